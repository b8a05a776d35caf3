"""Companion reads over NVMe/TCP: on the client's own queues vs through the mount daemon.

  .venv/bin/python tests/companion/bench_tcp_companion.py [--seconds 5] [--rounds 2]
      [--jobs rand_read_qd16,seq_read] [--processes 1]

On the host, no VM: the fake NVMe/TCP target of tests/tcp_target.py serves each connection
from a process of its own (so the target's one core is not what is measured), mounted by the
real daemon (``nvmeof-fuse mount -t tcp --daemon``).  ``scripts/benches/bench.py companion``
then reads into ``nvmeof_fuse.empty`` rows from another process, alternately with queues of
its own (``own``) and with none (``daemon``: the daemon's queues place the data in the
client's shared memory, its best path without a lease), ``--rounds`` times each, in the same
run.  Each row: the figure (IO/s or MB/s), CPU microseconds per request of the client
process(es), of the daemon, and of both, and the target's (its connection processes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(HERE.parent)]

from tcp_target import NQN, serve_like_nvmet  # noqa: E402

from nvmeof_fuse.procstat import cpu_seconds  # noqa: E402

MODES = {"own": 4, "daemon": 0}  # queues each File leases


def run_mode(path: str, queues: int, job: str, args: argparse.Namespace, daemon: int,
             target: int) -> dict:
    """One job in fresh client process(es), with the daemon's and the target's CPU."""
    cmd = [sys.executable, str(REPO / "scripts" / "benches" / "bench.py"), "companion",
           "--file", path, "--seconds", str(args.seconds), "--json", "--queues", str(queues),
           "--jobs", job, "--processes", str(args.processes)]
    d0, t0 = cpu_seconds(daemon), cpu_seconds(target, with_children=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    d1, t1 = cpu_seconds(daemon), cpu_seconds(target, with_children=True)
    result = json.loads(out)
    result["daemon_cpu_s"], result["target_cpu_s"] = d1 - d0, t1 - t0
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="per job and mode")
    ap.add_argument("--rounds", type=int, default=2, help="own/daemon alternations")
    ap.add_argument("--jobs", default="rand_read_qd16,seq_read")
    ap.add_argument("--processes", type=int, default=1, help="client processes at once")
    ap.add_argument("--size-mib", type=int, default=256)
    args = ap.parse_args()
    if args.processes != 1:
        args.seconds = max(args.seconds, 1.0)
    work = Path(tempfile.mkdtemp(prefix="bench-tcp-companion."))
    mnt = work / "mnt"
    mnt.mkdir()
    ports: multiprocessing.Queue = multiprocessing.Queue()
    target = multiprocessing.Process(target=serve_like_nvmet, args=(ports, args.size_mib << 20),
                                     daemon=True)
    target.start()
    mounted = False
    try:
        port = ports.get(timeout=30)
        subprocess.run([sys.executable, "-m", "nvmeof_fuse.cli", "mount", "-t", "tcp",
                        "-a", "127.0.0.1", "-s", str(port), "-n", NQN, "--daemon",
                        "--log-file", str(work / "daemon.log"), str(mnt)],
                       check=True, timeout=120)
        mounted = True
        daemon = json.loads((mnt / ".nvmeof" / "companion.json").read_text())["pid"]
        rows = []
        for round_ in range(args.rounds):
            for job in args.jobs.split(","):
                for mode, queues in MODES.items():
                    r = run_mode(str(mnt / "n1"), queues, job, args, daemon, target.pid)
                    rows.append((round_, mode, r))
        print(f"companion reads over NVMe/TCP, {args.processes} client process(es), "
              f"{args.seconds:g} s per job; fake target: a process per connection")
        print(f"{'round':>5} {'path':<7} {'job':<15} {'figure':>12} {'client':>8} "
              f"{'daemon':>8} {'both':>8} {'target':>8}   (CPU us per request)")
        for round_, mode, r in rows:
            for job, value in r["metrics"].items():
                ios = _ios(job, value, args.seconds)
                client = r.get("cpu_us_per_io", {}).get(job)
                daemon_us = r["daemon_cpu_s"] / ios * 1e6 if ios else 0
                target_us = r["target_cpu_s"] / ios * 1e6 if ios else 0
                unit = "MB/s" if job.startswith("seq") else "IO/s"
                both = "" if client is None else f"{client + daemon_us:8.0f}"
                print(f"{round_:>5} {mode:<7} {job:<15} {value:>7,.0f} {unit} "
                      f"{'' if client is None else client:>8} {daemon_us:8.0f} {both:>8} "
                      f"{target_us:8.0f}")
            for job, why in r["errors"].items():
                print(f"{round_:>5} {mode:<7} {job:<15} n/a: {why}")
        print("(client: the client processes' own CPU per request over the job's seconds; "
              "daemon and target: over the client's whole run, its start included)")
    finally:
        if mounted:
            subprocess.run(["fusermount3", "-u", str(mnt)], timeout=60, check=False)
        target.terminate()
        target.join(10)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _ios(job: str, value: float, seconds: float) -> float:
    """Requests of a job from its figure (MB/s of 1 MiB reads, or IO/s) and its seconds."""
    if job.startswith("seq"):
        return value * 1e6 / (1 << 20) * seconds
    return value * seconds


if __name__ == "__main__":
    raise SystemExit(main())
