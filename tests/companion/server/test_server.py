"""Leasing queue IDs and write locks over the real companion socket (the daemon side)."""

from __future__ import annotations

import errno
import functools
import threading
import uuid
from types import SimpleNamespace

import pytest
import trio
from companion_fakes import LeasingController, serving, wait_for

from nvmeof_fuse.companion import protocol
from nvmeof_fuse.companion.client.channel import SocketChannel
from nvmeof_fuse.companion.client.own_queues import lease_from, options_from
from nvmeof_fuse.companion.protocol import CompanionError
from nvmeof_fuse.companion.server.server import CompanionServer


def channel(server) -> SocketChannel:
    return SocketChannel("\0" + server.info()["socket"][1:], 10)


@pytest.fixture
def served(tmp_path):
    ctrl = LeasingController()
    with serving(ctrl, tmp_path) as (server, mnt):
        yield ctrl, server


def test_a_lease_names_the_queues_and_how_to_connect_them(served):
    ctrl, server = served
    ch = channel(server)
    try:
        assert ch.hello()["leasing"] == "on"
        reply = ch.call("lease", want=2)
        lease = lease_from(reply)
        assert lease.qids == (3, 4) and lease.cntlid == 7 and lease.queue_size == 128
        assert [(n.nsid, n.lba_size) for n in lease.namespaces] == [(1, 512), (2, 4096)]
        opts = options_from(reply, 60)
        assert (opts.traddr, opts.nqn, opts.hostid) == ("10.0.0.1", "nqn.2026-11.io.x:sub",
                                                        str(uuid.UUID(int=5)))
        assert opts.companion_queues == 0 and opts.keep_alive_tmo == 0
        assert ch.call("lease", want=2)["qids"] == [3, 4]  # renewing keeps the same QIDs
        assert server.snapshot()["sessions"][0]["qids"] == [3, 4]
    finally:
        ch.close()


def test_queues_run_out_then_come_back_when_a_client_goes(served):
    ctrl, server = served
    first, second, third = channel(server), channel(server), channel(server)
    try:
        assert first.call("lease", want=2)["qids"] == [3, 4]
        assert second.call("lease", want=2)["qids"] == [5]
        with pytest.raises(CompanionError) as refused:
            third.call("lease", want=2)
        assert str(refused.value) == ("all 3 companion queues of this mount are leased "
                                      "(--companion-queues)")
        assert refused.value.errno == errno.EBUSY
        first.close()
        assert wait_for(lambda: server.snapshot()["leases"] == 1)
        assert third.call("lease", want=2)["qids"] == [3, 4]
        second.call("unlease")
        assert server.snapshot()["leases"] == 1
    finally:
        for ch in (first, second, third):
            ch.close()


@pytest.mark.parametrize(("queues", "transport", "why"), [
    (0, "rdma", "queue leasing is off on this mount (--companion-queues 0)"),
    (0, "tcp", "queue leasing is off on this mount (--companion-queues 0)"),
    (2, "loop", "the mount's loop transport gives no direct placement into another "
                "process's memory"),
])
def test_no_lease_says_why(tmp_path, queues, transport, why):
    with serving(LeasingController(queues, transport), tmp_path) as (server, _):
        ch = channel(server)
        try:
            assert ch.hello()["leasing"] == why
            with pytest.raises(CompanionError) as refused:
                ch.call("lease", want=1)
            assert str(refused.value) == why
        finally:
            ch.close()


def test_a_held_write_lock_keeps_a_read_modify_write_out_until_unlock(served):
    """A FUSE write of a partial LBA waits for a client's lock on that LBA."""
    ctrl, server = served
    dropped: list[tuple[int, int, int]] = []

    async def drop(nsid: int, offset: int, length: int) -> None:
        dropped.append((nsid, offset, length))

    server.on_write = drop
    ns = ctrl.namespaces[1]
    ch = channel(server)
    try:
        token = ch.call("lock", nsid=1, offset=100, length=1000, hold_s=5)["token"]
        rmw_done = threading.Event()

        async def rmw() -> None:  # on the server's loop, as a FUSE write would run
            await ns.write(300, b"x" * 10)
            rmw_done.set()

        def start_rmw() -> None:
            ch_nursery = next(iter(server.sessions)).nursery
            ch_nursery.start_soon(rmw)

        trio.from_thread.run_sync(start_rmw, trio_token=server.trio_token)
        assert wait_for(lambda: len(ns._bytes.lock) == 2)  # queued behind the client's lock
        assert not rmw_done.is_set()
        ch.call("unlock", token=token, nsid=1, moved={"client_queue_write_bytes": 1000})
        assert rmw_done.wait(5)
        assert dropped == [(1, 100, 1000)]  # the pages of the range it wrote
        assert server.snapshot()["client_queue_write_bytes"] == 1000
    finally:
        ch.close()


def test_a_client_that_goes_releases_its_locks(served):
    ctrl, server = served
    ch = channel(server)
    ch.call("lock", nsid=2, offset=0, length=4096, hold_s=5)
    ch.close()
    assert wait_for(lambda: not server.sessions)
    second = channel(server)
    try:  # the same range is free again
        token = second.call("lock", nsid=2, offset=0, length=4096, hold_s=5)["token"]
        second.call("unlock", token=token, nsid=2)
    finally:
        second.close()


@pytest.mark.parametrize(("fields", "message"), [
    ({"nsid": 1, "offset": -1, "length": 10}, "bad write lock: offset -1, length 10 on "
                                               "namespace 1 (8388608 bytes)"),
    ({"nsid": 9, "offset": 0, "length": 10}, "namespace 9 does not exist on this mount"),
])
def test_bad_locks_are_one_line(served, fields, message):
    ctrl, server = served
    ch = channel(server)
    try:
        with pytest.raises(CompanionError) as exc:
            ch.call("lock", hold_s=5, **fields)
        assert str(exc.value) == message
        with pytest.raises(CompanionError, match="^write lock 42 is not held$"):
            ch.call("unlock", token=42, nsid=1)
    finally:
        ch.close()



def test_a_lock_on_an_unavailable_namespace_is_refused_by_name(served):
    ctrl, server = served
    why = "its LBA size 2^63 bytes (LBADS 63) is outside 512 B to 64 KiB"
    ctrl.namespaces[2].resize(SimpleNamespace(lba_size=1 << 63, nsze=1, unusable=why))
    ch = channel(server)
    try:
        with pytest.raises(CompanionError) as exc:
            ch.call("lock", nsid=2, offset=0, length=4096, hold_s=5)
        assert str(exc.value) == f"namespace n2 is unavailable: {why}"
        assert exc.value.errno == errno.ENXIO
    finally:
        ch.close()


def test_a_lease_carries_the_mounts_dhchap_secrets_so_the_clients_queues_authenticate(
        tmp_path):
    secret = "DHHC-1:00:" + "A" * 48 + ":"  # the form is all that matters here
    key_file = tmp_path / "key"
    key_file.write_text(secret + "\n")
    key_file.chmod(0o600)
    ctrl = LeasingController()
    ctrl.options.dhchap_secret = str(key_file)  # a file, as the README advises
    with serving(ctrl, tmp_path) as (server, _):
        ch = channel(server)
        try:
            reply = ch.call("lease", want=1)
        finally:
            ch.close()
    assert reply["dhchap_secret"] == secret and "dhchap_ctrl_secret" not in reply
    assert options_from(reply, 60).dhchap_secret == secret


def test_a_lease_refuses_an_insecure_secret_file_by_name_without_the_secret(tmp_path, caplog):
    """The daemon reads the file again for each lease, with the mount's checks."""
    secret = "DHHC-1:00:" + "A" * 48 + ":"
    key_file = tmp_path / "key"
    key_file.write_text(secret + "\n")
    key_file.chmod(0o644)
    ctrl = LeasingController()
    ctrl.options.dhchap_secret = str(key_file)
    with serving(ctrl, tmp_path) as (server, _):
        ch = channel(server)
        try:
            with pytest.raises(CompanionError, match="permissions 0644 are too open") as info:
                ch.call("lease", want=1)
        finally:
            ch.close()
    assert secret[10:] not in str(info.value) and secret[10:] not in caplog.text


MANY = 5000  # namespaces: all of them in one reply would exceed the socket's message


@pytest.fixture
def many(tmp_path):
    ctrl = LeasingController(specs=[(n, 512, n % 7 + 1) for n in range(1, MANY + 1)])
    with serving(ctrl, tmp_path) as (server, _):
        ch = channel(server)
        try:
            yield ch
        finally:
            ch.close()


def test_on_a_mount_of_many_namespaces_a_hello_and_a_lease_name_the_ones_asked_for(many):
    hello = many.hello(4321)
    assert hello["namespaces"] == {"4321": {"size": 512 * 3, "lba_size": 512, "nlb": 3}}
    assert hello["namespace_count"] == MANY and hello["leasing"] == "on"
    assert many.hello(MANY + 1)["namespaces"] == {}  # not here: the client says so
    lease = lease_from(many.call("lease", want=1, nsids=[4321, 7, 4321, MANY + 1]))
    assert [(n.nsid, n.lba_size, n.nsze) for n in lease.namespaces] == [(7, 512, 1),
                                                                        (4321, 512, 3)]
    assert many.call("lease", want=1, nsids=[])["namespaces"] == []


def test_on_a_mount_of_many_namespaces_a_hello_or_lease_asking_for_all_names_none(many):
    """Past the bound a reply names no namespace rather than some (or fail), and counts all."""
    hello = many.hello()
    assert hello["namespaces"] == {} and hello["namespace_count"] == MANY
    reply = many.call("lease", want=1)
    assert reply["namespaces"] == [] and reply["namespace_count"] == MANY


@pytest.mark.parametrize(("nsids", "why"), [
    ("all", "got str"), ([1, -1], "got -1"), (list(range(1, 2000)), "got 1999")])
def test_a_lease_naming_bad_nsids_is_refused_in_one_line(many, nsids, why):
    with pytest.raises(CompanionError) as refused:
        many.call("lease", want=1, nsids=nsids)
    assert str(refused.value).endswith(f"NSIDs (1 to 0xFFFFFFFE), {why}")
    assert refused.value.errno == errno.EPROTO
    assert many.call("lease", want=1, nsids=[1])["qids"] == [3]  # the session goes on


@pytest.mark.parametrize(("count", "largest"), [
    (600, False), (1024, True), (2000, False), (3000, True), (5000, False)])
def test_a_reply_asking_for_all_namespaces_names_all_while_they_fit_else_none(count, largest):
    """Bounded by the bytes they take, not by their count: an older client (its hello and
    lease ask for all) still opens its namespace on any mount whose namespaces fit a reply."""
    ctrl = LeasingController()
    ctrl.options.dhchap_secret = ctrl.options.dhchap_ctrl_secret = None
    top = 0xFFFFFFFE
    if largest:
        shape = SimpleNamespace(lba_size=1 << 16, nlb=(1 << 47) - 1, size=(1 << 63) - (1 << 16))
    else:  # 1 TiB of 512-byte LBAs
        shape = SimpleNamespace(lba_size=512, nlb=1 << 31, size=1 << 40)
    ctrl.namespaces = {top - i if largest else i + 1: shape for i in range(count)}
    from nvmeof_fuse.workers.supervisor import FuseWorkers

    role = FuseWorkers(2).role  # a mount with a FUSE worker, as the daemon registers it
    server = CompanionServer(ctrl, roles=[role])
    hello = server.hello()
    assert len(hello["namespaces"]) in (0, count) and hello["namespace_count"] == count
    protocol.reply_ok(1 << 62, **hello)  # raises past MAX_MESSAGE
    client = trio.run(server.lease, server.new_session("pid 1 uid 0"), 1)
    assert len(client["namespaces"]) in (0, count)
    protocol.reply_ok(1 << 62, **client)
    worker = trio.run(functools.partial(server.lease, server.new_session("pid 2 uid 0"), 1,
                                        role=role))
    named = len(worker["namespaces"])
    assert named == (count if count <= protocol.MAX_NAMED_NAMESPACES else 0)
    protocol.reply_ok(1 << 62, **worker)
    if not largest:  # as many as fit are named: a realistic mount of thousands still is
        assert len(hello["namespaces"]) == (count if count <= 1000 else 0)
        assert len(client["namespaces"]) == (count if count <= 2000 else 0)


def test_a_stats_reply_lists_the_asker_first_and_a_bounded_number_of_clients(served):
    """However many clients there are and whatever they reported (placement lines whose
    characters JSON escapes to six or twelve bytes each, byte totals of any size), a client's
    ``stats`` fits a message."""
    from nvmeof_fuse.companion.server.server import MAX_LISTED_SESSIONS
    from nvmeof_fuse.companion.server.session import PLACEMENT_KINDS

    _, server = served
    others = [channel(server) for _ in range(MAX_LISTED_SESSIONS + 3)]
    asker = channel(server)
    try:
        for k, ch in enumerate(others):
            line = "\x01" * 1000 if k % 2 else "\U0001F600" * 1000
            ch.call("stats", placement={kind: line for kind in PLACEMENT_KINDS},
                    moved={"client_queue_read_bytes": 10 ** 18 + k,
                           "client_queue_write_bytes": 10 ** 4000})
        stats = asker.call("stats", placement={"host": "mine", "cuda": 7})["stats"]
        assert len(stats["sessions"]) == MAX_LISTED_SESSIONS
        assert stats["sessions"][0]["placement"] == {"host": "mine", "cuda": "int"}
        assert stats["sessions"][1]["placement"]["host"] == "?" * 300
        assert stats["client_queue_read_bytes"] >= 10 ** 18  # taken: below 2**63
        assert stats["client_queue_write_bytes"] == 0  # not taken: too large
        assert stats["sessions_omitted"] == 4 and stats["clients"] == len(others) + 1
        assert len(server.snapshot()["sessions"]) == len(others) + 1  # stats.json: all
    finally:
        for ch in [*others, asker]:
            ch.close()


def test_a_file_is_bound_to_the_namespace_it_opened_not_to_its_nsid(served):
    """Another namespace takes n1 (a replacement): the session of a File of n1 (its
    ``hello``) still goes to the one it opened, which refuses I/O, and its lease names that
    one as gone, so that its own queues refuse it too; the session is told its queues are
    revoked.  Another client, opening n1 now, gets the new one."""
    from nvmeof_fuse.errors import NamespaceReplaced
    from nvmeof_fuse.host.attached import GONE
    from nvmeof_fuse.host.events import NamespaceChange
    from nvmeof_fuse.host.namespace import Namespace

    ctrl, server = served
    ch = channel(server)
    events = []
    ch.on_event = events.append
    try:
        ch.hello(1)
        (shape,) = lease_from(ch.call("lease", want=1, nsids=[1])).namespaces
        assert (shape.nsid, shape.generation) == (1, 0)
        old = ctrl.namespaces[1]
        old.replace("namespace n1 was replaced by another namespace (NGUID x != y)")
        ctrl.namespaces[1] = Namespace(ctrl, 1, SimpleNamespace(lba_size=512, nsze=64),
                                       1)
        (session,) = server.sessions
        assert session.namespace(1) is old
        with pytest.raises(NamespaceReplaced):  # what the session's reads of it meet
            trio.run(session.namespace(1).read_lbas, 0, 1)
        (shape,) = lease_from(ch.call("lease", want=1, nsids=[1])).namespaces
        assert shape.generation == GONE
        trio.from_thread.run(server.follow, [NamespaceChange("replaced", 1, 1, 1)],
                             trio_token=server.trio_token)
        assert wait_for(lambda: events, 10)
        assert events[0]["event"] == "revoked"
        other = channel(server)
        try:
            other.hello(1)
            (shape,) = lease_from(other.call("lease", want=1, nsids=[1])).namespaces
            assert (shape.generation, shape.nsze) == (1, 64)
        finally:
            other.close()
    finally:
        ch.close()
