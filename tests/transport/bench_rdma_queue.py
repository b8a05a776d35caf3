"""CPU per command of the core over fake verbs, on the host (no VM): a micro-benchmark.

  .venv/bin/python tests/transport/bench_rdma_queue.py [--ios 20000] [--qd 1,16] [--queues 1]
                                                        [--profile]

Runs ``Namespace.read_into`` (4 KiB, registered memory) through the real ``Controller``,
``RdmaQueue`` and reaper, over the fake verbs of rdma/test_transport_queue.py whose target answers
every capsule at once (its SEND completion and response are there for the next poll, and an
armed CQ signals the completion channel, a pipe).  Prints CPU microseconds per I/O
(``time.process_time``), or with ``--profile`` the top of a cProfile.  Only the host's own
Python cost is measured: the verbs calls themselves cost nothing here.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from types import SimpleNamespace

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "rdma"),
                os.path.join(os.path.dirname(__file__), "..")]

import trio  # noqa: E402
from test_transport_queue import CQ, FAKE_VERBS, PD, QP, WC, Channel  # noqa: E402

from nvmeof_fuse.host.controller import ConnectOptions, Controller  # noqa: E402
from nvmeof_fuse.host.namespace import Namespace  # noqa: E402
from nvmeof_fuse.host.state import CONNECTING, LIVE  # noqa: E402
from nvmeof_fuse.transport.rdma import transport as rdma  # noqa: E402
from nvmeof_fuse.transport.region import host_buffer  # noqa: E402

LBA = 4096
NLB_TOTAL = 65536


class InstantQP(QP):
    """A target that has answered each capsule by the time ``post_send`` returns."""

    def post_send(self, wrs) -> None:
        """Answer each capsule as it is posted, without the base class's records that only
        tests read (``posts``, ``last_posted``, ``sent``): the fake target's own cost is not
        ours.  (``sent`` is keyed by command ID, generation included: kept here, it held a
        work request of each in-capsule write for every ID ever used, up to 64 Ki objects
        that the garbage collector then walked, and writes looked 13% dearer.)"""
        cid_of, send_cq, respond = self.cid_of, self.send_cq, self.respond
        for wr in wrs:
            send_cq.add(WC(wr.wr_id, 0))
            respond(cid_of(wr))


def make_queue(transport, qid: int, size: int = 128) -> rdma.RdmaQueue:
    rdma._ibverbs = FAKE_VERBS
    channel = Channel()
    context = SimpleNamespace(create_comp_channel=lambda: channel,
                              create_cq=lambda n, ch: CQ(ch))
    cm = SimpleNamespace(context=context, create_qp=lambda pd, attr: InstantQP(attr),
                         connected=False)
    queue = rdma.RdmaQueue(transport, cm, PD(), qid, size, in_capsule_bytes=8192)
    queue.qp.post_recv(queue._recvs)
    transport._queues.append(queue)
    return queue


class FakeTransport:
    address = "rdma 192.0.2.1:4420"


def fake_register(addr: int, length: int, owner: object) -> SimpleNamespace:
    """A registration on the fake verbs: fixed keys, nothing to release."""
    return SimpleNamespace(keys=lambda pd: SimpleNamespace(lkey=1, rkey=2), close=lambda: None)


async def live_controller(nursery: trio.Nursery, nr_queues: int) -> Controller:
    """A LIVE Controller whose ``nr_queues`` I/O queues sit on the instant fake verbs, their
    reapers running in ``nursery`` (close the queues after it)."""
    transport = SimpleNamespace(traddr="fake", trsvcid=4420, _queues=[], yielded_at=0.0)
    opts = ConnectOptions("192.0.2.1", "nqn.2014-08.org.example:t", keep_alive_tmo=0)
    ctrl = Controller(opts, FakeTransport(), nursery)
    ctrl.io_queues = [make_queue(transport, qid) for qid in range(1, nr_queues + 1)]
    assert ctrl._change_state(CONNECTING) and ctrl._change_state(LIVE)
    for queue in ctrl.io_queues:
        await nursery.start(queue.reap)
    return ctrl


async def run(ios: int, qd: int, nr_queues: int = 1) -> tuple[float, float]:
    """(CPU s, wall s) for ``ios`` 4 KiB reads at queue depth ``qd`` over ``nr_queues``."""
    async with trio.open_nursery() as nursery:
        ctrl = await live_controller(nursery, nr_queues)
        queues = ctrl.io_queues
        ns = Namespace(ctrl, 1, SimpleNamespace(lba_size=LBA, nsze=NLB_TOTAL))
        memory = host_buffer(fake_register, qd * LBA)
        left = ios

        async def worker(i: int) -> None:
            nonlocal left
            ref = memory.ref(i * LBA, LBA)
            slba = i
            while left > 0:
                left -= 1
                await ns.read_into(slba, 1, ref)
                slba = (slba + 7919) % NLB_TOTAL

        cpu, wall = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as workers:
            for i in range(qd):
                workers.start_soon(worker, i)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        nursery.cancel_scope.cancel()
    for queue in queues:
        queue.close()
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ios", type=int, default=20000)
    ap.add_argument("--qd", default="1,16")
    ap.add_argument("--queues", type=int, default=1, help="I/O queues (the testbed VM has 2)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    for qd in (int(q) for q in args.qd.split(",")):
        trio.run(run, 2000, qd, args.queues)  # warm up
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            trio.run(run, args.ios, qd, args.queues)
            prof.disable()
            print(f"== QD{qd}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            continue
        best = min(trio.run(run, args.ios, qd, args.queues) for _ in range(3))
        print(f"QD{qd:<3} {best[0] / args.ios * 1e6:6.1f} us CPU per I/O  "
              f"({best[1] / args.ios * 1e6:6.1f} us wall)")


if __name__ == "__main__":
    main()
