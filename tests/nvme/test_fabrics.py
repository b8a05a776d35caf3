"""Controller properties against NVMe Base 2.0 "Offset 0h: CAP", "Offset 8h: VS",
"Offset 14h: CC", "Offset 1Ch: CSTS", and the "Connect Response" DW0 layout."""

import pytest

from nvmeof_fuse.nvme.fabrics import (
    Capabilities,
    ConnectResult,
    ControllerStatus,
    cc_enable_value,
    cc_shutdown_value,
    decode_version,
)


def test_capabilities():
    cap = (
        0x03FF  # MQES 15:0, 0's based
        | 1 << 16  # CQR
        | 0x1E << 24  # TO 31:24, 500 ms units
        | 2 << 32  # DSTRD 35:32
        | 1 << 36  # NSSRS
        | 0x41 << 37  # CSS 44:37
        | 0 << 48  # MPSMIN 51:48
        | 4 << 52  # MPSMAX 55:52
    )
    c = Capabilities.from_int(cap)
    assert c.raw == cap
    assert c.max_queue_entries == 1024
    assert c.cqr and c.nssrs
    assert c.timeout_ms == 15_000
    assert c.dstrd == 2
    assert c.css == 0x41
    assert c.min_page_size == 4096
    assert c.max_page_size == 65536


def test_cc_enable_value_matches_linux_default():
    # Linux nvme_enable_ctrl: EN | CSS NVM | MPS 0 | AMS RR | IOSQES 6 | IOCQES 4.
    assert cc_enable_value() == 0x00460001
    assert cc_enable_value(mps_shift=4, css=6) == 0x00460001 | 6 << 4 | 4 << 7
    with pytest.raises(ValueError, match="mps"):
        cc_enable_value(mps_shift=16)


def test_cc_shutdown_value():
    assert cc_shutdown_value(0x00460001) == 0x00464001  # SHN 15:14 = 01b
    assert cc_shutdown_value(0x00460001 | 2 << 14) == 0x00464001  # abrupt replaced


@pytest.mark.parametrize(
    "csts, rdy, cfs, shst",
    [(0x0, False, False, 0), (0x1, True, False, 0), (0x2, False, True, 0), (0x9, True, False, 2)],
)
def test_controller_status(csts, rdy, cfs, shst):
    s = ControllerStatus.from_int(csts)
    assert (s.rdy, s.cfs, s.shst) == (rdy, cfs, shst)
    assert s.shutdown_complete == (shst == 2)


def test_decode_version():
    assert decode_version(0x00010400) == "1.4"
    assert decode_version(0x00020001) == "2.0.1"
    assert decode_version(0x00010300) == "1.3"


def test_connect_result():
    r = ConnectResult.from_dw0(0x0002_0005)
    assert r.cntlid == 5
    assert r.authreq == 0x2
    assert r.authentication_required and not r.secure_channel_required
