"""FS_IOC_FIEMAP's structures and a file read's plan from them, with no I/O.

``encode_request`` builds the ``struct fiemap`` a caller hands the ioctl, ``parse_reply``
reads the extents the kernel wrote back (every count and length checked against the
buffer), and ``plan_read`` cuts a byte range of a file into pieces: bytes on the device
(a clean extent), zeros (a hole or an unwritten extent) and bytes only the kernel can
give (an extent flagged with anything else, with the reason).  :mod:`.fsmap` does the
ioctls and reads sysfs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

FS_IOC_FIEMAP = 0xC020660B  # _IOWR('f', 11, struct fiemap)
FIEMAP_FLAG_SYNC = 0x1  # write the file's dirty pages before mapping it

HEADER = struct.Struct("<QQIIII")  # fm_start, fm_length, fm_flags, mapped, count, reserved
EXTENT = struct.Struct("<QQQQQIIII")  # logical, physical, length, 2 reserved, flags, 3 reserved

LAST = 0x1
UNWRITTEN = 0x800
FLAG_NAMES = {
    0x2: "unknown location",
    0x4: "delayed allocation",
    0x8: "encoded",
    0x80: "encrypted",
    0x100: "not aligned",
    0x200: "data inline",
    0x400: "tail-packed",
    0x1000: "merged (not natively extents)",
    0x2000: "shared",
}


class Extent(NamedTuple):
    """One extent as the kernel reported it: bytes of the file at ``logical`` lie at
    ``physical`` on the filesystem's block device."""

    logical: int
    physical: int
    length: int
    flags: int


@dataclass(frozen=True)
class Piece:
    """``length`` bytes of a read at ``offset`` in the file (and in the caller's buffer,
    relative to the read's start: ``at``).  ``kind`` is ``device`` (read at ``physical``),
    ``zeros`` or ``kernel`` (``why`` says why)."""

    kind: str
    at: int
    offset: int
    length: int
    physical: int = 0
    why: str = ""


class FiemapError(ValueError):
    """A FIEMAP reply that does not fit its buffer or contradicts itself."""


def encode_request(start: int, length: int, count: int, flags: int = FIEMAP_FLAG_SYNC
                   ) -> bytearray:
    """A ``struct fiemap`` asking for up to ``count`` extents of ``[start, start+length)``,
    with room for the kernel's answer."""
    if start < 0 or length < 0 or count <= 0:
        raise ValueError(f"bad FIEMAP request: start {start}, length {length}, count {count}")
    buf = bytearray(HEADER.size + count * EXTENT.size)
    HEADER.pack_into(buf, 0, start, length, flags, 0, count, 0)
    return buf


def parse_reply(buf: bytes | bytearray | memoryview) -> list[Extent]:
    """The extents the kernel wrote into a request from :func:`encode_request`."""
    if len(buf) < HEADER.size:
        raise FiemapError(f"FIEMAP reply of {len(buf)} bytes is shorter than its header")
    _start, _length, _flags, mapped, count, _ = HEADER.unpack_from(buf, 0)
    if mapped > count or HEADER.size + mapped * EXTENT.size > len(buf):
        raise FiemapError(f"FIEMAP reply maps {mapped} extents, room for {count}")
    extents = []
    previous_end = -1
    for i in range(mapped):
        logical, physical, length, _r1, _r2, flags, *_ = EXTENT.unpack_from(
            buf, HEADER.size + i * EXTENT.size)
        if logical < previous_end:
            raise FiemapError(f"FIEMAP extent {i} at {logical} overlaps the one before it")
        previous_end = logical + length
        extents.append(Extent(logical, physical, length, flags))
    return extents


def unusable(flags: int) -> str:
    """Why an extent with ``flags`` cannot be read from the device ("" when it can)."""
    rest = flags & ~(LAST | UNWRITTEN)
    if not rest:
        return ""
    names = [name for bit, name in FLAG_NAMES.items() if rest & bit]
    unknown = rest & ~sum(FLAG_NAMES)
    if unknown:
        names.append(f"flags {unknown:#x}")
    return "extent " + ", ".join(names)


def plan_read(extents: list[Extent], offset: int, size: int, block: int) -> list[Piece]:
    """``[offset, offset+size)`` of a file cut into pieces, in order, covering it exactly.

    Bytes no extent covers are a hole (zeros).  A clean extent whose physical offset or
    length is not a multiple of ``block`` (the device's sector) goes to the kernel too.
    """
    pieces: list[Piece] = []
    at = offset
    end = offset + size

    def add(kind: str, start: int, stop: int, physical: int = 0, why: str = "") -> None:
        if stop <= start:
            return
        last = pieces[-1] if pieces else None
        if (last is not None and last.kind == kind and last.offset + last.length == start
                and last.why == why
                and (kind != "device" or last.physical + last.length == physical)):
            pieces[-1] = Piece(kind, last.at, last.offset, last.length + stop - start,
                               last.physical, why)
            return
        pieces.append(Piece(kind, start - offset, start, stop - start, physical, why))

    for extent in sorted(extents):
        first = max(at, extent.logical)
        stop = min(end, extent.logical + extent.length)
        if stop <= first:
            continue
        add("zeros", at, first)  # a hole before this extent
        why = unusable(extent.flags)
        if not why and (extent.physical % block or extent.logical % block
                        or extent.length % block):
            why = "extent not aligned to the device's sectors"
        if why:
            add("kernel", first, stop, why=why)
        elif extent.flags & UNWRITTEN:
            add("zeros", first, stop)
        else:
            add("device", first, stop, extent.physical + first - extent.logical)
        at = stop
    add("zeros", at, end)
    return pieces


def more_after(extents: list[Extent], count: int) -> int | None:
    """Where to ask again when a reply filled all ``count`` slots and did not say LAST;
    None when the mapping is complete."""
    if len(extents) < count or not extents or extents[-1].flags & LAST:
        return None
    tail = extents[-1]
    return tail.logical + tail.length
