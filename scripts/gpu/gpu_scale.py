"""Scale-out figures for a machine with cores to spare (``scripts/gpu-check --scale``).

Two parts. Each prints the one-process column from the same run, with CPU per request beside
every figure:

- ``workers``: ``tests/fs/bench_workers.py``'s jobs with 1 and N FUSE workers (default 4, 8
  and 16). They run over RAM, over the libfuse peer in C, and over the fake NVMe/TCP target
  (a process per connection).
- ``companion``: companion reads of 1 MiB at QD16 into the GPU, over NVMe/TCP, from 1 and from
  P processes (default 4), each on queues of its own. Without CUDA (or with ``--into host``)
  the reads go into host memory (``nvmeof_fuse.empty``).

The figures' goals are reported as met or missed, never failed: they are measurements.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "tests" / "tcp_target.py"  # the fake target: says its port, then serves
MOUNT = [sys.executable, "-m", "nvmeof_fuse.cli", "mount"]
NQN = "nqn.2026-11.io.nvmeof-fuse:fake-tcp"  # tests/tcp_target.py's
MIB = 1 << 20
CHUNK = MIB
INFLIGHT = 16
READY_TIMEOUT = 120.0  # s for a client to open its file (imports, CUDA, its queues)
TARGET_TIMEOUT = 60.0  # s for the fake target to say its port
MOUNT_TIMEOUT = 90.0  # s for the mount and its daemon
FOUR_K_GOAL = (8, 5.0)  # 8 workers at least 5x one worker at 4 KiB
FUSE_GBPS_GOAL = 4.0  # the FUSE file at 1 MiB over the fake target, GB/s
COMPANION_GOAL = (4, 3.0)  # 4 companion processes at least 3x one


def _bench_workers():
    """``tests/fs/bench_workers.py`` as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location(
        "bench_workers", REPO / "tests" / "fs" / "bench_workers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workers_part(counts: list[int], backends: list[str], seconds: float, rounds: int) -> None:
    bench = _bench_workers()
    counts = sorted({1, *counts})
    print(f"\nFUSE workers: {', '.join(map(str, counts))} serving processes, the bench's jobs "
          f"(numjobs = workers), {rounds} round(s) of {seconds:g} s, medians", flush=True)
    results = bench.run(list(backends), counts, seconds, rounds, 32, None)
    print(bench.table(results, backends, counts, 32))
    print(bench.split_table(results))

    def rate(backend: str, key: str, jobs: int, workers: int) -> float | None:
        runs = results.get((backend, key, jobs, workers))
        return statistics.median(r[0] for r in runs) if runs else None

    many, goal = FOUR_K_GOAL
    for backend in backends:
        one, more = rate(backend, "4k-randread-qd32", many, 1), rate(
            backend, "4k-randread-qd32", many, many)
        if one and more:
            print(f"  {backend}: {many} workers / 1 at 4 KiB: {more / one:.2f}x "
                  f"(goal {goal:g}x: {'met' if more >= goal * one else 'missed'})")
    if "tcp" in backends:
        best = max((rate("tcp", "1m-read-qd8", n, n) or 0.0) for n in counts)
        verdict = "met" if best >= FUSE_GBPS_GOAL * 1e9 else "missed"
        print(f"  tcp: the FUSE file at 1 MiB, best of the worker counts: {best / 1e9:.2f} "
              f"GB/s (goal {FUSE_GBPS_GOAL:g} GB/s: {verdict})")


# --- the companion part -----------------------------------------------------------------------


class MountFailed(RuntimeError):
    """The fake target or its mount did not come up (the message is one line)."""


class TcpMount:
    """The fake target (a process per connection) mounted over NVMe/TCP by the real daemon.
    Where it cannot be mounted, MountFailed, with the target stopped and the folder removed."""

    def __init__(self, size_mib: int) -> None:
        from nvmeof_fuse.procstat import cpu_seconds  # noqa: F401 - fail early without the package

        self.dir = Path(tempfile.mkdtemp(prefix="nvmeof-gpu-scale."))
        self.mnt = self.dir / "mnt"
        self.target: subprocess.Popen | None = None
        try:
            self.mnt.mkdir()
            self.target = subprocess.Popen([sys.executable, str(TARGET), str(size_mib)],
                                           stdout=subprocess.PIPE)
            said = _read_until(self.target, time.monotonic() + TARGET_TIMEOUT, b"\n")
            port = said.decode(errors="replace").strip()
            if not said.endswith(b"\n") or not port.isdigit():
                raise MountFailed(f"the fake target did not say its port within "
                                  f"{TARGET_TIMEOUT:g} s (it said {port[:80]!r})")
            try:
                run = subprocess.run([*MOUNT, "-t", "tcp", "-a", "127.0.0.1", "-s", port, "-n",
                                      NQN, "--daemon", "--log-file", str(self.dir / "daemon.log"),
                                      str(self.mnt)], capture_output=True, text=True,
                                     timeout=MOUNT_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise MountFailed(f"nvmeof-fuse mount did not finish within {MOUNT_TIMEOUT:g} s "
                                  "over the fake target") from None
            if run.returncode:
                last = (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]
                raise MountFailed(f"nvmeof-fuse mount over the fake target failed: {last}")
        except BaseException:
            self.close()
            raise
        self.path = str(self.mnt / "n1")

    def daemon_pid(self) -> int:
        return json.loads((self.mnt / ".nvmeof" / "companion.json").read_text())["pid"]

    def close(self) -> None:
        """Unmount (where mounted), stop the target, and remove the folder once unmounted."""
        try:
            subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True,
                           timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass  # no fusermount3, or it hung: a mount still there keeps the folder (below)
        if self.target is not None:
            self.target.terminate()
            try:
                self.target.wait(30)
            except subprocess.TimeoutExpired:
                self.target.kill()
                self.target.wait(30)
            self.target.stdout.close()
        if not os.path.ismount(self.mnt):  # never remove through a live mount
            shutil.rmtree(self.dir, ignore_errors=True)


def client(path: str, index: int, seconds: float, into: str) -> dict:
    """One client process's share: once warm it says ``ready`` and waits for a line on stdin,
    then reads CHUNK at INFLIGHT for ``seconds``."""
    import nvmeof_fuse
    from nvmeof_fuse.procstat import cpu_seconds

    f = nvmeof_fuse.File(path)
    try:
        if into == "gpu":
            import torch

            buf = torch.empty(INFLIGHT * CHUNK, dtype=torch.uint8, device="cuda")
        else:
            buf = nvmeof_fuse.empty(INFLIGHT * CHUNK)
        span = os.path.getsize(path) // CHUNK
        base = index * span // 7  # the processes start apart in the namespace
        for k in range(INFLIGHT):  # warm: registrations, queues, the first transfers
            f.pread(buf[k * CHUNK:(k + 1) * CHUNK], CHUNK, file_offset=k * CHUNK).get(60)
        print("ready", flush=True)
        sys.stdin.readline()
        cpu0, began, n = cpu_seconds(os.getpid()), time.perf_counter(), 0
        until = began + seconds
        pending, free, moved = [], list(range(INFLIGHT)), 0
        while time.perf_counter() < until or pending:
            while free and time.perf_counter() < until:
                k = free.pop()
                offset = (base + n) % span * CHUNK
                n += 1
                pending.append((k, f.pread(buf[k * CHUNK:(k + 1) * CHUNK], CHUNK,
                                           file_offset=offset)))
            k, future = pending.pop(0)
            moved += future.get(60)
            free.append(k)
        return {"bytes": moved, "requests": n, "seconds": time.perf_counter() - began,
                "cpu": cpu_seconds(os.getpid()) - cpu0, "placement": f.placement}
    finally:
        f.close()


def _read_until(proc: subprocess.Popen, deadline: float, marker: bytes) -> bytes:
    """What ``proc`` wrote to its stdout (unbuffered on our side) until it wrote ``marker``,
    it ended, or ``deadline`` (``time.monotonic``) passed."""
    said = b""
    while marker not in said and (left := deadline - time.monotonic()) > 0:
        if not select.select([proc.stdout], [], [], left)[0]:
            break
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break  # it ended
        said += chunk
    return said


def _ready(proc: subprocess.Popen, deadline: float) -> bool:
    """Whether ``proc`` said ``ready`` before ``deadline`` (``time.monotonic``)."""
    return b"ready\n" in _read_until(proc, deadline, b"ready\n")


def _clients(mount: TcpMount, processes: int, seconds: float, into: str) -> dict:
    from nvmeof_fuse.procstat import cpu_seconds

    procs = [subprocess.Popen([sys.executable, __file__, "--client", mount.path, str(i),
                               str(seconds), into],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
             for i in range(processes)]
    try:
        for proc in procs:  # each opened its file and moved its first chunks
            if not _ready(proc, time.monotonic() + READY_TIMEOUT):
                raise RuntimeError(f"a client process was not ready within {READY_TIMEOUT:g} s")
        daemon, target = mount.daemon_pid(), mount.target.pid
        d0, t0 = cpu_seconds(daemon), cpu_seconds(target, with_children=True)
        for proc in procs:
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        shares = []
        for proc in procs:
            out, _ = proc.communicate(timeout=seconds + 120)
            if proc.returncode:
                raise RuntimeError(f"a client process failed (exit {proc.returncode})")
            shares.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    took = max(s["seconds"] for s in shares)
    requests = max(1, sum(s["requests"] for s in shares))
    return {"gbps": sum(s["bytes"] for s in shares) / took / 1e9,
            "clients_us": sum(s["cpu"] for s in shares) / requests * 1e6,
            "daemon_us": (cpu_seconds(daemon) - d0) / requests * 1e6,
            "target_us": (cpu_seconds(target, with_children=True) - t0) / requests * 1e6,
            "placement": shares[0]["placement"]}


def companion_part(processes: int, seconds: float, rounds: int, into: str,
                   size_mib: int) -> bool:
    """The companion part; False, saying why in one line, where the fake target cannot be
    mounted."""
    try:
        mount = TcpMount(size_mib)
    except MountFailed as exc:
        print(f"gpu-check --scale: companion part: {exc}", file=sys.stderr, flush=True)
        return False
    try:
        print(f"\ncompanion reads into {into} over NVMe/TCP, 1 MiB QD{INFLIGHT} per process, "
              f"1 against {processes} processes, {rounds} round(s) of {seconds:g} s, medians; "
              "CPU per request of the clients, the daemon and the target", flush=True)
        figures: dict[int, list[dict]] = {1: [], processes: []}
        for _ in range(rounds):
            for count in figures:
                figures[count].append(_clients(mount, count, seconds, into))
        print(f"  placement: {figures[1][0]['placement']}")
        med = {}
        for count, runs in figures.items():
            fig = {key: statistics.median(r[key] for r in runs)
                   for key in ("gbps", "clients_us", "daemon_us", "target_us")}
            med[count] = fig["gbps"]
            print(f"  {count:2} process(es): {fig['gbps']:6.2f} GB/s  clients "
                  f"{fig['clients_us']:.1f} us  daemon {fig['daemon_us']:.1f} us  target "
                  f"{fig['target_us']:.1f} us per request")
        ratio = med[processes] / med[1] if med[1] else 0.0
        many, goal = COMPANION_GOAL
        verdict = ("met" if ratio >= goal else "missed") if processes == many else "n/a"
        print(f"  {processes} processes / 1: {ratio:.2f}x (goal {goal:g}x from {many}: {verdict})")
    finally:
        mount.close()
    return True


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client"]:
        path, index, seconds, into = argv[1:5]
        print(json.dumps(client(path, int(index), float(seconds), into)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="workers,companion", help="workers, companion")
    ap.add_argument("--workers", default="4,8,16", help="worker counts (1 always runs)")
    ap.add_argument("--backends", default="ram,libfuse,tcp", help="of the workers part")
    ap.add_argument("--processes", type=int, default=4, help="companion processes against 1")
    ap.add_argument("--into", choices=("auto", "gpu", "host"), default="auto")
    ap.add_argument("--seconds", type=float, default=3.0, help="per job")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--size-mib", type=int, default=1024, help="the companion part's namespace")
    args = ap.parse_args(argv)
    into = args.into if args.into != "auto" else ("gpu" if _cuda() else "host")
    if into == "gpu" and not _cuda():
        print("gpu-check --scale: --into gpu, but torch sees no CUDA device", file=sys.stderr)
        return 2
    parts = {p for p in args.parts.split(",") if p}
    print(f"nvmeof-fuse gpu-check --scale: {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    if "workers" in parts:
        workers_part([int(n) for n in args.workers.split(",") if n],
                     [b for b in args.backends.split(",") if b], args.seconds, args.rounds)
    ok = True
    if "companion" in parts:
        ok = companion_part(args.processes, args.seconds, args.rounds, into, args.size_mib)
    print(f"load {os.getloadavg()[0]:.2f} after")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
