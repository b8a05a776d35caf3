"""Controller properties (CAP, VS, CC, CSTS) and the Connect response.

Bit layouts: NVMe Base 2.0, "Offset 0h: CAP", "Offset 8h: VS", "Offset 14h: CC",
"Offset 1Ch: CSTS"; Connect response DW0: NVMe Base 2.0, "Connect Response".
"""

from __future__ import annotations

from dataclasses import dataclass

from ._fields import uint

CC_EN = 1 << 0
CC_SHN_MASK = 0x3 << 14
CC_SHN_NORMAL = 0x1 << 14
CC_SHN_ABRUPT = 0x2 << 14

SHST_NORMAL = 0
"""CSTS.SHST: normal operation, no shutdown requested."""
SHST_OCCURRING = 1
SHST_COMPLETE = 2


@dataclass(frozen=True, slots=True)
class Capabilities:
    """CAP, the 64-bit Controller Capabilities property."""

    raw: int
    max_queue_entries: int
    """MQES + 1: the largest I/O queue the controller accepts."""
    cqr: bool
    """Contiguous Queues Required."""
    ams: int
    timeout_ms: int
    """TO (500 ms units) in ms: worst-case wait for CSTS.RDY to change after CC.EN does."""
    dstrd: int
    nssrs: bool
    css: int
    """Command Sets Supported bitmap (bit 0 NVM, bit 6 I/O command sets, bit 7 admin only)."""
    min_page_size: int
    """2 ** (12 + MPSMIN) bytes."""
    max_page_size: int
    """2 ** (12 + MPSMAX) bytes."""

    @classmethod
    def from_int(cls, cap: int) -> Capabilities:
        cap = uint("CAP", cap, 64)
        return cls(
            raw=cap,
            max_queue_entries=(cap & 0xFFFF) + 1,
            cqr=bool(cap >> 16 & 1),
            ams=cap >> 17 & 0x3,
            timeout_ms=(cap >> 24 & 0xFF) * 500,
            dstrd=cap >> 32 & 0xF,
            nssrs=bool(cap >> 36 & 1),
            css=cap >> 37 & 0xFF,
            min_page_size=1 << (12 + (cap >> 48 & 0xF)),
            max_page_size=1 << (12 + (cap >> 52 & 0xF)),
        )


def cc_enable_value(mps_shift: int = 0, css: int = 0, iosqes: int = 6, iocqes: int = 4) -> int:
    """CC with EN = 1: memory page size 2 ** (12 + ``mps_shift``), queue entries 2**6 / 2**4 bytes.

    Bits: EN 0, CSS 6:4, MPS 10:7, AMS 13:11 (round robin), IOSQES 19:16, IOCQES 23:20.
    """
    return (
        CC_EN
        | uint("css", css, 3) << 4
        | uint("mps", mps_shift, 4) << 7
        | uint("iosqes", iosqes, 4) << 16
        | uint("iocqes", iocqes, 4) << 20
    )


def cc_shutdown_value(cc: int) -> int:
    """``cc`` with SHN (bits 15:14) set to 01b, a normal shutdown notification."""
    return (uint("CC", cc, 32) & ~CC_SHN_MASK) | CC_SHN_NORMAL


@dataclass(frozen=True, slots=True)
class ControllerStatus:
    """CSTS, the Controller Status property."""

    raw: int
    rdy: bool
    cfs: bool
    """Controller Fatal Status: the controller needs a reset."""
    shst: int
    """Shutdown status: 0 normal, 1 occurring, 2 complete."""
    nssro: bool
    pp: bool

    @classmethod
    def from_int(cls, csts: int) -> ControllerStatus:
        csts = uint("CSTS", csts, 32)
        return cls(
            raw=csts,
            rdy=bool(csts & 1),
            cfs=bool(csts >> 1 & 1),
            shst=csts >> 2 & 0x3,
            nssro=bool(csts >> 4 & 1),
            pp=bool(csts >> 5 & 1),
        )

    @property
    def shutdown_complete(self) -> bool:
        return self.shst == SHST_COMPLETE


def decode_version(vs: int) -> str:
    """VS (major 31:16, minor 15:8, tertiary 7:0) as "1.4" or "1.4.1"."""
    vs = uint("VS", vs, 32)
    major, minor, tertiary = vs >> 16, vs >> 8 & 0xFF, vs & 0xFF
    return f"{major}.{minor}.{tertiary}" if tertiary else f"{major}.{minor}"


@dataclass(frozen=True, slots=True)
class ConnectResult:
    """A successful Connect's DW0: CNTLID (15:0) and AUTHREQ (31:16)."""

    cntlid: int
    authreq: int
    """Raw AUTHREQ; bit 1 ATR (authentication needed), bit 2 ASCR (secure channel concat)."""

    @classmethod
    def from_dw0(cls, dw0: int) -> ConnectResult:
        dw0 = uint("Connect DW0", dw0, 32)
        return cls(cntlid=dw0 & 0xFFFF, authreq=dw0 >> 16)

    @property
    def authentication_required(self) -> bool:
        return bool(self.authreq & 0x2)

    @property
    def secure_channel_required(self) -> bool:
        return bool(self.authreq & 0x4)
