"""Log pages against NVMe Base 2.0 "Discovery Log Page" (1024-byte header: GENCTR 0..7,
NUMREC 8..15, RECFMT 16..17) with 1024-byte entries (TRTYPE 0, ADRFAM 1, SUBTYPE 2, TREQ 3,
PORTID 4..5, CNTLID 6..7, ASQSZ 8..9, EFLAGS 10..11, TRSVCID 32..63, SUBNQN 256..511,
TRADDR 512..767, TSAS 768..1023); "Error Information Log Entry"; "SMART / Health
Information Log Page"."""

import json
import struct

import pytest

from nvmeof_fuse.nvme.logpage import DiscoveryLogPage, ErrorLogEntry, SmartLog


def entry(*, trtype, adrfam, subtype, treq=0, portid, asqsz, trsvcid, subnqn, traddr, tsas):
    e = bytearray(1024)
    struct.pack_into("<BBBBHHHH", e, 0, trtype, adrfam, subtype, treq, portid, 0xFFFF, asqsz, 0)
    e[32 : 32 + len(trsvcid)] = trsvcid
    e[256 : 256 + len(subnqn)] = subnqn
    e[512 : 512 + len(traddr)] = traddr
    e[768 : 768 + len(tsas)] = tsas
    return bytes(e)


def discovery_page():
    header = bytearray(1024)
    struct.pack_into("<QQH", header, 0, 7, 2, 0)  # GENCTR, NUMREC, RECFMT
    rdma = entry(
        trtype=1,
        adrfam=1,
        subtype=2,
        treq=0x2 | 0x4,  # not required, SQ flow control disable supported
        portid=1,
        asqsz=32,
        trsvcid=b"4420",
        subnqn=b"nqn.2014-08.org.example:sub",
        traddr=b"192.168.1.10".ljust(256, b" "),  # traddr may be space padded
        tsas=bytes([1, 1, 1, 0, 0, 0, 0, 0]) + struct.pack("<H", 0xFFFF),  # QPTYPE PRTYPE CMS PKEY
    )
    tcp = entry(
        trtype=3,
        adrfam=2,
        subtype=3,
        portid=2,
        asqsz=128,
        trsvcid=b"8009",
        subnqn=b"nqn.2014-08.org.nvmexpress.discovery",
        traddr=b"fe80::1",
        tsas=b"\0",
    )
    return bytes(header) + rdma + tcp


def test_discovery_log_two_entries():
    page = DiscoveryLogPage.from_bytes(discovery_page())
    assert (page.genctr, page.numrec, page.recfmt) == (7, 2, 0)
    assert page.complete and len(page.entries) == 2
    a, b = page.entries
    assert (a.trtype, a.adrfam, a.subtype, a.portid, a.cntlid, a.asqsz) == (1, 1, 2, 1, 0xFFFF, 32)
    assert (a.trtype_name, a.adrfam_name, a.subtype_name) == ("rdma", "ipv4", "nvme subsystem")
    assert a.treq_name == "not required, sq flow control disable supported"
    assert (a.trsvcid, a.traddr) == ("4420", "192.168.1.10")
    assert a.subnqn == "nqn.2014-08.org.example:sub"
    assert (b.trtype_name, b.adrfam_name) == ("tcp", "ipv6")
    assert b.subtype_name == "current discovery subsystem"
    assert (b.traddr, b.trsvcid) == ("fe80::1", "8009")
    d = page.to_dict()
    assert d["records"][0]["rdma_prtype"] == "not specified"
    assert d["records"][0]["rdma_cms"] == "rdma-cm"
    assert d["records"][0]["rdma_pkey"] == 0xFFFF
    assert "rdma_cms" not in d["records"][1]
    assert d["records"][1]["tcp_sectype"] == "none"  # NVMe/TCP's TSAS: no TLS there
    json.dumps(d)


def test_discovery_sizes_and_truncation():
    assert DiscoveryLogPage.header_size == 1024
    assert DiscoveryLogPage.size_for(0) == 1024
    assert DiscoveryLogPage.size_for(2) == 3072
    header_only = DiscoveryLogPage.from_bytes(discovery_page()[:1024])
    assert header_only.numrec == 2 and header_only.entries == () and not header_only.complete
    partial = DiscoveryLogPage.from_bytes(discovery_page()[:2047])
    assert len(partial.entries) == 0
    assert len(DiscoveryLogPage.from_bytes(discovery_page()[:2048]).entries) == 1
    with pytest.raises(ValueError, match="discovery log page header needs 1024 bytes"):
        DiscoveryLogPage.from_bytes(bytes(100))


def test_error_log_entry():
    b = bytearray(64)
    status_field = 0x80 << 1 | 1 << 15 | 1  # SC 80h, DNR, phase tag set
    struct.pack_into("<QHHHHQIBB", b, 0, 42, 1, 0x1234, status_field, 0x0305, 0x9999, 1, 0, 1)
    struct.pack_into("<QH", b, 32, 0xABCDEF, 7)  # command specific info, TTSI
    e = ErrorLogEntry.from_bytes(b)
    assert (e.error_count, e.sqid, e.cmdid) == (42, 1, 0x1234)
    assert e.status == 0x80 | 1 << 14 and (e.sct, e.sc) == (0, 0x80)
    assert e.parameter_error_location == 0x0305
    assert (e.lba, e.nsid, e.vs, e.trtype, e.csi, e.ttsi) == (0x9999, 1, 0, 1, 0xABCDEF, 7)
    assert e.to_dict()["status_name"] == "LBA Out of Range"
    with pytest.raises(ValueError, match="error log entry needs 64 bytes"):
        ErrorLogEntry.from_bytes(bytes(63))


def test_smart_log():
    b = bytearray(512)
    b[0] = 0x04  # critical warning: reliability degraded
    struct.pack_into("<H", b, 1, 321)  # composite temperature, kelvin
    b[3:7] = bytes([100, 10, 3, 0])  # available spare, threshold, percentage used, EG warning
    big = (1 << 64) + 5  # 128-bit counters exceed 64 bits
    for i, value in enumerate([big, 2, 3, 4, 5, 6, 7, 8, 9, 10]):
        b[32 + 16 * i : 48 + 16 * i] = value.to_bytes(16, "little")
    struct.pack_into("<II8H", b, 192, 11, 12, 300, 301, 0, 0, 0, 0, 0, 0)
    s = SmartLog.from_bytes(b)
    assert s.critical_warning == 0x04
    assert (s.temperature_k, s.temperature_c) == (321, 48)
    assert (s.available_spare, s.available_spare_threshold, s.percentage_used) == (100, 10, 3)
    assert s.data_units_read == big and s.data_read_bytes == big * 512_000
    assert (s.data_units_written, s.host_reads, s.host_writes) == (2, 3, 4)
    assert (s.controller_busy_time, s.power_cycles, s.power_on_hours) == (5, 6, 7)
    assert (s.unsafe_shutdowns, s.media_errors, s.num_err_log_entries) == (8, 9, 10)
    assert (s.warning_temp_time, s.critical_comp_time) == (11, 12)
    assert s.temperature_sensors_k[:3] == (300, 301, 0)
    d = s.to_dict()
    assert d["temperature_c"] == 48
    json.dumps(d)
    with pytest.raises(ValueError, match="SMART log needs 512 bytes"):
        SmartLog.from_bytes(bytes(511))
