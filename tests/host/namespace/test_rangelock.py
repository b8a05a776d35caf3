"""The LBA range lock: FIFO, shared and exclusive parts, waits told and cancelled cleanly."""

import trio
import trio.testing

from nvmeof_fuse.host.namespace.rangelock import LbaRangeLock


def test_range_lock_is_fifo_and_shares_aligned_ranges():
    lock = LbaRangeLock()
    log = []

    async def hold(name, parts, release):
        async with lock.hold(parts):
            log.append(name)
            await release.wait()

    async def main():
        rel = {n: trio.Event() for n in "abcd"}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold, "a", [(0, 10, False)], rel["a"])
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(hold, "b", [(5, 15, False)], rel["b"])  # shared: no wait
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(hold, "c", [(7, 8, True)], rel["c"])  # waits for a and b
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(hold, "d", [(0, 100, False)], rel["d"])  # queued behind c
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["a", "b"]
            rel["a"].set()
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["a", "b"]
            rel["b"].set()
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["a", "b", "c"]
            rel["c"].set()
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["a", "b", "c", "d"]
            rel["d"].set()
        assert len(lock) == 0

    trio.run(main)


def test_range_lock_try_acquire_grants_only_what_would_not_wait():
    """No waiting and no queueing: None where acquire would wait (behind a holder, or behind
    an earlier waiter, so the order of arrival still holds)."""
    lock = LbaRangeLock()
    waits = []
    lock.on_wait = lambda: waits.append(len(lock))

    async def main():
        shared = lock.try_acquire([(0, 10, False)])
        assert shared is not None and shared.granted
        assert lock.try_acquire([(5, 6, True)]) is None and len(lock) == 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lock.acquire, [(5, 6, True)])  # waits for the shared holder
            await trio.testing.wait_all_tasks_blocked()
            assert lock.try_acquire([(0, 100, False)]) is None  # behind the exclusive waiter
            other = lock.try_acquire([(20, 30, True)])  # no conflict with anything queued
            assert other is not None and len(lock) == 3
            assert waits == [2]  # only acquire tells: try_acquire never waits
            lock.release(shared)
        lock.release(other)

    trio.run(main)


def test_range_lock_tells_on_wait_only_of_requests_that_must_wait():
    """``on_wait`` lets a holder be asked to let go (a companion write delegation)."""
    lock = LbaRangeLock()
    waits = []
    lock.on_wait = lambda: waits.append(len(lock))

    async def main():
        held = await lock.acquire([(0, 4, True)])
        other = await lock.acquire([(4, 4, True)])  # no conflict: granted at once
        assert waits == []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lock.acquire, [(2, 1, False)])
            await trio.testing.wait_all_tasks_blocked()
            assert waits == [3]  # told as it queued behind the holder
            lock.release(held)
        lock.release(other)

    trio.run(main)


def test_range_lock_waiter_cancelled_leaves_no_trace():
    """A request cancelled while it waits leaves the queue; those behind it still get in."""
    lock = LbaRangeLock()
    log = []

    async def main():
        held = await lock.acquire([(0, 1, True)])
        with trio.move_on_after(0):
            await lock.acquire([(0, 4, False)])  # conflicts with the held exclusive LBA
        assert len(lock) == 1
        async with trio.open_nursery() as nursery:
            async def later():
                async with lock.hold([(0, 4, False)]):
                    log.append("later")
            nursery.start_soon(later)
            await trio.testing.wait_all_tasks_blocked()
            assert log == []
            lock.release(held)
        assert log == ["later"] and len(lock) == 0
        shared = [await lock.acquire([(0, 8, False)]) for _ in range(3)]  # no exclusive: at once
        assert all(r.granted and r.event is None for r in shared)
        for r in shared:
            lock.release(r)
        assert len(lock) == 0

    trio.run(main)
