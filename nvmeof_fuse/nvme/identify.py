"""Identify data: controller (CNS 01h), namespace (CNS 00h), active namespace list (CNS 02h),
namespace identification descriptor list (CNS 03h).

Offsets: NVMe Base 2.0 "Identify Controller Data Structure" and NVM Command
Set 1.0 "Identify Namespace Data Structure" (Linux ``struct nvme_id_ctrl`` /
``struct nvme_id_ns``).
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from ._fields import BytesLike, buffer, le, text
from .constants import IDENTIFY_DATA_SIZE
from .fabrics import decode_version

LBADS_SERVED = range(9, 17)
"""LBA data sizes we serve, as powers of two: 512 B to 64 KiB (Linux serves 512 B up to its
page size; LBADS below 9 is reserved)."""
NSID_BROADCAST = 0xFFFFFFFF
SIZE_SERVED = 2**63 - 1
"""The largest namespace, in bytes, that a file's size (a signed 64-bit off_t) can show."""


def _view(name: str, data: BytesLike) -> memoryview:
    return buffer(f"Identify {name} data", data, IDENTIFY_DATA_SIZE)


@dataclass(frozen=True, slots=True)
class IdentifyController:
    """The fields of Identify Controller an NVMe-oF initiator uses or shows."""

    vid: int
    ssvid: int
    sn: str
    mn: str
    fr: str
    rab: int
    ieee: int
    cmic: int
    mdts: int
    """Max data transfer as a power of two of CAP.MPSMIN pages; 0 means no limit."""
    cntlid: int
    ver: int
    oaes: int
    ctratt: int
    cntrltype: int
    oacs: int
    acl: int
    aerl: int
    frmw: int
    lpa: int
    elpe: int
    npss: int
    kas: int
    """Keep Alive Support granularity, in 100 ms units (0: keep alive not supported)."""
    sqes: int
    cqes: int
    maxcmd: int
    nn: int
    oncs: int
    fuses: int
    fna: int
    vwc: int
    awun: int
    awupf: int
    sgls: int
    subnqn: str
    ioccsz: int
    """I/O command capsule size in 16-byte units (fabrics)."""
    iorcsz: int
    icdoff: int
    fcatt: int
    msdbd: int
    ofcs: int
    crdt: tuple[int, int, int] = (0, 0, 0)
    """Command Retry Delay Times 1-3, in 100 ms units (a status's CRD picks one)."""
    anatt: int = 0
    """ANA Transition Time: seconds a group may stay in the change state."""
    anacap: int = 0
    anagrpmax: int = 0
    nanagrpid: int = 0
    mnan: int = 0
    """Maximum Number of Allowed Namespaces (0: not reported, NN applies)."""
    rtd3e: int = 0
    """RTD3 Entry Latency, microseconds: how long a shutdown may take (0: not reported)."""

    @classmethod
    def from_bytes(cls, data: BytesLike) -> IdentifyController:
        v = _view("Controller", data)

        def u8(off: int) -> int:
            return v[off]

        def u16(off: int) -> int:
            return le(v, off, 2)

        def u32(off: int) -> int:
            return le(v, off, 4)

        return cls(
            vid=u16(0),
            ssvid=u16(2),
            sn=text(v, 4, 20),
            mn=text(v, 24, 40),
            fr=text(v, 64, 8),
            rab=u8(72),
            ieee=le(v, 73, 3),
            cmic=u8(76),
            mdts=u8(77),
            cntlid=u16(78),
            ver=u32(80),
            oaes=u32(92),
            ctratt=u32(96),
            cntrltype=u8(111),
            oacs=u16(256),
            acl=u8(258),
            aerl=u8(259),
            frmw=u8(260),
            lpa=u8(261),
            elpe=u8(262),
            npss=u8(263),
            kas=u16(320),
            sqes=u8(512),
            cqes=u8(513),
            maxcmd=u16(514),
            nn=u32(516),
            oncs=u16(520),
            fuses=u16(522),
            fna=u8(524),
            vwc=u8(525),
            awun=u16(526),
            awupf=u16(528),
            sgls=u32(536),
            subnqn=text(v, 768, 256),
            ioccsz=u32(1792),
            iorcsz=u32(1796),
            icdoff=u16(1800),
            fcatt=u8(1802),
            msdbd=u8(1803),
            ofcs=u16(1804),
            crdt=(u16(128), u16(130), u16(132)),
            anatt=u8(342),
            anacap=u8(343),
            anagrpmax=u32(344),
            nanagrpid=u32(348),
            mnan=u32(540),
            rtd3e=u32(88),
        )

    @property
    def ana_reporting(self) -> bool:
        """CMIC bit 3: the controller reports Asymmetric Namespace Access (ANA log, AEN)."""
        return bool(self.cmic & 0x8)

    @property
    def multi_controller(self) -> bool:
        """CMIC bit 1: the subsystem may have two or more controllers (paths)."""
        return bool(self.cmic & 0x2)

    def max_transfer_bytes(self, page_size: int) -> int | None:
        """MDTS in bytes for CAP.MPSMIN ``page_size``; None when unlimited (MDTS 0)."""
        return page_size << self.mdts if self.mdts else None

    @property
    def version(self) -> str:
        return decode_version(self.ver)

    @property
    def keyed_sgl_supported(self) -> bool:
        """SGLS bit 2: Keyed SGL Data Block descriptors (needed for NVMe/RDMA)."""
        return bool(self.sgls & 0x4)

    @property
    def in_capsule_data_bytes(self) -> int:
        """Data bytes an I/O command capsule may carry after its 64-byte SQE."""
        return max(self.ioccsz * 16 - 64, 0)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "version": self.version}


@dataclass(frozen=True, slots=True)
class LbaFormat:
    """One LBA Format entry: metadata bytes, LBA data size as a power of two, relative perf."""

    ms: int
    lbads: int
    rp: int


_SHARED_MAX = 256
"""Distinct LBA format tables kept to share: a subsystem's namespaces mostly have one of a
few, and each namespace's Identify data is kept (a target may have 65,536 namespaces)."""
_shared_values: dict[bytes, bytes] = {bytes(8): bytes(8), bytes(16): bytes(16)}
"""The all-zero EUI-64 and NGUID (not reported), one object each for every namespace."""
_format_tables: dict[bytes, tuple[LbaFormat, ...]] = {}
_POWERS_OF_TWO = tuple(1 << n for n in range(64))
"""LBA sizes: one int object each, not one per namespace that keeps its size."""


def _shared(value: bytes) -> bytes:
    """``value``, as the one object kept for it when it is all zero (no identifier)."""
    return _shared_values.get(value, value)


def _lba_formats(table: bytes) -> tuple[LbaFormat, ...]:
    """The LBA formats of ``table`` (4 bytes each), one tuple shared by every namespace with
    the same table (up to _SHARED_MAX tables; a target inventing more gets its own)."""
    formats = _format_tables.get(table)
    if formats is None:
        formats = tuple(LbaFormat(*struct.unpack_from("<HBB", table, at))
                        for at in range(0, len(table), 4))
        if len(_format_tables) < _SHARED_MAX:
            _format_tables[table] = formats
    return formats


@dataclass(frozen=True, slots=True)
class IdentifyNamespace:
    """Size and format of a namespace (all zero for an inactive NSID)."""

    nsze: int
    ncap: int
    nuse: int
    nsfeat: int
    nlbaf: int
    """Number of LBA formats, 0's based (as on the wire)."""
    flbas: int
    mc: int
    dpc: int
    dps: int
    nmic: int
    nguid: bytes
    eui64: bytes
    lbaf: tuple[LbaFormat, ...]
    anagrpid: int = 0
    """The ANA group the namespace belongs to (0: none reported)."""

    @classmethod
    def from_bytes(cls, data: BytesLike) -> IdentifyNamespace:
        v = _view("Namespace", data)
        count = min(v[25] + 1, 64)
        return cls(
            nsze=le(v, 0, 8),
            ncap=le(v, 8, 8),
            nuse=le(v, 16, 8),
            nsfeat=v[24],
            nlbaf=v[25],
            flbas=v[26],
            mc=v[27],
            dpc=v[28],
            dps=v[29],
            nmic=v[30],
            nguid=_shared(bytes(v[104:120])),
            eui64=_shared(bytes(v[120:128])),
            lbaf=_lba_formats(bytes(v[128:128 + 4 * count])),
            anagrpid=le(v, 92, 4),
        )

    @property
    def format_index(self) -> int:
        """Current LBA format: FLBAS bits 3:0, plus bits 6:5 as the high bits (>16 formats)."""
        return (self.flbas & 0x0F) | (self.flbas & 0x60) >> 1

    @property
    def current_format(self) -> LbaFormat:
        index = self.format_index
        if index >= len(self.lbaf):
            raise ValueError(f"FLBAS selects LBA format {index}, only {len(self.lbaf)} exist")
        return self.lbaf[index]

    @property
    def lba_size(self) -> int:
        """Bytes per logical block of the current format."""
        lbads = self.current_format.lbads
        return _POWERS_OF_TWO[lbads] if lbads < 64 else 1 << lbads

    @property
    def unusable(self) -> str:
        """Why we cannot serve this namespace, in a few words; '' when we can: FLBAS past
        the LBA formats, an LBA size outside 512 B to 64 KiB (:data:`LBADS_SERVED`), a size
        past 2^63 - 1 bytes (:data:`SIZE_SERVED`)."""
        try:
            lbads = self.current_format.lbads
        except ValueError as exc:  # FLBAS past the LBA formats
            return str(exc)
        if lbads not in LBADS_SERVED:
            return (f"its LBA size 2^{lbads} bytes (LBADS {lbads}) is outside 512 B to "
                    "64 KiB")
        if self.nsze << lbads > SIZE_SERVED:
            return f"its size, {self.nsze} LBAs of {1 << lbads} bytes, is past 2^63 bytes"
        return ""

    @property
    def metadata_size(self) -> int:
        return self.current_format.ms

    @property
    def active(self) -> bool:
        return self.nsze != 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["nguid"] = self.nguid.hex()
        d["eui64"] = self.eui64.hex()
        if self.active:
            reason = self.unusable
            if reason:
                d["unusable"] = reason
            else:
                d["lba_size"] = self.lba_size
        return d


ACTIVE_NS_PER_PAGE = 1024
"""NSIDs one page of the Active Namespace ID list holds (4096 bytes); a full page may have
more after it: the next page lists those above its last (the NSID of the command)."""


def parse_active_ns_list(data: BytesLike) -> list[int]:
    """Active Namespace ID list (CNS 02h): ascending NSIDs, ended by the first zero.

    What breaks the order (a repeat, a smaller NSID) and the broadcast NSID 0xFFFFFFFF,
    which names no namespace, are skipped: at most ACTIVE_NS_PER_PAGE distinct NSIDs come
    back."""
    v = _view("active namespace list", data)
    nsids: list[int] = []
    for (nsid,) in struct.iter_unpack("<I", v):
        if nsid == 0:
            break
        if nsid != NSID_BROADCAST and (not nsids or nsid > nsids[-1]):
            nsids.append(nsid)
    return nsids


class Nidt(IntEnum):
    """Namespace Identifier Types of the descriptor list (NVMe Base 2.0, "NIDT")."""

    EUI64 = 0x1
    NGUID = 0x2
    UUID = 0x3
    CSI = 0x4


_NIDL = {Nidt.EUI64: 8, Nidt.NGUID: 16, Nidt.UUID: 16, Nidt.CSI: 1}
_NID_NAMES = {Nidt.EUI64: "EUI-64", Nidt.NGUID: "NGUID", Nidt.UUID: "UUID", Nidt.CSI: "CSI"}
_DESC_HEADER = 4


@dataclass(frozen=True, slots=True)
class NamespaceIds:
    """A namespace's identifiers: all zero where not reported (the kernel's
    ``struct nvme_ns_ids``).  Two paths reach the same namespace only when these are
    equal (:meth:`mismatch`, as ``nvme_ns_ids_equal``)."""

    eui64: bytes = bytes(8)
    nguid: bytes = bytes(16)
    uuid: bytes = bytes(16)
    csi: int = 0

    @classmethod
    def from_descriptors(cls, data: BytesLike, base: NamespaceIds | None = None
                         ) -> NamespaceIds:
        """Parse a Namespace Identification Descriptor list (Identify CNS 03h).

        Each descriptor is NIDT (1 byte), NIDL (1 byte), 2 reserved bytes, then NIDL
        bytes; the list ends at a descriptor with NIDL 0 or at the end of the data.
        Identifiers found replace those of ``base`` (e.g. from Identify Namespace, as
        the kernel's ``nvme_report_ns_ids`` does); unknown types are skipped, a known
        type with the wrong length raises ValueError.
        """
        buffer("namespace identification descriptor list", data, _DESC_HEADER)
        v = memoryview(data).cast("B")
        base = base or cls()  # (fields by hand: asdict deep-copies, per namespace)
        found: dict[str, Any] = {"eui64": base.eui64, "nguid": base.nguid, "uuid": base.uuid,
                                 "csi": base.csi}
        pos = 0
        while pos + _DESC_HEADER <= len(v):
            nidt, nidl = v[pos], v[pos + 1]
            if nidl == 0:
                break
            body = bytes(v[pos + _DESC_HEADER : pos + _DESC_HEADER + nidl])
            if len(body) < nidl:
                raise ValueError(f"namespace identification descriptor type {nidt} runs "
                                 f"past the end of the list ({nidl} bytes)")
            expected = _NIDL.get(nidt)  # type: ignore[call-overload]
            if expected is not None:
                if nidl != expected:
                    raise ValueError(f"namespace identification descriptor "
                                     f"{_NID_NAMES[Nidt(nidt)]} has length {nidl}, "
                                     f"expected {expected}")
                if nidt == Nidt.CSI:
                    found["csi"] = body[0]
                else:
                    found[Nidt(nidt).name.lower()] = body
            pos += _DESC_HEADER + nidl
        return cls(**found)

    @classmethod
    def from_identify(cls, ident: IdentifyNamespace) -> NamespaceIds:
        """The EUI64 and NGUID fields of Identify Namespace."""
        return cls(eui64=ident.eui64, nguid=ident.nguid)

    def to_descriptors(self, size: int = IDENTIFY_DATA_SIZE) -> bytes:
        """Encode the non-zero identifiers as a descriptor list (for fakes), zero-padded."""
        out = bytearray()
        for nidt, value in ((Nidt.EUI64, self.eui64), (Nidt.NGUID, self.nguid),
                            (Nidt.UUID, self.uuid)):
            if any(value):
                out += struct.pack("<BBxx", nidt, len(value)) + value
        out += struct.pack("<BBxxB", Nidt.CSI, 1, self.csi)
        return bytes(out.ljust(size, b"\0"))

    @property
    def reported(self) -> bool:
        """Whether any identifier is non-zero (else two namespaces cannot be told apart)."""
        return any(self.eui64) or any(self.nguid) or any(self.uuid)

    def mismatch(self, other: NamespaceIds) -> str:
        """'' when equal (as the kernel's ``nvme_ns_ids_equal``), else which identifier
        differs and both values, e.g. ``NGUID 00..01 != 00..02``."""
        for name, a, b in (("UUID", self.uuid, other.uuid), ("NGUID", self.nguid, other.nguid),
                           ("EUI-64", self.eui64, other.eui64)):
            if a != b:
                return f"{name} {_hex(a)} != {_hex(b)}"
        if self.csi != other.csi:
            return f"CSI {self.csi} != {other.csi}"
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {"eui64": self.eui64.hex(), "nguid": self.nguid.hex(), "uuid": self.uuid.hex(),
                "csi": self.csi}


    def describe(self) -> str:
        """The identifiers reported (``NGUID ..., UUID ...``), or ``no identifiers``."""
        words = [f"{name} {value.hex()}" for name, value in
                 (("NGUID", self.nguid), ("EUI-64", self.eui64), ("UUID", self.uuid))
                 if any(value)]
        if self.csi:
            words.append(f"CSI {self.csi}")
        return ", ".join(words) or "no identifiers"


@dataclass(frozen=True, slots=True)
class NamespaceIdentity:
    """What tells one namespace from another behind the same NSID: its identifiers and LBA
    format, and where it reports no identifiers, its size too (two namespaces without
    identifiers of the same size and format cannot be told apart).

    The kernel compares the identifiers alone (``nvme_ns_ids_equal``) and removes a
    namespace whose identifiers changed; we compare the format as well, since a namespace
    formatted anew holds none of the data a reader of the old one expects.
    """

    ids: NamespaceIds
    lbads: int
    """The current format's LBA data size as a power of two (-1: FLBAS names none)."""
    ms: int
    """Its metadata bytes per LBA (-1 with ``lbads``)."""
    nsze: int

    @classmethod
    def of(cls, ident: IdentifyNamespace, ids: NamespaceIds | None = None
           ) -> NamespaceIdentity:
        """The identity of Identify Namespace ``ident`` with identifiers ``ids`` (by
        default those of Identify Namespace itself)."""
        try:
            fmt = ident.current_format
        except ValueError:  # FLBAS past the formats: the namespace is unusable anyway
            lbads = ms = -1
        else:
            lbads, ms = fmt.lbads, fmt.ms
        return cls(ids if ids is not None else NamespaceIds.from_identify(ident), lbads, ms,
                   ident.nsze)

    def change(self, new: NamespaceIdentity) -> str:
        """'' when ``new`` is this namespace (a size change of one with identifiers is a
        resize), else what differs, with both values (``NGUID 00..01 != 00..02``)."""
        mismatch = self.ids.mismatch(new.ids)
        if mismatch:
            return mismatch
        if (self.lbads, self.ms) != (new.lbads, new.ms):
            return f"LBA format {self._format()} != {new._format()}"
        if not self.ids.reported and self.nsze != new.nsze:
            return f"size {self.nsze} != {new.nsze} LBAs, with no identifiers to tell them apart"
        return ""

    def _format(self) -> str:
        if self.lbads < 0:
            return "(none)"
        return f"{1 << self.lbads} B" + (f"+{self.ms}" if self.ms else "")

    def describe(self) -> str:
        """``NGUID ..., 512 B LBAs`` (with the size where there are no identifiers)."""
        words = [self.ids.describe(), f"{self._format()} LBAs"]
        if not self.ids.reported:
            words.append(f"{self.nsze} LBAs")
        return ", ".join(words)


def controller_change(old: IdentifyController, new: IdentifyController) -> str:
    """'' when ``new`` names the controller's subsystem as ``old`` did (subsystem NQN,
    serial number and model number: NVM subsystem values, the same on every controller
    of a subsystem); else which differs, with both values."""
    for name, a, b in (("subsystem NQN", old.subnqn, new.subnqn),
                       ("serial number", old.sn, new.sn), ("model number", old.mn, new.mn)):
        if a != b:
            return f"{name} {a!r} != {b!r}"
    return ""


def _hex(value: bytes) -> str:
    return value.hex() if any(value) else "(none)"
