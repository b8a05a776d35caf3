"""CPU per command of the core over NVMe/TCP, on the host (no VM): a micro-benchmark.

  .venv/bin/python tests/transport/bench_tcp_queue.py [--seconds 3] [--size 4096] [--qd 1,16]
                                                       [--write] [--profile]

Runs ``Namespace.read_into`` (or ``write_from``) through the real ``Controller`` and
``TcpQueue``s against the fake NVMe/TCP target of tests/tcp_target.py, which runs in a child
process so that only our side's CPU is counted.  Prints I/Os per second, CPU microseconds
per I/O (``os.times``, user and system) and syscalls are the kernel's loopback only; with
``--profile``, the top of a cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing
import os
import pstats
import sys
import time

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]

import trio  # noqa: E402
from tcp_target import NQN, serve_like_nvmet  # noqa: E402

from nvmeof_fuse.host.controller import ConnectOptions, connect  # noqa: E402


async def run(args, port: int) -> None:
    options = ConnectOptions("127.0.0.1", NQN, transport="tcp", trsvcid=port,
                             keep_alive_tmo=0)
    async with connect(options) as ctrl:
        ns = ctrl.namespaces[1]
        region = ctrl.allocate(16 * args.size)
        nlb = args.size // ns.lba_size
        slots = ns.nlb // nlb
        for qd in args.qd:
            count = 0

            async def worker(i: int, deadline: float, qd: int = qd) -> None:
                nonlocal count
                ref = region.ref(i * args.size, args.size)
                slba = i * nlb
                while time.monotonic() < deadline:
                    if args.write:
                        await ns.write_from(slba, nlb, ref)
                    else:
                        await ns.read_into(slba, nlb, ref)
                    slba = (slba + qd * nlb) % (slots * nlb)
                    count += 1

            start, cpu = time.monotonic(), os.times()
            async with trio.open_nursery() as nursery:
                for i in range(qd):
                    nursery.start_soon(worker, i, start + args.seconds)
            elapsed, end = time.monotonic() - start, os.times()
            user, system = end.user - cpu.user, end.system - cpu.system
            print(f"QD{qd} {args.size} B {'write' if args.write else 'read'}: "
                  f"{count / elapsed:,.0f} IO/s, CPU {(user + system) / count * 1e6:.0f} us/IO "
                  f"(user {user / count * 1e6:.0f}, system {system / count * 1e6:.0f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--qd", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    ports = multiprocessing.Queue()
    child = multiprocessing.Process(target=serve_like_nvmet, args=(ports,), daemon=True)
    child.start()
    try:
        port = ports.get(timeout=30)
        if args.profile:
            profile = cProfile.Profile(time.process_time)
            profile.runcall(trio.run, run, args, port)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        else:
            trio.run(run, args, port)
    finally:
        child.terminate()


if __name__ == "__main__":
    main()
