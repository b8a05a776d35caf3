"""SGL descriptors against NVMe Base 2.0 "SGL Descriptor Format" and "Keyed SGL Data Block
descriptor" (byte 15: type in bits 7:4, subtype in bits 3:0)."""

import pytest

from nvmeof_fuse.nvme.sgl import (
    MAX_KEYED_LENGTH,
    NULL_SGL,
    in_capsule_data,
    keyed_data_block,
    pack_keyed_data_block_into,
)


def test_keyed_data_block_layout():
    d = keyed_data_block(0x1122334455667788, 0x123456, 0xA1B2C3D4)
    assert len(d) == 16
    assert int.from_bytes(d[0:8], "little") == 0x1122334455667788  # ADDRESS, bytes 7:0
    assert d[8:11] == bytes([0x56, 0x34, 0x12])  # LENGTH, bytes 10:8, 3 bytes LE
    assert int.from_bytes(d[11:15], "little") == 0xA1B2C3D4  # KEY, bytes 14:11
    assert d[15] == 0x40  # type 4h (Keyed Data Block), subtype 0h (Address)


def test_keyed_invalidate_subtype():
    assert keyed_data_block(0, 1, 1, invalidate=True)[15] == 0x4F  # subtype Fh: invalidate key


def test_keyed_max_length_and_overflow():
    assert keyed_data_block(0, MAX_KEYED_LENGTH, 0)[8:11] == b"\xff\xff\xff"
    with pytest.raises(ValueError, match="keyed SGL length must fit in 24 bits"):
        keyed_data_block(0, MAX_KEYED_LENGTH + 1, 0)
    with pytest.raises(ValueError, match="SGL key"):
        keyed_data_block(0, 1, 1 << 32)
    with pytest.raises(ValueError, match="SGL address"):
        keyed_data_block(-1, 1, 0)


def test_in_capsule_data_layout():
    d = in_capsule_data(0x10, 1024)
    assert int.from_bytes(d[0:8], "little") == 0x10  # offset into the capsule data
    assert int.from_bytes(d[8:12], "little") == 1024  # LENGTH, bytes 11:8
    assert d[12:15] == b"\0\0\0"
    assert d[15] == 0x01  # type 0h (Data Block), subtype 1h (Offset)


def test_null_sgl_is_zero_length_keyed():
    assert NULL_SGL == bytes(15) + b"\x40"


def test_keyed_data_block_packed_into_a_buffer_is_the_same_descriptor():
    buf = bytearray(b"\xff" * 40)
    pack_keyed_data_block_into(buf, 24, 0x1122334455667788, 0x123456, 0xA1B2C3D4)
    assert buf[24:40] == keyed_data_block(0x1122334455667788, 0x123456, 0xA1B2C3D4)
    assert buf[:24] == b"\xff" * 24


@pytest.mark.parametrize("addr, length, key, what", [
    (0, MAX_KEYED_LENGTH + 1, 1, "length"), (0, 1, 1 << 32, "key"), (-1, 1, 1, "address")])
def test_keyed_data_block_packed_into_a_buffer_refuses_bad_fields(addr, length, key, what):
    with pytest.raises(ValueError, match=what):
        pack_keyed_data_block_into(bytearray(16), 0, addr, length, key)
