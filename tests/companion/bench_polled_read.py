"""CPU per companion read on a polled queue, on the host (no VM): a micro-benchmark.

  .venv/bin/python tests/companion/bench_polled_read.py [--seconds 1] [--qd 16,1] [--profile]

Runs ``File.pread(...).get()`` into ``nvmeof_fuse.empty`` rows (4 KiB, ``qd`` futures
outstanding from one thread, the loop of ``scripts/benches/bench.py companion``)
through the real ``File``, ``DirectQueues``, ``PolledRead`` and ``PolledQueue``, over the
instant fake verbs of tests/transport/bench_rdma_queue.py (the target has answered each
capsule when ``post_send`` returns).  Prints CPU microseconds per read, best of 5, beside
the core's ``Namespace.read_into`` over the same fake verbs measured in the same run, or with
``--profile`` the top of a cProfile.  Only the host's own Python cost is measured.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from types import SimpleNamespace

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "transport"),
                os.path.join(os.path.dirname(__file__), "..", ".."),
                os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "benches")]

import bench  # noqa: E402
import trio  # noqa: E402
from bench_rdma_queue import fake_register, make_queue  # noqa: E402
from bench_rdma_queue import run as core_run  # noqa: E402

import nvmeof_fuse  # noqa: E402
from nvmeof_fuse.companion.client import file as client  # noqa: E402
from nvmeof_fuse.companion.client import own_queues as direct  # noqa: E402
from nvmeof_fuse.companion.client.polled import PolledReads  # noqa: E402
from nvmeof_fuse.companion.client.registrations import Registrations  # noqa: E402
from nvmeof_fuse.transport.rdma.polled import PolledQueue  # noqa: E402

LBA = 4096
NLB_TOTAL = 1 << 20


def polled_file() -> client.File:
    """A File whose DirectQueues hold one polled queue over the instant fake verbs (built
    around the daemon, which the real constructors would ask for a lease)."""
    transport = SimpleNamespace(traddr="fake", trsvcid=4420, _queues=[], yielded_at=0.0)
    d = object.__new__(direct.DirectQueues)
    d._ctrl = SimpleNamespace(polled_queues=[PolledQueue(make_queue(transport, 1))], live=True)
    d.polled = PolledReads({1: SimpleNamespace(nsid=1, lba_size=LBA, nsze=NLB_TOTAL)},
                           {1: 256}, 30.0, d.read_on_loop, lambda queue, exc: None)
    d.polled.ctrl = d._ctrl
    d._registrations = Registrations(fake_register)
    d._timeout = 30.0
    d.renew_timeout = 60.0
    f = object.__new__(client.File)
    f.path, f.nsid, f.lba_size, f.nbytes = "fake/n1", 1, LBA, NLB_TOTAL * LBA
    f.timeout, f.compat_mode = 30.0, False
    f._closed, f._stale, f._direct = False, [], d
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="per round (5 rounds)")
    ap.add_argument("--qd", default="16,1")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    f = polled_file()
    bufs = nvmeof_fuse.empty((16, LBA))
    for qd in (int(q) for q in args.qd.split(",")):
        job = bench.Job(f"rand_read_qd{qd}", LBA, qd, False)
        cursor = bench.Cursor(job, LBA, NLB_TOTAL)
        bench.companion_slice(f, bufs, job, cursor, 0.2)  # warm up
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            bench.companion_slice(f, bufs, job, cursor, args.seconds)
            prof.disable()
            print(f"== QD{qd}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            continue
        rounds = []
        for _ in range(5):
            cpu = time.process_time()
            ios, _ = bench.companion_slice(f, bufs, job, cursor, args.seconds)
            rounds.append((time.process_time() - cpu) / ios)
        ios = 20000
        trio.run(core_run, 2000, qd, 1)  # warm up
        core = min(trio.run(core_run, ios, qd, 1)[0] for _ in range(3)) / ios
        print(f"QD{qd:<3} companion {min(rounds) * 1e6:6.1f} us CPU per read, "
              f"core {core * 1e6:6.1f} us (companion/core {min(rounds) / core:.2f})")


if __name__ == "__main__":
    main()
