"""The watchdog both transports park their callers with: deadlines, expiry, nearer deadlines."""

from __future__ import annotations

import math
import threading
from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from nvmeof_fuse.errors import CommandTimeout
from nvmeof_fuse.transport.parking import Watchdog, time_out


def request(cid: int) -> SimpleNamespace:
    return SimpleNamespace(cid=cid, task=None, deadline=math.inf, timeout=0.0)


HANG_GUARD = 60  # s of real time: a hang fails the test instead of stalling the suite


class Queue:
    """What a queue gives the watchdog: its requests, and an expire that times them out."""

    def __init__(self) -> None:
        self.pending: dict[int, SimpleNamespace] = {}
        self.watchdog = Watchdog(
            lambda: (r for r in self.pending.values() if r.task is not None), self.expire)

    def expire(self, now: float) -> None:
        for r in list(self.pending.values()):
            if r.task is not None and r.deadline <= now:
                time_out(r, "I/O queue 1")


@asynccontextmanager
async def watched(*cids: int):
    """A queue with requests ``cids`` in flight, its watchdog running; the nursery too."""
    queue = Queue()
    for cid in cids:
        queue.pending[cid] = request(cid)
    async with trio.open_nursery() as nursery:
        await nursery.start(queue.watchdog.run)
        yield queue, nursery
        nursery.cancel_scope.cancel()


def run(test) -> None:
    """On a clock that jumps to the next deadline.  A parked caller cannot be cancelled, so a
    lost wakeup would spin trio for ever: it runs in a thread that fails the test instead."""
    outcome: list = []

    def target() -> None:
        try:
            trio.run(test, clock=trio.testing.MockClock(autojump_threshold=0))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - raised again below
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD)
    assert outcome, f"a parked caller was still parked after {HANG_GUARD} s"
    if outcome[0] is not None:
        raise outcome[0]


def test_a_caller_past_its_deadline_gets_command_timeout():
    async def main():
        async with watched(7) as (queue, _):
            r = queue.pending[7]
            with pytest.raises(CommandTimeout, match="I/O queue 1: command 7 got no completion "
                                                     "within 5 s"):
                await queue.watchdog.park(r, 5.0)
            assert trio.current_time() == pytest.approx(5.0)
            assert r.task is None

    run(main)


def test_a_finished_request_lets_its_caller_go_and_cancelling_it_does_not():
    async def main():
        done = []
        scope = trio.CancelScope()

        async def caller(queue, r):
            with scope:
                await queue.watchdog.park(r, 60.0)
                done.append(trio.current_time())

        async with watched(1) as (queue, nursery):
            r = queue.pending[1]
            nursery.start_soon(caller, queue, r)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()  # the target may still be moving data: the caller stays
            await trio.testing.wait_all_tasks_blocked()
            assert not done and r.task is not None
            task, r.task = r.task, None
            del queue.pending[1]
            trio.lowlevel.reschedule(task)  # what the queue does once the command finished
            await trio.testing.wait_all_tasks_blocked()
            assert done == [0.0]

    run(main)


def test_a_nearer_deadline_parked_later_is_watched_from_then_on():
    async def main():
        ended = {}

        async def caller(queue, r, timeout):
            try:
                await queue.watchdog.park(r, timeout)
            except CommandTimeout:
                ended[r.cid] = trio.current_time()

        async with watched(1, 2) as (queue, nursery):
            nursery.start_soon(caller, queue, queue.pending[1], 100.0)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(caller, queue, queue.pending[2], 3.0)
            await trio.sleep(200)
        assert ended == {2: pytest.approx(3.0), 1: pytest.approx(100.0)}

    run(main)


def test_a_cut_ends_the_waits_in_flight_by_its_deadline_and_their_message_says_so():
    """The mount stops (Controller.wind_down): commands in flight with the whole command
    timeout ahead of them time out by the mount's deadline instead; nearer ones keep theirs."""
    async def main():
        ended = {}

        async def caller(queue, r, timeout):
            try:
                await queue.watchdog.park(r, timeout)
            except CommandTimeout as exc:
                ended[r.cid] = (trio.current_time(), str(exc))

        async with watched(1, 2) as (queue, nursery):
            nursery.start_soon(caller, queue, queue.pending[1], 30.0)
            nursery.start_soon(caller, queue, queue.pending[2], 4.0)
            await trio.sleep(2)
            queue.watchdog.cut(trio.current_time() + 7.5)
            await trio.sleep(100)
        assert ended == {
            1: (pytest.approx(9.5), "I/O queue 1: command 1 got no completion within 9.5 s"),
            2: (pytest.approx(4.0), "I/O queue 1: command 2 got no completion within 4 s")}

    run(main)
