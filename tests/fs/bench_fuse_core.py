"""Our FUSE layer over the core against our FUSE layer over RAM, on the host (no VM).

  .venv/bin/python tests/fs/bench_fuse_core.py [--seconds 3] [--rounds 3]     (root: fio, fusectl)

Issue #14 asks the FUSE file for 0.8x of FUSE over RAM at 4 KiB QD16; in the VM both move
with the host.  Here, natively, one server runs our FUSE layer over a ``Controller`` whose
``RdmaQueue``s sit on the instant fake verbs of tests/transport/bench_rdma_queue.py (the
target has answered each capsule when ``post_send`` returns, and moves no data: what is
measured is our Python on both sides of the NVMe queue), the other
``scripts/benches/bench.py fuse-ram``.  Each fio job (O_DIRECT, libaio) runs on the two in turn,
``--rounds`` times; printed are the medians, each server's CPU time per request, and core
over RAM.  Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHES = os.path.join(HERE, "..", "..", "scripts", "benches")  # bench.py, bench_host.py
sys.path[:0] = [os.path.join(HERE, "..", "transport"), os.path.join(HERE, "..", ".."), BENCHES]

NLB = 1 << 16  # 256 MiB of 4 KiB LBAs
READY_TIMEOUT = 60.0  # s for a server to mount (imports included)
JOBS = (("randread16", "4 KiB randread QD16", "randread", 16),
        ("randread1", "4 KiB randread QD1", "randread", 1),
        ("randwrite16", "4 KiB randwrite QD16", "randwrite", 16))


def _identify_namespace():
    from nvmeof_fuse import nvme

    data = bytearray(4096)
    struct.pack_into("<QQQ", data, 0, NLB, NLB, NLB)  # NSZE, NCAP, NUSE
    struct.pack_into("<HBB", data, 128, 0, 12, 0)  # LBA format 0: 4 KiB
    return nvme.IdentifyNamespace.from_bytes(bytes(data))


def serve(mountpoint: str, queues: int) -> None:
    """Mount namespace 1 of a live Controller on fake verbs; serve until unmounted."""
    import trio
    from bench_rdma_queue import fake_register, live_controller

    from nvmeof_fuse.fs.mount import MountOptions
    from nvmeof_fuse.fs.mount import serve as serve_mount
    from nvmeof_fuse.host.memory import BouncePool
    from nvmeof_fuse.host.namespace import Namespace

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
            ctrl = await live_controller(nursery, queues)
            ctrl.max_transfer = 1 << 20
            ctrl.bounce = BouncePool(fake_register, ctrl.max_transfer, 32)
            ctrl.identify = SimpleNamespace(subnqn=ctrl.options.nqn, cntlid=1)
            ctrl.describe = lambda: {"transport": "fake rdma"}
            ctrl.namespaces[1] = Namespace(ctrl, 1, _identify_namespace())

            async def serve_until_unmounted(task_status=trio.TASK_STATUS_IGNORED) -> None:
                await serve_mount(ctrl, mountpoint, MountOptions(), task_status=task_status)
                nursery.cancel_scope.cancel()  # unmounted: the queues' tasks end too

            await nursery.start(serve_until_unmounted)
            print(f"READY {mountpoint}/n1", flush=True)

    async def _stop_on_signal(scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                scope.cancel()

    trio.run(main)


def _start(cmd: list[str], log: str) -> tuple[subprocess.Popen, str]:
    """Start a server; its process and namespace file, once it printed READY."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "wb"))
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout=READY_TIMEOUT)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line.startswith("READY"):
        proc.kill()
        with open(log, "rb") as f:
            tail = f.read().decode(errors="replace").strip().splitlines()
        raise SystemExit(f"bench_fuse_core: {cmd[-1]} did not mount: "
                         f"{tail[-1] if tail else 'no output'}")
    return proc, line.split()[1]


def _fio(target: str, rw: str, qd: int, seconds: float) -> float:
    out = subprocess.run(["fio", "--output-format=json", f"--filename={target}",
                          "--ioengine=libaio", "--direct=1", f"--runtime={seconds:g}",
                          "--time_based", "--name=j", f"--rw={rw}", "--bs=4k",
                          f"--iodepth={qd}"], capture_output=True, text=True,
                         timeout=seconds + 120, check=True)
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    return job["read"]["iops"] + job["write"]["iops"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="per job and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--queues", type=int, default=2, help="I/O queues (the testbed VM's 2)")
    ap.add_argument("--serve", metavar="MOUNTPOINT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.queues)
        return
    from nvmeof_fuse.procstat import cpu_seconds

    work = tempfile.mkdtemp(prefix="bench-fuse-core-")
    servers = {}
    try:
        for name, cmd in (("core", [sys.executable, os.path.abspath(__file__), "--queues",
                                    str(args.queues), "--serve"]),
                          ("ram", [sys.executable, os.path.join(BENCHES, "bench.py"), "fuse-ram"])):
            mnt = os.path.join(work, name)
            os.mkdir(mnt)
            servers[name] = (*_start(cmd + [mnt], os.path.join(work, f"{name}.log")), mnt)
        print(f"{'job':24s} {'over the core (fake verbs)':>30s} {'over RAM':>22s} {'core/RAM':>9s}")
        for _, label, rw, qd in JOBS:
            iops: dict[str, list[float]] = {"core": [], "ram": []}
            cpu: dict[str, list[float]] = {"core": [], "ram": []}
            for _ in range(args.rounds):
                for name, (proc, target, _) in servers.items():
                    before = cpu_seconds(proc.pid)
                    rate = _fio(target, rw, qd, args.seconds)
                    cpu[name].append((cpu_seconds(proc.pid) - before) / (rate * args.seconds))
                    iops[name].append(rate)
            core, ram = (statistics.median(iops[n]) for n in ("core", "ram"))
            cells = [f"{statistics.median(iops[n]):,.0f} IOPS "
                     f"({statistics.median(cpu[n]) * 1e6:.1f} us)" for n in ("core", "ram")]
            print(f"{label:24s} {cells[0]:>30s} {cells[1]:>22s} {core / ram:9.2f}")
    finally:
        for proc, _, mnt in servers.values():
            subprocess.run(["fusermount3", "-u", mnt], capture_output=True, timeout=30)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
