"""16-byte SGL descriptors placed in a command's DPTR (bytes 24..39).

Layouts: NVMe Base 2.0 "SGL Descriptor Format" / "Keyed SGL Data Block
descriptor"; the descriptor identifier (byte 15) holds the type in bits 7:4
and the subtype in bits 3:0.
"""

from __future__ import annotations

import struct

from ._fields import uint

TYPE_DATA_BLOCK = 0x0
TYPE_KEYED_DATA_BLOCK = 0x4
SUBTYPE_ADDRESS = 0x0
SUBTYPE_OFFSET = 0x1
SUBTYPE_INVALIDATE_KEY = 0xF
"""NVMe/RDMA: ask the target to Send with Invalidate for this key."""

MAX_KEYED_LENGTH = (1 << 24) - 1
"""A keyed data block describes at most 2**24 - 1 bytes (3-byte length)."""
_KEYED = struct.Struct("<QQ")  # address; then length (24 bits), key (32), identifier (8)


def keyed_data_block(addr: int, length: int, key: int, invalidate: bool = False) -> bytes:
    """Keyed SGL Data Block: remote memory at ``addr`` (``length`` bytes) under RDMA ``key``.

    Bytes 0..7 address, 8..10 length, 11..14 key, 15 = 0x40 (0x4F with ``invalidate``).
    """
    subtype = SUBTYPE_INVALIDATE_KEY if invalidate else SUBTYPE_ADDRESS
    if (type(addr) is int and type(length) is int and type(key) is int  # the I/O path
            and 0 <= addr < 1 << 64 and 0 <= length <= MAX_KEYED_LENGTH and 0 <= key < 1 << 32):
        return _KEYED.pack(addr, length | key << 24 | (TYPE_KEYED_DATA_BLOCK << 4 | subtype) << 56)
    return (
        struct.pack("<Q", uint("SGL address", addr, 64))
        + uint("keyed SGL length", length, 24).to_bytes(3, "little")
        + struct.pack("<IB", uint("SGL key", key, 32), TYPE_KEYED_DATA_BLOCK << 4 | subtype)
    )


def pack_keyed_data_block_into(buf, offset: int, addr: int, length: int, key: int) -> None:
    """:func:`keyed_data_block` (address subtype) written into ``buf`` at ``offset``.

    For the I/O path: builds no bytes object.
    """
    if not (type(length) is int and type(key) is int
            and 0 <= length <= MAX_KEYED_LENGTH and 0 <= key < 1 << 32):
        raise ValueError(f"keyed SGL length {length} or key {key} out of range")
    try:
        _KEYED.pack_into(buf, offset, addr, length | key << 24 | TYPE_KEYED_DATA_BLOCK << 60)
    except struct.error:
        raise ValueError(f"SGL address {addr!r} out of range") from None


def in_capsule_data(offset: int, length: int) -> bytes:
    """Data Block with Offset subtype: ``length`` bytes of in-capsule data at ``offset``.

    ``offset`` counts from the start of the capsule's data area (the ICDOFF-adjusted start).
    Bytes 0..7 offset, 8..11 length, 15 = 0x01.
    """
    return struct.pack(
        "<QI3xB",
        uint("in-capsule offset", offset, 64),
        uint("in-capsule length", length, 32),
        TYPE_DATA_BLOCK << 4 | SUBTYPE_OFFSET,
    )


NULL_SGL = keyed_data_block(0, 0, 0)
"""Keyed descriptor of length 0, for commands that move no data (as Linux nvme-rdma sends)."""
