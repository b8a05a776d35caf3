"""64-byte submission queue entries, one short builder per command.

Every builder returns a fresh ``bytearray(64)`` with command ID 0; the queue
stamps its own CID with :func:`set_command_id`. All commands use SGLs (PSDT
01b, flags byte 0x40) with the descriptor in DPTR, bytes 24..39.

Common layout (NVMe Base 2.0, "Common Command Format"): byte 0 opcode, byte 1
flags, 2..3 CID, 4..7 NSID, 24..39 DPTR, 40..63 CDW10..CDW15. Fabrics commands
(NVMe Base 2.0, "Fabrics Command") put FCTYPE in byte 4 instead of an NSID.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterable

from ._fields import BytesLike, in_range, uint
from .constants import (
    AUTH_PROTOCOL_ID,
    CNTLID_DYNAMIC,
    CONNECT_DATA_SIZE,
    NQN_MAX_BYTES,
    NSID_ALL,
    OPC_FABRICS,
    PSDT_SGL_METABUF,
    SGL_DESC_SIZE,
    SQE_SIZE,
    AdminOpcode,
    FabricsType,
    IoOpcode,
)
from .sgl import NULL_SGL

MAX_NLB = 65536
"""Most logical blocks one Read/Write/Write Zeroes can move (16-bit 0's based NLB)."""
MAX_DSM_RANGES = 256


def lbas_per_command(max_transfer: int, lba_size: int) -> int:
    """Most LBAs one Read or Write moves: the controller's transfer limit (bytes), at least
    one LBA, at most :data:`MAX_NLB`."""
    return max(1, min(max_transfer // lba_size, MAX_NLB))


def _sqe(opcode: int, nsid: int = 0, sgl: BytesLike = NULL_SGL) -> bytearray:
    if len(sgl) != SGL_DESC_SIZE:
        raise ValueError(f"an SGL descriptor is {SGL_DESC_SIZE} bytes, got {len(sgl)}")
    sqe = bytearray(SQE_SIZE)
    sqe[0] = opcode
    sqe[1] = PSDT_SGL_METABUF
    struct.pack_into("<I", sqe, 4, uint("nsid", nsid, 32))
    sqe[24:40] = sgl
    return sqe


def _fabrics(fctype: FabricsType, sgl: BytesLike = NULL_SGL) -> bytearray:
    sqe = _sqe(OPC_FABRICS, 0, sgl)
    sqe[4] = fctype
    return sqe


def _io_nsid(nsid: int) -> int:
    return in_range("nsid", nsid, 1, NSID_ALL - 1)


def _nlb(nlb: int) -> int:
    """Natural block count -> 0's based NLB field."""
    return in_range("number of logical blocks", nlb, 1, MAX_NLB) - 1


_CID = struct.Struct("<H")


def set_command_id(sqe: bytearray | memoryview, cid: int) -> None:
    """Stamp command identifier ``cid`` into CDW0 bytes 2..3."""
    _CID.pack_into(sqe, 2, cid if type(cid) is int and 0 <= cid <= 0xFFFF
                   else uint("command id", cid, 16))


def command_id(sqe: BytesLike) -> int:
    """The command identifier in CDW0 bytes 2..3."""
    return int.from_bytes(sqe[2:4], "little")


def command_name(sqe: BytesLike, admin: bool) -> str:
    """A readable name for the command in ``sqe`` ("Read", "Identify", "Connect", ...)."""
    opcode = sqe[0]
    try:
        if opcode == OPC_FABRICS:
            return FabricsType(sqe[4]).name.replace("_", " ").title()
        kind = AdminOpcode if admin else IoOpcode
        return kind(opcode).name.replace("_", " ").title()
    except ValueError:
        return f"{'Admin' if admin else 'I/O'} command {opcode:#04x}"


# --- Admin commands ---------------------------------------------------------------------


def identify(cns: int, nsid: int = 0, cntid: int = 0, *, sgl: BytesLike) -> bytearray:
    """Identify: CDW10 = CNS (bits 7:0) | CNTID (bits 31:16); 4096 bytes come back."""
    sqe = _sqe(AdminOpcode.IDENTIFY, nsid, sgl)
    struct.pack_into("<BxH", sqe, 40, uint("cns", cns, 8), uint("cntid", cntid, 16))
    return sqe


def get_log_page(
    lid: int,
    numd_bytes: int,
    offset: int = 0,
    nsid: int = NSID_ALL,
    lsp: int = 0,
    rae: bool = False,
    *,
    sgl: BytesLike,
) -> bytearray:
    """Get Log Page for ``numd_bytes`` bytes starting ``offset`` bytes into log ``lid``.

    CDW10: LID 7:0, LSP 14:8, RAE 15, NUMDL 31:16; CDW11: NUMDU 15:0;
    CDW12/13: LPOL/LPOU. NUMD is the dword count, 0's based.
    """
    if numd_bytes <= 0 or numd_bytes % 4:
        raise ValueError(f"log page length must be a positive multiple of 4, got {numd_bytes}")
    if offset % 4:
        raise ValueError(f"log page offset must be a multiple of 4, got {offset}")
    numd = uint("log page dword count", numd_bytes // 4 - 1, 32)
    cdw10 = uint("lid", lid, 8) | uint("lsp", lsp, 7) << 8 | int(rae) << 15 | (numd & 0xFFFF) << 16
    sqe = _sqe(AdminOpcode.GET_LOG_PAGE, nsid, sgl)
    struct.pack_into("<IIQ", sqe, 40, cdw10, numd >> 16, uint("log page offset", offset, 64))
    return sqe


def set_features(
    fid: int, cdw11: int, save: bool = False, *, sgl: BytesLike = NULL_SGL
) -> bytearray:
    """Set Features: CDW10 = FID (7:0) | SV (bit 31); CDW11 is feature specific."""
    sqe = _sqe(AdminOpcode.SET_FEATURES, 0, sgl)
    cdw10 = uint("fid", fid, 8) | int(save) << 31
    struct.pack_into("<II", sqe, 40, cdw10, uint("cdw11", cdw11, 32))
    return sqe


def get_features(fid: int, sel: int = 0, cdw11: int = 0, *, sgl: BytesLike = NULL_SGL) -> bytearray:
    """Get Features: CDW10 = FID (7:0) | SEL (10:8: 0 current, 1 default, 2 saved, 3 caps)."""
    sqe = _sqe(AdminOpcode.GET_FEATURES, 0, sgl)
    cdw10 = uint("fid", fid, 8) | uint("sel", sel, 3) << 8
    struct.pack_into("<II", sqe, 40, cdw10, uint("cdw11", cdw11, 32))
    return sqe


def keep_alive() -> bytearray:
    """Keep Alive: no fields."""
    return _sqe(AdminOpcode.KEEP_ALIVE)


def async_event_request() -> bytearray:
    """Asynchronous Event Request: no fields; completes when the controller has an event."""
    return _sqe(AdminOpcode.ASYNC_EVENT_REQUEST)


# --- NVM I/O commands (NVM Command Set 1.0) ---------------------------------------------


# Read/Write in one pack (they are the I/O path): opcode, flags, CID 0, NSID, 16 reserved/MPTR
# bytes, DPTR, SLBA, CDW12, 12 zero bytes.
_RW = struct.Struct("<BBxxI16x16sQI12x")
_READ, _WRITE = int(IoOpcode.READ), int(IoOpcode.WRITE)


def _rw_fits(nsid: object, slba: object, nlb: object, sgl: BytesLike) -> bool:
    """Plain ints in range and a 16-byte SGL: anything else takes the checking path."""
    return (type(nsid) is int and type(slba) is int and type(nlb) is int
            and 0 < nsid < NSID_ALL and 0 <= slba < 1 << 64 and 0 < nlb <= MAX_NLB
            and len(sgl) == SGL_DESC_SIZE)


def read(nsid: int, slba: int, nlb: int, sgl: BytesLike) -> bytearray:
    """Read ``nlb`` blocks from ``slba``: CDW10/11 = SLBA, CDW12 bits 15:0 = NLB - 1."""
    if _rw_fits(nsid, slba, nlb, sgl):
        return bytearray(_RW.pack(_READ, PSDT_SGL_METABUF, nsid, sgl, slba, nlb - 1))
    sqe = _sqe(IoOpcode.READ, _io_nsid(nsid), sgl)
    struct.pack_into("<QH", sqe, 40, uint("slba", slba, 64), _nlb(nlb))
    return sqe


def read_into(buf: bytearray | memoryview, at: int, nsid: int, slba: int, nlb: int) -> None:
    """:func:`read` with a null SGL, written into ``buf`` at ``at`` (no SQE object built)."""
    if _rw_fits(nsid, slba, nlb, NULL_SGL):
        _RW.pack_into(buf, at, _READ, PSDT_SGL_METABUF, nsid, NULL_SGL, slba, nlb - 1)
    else:
        buf[at:at + SQE_SIZE] = read(nsid, slba, nlb, NULL_SGL)


def write(nsid: int, slba: int, nlb: int, sgl: BytesLike, fua: bool = False) -> bytearray:
    """Write ``nlb`` blocks at ``slba``; ``fua`` sets Force Unit Access (CDW12 bit 30)."""
    if _rw_fits(nsid, slba, nlb, sgl):
        return bytearray(_RW.pack(_WRITE, PSDT_SGL_METABUF, nsid, sgl, slba,
                                  nlb - 1 | bool(fua) << 30))
    sqe = _sqe(IoOpcode.WRITE, _io_nsid(nsid), sgl)
    cdw12 = _nlb(nlb) | bool(fua) << 30
    struct.pack_into("<QI", sqe, 40, uint("slba", slba, 64), cdw12)
    return sqe


def flush(nsid: int) -> bytearray:
    """Flush the volatile write cache of ``nsid`` (NSID_ALL: every namespace)."""
    return _sqe(IoOpcode.FLUSH, in_range("nsid", nsid, 1, NSID_ALL))


def write_zeroes(nsid: int, slba: int, nlb: int, deallocate: bool = False) -> bytearray:
    """Write Zeroes over ``nlb`` blocks; ``deallocate`` sets DEAC (CDW12 bit 25)."""
    sqe = _sqe(IoOpcode.WRITE_ZEROES, _io_nsid(nsid))
    cdw12 = _nlb(nlb) | int(deallocate) << 25
    struct.pack_into("<QI", sqe, 40, uint("slba", slba, 64), cdw12)
    return sqe


def dataset_management(
    nsid: int, nr_ranges: int, deallocate: bool = True, *, sgl: BytesLike
) -> bytearray:
    """Dataset Management over ``nr_ranges`` ranges (from :func:`dsm_ranges`).

    CDW10 bits 7:0 = NR (0's based); CDW11 bit 2 = AD (deallocate, i.e. trim).
    """
    sqe = _sqe(IoOpcode.DATASET_MANAGEMENT, _io_nsid(nsid), sgl)
    nr = in_range("number of DSM ranges", nr_ranges, 1, MAX_DSM_RANGES) - 1
    struct.pack_into("<II", sqe, 40, nr, int(deallocate) << 2)
    return sqe


def dsm_ranges(ranges: Iterable[tuple[int, int]]) -> bytes:
    """Range list for Dataset Management: 16 bytes per ``(slba, nlb)``.

    Each range: bytes 0..3 context attributes (0), 4..7 length in blocks (not
    0's based), 8..15 starting LBA (NVM Command Set 1.0, "Dataset Management Range").
    """
    out = bytearray()
    for slba, nlb in ranges:
        nlb = in_range("DSM range length", nlb, 1, 0xFFFFFFFF)
        out += struct.pack("<IIQ", 0, nlb, uint("DSM range slba", slba, 64))
    in_range("number of DSM ranges", len(out) // 16, 1, MAX_DSM_RANGES)
    return bytes(out)


# --- Fabrics commands (NVMe Base 2.0 "Fabrics Command Set"; NVMe-oF 1.1) ----------------

CONNECT_DISABLE_SQFLOW = 0x04
"""Connect CATTR bit 2: the host asks to disable SQ flow control (it tracks SQ room itself;
a controller that declines answers an SQ head other than FFFFh); a controller over NVMe/TCP
that agrees may end a successful read with its last C2HData PDU (the SUCCESS flag), without
a CapsuleResp (Linux ``NVME_CONNECT_DISABLE_SQFLOW``)."""


def connect(
    qid: int, sqsize: int, kato_ms: int = 0, cattr: int = 0, *, sgl: BytesLike
) -> bytearray:
    """Connect queue ``qid`` with ``sqsize`` entries; the 1024-byte data is behind ``sgl``.

    Bytes 40..41 RECFMT (0), 42..43 QID, 44..45 SQSIZE (0's based), 46 CATTR,
    48..51 KATO in milliseconds (admin queue only; 0 disables keep alive).
    """
    sqe = _fabrics(FabricsType.CONNECT, sgl)
    struct.pack_into(
        "<HHHBxI",
        sqe,
        40,
        0,
        uint("qid", qid, 16),
        in_range("queue size", sqsize, 2, 65536) - 1,
        uint("cattr", cattr, 8),
        uint("kato_ms", kato_ms, 32),
    )
    return sqe


def _nqn(name: str, nqn: str) -> bytes:
    raw = nqn.encode("utf-8")
    if not raw or len(raw) > NQN_MAX_BYTES:
        raise ValueError(f"{name} must be 1..{NQN_MAX_BYTES} bytes of UTF-8, got {len(raw)}")
    if b"\0" in raw:
        raise ValueError(f"{name} must not contain NUL")
    return raw


def connect_data(hostid: uuid.UUID, cntlid: int, subnqn: str, hostnqn: str) -> bytes:
    """The 1024-byte Connect data: HOSTID 0..15, CNTLID 16..17, SUBNQN at 256, HOSTNQN at 512.

    Use ``CNTLID_DYNAMIC`` (0xFFFF) on the admin queue of a dynamic controller
    subsystem; I/O queues pass the CNTLID the admin Connect returned.
    """
    data = bytearray(CONNECT_DATA_SIZE)
    data[0:16] = hostid.bytes
    struct.pack_into("<H", data, 16, uint("cntlid", cntlid, 16))
    sub, host = _nqn("subsystem NQN", subnqn), _nqn("host NQN", hostnqn)
    data[256 : 256 + len(sub)] = sub
    data[512 : 512 + len(host)] = host
    return bytes(data)


def property_get(offset: int, size8: bool) -> bytearray:
    """Property Get: byte 40 ATTRIB (bits 2:0 = 1 for 8 bytes), bytes 44..47 OFST."""
    sqe = _fabrics(FabricsType.PROPERTY_GET)
    struct.pack_into("<B3xI", sqe, 40, int(size8), uint("property offset", offset, 32))
    return sqe


def property_set(offset: int, value: int, size8: bool) -> bytearray:
    """Property Set: as Property Get plus the value at bytes 48..55."""
    sqe = _fabrics(FabricsType.PROPERTY_SET)
    value = uint("property value", value, 64 if size8 else 32)
    struct.pack_into("<B3xIQ", sqe, 40, int(size8), uint("property offset", offset, 32), value)
    return sqe


def _auth(fctype: FabricsType, length: int, sgl: BytesLike) -> bytearray:
    sqe = _fabrics(fctype, sgl)
    struct.pack_into("<xBBBI", sqe, 40, 0x01, 0x01, AUTH_PROTOCOL_ID,
                     in_range("authentication data length", length, 1, 0xFFFFFFFF))
    return sqe


def auth_send(length: int, *, sgl: BytesLike) -> bytearray:
    """Authentication Send of ``length`` bytes (an in-band authentication message).

    Byte 41 SPSP0 = 1, 42 SPSP1 = 1, 43 SECP = E9h (NVMe in-band authentication),
    44..47 TL: the transfer length, equal to the data behind ``sgl``.
    """
    return _auth(FabricsType.AUTH_SEND, length, sgl)


def auth_receive(length: int, *, sgl: BytesLike) -> bytearray:
    """Authentication Receive into ``length`` bytes: as Send, with AL at bytes 44..47."""
    return _auth(FabricsType.AUTH_RECEIVE, length, sgl)


__all__ = [
    "CNTLID_DYNAMIC",
    "MAX_DSM_RANGES",
    "MAX_NLB",
    "async_event_request",
    "auth_receive",
    "auth_send",
    "command_id",
    "command_name",
    "lbas_per_command",
    "connect",
    "connect_data",
    "dataset_management",
    "dsm_ranges",
    "flush",
    "get_features",
    "get_log_page",
    "identify",
    "keep_alive",
    "property_get",
    "property_set",
    "read",
    "set_command_id",
    "set_features",
    "write",
    "write_zeroes",
]
