"""Completion entries against NVMe Base 2.0 "Common Completion Queue Entry Layout" and
"Completion Queue Entry: Status Field": in the 16-bit word at bytes 14..15, bit 0 is the
phase tag, SC bits 8:1, SCT 11:9, CRD 13:12, More 14, DNR 15."""

import errno
import struct

import pytest

from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.nvme.completion import Completion
from nvmeof_fuse.nvme.status import NVMeStatusError


def cqe(result=0, sq_head=0, sq_id=0, cid=0, *, phase=0, sc=0, sct=0, crd=0, more=0, dnr=0):
    word = phase | sc << 1 | sct << 9 | crd << 12 | more << 14 | dnr << 15
    return struct.pack("<QHHHH", result, sq_head, sq_id, cid, word)


def test_fields():
    c = Completion.from_bytes(cqe(0x1122334455667788, 5, 1, 0x1234, phase=1))
    assert c.result == 0x1122334455667788
    assert c.dw0 == 0x55667788 and c.dw1 == 0x11223344
    assert (c.sq_head, c.sq_id, c.command_id) == (5, 1, 0x1234)
    assert c.phase is True
    assert c.status == 0  # the phase bit is not part of the status
    assert c.ok


def test_unpack_from_reads_in_place():
    ring = bytearray(48)
    ring[16:32] = cqe(7, 3, 2, 0x42, phase=1, sc=0x2)
    c = Completion.unpack_from(memoryview(ring), 16)
    assert c == Completion.from_bytes(ring[16:32])
    assert (c.result, c.sq_head, c.sq_id, c.command_id, c.sc, c.phase) == (7, 3, 2, 0x42, 2, True)


def test_status_bits():
    c = Completion.from_bytes(cqe(phase=1, sc=0x82, sct=1, crd=2, more=1, dnr=1))
    assert (c.sc, c.sct, c.crd) == (0x82, 1, 2)
    assert c.more and c.dnr and not c.ok
    assert c.status == 0x82 | 1 << 8 | 2 << 11 | 1 << 13 | 1 << 14
    assert c.status_name(fabrics=True) == "Connect Invalid Parameters"
    assert c.status_name() == "Attempted Write to Read Only Range"


def test_dnr_or_more_alone_is_still_success():
    # Only SCT/SC decide success; a set DNR or More bit with SC 0 is not a failure.
    assert Completion.from_bytes(cqe(dnr=1)).ok


def test_accepts_memoryview_and_longer_buffers():
    raw = bytearray(cqe(cid=9, sc=0x80)) + b"trailing"
    c = Completion.from_bytes(memoryview(raw))
    assert (c.command_id, c.sc) == (9, 0x80)


def test_short_buffer():
    with pytest.raises(ValueError, match="completion needs 16 bytes, got 15"):
        Completion.from_bytes(bytes(15))


def test_raise_for_status():
    Completion.from_bytes(cqe(phase=1)).raise_for_status("Read")
    c = Completion.from_bytes(cqe(phase=1, sc=0x80, dnr=1))
    with pytest.raises(NVMeStatusError) as info:
        c.raise_for_status("Read")
    e = info.value
    assert isinstance(e, NVMeoFError)
    assert str(e) == "Read failed: LBA Out of Range (sct 0x0, sc 0x80, dnr)"
    assert (e.sct, e.sc, e.dnr, e.command) == (0, 0x80, True, "Read")
    assert e.name == "LBA Out of Range"
    assert e.errno == errno.ENOSPC


def test_raise_for_connect_invalid_parameters():
    # DW0: IATTR (bit 16) = 1, the Connect data; IPO = 512, HOSTNQN.
    c = Completion.from_bytes(cqe(1 << 16 | 512, sc=0x82, sct=1, dnr=1))
    with pytest.raises(NVMeStatusError) as info:
        c.raise_for_status("Connect", fabrics=True)
    assert str(info.value) == (
        "Connect failed: Connect Invalid Parameters: HOSTNQN in Connect data (byte 512)"
        " (sct 0x1, sc 0x82, dnr)"
    )
    assert info.value.errno == errno.EINVAL
    assert info.value.result == 1 << 16 | 512
