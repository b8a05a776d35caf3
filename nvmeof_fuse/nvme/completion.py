"""16-byte completion queue entries.

Layout (NVMe Base 2.0, "Common Completion Queue Entry Layout"): DW0..DW1
command specific result (bytes 0..7), SQ head 8..9, SQ ID 10..11, CID 12..13,
then a 16-bit word at 14..15: bit 0 phase tag, bits 8:1 SC, 11:9 SCT,
13:12 CRD, 14 More, 15 DNR. ``status`` here is that word shifted right by one,
so bits 7:0 SC, 10:8 SCT, 12:11 CRD, 13 More, 14 DNR (Linux's layout).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ._fields import BytesLike, buffer
from .constants import CQE_SIZE
from .status import NVMeStatusError, status_name

_CQE = struct.Struct("<QHHHH")


@dataclass(slots=True)
class Completion:
    """A parsed completion queue entry (treat it as read-only).

    Not ``frozen``: a frozen dataclass sets each field through ``object.__setattr__``,
    which made building one per I/O four times dearer.
    """

    result: int
    """DW0 | DW1 << 32, the command specific result."""
    sq_head: int
    sq_id: int
    command_id: int
    status: int
    """15-bit status field without the phase bit."""
    phase: bool

    @classmethod
    def from_bytes(cls, data: BytesLike) -> Completion:
        """Parse the first 16 bytes of ``data``."""
        return cls.unpack_from(buffer("completion", data, CQE_SIZE))

    @classmethod
    def unpack_from(cls, data: BytesLike, offset: int = 0) -> Completion:
        """Parse the 16 bytes at ``offset`` in ``data`` (no copy; for the I/O path)."""
        result, sq_head, sq_id, cid, word = _CQE.unpack_from(data, offset)
        return cls(result, sq_head, sq_id, cid, word >> 1, bool(word & 1))

    @property
    def dw0(self) -> int:
        return self.result & 0xFFFFFFFF

    @property
    def dw1(self) -> int:
        return self.result >> 32

    @property
    def sc(self) -> int:
        """Status Code."""
        return self.status & 0xFF

    @property
    def sct(self) -> int:
        """Status Code Type."""
        return self.status >> 8 & 0x7

    @property
    def crd(self) -> int:
        """Command Retry Delay index (0: retry at once)."""
        return self.status >> 11 & 0x3

    @property
    def more(self) -> bool:
        """More status information is in the Error Information log page."""
        return bool(self.status & 0x2000)

    @property
    def dnr(self) -> bool:
        """Do Not Retry: the same command would fail again."""
        return bool(self.status & 0x4000)

    @property
    def ok(self) -> bool:
        return self.status & 0x7FF == 0

    def status_name(self, fabrics: bool = False) -> str:
        return status_name(self.sct, self.sc, fabrics)

    def raise_for_status(self, command_name: str, *, fabrics: bool = False) -> None:
        """Raise :class:`NVMeStatusError` unless the command succeeded.

        Pass ``fabrics=True`` for Fabrics commands (Connect, Property Get/Set, ...)
        so SCT 1 codes >= 0x80 get their Fabrics meaning.
        """
        if not self.ok:
            raise NVMeStatusError(self.status, command_name, result=self.result, fabrics=fabrics)
