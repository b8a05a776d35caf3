"""FUSE workers on the host: one serving process against N, over RAM and over the fake target.

  .venv/bin/python tests/fs/bench_workers.py [--seconds 5] [--rounds 1] [--workers 1,2,4]
                                             [--backends ram,libfuse,tcp] [--iodepth 32]
                                             [--target nvme+rdma://ADDR:PORT/NQN/NSID]
                                             [--loadgen fio|loadgen]    (root, /dev/fuse)

Over RAM, ``scripts/benches/bench.py fuse-ram --workers N`` serves a memfd every process maps
(the FUSE layer alone); beside it the peer, ``peer_fuse_ram.c``: the same RAM file served by
libfuse in C with N threads on cloned descriptors (what more serving threads buy on this host
when the server is native code; ``peer_fuse_ram`` from PATH, else built with gcc at run time,
left out where it cannot be); over the fake target, ``nvmeof-fuse mount --workers N`` serves
``tests/tcp_target.py`` on 127.0.0.1 (a process per connection, on the same cores); with
``--target``, a real target instead (the testbed's, in the VM: part "workers" of
``scripts/bench``), the backend named by its transport. The load generator is fio where it is
on PATH, else ``loadgen`` (``loadgen.c``: fio's libaio engine as a small static C program) from
PATH or built with gcc; ``--loadgen`` forces one (it only reads: the write and mixed jobs, 4
KiB randwrite and 70/30 randrw at the 4 KiB job's depth, run with fio only). Each job runs with
``numjobs`` = N on one worker and on N workers, mounts alternating round by round; printed are
the medians, the serving processes' CPU per request (the main process and its workers, not the
load generator, not the target), the whole host's, the share of the host's CPUs busy, and N
over one. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

from nvmeof_fuse.procstat import machine_cpu, process_tree, processes_cpu

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "benches" / "bench.py"
TARGET = ROOT / "tests" / "tcp_target.py"
PEER = Path(__file__).with_name("peer_fuse_ram.c")
LOADGEN = Path(__file__).with_name("loadgen.c")
NQN = "nqn.2026-11.io.nvmeof-fuse:fake-tcp"
READY_TIMEOUT = 90.0  # s for a mount and its workers (imports included, a loaded host)
RAM_MIB = 256
TCP_MIB = 256


def load_jobs(iodepth: int) -> tuple[tuple[str, str, str, str, int], ...]:
    """(key, title, rw, bs, iodepth) of the jobs (``randrw70``: fio's randrw, 70% reads)."""
    return ((f"4k-randread-qd{iodepth}", f"4 KiB randread QD{iodepth}", "randread", "4k",
             iodepth), ("1m-read-qd8", "1 MiB read QD8", "read", "1m", 8),
            (f"4k-randwrite-qd{iodepth}", f"4 KiB randwrite QD{iodepth}", "randwrite", "4k",
             iodepth),
            (f"4k-randrw70-qd{iodepth}", f"4 KiB 70/30 randrw QD{iodepth}", "randrw70", "4k",
             iodepth))


READS = ("randread", "read")
"""The jobs loadgen runs (it only reads): the others run with fio only."""


def _host_busy() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole host since boot, from /proc/stat."""
    kinds = machine_cpu()
    total = sum(kinds.values())
    return total - kinds["idle"] - kinds["iowait"], total


def _is_mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {READY_TIMEOUT:g} s")
        time.sleep(0.1)


class Server:
    """One mount with ``workers`` serving processes, until :meth:`stop`."""

    def __init__(self, backend: str, workers: int, mnt: str, source: str | None,
                 log: str) -> None:
        self.mnt, self.workers = mnt, workers
        out = open(log, "w")  # noqa: SIM115 - the child's, closed in stop()
        self._out = out
        if backend == "ram":
            cmd = [sys.executable, str(BENCH), "fuse-ram", mnt, "--size-mib", str(RAM_MIB),
                   "--workers", str(workers)]
        elif backend == "libfuse":  # source: the peer's binary; its threads are the workers
            cmd = [str(source), mnt, str(RAM_MIB), str(workers)]
        else:
            cmd = [sys.executable, "-m", "nvmeof_fuse.cli", "mount", "-k", "0", "--workers",
                   str(workers), str(source), mnt]
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        _wait(lambda: _is_mounted(mnt) or self.proc.poll() is not None, "the mount")
        if self.proc.poll() is not None:
            raise RuntimeError(f"the mount failed: {Path(log).read_text()[-300:]}")
        if backend != "libfuse":
            _wait(lambda: len(process_tree(self.proc.pid)) >= workers, "the workers")
        if backend not in ("ram", "libfuse") and workers > 1:
            _wait(lambda: Path(log).read_text().count(" serves on queues ") >= workers - 1,
                  "the workers' queues")

    def cpu(self) -> float:
        return processes_cpu(process_tree(self.proc.pid))

    def to_main(self) -> tuple[int, ...]:
        """(requests the main process read, requests its workers read, messages those sent
        it because of a request, the main process's waits for requests, the workers'), from
        ``stats.json`` (workers report each second); zeros for a server without them."""
        try:
            doc = json.loads(Path(self.mnt, ".nvmeof", "stats.json").read_bytes())
        except (OSError, ValueError):
            return 0, 0, 0, 0, 0
        procs = doc.get("workers") or [(doc.get("serving") or {}).get("main") or {}]
        sent = sum(w.get("to_main", {}).get(kind, 0) for w in procs[1:]
                   for kind in ("meta", "read", "write"))
        return (procs[0].get("requests", 0), sum(w.get("requests", 0) for w in procs[1:]),
                sent, procs[0].get("parks", 0), sum(w.get("parks", 0) for w in procs[1:]))

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", self.mnt], check=False, timeout=60)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(60)
        self._out.close()


class Generator(NamedTuple):
    """The load generator: ``name`` (fio or loadgen) and its binary."""

    name: str
    binary: str


def _build(source: Path, work: str, flags: list[str]) -> str:
    binary = os.path.join(work, source.stem)
    subprocess.run(["gcc", "-O2", "-o", binary, str(source), *flags], check=True,
                   capture_output=True, text=True, timeout=120)
    return binary


def load_generator(forced: str | None, work: str) -> Generator:
    """fio where it is on PATH (unless ``forced`` is loadgen), else ``loadgen`` from PATH,
    else built from ``loadgen.c`` into ``work``; SystemExit with one line where none can run."""
    if forced != "loadgen" and (fio_binary := shutil.which("fio")):
        return Generator("fio", fio_binary)
    if forced == "fio":
        sys.exit("bench_workers: --loadgen fio, but there is no fio on PATH")
    if prebuilt := shutil.which("loadgen"):
        return Generator("loadgen", prebuilt)
    try:
        return Generator("loadgen", _build(LOADGEN, work, ["-pthread"]))
    except (OSError, subprocess.SubprocessError) as exc:
        sys.exit(f"bench_workers: no load generator: no fio or loadgen on PATH, and "
                 f"{LOADGEN.name} does not build ({exc})")


def _json_of(cmd: list[str], seconds: float) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
        raise RuntimeError(f"{Path(cmd[0]).name} failed: {last}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def read_load(gen: Generator, path: str, rw: str, bs: str, qd: int, jobs: int,
              seconds: float) -> tuple[float, int]:
    """``jobs`` readers (or writers, or both) of ``path``, ``qd`` each in flight, O_DIRECT
    through Linux AIO: bytes per second and requests done, over all jobs, reads and writes
    together."""
    if gen.name == "loadgen":
        got = _json_of([gen.binary, path, rw, bs, str(qd), str(jobs), str(seconds)], seconds)
        return got["bw_bytes"], got["total_ios"]
    mix = ["--rw=randrw", "--rwmixread=70"] if rw == "randrw70" else [f"--rw={rw}"]
    job = _json_of([gen.binary, "--output-format=json", f"--filename={path}",
                    "--ioengine=libaio", "--direct=1", f"--runtime={seconds}",
                    "--time_based", "--name=w", *mix, f"--bs={bs}",
                    f"--iodepth={qd}", f"--numjobs={jobs}", "--group_reporting"],
                   seconds)["jobs"][0]
    return (job["read"]["bw_bytes"] + job["write"]["bw_bytes"],
            job["read"]["total_ios"] + job["write"]["total_ios"])


def build_peer(work: str) -> str | None:
    """The libfuse peer: ``peer_fuse_ram`` from PATH, else built from ``peer_fuse_ram.c`` into
    ``work``; None, saying why, where gcc or libfuse3's headers are missing."""
    if prebuilt := shutil.which("peer_fuse_ram"):
        return prebuilt
    try:
        flags = subprocess.run(["pkg-config", "fuse3", "--cflags", "--libs"], check=True,
                               capture_output=True, text=True, timeout=60).stdout.split()
        return _build(PEER, work, flags)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"the libfuse peer is left out: cannot build it ({exc})", flush=True)
        return None


def start_target() -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(TARGET), str(TCP_MIB)],
                            stdout=subprocess.PIPE, text=True, env=env)
    got: dict = {}
    reader = threading.Thread(target=lambda: got.setdefault("port", proc.stdout.readline()))
    reader.start()
    reader.join(READY_TIMEOUT)
    if not got.get("port", "").strip().isdigit():
        proc.kill()
        raise RuntimeError("the fake target did not start")
    return proc, int(got["port"])


def run(backends: list[str], counts: list[int], seconds: float, rounds: int, iodepth: int,
        target_uri: str | None, gen: Generator | None = None) -> dict:
    """{(backend, job key, numjobs, workers): [(bytes/s, serving CPU us per request, host
    CPU us per request, host busy fraction), ...]}; without ``gen``, the load generator is
    chosen (:func:`load_generator`) and named in a line."""
    results: dict = {}
    split = results.setdefault("to_main", {})  # (backend, key, jobs, workers): [(main, ...)]
    target, source, nsid = None, target_uri, 1
    if target_uri:
        tail = target_uri.rstrip("/").rsplit("/", 1)[-1]
        nsid = int(tail) if tail.isdigit() else 1
    elif "tcp" in backends:
        target, port = start_target()
        source = f"nvme+tcp://127.0.0.1:{port}/{NQN}"
    work = tempfile.mkdtemp(prefix="nvmeof-fuse-bench-workers-")
    if gen is None:
        gen = load_generator(None, work)
        print(f"load generator: {gen.name} ({gen.binary})", flush=True)
    peer = build_peer(work) if "libfuse" in backends else None
    if "libfuse" in backends and peer is None:
        backends.remove("libfuse")
    try:
        for _ in range(rounds):
            for backend in backends:
                for workers in counts:
                    mnt = os.path.join(work, f"{backend}{workers}")
                    os.makedirs(mnt, exist_ok=True)
                    server = Server(backend, workers, mnt,
                                    peer if backend == "libfuse" else source,
                                    os.path.join(work, f"{backend}{workers}.log"))
                    try:
                        for key, _, rw, bs, qd in load_jobs(iodepth):
                            if gen.name == "loadgen" and rw not in READS:
                                continue
                            for numjobs in counts:
                                if workers not in (1, numjobs):
                                    continue
                                sent0 = server.to_main()
                                before, (busy0, all0) = server.cpu(), _host_busy()
                                rate, ios = read_load(gen, f"{mnt}/n{nsid}", rw, bs, qd,
                                                      numjobs, seconds)
                                cpu = server.cpu() - before
                                busy1, all1 = _host_busy()
                                if backend not in ("ram", "libfuse"):
                                    if workers > 1:
                                        time.sleep(1.5)  # the workers' reports after the job
                                    sent1 = server.to_main()
                                    split.setdefault((backend, key, numjobs, workers),
                                                     []).append(tuple(
                                        b - a for a, b in zip(sent0, sent1, strict=True)))
                                ios = max(ios, 1)
                                results.setdefault((backend, key, numjobs, workers), []).append(
                                    (rate, cpu / ios * 1e6, (busy1 - busy0) / ios * 1e6,
                                     (busy1 - busy0) / max(all1 - all0, 1e-9)))
                    finally:
                        server.stop()
    finally:
        if target is not None:
            target.kill()
            target.wait(60)
    return results


def table(results: dict, backends: list[str], counts: list[int], iodepth: int) -> str:
    lines = ["| over | job | numjobs | 1 worker | CPU/req | host CPU/req | host busy "
             "| N workers | CPU/req | host CPU/req | host busy | N / 1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for backend in backends:
        for key, title, _, bs, _ in load_jobs(iodepth):
            for jobs in counts:
                one = results.get((backend, key, jobs, 1))
                many = results.get((backend, key, jobs, jobs))
                if not one:
                    continue

                def fig(runs, bs=bs):
                    rate = statistics.median(r[0] for r in runs)
                    cpu, host, busy = (statistics.median(r[i] for r in runs) for i in (1, 2, 3))
                    shown = (f"{rate / 4096:,.0f} IOPS" if bs == "4k"
                             else f"{rate / 1e6:,.0f} MB/s")
                    return rate, (f"{shown} | {cpu:.1f} us | {host:.1f} us | "
                                  f"{busy * 100:.0f}%")

                r1, s1 = fig(one)
                if jobs == 1 or not many:
                    lines.append(f"| {backend} | {title} | {jobs} | {s1} | - | - | - | - | - |")
                    continue
                rn, sn = fig(many)
                lines.append(f"| {backend} | {title} | {jobs} | {s1} | {sn} ({jobs}) | "
                             f"{rn / r1:.2f}x |")
    return "\n".join(lines)


def split_table(results: dict) -> str:
    """How each job's requests split over the mount's processes, how many each took per
    wait, and what the workers sent the main process because of a request, per request
    they read (issue #60: READ and WRITE send nothing); empty without a mount over a
    target."""
    split = results.get("to_main") or {}
    if not split:
        return ""
    lines = ["| over | job | numjobs | workers | read by main | read by workers | requests "
             "per wait, main / workers | to main per request |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for (backend, key, jobs, workers), runs in sorted(split.items()):
        main_reqs, worker_reqs, sent, main_parks, worker_parks = (
            sum(r[i] for r in runs) for i in range(5))
        lines.append(f"| {backend} | {key} | {jobs} | {workers} | {main_reqs:,} | "
                     f"{worker_reqs:,} | "
                     f"{main_reqs / max(main_parks, 1):.1f} / "
                     f"{worker_reqs / max(worker_parks, 1):.1f} | "
                     f"{sent / worker_reqs if worker_reqs else 0:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workers", default="1,2,4", help="worker counts (1 always runs)")
    ap.add_argument("--backends", default="ram,libfuse,tcp",
                    help="ram, libfuse (the native peer over RAM), tcp (the fake target)")
    ap.add_argument("--iodepth", type=int, default=32, help="of the 4 KiB job")
    ap.add_argument("--loadgen", choices=("fio", "loadgen"),
                    help="the load generator (default: fio if on PATH, else loadgen)")
    ap.add_argument("--target", help="a real target's URI (nvme+rdma://... or nvme+tcp://, "
                    "/NSID at the end), served instead of RAM and the fake target")
    args = ap.parse_args(argv)
    counts = sorted({1, *(int(n) for n in args.workers.split(","))})
    backends = [b for b in args.backends.split(",") if b]
    if args.target:
        backends = [args.target.split("://", 1)[0].removeprefix("nvme+")]
    gen = load_generator(args.loadgen, tempfile.mkdtemp(prefix="nvmeof-fuse-loadgen-"))
    print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} before; load generator: "
          f"{gen.name} ({gen.binary})", flush=True)
    results = run(backends, counts, args.seconds, args.rounds, args.iodepth, args.target, gen)
    print(table(results, backends, counts, args.iodepth))
    split = split_table(results)
    if split:
        print(split)
    print(f"load {os.getloadavg()[0]:.2f} after; CPU/req: the serving processes' user+system "
          "CPU per request (main and workers; not the load generator, not the target); host "
          "CPU/req: the whole host's busy CPU per request (the load generator, the kernel and "
          "the target too); host busy: "
          "the share of all CPUs busy during the job")
    return 0


if __name__ == "__main__":
    sys.exit(main())
