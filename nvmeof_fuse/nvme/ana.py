"""Asymmetric Namespace Access: the ANA log page (LID 0Ch) and its states.

Layout: NVMe Base 2.0 "Asymmetric Namespace Access Log Page" (Linux
``struct nvme_ana_rsp_hdr`` and ``struct nvme_ana_group_desc``): a 16-byte
header (change count, number of group descriptors), then per group a 32-byte
descriptor (group ID, NSID count, change count, state) followed by its NSIDs.
With the RGO bit of LSP (Return Groups Only) the NSID lists are left out.

The Linux target (``nvmet_execute_get_log_page_ana``) copies whole descriptors
while they fit and still counts every enabled group in NGRPS, so a short
buffer may hold fewer descriptors than the header counts: the parser takes
the whole ones and says whether all were there (:attr:`AnaLogPage.complete`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from ._fields import BytesLike, buffer

HEADER_SIZE = 16
GROUP_DESCRIPTOR_SIZE = 32
LSP_RGO = 0x1
"""Get Log Page LSP bit 0 for the ANA log: Return Groups Only (no NSID lists)."""

CMIC_ANA = 1 << 3
"""Identify Controller CMIC bit 3: the controller reports ANA."""


class AnaState(IntEnum):
    """ANA states (NVMe Base 2.0, "Asymmetric Namespace Access Reporting")."""

    OPTIMIZED = 0x1
    NON_OPTIMIZED = 0x2
    INACCESSIBLE = 0x3
    PERSISTENT_LOSS = 0x4
    CHANGE = 0xF

    @property
    def label(self) -> str:
        """The name as the kernel's sysfs ``ana_state`` shows it."""
        return _LABELS[self]

    @property
    def usable(self) -> bool:
        """Whether I/O may go to a namespace in this state (the kernel's nvme_state_is_live)."""
        return self in (AnaState.OPTIMIZED, AnaState.NON_OPTIMIZED)


_LABELS = {
    AnaState.OPTIMIZED: "optimized",
    AnaState.NON_OPTIMIZED: "non-optimized",
    AnaState.INACCESSIBLE: "inaccessible",
    AnaState.PERSISTENT_LOSS: "persistent-loss",
    AnaState.CHANGE: "change",
}


def ana_state(value: int) -> AnaState:
    """The ANA state ``value`` names; ValueError for a reserved one."""
    try:
        return AnaState(value)
    except ValueError:
        raise ValueError(f"ANA log page: reserved ANA state {value:#x}") from None


@dataclass(frozen=True, slots=True)
class AnaGroup:
    """One ANA group descriptor: its state and the NSIDs in it (empty with RGO)."""

    grpid: int
    state: AnaState
    chgcnt: int = 0
    nsids: tuple[int, ...] = ()

    def to_bytes(self) -> bytes:
        head = struct.pack("<IIQB15x", self.grpid, len(self.nsids), self.chgcnt, self.state)
        return head + struct.pack(f"<{len(self.nsids)}I", *self.nsids)


@dataclass(frozen=True, slots=True)
class AnaLogPage:
    """The ANA log page: change count, NGRPS and the group descriptors fetched."""

    chgcnt: int
    ngrps: int
    groups: tuple[AnaGroup, ...]

    @classmethod
    def from_bytes(cls, data: BytesLike) -> AnaLogPage:
        """Parse the header and the whole descriptors ``data`` holds (up to NGRPS).

        A descriptor with group ID 0 or a reserved state raises ValueError, as the
        kernel's ``nvme_parse_ana_log`` refuses it.
        """
        v = memoryview(data).cast("B")
        buffer("ANA log page header", v, HEADER_SIZE)
        chgcnt, ngrps = struct.unpack_from("<QH", v)
        groups = []
        offset = HEADER_SIZE
        for _ in range(ngrps):
            if offset + GROUP_DESCRIPTOR_SIZE > len(v):
                break
            grpid, nnsids, gchg, state = struct.unpack_from("<IIQB", v, offset)
            end = offset + GROUP_DESCRIPTOR_SIZE + 4 * nnsids
            if end > len(v):
                break
            if grpid == 0:
                raise ValueError("ANA log page: a group descriptor has group ID 0")
            nsids = struct.unpack_from(f"<{nnsids}I", v, offset + GROUP_DESCRIPTOR_SIZE)
            groups.append(AnaGroup(grpid, ana_state(state), gchg, nsids))
            offset = end
        return cls(chgcnt=chgcnt, ngrps=ngrps, groups=tuple(groups))

    def to_bytes(self, size: int = 0) -> bytes:
        """Encode (for fakes); zero-padded to ``size`` bytes when given."""
        out = struct.pack("<QH6x", self.chgcnt, self.ngrps) + b"".join(
            g.to_bytes() for g in self.groups)
        return out.ljust(size, b"\0") if size else out

    @classmethod
    def of(cls, groups: dict[int, tuple[AnaState, tuple[int, ...]]], chgcnt: int = 0
           ) -> AnaLogPage:
        """A page for ``{grpid: (state, nsids)}`` (for fakes and tests)."""
        descs = tuple(AnaGroup(g, s, chgcnt, tuple(n)) for g, (s, n) in sorted(groups.items()))
        return cls(chgcnt=chgcnt, ngrps=len(descs), groups=descs)

    @property
    def complete(self) -> bool:
        """Whether all NGRPS descriptors were in the buffer."""
        return len(self.groups) == self.ngrps

    def group(self, grpid: int) -> AnaGroup | None:
        for g in self.groups:
            if g.grpid == grpid:
                return g
        return None

    def nsid_states(self) -> dict[int, AnaState]:
        """State per NSID from the groups' NSID lists (empty with RGO)."""
        return {nsid: g.state for g in self.groups for nsid in g.nsids}

    @property
    def changing(self) -> bool:
        """Whether any group is in the change state (the ANATT timer runs)."""
        return any(g.state is AnaState.CHANGE for g in self.groups)


def ana_log_size(nanagrpid: int, mnan: int) -> int:
    """Bytes the whole ANA log may take: header, NANAGRPID descriptors and MNAN NSIDs
    (the kernel's ``nvme_mpath_init_identify``); a multiple of 4."""
    size = HEADER_SIZE + nanagrpid * GROUP_DESCRIPTOR_SIZE + mnan * 4
    return (size + 3) & ~3
