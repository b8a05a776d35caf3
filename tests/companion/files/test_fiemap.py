"""FS_IOC_FIEMAP's structures and the read plan, with no I/O (companion/fiemap.py)."""

from __future__ import annotations

import pytest

from nvmeof_fuse.companion.files import fiemap as fm
from nvmeof_fuse.companion.files.fiemap import Extent, Piece


def reply(extents: list[Extent], count: int | None = None) -> bytearray:
    """What the kernel would write back into a request for ``count`` extents."""
    count = len(extents) if count is None else count
    buf = fm.encode_request(0, 1 << 40, max(count, 1))
    fm.HEADER.pack_into(buf, 0, 0, 1 << 40, fm.FIEMAP_FLAG_SYNC, len(extents), max(count, 1), 0)
    for i, e in enumerate(extents):
        fm.EXTENT.pack_into(buf, fm.HEADER.size + i * fm.EXTENT.size, e.logical, e.physical,
                            e.length, 0, 0, e.flags, 0, 0, 0)
    return buf


def test_the_structures_have_the_kernels_sizes_and_ioctl_number():
    assert fm.HEADER.size == 32 and fm.EXTENT.size == 56
    # _IOWR('f', 11, struct fiemap): dir 3 << 30, size 32 << 16, type 'f' << 8, nr 11
    assert fm.FS_IOC_FIEMAP == (3 << 30) | (32 << 16) | (ord("f") << 8) | 11


def test_a_request_asks_for_its_range_with_sync_and_room():
    buf = fm.encode_request(4096, 1 << 20, 3)
    assert len(buf) == 32 + 3 * 56
    assert fm.HEADER.unpack_from(buf) == (4096, 1 << 20, fm.FIEMAP_FLAG_SYNC, 0, 3, 0)
    with pytest.raises(ValueError, match="bad FIEMAP request"):
        fm.encode_request(0, 10, 0)


def test_a_reply_round_trips_and_lies_are_caught():
    extents = [Extent(0, 1 << 20, 8192, 0), Extent(8192, 5 << 20, 4096, fm.LAST)]
    assert fm.parse_reply(reply(extents)) == extents
    with pytest.raises(fm.FiemapError, match="shorter than its header"):
        fm.parse_reply(b"\0" * 8)
    bad = reply(extents)
    fm.HEADER.pack_into(bad, 0, 0, 0, 0, 3, 2, 0)  # maps more than it had room for
    with pytest.raises(fm.FiemapError, match="maps 3 extents, room for 2"):
        fm.parse_reply(bad)
    overlapping = [Extent(0, 0, 8192, 0), Extent(4096, 0, 4096, 0)]
    with pytest.raises(fm.FiemapError, match="overlaps"):
        fm.parse_reply(reply(overlapping))


def test_more_after_asks_again_only_for_a_full_reply_without_last():
    full = [Extent(0, 0, 4096, 0), Extent(4096, 8192, 4096, 0)]
    assert fm.more_after(full, 2) == 8192
    assert fm.more_after(full, 3) is None
    assert fm.more_after([*full[:1], Extent(4096, 8192, 4096, fm.LAST)], 2) is None
    assert fm.more_after([], 2) is None


def test_holes_unwritten_and_clean_extents():
    extents = [Extent(4096, 1 << 20, 8192, 0),  # clean
               Extent(12288, 2 << 20, 4096, fm.UNWRITTEN),  # fallocated: zeros
               Extent(20480, 3 << 20, 4096, fm.LAST)]  # after a hole at 16384
    plan = fm.plan_read(extents, 100, 30000, 512)
    assert plan == [
        Piece("zeros", 0, 100, 3996),
        Piece("device", 3996, 4096, 8192, 1 << 20),
        Piece("zeros", 12188, 12288, 8192),  # unwritten + hole, merged
        Piece("device", 20380, 20480, 4096, 3 << 20),
        Piece("zeros", 24476, 24576, 5524),  # past the last extent (a sparse tail)
    ]
    assert sum(p.length for p in plan) == 30000


def test_a_range_inside_one_extent_starts_at_its_offset():
    plan = fm.plan_read([Extent(0, 1 << 20, 1 << 20, fm.LAST)], 12345, 1000, 512)
    assert plan == [Piece("device", 0, 12345, 1000, (1 << 20) + 12345)]


def test_physically_contiguous_extents_merge_others_do_not():
    extents = [Extent(0, 1 << 20, 4096, 0), Extent(4096, (1 << 20) + 4096, 4096, 0),
               Extent(8192, 9 << 20, 4096, fm.LAST)]
    plan = fm.plan_read(extents, 0, 12288, 512)
    assert [(p.kind, p.length, p.physical) for p in plan] == [
        ("device", 8192, 1 << 20), ("device", 4096, 9 << 20)]


@pytest.mark.parametrize(("flags", "why"), [
    (0x4, "delayed allocation"), (0x8, "encoded"), (0x80, "encrypted"),
    (0x100, "not aligned"), (0x200, "data inline"), (0x400, "tail-packed"),
    (0x2000, "shared"), (0x2, "unknown location"), (0x1000, "merged"),
    (0x40000, "flags 0x40000"), (0x2000 | 0x80 | fm.LAST, "encrypted, shared")])
def test_any_other_flag_sends_the_extent_to_the_kernel_with_its_name(flags, why):
    extents = [Extent(0, 1 << 20, 4096, 0), Extent(4096, 2 << 20, 4096, flags)]
    plan = fm.plan_read(extents, 0, 8192, 512)
    assert plan[0].kind == "device"
    assert plan[1].kind == "kernel" and plan[1].offset == 4096 and why in plan[1].why


def test_an_extent_off_the_devices_sectors_goes_to_the_kernel():
    plan = fm.plan_read([Extent(0, (1 << 20) + 100, 4096, fm.LAST)], 0, 4096, 512)
    assert plan == [Piece("kernel", 0, 0, 4096, why="extent not aligned to the device's "
                          "sectors")]


def test_unusable_is_empty_for_last_and_unwritten():
    assert fm.unusable(fm.LAST | fm.UNWRITTEN) == ""
    assert fm.unusable(0) == ""
