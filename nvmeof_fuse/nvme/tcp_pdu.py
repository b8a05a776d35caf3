"""NVMe/TCP PDUs (NVMe/TCP Transport Specification 1.0): encoders and header parsers, no I/O.

Every PDU starts with an 8-byte common header (type, flags, HLEN, PDO, PLEN).
After ICReq/ICResp, a header digest (CRC32C of the HLEN header bytes) follows
every header when both sides agreed to one, and a data digest (CRC32C of the
data) follows the data of every PDU that carries data.  Digests are stored
little-endian.  PDO is where the data starts: after the header, its digest
and padding up to the receiver's PDU data alignment (CPDA from the host's
side, HPDA from the controller's).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from crc32c import crc32c

from .completion import Completion

ICREQ = 0x00
ICRESP = 0x01
H2C_TERM_REQ = 0x02
C2H_TERM_REQ = 0x03
CAPSULE_CMD = 0x04
CAPSULE_RESP = 0x05
H2C_DATA = 0x06
C2H_DATA = 0x07
R2T = 0x09

FLAG_HDGST = 0x01
FLAG_DDGST = 0x02
FLAG_LAST_PDU = 0x04
FLAG_SUCCESS = 0x08
"""C2HData: the command succeeded and no CapsuleResp follows (only with LAST_PDU)."""

DIGEST_BYTES = 4
IC_PDU_LENGTH = 128
COMMON_HEADER = struct.Struct("<BBBBI")  # pdu-type, flags, hlen, pdo, plen
CAPSULE_CMD_HLEN = 72  # common header + 64-byte SQE
CAPSULE_RESP_HLEN = 24  # common header + 16-byte CQE
DATA_HLEN = 24  # H2CData / C2HData / R2T
TERM_REQ_HLEN = 24
_DATA = struct.Struct("<HHII4x")  # cccid, ttag (H2C/R2T) or reserved (C2H), offset, length
_TERM = struct.Struct("<HI")  # FES, FEI

HEADER_LENGTHS = {
    ICRESP: IC_PDU_LENGTH,
    C2H_TERM_REQ: TERM_REQ_HLEN,
    CAPSULE_RESP: CAPSULE_RESP_HLEN,
    C2H_DATA: DATA_HLEN,
    R2T: DATA_HLEN,
}
"""The PDUs a controller may send a host, with their fixed header lengths."""

PDU_NAMES = {ICREQ: "ICReq", ICRESP: "ICResp", H2C_TERM_REQ: "H2CTermReq",
             C2H_TERM_REQ: "C2HTermReq", CAPSULE_CMD: "CapsuleCmd", CAPSULE_RESP: "CapsuleResp",
             H2C_DATA: "H2CData", C2H_DATA: "C2HData", R2T: "R2T"}

TERM_REASONS = {1: "invalid PDU header field", 2: "PDU sequence error",
                3: "header digest error", 4: "data transfer out of range",
                5: "data transfer limit exceeded", 6: "unsupported parameter"}
"""Fatal Error Status of a C2HTermReq/H2CTermReq."""

MIN_MAXH2CDATA = 4096


class PduError(ValueError):
    """A PDU that breaks the protocol; the message names the PDU and the field."""


def digest(data) -> bytes:
    """The 4-byte CRC32C digest of ``data`` (any buffer), as it goes on the wire."""
    return crc32c(data).to_bytes(4, "little")


def align(length: int, pda: int) -> int:
    """``length`` rounded up to a PDU data alignment field (0's based, in dwords)."""
    unit = (pda + 1) * 4
    return -(-length // unit) * unit


# --- connection setup ---------------------------------------------------------------------------

def icreq_pdu(*, hpda: int = 0, header_digest: bool = False, data_digest: bool = False,
              maxr2t: int = 0) -> bytes:
    """Initialize Connection Request PDU (ICReq): 128 bytes."""
    digests = (1 if header_digest else 0) | (2 if data_digest else 0)
    head = COMMON_HEADER.pack(ICREQ, 0, IC_PDU_LENGTH, 0, IC_PDU_LENGTH)
    body = struct.pack("<HBBI", 0, hpda, digests, maxr2t)  # PFV 0, HPDA, DGST, MAXR2T
    return (head + body).ljust(IC_PDU_LENGTH, b"\0")


@dataclass(frozen=True, slots=True)
class ICResp:
    """Initialize Connection Response: what the controller agreed to."""

    pfv: int
    cpda: int
    header_digest: bool
    data_digest: bool
    maxh2cdata: int


def parse_icresp(pdu: bytes) -> ICResp:
    """Parse a 128-byte ICResp PDU; raise ValueError naming what is wrong."""
    if len(pdu) != IC_PDU_LENGTH:
        raise PduError(f"ICResp must be {IC_PDU_LENGTH} bytes, got {len(pdu)}")
    pdu_type, _flags, hlen, _pdo, plen = COMMON_HEADER.unpack_from(pdu)
    if pdu_type == C2H_TERM_REQ:
        fes, _ = _TERM.unpack_from(pdu, 8)
        raise PduError(f"a C2HTermReq instead of an ICResp ({term_reason(fes)})")
    if pdu_type != ICRESP or hlen != IC_PDU_LENGTH or plen != IC_PDU_LENGTH:
        raise PduError(f"not an ICResp PDU (type {pdu_type:#x}, hlen {hlen}, plen {plen})")
    pfv, cpda, dgst, maxh2cdata = struct.unpack_from("<HBBI", pdu, 8)
    return ICResp(pfv, cpda, bool(dgst & 1), bool(dgst & 2), maxh2cdata)


def check_icresp(resp: ICResp, *, header_digest: bool, data_digest: bool) -> None:
    """Raise PduError if the controller's ICResp is one this host cannot work with."""
    if resp.pfv != 0:
        raise PduError(f"ICResp has PDU format version {resp.pfv}, expected 0")
    if resp.cpda > 31:
        raise PduError(f"ICResp has CPDA {resp.cpda}, above the maximum of 31")
    if resp.maxh2cdata < MIN_MAXH2CDATA or resp.maxh2cdata % 4:
        raise PduError(f"ICResp has MAXH2CDATA {resp.maxh2cdata}, not a multiple of 4 "
                       f"of at least {MIN_MAXH2CDATA}")
    for what, asked, got in (("header", header_digest, resp.header_digest),
                             ("data", data_digest, resp.data_digest)):
        if got and not asked:
            raise PduError(f"ICResp enables a {what} digest the host did not ask for")


def term_reason(fes: int) -> str:
    return TERM_REASONS.get(fes, f"fatal error status {fes:#x}")


# --- host to controller -------------------------------------------------------------------------

def capsule_cmd_header(sqe, data_length: int, *, header_digest: bool, data_digest: bool,
                       cpda: int = 0) -> bytes:
    """CapsuleCmd PDU up to its in-capsule data: header, digest and padding.

    The data (``data_length`` bytes) and, with ``data_digest``, its digest follow.
    """
    hd = DIGEST_BYTES if header_digest else 0
    flags = FLAG_HDGST if header_digest else 0
    dd = 0
    pdo = 0
    start = CAPSULE_CMD_HLEN + hd
    if data_length:
        pdo = align(start, cpda)
        if data_digest:
            flags |= FLAG_DDGST
            dd = DIGEST_BYTES
    plen = (pdo or start) + data_length + dd
    head = COMMON_HEADER.pack(CAPSULE_CMD, flags, CAPSULE_CMD_HLEN, pdo, plen) + bytes(sqe)
    if header_digest:
        head += digest(head)
    if pdo > start:
        head += bytes(pdo - start)
    return head


def h2c_data_header(cid: int, ttag: int, offset: int, length: int, *, last: bool,
                    header_digest: bool, data_digest: bool, cpda: int = 0) -> bytes:
    """H2CData PDU up to its data: header, digest and padding."""
    hd = DIGEST_BYTES if header_digest else 0
    flags = (FLAG_HDGST if header_digest else 0) | (FLAG_DDGST if data_digest else 0)
    if last:
        flags |= FLAG_LAST_PDU
    pdo = align(DATA_HLEN + hd, cpda)
    plen = pdo + length + (DIGEST_BYTES if data_digest else 0)
    head = COMMON_HEADER.pack(H2C_DATA, flags, DATA_HLEN, pdo, plen) + _DATA.pack(
        cid, ttag, offset, length)
    if header_digest:
        head += digest(head)
    return head.ljust(pdo, b"\0")


def h2c_pieces(offset: int, length: int, maxh2cdata: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each H2CData PDU answering an R2T, each at most MAXH2CDATA."""
    return [(at, min(maxh2cdata, offset + length - at))
            for at in range(offset, offset + length, maxh2cdata)]


# --- controller to host -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Header:
    """A parsed PDU header from the controller (its data, if any, still on the wire)."""

    type: int
    flags: int
    hlen: int
    pdo: int
    plen: int
    cid: int = 0
    ttag: int = 0
    offset: int = 0
    length: int = 0
    """C2HData/R2T: the data offset and length the PDU names."""
    completion: Completion | None = None
    data_digest: bool = False
    """C2HData: a data digest follows the data."""

    @property
    def name(self) -> str:
        return PDU_NAMES.get(self.type, f"PDU type {self.type:#x}")


def peek_common(buf, offset: int = 0) -> tuple[int, int, int, int, int]:
    """``(type, flags, hlen, pdo, plen)`` of the common header at ``offset``."""
    return COMMON_HEADER.unpack_from(buf, offset)


def peek_data_length(buf, offset: int = 0) -> int:
    """The data length an R2T (or C2HData, H2CData) header at ``offset`` names, unchecked:
    :func:`parse_header` checks the header when the PDU is handled."""
    return _DATA.unpack_from(buf, offset + COMMON_HEADER.size)[3]


def header_bytes(pdu_type: int, hlen: int, *, header_digest: bool) -> int:
    """How many bytes the header of a controller PDU takes with its digest; PduError if
    the type is unknown or ``hlen`` is not the type's."""
    expected = HEADER_LENGTHS.get(pdu_type)
    if expected is None:
        raise PduError(f"unknown PDU type {pdu_type:#x} from the controller")
    if hlen != expected:
        raise PduError(f"{PDU_NAMES[pdu_type]} PDU with header length {hlen}, "
                       f"expected {expected}")
    # C2HTermReq never carries digests (the connection may be what failed)
    return hlen + (DIGEST_BYTES if header_digest and pdu_type not in (ICRESP, C2H_TERM_REQ)
                   else 0)


def parse_header(buf, offset: int = 0, *, header_digest: bool, data_digest: bool) -> Header:
    """Parse and check the controller PDU header (with its digest) at ``offset``.

    Raises PduError naming the PDU and what is wrong: an unknown type, a header
    length, digest or flag that disagrees with the connection, a PLEN that
    disagrees with the header.
    """
    pdu_type, flags, hlen, pdo, plen = COMMON_HEADER.unpack_from(buf, offset)
    size = header_bytes(pdu_type, hlen, header_digest=header_digest)
    name = PDU_NAMES[pdu_type]
    if pdu_type == C2H_TERM_REQ:
        fes, fei = _TERM.unpack_from(buf, offset + 8)
        return Header(pdu_type, flags, hlen, pdo, plen, offset=fei, length=fes)
    if header_digest:
        if not flags & FLAG_HDGST:
            raise PduError(f"{name} PDU without the header digest the connection uses")
        want = digest(buf[offset:offset + hlen])
        got = bytes(buf[offset + hlen:offset + size])
        if got != want:
            raise PduError(f"header digest mismatch on {name} PDU "
                           f"(got {got.hex()}, computed {want.hex()})")
    elif flags & FLAG_HDGST:
        raise PduError(f"{name} PDU has a header digest the connection did not agree to")
    if pdu_type == CAPSULE_RESP or pdu_type == R2T:
        if plen != size:
            raise PduError(f"{name} PDU length {plen} disagrees with its header ({size} bytes)")
        if pdu_type == CAPSULE_RESP:
            return Header(pdu_type, flags, hlen, pdo, plen,
                          completion=Completion.unpack_from(buf, offset + 8))
        cid, ttag, r2to, r2tl = _DATA.unpack_from(buf, offset + 8)
        if r2tl == 0:
            raise PduError(f"R2T for command {cid} asks for 0 bytes")
        return Header(pdu_type, flags, hlen, pdo, plen, cid, ttag, r2to, r2tl)
    if pdu_type == C2H_DATA:
        cid, _, datao, datal = _DATA.unpack_from(buf, offset + 8)
        ddgst = bool(flags & FLAG_DDGST)
        if ddgst != data_digest:
            raise PduError(f"C2HData PDU {'has' if ddgst else 'lacks'} a data digest, "
                           f"but the connection {'does not use' if ddgst else 'uses'} one")
        if flags & FLAG_SUCCESS and not flags & FLAG_LAST_PDU:
            raise PduError(f"C2HData PDU for command {cid} has SUCCESS without LAST_PDU")
        if datal == 0:
            raise PduError(f"C2HData PDU for command {cid} carries 0 bytes")
        if pdo < size or pdo - size > 128:
            raise PduError(f"C2HData PDU data offset {pdo} is not after its {size}-byte header")
        expected = pdo + datal + (DIGEST_BYTES if ddgst else 0)
        if plen != expected:
            raise PduError(f"C2HData PDU length {plen} disagrees with its header (data offset "
                           f"{pdo} + {datal} data bytes{' + digest' if ddgst else ''} = "
                           f"{expected})")
        return Header(pdu_type, flags, hlen, pdo, plen, cid, 0, datao, datal,
                      data_digest=ddgst)
    raise PduError(f"unexpected {name} PDU after the connection was set up")
