"""The final flush at unmount (daemon.flush_all): only the namespaces written since their
last flush, a bounded number at a time, within one bound for all, each outcome in one line."""

from __future__ import annotations

import logging

import trio
import trio.testing

from nvmeof_fuse import daemon
from nvmeof_fuse.errors import TransportError


class Ns:
    """A namespace that counts its flushes and the flushes in flight of its controller."""

    def __init__(self, ctrl: Ctrl, nsid: int, written: bool) -> None:
        self.ctrl, self.nsid, self.written = ctrl, nsid, written
        self.flushes = 0
        self.fail: Exception | None = None
        self.hang = False

    async def flush(self) -> None:
        ctrl = self.ctrl
        ctrl.in_flight += 1
        ctrl.most = max(ctrl.most, ctrl.in_flight)
        try:
            await trio.sleep(1 if not self.hang else 3600)
            if self.fail is not None:
                raise self.fail
            self.flushes += 1
            self.written = False
        finally:
            ctrl.in_flight -= 1


class Ctrl:
    state = "live"

    def __init__(self, count: int, written: set[int]) -> None:
        self.in_flight = self.most = 0
        self.namespaces = {n: Ns(self, n, n in written) for n in range(1, count + 1)}


def flush_all(ctrl: Ctrl, caplog) -> float:
    """Run the final flush on a mock clock; how long it took."""
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def main() -> float:
        await daemon.flush_all(ctrl)
        return trio.current_time()

    with caplog.at_level(logging.INFO, logger="nvmeof-fuse"):
        return trio.run(main, clock=clock)


def test_only_the_namespaces_written_are_flushed_a_bounded_number_at_a_time(caplog):
    written = set(range(1, 65537, 1000))  # 66 of 65,536
    ctrl = Ctrl(65536, written)
    took = flush_all(ctrl, caplog)
    assert {n for n, ns in ctrl.namespaces.items() if ns.flushes} == written
    assert all(ns.flushes == 1 for n, ns in ctrl.namespaces.items() if n in written)
    assert ctrl.most == daemon.FLUSHES_IN_FLIGHT
    assert took == -(-len(written) // daemon.FLUSHES_IN_FLIGHT)  # 1 s each, 8 at a time
    assert caplog.messages == ["flushed n1, n1001, n2001, n3001, n4001, n5001, n6001, n7001 "
                               "and 58 more (the 66 of 65536 namespaces written since their "
                               "last flush)"]


def test_nothing_written_sends_no_flush_and_says_nothing(caplog):
    ctrl = Ctrl(1024, set())
    assert flush_all(ctrl, caplog) == 0
    assert ctrl.most == 0 and caplog.messages == []


def test_a_namespace_that_cannot_say_whether_it_was_written_is_flushed(caplog):
    ctrl = Ctrl(2, set())
    del ctrl.namespaces[2].written  # a stand-in of the namespace API without the flag
    flush_all(ctrl, caplog)
    assert [ns.flushes for ns in ctrl.namespaces.values()] == [0, 1]


def test_failures_are_one_line_and_the_others_still_flushed(caplog):
    ctrl = Ctrl(20, set(range(1, 21)))
    for nsid in (3, 7, 9):
        ctrl.namespaces[nsid].fail = TransportError("the connection is gone")
    flush_all(ctrl, caplog)
    assert sum(ns.flushes for ns in ctrl.namespaces.values()) == 17
    assert caplog.messages == [
        "flushed n1, n2, n4, n5, n6, n8, n10, n11 and 9 more (the 20 of 20 namespaces "
        "written since their last flush)",
        "final flush of n3 failed: the connection is gone (and of 2 more)"]


def test_the_final_flush_ends_within_its_bound_and_says_what_was_not_flushed(caplog):
    ctrl = Ctrl(100, set(range(1, 101)))
    for nsid in (50, 60):
        ctrl.namespaces[nsid].hang = True  # a target that never answers these
    took = flush_all(ctrl, caplog)
    assert took == daemon.FLUSH_TIMEOUT
    flushed = {n for n, ns in ctrl.namespaces.items() if ns.flushes}
    assert 50 not in flushed and 60 not in flushed
    left = sorted(set(range(1, 101)) - flushed)
    assert caplog.messages[-1] == (
        f"final flush not done within {daemon.FLUSH_TIMEOUT:g} s: "
        + ", ".join(f"n{n}" for n in left[:8])
        + (f" and {len(left) - 8} more" if len(left) > 8 else "") + " not flushed")


def test_no_final_flush_while_the_controller_is_not_live(caplog):
    ctrl = Ctrl(2, {1, 2})
    ctrl.state = "resetting"
    flush_all(ctrl, caplog)
    assert ctrl.most == 0
    assert caplog.messages == ["no final flush: the connection to the controller is resetting"]
