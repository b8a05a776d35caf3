"""The staged pipeline on its own: slots bound what is in flight, not workers; order; errors."""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading

import numpy as np
import pytest

from nvmeof_fuse.companion.client.shared_bounce import CallerMemory, Staging
from nvmeof_fuse.companion.client.via_daemon import DaemonIO

LBA = 512
TASK = 4096  # 8 LBAs, a page


class HeldChannel:
    """Requests are answered only when the test says so; reads fill the slot with a pattern."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, tuple, concurrent.futures.Future]] = []
        self.lock = threading.Lock()
        self.staging: Staging | None = None

    def register_shared(self, mem, staging: bool = False) -> int:
        return 1

    def read_async(self, nsid, pieces, timeout):
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.requests.append(("read", (nsid, pieces), future))
        return future

    def write_async(self, nsid, offset, length, rid, region_offset, head, tail, timeout):
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.requests.append(("write", (offset, length, region_offset), future))
        return future

    def outstanding(self) -> list:
        with self.lock:
            return [r for r in self.requests if not r[2].done()]

    def answer(self, count: int | None = None, error: BaseException | None = None) -> None:
        for kind, args, future in self.outstanding()[:count]:
            if kind == "read" and error is None:  # the LBAs land in the slot: byte = LBA % 256
                for piece in args[1]:
                    for i in range(piece.nlb):
                        ctypes.memset(self.staging.addr + piece.offset + i * LBA,
                                      (piece.slba + i) % 256, LBA)
            if error is None:
                future.set_result({})
            else:
                future.set_exception(error)


@pytest.fixture
def pipeline():
    channel = HeldChannel()
    staging = Staging(channel, 8 * TASK)
    channel.staging = staging
    with concurrent.futures.ThreadPoolExecutor(1) as workers:  # one worker, eight tasks' worth
        yield channel, staging, DaemonIO(channel, 1, LBA, staging, TASK, workers,
                                         lambda n: 10.0)
    staging.close()


def host(buf: np.ndarray) -> CallerMemory:
    return CallerMemory(None, None, buf.ctypes.data, 0, None, buf)


def wait(condition, timeout: float = 10.0) -> bool:
    deadline = threading.Event()
    for _ in range(int(timeout / 0.005)):
        if condition():
            return True
        deadline.wait(0.005)
    return False


def test_slots_not_workers_bound_the_requests_in_flight(pipeline):
    channel, staging, io = pipeline
    buf = np.zeros(32 * TASK, np.uint8)
    transfer = io.read_staged(host(buf), 0, buf.nbytes)  # 32 tasks, room for 8, 1 worker
    assert len(channel.outstanding()) == 8  # all the room at once, though one worker
    assert staging.snapshot()["staging_waiting"] == 24
    channel.answer(3)
    assert wait(lambda: len(channel.requests) == 11)  # each answer starts the next task
    while not transfer.future.done():
        channel.answer()
        wait(lambda: channel.outstanding() or transfer.future.done(), 1)
    assert transfer.future.result(5) == buf.nbytes
    expected = np.repeat(np.arange(len(buf) // LBA) % 256, LBA).astype(np.uint8)
    assert np.array_equal(buf, expected)
    assert staging.snapshot()["staging_free_bytes"] == 8 * TASK


def test_an_unaligned_staged_read_copies_only_the_callers_bytes(pipeline):
    channel, staging, io = pipeline
    buf = np.full(3000, 0xEE, np.uint8)
    transfer = io.read_staged(host(buf), 700, 2999)
    while not transfer.future.done():
        channel.answer()
        wait(lambda: channel.outstanding() or transfer.future.done(), 1)
    assert transfer.future.result(5) == 2999
    expected = np.repeat(np.arange(8) % 256, LBA).astype(np.uint8)[700:3699]
    assert np.array_equal(buf[:2999], expected) and buf[2999] == 0xEE


def test_a_failed_task_fails_the_transfer_only_once_every_task_ended(pipeline):
    channel, staging, io = pipeline
    buf = np.zeros(3 * TASK, np.uint8)
    transfer = io.read_staged(host(buf), 0, buf.nbytes)
    channel.answer(1, OSError(5, "the daemon failed it"))
    assert not transfer.future.done()  # the others may still write the caller's memory
    channel.answer()
    assert wait(transfer.future.done)
    with pytest.raises(OSError, match="the daemon failed it"):
        transfer.future.result()
    assert wait(lambda: staging.snapshot()["staging_free_bytes"] == 8 * TASK)


def test_a_staged_write_sends_each_slot_after_copying_into_it(pipeline):
    channel, staging, io = pipeline
    buf = np.arange(10 * TASK, dtype=np.uint32).astype(np.uint8)
    transfer = io.write_staged(host(buf), 100, 9 * TASK)
    assert wait(lambda: len(channel.outstanding()) == 8)  # copied by the one worker, sent
    offsets = sorted(args[0] for _, args, _ in channel.requests)
    assert offsets[0] == 100 and offsets[1] == TASK  # cut at LBA boundaries
    while not transfer.future.done():
        channel.answer()
        wait(lambda: channel.outstanding() or transfer.future.done(), 1)
    assert transfer.future.result(5) == 9 * TASK
    assert len(channel.requests) == 10


def test_small_requests_share_the_memory_and_waiters_are_served_in_order():
    staging = Staging(HeldChannel(), 4 * TASK)
    got = []
    for _ in range(4):
        staging.acquire(100, got.append)  # each takes a page, not the whole memory
    assert got == [0, TASK, 2 * TASK, 3 * TASK]
    staging.acquire(2 * TASK, lambda at: got.append(("big", at)))  # waits
    staging.acquire(1, lambda at: got.append(("small", at)))  # waits behind it: in order
    staging.release(TASK, 100)
    assert got[4:] == []  # one page free: the big one still waits, and so the small one
    staging.release(2 * TASK, 100)  # pages 1 and 2 merge
    assert got[4:] == [("big", TASK)]
    staging.release(0, 100)
    assert got[5:] == [("small", 0)]
    with pytest.raises(ValueError, match="exceed the 16384-byte staging memory"):
        staging.acquire(5 * TASK, got.append)
    staging.close()
