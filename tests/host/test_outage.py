"""The target goes away with commands in flight while a companion client holds leased queues
(issue #44): every command runs again once reconnected, and every bounce buffer lent to a
command of the lost connection, whatever became of that command, is back in its pool.

The controllers are the real ones (the mount daemon's and the client's); the target and the
transports are tests/fabric_fakes.py's, and trio's clock jumps over the waits.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import trio
import trio.testing
from fabric_fakes import FakeTarget, FakeTransport

from nvmeof_fuse.companion.client.own_queues import lease_from
from nvmeof_fuse.companion.server.server import CompanionServer
from nvmeof_fuse.host.attached import EDGE_BUFFERS, attach
from nvmeof_fuse.host.controller import ConnectOptions, Controller
from nvmeof_fuse.host.namespace import Namespace
from nvmeof_fuse.host.state import CONNECTING, LIVE

NQN = "nqn.2014-08.org.example:outage"
LBA = 512
CHUNK = 16384  # the daemon's bounce buffers (its MDTS)
BUFFERS = 12


def options(**kw) -> ConnectOptions:
    return ConnectOptions("192.0.2.1", NQN, keep_alive_tmo=0, reconnect_delay=1,
                          ctrl_loss_tmo=60, **kw)


async def daemon(nursery: trio.Nursery, target: FakeTarget) -> Controller:
    """A live controller with two I/O queues, queue IDs 3 and 4 to lease, and n1."""
    transport = FakeTransport(target)
    ctrl = Controller(options(companion_queues=2), transport, nursery)

    async def connect_admin() -> None:
        ctrl.admin = await transport.connect_queue(nursery, 0, 32)

    async def connect_io_queues() -> None:
        ctrl.io_queues = [await transport.connect_queue(nursery, qid, 32) for qid in (1, 2)]
        ctrl.lease_qids = [3, 4]

    ctrl._connect_admin, ctrl._connect_io_queues = connect_admin, connect_io_queues
    ctrl.io_queue_size = lambda: 32
    await connect_admin()
    await connect_io_queues()
    ctrl.max_transfer = CHUNK
    ctrl.bounce = ctrl.new_bounce_pool(CHUNK, BUFFERS)
    ctrl.namespaces[1] = Namespace(ctrl, 1, SimpleNamespace(lba_size=LBA, nsze=target.nlb))
    assert ctrl._change_state(CONNECTING) and ctrl._change_state(LIVE)
    await nursery.start(ctrl.supervise)
    return ctrl


def whole(count: int) -> dict[str, int]:
    return {"free": count, "lent": 0, "held": 0, "waiters": 0}


def test_a_lost_connection_gives_back_every_bounce_buffer_while_a_client_holds_leases():
    target = FakeTarget(LBA, 4096)
    target.disk[:] = os.urandom(len(target.disk))
    before = bytes(target.disk)
    results: dict[str, tuple[int, bytes]] = {}  # what each read got, and where from

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ctrl = await daemon(nursery, target)
            ns = ctrl.namespaces[1]
            server = CompanionServer(ctrl)
            session = server.new_session("pid 2 uid 0")

            async def lease():
                return lease_from(await server.lease(session, 2))

            client_options = options(nr_io_queues=2, companion_queues=0)
            async with attach(client_options, lease, FakeTransport(target)) as client:
                assert [q.qid for q in client.io_queues] == [3, 4]
                client_ns = client.namespaces[1]
                landing = client.allocate(8 * LBA)
                async with trio.open_nursery() as io:
                    target.go_away()  # what is sent from here on gets no answer

                    # the FUSE file at depth: started commands, run again as tasks on failure
                    def started_read(at: int) -> None:
                        def done(data) -> None:
                            if data is None:
                                io.start_soon(read_task, f"started read {at}", at, 2 * LBA)
                            else:
                                results[f"started read {at}"] = at, bytes(data)
                        assert ns.start_read_lent(at, 2 * LBA, done)

                    def started_write(at: int, data: bytes) -> None:
                        def done(landed: bool) -> None:
                            if not landed:
                                io.start_soon(write_task, at, data)
                        assert ns.start_write(at, memoryview(data), done)

                    async def read_task(key: str, at: int, length: int) -> None:
                        results[key] = at, bytes(await ns.read_lent(at, length))

                    async def write_task(at: int, data: bytes) -> None:
                        await ns.write(at, data)

                    async def client_edge(lba: int) -> None:
                        results[f"edge {lba}"] = lba * LBA, bytes(await client_ns.lend_lbas(lba, 1))

                    async def client_read(lba: int) -> None:
                        await client_ns.read_into(lba, 8, landing.ref(0, 8 * LBA))
                        results["client read"] = lba * LBA, bytes(landing.view[:8 * LBA])

                    writes = {64 * i * LBA: os.urandom(4 * LBA) for i in range(1, 5)}
                    for i in range(4):
                        started_read(1000 * LBA + i * 4 * LBA)
                    for at, data in writes.items():
                        started_write(at, data)
                    for i in range(3):  # as tasks: one of two commands, and partial LBAs
                        io.start_soon(read_task, f"task read {i}", 2000 * LBA + i * 100,
                                      CHUNK + 3000)
                    writes[3000 * LBA + 7] = os.urandom(3 * LBA)  # partial LBAs
                    io.start_soon(write_task, 3000 * LBA + 7, writes[3000 * LBA + 7])
                    io.start_soon(client_edge, 3500)
                    io.start_soon(client_read, 3600)
                    await trio.sleep(0.5)
                    counts = ctrl.bounce.counts()
                    assert counts["lent"] >= 8 + 3, counts  # all in flight, none answered
                    assert not results
                    target.fail_queues()  # the connection is noticed lost, on every queue
                    await trio.sleep(5)  # the target stays away meanwhile
                    assert ctrl.state is not LIVE and client.state is not LIVE
                    target.come_back()
                # every command landed once reconnected
                assert ctrl.state is LIVE and client.state is LIVE
                assert (ctrl.losses, ctrl.reconnects, client.reconnects) == (1, 1, 1)
                for at, data in writes.items():
                    assert target.disk[at:at + len(data)] == data
                assert len(results) == 4 + 3 + 2
                for key, (at, data) in results.items():
                    assert data == before[at:at + len(data)], key
                # and every bounce buffer of both controllers is back
                assert ctrl.bounce.counts() == whole(BUFFERS)
                assert client.bounce.counts() == whole(EDGE_BUFFERS)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
