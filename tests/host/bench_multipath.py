"""CPU per 4 KiB read through the multipath head, on the host (no VM): a micro-benchmark.

  .venv/bin/python tests/host/bench_multipath.py [--seconds 3] [--qd 1,16] [--rounds 2]

``Namespace.read_into`` on registered memory, three ways against fake NVMe/TCP targets
(tests/tcp_target.py, each in a child process so that only our side's CPU counts): a plain
``Controller`` (as before multipath), the multipath head with one path (commands handed
straight to its controller), and the head with two paths (queue-depth policy; one target
per path), and two paths with the failover policy (all on one: the cost of the path
choice without that of a second connection).  The ways alternate in each round, so a busy
host skews them alike.  Prints I/Os per second and CPU microseconds per I/O (``os.times``,
user and system).  Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..")]

import trio  # noqa: E402
from tcp_target import NQN, serve_like_nvmet  # noqa: E402

from nvmeof_fuse.host.controller import ConnectOptions, connect  # noqa: E402
from nvmeof_fuse.host.multipath import head as multipath  # noqa: E402

WAYS = ("controller", "head, 1 path", "head, 2 paths", "2 paths failover")


def options(port: int) -> ConnectOptions:
    return ConnectOptions("127.0.0.1", NQN, transport="tcp", trsvcid=port, keep_alive_tmo=0,
                          nr_io_queues=2)


def opened(way: str, ports: list[int]):
    if way == "controller":
        return connect(options(ports[0]))
    count = 1 if way == "head, 1 path" else 2
    policy = "failover" if "failover" in way else "queue-depth"
    return multipath.connect([options(p) for p in ports[:count]], policy=policy)


async def measure(ctrl, qd: int, seconds: float, size: int = 4096) -> tuple[float, float]:
    ns = ctrl.namespaces[1]
    region = ctrl.allocate(16 * size)
    nlb = size // ns.lba_size
    slots = ns.nlb // nlb
    count = 0

    async def worker(i: int, deadline: float) -> None:
        nonlocal count
        ref = region.ref(i * size, size)
        slba = i * nlb
        while time.monotonic() < deadline:
            await ns.read_into(slba, nlb, ref)
            slba = (slba + qd * nlb) % (slots * nlb)
            count += 1

    await worker(0, time.monotonic() + 0.3)  # warm up
    count = 0
    start, cpu = time.monotonic(), os.times()
    async with trio.open_nursery() as nursery:
        for i in range(qd):
            nursery.start_soon(worker, i, start + seconds)
    elapsed, end = time.monotonic() - start, os.times()
    busy = (end.user - cpu.user) + (end.system - cpu.system)
    return count / elapsed, busy / count * 1e6


async def run(args, ports: list[int]) -> None:
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for way in WAYS:
            async with opened(way, ports) as ctrl:
                for qd in args.qd:
                    results.setdefault((way, qd), []).append(
                        await measure(ctrl, qd, args.seconds))
    for qd in args.qd:
        for way in WAYS:
            runs = results[(way, qd)]
            iops = [r[0] for r in runs]
            cpu = [r[1] for r in runs]
            print(f"4 KiB read QD{qd:<2} {way:<16}: {min(iops):>8,.0f}-{max(iops):>8,.0f} IO/s, "
                  f"CPU {min(cpu):.1f}-{max(cpu):.1f} us/IO ({len(runs)} runs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--qd", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    queue = multiprocessing.Queue()
    children = [multiprocessing.Process(target=serve_like_nvmet, args=(queue,), daemon=True)
                for _ in range(2)]
    with contextlib.ExitStack() as stack:
        for child in children:
            child.start()
            stack.callback(child.terminate)
        ports = [queue.get(timeout=30) for _ in children]
        trio.run(run, args, ports)


if __name__ == "__main__":
    main()
