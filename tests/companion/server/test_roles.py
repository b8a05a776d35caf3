"""The companion server's roles (companion/server/roles.py), with the one the daemon
registers, the FUSE workers': leases on any transport from queue IDs kept for them, their
sessions counted apart from clients, write locks that leave the kernel's pages alone,
requests only they may send (with bytes back), their reports, and events told to them."""

from __future__ import annotations

import dataclasses
import os

import pytest
import trio
import trio.testing
from companion_fakes import LeasingController, serving, wait_for
from multipath_fakes import Port, options
from workers_fakes import workers_role

from nvmeof_fuse.companion.client.channel import SocketChannel
from nvmeof_fuse.companion.protocol import CompanionError
from nvmeof_fuse.companion.server.server import CompanionServer
from nvmeof_fuse.host.multipath import head as multipath
from nvmeof_fuse.workers.supervisor import FuseWorkers


def channel(server) -> SocketChannel:
    return SocketChannel("\0" + server.info()["socket"][1:], 10)




@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_workers_lease_the_last_queue_ids_on_any_transport(tmp_path, transport):
    ctrl = LeasingController(companion_queues=4, transport=transport)
    with serving(ctrl, tmp_path, roles=[workers_role(3)]) as (server, _):
        worker, other, client = channel(server), channel(server), channel(server)
        try:
            assert worker.call("lease", want=1, worker=True)["qids"] == [5]
            assert other.call("lease", want=1, worker=True)["qids"] == [6]
            # companion clients get the others, never the workers'
            assert client.call("lease", want=4)["qids"] == [3, 4]
            third = channel(server)
            try:
                with pytest.raises(CompanionError, match="FUSE workers are taken"):
                    third.call("lease", want=1, worker=True)
                worker.close()  # a worker that dies gives its queue IDs back
                assert wait_for(lambda: third.call("lease", want=1, worker=True)["qids"]
                                == [5])
            finally:
                third.close()
        finally:
            for ch in (worker, other, client):
                ch.close()


def test_stats_count_fuse_workers_apart_from_companion_clients(tmp_path):
    ctrl = LeasingController(companion_queues=4, transport="tcp")
    with serving(ctrl, tmp_path, roles=[workers_role()]) as (server, _):
        worker, client = channel(server), channel(server)
        try:
            worker.call("lease", want=1, worker=True)
            client.call("lease", want=1)
            counts = {k: server.snapshot()[k] for k in
                      ("clients", "clients_total", "fuse_workers", "fuse_workers_total", "leases")}
            assert counts == {"clients": 1, "clients_total": 1, "fuse_workers": 1,
                              "fuse_workers_total": 1, "leases": 1}
            assert [s["qids"] for s in server.snapshot()["sessions"]] == [[3]]
            worker.close()
            assert wait_for(lambda: server.snapshot()["fuse_workers"] == 0)
            assert server.snapshot()["clients"] == 1 and server.snapshot()["leases"] == 1
        finally:
            worker.close()
            client.close()
    assert server.snapshot()["clients"] == 0


def test_without_workers_no_process_leases_as_one(tmp_path):
    with serving(LeasingController(), tmp_path, roles=[workers_role(1)]) as (server, _):
        ch = channel(server)
        try:
            with pytest.raises(CompanionError, match="no FUSE workers"):
                ch.call("lease", want=1, worker=True)
            with pytest.raises(CompanionError, match="no FUSE workers"):
                ch.call("fuse", kind="meta", opcode=3, unique=1, nodeid=1)
        finally:
            ch.close()


def test_forwarded_fuse_requests_get_their_bytes_back_and_reports_show_each_worker(tmp_path):
    seen = []

    async def on_fuse(session, header, payload):
        seen.append((header["kind"], payload))
        return {"_payload": b"\x01reply" * 100, "more": 1}

    with serving(LeasingController(companion_queues=4, transport="tcp"), tmp_path,
                 roles=[workers_role(fuse=on_fuse)]) as (server, _):
        ch = channel(server)
        try:
            ch.call("lease", want=1, worker=True)
            reply = ch.call("fuse", payload=b"request", kind="meta", opcode=1, unique=9,
                            nodeid=1)
            assert reply["_payload"] == b"\x01reply" * 100 and reply["more"] == 1
            assert seen == [("meta", b"request")]
            ch.call("report", worker={"index": 1, "pid": 42, "namespaces": {}})
            assert server.own_reports() == [{"index": 1, "pid": 42, "namespaces": {},
                                             "qids": [6]}]
            assert server.snapshot()["sessions"] == []  # a worker is no companion client
        finally:
            ch.close()


def test_only_a_fuse_worker_sends_fuse_requests_and_names_its_own_pid(tmp_path):
    """A companion client cannot post a worker's ``ready`` or ack, nor report as one."""
    pool = FuseWorkers(2)
    seen = []

    async def seeing(session, header, payload):  # the supervisor's own checks; a meta
        if header["kind"] != "meta":               # request it would answer by its session
            await pool.on_fuse(session, header, payload)
        seen.append(header["kind"])  # answered
        return {}

    with serving(LeasingController(companion_queues=4, transport="tcp"), tmp_path,
                 roles=[dataclasses.replace(pool.role, requests={"fuse": seeing})]) as (
            server, _):
        pool.companion = server
        client, worker = channel(server), channel(server)
        try:
            ready = {"kind": "ready", "index": 1, "pid": os.getpid(), "qids": [6]}
            for kind, fields in (("ready", ready), ("meta", {"opcode": 1, "unique": 1,
                                                             "nodeid": 1})):
                with pytest.raises(CompanionError, match="only the mount's FUSE workers"):
                    client.call("fuse", **{"kind": kind, **fields})
            with pytest.raises(CompanionError, match="only a FUSE worker"):
                client.call("report", worker={"index": 1, "pid": os.getpid()})
            worker.call("lease", want=1, worker=True)
            for kind in ("ready", "namespaces"):
                with pytest.raises(CompanionError, match=f"fuse {kind}: pid 1 is not the "
                                   f"sender's \\({os.getpid()}\\)"):
                    worker.call("fuse", **{**ready, "kind": kind, "pid": 1, "generation": 1})
            worker.call("fuse", **ready)
            worker.call("fuse", kind="namespaces", index=1, pid=os.getpid(), generation=1)
            worker.call("fuse", kind="meta", opcode=1, unique=1, nodeid=1)
            assert seen == ["ready", "namespaces", "meta"]
        finally:
            client.close()
            worker.close()


def test_workers_are_sent_events_and_the_sender_learns_which_were(tmp_path):
    role = workers_role()
    with serving(LeasingController(companion_queues=4, transport="tcp"), tmp_path,
                 roles=[role]) as (server, _):
        client, worker = channel(server), channel(server)
        heard = []
        worker.on_event = heard.append
        try:
            client.call("hello")
            worker.call("lease", want=1, worker=True)
            told = trio.from_thread.run(server.tell, role, {"event": "namespaces"},
                                        trio_token=server.trio_token)
            assert [(s.pid, s.role) for s in told] == [(os.getpid(), role)]
            assert wait_for(lambda: [e.get("event") for e in heard] == ["namespaces"])
        finally:
            client.close()
            worker.close()


def test_a_workers_lease_moves_with_its_path_and_stays_on_its_fabric():
    port = Port()

    async def main() -> None:
        opts = [options(addr, companion_queues=4) for addr in list(port.targets)[:2]]
        async with multipath.connect(opts, connect_path=port.connect) as head:
            async with trio.open_nursery() as nursery:
                role = workers_role(3)
                server = CompanionServer(head, roles=[role])
                nursery.start_soon(server._revoke_leases_on_loss)

                def leasable(ctrl):
                    ctrl.lease_qids, ctrl.io_queue_size = [3, 4, 5, 6], lambda: 32
                for path in head.paths:
                    leasable(path.ctrl)
                session = server.new_session("pid 3 uid 0")
                events = []

                async def notify(event):
                    events.append(event)
                session.notify = notify
                first = await server.lease(session, 1, role=role)
                assert (first["traddr"], first["qids"]) == ("192.0.2.1", [5])
                port[0].go_away()
                port[0].fail_queues()
                for _ in range(2):
                    await head.namespaces[1].read(0, 512)
                await trio.sleep(0.1)
                port.on_connect = leasable
                assert [e["event"] for e in events] == ["revoked"]
                again = await server.lease(session, 1, role=role)
                assert (again["traddr"], again["qids"]) == ("192.0.2.2", [5])
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
