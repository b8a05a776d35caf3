"""Identify data built field by field at the offsets of NVMe Base 2.0 "Identify Controller
Data Structure" (incl. the Fabrics fields at 1792..) and NVM Command Set 1.0 "Identify
Namespace Data Structure" (LBA formats at 128, FLBAS bits 3:0 and 6:5)."""

import json
import struct

import pytest

from nvmeof_fuse.nvme.identify import (
    IdentifyController,
    IdentifyNamespace,
    NamespaceIdentity,
    NamespaceIds,
    controller_change,
    parse_active_ns_list,
)


def controller_buffer(mdts=5):
    b = bytearray(4096)
    struct.pack_into("<HH", b, 0, 0x1B36, 0x1AF4)  # VID, SSVID
    b[4:24] = b"SN0123456789".ljust(20)  # SN, ASCII space padded
    b[24:64] = b"Linux NVMe-oF target".ljust(40)  # MN
    b[64:72] = b"6.8.0".ljust(8)  # FR
    b[72] = 6  # RAB
    b[73:76] = bytes([0x14, 0x25, 0x00])  # IEEE OUI, little endian
    b[76] = 0x0B  # CMIC
    b[77] = mdts  # MDTS
    struct.pack_into("<HI", b, 78, 0x0007, 0x00020000)  # CNTLID, VER
    struct.pack_into("<II", b, 84, 0, 8_000_000)  # RTD3R, RTD3E: 8 s, microseconds
    struct.pack_into("<I", b, 92, 0x900)  # OAES
    struct.pack_into("<I", b, 96, 0x8000)  # CTRATT
    b[111] = 1  # CNTRLTYPE: I/O controller
    struct.pack_into("<HHH", b, 128, 5, 20, 300)  # CRDT1-3, 100 ms units
    struct.pack_into("<HBBBBBB", b, 256, 0x0008, 3, 3, 0x03, 0x07, 127, 0)  # OACS..NPSS
    struct.pack_into("<H", b, 320, 100)  # KAS, 100 ms units
    struct.pack_into("<BBHIHHBBHH", b, 512, 0x66, 0x44, 128, 1024, 0x5D, 1, 0, 1, 0, 0)
    struct.pack_into("<I", b, 536, 0x0010_0005)  # SGLS
    nqn = b"nqn.2014-08.org.example:sub"
    b[768 : 768 + len(nqn)] = nqn  # SUBNQN, NUL padded
    struct.pack_into("<IIHBB", b, 1792, 260, 1, 0, 0, 1)  # IOCCSZ, IORCSZ, ICDOFF, FCATT, MSDBD
    struct.pack_into("<H", b, 1804, 0x1)  # OFCS
    return bytes(b)


def test_identify_controller_fields():
    c = IdentifyController.from_bytes(controller_buffer())
    assert (c.vid, c.ssvid) == (0x1B36, 0x1AF4)
    assert (c.sn, c.mn, c.fr) == ("SN0123456789", "Linux NVMe-oF target", "6.8.0")
    assert (c.rab, c.ieee, c.cmic, c.mdts) == (6, 0x002514, 0x0B, 5)
    assert (c.cntlid, c.ver, c.version) == (7, 0x00020000, "2.0")
    assert (c.oaes, c.ctratt, c.cntrltype) == (0x900, 0x8000, 1)
    assert c.crdt == (5, 20, 300)
    assert c.rtd3e == 8_000_000
    assert (c.oacs, c.acl, c.aerl, c.frmw, c.lpa, c.elpe, c.npss) == (8, 3, 3, 3, 7, 127, 0)
    assert c.kas == 100
    assert (c.sqes, c.cqes, c.maxcmd, c.nn) == (0x66, 0x44, 128, 1024)
    assert (c.oncs, c.fuses, c.fna, c.vwc, c.awun, c.awupf) == (0x5D, 1, 0, 1, 0, 0)
    assert c.sgls == 0x0010_0005 and c.keyed_sgl_supported
    assert c.subnqn == "nqn.2014-08.org.example:sub"
    assert (c.ioccsz, c.iorcsz, c.icdoff, c.fcatt, c.msdbd, c.ofcs) == (260, 1, 0, 0, 1, 1)
    assert c.in_capsule_data_bytes == 260 * 16 - 64


def test_max_transfer_bytes():
    assert IdentifyController.from_bytes(controller_buffer(5)).max_transfer_bytes(4096) == 131072
    assert IdentifyController.from_bytes(controller_buffer(0)).max_transfer_bytes(4096) is None


def test_identify_controller_to_dict_is_json():
    d = IdentifyController.from_bytes(controller_buffer()).to_dict()
    assert d["mn"] == "Linux NVMe-oF target" and d["version"] == "2.0"
    json.dumps(d)


def test_identify_wrong_length():
    with pytest.raises(ValueError, match="Identify Controller data needs 4096 bytes, got 4095"):
        IdentifyController.from_bytes(bytes(4095))
    with pytest.raises(ValueError, match="Identify Namespace data needs 4096 bytes"):
        IdentifyNamespace.from_bytes(b"")


def namespace_buffer(nlbaf, flbas, formats):
    b = bytearray(4096)
    struct.pack_into("<QQQ", b, 0, 2_097_152, 2_097_152, 1000)  # NSZE, NCAP, NUSE
    b[24:30] = bytes([0x1, nlbaf, flbas, 0x3, 0x1F, 0x0])  # NSFEAT NLBAF FLBAS MC DPC DPS
    b[30] = 1  # NMIC
    b[104:120] = bytes(range(16))  # NGUID
    b[120:128] = bytes(range(0xA0, 0xA8))  # EUI64
    for i, (ms, lbads, rp) in formats.items():
        struct.pack_into("<HBB", b, 128 + 4 * i, ms, lbads, rp)  # LBAF i: MS, LBADS, RP
    return bytes(b)


def test_identify_namespace_fields():
    ns = IdentifyNamespace.from_bytes(namespace_buffer(1, 0x01, {0: (0, 9, 2), 1: (8, 12, 0)}))
    assert (ns.nsze, ns.ncap, ns.nuse) == (2_097_152, 2_097_152, 1000)
    assert (ns.nsfeat, ns.nlbaf, ns.flbas, ns.mc, ns.dpc, ns.dps, ns.nmic) == (1, 1, 1, 3, 31, 0, 1)
    assert len(ns.lbaf) == 2  # NLBAF is 0's based
    assert (ns.lbaf[0].ms, ns.lbaf[0].lbads, ns.lbaf[0].rp) == (0, 9, 2)
    assert ns.format_index == 1
    assert ns.lba_size == 4096 and ns.metadata_size == 8
    assert ns.nguid == bytes(range(16)) and ns.eui64 == bytes(range(0xA0, 0xA8))
    d = ns.to_dict()
    assert d["nguid"] == bytes(range(16)).hex() and d["lba_size"] == 4096
    json.dumps(d)


def test_flbas_upper_bits_select_formats_above_16():
    # FLBAS bits 6:5 are the most significant bits of the format index (NLBAF > 16).
    ns = IdentifyNamespace.from_bytes(namespace_buffer(19, 0x20 | 0x01, {17: (0, 13, 0)}))
    assert ns.format_index == 17
    assert ns.lba_size == 8192


def test_flbas_beyond_nlbaf():
    ns = IdentifyNamespace.from_bytes(namespace_buffer(0, 0x02, {0: (0, 9, 0)}))
    with pytest.raises(ValueError, match="FLBAS selects LBA format 2, only 1 exist"):
        _ = ns.lba_size


def test_inactive_namespace():
    ns = IdentifyNamespace.from_bytes(bytes(4096))
    assert not ns.active
    assert "lba_size" not in ns.to_dict()


def test_active_ns_list():
    b = bytearray(4096)
    struct.pack_into("<III", b, 0, 1, 2, 5)
    assert parse_active_ns_list(b) == [1, 2, 5]
    assert parse_active_ns_list(bytes(4096)) == []
    full = struct.pack("<1024I", *range(1, 1025))
    assert parse_active_ns_list(full)[-1] == 1024


def test_identify_controller_ana_fields_at_the_kernel_offsets():
    b = bytearray(controller_buffer())
    b[342], b[343] = 10, 0x1F  # ANATT, ANACAP as nvmet sets them
    struct.pack_into("<II", b, 344, 128, 128)  # ANAGRPMAX, NANAGRPID
    struct.pack_into("<I", b, 540, 1024)  # MNAN
    c = IdentifyController.from_bytes(bytes(b))
    assert (c.anatt, c.anacap, c.anagrpmax, c.nanagrpid, c.mnan) == (10, 0x1F, 128, 128, 1024)
    assert c.ana_reporting and c.multi_controller  # CMIC 0x0B: bits 0, 1, 3
    b[76] = 0x03
    assert not IdentifyController.from_bytes(bytes(b)).ana_reporting


def test_identify_namespace_anagrpid():
    b = bytearray(4096)
    struct.pack_into("<Q", b, 0, 100)
    struct.pack_into("<I", b, 92, 3)
    b[128 + 2] = 9
    assert IdentifyNamespace.from_bytes(bytes(b)).anagrpid == 3


NGUID = bytes(range(16))
UUID = bytes(range(16, 32))


def nvmet_desclist(uuid=UUID, nguid=NGUID, csi=0):
    """As nvmet_execute_identify_desclist: UUID, NGUID (non-zero ones), CSI, zeroes."""
    out = b""
    if any(uuid):
        out += struct.pack("<BBxx", 3, 16) + uuid
    if any(nguid):
        out += struct.pack("<BBxx", 2, 16) + nguid
    out += struct.pack("<BBxxB", 4, 1, csi)
    return out.ljust(4096, b"\0")


def test_descriptor_list_parses_what_nvmet_sends():
    ids = NamespaceIds.from_descriptors(nvmet_desclist())
    assert (ids.uuid, ids.nguid, ids.eui64, ids.csi) == (UUID, NGUID, bytes(8), 0)
    assert ids.reported


def test_descriptor_list_overrides_identify_namespace_and_round_trips():
    base = NamespaceIds(eui64=b"\x01" * 8, nguid=b"\x02" * 16)
    ids = NamespaceIds.from_descriptors(nvmet_desclist(uuid=bytes(16)), base)
    assert ids.eui64 == b"\x01" * 8 and ids.nguid == NGUID
    assert NamespaceIds.from_descriptors(ids.to_descriptors()) == ids


def test_descriptor_list_skips_unknown_types_and_refuses_bad_lengths():
    data = struct.pack("<BBxx", 0x7, 2) + b"xy" + struct.pack("<BBxx", 2, 16) + NGUID
    assert NamespaceIds.from_descriptors(data.ljust(64, b"\0")).nguid == NGUID
    with pytest.raises(ValueError, match="NGUID has length 8, expected 16"):
        NamespaceIds.from_descriptors(struct.pack("<BBxx", 2, 8) + bytes(8))
    with pytest.raises(ValueError, match="past the end"):
        NamespaceIds.from_descriptors(struct.pack("<BBxx", 2, 16) + bytes(4))


def test_ids_mismatch_is_nvme_ns_ids_equal():
    a = NamespaceIds.from_descriptors(nvmet_desclist())
    assert a.mismatch(NamespaceIds.from_descriptors(nvmet_desclist())) == ""
    other = NamespaceIds.from_descriptors(nvmet_desclist(nguid=bytes(range(1, 17))))
    assert other.mismatch(a).startswith("NGUID 0102") and "!= 000102" in other.mismatch(a)
    assert a.mismatch(NamespaceIds(nguid=NGUID, uuid=UUID, csi=2)) == "CSI 0 != 2"
    assert "UUID" in a.mismatch(NamespaceIds(nguid=NGUID))  # a missing id differs too


@pytest.mark.parametrize("lbads, unusable", [
    (9, ""), (12, ""), (16, ""),
    (0, "LBA size 2^0 bytes (LBADS 0) is outside 512 B to 64 KiB"),
    (8, "LBADS 8"), (17, "LBADS 17"), (63, "LBADS 63"), (255, "LBADS 255"),
])
def test_an_lba_size_outside_512_bytes_to_64_kib_is_unusable(lbads, unusable):
    ns = IdentifyNamespace.from_bytes(namespace_buffer(0, 0, {0: (0, lbads, 0)}))
    assert (unusable in ns.unusable) and bool(ns.unusable) == bool(unusable)
    d = json.loads(json.dumps(ns.to_dict()))
    assert ("lba_size" in d) != bool(unusable) and ("unusable" in d) == bool(unusable)


@pytest.mark.parametrize("nsze, lbads, usable", [
    (2**54 - 1, 9, True),  # just under 2^63 bytes
    (2**54, 9, False),  # 2^63 bytes: past what off_t shows
    (2**64 - 1, 9, False),
    (2**47, 16, False),
    (2**47 - 1, 16, True),
])
def test_a_size_past_2_63_bytes_is_unusable(nsze, lbads, usable):
    b = bytearray(namespace_buffer(0, 0, {0: (0, lbads, 0)}))
    struct.pack_into("<Q", b, 0, nsze)
    ns = IdentifyNamespace.from_bytes(b)
    assert (ns.unusable == "") == usable
    if not usable:
        assert "past 2^63 bytes" in ns.unusable and str(nsze) in ns.unusable


def test_flbas_beyond_nlbaf_is_unusable_and_its_report_does_not_raise():
    ns = IdentifyNamespace.from_bytes(namespace_buffer(0, 0x02, {0: (0, 9, 0)}))
    assert ns.unusable == "FLBAS selects LBA format 2, only 1 exist"
    assert ns.to_dict()["unusable"] == ns.unusable


def test_active_ns_list_skips_repeats_disorder_and_the_broadcast_nsid():
    page = struct.pack("<6I", 1, 1, 0xFFFFFFFF, 5, 3, 7).ljust(4096, b"\0")
    assert parse_active_ns_list(page) == [1, 5, 7]
    full = struct.pack("<1024I", *range(1, 1025))
    assert parse_active_ns_list(full) == list(range(1, 1025))


def test_namespaces_with_one_format_table_share_it_and_their_zero_identifiers():
    """A target may have 65,536 namespaces, each kept: what they have alike is one object."""
    page = bytearray(namespace_buffer(1, 0x01, {0: (0, 9, 2), 1: (8, 12, 0)}))
    page[104:128] = bytes(24)  # no NGUID, no EUI-64
    a, b = IdentifyNamespace.from_bytes(page), IdentifyNamespace.from_bytes(bytes(page))
    assert a.lbaf is b.lbaf and a.nguid is b.nguid and a.eui64 is b.eui64
    assert a.lba_size is b.lba_size and a == b


def test_a_target_inventing_format_tables_gets_each_right_and_keeps_a_bounded_few():
    from nvmeof_fuse.nvme import identify

    seen = []
    for ms in range(identify._SHARED_MAX + 20):
        ns = IdentifyNamespace.from_bytes(namespace_buffer(0, 0, {0: (ms, 9, 0)}))
        assert ns.metadata_size == ms and ns.lba_size == 512
        seen.append(ns)
    assert len(identify._format_tables) <= identify._SHARED_MAX


def identity(nguid=NGUID, lbads=9, ms=0, nsze=1000, uuid=bytes(16)):
    return NamespaceIdentity(NamespaceIds(nguid=nguid, uuid=uuid), lbads, ms, nsze)


def test_a_namespace_of_the_same_identity_is_the_same_one_whatever_its_size():
    assert identity().change(identity()) == ""
    assert identity().change(identity(nsze=2000)) == ""  # a resize, as the kernel's


@pytest.mark.parametrize(("new", "says"), [
    (identity(nguid=bytes(range(1, 17))), "NGUID 000102030405060708090a0b0c0d0e0f != 0102"),
    (identity(uuid=UUID), "UUID (none) != 1011"),
    (identity(nguid=bytes(16)), "NGUID 000102030405060708090a0b0c0d0e0f != (none)"),
    (identity(lbads=12), "LBA format 512 B != 4096 B"),
    (identity(ms=8), "LBA format 512 B != 512 B+8"),
    (identity(lbads=-1, ms=-1), "LBA format 512 B != (none)"),
])
def test_another_identifier_or_format_is_another_namespace(new, says):
    assert identity().change(new).startswith(says), identity().change(new)


def test_a_namespace_without_identifiers_is_told_apart_by_its_size_and_format():
    none = NamespaceIds()
    a = NamespaceIdentity(none, 9, 0, 1000)
    assert a.change(NamespaceIdentity(none, 9, 0, 1000)) == ""
    assert a.change(NamespaceIdentity(none, 9, 0, 500)) == \
        "size 1000 != 500 LBAs, with no identifiers to tell them apart"
    assert a.change(NamespaceIdentity(none, 12, 0, 1000)) == "LBA format 512 B != 4096 B"
    assert a.describe() == "no identifiers, 512 B LBAs, 1000 LBAs"
    assert identity(uuid=UUID).describe() == f"NGUID {NGUID.hex()}, UUID {UUID.hex()}, 512 B LBAs"


def test_the_identity_of_identify_namespace_and_a_format_past_the_formats():
    ns = IdentifyNamespace.from_bytes(namespace_buffer(1, 0x01, {0: (0, 9, 2), 1: (8, 12, 0)}))
    ident = NamespaceIdentity.of(ns)
    assert (ident.ids.nguid, ident.ids.eui64) == (bytes(range(16)), bytes(range(0xA0, 0xA8)))
    assert (ident.lbads, ident.ms, ident.nsze) == (12, 8, 2_097_152)
    past = IdentifyNamespace.from_bytes(namespace_buffer(0, 0x05, {0: (0, 9, 0)}))
    assert (NamespaceIdentity.of(past).lbads, NamespaceIdentity.of(past).ms) == (-1, -1)
    assert NamespaceIdentity.of(ns, NamespaceIds(uuid=UUID)).ids == NamespaceIds(uuid=UUID)


def test_a_controller_of_another_subsystem_serial_or_model_is_another_one():
    first = IdentifyController.from_bytes(controller_buffer())
    assert controller_change(first, IdentifyController.from_bytes(controller_buffer())) == ""
    for offset, value, says in [
            (4, b"OTHER".ljust(20), "serial number 'SN0123456789' != 'OTHER'"),
            (24, b"Other model".ljust(40), "model number 'Linux NVMe-oF target' != 'Other model'"),
            (768, b"nqn.2014-08.org.example:other".ljust(256, b"\0"),
             "subsystem NQN 'nqn.2014-08.org.example:sub' != 'nqn.2014-08.org.example:other'")]:
        b = bytearray(controller_buffer())
        b[offset:offset + len(value)] = value
        assert controller_change(first, IdentifyController.from_bytes(bytes(b))) == says
