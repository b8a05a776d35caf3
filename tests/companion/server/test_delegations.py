"""Write delegations of whole namespaces, over the real companion socket (the daemon side)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from companion_fakes import LeasingController, serving, wait_for

from nvmeof_fuse.companion.client.channel import SocketChannel
from nvmeof_fuse.companion.server import server as companion_server
from nvmeof_fuse.companion.server.delegations import Delegations
from nvmeof_fuse.host.namespace.byterange import LbaRangeLock


def channel(server, events: list | None = None) -> SocketChannel:
    ch = SocketChannel("\0" + server.info()["socket"][1:], 10)
    if events is not None:
        ch.on_event = events.append
    return ch


@pytest.fixture
def served(tmp_path):
    ctrl = LeasingController()
    with serving(ctrl, tmp_path) as (server, mnt):
        dropped: list[int] = []

        async def drop(nsid: int, offset: int, length: int) -> None:
            # A delegation drops all of them (any LBA may have changed), a lock its range.
            dropped.append((nsid, offset, length) if length else nsid)

        server.on_write = drop
        yield ctrl, server, dropped


def on_server_loop(server, job) -> threading.Event:
    """Start ``job`` (async) on the daemon's loop, as a FUSE request would run; the event is
    set once it returned."""
    done = threading.Event()

    async def run() -> None:
        await job()
        done.set()

    trio.from_thread.run_sync(trio.lowlevel.spawn_system_task, run,
                              trio_token=server.trio_token)
    return done


def test_a_namespace_nobody_uses_is_delegated_and_a_waiting_write_recalls_it(served):
    ctrl, server, dropped = served
    ns = ctrl.namespaces[1]
    events: list[dict] = []
    ch = channel(server, events)
    try:
        reply = ch.call("lock", nsid=1, offset=0, length=512, hold_s=5, delegate=True)
        assert reply["delegated"] is True
        token = reply["token"]
        again = ch.call("lock", nsid=1, offset=8192, length=100, hold_s=5, delegate=True)
        assert (again["token"], again["delegated"]) == (token, True)  # still ours
        assert len(ns.write_lock) == 1  # every LBA, held for the client

        written = on_server_loop(server, lambda: ns.write(300, b"x" * 10))  # a FUSE RMW
        assert wait_for(lambda: events)
        assert {k: events[0][k] for k in ("event", "nsid", "token")} == {
            "event": "recall", "nsid": 1, "token": token}
        assert not written.is_set() and dropped == []
        ch.call("unlock", token=token, nsid=1)  # handed back
        assert written.wait(5)
        assert dropped == [1]  # the kernel's pages dropped before the write went on
        snap = server.snapshot()
        assert (snap["delegations_granted"], snap["delegations_recalled"]) == (1, 1)
        # Recalled and handed back: a plain range lock now, until delegated anew.
        plain = ch.call("lock", nsid=1, offset=0, length=512, hold_s=5)
        assert "delegated" not in plain
        ch.call("unlock", token=plain["token"], nsid=1)
    finally:
        ch.close()


def test_asks_of_one_client_that_cross_get_the_same_delegation_and_recall_nothing(served):
    ctrl, server, dropped = served
    ch = channel(server)
    try:
        futures = [ch.call_future("lock", nsid=1, offset=i * 4096, length=4096, hold_s=5,
                                  delegate=True) for i in range(8)]
        replies = [future.result(10) for future in futures]
        assert {(r["token"], r.get("delegated")) for r in replies} == {
            (replies[0]["token"], True)}
        snap = server.snapshot()
        assert (snap["delegations_granted"], snap["delegations_recalled"]) == (1, 0)
        ch.call("unlock", token=replies[0]["token"], nsid=1)
    finally:
        ch.close()


def test_no_delegation_while_a_file_of_the_namespace_is_open(served):
    ctrl, server, dropped = served
    server.delegations.files_open = lambda nsid: nsid == 1
    ch = channel(server)
    try:
        reply = ch.call("lock", nsid=1, offset=0, length=512, hold_s=5, delegate=True)
        assert "delegated" not in reply  # a range lock, as without delegate
        ch.call("unlock", token=reply["token"], nsid=1)
        assert ch.call("lock", nsid=2, offset=0, length=4096, hold_s=5,
                       delegate=True)["delegated"]
    finally:
        ch.close()


def test_another_clients_lock_recalls_it_and_a_holder_that_goes_gives_it_back(served):
    ctrl, server, dropped = served
    events: list[dict] = []
    first, second = channel(server, events), channel(server)
    try:
        first.call("lock", nsid=2, offset=0, length=4096, hold_s=5, delegate=True)
        got: list[dict] = []
        asking = threading.Thread(target=lambda: got.append(second.call(
            "lock", nsid=2, offset=8192, length=4096, hold_s=5, delegate=True)))
        asking.start()
        assert wait_for(lambda: events)  # the second client's wait recalled it
        assert not got
        first.close()  # goes without handing it back: taken back with its other locks
        asking.join(10)
        assert got and "delegated" not in got[0]  # the second gets a range lock
        assert dropped == [2]
        second.call("unlock", token=got[0]["token"], nsid=2)
    finally:
        first.close()
        second.close()


def test_an_open_waits_for_the_hand_back_and_a_holder_that_keeps_it_loses_it(
        served, monkeypatch, caplog):
    ctrl, server, dropped = served
    monkeypatch.setattr(companion_server, "LOCK_GRACE", 0.2)
    events: list[dict] = []
    ch = channel(server, events)
    try:
        token = ch.call("lock", nsid=1, offset=0, length=512, hold_s=0, delegate=True)["token"]
        opened = on_server_loop(server, lambda: server.delegations.wait_returned(1))
        assert opened.wait(10)  # the holder never handed it back: its bound ran out
        assert [e["event"] for e in events] == ["recall"]
        assert dropped == [1]
        assert "did not hand back its delegation of n1" in caplog.text
        assert server.delegations.held(1) is None
        with pytest.raises(Exception, match=f"write lock {token} is not held"):
            ch.call("unlock", token=token, nsid=1)  # too late
    finally:
        ch.close()


def test_an_open_of_a_namespace_not_delegated_does_not_wait(served):
    ctrl, server, dropped = served
    opened = on_server_loop(server, lambda: server.delegations.wait_returned(2))
    assert opened.wait(5)
    assert dropped == []


def test_a_report_lists_the_clients_delegations_until_recalled(served):
    ctrl, server, dropped = served
    events: list[dict] = []
    ch = channel(server, events)
    try:
        token = ch.call("lock", nsid=1, offset=0, length=512, hold_s=5, delegate=True)["token"]
        assert ch.call("report", moved={})["delegated"] == [token]  # renews the client's term
        changed = on_server_loop(server, lambda: server.delegations.follow(
            [SimpleNamespace(kind="resized", nsid=1)]))  # its LBAs changed on the target
        assert changed.wait(5) and wait_for(lambda: events)
        assert events[0]["event"] == "recall"
        assert ch.call("report", moved={})["delegated"] == []
        ch.call("unlock", token=token, nsid=1)
    finally:
        ch.close()


def test_a_delegation_recalled_as_it_is_granted_still_reaches_its_client():
    """The ask that claimed it gets the token and the recall, and hands it back at once
    (a refusal would leave the lock held for a client that does not know it)."""
    told: list[dict] = []

    class Locks(dict):
        def __setitem__(self, token, release):  # as the grant is made: a FUSE open
            delegations.recall(1)
            super().__setitem__(token, release)

    async def notify(event):
        told.append(event)

    async def drop(nsid):
        pass

    delegations = Delegations(drop)
    session = SimpleNamespace(nursery=None, ended=False, next_token=0, write_locks=Locks(),
                              notify=notify, peer="pid 1")
    ns = SimpleNamespace(write_lock=LbaRangeLock(), nlb=8)

    async def main():
        async with trio.open_nursery() as nursery:
            session.nursery = nursery
            token = await delegations.grant(session, ns, 1, 5.0)
            assert token == 1
            await trio.testing.wait_all_tasks_blocked()
            assert told == [{"event": "recall", "nsid": 1, "token": 1}]
            await delegations.hand_back(delegations.of(session, token))
        assert (delegations.granted, delegations.recalled) == (1, 1)
        assert len(ns.write_lock) == 0

    trio.run(main)


def test_a_session_holds_a_bounded_number_of_delegations_then_takes_range_locks(
        tmp_path, monkeypatch):
    """A report lists a session's delegations: bounded, however many namespaces it writes."""
    from nvmeof_fuse.companion import protocol
    from nvmeof_fuse.companion.server import delegations as delegation

    biggest = [(1 << 64) - 1] * delegation.MAX_SESSION_DELEGATIONS
    assert len(protocol.reply_ok(1 << 62, delegated=biggest)) < protocol.MAX_MESSAGE
    monkeypatch.setattr(delegation, "MAX_SESSION_DELEGATIONS", 2)
    ctrl = LeasingController(specs=[(n, 512, 8) for n in (1, 2, 3)])
    with serving(ctrl, tmp_path) as (server, _):
        ch = channel(server)
        try:
            replies = [ch.call("lock", nsid=n, offset=0, length=512, hold_s=5, delegate=True)
                       for n in (1, 2, 3)]
            assert [r.get("delegated", False) for r in replies] == [True, True, False]
            assert ch.call("report", moved={})["delegated"] == [r["token"] for r in replies[:2]]
            ch.call("unlock", token=replies[2]["token"], nsid=3)
            ch.call("unlock", token=replies[0]["token"], nsid=1)  # one handed back: room again
            assert ch.call("lock", nsid=3, offset=0, length=512, hold_s=5,
                           delegate=True).get("delegated")
        finally:
            ch.close()


def test_no_delegation_while_another_process_of_the_mount_holds_a_range():
    """A FUSE worker's write holds its range in the kernel's locks only: the daemon sees
    none queued in its own lock, and still refuses the whole namespace."""
    from nvmeof_fuse.host.namespace.sharedranges import NamespaceRanges, SharedRanges

    ranges = SharedRanges.create(5.0)
    lock = LbaRangeLock()
    lock.shared = NamespaceRanges(ranges, 1, lambda: 8)
    worker = LbaRangeLock()  # as a worker process's, on the same file
    worker.shared = NamespaceRanges(ranges, 1, lambda: 8)
    delegations = Delegations(lambda nsid: trio.lowlevel.checkpoint())
    session = SimpleNamespace(nursery=None, ended=False, next_token=0, write_locks={},
                              notify=None, peer="pid 1")
    ns = SimpleNamespace(write_lock=lock, nlb=8)

    async def main():
        async with trio.open_nursery() as nursery:
            session.nursery = nursery
            held = worker.try_acquire([(3, 4, True)])
            assert await delegations.grant(session, ns, 1, 5.0) is None
            worker.release(held)
            token = await delegations.grant(session, ns, 1, 5.0)
            assert token is not None
            assert worker.try_acquire([(0, 1, False)]) is None  # the delegation holds all
            await delegations.hand_back(delegations.of(session, token))
        assert len(lock) == 0

    try:
        trio.run(main)
    finally:
        ranges.close()
