import errno
import random
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from nvmeof_fuse.errors import InvalidArgument, NVMeoFError, TransportError
from nvmeof_fuse.host.namespace.byterange import ByteRangeIO, NoSpace, split_range
from nvmeof_fuse.host.namespace.stats import IoStats

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fakes import FakeDevice  # noqa: E402


def run(fn, *args):
    return trio.run(fn, *args)


# --- split_range -------------------------------------------------------------


@pytest.mark.parametrize("ls", [1, 4, 8])
def test_split_covers_every_byte_once(ls):
    for offset in range(0, 3 * ls):
        for length in range(0, 4 * ls):
            sp = split_range(offset, length, ls)
            got = []  # (absolute byte, index in caller buffer)
            for edge in sp.edges():
                assert 0 <= edge.start and edge.data.stop - edge.data.start < ls
                for i in range(edge.data.start, edge.data.stop):
                    got.append((edge.lba * ls + edge.start + i - edge.data.start, i))
            for i in range(sp.middle.start, sp.middle.stop):
                got.append((sp.middle_slba * ls + i - sp.middle.start, i))
            assert sp.middle.stop - sp.middle.start == sp.middle_nlb * ls
            assert sorted(got) == [(offset + i, i) for i in range(length)]
            if sp.head and sp.tail:
                assert sp.head.lba < sp.tail.lba


def test_split_examples():
    sp = split_range(1000, 5000, 512)  # bytes 1000..5999
    assert (sp.head.lba, sp.head.start, sp.head.data) == (1, 488, slice(0, 24))
    assert (sp.middle_slba, sp.middle_nlb, sp.middle) == (2, 9, slice(24, 24 + 9 * 512))
    assert (sp.tail.lba, sp.tail.start, sp.tail.data) == (11, 0, slice(4632, 5000))
    assert sp.first_lba == 1 and sp.nlb == 11

    aligned = split_range(4096, 8192, 4096)
    assert aligned.head is None and aligned.tail is None
    assert (aligned.middle_slba, aligned.middle_nlb) == (1, 2)

    inside = split_range(10, 5, 512)
    assert inside.head == split_range(10, 5, 512).head and inside.tail is None
    assert inside.middle_nlb == 0 and inside.nlb == 1


def test_split_rejects_negative():
    with pytest.raises(InvalidArgument):
        split_range(-1, 5, 512)
    with pytest.raises(InvalidArgument):
        split_range(0, -5, 512)


# --- read ---------------------------------------------------------------------


def make(ls=512, nlb=16, seed=None):
    dev = FakeDevice(ls, nlb, seed=seed)
    dev.data[:] = random.Random(1).randbytes(len(dev.data))
    return dev, ByteRangeIO(dev, IoStats())


def test_read_any_range_matches_bytes():
    dev, io = make(ls=8, nlb=6)
    ref = bytes(dev.data)

    async def main():
        for offset in range(0, 50):
            for length in range(0, 60, 3):
                assert await io.read(offset, length) == ref[offset : offset + length]

    run(main)


def test_read_reads_only_touched_lbas_in_one_command():
    dev, io = make()

    async def main():
        await io.read(600, 100)  # LBA 1 only
        await io.read(500, 1000)  # LBAs 0..2

    run(main)
    assert dev.reads == [(1, 1), (0, 3)]


def test_read_short_at_end_and_empty_past_it():
    dev, io = make(nlb=4)

    async def main():
        assert await io.read(2000, 100) == bytes(dev.data[2000:2048])
        assert await io.read(2048, 10) == b""
        assert await io.read(10**9, 10) == b""
        assert await io.read(0, 0) == b""

    run(main)
    assert dev.reads == [(3, 1)]


@pytest.mark.parametrize("seed", range(3))
def test_concurrent_lent_reads_are_right_when_used_before_yielding(seed):
    dev, io = make(ls=512, nlb=64, seed=seed)
    ref = bytes(dev.data)
    rng = random.Random(seed)
    ranges = [(rng.randrange(len(ref)), rng.randrange(1, 3000)) for _ in range(40)]
    kept = []

    async def reader(offset, length):
        got = await io.read_lent(offset, length)
        assert got == ref[offset : offset + length]  # used at once, as a FUSE reply does
        kept.append((got, ref[offset : offset + length]))

    async def main():
        async with trio.open_nursery() as nursery:
            for r in ranges:
                nursery.start_soon(reader, *r)

    run(main)
    # The fake overwrites lent data at the next command, so holding it would have been caught.
    assert any(got != want for got, want in kept)


def test_read_negative_is_invalid_argument():
    _, io = make()
    for offset, length in [(-1, 10), (0, -1)]:
        with pytest.raises(InvalidArgument, match="bad read"):
            run(io.read, offset, length)


# --- write --------------------------------------------------------------------


def test_random_writes_match_a_bytearray():
    dev, io = make(ls=16, nlb=32)
    ref = bytearray(dev.data)
    rng = random.Random(7)

    async def main():
        for _ in range(500):
            offset = rng.randrange(len(ref))
            data = rng.randbytes(rng.randrange(0, min(100, len(ref) - offset) + 1))
            assert await io.write(offset, data) == len(data)
            ref[offset : offset + len(data)] = data
            assert dev.data == ref

    run(main)


def test_aligned_write_does_no_read():
    dev, io = make()
    run(io.write, 1024, memoryview(b"x" * 2048))
    assert dev.reads == [] and dev.writes == [(2, 4)]


def test_unaligned_write_reads_only_edges():
    dev, io = make()
    run(io.write, 1000, b"y" * 5000)
    assert sorted(dev.reads) == [(1, 1), (11, 1)]
    assert sorted(dev.writes) == [(1, 1), (2, 9), (11, 1)]
    assert io.stats.counters["rmw_lbas"] == 2


def test_write_past_end_is_enospc_and_writes_nothing():
    dev, io = make(nlb=4)
    before = bytes(dev.data)
    with pytest.raises(NoSpace) as info:
        run(io.write, 2000, b"z" * 100)
    assert isinstance(info.value, NVMeoFError) and info.value.errno == errno.ENOSPC
    assert "offset 2000" in str(info.value) and "2048" in str(info.value)
    assert dev.data == before and dev.writes == []
    with pytest.raises(InvalidArgument):
        run(io.write, -1, b"a")
    assert run(io.write, 2048, b"") == 0


def test_device_error_surfaces_unwrapped_and_releases_the_lock():
    dev, io = make()
    dev.fail = TransportError("lost connection to 192.0.2.1")
    with pytest.raises(TransportError, match="lost connection"):
        run(io.write, 1000, b"q" * 5000)
    assert len(io.lock) == 0
    assert io.stats.snapshot()["ops"]["write"]["errors"] == 1


def test_cancelled_write_releases_the_lock():
    dev, io = make()

    async def main():
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(io.write, 100, b"c" * 10)
                await trio.sleep(0)
                scope.cancel()
        assert len(io.lock) == 0
        await io.write(100, b"d" * 10)  # nothing left blocking that LBA

    run(main)


# --- concurrency ---------------------------------------------------------------


async def _concurrent(io, writes):
    async with trio.open_nursery() as nursery:
        for offset, data in writes:
            nursery.start_soon(io.write, offset, data)


def _disjoint_writes(rng, size, ls):
    """Writes to disjoint byte ranges that share edge LBAs and overlap aligned ones."""
    cuts = sorted(rng.sample(range(1, size), 40))
    bounds = [0, *cuts, size]
    return [(a, rng.randbytes(b - a)) for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("seed", range(30))
def test_concurrent_writers_sharing_lbas_lose_nothing(seed):
    ls = 16
    dev, io = make(ls=ls, nlb=32, seed=seed)
    rng = random.Random(seed)
    writes = _disjoint_writes(rng, len(dev.data), ls)
    rng.shuffle(writes)
    run(_concurrent, io, writes)
    expected = b"".join(d for _, d in sorted(writes, key=lambda w: w[0]))
    assert dev.data == expected
    assert len(io.lock) == 0


def test_without_the_lock_updates_get_lost():
    """Guard the test above: it would catch a missing or broken lock."""

    class NoLock:
        @asynccontextmanager
        async def hold(self, parts):
            yield

        async def acquire(self, parts):
            return None

        def release(self, req):
            pass

    lost = 0
    for seed in range(30):
        dev, io = make(ls=16, nlb=32, seed=seed)
        io.lock = NoLock()
        rng = random.Random(seed)
        writes = _disjoint_writes(rng, len(dev.data), 16)
        run(_concurrent, io, writes)
        expected = b"".join(d for _, d in sorted(writes, key=lambda w: w[0]))
        lost += dev.data != expected
    assert lost > 0


@pytest.mark.parametrize("seed", range(30))
def test_aligned_write_and_rmw_of_an_lba_serialize(seed):
    """An aligned write over LBA 2 and a partial write inside it: one must win whole."""
    ls = 16
    dev, io = make(ls=ls, nlb=8, seed=seed)
    dev.data[:] = bytes(len(dev.data))
    aligned = (0, b"A" * (4 * ls))
    partial = (2 * ls + 3, b"B" * 5)
    order = [aligned, partial] if seed % 2 else [partial, aligned]
    run(_concurrent, io, order)
    lba2 = bytes(dev.data[2 * ls : 3 * ls])
    a_then_b = b"A" * 3 + b"B" * 5 + b"A" * 8
    assert lba2 in (b"A" * ls, a_then_b)
    assert bytes(dev.data[: 2 * ls]) == b"A" * 2 * ls


def test_aligned_write_is_one_command_and_recorded():
    dev, io = make(ls=16, nlb=8, seed=1)
    run(io.write, 32, b"x" * 48)
    assert bytes(dev.data[32:80]) == b"x" * 48 and dev.writes == [(2, 3)] and not dev.reads
    assert io.stats.ops["write"].ops == 1 and io.stats.ops["write"].bytes == 48
    assert len(io.lock) == 0
