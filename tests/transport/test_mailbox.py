"""The one bridge from a queue's threads into trio: order, batches, a thread's end, drain."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from nvmeof_fuse.transport.mailbox import Mailbox

HANG_GUARD = 30  # s of real time: a hang fails the test instead of stalling the suite


class HeldWakeups:
    """A trio token whose wakeups never come: only Mailbox.drain hands anything over."""

    def __init__(self) -> None:
        self.asked = 0

    def run_sync_soon(self, fn, *args) -> None:
        self.asked += 1


def run(test) -> None:
    async def main():
        with trio.fail_after(HANG_GUARD):
            await test()

    trio.run(main)


def test_a_threads_posts_arrive_in_order_and_before_its_end():
    async def test():
        got = []
        mailbox = Mailbox(lambda batch: got.append((threading.current_thread().name, batch)))

        def work():
            for i in range(50):
                mailbox.post([i, -i])
            return "result"

        assert await mailbox.run_in_thread(work) == "result"
        # all handled on the trio thread, in order, before the thread's end came back
        assert {name for name, _ in got} == {threading.main_thread().name}
        assert [item for _, batch in got for item in batch] == [x for i in range(50)
                                                               for x in (i, -i)]

    run(test)


def test_posts_waiting_together_take_one_wakeup():
    async def test():
        got = []
        mailbox = Mailbox(got.append)
        mailbox._token = held = HeldWakeups()
        for i in range(3):
            await trio.to_thread.run_sync(mailbox.post, [i])
        assert got == [] and held.asked == 1  # the first post asked for a wakeup, no other
        mailbox.drain()
        assert got == [[0, 1, 2]]
        mailbox.drain()  # nothing more: the handler is not called with nothing
        assert got == [[0, 1, 2]]

    run(test)


def test_a_threads_exception_comes_back_after_what_it_posted():
    async def test():
        got = []
        mailbox = Mailbox(got.extend)

        def work():
            mailbox.post(["read last"])
            raise OSError("broken")

        with pytest.raises(OSError, match="^broken$"):
            await mailbox.run_in_thread(work)
        assert got == ["read last"]

    run(test)


def test_a_thread_is_waited_for_even_when_its_caller_is_cancelled():
    """The thread may use the caller's memory: its caller goes on only once it ended."""
    async def test():
        mailbox = Mailbox(lambda batch: None)
        release = threading.Event()
        ended = []

        def work():
            release.wait(HANG_GUARD)
            ended.append(True)
            return 7

        scope = trio.CancelScope()

        async def cancel_then_release():
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            release.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_then_release)
            with scope:
                assert await mailbox.run_in_thread(work) == 7
                assert ended == [True]
                await trio.sleep_forever()  # (cancelled here)
        assert scope.cancelled_caught

    run(test)


def test_a_post_after_trios_run_is_refused():
    holder = {}

    async def main():
        holder["mailbox"] = Mailbox(lambda batch: None)

    trio.run(main)
    with pytest.raises(trio.RunFinishedError):
        holder["mailbox"].post(["late"])
