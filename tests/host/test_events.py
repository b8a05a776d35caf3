"""Namespace rescans and the AER loop over a fake controller (the target's side faked)."""

from __future__ import annotations

import logging
import struct
from functools import partial
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from nvmeof_fuse.errors import NamespaceRemoved, NamespaceReplaced, TransportError
from nvmeof_fuse.host.events import (
    COUNT_PAGES_MAX,
    EVENTS_PER_SECOND,
    IDENTIFY_IN_FLIGHT,
    AsyncEvents,
    NamespaceChange,
    active_nsids,
    describe_changes,
    rescan,
)
from nvmeof_fuse.host.namespace import Namespace
from nvmeof_fuse.host.state import DELETING, LIVE
from nvmeof_fuse.nvme import Cns, Completion, IdentifyNamespace, NVMeStatusError


def identify_namespace(nlb: int, lba_shift: int = 9, nguid: bytes = bytes(16)) -> bytes:
    data = bytearray(4096)
    struct.pack_into("<QQQ", data, 0, nlb, nlb, 0)
    data[104:120] = nguid
    struct.pack_into("<HBB", data, 128, 0, lba_shift, 0)  # one format, in use
    return bytes(data)


def active_ns_page(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids) + bytes(4096 - 4 * len(ids))


class Target:
    """Active namespaces as ``{nsid: nlb}`` (512-byte LBAs)."""

    def __init__(self, namespaces: dict[int, int]) -> None:
        self.namespaces = dict(namespaces)
        self.nguids: dict[int, bytes] = {}  # the NGUIDs they report (none by default)
        self.list_pages = 0  # Active Namespace ID list pages read

    async def identify_raw(self, cns: int, nsid: int = 0) -> bytes:
        if cns == Cns.ACTIVE_NS_LIST:  # those above nsid, a page at most
            self.list_pages += 1
            return active_ns_page([n for n in sorted(self.namespaces) if n > nsid][:1024])
        if cns == Cns.NS_DESCRIPTOR_LIST:
            return bytes(4096)  # an empty list: Identify Namespace's identifiers stand
        return identify_namespace(self.namespaces.get(nsid, 0),
                                  nguid=self.nguids.get(nsid, bytes(16)))


def controller(target: Target, known: dict[int, int], max_namespaces: int = 65536):
    ctrl = SimpleNamespace(options=SimpleNamespace(nqn="nqn.2014-08.org.example:t",
                                                   max_namespaces=max_namespaces),
                           identify_raw=target.identify_raw, namespaces={}, replaced=[])
    ctrl.namespace_replaced = lambda nsid, old, new: ctrl.replaced.append((nsid, old, new))
    for nsid, nlb in known.items():
        ctrl.namespaces[nsid] = Namespace(ctrl, nsid,
                                          IdentifyNamespace.from_bytes(identify_namespace(nlb)))
    return ctrl


def test_rescan_adds_removes_and_resizes_and_logs_each_change_in_one_line(caplog):
    target = Target({1: 100, 2: 300, 4: 8})
    ctrl = controller(target, {1: 100, 2: 200, 3: 50})
    removed = ctrl.namespaces[3]
    with caplog.at_level(logging.INFO, logger="nvmeof_fuse.host.events"):
        changes = trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    assert changes == [NamespaceChange("resized", 2, 200 * 512, 300 * 512),
                       NamespaceChange("removed", 3, 50 * 512, 0),
                       NamespaceChange("added", 4, 0, 8 * 512)]
    assert sorted(ctrl.namespaces) == [1, 2, 4] and ctrl.namespaces[2].nlb == 300
    assert caplog.messages == [f"namespace n2 resized from {200 * 512} to {300 * 512} bytes",
                               "namespace n3 removed", f"namespace n4 added ({8 * 512} bytes)"]
    with pytest.raises(NamespaceRemoved, match="namespace n3 was removed from nqn"):
        trio.run(removed.read_lbas, 0, 1)


def test_rescan_of_a_changed_list_looks_only_at_those():
    target = Target({1: 100, 2: 999})
    ctrl = controller(target, {1: 100, 2: 200})
    assert trio.run(rescan, ctrl, [1], partial(Namespace, ctrl)) == []
    assert ctrl.namespaces[2].nlb == 200


def test_a_namespace_whose_new_identify_we_cannot_serve_goes_unavailable_said_once(caplog):
    target = Target({1: 100})
    ctrl = controller(target, {1: 100})
    plain = target.identify_raw

    async def identify_raw(cns, nsid=0):
        data = bytearray(await plain(cns, nsid))
        if cns == Cns.NAMESPACE:
            data[130] = 63  # LBADS 63
        return bytes(data)

    ctrl.identify_raw = identify_raw
    with caplog.at_level(logging.INFO, logger="nvmeof_fuse.host.events"):
        for _ in range(2):
            trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    ns = ctrl.namespaces[1]
    assert ns.size == 0 and "LBADS 63" in ns.unavailable
    assert caplog.messages == ["nqn.2014-08.org.example:t: namespace n1 is unavailable: its "
                               "LBA size 2^63 bytes (LBADS 63) is outside 512 B to 64 KiB",
                               f"namespace n1 resized from {100 * 512} to 0 bytes"]


NGUID_A, NGUID_B = bytes(range(16)), bytes(range(16, 32))


def test_a_namespace_of_another_identity_is_replaced_and_said_in_one_line(caplog):
    """Another NGUID behind n1, the same size: the old namespace refuses I/O (EIO), a new
    one of the next generation takes the NSID, the controller is told at once, and one
    line names the NSID and both identities.  n2, whose size changed, is resized."""
    target = Target({1: 100, 2: 100})
    target.nguids = {1: NGUID_A, 2: bytes(range(32, 48))}
    ctrl = controller(target, {})
    new_namespace = partial(Namespace, ctrl)
    trio.run(rescan, ctrl, None, new_namespace)  # found, with their identities
    old = ctrl.namespaces[1]
    target.nguids[1], target.namespaces[2] = NGUID_B, 200
    with caplog.at_level(logging.INFO, logger="nvmeof_fuse.host.events"):
        changes = trio.run(rescan, ctrl, None, new_namespace)
    new = ctrl.namespaces[1]
    assert new is not old and new.identity.ids.nguid == NGUID_B
    assert [c.kind for c in changes] == ["replaced", "resized"]
    assert (changes[0].nsid, changes[0].old_size, changes[0].new_size) == (1, 51200, 51200)
    assert ctrl.replaced == [(1, old, new)]
    (line, resized) = caplog.messages
    assert line == changes[0].detail and "\n" not in line
    assert line.startswith(f"namespace n1 of nqn.2014-08.org.example:t is another namespace "
                           f"now (NGUID {NGUID_A.hex()} != {NGUID_B.hex()}): it was NGUID "
                           f"{NGUID_A.hex()}, 512 B LBAs, it is NGUID {NGUID_B.hex()}")
    assert caplog.records[0].levelno == logging.WARNING and "n2 resized" in resized
    with pytest.raises(NamespaceReplaced, match="namespace n1 of nqn.2014-08.org.example:t "
                       "was replaced by another namespace \\(NGUID"):
        trio.run(old.read_lbas, 0, 1)
    assert trio.run(rescan, ctrl, None, new_namespace) == []  # and it stays the new one


def test_without_identifiers_another_size_is_another_namespace():
    target = Target({1: 100})
    ctrl = controller(target, {})
    trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    target.namespaces[1] = 50
    (change,) = trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    assert change.kind == "replaced" and "size 100 != 50 LBAs, with no identifiers" in \
        change.detail


def test_a_namespace_found_with_another_ones_identifiers_is_refused(caplog):
    target = Target({1: 100, 2: 100})
    target.nguids = {1: NGUID_A, 2: NGUID_B}
    ctrl = controller(target, {})
    trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    target.nguids[2] = NGUID_A  # n2 answers with n1's identifiers now
    with caplog.at_level(logging.WARNING, logger="nvmeof_fuse.host.events"):
        (change,) = trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    assert change.kind == "replaced" and change.nsid == 2
    assert ctrl.namespaces[2].size == 0 and not ctrl.namespaces[1].unavailable
    assert ("nqn.2014-08.org.example:t: namespace n2 is unavailable: it reports the "
            f"identifiers of namespace n1 (NGUID {NGUID_A.hex()})") in caplog.messages


class AdminQueue:
    """Answers each AER with the next event of ``events``; then waits."""

    def __init__(self, events: list[int]) -> None:
        self.events = list(events)
        self.armed = 0
        self.idle = trio.Event()

    async def execute(self, sqe, data=None, *, to_controller=False, timeout):
        self.armed += 1
        if not self.events:
            self.idle.set()
            await trio.sleep_forever()
        return Completion(self.events.pop(0), 0, 0, 0, 0, True)


def test_each_event_is_handled_and_the_request_re_armed():
    ns_changed = 0x04 << 16 | 0x00 << 8 | 0x2

    async def main():
        admin = AdminQueue([ns_changed, ns_changed])
        pages = []

        async def get_log_page(lid, length, offset=0):
            pages.append(lid)
            return struct.pack("<2I", 5, 0) + bytes(length - 8)

        seen = []

        async def listener(changes):
            seen.append(changes)

        target = Target({5: 10})
        ctrl = SimpleNamespace(admin=admin, state=LIVE, identify=None, namespaces={},
                               options=SimpleNamespace(nqn="nqn.2014-08.org.example:t"),
                               identify_raw=target.identify_raw, get_log_page=get_log_page)

        async def wait_connected():
            return True

        ctrl.wait_connected = wait_connected
        events = AsyncEvents(ctrl, partial(Namespace, ctrl))
        events.listeners.append(listener)
        async with trio.open_nursery() as nursery:
            await nursery.start(events.run)
            await admin.idle.wait()
            nursery.cancel_scope.cancel()
        assert admin.armed == 3 and events.events == 2 and pages == [0x04, 0x04]
        assert seen == [[NamespaceChange("added", 5, 0, 10 * 512)]]  # the second: no change

    trio.run(main)


def test_after_a_reconnect_the_changes_found_before_io_resumed_are_told_once_re_armed():
    """The rescan runs before the controller is live again (check_after_reconnect: the
    change is applied then); the listeners hear of it once the loop sees the new admin
    queue, and no rescan runs again then."""

    async def main():
        target = Target({1: 10})
        ctrl = controller(target, {})
        ctrl.admin, ctrl.state, ctrl.identify = AdminQueue([]), LIVE, None

        async def wait_connected():
            return True

        ctrl.wait_connected = wait_connected
        ctrl.connection_lost = lambda queue, exc: None
        events = AsyncEvents(ctrl, partial(Namespace, ctrl))
        seen = []

        async def listener(changes):
            seen.append(changes)

        events.listeners.append(listener)
        await events.check_after_reconnect()
        assert sorted(ctrl.namespaces) == [1] and seen == []  # applied, not told yet
        pages = target.list_pages
        lost = trio.Event()

        class LostQueue:  # the AER's queue, lost: its AER fails once reconnected
            async def execute(self, sqe, data=None, *, to_controller=False, timeout):
                await lost.wait()
                raise TransportError("lost")

        ctrl.admin = LostQueue()
        async with trio.open_nursery() as nursery:
            await nursery.start(events.run)
            ctrl.admin = AdminQueue([])  # reconnected
            lost.set()
            await ctrl.admin.idle.wait()
            nursery.cancel_scope.cancel()
        assert seen == [[NamespaceChange("added", 1, 0, 10 * 512)]]
        assert target.list_pages == pages

    trio.run(main)


@pytest.mark.parametrize("state", [LIVE, DELETING])
def test_a_failed_rescan_warns_only_while_the_controller_is_live(caplog, state):
    """nvmet answers Command Sequence Error once shutdown began: that is no news to log."""

    async def identify_raw(cns, nsid=0):
        raise NVMeStatusError(0x0C | 0x4000, "Identify")  # Command Sequence Error, DNR

    ctrl = SimpleNamespace(state=state, identify_raw=identify_raw, namespaces={},
                           options=SimpleNamespace(nqn="nqn.2014-08.org.example:t"))
    with caplog.at_level(logging.WARNING, logger="nvmeof_fuse.host.events"):
        trio.run(AsyncEvents(ctrl, partial(Namespace, ctrl))._rescan, None)
    if state is LIVE:
        assert caplog.messages == ["namespace rescan failed: Identify failed: Command Sequence "
                                   "Error (sct 0x0, sc 0x0c, dnr)"]
    else:
        assert caplog.messages == []


def test_rescan_reads_the_active_namespace_list_page_after_page():
    target = Target({nsid: 8 for nsid in range(1, 2500)} | {5000: 8})
    ctrl = controller(target, {})
    changes = trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    assert len(changes) == 2500 and sorted(ctrl.namespaces)[-2:] == [2499, 5000]
    assert target.list_pages == 3  # 1024 + 1024 + 452: the third is not full


def test_a_list_of_exactly_full_pages_ends_with_an_empty_one():
    target = Target({nsid: 8 for nsid in range(1, 2049)})
    assert trio.run(active_nsids, controller(target, {})) == list(range(1, 2049))
    assert target.list_pages == 3


class Endless(Target):
    async def identify_raw(self, cns, nsid=0):
        self.list_pages += 1
        return active_ns_page(list(range(nsid + 1, nsid + 1025)))


def test_a_target_whose_list_never_ends_is_read_to_a_bound_and_says_so(caplog):
    target = Endless({})
    with caplog.at_level(logging.WARNING, logger="nvmeof_fuse.host.events"):
        nsids = trio.run(active_nsids, controller(target, {}))
    assert target.list_pages == 64 + COUNT_PAGES_MAX  # to the cap, then to count
    assert nsids == list(range(1, 65537))
    assert caplog.messages == ["nqn.2014-08.org.example:t: serving the first 65536 of more "
                               f"than {65536 + COUNT_PAGES_MAX * 1024} namespaces "
                               "(--max-namespaces)"]


def test_a_listed_namespace_that_is_not_there_is_no_refusal(caplog):
    """An NSID the list names whose Identify Namespace says size 0 is not served, and the
    cap has nothing to do with it."""
    target = Target({1: 8, 2: 0, 3: 8})
    ctrl = controller(target, {}, max_namespaces=4)
    with caplog.at_level(logging.WARNING, logger="nvmeof_fuse.host.events"):
        trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    assert sorted(ctrl.namespaces) == [1, 3] and caplog.messages == []


def test_a_list_of_exactly_the_cap_is_served_whole_and_refuses_nothing(caplog):
    target = Target({nsid: 8 for nsid in range(1, 4097)})
    with caplog.at_level(logging.WARNING, logger="nvmeof_fuse.host.events"):
        nsids = trio.run(active_nsids, controller(target, {}, max_namespaces=4096))
    assert nsids == list(range(1, 4097)) and caplog.messages == []
    assert target.list_pages == 5  # the fifth, empty, says the list ended


def test_namespaces_past_the_cap_are_refused_in_one_line_said_again_only_when_it_changes(
        caplog):
    target = Target({nsid: 8 for nsid in range(1, 3001)})
    ctrl = controller(target, {}, max_namespaces=1000)
    with caplog.at_level(logging.INFO, logger="nvmeof_fuse.host.events"):
        assert trio.run(active_nsids, ctrl) == list(range(1, 1001))
        changes = trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
        assert len(changes) == 1000 and sorted(ctrl.namespaces) == list(range(1, 1001))
        caplog.clear()
        for _ in range(3):  # the same again: nothing to say
            assert trio.run(rescan, ctrl, None, partial(Namespace, ctrl)) == []
        assert caplog.messages == []
        target.namespaces[5000] = 8
        trio.run(rescan, ctrl, [5000], partial(Namespace, ctrl))
    assert 5000 not in ctrl.namespaces
    assert caplog.messages == ["nqn.2014-08.org.example:t: serving the first 1000 of 3001 "
                               "namespaces (--max-namespaces)"]


def test_a_rescan_keeps_what_it_serves_when_namespaces_past_the_cap_come_first():
    """A namespace added below those served does not push one out: it waits for room."""
    target = Target({nsid: 8 for nsid in range(10, 20)})
    ctrl = controller(target, {}, max_namespaces=10)
    trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    target.namespaces[1] = 8
    assert trio.run(rescan, ctrl, None, partial(Namespace, ctrl)) == []
    assert sorted(ctrl.namespaces) == list(range(10, 20))
    del target.namespaces[15]
    changes = trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    assert changes == [NamespaceChange("added", 1, 0, 8 * 512),
                       NamespaceChange("removed", 15, 8 * 512, 0)]


def test_a_scan_identifies_namespaces_side_by_side_bounded():
    class Counting(Target):
        in_flight = most = 0

        async def identify_raw(self, cns, nsid=0):
            if cns != Cns.NAMESPACE:
                return await super().identify_raw(cns, nsid)
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            await trio.sleep(0.001)
            self.in_flight -= 1
            return await super().identify_raw(cns, nsid)

    target = Counting({nsid: 8 for nsid in range(1, 200)})
    ctrl = controller(target, {})
    assert len(trio.run(rescan, ctrl, None, partial(Namespace, ctrl))) == 199
    assert target.most == IDENTIFY_IN_FLIGHT


def test_a_full_page_that_goes_back_ends_the_list():
    class Repeating(Target):
        async def identify_raw(self, cns, nsid=0):
            self.list_pages += 1
            return active_ns_page(list(range(1, 1025)))  # the first page, whatever we ask

    target = Repeating({})
    assert trio.run(active_nsids, controller(target, {})) == list(range(1, 1025))
    assert target.list_pages == 2


def test_a_full_page_that_ends_at_the_last_nsid_ends_the_list():
    """No NSID follows 0xFFFFFFFE, and asking for those above it is invalid."""
    last = list(range(0xFFFFFFFE - 1023, 0xFFFFFFFF))
    target = Target({nsid: 8 for nsid in last})
    assert trio.run(active_nsids, controller(target, {})) == last
    assert target.list_pages == 1


def test_a_namespace_gone_since_the_active_list_was_read_is_removed_and_the_rescan_goes_on(
        caplog):
    """The list names n2 and n3; Identify Namespace of n2 then says Invalid Namespace or
    Format (it went away meanwhile): n2 is removed, n3 still rescanned."""
    target = Target({1: 100, 2: 100, 3: 300})
    ctrl = controller(target, {1: 100, 2: 100, 3: 100})
    plain = target.identify_raw

    async def identify_raw(cns, nsid=0):
        if cns == Cns.NAMESPACE and nsid == 2:
            raise NVMeStatusError(0x0B, "Identify")
        return await plain(cns, nsid)

    ctrl.identify_raw = identify_raw
    with caplog.at_level(logging.INFO, logger="nvmeof_fuse.host.events"):
        changes = trio.run(rescan, ctrl, [2, 3], partial(Namespace, ctrl))
    assert changes == [NamespaceChange("removed", 2, 100 * 512, 0),
                       NamespaceChange("resized", 3, 100 * 512, 300 * 512)]
    assert sorted(ctrl.namespaces) == [1, 3]
    assert caplog.messages == ["namespace n2 removed",
                               f"namespace n3 resized from {100 * 512} to {300 * 512} bytes"]


def test_another_identify_status_fails_the_rescan_and_removes_nothing():
    target = Target({1: 100})
    ctrl = controller(target, {1: 100})
    plain = target.identify_raw

    async def identify_raw(cns, nsid=0):
        if cns == Cns.NAMESPACE:
            raise NVMeStatusError(0x0C | 0x4000, "Identify")  # Command Sequence Error, DNR
        return await plain(cns, nsid)

    ctrl.identify_raw = identify_raw
    with pytest.raises(NVMeStatusError):
        trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    assert sorted(ctrl.namespaces) == [1]


def test_a_rescan_of_many_changes_logs_one_line_per_kind(caplog):
    target = Target({nsid: 8 for nsid in range(1, 1001)})
    ctrl = controller(target, {5000: 8})
    with caplog.at_level(logging.INFO, logger="nvmeof_fuse.host.events"):
        changes = trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    assert len(changes) == 1001
    assert caplog.messages == ["1,000 namespaces added: n1, n2, n3, n4, n5, n6, n7, n8 and "
                               "992 more", "1 namespaces removed: n5000"]
    assert describe_changes(changes[:2]) == [f"namespace n{n} added ({8 * 512} bytes)"
                                             for n in (1, 2)]


def test_a_target_that_answers_every_event_request_at_once_is_paced():
    """Each AER completes at once with a SMART notice: at most EVENTS_PER_SECOND are taken
    a second (on trio's clock, jumped ahead whenever the loop waits)."""
    smart = 0x02 << 16 | 0x01 << 8 | 0x1

    class Storm:
        armed = 0

        async def execute(self, sqe, data=None, *, to_controller=False, timeout):
            self.armed += 1
            await trio.lowlevel.checkpoint()
            return Completion(smart, 0, 0, 0, 0, True)

    async def main():
        admin = Storm()
        ctrl = SimpleNamespace(admin=admin, state=LIVE, identify=None, namespaces={},
                               options=SimpleNamespace(nqn="nqn.2014-08.org.example:t"))

        async def wait_connected():
            return True

        ctrl.wait_connected = wait_connected
        events = AsyncEvents(ctrl, partial(Namespace, ctrl))
        async with trio.open_nursery() as nursery:
            await nursery.start(events.run)
            await trio.sleep(10)
            nursery.cancel_scope.cancel()
        assert 10 * EVENTS_PER_SECOND <= events.events <= 11 * EVENTS_PER_SECOND, events.events

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_rescan_whose_identify_fails_applies_nothing_and_the_next_applies_all():
    """A rescan identifies every namespace before it applies any change: one that fails
    (the connection went again, after a reconnect) leaves n1 as it was, refusing nothing
    yet and serving nothing (the controller is not live), and the next rescan, which the
    next reconnect runs, replaces it."""
    target = Target({1: 100, 2: 100})
    target.nguids = {1: NGUID_A, 2: NGUID_B}
    ctrl = controller(target, {})
    trio.run(rescan, ctrl, None, partial(Namespace, ctrl))
    old = ctrl.namespaces[1]
    target.nguids[1] = bytes(range(48, 64))
    plain = target.identify_raw

    async def identify_raw(cns, nsid=0):
        if nsid == 2 and cns == Cns.NAMESPACE:
            raise TransportError("admin queue: the connection went again")
        return await plain(cns, nsid)

    ctrl.identify_raw = identify_raw
    kept: list[NamespaceChange] = []
    with pytest.raises(TransportError):
        trio.run(rescan, ctrl, None, partial(Namespace, ctrl), kept)
    assert kept == [] and ctrl.namespaces[1] is old
    ctrl.identify_raw = plain
    trio.run(rescan, ctrl, None, partial(Namespace, ctrl), kept)
    assert [(c.kind, c.nsid) for c in kept] == [("replaced", 1)]
    assert ctrl.namespaces[1] is not old and old.removed
