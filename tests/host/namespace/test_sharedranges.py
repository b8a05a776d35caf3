"""Range locks across the processes of a mount (host/namespace/sharedranges.py): the kernel's
open-file-description locks on one memfd, and the LbaRangeLock that takes them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from nvmeof_fuse.host.namespace.rangelock import LbaRangeLock
from nvmeof_fuse.host.namespace.sharedranges import (
    NSID_SHIFT,
    NamespaceRanges,
    RangeLockTimeout,
    SharedRanges,
    lock_units,
)

ROOT = Path(__file__).resolve().parents[3]
EX, SH = True, False


@pytest.fixture
def ranges():
    r = SharedRanges.create(5.0)
    yield r
    r.close()


def test_lock_units_are_the_lbas_of_each_nsid_in_ascending_order():
    base = 3 << NSID_SHIFT
    assert lock_units(3, 64, [(0, 1, EX), (9, 10, EX), (1, 9, SH)]) == [
        (base, base + 1, EX), (base + 1, base + 9, SH), (base + 9, base + 10, EX)]
    # a namespace past 2**31 LBAs: units of several LBAs, one lock over the span
    big = 1 << 33
    assert lock_units(1, big, [(8, 9, EX), (9, 20, SH)]) == [
        ((1 << NSID_SHIFT) + 2, (1 << NSID_SHIFT) + 5, EX)]
    top = lock_units(0xFFFFFFFE, big, [(big - 1, big, SH)])
    assert top[0][1] < 1 << 63  # inside off_t
    with pytest.raises(ValueError, match="NSID 4294967296 is outside"):
        lock_units(1 << 32, 8, [(0, 1, EX)])


def test_overlapping_locks_conflict_unless_both_are_shared(ranges):
    held = ranges.try_lock([(10, 20, EX)])
    assert held is not None
    assert ranges.try_lock([(19, 21, SH)]) is None  # overlaps the exclusive one
    assert ranges.try_lock([(0, 10, EX)]) is not None  # adjacent below
    assert ranges.try_lock([(20, 30, EX)]) is not None  # adjacent above
    shared = ranges.try_lock([(100, 110, SH)])
    assert ranges.try_lock([(105, 120, SH)]) is not None  # shared with shared
    assert ranges.try_lock([(109, 110, EX)]) is None
    ranges.unlock(held, [(10, 20, EX)])
    assert ranges.try_lock([(15, 16, EX)]) is not None  # released
    assert shared is not None


def test_a_refused_request_holds_none_of_its_parts(ranges):
    blocker = ranges.try_lock([(5, 6, EX)])
    assert ranges.try_lock([(0, 1, EX), (1, 5, SH), (5, 6, EX)]) is None
    assert ranges.try_lock([(0, 5, EX)]) is not None  # its first parts were let go
    assert blocker is not None


def test_closing_the_file_releases_its_locks():
    first = SharedRanges.create(5.0)
    other = SharedRanges(os.open(f"/proc/self/fd/{first.fd}", os.O_RDWR), 5.0)
    fd = first.try_lock([(0, 8, EX)])
    first._put(fd)  # (done with, kept in the pool: still holding until closed)
    first._free.remove(fd)
    assert other.try_lock([(0, 1, SH)]) is None
    os.close(fd)  # its last descriptor closed: the kernel drops its locks
    assert other.try_lock([(0, 1, EX)]) is not None
    first.close()
    other.close()


HOLDER = """
import os, sys, time
from nvmeof_fuse.host.namespace.sharedranges import SharedRanges
ranges = SharedRanges(int(sys.argv[1]), 5.0)
assert ranges.try_lock([(0, 100, True)]) is not None
print("held", flush=True)
time.sleep(60)
"""


def test_a_holder_killed_with_sigkill_leaves_nothing_locked(ranges):
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(ranges.fd)],
                             pass_fds=(ranges.fd,), stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert child.stdout.readline() == "held\n"
        assert ranges.try_lock([(50, 51, SH)]) is None  # another process holds it
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        assert ranges.try_lock([(0, 100, EX)]) is not None  # free at once
    finally:
        child.kill()
        child.wait()


def test_a_waiter_takes_the_lock_once_its_holder_lets_go_with_the_loop_free(ranges):
    order = []

    async def main():
        held = ranges.try_lock([(0, 4, EX)])

        async def waiter():
            fd = await ranges.lock([(1, 2, SH)], "LBAs 1..1 of n1")
            order.append("taken")
            ranges.unlock(fd, [(1, 2, SH)])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            for _ in range(3):  # the loop runs other tasks while it waits
                await trio.sleep(0.01)
                order.append("other")
            ranges.unlock(held, [(0, 4, EX)])
        assert ranges.contended == 1

    trio.run(main)
    assert order == ["other", "other", "other", "taken"]


def test_a_wait_past_the_limit_fails_with_a_line_naming_the_lbas(ranges):
    ranges.wait_limit = 0.05
    assert ranges.try_lock([(0, 4, EX)]) is not None

    async def main():
        with pytest.raises(RangeLockTimeout) as caught:
            await ranges.lock([(2, 3, EX), (3, 9, SH)], "LBAs 2..8 of n1")
        return caught.value

    exc = trio.run(main)
    assert str(exc) == ("LBAs 2..8 of n1 stayed locked by another process of the mount for "
                        "over 0.05 s")
    assert exc.errno == 110  # ETIMEDOUT
    assert ranges.try_lock([(4, 9, EX)]) is not None  # nothing of the failed one kept


def test_written_bytes_are_seen_by_every_process_of_the_file(ranges):
    other = SharedRanges(os.open(f"/proc/self/fd/{ranges.fd}", os.O_RDWR), 5.0)
    assert not other.written(7)
    ranges.mark_written(7)
    assert other.written(7) and not other.written(8)
    other.clear_written(7)
    assert not ranges.written(7)
    other.close()


def _two_processes(ranges: SharedRanges) -> tuple[LbaRangeLock, LbaRangeLock]:
    """Two range locks of one namespace, each as another process's (their requests lock on
    descriptions of their own, as two processes' would)."""
    locks = LbaRangeLock(), LbaRangeLock()
    for lock in locks:
        lock.shared = NamespaceRanges(ranges, 1, lambda: 64)
    return locks


def test_range_locks_of_two_processes_exclude_each_other(ranges):
    a, b = _two_processes(ranges)

    async def main():
        req = await a.acquire([(0, 1, EX), (1, 8, SH)])
        assert b.try_acquire([(7, 8, EX)]) is None and len(b) == 0
        assert b.try_acquire([(2, 4, SH)]) is not None  # shared with shared
        got = []

        async def other():
            got.append(await b.acquire([(0, 1, EX)]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await trio.sleep(0.05)  # (it polls: never blocked for long)
            assert got == []  # waits for a's release
            a.release(req)
        b.release(got[0])
        assert ranges.written(1)

    trio.run(main)


def test_a_cancelled_wait_releases_the_request_in_its_process(ranges):
    a, b = _two_processes(ranges)

    async def main():
        held = await a.acquire([(0, 8, EX)])
        with trio.move_on_after(0.05):
            await b.acquire([(4, 5, EX)])
        assert len(b) == 0
        a.release(held)
        assert b.try_acquire([(0, 8, EX)]) is not None

    trio.run(main)


def test_a_lock_without_shared_ranges_takes_no_kernel_lock():
    lock = LbaRangeLock()

    async def main():
        req = await lock.acquire([(0, 1, EX)])
        assert req.held is None
        lock.release(req)

    trio.run(main)
    assert lock.written


def test_polling_does_not_spin(ranges):
    """A wait of 0.3 s costs the waiter little CPU: it sleeps between its tries."""
    ranges.try_lock([(0, 1, EX)])
    ranges.wait_limit = 0.3

    async def main():
        with pytest.raises(RangeLockTimeout):
            await ranges.lock([(0, 1, EX)], "LBA 0 of n1")

    cpu = time.process_time()
    trio.run(main)
    assert time.process_time() - cpu < 0.25


def test_a_lock_the_kernel_refuses_is_a_one_line_error_and_holds_nothing(ranges, monkeypatch):
    import errno

    from nvmeof_fuse.host.namespace import sharedranges

    lock = LbaRangeLock()
    lock.shared = NamespaceRanges(ranges, 1, lambda: 64)

    def refuse(fd, cmd, arg):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(sharedranges.fcntl, "fcntl", refuse)

    async def main():
        with pytest.raises(sharedranges.RangeLockFailed) as caught:
            await lock.acquire([(0, 1, EX)])
        return caught.value

    exc = trio.run(main)
    assert str(exc) == ("taking a lock of the mount's range locks failed: No locks "
                        "available")
    assert len(lock) == 0
    monkeypatch.undo()
    monkeypatch.setattr(sharedranges.os, "open", lambda *a: (_ for _ in ()).throw(
        OSError(errno.ENOENT, "No such file or directory")))
    ranges._free.clear()
    with pytest.raises(sharedranges.RangeLockFailed, match=r"^opening a description "
                       r"\(/proc/self/fd\) of the mount's range locks failed: No such file"):
        ranges.try_lock([(0, 1, EX)])
