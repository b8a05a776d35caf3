"""Log pages: Discovery (70h), Error Information (01h), SMART / Health Information (02h).

Layouts: NVMe Base 2.0 "Discovery Log Page" and "Discovery Log Page Entry",
"Error Information Log Entry Data Structure", "SMART / Health Information Log
Page" (Linux ``struct nvmf_disc_rsp_page_hdr``, ``nvme_error_slot``, ``nvme_smart_log``).
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any

from ._fields import BytesLike, buffer, le, text
from .status import status_name

# Names as nvme-cli / libnvme print them (nvmf_trtype_str and friends).
TRTYPE_NAMES = {0: "pci", 1: "rdma", 2: "fc", 3: "tcp", 254: "loop"}
ADRFAM_NAMES = {0: "pci", 1: "ipv4", 2: "ipv6", 3: "infiniband", 4: "fibre-channel", 254: "loop"}
SUBTYPE_NAMES = {
    1: "discovery subsystem referral",
    2: "nvme subsystem",
    3: "current discovery subsystem",
}
TREQ_NAMES = {0: "not specified", 1: "required", 2: "not required"}
TREQ_DISABLE_SQFLOW = 0x4
RDMA_QPTYPE_NAMES = {1: "connected", 2: "datagram"}
RDMA_PRTYPE_NAMES = {1: "not specified", 2: "infiniband", 3: "roce", 4: "roce-v2", 5: "iwarp"}
RDMA_CMS_NAMES = {1: "rdma-cm"}
TCP_SECTYPE_NAMES = {0: "none", 1: "tls", 2: "tls13"}
"""NVMe/TCP's TSAS byte 0, SECTYPE, in libnvme's words: none, TLS 1.2, TLS 1.3."""

TRTYPE_RDMA = 1
TRTYPE_TCP = 3
DISCOVERY_ENTRY_SIZE = 1024


def _name(table: dict[int, str], value: int) -> str:
    return table.get(value, "unrecognized")


@dataclass(frozen=True, slots=True)
class DiscoveryLogEntry:
    """One 1024-byte discovery log page entry: where and how to reach a subsystem."""

    trtype: int
    adrfam: int
    subtype: int
    treq: int
    portid: int
    cntlid: int
    asqsz: int
    eflags: int
    trsvcid: str
    subnqn: str
    traddr: str
    tsas: bytes

    @classmethod
    def from_bytes(cls, data: BytesLike) -> DiscoveryLogEntry:
        v = buffer("discovery log entry", data, DISCOVERY_ENTRY_SIZE)
        trtype, adrfam, subtype, treq, portid, cntlid, asqsz, eflags = struct.unpack_from(
            "<BBBBHHHH", v
        )
        return cls(
            trtype=trtype,
            adrfam=adrfam,
            subtype=subtype,
            treq=treq,
            portid=portid,
            cntlid=cntlid,
            asqsz=asqsz,
            eflags=eflags,
            trsvcid=text(v, 32, 32),
            subnqn=text(v, 256, 256),
            traddr=text(v, 512, 256),
            tsas=bytes(v[768:1024]),
        )

    @property
    def trtype_name(self) -> str:
        return _name(TRTYPE_NAMES, self.trtype)

    @property
    def adrfam_name(self) -> str:
        return _name(ADRFAM_NAMES, self.adrfam)

    @property
    def subtype_name(self) -> str:
        return _name(SUBTYPE_NAMES, self.subtype)

    @property
    def treq_name(self) -> str:
        name = _name(TREQ_NAMES, self.treq & 0x3)
        if self.treq & TREQ_DISABLE_SQFLOW:
            name += ", sq flow control disable supported"
        return name

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "trtype": self.trtype_name,
            "adrfam": self.adrfam_name,
            "subtype": self.subtype_name,
            "treq": self.treq_name,
            "portid": self.portid,
            "trsvcid": self.trsvcid,
            "subnqn": self.subnqn,
            "traddr": self.traddr,
            "cntlid": self.cntlid,
            "asqsz": self.asqsz,
            "eflags": self.eflags,
        }
        if self.trtype == TRTYPE_RDMA:
            qptype, prtype, cms = self.tsas[0], self.tsas[1], self.tsas[2]
            d["rdma_qptype"] = _name(RDMA_QPTYPE_NAMES, qptype)
            d["rdma_prtype"] = _name(RDMA_PRTYPE_NAMES, prtype)
            d["rdma_cms"] = _name(RDMA_CMS_NAMES, cms)
            d["rdma_pkey"] = int.from_bytes(self.tsas[8:10], "little")
        elif self.trtype == TRTYPE_TCP:
            d["tcp_sectype"] = _name(TCP_SECTYPE_NAMES, self.tsas[0])
        return d


@dataclass(frozen=True, slots=True)
class DiscoveryLogPage:
    """Discovery log page: header (GENCTR, NUMREC, RECFMT) and the entries fetched.

    Fetch :attr:`header_size` bytes first, then :meth:`size_for` ``numrec``
    bytes, and retry if GENCTR changed in between (NVMe Base 2.0, "Discovery
    Log Page").
    """

    header_size = 1024

    genctr: int
    numrec: int
    recfmt: int
    entries: tuple[DiscoveryLogEntry, ...]

    @staticmethod
    def size_for(numrec: int) -> int:
        """Bytes to fetch for the header plus ``numrec`` entries."""
        return DiscoveryLogPage.header_size + numrec * DISCOVERY_ENTRY_SIZE

    @classmethod
    def from_bytes(cls, data: BytesLike) -> DiscoveryLogPage:
        """Parse the header and as many whole entries as ``data`` holds (up to NUMREC)."""
        v = memoryview(data).cast("B")
        buffer("discovery log page header", v, cls.header_size)
        genctr, numrec, recfmt = struct.unpack_from("<QQH", v)
        available = (len(v) - cls.header_size) // DISCOVERY_ENTRY_SIZE
        entries = tuple(
            DiscoveryLogEntry.from_bytes(v[cls.size_for(i) : cls.size_for(i + 1)])
            for i in range(min(numrec, available))
        )
        return cls(genctr=genctr, numrec=numrec, recfmt=recfmt, entries=entries)

    @property
    def complete(self) -> bool:
        """Whether all NUMREC entries were in the buffer."""
        return len(self.entries) == self.numrec

    def to_dict(self) -> dict[str, Any]:
        return {
            "genctr": self.genctr,
            "numrec": self.numrec,
            "recfmt": self.recfmt,
            "records": [e.to_dict() for e in self.entries],
        }


@dataclass(frozen=True, slots=True)
class ErrorLogEntry:
    """One 64-byte Error Information log entry."""

    error_count: int
    """0 means the entry is empty."""
    sqid: int
    cmdid: int
    status: int
    """15-bit status field (phase bit removed), as in :class:`Completion`."""
    parameter_error_location: int
    lba: int
    nsid: int
    vs: int
    trtype: int
    csi: int
    """Command Specific Information."""
    ttsi: int
    """Transport Type Specific Information."""

    SIZE = 64

    @classmethod
    def from_bytes(cls, data: BytesLike) -> ErrorLogEntry:
        v = buffer("error log entry", data, cls.SIZE)
        count, sqid, cmdid, status, pel, lba, nsid, vs, trtype = struct.unpack_from("<QHHHHQIBB", v)
        return cls(
            error_count=count,
            sqid=sqid,
            cmdid=cmdid,
            status=status >> 1,
            parameter_error_location=pel,
            lba=lba,
            nsid=nsid,
            vs=vs,
            trtype=trtype,
            csi=le(v, 32, 8),
            ttsi=le(v, 40, 2),
        )

    @property
    def sct(self) -> int:
        return self.status >> 8 & 0x7

    @property
    def sc(self) -> int:
        return self.status & 0xFF

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status_name": status_name(self.sct, self.sc)}


@dataclass(frozen=True, slots=True)
class SmartLog:
    """SMART / Health Information (512 bytes). Counters are 128-bit on the wire."""

    critical_warning: int
    temperature_k: int
    """Composite temperature in kelvin."""
    available_spare: int
    available_spare_threshold: int
    percentage_used: int
    endurance_group_critical_warning: int
    data_units_read: int
    """In units of 1000 512-byte blocks (see :attr:`data_read_bytes`)."""
    data_units_written: int
    host_reads: int
    host_writes: int
    controller_busy_time: int
    power_cycles: int
    power_on_hours: int
    unsafe_shutdowns: int
    media_errors: int
    num_err_log_entries: int
    warning_temp_time: int
    critical_comp_time: int
    temperature_sensors_k: tuple[int, ...]
    """Sensors 1..8 in kelvin; 0 means not implemented."""

    SIZE = 512

    @classmethod
    def from_bytes(cls, data: BytesLike) -> SmartLog:
        v = buffer("SMART log", data, cls.SIZE)

        def u128(off: int) -> int:
            return le(v, off, 16)

        return cls(
            critical_warning=v[0],
            temperature_k=le(v, 1, 2),
            available_spare=v[3],
            available_spare_threshold=v[4],
            percentage_used=v[5],
            endurance_group_critical_warning=v[6],
            data_units_read=u128(32),
            data_units_written=u128(48),
            host_reads=u128(64),
            host_writes=u128(80),
            controller_busy_time=u128(96),
            power_cycles=u128(112),
            power_on_hours=u128(128),
            unsafe_shutdowns=u128(144),
            media_errors=u128(160),
            num_err_log_entries=u128(176),
            warning_temp_time=le(v, 192, 4),
            critical_comp_time=le(v, 196, 4),
            temperature_sensors_k=struct.unpack_from("<8H", v, 200),
        )

    @property
    def temperature_c(self) -> int:
        return self.temperature_k - 273

    @property
    def data_read_bytes(self) -> int:
        return self.data_units_read * 512_000

    @property
    def data_written_bytes(self) -> int:
        return self.data_units_written * 512_000

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["temperature_sensors_k"] = list(self.temperature_sensors_k)
        d["temperature_c"] = self.temperature_c
        return d
