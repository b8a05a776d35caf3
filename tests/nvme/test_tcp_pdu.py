"""NVMe/TCP PDU layouts: CapsuleCmd, H2CData, and the checks on the controller's headers."""

import struct

import pytest

from nvmeof_fuse.nvme import tcp_pdu as pdu

SQE = bytes(range(64))


def test_crc32c_is_the_castagnoli_check_value_little_endian():
    assert pdu.digest(b"123456789") == (0xE3069283).to_bytes(4, "little")


def test_capsule_without_data():
    head = pdu.capsule_cmd_header(SQE, 0, header_digest=False, data_digest=False)
    assert head == struct.pack("<BBBBI", 4, 0, 72, 0, 72) + SQE


def test_capsule_with_in_capsule_data_and_both_digests():
    head = pdu.capsule_cmd_header(SQE, 4096, header_digest=True, data_digest=True)
    assert struct.unpack_from("<BBBBI", head) == (4, 3, 72, 76, 76 + 4096 + 4)
    assert head[76:] == b"" and head[72:76] == pdu.digest(head[:72])


def test_capsule_data_is_padded_to_the_controllers_alignment():
    head = pdu.capsule_cmd_header(SQE, 512, header_digest=True, data_digest=False, cpda=3)
    assert len(head) == 80 and head[3] == 80 and head[76:] == bytes(4)  # 16-byte units
    assert struct.unpack_from("<I", head, 4) == (80 + 512,)


def test_h2c_data_header():
    head = pdu.h2c_data_header(5, 9, 8192, 4096, last=True, header_digest=False,
                               data_digest=True)
    assert struct.unpack("<BBBBIHHII4x", head) == (6, 2 | 4, 24, 24, 24 + 4096 + 4, 5, 9,
                                                   8192, 4096)


def test_h2c_pieces_split_at_maxh2cdata():
    assert pdu.h2c_pieces(4096, 20000, 8192) == [(4096, 8192), (12288, 8192), (20480, 3616)]
    assert pdu.h2c_pieces(0, 4096, 1 << 22) == [(0, 4096)]


def c2h(cid=1, offset=0, length=512, flags=pdu.FLAG_LAST_PDU, pdo=24, plen=None):
    plen = pdo + length if plen is None else plen
    return struct.pack("<BBBBIHHII4x", pdu.C2H_DATA, flags, 24, pdo, plen, cid, 0, offset,
                       length)


def test_parse_c2h_data():
    header = pdu.parse_header(c2h(cid=7, offset=512, length=1024, pdo=32), header_digest=False,
                              data_digest=False)
    assert (header.type, header.cid, header.offset, header.length, header.pdo) == (
        pdu.C2H_DATA, 7, 512, 1024, 32)


def test_peek_data_length_reads_an_r2ts_length_where_the_buffer_holds_it():
    r2t = struct.pack("<BBBBIHHII4x", pdu.R2T, 0, 24, 0, 24, 3, 8, 4096, 65536)
    assert pdu.peek_data_length(b"xx" + r2t, 2) == 65536
    assert pdu.parse_header(r2t, header_digest=False, data_digest=False).length == 65536


def test_parse_capsule_resp_with_a_header_digest():
    head = struct.pack("<BBBBI", 5, 1, 24, 0, 28) + struct.pack("<QHHHH", 9, 3, 1, 17, 0)
    header = pdu.parse_header(head + pdu.digest(head), header_digest=True, data_digest=False)
    assert header.completion.command_id == 17 and header.completion.result == 9


@pytest.mark.parametrize(("raw", "digests", "message"), [
    (c2h(plen=600), (False, False), "C2HData PDU length 600 disagrees with its header"),
    (c2h(flags=pdu.FLAG_SUCCESS), (False, False), "SUCCESS without LAST_PDU"),
    (c2h(length=0), (False, False), "carries 0 bytes"),
    (c2h(pdo=8), (False, False), "data offset 8 is not after its 24-byte header"),
    (c2h(), (False, True), "lacks a data digest, but the connection uses one"),
    (c2h(flags=pdu.FLAG_HDGST | pdu.FLAG_LAST_PDU), (False, False),
     "has a header digest the connection did not agree to"),
    (c2h() + bytes(4), (True, False), "without the header digest the connection uses"),
    (c2h(flags=pdu.FLAG_HDGST | pdu.FLAG_LAST_PDU) + b"bad!", (True, False),
     "header digest mismatch on C2HData PDU"),
    (struct.pack("<BBBBI", 0x0C, 0, 24, 0, 24) + bytes(16), (False, False),
     "unknown PDU type 0xc"),
    (struct.pack("<BBBBI", 5, 0, 40, 0, 40) + bytes(32), (False, False),
     "CapsuleResp PDU with header length 40, expected 24"),
    (struct.pack("<BBBBI", 5, 0, 24, 0, 30) + bytes(16), (False, False),
     "CapsuleResp PDU length 30 disagrees with its header"),
    (struct.pack("<BBBBIHHII4x", 9, 0, 24, 0, 24, 1, 2, 0, 0), (False, False),
     "R2T for command 1 asks for 0 bytes"),
])
def test_bad_headers_are_named(raw, digests, message):
    with pytest.raises(pdu.PduError, match=message):
        pdu.parse_header(raw, header_digest=digests[0], data_digest=digests[1])


def test_a_term_req_carries_its_reason_without_digests():
    raw = struct.pack("<BBBBI", 3, 0, 24, 0, 24) + struct.pack("<HI", 3, 0).ljust(16, b"\0")
    header = pdu.parse_header(raw, header_digest=True, data_digest=True)
    assert pdu.term_reason(header.length) == "header digest error"


@pytest.mark.parametrize(("fields", "message"), [
    ({"pfv": 1}, "PDU format version 1"),
    ({"cpda": 32}, "CPDA 32"),
    ({"maxh2cdata": 1024}, "MAXH2CDATA 1024"),
])
def test_icresp_this_host_cannot_use(fields, message):
    resp = pdu.ICResp(**{"pfv": 0, "cpda": 0, "header_digest": False, "data_digest": False,
                         "maxh2cdata": 1 << 22, **fields})
    with pytest.raises(pdu.PduError, match=message):
        pdu.check_icresp(resp, header_digest=False, data_digest=False)
