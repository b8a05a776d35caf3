"""SQE builders against NVMe Base 2.0 "Common Command Format" (CDW0: opcode byte 0, flags
byte 1 with PSDT in bits 7:6, CID bytes 2..3; NSID 4..7; DPTR 24..39; CDW10.. at 40),
the NVM Command Set 1.0 Read/Write/Write Zeroes/Dataset Management figures and the
Fabrics Connect/Property Get/Property Set/Disconnect command figures."""

import uuid

import pytest

from nvmeof_fuse.nvme import command as c
from nvmeof_fuse.nvme.constants import NSID_ALL, Cns, FeatureId, LogPageId, Property
from nvmeof_fuse.nvme.sgl import NULL_SGL, keyed_data_block

SGL = keyed_data_block(0xDEADBEEF000, 4096, 0x1234)


def le(buf, start, end):
    return int.from_bytes(buf[start:end], "little")


ALL_BUILDERS = [
    lambda: c.identify(Cns.CONTROLLER, sgl=SGL),
    lambda: c.get_log_page(LogPageId.SMART, 512, sgl=SGL),
    lambda: c.set_features(FeatureId.NUMBER_OF_QUEUES, 0),
    lambda: c.get_features(FeatureId.KEEP_ALIVE_TIMER),
    c.keep_alive,
    c.async_event_request,
    lambda: c.read(1, 0, 1, SGL),
    lambda: c.write(1, 0, 1, SGL),
    lambda: c.flush(1),
    lambda: c.write_zeroes(1, 0, 1),
    lambda: c.dataset_management(1, 1, sgl=SGL),
    lambda: c.connect(0, 32, sgl=SGL),
    lambda: c.property_get(Property.CAP, True),
    lambda: c.property_set(Property.CC, 1, False),
]


@pytest.mark.parametrize("build", ALL_BUILDERS)
def test_every_sqe_is_64_bytes_sgl_cid_zero(build):
    sqe = build()
    assert isinstance(sqe, bytearray) and len(sqe) == 64
    assert sqe[1] == 0x40  # PSDT 01b: SGL, metadata buffer (Linux NVME_CMD_SGL_METABUF)
    assert sqe[2:4] == b"\0\0"


def test_read_layout():
    sqe = c.read(1, 0x1122334455667788, 8, SGL)
    assert sqe[0] == 0x02  # Read opcode
    assert le(sqe, 4, 8) == 1  # NSID
    assert sqe[24:40] == SGL  # DPTR holds SGL1
    assert le(sqe, 40, 48) == 0x1122334455667788  # CDW10/11 SLBA, little endian
    assert le(sqe, 48, 50) == 7  # CDW12 bits 15:0 NLB, 0's based
    assert le(sqe, 50, 64) == 0  # no FUA, LR, DSM, PI fields


def test_write_fua():
    sqe = c.write(3, 5, 1, SGL, fua=True)
    assert sqe[0] == 0x01
    assert le(sqe, 48, 52) == 1 << 30  # CDW12 bit 30 FUA, NLB 0


@pytest.mark.parametrize("nlb", [0, -1, 65537])
def test_bad_nlb(nlb):
    with pytest.raises(ValueError, match=r"number of logical blocks must be 1\.\.65536"):
        c.read(1, 0, nlb, SGL)


@pytest.mark.parametrize(("nsid", "slba", "nlb"), [(1, 0, 1), (7, (1 << 64) - 2, 2),
                                                   (1, 5, 65536)])
def test_read_into_writes_what_read_builds(nsid, slba, nlb):
    buf = bytearray(b"\xee" * 192)
    c.read_into(buf, 64, nsid, slba, nlb)
    assert buf[64:128] == c.read(nsid, slba, nlb, NULL_SGL)
    assert buf[:64] == buf[128:] == b"\xee" * 64  # nothing outside its 64 bytes


@pytest.mark.parametrize(("nsid", "slba", "nlb", "error"), [
    (1, 0, 0, "number of logical blocks"), (0, 0, 1, "nsid"), (1, 1 << 64, 1, "slba")])
def test_read_into_refuses_what_read_refuses(nsid, slba, nlb, error):
    buf = bytearray(64)
    with pytest.raises(ValueError, match=error):
        c.read_into(buf, 0, nsid, slba, nlb)
    assert buf == bytearray(64)


def test_max_nlb_encodes_ffff():
    assert le(c.read(1, 0, 65536, SGL), 48, 50) == 0xFFFF


def test_io_nsid_validated():
    with pytest.raises(ValueError, match="nsid"):
        c.read(0, 0, 1, SGL)
    with pytest.raises(ValueError, match="nsid"):
        c.write(NSID_ALL, 0, 1, SGL)
    assert le(c.flush(NSID_ALL), 4, 8) == NSID_ALL  # flush may target all namespaces


def test_bad_sgl_length():
    with pytest.raises(ValueError, match="SGL descriptor is 16 bytes"):
        c.read(1, 0, 1, b"\0" * 8)


def test_set_command_id():
    sqe = c.keep_alive()
    c.set_command_id(sqe, 0xBEEF)
    assert sqe[2:4] == b"\xef\xbe"
    assert c.command_id(sqe) == 0xBEEF
    with pytest.raises(ValueError, match="command id"):
        c.set_command_id(sqe, 0x10000)


def test_identify_layout():
    sqe = c.identify(Cns.NAMESPACE, nsid=7, cntid=0x1234, sgl=SGL)
    assert sqe[0] == 0x06
    assert le(sqe, 4, 8) == 7
    assert sqe[40] == 0x00  # CDW10 bits 7:0 CNS
    assert le(sqe, 42, 44) == 0x1234  # CDW10 bits 31:16 CNTID
    assert c.identify(Cns.CONTROLLER, sgl=SGL)[40] == 0x01


def test_get_log_page_layout():
    sqe = c.get_log_page(LogPageId.DISCOVERY, 4096, offset=1024, nsid=0, sgl=SGL)
    assert sqe[0] == 0x02
    assert sqe[40] == 0x70  # CDW10 bits 7:0 LID
    assert le(sqe, 42, 44) == 1023  # CDW10 bits 31:16 NUMDL (dwords, 0's based)
    assert le(sqe, 44, 46) == 0  # CDW11 bits 15:0 NUMDU
    assert le(sqe, 48, 52) == 1024  # CDW12 LPOL
    assert le(sqe, 52, 56) == 0  # CDW13 LPOU


def test_get_log_page_numdu_lsp_rae():
    sqe = c.get_log_page(LogPageId.ERROR, 0x40000 * 4, offset=1 << 32, lsp=3, rae=True, sgl=SGL)
    assert le(sqe, 4, 8) == NSID_ALL  # default NSID
    assert sqe[41] == 0x80 | 3  # CDW10 bit 15 RAE, bits 14:8 LSP
    assert le(sqe, 42, 44) == 0xFFFF  # NUMD 0x3FFFF: low half
    assert le(sqe, 44, 46) == 0x3  # high half
    assert le(sqe, 48, 52) == 0 and le(sqe, 52, 56) == 1  # LPOL/LPOU


@pytest.mark.parametrize("size, offset", [(0, 0), (6, 0), (8, 2)])
def test_get_log_page_alignment(size, offset):
    with pytest.raises(ValueError, match="multiple of 4"):
        c.get_log_page(LogPageId.SMART, size, offset=offset, sgl=SGL)


def test_set_features_layout():
    sqe = c.set_features(FeatureId.NUMBER_OF_QUEUES, 0x00030003, save=True)
    assert sqe[0] == 0x09
    assert le(sqe, 40, 44) == 0x07 | 1 << 31  # CDW10 FID, SV bit 31
    assert le(sqe, 44, 48) == 0x00030003  # CDW11 NSQR/NCQR, 0's based
    assert sqe[24:40] == NULL_SGL


def test_get_features_layout():
    sqe = c.get_features(FeatureId.KEEP_ALIVE_TIMER, sel=3, cdw11=9)
    assert sqe[0] == 0x0A
    assert le(sqe, 40, 44) == 0x0F | 3 << 8  # SEL bits 10:8
    assert le(sqe, 44, 48) == 9


def test_keep_alive_and_aer():
    assert c.keep_alive()[0] == 0x18
    assert c.async_event_request()[0] == 0x0C
    assert c.keep_alive()[24:40] == NULL_SGL


def test_write_zeroes_deallocate():
    sqe = c.write_zeroes(1, 0x100, 16, deallocate=True)
    assert sqe[0] == 0x08
    assert le(sqe, 40, 48) == 0x100
    assert le(sqe, 48, 52) == 15 | 1 << 25  # CDW12 bit 25 DEAC


def test_dataset_management_and_ranges():
    ranges = c.dsm_ranges([(0x10, 8), (0x1122334455, 1)])
    assert len(ranges) == 32
    assert le(ranges, 0, 4) == 0  # context attributes
    assert le(ranges, 4, 8) == 8  # length in logical blocks (not 0's based)
    assert le(ranges, 8, 16) == 0x10  # starting LBA
    assert le(ranges, 20, 24) == 1 and le(ranges, 24, 32) == 0x1122334455
    sqe = c.dataset_management(1, 2, sgl=SGL)
    assert sqe[0] == 0x09
    assert le(sqe, 40, 44) == 1  # CDW10 NR, 0's based
    assert le(sqe, 44, 48) == 1 << 2  # CDW11 AD
    assert le(c.dataset_management(1, 1, deallocate=False, sgl=SGL), 44, 48) == 0


def test_dsm_range_limits():
    with pytest.raises(ValueError, match="number of DSM ranges"):
        c.dsm_ranges([])
    with pytest.raises(ValueError, match="number of DSM ranges"):
        c.dsm_ranges([(i, 1) for i in range(257)])
    with pytest.raises(ValueError, match="DSM range length"):
        c.dsm_ranges([(0, 0)])
    with pytest.raises(ValueError, match="number of DSM ranges"):
        c.dataset_management(1, 0, sgl=SGL)


def test_connect_layout():
    sqe = c.connect(qid=3, sqsize=128, kato_ms=0, cattr=0x4, sgl=SGL)
    assert sqe[0] == 0x7F  # Fabrics opcode
    assert sqe[4] == 0x01  # FCTYPE Connect
    assert sqe[24:40] == SGL
    assert le(sqe, 40, 42) == 0  # RECFMT
    assert le(sqe, 42, 44) == 3  # QID
    assert le(sqe, 44, 46) == 127  # SQSIZE, 0's based
    assert sqe[46] == 0x4  # CATTR
    assert le(sqe, 48, 52) == 0  # KATO
    assert le(c.connect(0, 32, kato_ms=120_000, sgl=SGL), 48, 52) == 120_000


def test_connect_queue_size_bounds():
    with pytest.raises(ValueError, match="queue size"):
        c.connect(1, 1, sgl=SGL)
    with pytest.raises(ValueError, match="queue size"):
        c.connect(1, 65537, sgl=SGL)


HOSTID = uuid.UUID("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
SUBNQN = "nqn.2014-08.org.example:sub"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:" + str(HOSTID)


def test_connect_data_layout():
    data = c.connect_data(HOSTID, 0xFFFF, SUBNQN, HOSTNQN)
    assert len(data) == 1024
    assert data[0:16] == HOSTID.bytes  # HOSTID bytes 15:00
    assert le(data, 16, 18) == 0xFFFF  # CNTLID, dynamic
    assert data[18:256] == bytes(238)
    assert data[256 : 256 + len(SUBNQN)] == SUBNQN.encode()  # SUBNQN at 256
    assert data[256 + len(SUBNQN) : 512] == bytes(256 - len(SUBNQN))  # NUL padded
    assert data[512 : 512 + len(HOSTNQN)] == HOSTNQN.encode()  # HOSTNQN at 512
    assert data[512 + len(HOSTNQN) :] == bytes(512 - len(HOSTNQN))


def test_connect_data_nqn_limits():
    c.connect_data(HOSTID, 1, "n" * 223, HOSTNQN)
    with pytest.raises(ValueError, match=r"subsystem NQN must be 1\.\.223 bytes of UTF-8, got 224"):
        c.connect_data(HOSTID, 1, "n" * 224, HOSTNQN)
    with pytest.raises(ValueError, match="host NQN must be 1..223"):
        c.connect_data(HOSTID, 1, SUBNQN, "")
    with pytest.raises(ValueError, match="NUL"):
        c.connect_data(HOSTID, 1, SUBNQN, "nqn\0x")


def test_property_get_layout():
    sqe = c.property_get(Property.CAP, size8=True)
    assert (sqe[0], sqe[4]) == (0x7F, 0x04)
    assert sqe[40] == 1  # ATTRIB bits 2:0 = 1: 8 bytes
    assert le(sqe, 44, 48) == 0x00  # OFST
    sqe = c.property_get(Property.CSTS, size8=False)
    assert sqe[40] == 0 and le(sqe, 44, 48) == 0x1C


def test_property_set_layout():
    sqe = c.property_set(Property.CC, 0x00460001, size8=False)
    assert (sqe[0], sqe[4]) == (0x7F, 0x00)
    assert sqe[40] == 0
    assert le(sqe, 44, 48) == 0x14
    assert le(sqe, 48, 56) == 0x00460001  # VALUE bytes 55:48
    with pytest.raises(ValueError, match="property value must fit in 32 bits"):
        c.property_set(Property.CC, 1 << 32, size8=False)


def test_command_name():
    assert c.command_name(c.read(1, 0, 1, SGL), admin=False) == "Read"
    assert c.command_name(c.get_log_page(2, 512, sgl=SGL), admin=True) == "Get Log Page"
    assert c.command_name(c.connect(0, 32, sgl=SGL), admin=True) == "Connect"
    assert c.command_name(c.property_get(0, True), admin=True) == "Property Get"
    assert c.command_name(bytes([0x55]) + bytes(63), admin=True) == "Admin command 0x55"


def test_lbas_per_command_follow_the_transfer_limit_within_one_and_max_nlb():
    assert c.lbas_per_command(1 << 20, 4096) == 256
    assert c.lbas_per_command(1 << 20, 512) == 2048
    assert c.lbas_per_command(1024, 4096) == 1  # a limit below one LBA still moves one
    assert c.lbas_per_command(1 << 40, 512) == c.MAX_NLB
