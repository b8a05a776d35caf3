"""Registered memory: caller buffers, host buffers, region slices and the bounce pool."""

import ctypes

import numpy as np
import pytest
import trio
import trio.testing

from nvmeof_fuse.errors import CommandTimeout, InvalidArgument, NVMeoFError, TransportError
from nvmeof_fuse.host.memory import BouncePool, Region, buffer_address, host_buffer


class FakeRegistration:
    def __init__(self, addr: int, length: int, owner: object) -> None:
        self.addr, self.length, self.owner = addr, length, owner
        self.lkey, self.rkey = 0x100 + length, 0x200 + length
        self.closed = 0

    def keys(self, domain: object) -> "FakeRegistration":
        return self

    def close(self) -> None:
        self.closed += 1


class FakeRegister:
    """A transport's ``register`` that records its calls."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[FakeRegistration] = []
        self.fail = fail

    def __call__(self, addr: int, length: int, owner: object) -> FakeRegistration:
        if self.fail is not None:
            raise self.fail
        registration = FakeRegistration(addr, length, owner)
        self.calls.append(registration)
        return registration


# --- buffer_address -------------------------------------------------------------------------------


def test_numpy_contiguous():
    arr = np.zeros((4, 8), dtype=np.float32)
    addr, length, owner = buffer_address(arr)
    assert (addr, length, owner) == (arr.ctypes.data, 128, arr)


def test_numpy_non_contiguous():
    arr = np.zeros((4, 8), dtype=np.uint8)
    with pytest.raises(InvalidArgument, match="array must be C-contiguous"):
        buffer_address(arr[:, ::2])
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        buffer_address(arr.T)


def test_numpy_read_only():
    arr = np.zeros(16, dtype=np.uint8)
    arr.flags.writeable = False
    with pytest.raises(InvalidArgument, match="array must be writable"):
        buffer_address(arr)


def test_bytearray():
    buf = bytearray(b"abcdefgh")
    addr, length, owner = buffer_address(buf)
    assert length == 8 and owner is buf
    assert ctypes.string_at(addr, 8) == b"abcdefgh"


def test_memoryview_slice_points_into_its_base():
    buf = bytearray(b"abcdefgh")
    addr, length, _ = buffer_address(memoryview(buf)[3:6])
    assert length == 3 and ctypes.string_at(addr, 3) == b"def"


def test_empty_bytearray_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="empty"):
        buffer_address(bytearray())


def test_bytes_rejected():
    with pytest.raises(InvalidArgument, match="writable and contiguous"):
        buffer_address(b"read only")


def test_non_buffer_rejected():
    with pytest.raises(InvalidArgument, match="cannot register a list: pass a numpy array"):
        buffer_address([1, 2, 3])


class FakeTensor:
    def __init__(self, *, is_cuda=False, contiguous=True) -> None:
        self.is_cuda = is_cuda
        self._contiguous = contiguous
        self.storage = (ctypes.c_float * 6)()

    def is_contiguous(self) -> bool:
        return self._contiguous

    def data_ptr(self) -> int:
        return ctypes.addressof(self.storage)

    def numel(self) -> int:
        return 6

    def element_size(self) -> int:
        return 4


def test_cpu_tensor():
    tensor = FakeTensor()
    assert buffer_address(tensor) == (tensor.data_ptr(), 24, tensor)


def test_non_contiguous_tensor():
    with pytest.raises(InvalidArgument, match="tensor must be contiguous"):
        buffer_address(FakeTensor(contiguous=False))


def test_cuda_looking_object_rejected():
    with pytest.raises(InvalidArgument, match="CUDA tensors are registered through"):
        buffer_address(FakeTensor(is_cuda=True))


# --- host_buffer and Region -----------------------------------------------------------------------


def test_host_buffer_registers_its_memory():
    register = FakeRegister()
    region = host_buffer(register, 10000)
    (registration,) = register.calls
    assert (region.addr, region.length) == (registration.addr, 10000)
    assert region.addr % 4096 == 0
    assert region.registration.keys(None) is registration
    region.view[:5] = b"hello"
    assert ctypes.string_at(region.addr, 5) == b"hello"
    assert registration.owner is region.owner
    region.close()
    region.close()
    assert registration.closed == 1 and region.view is None


@pytest.mark.parametrize("length", [0, -1])
def test_host_buffer_needs_a_positive_length(length):
    with pytest.raises(InvalidArgument, match=f"must be positive, got {length}"):
        host_buffer(FakeRegister(), length)


def test_host_buffer_registration_failure_propagates():
    with pytest.raises(TransportError, match="no PD"):
        host_buffer(FakeRegister(TransportError("no PD")), 4096)


def test_region_ref_bounds():
    region = Region(0x1000, 100, FakeRegistration(0x1000, 100, None))
    ref = region.ref(10, 20)
    assert (ref.addr, ref.offset, ref.length, ref.region) == (0x100A, 10, 20, region)
    assert region.ref().length == 100
    assert region.ref(40).length == 60
    assert region.ref(100, 0).length == 0
    for offset, length in [(-1, 1), (0, 101), (90, 11), (0, -1), (101, None)]:
        with pytest.raises(InvalidArgument, match="outside the 100-byte region"):
            region.ref(offset, length)


# --- BouncePool -----------------------------------------------------------------------------------


def test_pool_registers_once_and_closes_all():
    register = FakeRegister()
    pool = BouncePool(register, 8192, 3)
    assert [r.length for r in register.calls] == [8192] * 3

    async def main():
        for _ in range(5):
            async with pool.borrow() as region:
                assert region.length == 8192

    trio.run(main)
    assert len(register.calls) == 3
    pool.close()
    assert all(r.closed == 1 for r in register.calls)


def test_pool_borrowers_get_distinct_buffers_and_wait_when_empty():
    pool = BouncePool(FakeRegister(), 4096, 2)
    held: list[Region] = []
    release = trio.Event()

    async def borrower():
        async with pool.borrow() as region:
            held.append(region)
            await release.wait()

    async def main():
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(borrower)
            await trio.testing.wait_all_tasks_blocked()
            assert len(held) == 2 and held[0] is not held[1]
            release.set()
        assert len(held) == 3 and held[2] in held[:2]

    trio.run(main)


async def _lose_or_keep(pool: BouncePool, error: BaseException) -> Region:
    with pytest.raises(type(error)):
        async with pool.borrow() as region:
            raise error
    return region


async def _can_borrow(pool: BouncePool) -> bool:
    """Whether a borrow gets a buffer without waiting (checked without any timing)."""
    got = []

    async def borrow():
        async with pool.borrow() as region:
            got.append(region)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(borrow)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    return bool(got)


def test_a_held_buffer_comes_back_when_the_queues_are_torn_down():
    pool = BouncePool(FakeRegister(), 4096, 2)

    async def main():
        sent_in = pool.generation
        region = await pool.take()
        pool.hold(region, sent_in)  # its command failed with its connection
        assert pool.counts() == {"free": 1, "lent": 0, "held": 1, "waiters": 0}
        pool.reclaim()  # that connection's queues are torn down
        assert pool.counts() == {"free": 2, "lent": 0, "held": 0, "waiters": 0}
        late = await pool.take()
        pool.hold(late, sent_in)  # failed after that teardown: back at once
        assert pool.counts() == {"free": 2, "lent": 0, "held": 0, "waiters": 0}

    trio.run(main)


@pytest.mark.parametrize("error", [CommandTimeout("late"), TransportError("gone"),
                                   NVMeoFError("status"), InvalidArgument("bad"), ValueError("x"),
                                   KeyboardInterrupt()])
def test_a_borrowed_buffer_is_returned_after_any_error(error):
    pool = BouncePool(FakeRegister(), 4096, 1)

    async def main():
        first = await _lose_or_keep(pool, error)
        async with pool.borrow() as again:
            assert again is first

    trio.run(main)


def test_buffer_is_returned_after_cancellation():
    pool = BouncePool(FakeRegister(), 4096, 1)

    async def main():
        with trio.CancelScope() as scope:
            async with pool.borrow():
                scope.cancel()
                await trio.sleep_forever()
        assert await _can_borrow(pool)

    trio.run(main)


def test_take_does_not_yield_while_a_buffer_is_free_then_waits_for_give():
    pool = BouncePool(FakeRegister(), 4096, 1)

    async def main():
        with trio.testing.assert_no_checkpoints():
            region = await pool.take()
        assert pool.available == 0
        got = []

        async def taker():
            got.append(await pool.take())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(taker)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            pool.give(region)
        assert got == [region] and pool.available == 0

    trio.run(main)


def test_a_wait_goes_on_while_patient_then_fails_as_the_bug_it_is():
    patient = [True]
    pool = BouncePool(FakeRegister(), 4096, 1, timeout=5.0, patient=lambda: patient[0])

    async def main():
        await pool.take()
        with trio.move_on_after(60):  # reconnecting: the buffer's command waits for it too
            await pool.take()
        assert pool.waiters == 0
        patient[0] = False
        with pytest.raises(NVMeoFError, match=r"^internal error: no bounce buffer came back "
                           r"within 5 s while connected \(1 lent, 0 held, 1 waiting\)"):
            await pool.take()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_counts_show_free_lent_held_and_waiters():
    pool = BouncePool(FakeRegister(), 4096, 2)

    async def main():
        assert pool.counts() == {"free": 2, "lent": 0, "held": 0, "waiters": 0}
        first, second = await pool.take(), await pool.take()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.take)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.counts() == {"free": 0, "lent": 2, "held": 0, "waiters": 1}
            pool.give(first)
        assert pool.counts() == {"free": 0, "lent": 2, "held": 0, "waiters": 0}
        pool.give(second)
        assert pool.counts() == {"free": 1, "lent": 1, "held": 0, "waiters": 0}

    trio.run(main)


def test_a_read_buffer_is_cleared_where_the_transport_cannot_count_its_data():
    """Over RDMA a target that answers a read with success and writes nothing would hand on
    what the buffer held: another request's bytes.  Cleared, it hands on zeros."""
    async def main() -> None:
        for clear, expect in ((True, bytes(4096)), (False, b"s" * 4096)):
            pool = BouncePool(FakeRegister(), 8192, 1, clear_reads=clear)
            region = await pool.take()
            region.view[:] = b"s" * 8192  # an earlier request's data
            pool.for_read(region.view, 4096)
            assert bytes(region.view[:4096]) == expect
            assert bytes(region.view[4096:]) == b"s" * 4096  # only what the read covers
            pool.give(region)
            pool.close()

    trio.run(main)
