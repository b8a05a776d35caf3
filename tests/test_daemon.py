"""The mount's exit (daemon.py): its plan, one deadline split between the drain, the final
flush and the orderly shutdown; and the final flush (flush_all): only the namespaces written
since their last flush, a bounded number at a time, by the plan's deadline, each outcome in
one line."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from host.test_controller import OK, FakeQueue, ShutdownQueue, run

from nvmeof_fuse import daemon
from nvmeof_fuse.errors import CommandTimeout, ControllerLost, TransportError
from nvmeof_fuse.host.controller import Controller
from nvmeof_fuse.nvme import command as cmd


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


FLUSH_BY = 9.0  # s: what the default exit plan leaves the final flush (14 s less 5 s)


def flush_all(ctrl: Ctrl, caplog, skipped: list[str] | None = None) -> float:
    """Run the final flush on a mock clock, by FLUSH_BY; how long it took."""
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def main() -> float:
        said = await daemon.flush_all(ctrl, FLUSH_BY)
        if skipped is not None:
            skipped.extend(said)
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


def test_the_final_flush_ends_by_its_deadline_and_says_what_was_not_flushed(caplog):
    """Flushes that ignore the deadline (a stand-in whose waits are not cut) are left
    behind FLUSH_BACKSTOP after it; each one not flushed is named."""
    ctrl = Ctrl(100, set(range(1, 101)))
    for nsid in (50, 60):
        ctrl.namespaces[nsid].hang = True  # a target that never answers these
    skipped: list[str] = []
    took = flush_all(ctrl, caplog, skipped)
    assert took == FLUSH_BY + daemon.FLUSH_BACKSTOP
    flushed = {n for n, ns in ctrl.namespaces.items() if ns.flushes}
    assert 50 not in flushed and 60 not in flushed
    left = sorted(set(range(1, 101)) - flushed)
    said = ("final flush of " + ", ".join(f"n{n}" for n in left[:8])
            + (f" and {len(left) - 8} more" if len(left) > 8 else "")
            + f" not confirmed within {FLUSH_BY:g} s")
    assert caplog.messages[-1] == said and skipped == [said]


def test_a_flush_cut_by_the_deadline_is_not_confirmed_rather_than_failed(caplog):
    """The namespace's command timed out at the deadline (its timeout was cut to it:
    Controller.wind_down), and its retry failed: that is a flush not confirmed in time."""
    ctrl = Ctrl(3, {1, 2, 3})
    ns = ctrl.namespaces[2]
    ns.hang = True

    async def cut_flush() -> None:
        await trio.sleep_until(FLUSH_BY)
        raise ControllerLost("/mnt is being unmounted (I/O queue 1: command 3 got no "
                             "completion within 9 s (its connection is closed))")

    ns.flush = cut_flush
    skipped: list[str] = []
    assert flush_all(ctrl, caplog, skipped) == FLUSH_BY
    assert caplog.messages == [
        "flushed n1, n3 (the 3 of 3 namespaces written since their last flush)",
        "final flush of n2 not confirmed within 9 s"]
    assert skipped == ["final flush of n2 not confirmed within 9 s"]


def test_no_final_flush_while_the_controller_is_not_live(caplog):
    ctrl = Ctrl(2, {1, 2})
    ctrl.state = "resetting"
    skipped: list[str] = []
    flush_all(ctrl, caplog, skipped)
    assert ctrl.most == 0
    assert caplog.messages == ["no final flush: the connection to the controller is resetting"]
    assert skipped == caplog.messages


# -- the exit's plan ------------------------------------------------------------------------


@pytest.mark.parametrize(("shutdown_timeout", "drain", "flush", "end"), [
    (5, 6, 9, 14),  # the default: the flush gets 9 s, the drain 6 s of them
    (10, 1, 4, 14),  # RTD3E's most: the flush keeps FLUSH_LEAST after the drain
    (1, 10, 13, 14),  # a short --shutdown-timeout leaves the rest to the flush
    (30, 0, 3, 33),  # a longer one is the user's to ask for: it alone stretches the exit
])
def test_the_exit_plan_keeps_the_shutdowns_timeout_and_the_flushs_least(
        shutdown_timeout, drain, flush, end):
    plan = daemon.ExitPlan.starting(100.0, shutdown_timeout)
    assert (plan.drain_by, plan.flush_by, plan.exit_by) == (100 + drain, 100 + flush, 100 + end)
    assert plan.exit_by - plan.flush_by == shutdown_timeout
    assert plan.flush_by - plan.drain_by == daemon.FLUSH_LEAST
    assert daemon.EXIT_TIMEOUT < 15  # issue #56: the daemon ends within 15 s


class Flushing(FakeQueue):
    """An I/O queue whose target answers a Flush after ``delay`` s (None: never); its
    commands time out at their timeouts, which wind_down cuts."""

    def __init__(self, delay: float | None) -> None:
        super().__init__(1)
        self.delay = delay

    async def execute(self, sqe, data=None, *, to_controller=False, timeout):
        wait = timeout if self.delay is None else min(self.delay, timeout)
        with trio.CancelScope(shield=True):
            await trio.sleep(wait)
        if self.delay is None or self.delay > timeout:
            raise CommandTimeout(f"I/O queue 1: command 1 got no completion within "
                                 f"{timeout:g} s (its connection is closed)")
        return OK


@pytest.mark.parametrize(("flush_s", "shutdown", "took", "notes"), [
    (0.5, "done", 0.5, []),  # a healthy target: nothing skipped
    (None, "done", 9.0, ["final flush of n1 not confirmed within 9 s",
                         "no orderly shutdown: the controller was connecting"]),
    (8.5, "never", 13.5, ["shutdown not confirmed within 5 s (CSTS.SHST not set)"]),
    (None, "never", 9.0, ["final flush of n1 not confirmed within 9 s",
                          "no orderly shutdown: the controller was connecting"]),
], ids=["healthy", "flush never answered", "slow flush, shutdown never", "nothing answered"])
def test_the_exit_of_a_controller_ends_within_the_plan_whatever_the_target_does(
        flush_s, shutdown, took, notes, caplog):
    """The split on a real Controller (its queues faked), on a mock clock: the mount winds
    the controller down by the plan's flush deadline, flushes, then shuts it down with its
    own timeout.  A Flush never answered is cut at 9 s (its timeout cost the connection, so
    no orderly shutdown is possible); one answered at 8.5 s leaves the shutdown its 5 s."""
    async def exit_of(ctrl: Controller) -> list[str]:
        plan = daemon.ExitPlan.starting(trio.current_time(), ctrl.shutdown_timeout())
        ctrl.wind_down("/mnt is being unmounted", plan.flush_by)
        skipped = await daemon.flush_all(ctrl, plan.flush_by)
        await ctrl.shutdown("unmounting")
        assert trio.current_time() <= plan.exit_by
        return skipped + ([ctrl.shutdown_note] if ctrl.shutdown_note else [])

    async def test(ctrl: Controller) -> None:
        ctrl.io_queues = [Flushing(flush_s)]
        ctrl.admin = ShutdownQueue(shutdown)
        ctrl.cap = SimpleNamespace(timeout_ms=127_500)
        ctrl.identify = SimpleNamespace(rtd3e=0)
        ns = SimpleNamespace(written=True)

        async def flush() -> None:
            await ctrl.io_command(cmd.flush(1))

        ns.flush = flush
        ctrl.namespaces = {1: ns}
        start = trio.current_time()
        assert await exit_of(ctrl) == notes
        assert trio.current_time() - start == pytest.approx(took, abs=0.1)

    with caplog.at_level(logging.INFO, logger="nvmeof-fuse"):
        run(test)
