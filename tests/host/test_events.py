"""Namespace rescans and the AER loop over a fake controller (the target's side faked)."""

from __future__ import annotations

import logging
import struct
from functools import partial
from types import SimpleNamespace

import pytest
import trio

from nvmeof_fuse.errors import NamespaceRemoved
from nvmeof_fuse.host.events import (
    ACTIVE_NS_PAGES_MAX,
    AsyncEvents,
    NamespaceChange,
    active_nsids,
    rescan,
)
from nvmeof_fuse.host.namespace import Namespace
from nvmeof_fuse.host.state import DELETING, LIVE
from nvmeof_fuse.nvme import Cns, Completion, IdentifyNamespace, NVMeStatusError


def identify_namespace(nlb: int, lba_shift: int = 9) -> bytes:
    data = bytearray(4096)
    struct.pack_into("<QQQ", data, 0, nlb, nlb, 0)
    struct.pack_into("<HBB", data, 128, 0, lba_shift, 0)  # one format, in use
    return bytes(data)


def active_ns_page(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids) + bytes(4096 - 4 * len(ids))


class Target:
    """Active namespaces as ``{nsid: nlb}`` (512-byte LBAs)."""

    def __init__(self, namespaces: dict[int, int]) -> None:
        self.namespaces = dict(namespaces)
        self.list_pages = 0  # Active Namespace ID list pages read

    async def identify_raw(self, cns: int, nsid: int = 0) -> bytes:
        if cns == Cns.ACTIVE_NS_LIST:  # those above nsid, a page at most
            self.list_pages += 1
            return active_ns_page([n for n in sorted(self.namespaces) if n > nsid][:1024])
        return identify_namespace(self.namespaces.get(nsid, 0))


def controller(target: Target, known: dict[int, int]):
    ctrl = SimpleNamespace(options=SimpleNamespace(nqn="nqn.2014-08.org.example:t"),
                           identify_raw=target.identify_raw, namespaces={})
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


def test_a_target_whose_list_never_ends_is_read_to_a_bound_and_says_so(caplog):
    class Endless(Target):
        async def identify_raw(self, cns, nsid=0):
            self.list_pages += 1
            return active_ns_page(list(range(nsid + 1, nsid + 1025)))

    target = Endless({})
    with caplog.at_level(logging.WARNING, logger="nvmeof_fuse.host.events"):
        nsids = trio.run(active_nsids, controller(target, {}))
    assert target.list_pages == ACTIVE_NS_PAGES_MAX
    assert nsids == list(range(1, ACTIVE_NS_PAGES_MAX * 1024 + 1))
    assert caplog.messages == [f"nqn.2014-08.org.example:t: the active namespace list goes on "
                               f"past {ACTIVE_NS_PAGES_MAX} pages; serving its first "
                               f"{len(nsids)} namespaces"]


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
