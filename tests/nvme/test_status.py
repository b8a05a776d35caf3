"""Status names against the NVMe Base 2.0 status tables (Linux constants.c nvme_statuses[]),
errno mapping, and the Connect response IATTR/IPO decoding ("Connect Response")."""

import errno

import pytest

from nvmeof_fuse.nvme.status import (
    NVMeStatusError,
    connect_invalid_parameter,
    fails_over,
    is_ana_error,
    is_path_error,
    status_errno,
    status_name,
)


@pytest.mark.parametrize(
    "sct, sc, fabrics, name",
    [
        (0, 0x00, False, "Successful Completion"),
        (0, 0x01, False, "Invalid Command Opcode"),
        (0, 0x02, False, "Invalid Field in Command"),
        (0, 0x04, False, "Data Transfer Error"),
        (0, 0x06, False, "Internal Error"),
        (0, 0x07, False, "Command Abort Requested"),
        (0, 0x0B, False, "Invalid Namespace or Format"),
        (0, 0x0F, False, "Data SGL Length Invalid"),
        (0, 0x1E, False, "SGL Data Block Granularity Invalid"),
        (0, 0x80, False, "LBA Out of Range"),
        (0, 0x81, False, "Capacity Exceeded"),
        (0, 0x82, False, "Namespace Not Ready"),
        (1, 0x01, False, "Invalid Queue Identifier"),
        (1, 0x02, False, "Invalid Queue Size"),
        (1, 0x80, False, "Conflicting Attributes"),
        (1, 0x82, False, "Attempted Write to Read Only Range"),
        (1, 0x80, True, "Incompatible Format"),
        (1, 0x81, True, "Controller Busy"),
        (1, 0x82, True, "Connect Invalid Parameters"),
        (1, 0x83, True, "Connect Restart Discovery"),
        (1, 0x84, True, "Connect Invalid Host"),
        (1, 0x85, True, "Invalid Queue Type"),
        (1, 0x90, True, "Discover Restart"),
        (1, 0x91, True, "Authentication Required"),
        (1, 0x01, True, "Invalid Queue Identifier"),  # below 0x80 the hint does not matter
        (2, 0x80, False, "Write Fault"),
        (2, 0x81, False, "Unrecovered Read Error"),
        (2, 0x82, False, "End-to-end Guard Check Error"),
        (2, 0x85, False, "Compare Failure"),
        (2, 0x86, False, "Access Denied"),
        (2, 0x87, False, "Deallocated or Unwritten Logical Block"),
        (3, 0x00, False, "Internal Path Error"),
        (3, 0x70, False, "Host Pathing Error"),
        (7, 0x12, False, "Vendor Specific"),
        (0, 0x7F, False, "Unknown Status"),
        (5, 0x00, False, "Unknown Status"),
    ],
)
def test_status_name(sct, sc, fabrics, name):
    assert status_name(sct, sc, fabrics) == name


@pytest.mark.parametrize(
    "sct, sc, fabrics, err",
    [
        (0, 0x00, False, 0),
        (0, 0x01, False, errno.EOPNOTSUPP),
        (0, 0x02, False, errno.EINVAL),
        (0, 0x04, False, errno.EIO),
        (0, 0x20, False, errno.EROFS),
        (0, 0x80, False, errno.ENOSPC),
        (0, 0x81, False, errno.ENOSPC),
        (0, 0x82, False, errno.EAGAIN),
        (1, 0x82, False, errno.EROFS),
        (1, 0x82, True, errno.EINVAL),
        (1, 0x84, True, errno.EACCES),
        (1, 0x81, True, errno.EBUSY),
        (2, 0x81, False, errno.EIO),
        (2, 0x86, False, errno.EACCES),
        (3, 0x02, False, errno.ENOLINK),
        (7, 0x00, False, errno.EIO),
    ],
)
def test_status_errno(sct, sc, fabrics, err):
    assert status_errno(sct, sc, fabrics) == err


def test_connect_invalid_parameter():
    assert connect_invalid_parameter(44) == "SQSIZE in Connect command (byte 44)"
    assert connect_invalid_parameter(42) == "QID in Connect command (byte 42)"
    assert connect_invalid_parameter(1 << 16 | 16) == "CNTLID in Connect data (byte 16)"
    assert connect_invalid_parameter(1 << 16 | 256) == "SUBNQN in Connect data (byte 256)"
    assert connect_invalid_parameter(1 << 16 | 300) == "field in Connect data (byte 300)"


def test_error_attributes_and_message():
    e = NVMeStatusError(0x0002, "Identify")
    assert (e.status, e.sct, e.sc, e.dnr, e.errno) == (2, 0, 2, False, errno.EINVAL)
    assert str(e) == "Identify failed: Invalid Field in Command (sct 0x0, sc 0x02)"
    e = NVMeStatusError(0x4000 | 0x0281, "Read")
    assert str(e) == "Read failed: Unrecovered Read Error (sct 0x2, sc 0x81, dnr)"
    # The IATTR/IPO detail only applies to Fabrics commands.
    assert "Connect data" not in str(NVMeStatusError(0x182, "Write", result=1 << 16))


@pytest.mark.parametrize("sct, sc, path, ana", [
    (3, 0x00, True, False),  # Internal Path Error
    (3, 0x01, True, True),  # Asymmetric Access Persistent Loss
    (3, 0x02, True, True),  # Asymmetric Access Inaccessible
    (3, 0x03, True, True),  # Asymmetric Access Transition
    (3, 0x60, True, False),  # Controller Pathing Error
    (3, 0x70, True, False),  # Host Pathing Error
    (3, 0x71, True, False),  # Command Aborted By Host
    (0, 0x06, False, False),  # Internal Error: retried on the same path, not failed over
    (0, 0x22, False, False),  # Transient Transport Error
    (2, 0x81, False, False),  # Unrecovered Read Error
])
def test_path_and_ana_errors_as_the_kernel_classifies_them(sct, sc, path, ana):
    assert is_path_error(sct, sc) is path
    assert is_ana_error(sct, sc) is ana
    assert fails_over(sct, sc, dnr=False) is path
    assert not fails_over(sct, sc, dnr=True)  # Do Not Retry: on no path
