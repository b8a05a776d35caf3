"""Completion status: names, errno mapping and the exception raised for failures.

Names follow the NVMe Base 2.0 status tables ("Generic Command Status Values",
"Command Specific Status Values", "Media and Data Integrity Errors",
"Path Related Status Values"), the NVM and Zoned command set tables, and the
Fabrics Connect/Discovery codes; Linux ``drivers/nvme/host/constants.c`` uses
the same wording. In SCT 1, codes 0x80 and up belong to the command set, so
the same code means different things for Fabrics and NVM I/O commands.
"""

from __future__ import annotations

import errno as _errno

from nvmeof_fuse.errors import NVMeoFError

SCT_GENERIC = 0x0
SCT_COMMAND_SPECIFIC = 0x1
SCT_MEDIA = 0x2
SCT_PATH = 0x3
SCT_VENDOR = 0x7

SC_INTERNAL_PATH_ERROR = 0x00
SC_ANA_PERSISTENT_LOSS = 0x01
SC_ANA_INACCESSIBLE = 0x02
SC_ANA_TRANSITION = 0x03
SC_CONTROLLER_PATH_ERROR = 0x60
SC_HOST_PATH_ERROR = 0x70
SC_HOST_ABORTED = 0x71
"""Path Related Status codes (SCT 3h)."""

SC_CONNECT_INVALID_PARAMETERS = 0x82
"""Fabrics SCT 1 code whose completion DW0 names the bad field (IATTR/IPO)."""

GENERIC: dict[int, str] = {
    0x00: "Successful Completion",
    0x01: "Invalid Command Opcode",
    0x02: "Invalid Field in Command",
    0x03: "Command ID Conflict",
    0x04: "Data Transfer Error",
    0x05: "Commands Aborted due to Power Loss Notification",
    0x06: "Internal Error",
    0x07: "Command Abort Requested",
    0x08: "Command Aborted due to SQ Deletion",
    0x09: "Command Aborted due to Failed Fused Command",
    0x0A: "Command Aborted due to Missing Fused Command",
    0x0B: "Invalid Namespace or Format",
    0x0C: "Command Sequence Error",
    0x0D: "Invalid SGL Segment Descriptor",
    0x0E: "Invalid Number of SGL Descriptors",
    0x0F: "Data SGL Length Invalid",
    0x10: "Metadata SGL Length Invalid",
    0x11: "SGL Descriptor Type Invalid",
    0x12: "Invalid Use of Controller Memory Buffer",
    0x13: "PRP Offset Invalid",
    0x14: "Atomic Write Unit Exceeded",
    0x15: "Operation Denied",
    0x16: "SGL Offset Invalid",
    0x18: "Host Identifier Inconsistent Format",
    0x19: "Keep Alive Timer Expired",
    0x1A: "Keep Alive Timeout Invalid",
    0x1B: "Command Aborted due to Preempt and Abort",
    0x1C: "Sanitize Failed",
    0x1D: "Sanitize In Progress",
    0x1E: "SGL Data Block Granularity Invalid",
    0x1F: "Command Not Supported for Queue in CMB",
    0x20: "Namespace is Write Protected",
    0x21: "Command Interrupted",
    0x22: "Transient Transport Error",
    0x23: "Command Prohibited by Command and Feature Lockdown",
    0x24: "Admin Command Media Not Ready",
    0x80: "LBA Out of Range",
    0x81: "Capacity Exceeded",
    0x82: "Namespace Not Ready",
    0x83: "Reservation Conflict",
    0x84: "Format In Progress",
}

COMMAND_SPECIFIC: dict[int, str] = {
    0x00: "Completion Queue Invalid",
    0x01: "Invalid Queue Identifier",
    0x02: "Invalid Queue Size",
    0x03: "Abort Command Limit Exceeded",
    0x05: "Asynchronous Event Request Limit Exceeded",
    0x06: "Invalid Firmware Slot",
    0x07: "Invalid Firmware Image",
    0x08: "Invalid Interrupt Vector",
    0x09: "Invalid Log Page",
    0x0A: "Invalid Format",
    0x0B: "Firmware Activation Requires Conventional Reset",
    0x0C: "Invalid Queue Deletion",
    0x0D: "Feature Identifier Not Saveable",
    0x0E: "Feature Not Changeable",
    0x0F: "Feature Not Namespace Specific",
    0x10: "Firmware Activation Requires NVM Subsystem Reset",
    0x11: "Firmware Activation Requires Controller Level Reset",
    0x12: "Firmware Activation Requires Maximum Time Violation",
    0x13: "Firmware Activation Prohibited",
    0x14: "Overlapping Range",
    0x15: "Namespace Insufficient Capacity",
    0x16: "Namespace Identifier Unavailable",
    0x18: "Namespace Already Attached",
    0x19: "Namespace Is Private",
    0x1A: "Namespace Not Attached",
    0x1B: "Thin Provisioning Not Supported",
    0x1C: "Controller List Invalid",
    0x1D: "Device Self-test In Progress",
    0x1E: "Boot Partition Write Prohibited",
    0x1F: "Invalid Controller Identifier",
    0x20: "Invalid Secondary Controller State",
    0x21: "Invalid Number of Controller Resources",
    0x22: "Invalid Resource Identifier",
    0x23: "Sanitize Prohibited While Persistent Memory Region is Enabled",
    0x24: "ANA Group Identifier Invalid",
    0x25: "ANA Attach Failed",
    0x26: "Insufficient Capacity",
    0x27: "Namespace Attachment Limit Exceeded",
    0x28: "Prohibition of Command Execution Not Supported",
    0x29: "I/O Command Set Not Supported",
    0x2A: "I/O Command Set Not Enabled",
    0x2B: "I/O Command Set Combination Rejected",
    0x2C: "Invalid I/O Command Set",
    0x2D: "Identifier Unavailable",
}

NVM_COMMAND_SPECIFIC: dict[int, str] = {
    0x80: "Conflicting Attributes",
    0x81: "Invalid Protection Information",
    0x82: "Attempted Write to Read Only Range",
    0x83: "Command Size Limit Exceeded",
    0xB8: "Zoned Boundary Error",
    0xB9: "Zone Is Full",
    0xBA: "Zone Is Read Only",
    0xBB: "Zone Is Offline",
    0xBC: "Zone Invalid Write",
    0xBD: "Too Many Active Zones",
    0xBE: "Too Many Open Zones",
    0xBF: "Invalid Zone State Transition",
}

FABRICS_COMMAND_SPECIFIC: dict[int, str] = {
    0x80: "Incompatible Format",
    0x81: "Controller Busy",
    0x82: "Connect Invalid Parameters",
    0x83: "Connect Restart Discovery",
    0x84: "Connect Invalid Host",
    0x85: "Invalid Queue Type",
    0x90: "Discover Restart",
    0x91: "Authentication Required",
}

MEDIA: dict[int, str] = {
    0x80: "Write Fault",
    0x81: "Unrecovered Read Error",
    0x82: "End-to-end Guard Check Error",
    0x83: "End-to-end Application Tag Check Error",
    0x84: "End-to-end Reference Tag Check Error",
    0x85: "Compare Failure",
    0x86: "Access Denied",
    0x87: "Deallocated or Unwritten Logical Block",
    0x88: "End-to-end Storage Tag Check Error",
}

PATH: dict[int, str] = {
    0x00: "Internal Path Error",
    0x01: "Asymmetric Access Persistent Loss",
    0x02: "Asymmetric Access Inaccessible",
    0x03: "Asymmetric Access Transition",
    0x60: "Controller Pathing Error",
    0x70: "Host Pathing Error",
    0x71: "Command Aborted By Host",
}


def status_name(sct: int, sc: int, fabrics: bool = False) -> str:
    """Spec name of ``sct``/``sc``; ``fabrics`` selects the Fabrics meaning of SCT 1 >= 0x80."""
    if sct == SCT_GENERIC:
        table = GENERIC
    elif sct == SCT_COMMAND_SPECIFIC:
        if sc < 0x80:
            table = COMMAND_SPECIFIC
        else:
            table = FABRICS_COMMAND_SPECIFIC if fabrics else NVM_COMMAND_SPECIFIC
    elif sct == SCT_MEDIA:
        table = MEDIA
    elif sct == SCT_PATH:
        table = PATH
    elif sct == SCT_VENDOR:
        return "Vendor Specific"
    else:
        table = {}
    return table.get(sc, "Unknown Status")


# errno per (sct, sc), in the spirit of Linux nvme_error_status() (core.c), adapted
# to what a filesystem caller expects: "bad request" -> EINVAL/EOPNOTSUPP, "no room" ->
# ENOSPC, write-protect -> EROFS, "try later" -> EAGAIN, path trouble -> ENOLINK.
_ERRNO: dict[tuple[int, int], int] = {
    (SCT_GENERIC, 0x01): _errno.EOPNOTSUPP,  # Invalid Command Opcode
    (SCT_GENERIC, 0x02): _errno.EINVAL,  # Invalid Field in Command
    (SCT_GENERIC, 0x07): _errno.ECANCELED,  # Command Abort Requested
    (SCT_GENERIC, 0x08): _errno.ECANCELED,  # Aborted due to SQ Deletion
    (SCT_GENERIC, 0x0B): _errno.EINVAL,  # Invalid Namespace or Format
    (SCT_GENERIC, 0x19): _errno.ETIMEDOUT,  # Keep Alive Timer Expired
    (SCT_GENERIC, 0x20): _errno.EROFS,  # Namespace is Write Protected
    (SCT_GENERIC, 0x21): _errno.EAGAIN,  # Command Interrupted
    (SCT_GENERIC, 0x22): _errno.EAGAIN,  # Transient Transport Error
    (SCT_GENERIC, 0x24): _errno.EAGAIN,  # Admin Command Media Not Ready
    (SCT_GENERIC, 0x80): _errno.ENOSPC,  # LBA Out of Range
    (SCT_GENERIC, 0x81): _errno.ENOSPC,  # Capacity Exceeded
    (SCT_GENERIC, 0x82): _errno.EAGAIN,  # Namespace Not Ready
    (SCT_GENERIC, 0x83): _errno.EACCES,  # Reservation Conflict (Linux: BLK_STS_RESV_CONFLICT)
    (SCT_GENERIC, 0x84): _errno.EAGAIN,  # Format In Progress
    (SCT_COMMAND_SPECIFIC, 0x01): _errno.EINVAL,  # Invalid Queue Identifier
    (SCT_COMMAND_SPECIFIC, 0x02): _errno.EINVAL,  # Invalid Queue Size
    (SCT_COMMAND_SPECIFIC, 0x09): _errno.EINVAL,  # Invalid Log Page
    (SCT_MEDIA, 0x86): _errno.EACCES,  # Access Denied
    (SCT_PATH, 0x70): _errno.ENOLINK,  # Host Pathing Error (Linux: BLK_STS_TRANSPORT)
}
_NVM_ERRNO: dict[int, int] = {
    0x80: _errno.EINVAL,  # Conflicting Attributes
    0x81: _errno.EINVAL,  # Invalid Protection Information
    0x82: _errno.EROFS,  # Attempted Write to Read Only Range
    0x83: _errno.EOPNOTSUPP,  # Command Size Limit Exceeded
}
_FABRICS_ERRNO: dict[int, int] = {
    0x80: _errno.EPROTO,  # Incompatible Format
    0x81: _errno.EBUSY,  # Controller Busy
    0x82: _errno.EINVAL,  # Connect Invalid Parameters
    0x83: _errno.EAGAIN,  # Connect Restart Discovery
    0x84: _errno.EACCES,  # Connect Invalid Host
    0x85: _errno.EINVAL,  # Invalid Queue Type
    0x90: _errno.EAGAIN,  # Discover Restart
    0x91: _errno.EACCES,  # Authentication Required
}


def status_errno(sct: int, sc: int, fabrics: bool = False) -> int:
    """The errno a filesystem should report for status ``sct``/``sc`` (EIO by default)."""
    if sct == SCT_GENERIC and sc == 0:
        return 0
    if sct == SCT_COMMAND_SPECIFIC and sc >= 0x80:
        table = _FABRICS_ERRNO if fabrics else _NVM_ERRNO
        return table.get(sc, _errno.EIO)
    if sct == SCT_PATH and (sct, sc) not in _ERRNO:
        return _errno.ENOLINK
    return _ERRNO.get((sct, sc), _errno.EIO)


def is_path_error(sct: int, sc: int) -> bool:
    """A Path Related Status (SCT 3h): the path, not the command, failed, so another path
    may serve it (the kernel's ``nvme_is_path_error``)."""
    return sct == SCT_PATH


def is_ana_error(sct: int, sc: int) -> bool:
    """An ANA status (301h persistent loss, 302h inaccessible, 303h transition): the
    controller is alive but its ANA state changed; read the ANA log again
    (the kernel's ``nvme_is_ana_error``)."""
    return sct == SCT_PATH and sc in (SC_ANA_PERSISTENT_LOSS, SC_ANA_INACCESSIBLE,
                                      SC_ANA_TRANSITION)


def fails_over(sct: int, sc: int, dnr: bool) -> bool:
    """Whether a multipath head runs a command that failed with this status again on
    another path at once, as the kernel's ``nvme_decide_disposition`` returns FAILOVER:
    a path error without Do Not Retry."""
    return not dnr and sct == SCT_PATH


_CONNECT_SQE_FIELDS = {40: "RECFMT", 42: "QID", 44: "SQSIZE", 46: "CATTR", 48: "KATO"}
_CONNECT_DATA_FIELDS = {0: "HOSTID", 16: "CNTLID", 256: "SUBNQN", 512: "HOSTNQN"}


def connect_invalid_parameter(dw0: int) -> str:
    """Which field a Connect Invalid Parameters completion blames, from DW0.

    DW0 bit 16 is IATTR (0: the Connect command, 1: the Connect data) and bits
    15:0 are IPO, the byte offset of the bad field (NVMe Base 2.0, "Connect
    Response"; Linux ``nvmf_log_connect_error``).
    """
    ipo = dw0 & 0xFFFF
    if dw0 >> 16 & 1:
        field, where = _CONNECT_DATA_FIELDS.get(ipo), "Connect data"
    else:
        field, where = _CONNECT_SQE_FIELDS.get(ipo), "Connect command"
    return f"{field or 'field'} in {where} (byte {ipo})"


class NVMeStatusError(NVMeoFError):
    """A command completed with a non-zero status.

    ``status`` is the 15-bit status field (phase bit removed); ``sct``, ``sc``
    and ``dnr`` are decoded from it, ``name`` is the spec name, ``command`` the
    failed command's name and ``errno`` what a filesystem should return.
    """

    def __init__(self, status: int, command: str, *, result: int = 0, fabrics: bool = False):
        self.status = status
        self.sct = status >> 8 & 0x7
        self.sc = status & 0xFF
        self.dnr = bool(status & 0x4000)
        self.name = status_name(self.sct, self.sc, fabrics)
        self.command = command
        self.result = result
        self.errno = status_errno(self.sct, self.sc, fabrics)
        detail = ""
        connect_invalid = (self.sct, self.sc) == (
            SCT_COMMAND_SPECIFIC,
            SC_CONNECT_INVALID_PARAMETERS,
        )
        if fabrics and connect_invalid:
            detail = f": {connect_invalid_parameter(result & 0xFFFFFFFF)}"
        dnr = ", dnr" if self.dnr else ""
        super().__init__(
            f"{command} failed: {self.name}{detail} (sct {self.sct:#x}, sc {self.sc:#04x}{dnr})"
        )
