"""The checks behind scripts/gpu-check: the companion API's CUDA path on a machine with a GPU.

A fake NVMe/TCP target (tests/tcp_target.py, a process per connection) on
loopback is mounted through the real daemon and FUSE.  Then, each from threads
that never touched CUDA: the CUDA driver calls in the memory's own context;
what ``File.placement`` says; CUDA tensors read and written byte-exactly at
unaligned offsets and sizes (futures in flight, ``stream=``, a second GPU when
there is one); the daemon's counters (no errors).  Last, GB/s into the GPU
through the companion API beside the FUSE file read into host memory and the
user's own loop (O_DIRECT reads into pinned memory, each copied to the GPU),
measured in turns in the same run.

One line per check and a summary; exit 1 if any check failed.  The figures'
goals are reported as met or missed, never failed (they are measurements).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import itertools
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NQN = "nqn.2026-11.io.nvmeof-fuse:fake-tcp"  # tests/tcp_target.py's
MIB = 1 << 20
RESULTS: list[tuple[str, str, str]] = []  # (check, PASS/FAIL/SKIP, detail)


class Skip(Exception):
    pass


def check(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def wrap(fn: Callable[[], str]) -> Callable[[], str]:
        started = time.perf_counter()
        try:
            RESULTS.append((name, "PASS", fn() or ""))
        except Skip as exc:
            RESULTS.append((name, "SKIP", str(exc)))
        except Exception as exc:  # noqa: BLE001 - every failure is one line of the summary
            detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            RESULTS.append((name, "FAIL", detail))
            if os.environ.get("GPU_CHECK_DEBUG"):
                traceback.print_exc()
        print(f"  {RESULTS[-1][1]:4}  {name} ({time.perf_counter() - started:.1f} s)",
              flush=True)
        return fn
    return wrap


def fresh(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a new thread that never touched CUDA: its result."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result(120)


def torch_cuda():
    try:
        import torch
    except ImportError as exc:
        raise Skip(f"torch is not importable ({exc})") from None
    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    return torch


class Mounted:
    """The fake target in a process of its own, mounted with the real daemon (over FUSE)."""

    def __init__(self, size_mib: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="nvmeof-gpu-check."))
        self.mnt = self.dir / "mnt"
        self.mnt.mkdir()
        self.log = self.dir / "daemon.log"
        self.target = subprocess.Popen([sys.executable, str(REPO / "tests" / "tcp_target.py"),
                                        str(size_mib)], stdout=subprocess.PIPE, text=True)
        line = self.target.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(f"the fake target did not start ({line!r})")
        self.port = int(line)
        subprocess.run([sys.executable, "-m", "nvmeof_fuse.cli", "mount", "-t", "tcp", "-a",
                        "127.0.0.1", "-s", str(self.port), "-n", NQN, "-i", "4", "--daemon",
                        "--log-file", str(self.log), str(self.mnt)],
                       check=True, timeout=60)
        self.path = str(self.mnt / "n1")

    def stats(self) -> dict:
        return json.loads((self.mnt / ".nvmeof" / "stats.json").read_text())

    def daemon_pid(self) -> int:
        return json.loads((self.mnt / ".nvmeof" / "companion.json").read_text())["pid"]

    def close(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], timeout=30, check=False)
        self.target.terminate()
        self.target.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def aligned(nbytes: int) -> mmap.mmap:
    """Page-aligned host memory (O_DIRECT wants it)."""
    return mmap.mmap(-1, nbytes)


def fuse_read(path: str, offset: int, nbytes: int) -> bytes:
    """The namespace's bytes through the FUSE file, past the page cache."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        start = offset - offset % 4096
        span = -(-(offset + nbytes - start) // 4096) * 4096
        buf = aligned(span)
        assert os.preadv(fd, [buf], start) == span
        return bytes(buf[offset - start:offset - start + nbytes])
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="the namespace (MiB)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per bench slice")
    parser.add_argument("--rounds", type=int, default=3, help="slices of each bench job")
    args = parser.parse_args()
    print("nvmeof-fuse gpu-check", flush=True)
    state: dict = {}

    @check("libcuda and the device")
    def _device() -> str:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise Skip(f"libcuda.so.1 not found ({exc})") from None
        assert lib.cuInit(0) == 0, "cuInit failed"
        count, version = ctypes.c_int(), ctypes.c_int()
        assert lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0, "no device"
        lib.cuDriverGetVersion(ctypes.byref(version))
        from nvmeof_fuse.companion.cuda import gpu

        names = []
        for ordinal in range(count.value):
            dev = ctypes.c_int()
            lib.cuDeviceGet(ctypes.byref(dev), ordinal)
            name = ctypes.create_string_buffer(128)
            lib.cuDeviceGetName(name, 128, dev)
            names.append(f"{name.value.decode()} (dma-buf: "
                         f"{gpu.ops().dmabuf_supported(ordinal)})")
        state["devices"] = count.value
        return f"driver {version.value}, {count.value} device(s): {'; '.join(names)}"

    @check("PCIe topology: the GPUs, the RDMA devices, and the one nearest each GPU")
    def _topology() -> str:
        from nvmeof_fuse.companion.cuda import gpu
        from nvmeof_fuse.host.topology.report import report
        from nvmeof_fuse.host.topology.sysfs import Topology

        try:
            found = [gpu.ops().pci_bus_id(d) for d in range(state.get("devices", 0))]
        except Exception as exc:  # noqa: BLE001 - then the GPUs sysfs shows
            print(f"        (the CUDA driver's PCI addresses: {exc})")
            found = None
        lines = report(Topology(), found or None)
        for line in lines:
            print(f"        {line}", flush=True)
        return lines[0]

    @check("driver calls on a thread that never touched CUDA, in the memory's context")
    def _seam() -> str:
        torch = torch_cuda()
        from nvmeof_fuse.companion.cuda import gpu

        t = torch.empty(3 * MIB + 5, dtype=torch.uint8, device="cuda")  # context: this thread

        def elsewhere() -> str:
            cuda = gpu.ops()
            mem = cuda.memory(t)
            started = time.perf_counter()
            fd = cuda.export_dmabuf(mem, mem.base, -(-mem.size // gpu.PAGE) * gpu.PAGE)
            took = time.perf_counter() - started
            target = os.readlink(f"/proc/self/fd/{fd}")
            os.close(fd)
            cuda.synchronize(mem)
            cuda.flush_gpudirect_writes(mem)
            assert "dmabuf" in target, f"fd points at {target!r}, not a dma-buf"
            return (f"allocation {mem.size} B around the tensor exported ({target}, "
                    f"{took * 1e6:.0f} us); synchronize and flush on device {mem.device}")

        return fresh(elsewhere)

    @check("dma-buf export with expandable segments (VMM memory, no context of its own)")
    def _vmm() -> str:
        torch_cuda()
        code = ("import os, torch, concurrent.futures as cf\n"
                "from nvmeof_fuse.companion.cuda import gpu\n"
                "t = torch.empty(5 << 20, dtype=torch.uint8, device='cuda')\n"
                "def go():\n"
                "    c = gpu.ops(); m = c.memory(t)\n"
                "    b, o, n = gpu.page_span(m.ptr, m.nbytes)\n"
                "    try:\n"
                "        fd = c.export_dmabuf(m, m.base, m.size); whole = 'whole allocation'\n"
                "    except gpu.CudaError:\n"
                "        fd = c.export_dmabuf(m, b, n); whole = 'the tensor span only'\n"
                "    os.close(fd)\n"
                "    return f'context {m.context:#x}, {whole} exported'\n"
                "print(cf.ThreadPoolExecutor(1).submit(go).result())\n")
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, (out.stderr.strip().splitlines() or ["?"])[-1]
        return out.stdout.strip()

    try:
        state["mount"] = Mounted(args.size_mib)
    except Exception as exc:  # noqa: BLE001
        RESULTS.append(("mount the fake NVMe/TCP target through the daemon and FUSE", "FAIL",
                        f"{type(exc).__name__}: {exc}"[:300]))
        return summary()
    mounted: Mounted = state["mount"]
    try:
        run_checks(mounted, state)
        run_bench(mounted, args)
    finally:
        mounted.close()
    return summary()


def run_checks(mounted: Mounted, state: dict) -> None:
    path = mounted.path

    @check("File.placement over NVMe/TCP explains itself")
    def _placement() -> str:
        import nvmeof_fuse

        with nvmeof_fuse.File(path, near=0) as f:  # its lease says where GPU 0 is
            placement, own = f.placement, f.own_queues
        with nvmeof_fuse.File(path, queues=0) as f:
            via_daemon = f.placement
        assert own, "no NVMe/TCP queues of its own"
        assert placement["cuda"].startswith("staged: by this process over its own queues "
                                            "(NVMe/TCP receives data into host memory")
        assert via_daemon["cuda"].startswith("staged: NVMe/TCP receives data into host memory")
        return (f"cuda: {placement['cuda'][:60]}...; shared: {placement['shared']}; "
                f"path: {placement.get('path', 'one path, no choice')}")

    @check("CUDA tensors from fresh threads: unaligned reads and writes, byte-exact")
    def _data() -> str:
        torch = torch_cuda()
        import numpy as np

        import nvmeof_fuse

        region = 64 * MIB
        pattern = np.frombuffer(os.urandom(region), np.uint8)
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        try:
            buf = aligned(region)
            buf[:] = pattern.tobytes()
            assert os.pwritev(fd, [buf], 0) == region
        finally:
            os.close(fd)
        t = torch.zeros(region, dtype=torch.uint8, device="cuda")
        cases = [(1, 1), (511, 3), (4097, 4095), (MIB + 3, 12_345), (9 * MIB + 7, 777_777),
                 (16 * MIB, 16 * MIB)]
        with nvmeof_fuse.File(path) as f:
            def reads() -> None:
                for n, offset in cases:
                    t.zero_()
                    assert f.read(t, n, file_offset=offset, buf_offset=13) == n
                    got = t[13:13 + n].cpu().numpy()
                    assert np.array_equal(got, pattern[offset:offset + n]), f"read {n}@{offset}"
                futures = [f.pread(t, MIB, file_offset=i * MIB + 1, buf_offset=i * MIB)
                           for i in range(16)]
                assert [fut.get(60) for fut in futures] == [MIB] * 16
                expected = np.concatenate([pattern[i * MIB + 1:(i + 1) * MIB + 1]
                                           for i in range(16)])
                assert np.array_equal(t[:16 * MIB].cpu().numpy(), expected), "16 futures"

            fresh(reads)
            src = torch.randint(0, 256, (region,), dtype=torch.uint8, device="cuda")

            def writes() -> None:
                for n, offset in cases:
                    assert f.write(src, n, file_offset=offset + 32 * MIB, buf_offset=7) == n
                    back = fuse_read(path, offset + 32 * MIB, n)
                    assert back == src[7:7 + n].cpu().numpy().tobytes(), f"write {n}@{offset}"
                futures = [f.pwrite(src, MIB, file_offset=i * MIB + 5, buf_offset=i * MIB)
                           for i in range(16)]
                assert [fut.get(60) for fut in futures] == [MIB] * 16
                assert fuse_read(path, 5, 16 * MIB) == src[:16 * MIB].cpu().numpy().tobytes()

            fresh(writes)
        return f"{len(cases)} sizes each way (1 B to 16 MiB), and 16 futures of 1 MiB each way"

    @check("stream=: copies ordered on the caller's torch stream")
    def _stream() -> str:
        torch = torch_cuda()

        import nvmeof_fuse

        side = torch.cuda.Stream()
        t = torch.empty(8 * MIB + 3, dtype=torch.uint8, device="cuda")
        with nvmeof_fuse.File(path) as f:
            def go() -> None:
                with torch.cuda.stream(side):
                    t.fill_(0xAB)  # queued on the side stream: the write must see it
                assert f.write(t, file_offset=100 * MIB + 1, stream=side) == t.numel()
                u = torch.empty_like(t)
                assert f.read(u, file_offset=100 * MIB + 1, stream=side) == t.numel()
                side.synchronize()
                assert bool((u == 0xAB).all()), "the write did not wait for the fill"

            fresh(go)
        return "write after a fill queued on the same stream, read back on it"

    @check("a tensor on a second GPU, from a fresh thread")
    def _second() -> str:
        torch = torch_cuda()
        if state.get("devices", 1) < 2:
            raise Skip("one GPU here")
        import nvmeof_fuse

        t = torch.zeros(3 * MIB + 1, dtype=torch.uint8, device="cuda:1")
        with nvmeof_fuse.File(path) as f:
            assert fresh(f.read, t, file_offset=17) == t.numel()
        assert t.cpu().numpy().tobytes() == fuse_read(path, 17, t.numel())
        return "cuda:1 read byte-exactly"

    @check("the daemon's counters: no companion errors")
    def _counters() -> str:
        companion = mounted.stats()["companion"]
        assert companion["errors"] == 0, f"{companion['errors']} companion errors"
        assert companion["dmabuf_refused"] == 0, "the client asked for what TCP cannot do"
        return (f"requests {companion['requests']}, errors 0, dma-buf refused 0; on the "
                f"clients' own queues {companion['client_queue_read_bytes'] >> 20} MiB read, "
                f"{companion['client_queue_write_bytes'] >> 20} MiB written; staged by the "
                f"daemon {companion['staged_read_bytes'] >> 20} MiB read, "
                f"{companion['staged_write_bytes'] >> 20} MiB written")


def run_bench(mounted: Mounted, args: argparse.Namespace) -> None:
    """GB/s of each way into memory, in turns (``args.rounds`` slices each), medians."""
    try:
        torch = torch_cuda()
    except Skip as exc:
        RESULTS.append(("bench", "SKIP", str(exc)))
        return
    import nvmeof_fuse
    from nvmeof_fuse.procstat import cpu_seconds

    path, size = mounted.path, args.size_mib * MIB
    depth, gpu_buf = 16, torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    f = nvmeof_fuse.File(path)

    pids = {"target": mounted.target.pid, "daemon": mounted.daemon_pid(), "client": os.getpid()}
    busy: dict[str, dict[str, list[float]]] = {}

    def timed(name: str, run: Callable[[float], int]) -> float:
        cpu = {who: cpu_seconds(pid, with_children=who == "target") for who, pid in pids.items()}
        started = time.perf_counter()
        moved = run(started + args.seconds)
        took = time.perf_counter() - started
        for who, pid in pids.items():  # share of one core each process kept busy
            busy.setdefault(name, {}).setdefault(who, []).append(
                (cpu_seconds(pid, with_children=who == "target") - cpu[who]) / took)
        return moved / took / 1e9

    def offsets(chunk: int) -> Callable[[], int]:
        """Successive offsets of ``chunk`` bytes over the namespace; any thread may call."""
        counter = itertools.count()  # next() of a count is atomic
        return lambda: next(counter) * chunk % (size - size % chunk)

    def fuse_host_qd16(until: float) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        where = offsets(MIB)

        def worker() -> int:
            buf, moved = aligned(MIB), 0
            while time.perf_counter() < until:
                moved += os.preadv(fd, [buf], where())
            return moved

        try:
            with concurrent.futures.ThreadPoolExecutor(depth) as pool:
                return sum(pool.map(lambda _: worker(), range(depth)))
        finally:
            os.close(fd)

    def pinned_loop(threads: int) -> Callable[[float], int]:
        def run(until: float) -> int:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            where = offsets(MIB)

            def worker(k: int) -> int:
                pinned = torch.empty(MIB, dtype=torch.uint8, pin_memory=True)
                view, moved = memoryview(pinned.numpy()), 0
                dst = gpu_buf[k * MIB:(k + 1) * MIB]
                while time.perf_counter() < until:
                    moved += os.preadv(fd, [view], where())
                    dst.copy_(pinned)
                return moved

            try:
                with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                    return sum(pool.map(worker, range(threads)))
            finally:
                os.close(fd)
        return run

    def companion(chunk: int, inflight: int, into: str) -> Callable[[float], int]:
        buf = gpu_buf if into == "gpu" else nvmeof_fuse.empty(64 * MIB)

        def run(until: float) -> int:
            def go() -> int:
                where, pending, moved = offsets(chunk), [], 0
                slots = list(range(inflight))
                while time.perf_counter() < until or pending:
                    while slots and time.perf_counter() < until:
                        k = slots.pop()
                        pending.append((k, f.pread(buf[k * chunk:(k + 1) * chunk], chunk,
                                                   file_offset=where())))
                    k, fut = pending.pop(0)
                    moved += fut.get(60)
                    slots.append(k)
                return moved

            return fresh(go)
        return run

    jobs = {
        "FUSE file -> host, 1 MiB QD16 (16 threads, O_DIRECT)": fuse_host_qd16,
        "user's loop: O_DIRECT 1 MiB -> pinned -> GPU, 1 thread": pinned_loop(1),
        "user's loop: O_DIRECT 1 MiB -> pinned -> GPU, 16 threads": pinned_loop(16),
        "companion -> GPU, 1 MiB QD16 (16 futures)": companion(MIB, 16, "gpu"),
        "companion -> GPU, 16 MiB QD1": companion(16 * MIB, 1, "gpu"),
        "companion -> GPU, 16 MiB QD4": companion(16 * MIB, 4, "gpu"),
        "companion -> host (nvmeof_fuse.empty), 1 MiB QD16": companion(MIB, 16, "host"),
    }
    figures: dict[str, list[float]] = {name: [] for name in jobs}
    try:
        for run in jobs.values():  # a warm-up slice each
            run(time.perf_counter() + 0.3)
        for _ in range(args.rounds):
            for name, run in jobs.items():
                figures[name].append(timed(name, run))
    finally:
        f.close()
    print(f"\nGB/s into memory from the same fake NVMe/TCP target, {args.rounds} slices of "
          f"{args.seconds:g} s each in turns (median; min-max), and the cores the target, "
          f"the daemon and this process kept busy:")
    width = max(len(name) for name in figures)
    for name, values in figures.items():
        cores = "  ".join(f"{who} {statistics.median(shares):4.2f}"
                          for who, shares in busy[name].items())
        print(f"  {name.ljust(width)}  {statistics.median(values):6.2f}  "
              f"({min(values):.2f}-{max(values):.2f})  {cores}")
    med = {name: statistics.median(values) for name, values in figures.items()}
    names = list(figures)
    fuse, loop1, loop16, qd16 = med[names[0]], med[names[1]], med[names[2]], med[names[3]]
    big = max(med[names[4]], med[names[5]])
    print(f"  companion 1 MiB QD16 / FUSE file QD16: {qd16 / fuse:.2f}x (goal 0.9x: "
          f"{'met' if qd16 >= 0.9 * fuse else 'missed'})")
    print(f"  companion 1 MiB QD16 / user's loop, 1 thread: {qd16 / loop1:.2f}x (goal 1.0x: "
          f"{'met' if qd16 >= loop1 else 'missed'}); 16 threads: {qd16 / loop16:.2f}x")
    print(f"  companion 16 MiB (best of QD1, QD4) / FUSE file QD16: {big / fuse:.2f}x")
    stats = mounted.stats()["companion"]
    print(f"  daemon: companion errors {stats['errors']}, dma-buf refused "
          f"{stats['dmabuf_refused']}")


def summary() -> int:
    counts = {v: sum(1 for _, x, _ in RESULTS if x == v) for v in ("PASS", "FAIL", "SKIP")}
    width = max(len(name) for name, _, _ in RESULTS)
    print()
    for name, verdict, detail in RESULTS:
        print(f"  {verdict:4}  {name.ljust(width)}  {detail}")
    print(f"summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
