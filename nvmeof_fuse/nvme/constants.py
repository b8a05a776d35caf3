"""NVMe and NVMe-oF numbers: opcodes, CNS values, feature and log page IDs, properties.

Values follow the NVMe Base Specification 2.0 and the NVMe over Fabrics 1.1
specification (mirrored in Linux ``include/linux/nvme.h``).
"""

from __future__ import annotations

from enum import IntEnum

SQE_SIZE = 64
"""Bytes in a submission queue entry (command)."""
CQE_SIZE = 16
"""Bytes in a completion queue entry."""
SGL_DESC_SIZE = 16
"""Bytes in one SGL descriptor."""
IDENTIFY_DATA_SIZE = 4096
"""Bytes returned by every Identify CNS used here."""
CONNECT_DATA_SIZE = 1024
"""Bytes in the Fabrics Connect data structure."""

NSID_ALL = 0xFFFFFFFF
"""Broadcast namespace ID."""
CNTLID_DYNAMIC = 0xFFFF
"""Connect data CNTLID asking the subsystem to allocate a controller (dynamic model)."""
NQN_MAX_BYTES = 223
"""Longest NVMe Qualified Name, in UTF-8 bytes, excluding the NUL."""
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
"""Well-known NQN of a discovery subsystem."""

PSDT_SGL_METABUF = 0x40
"""CDW0 flags byte: PSDT = 01b, data pointer is an SGL (Linux ``NVME_CMD_SGL_METABUF``)."""


class AdminOpcode(IntEnum):
    """Admin command opcodes (NVMe Base 2.0, "Opcodes for Admin Commands")."""

    GET_LOG_PAGE = 0x02
    IDENTIFY = 0x06
    ABORT = 0x08
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A
    ASYNC_EVENT_REQUEST = 0x0C
    KEEP_ALIVE = 0x18
    FABRICS = 0x7F


class IoOpcode(IntEnum):
    """NVM command set I/O opcodes (NVM Command Set 1.0, "Opcodes for NVM Commands")."""

    FLUSH = 0x00
    WRITE = 0x01
    READ = 0x02
    WRITE_UNCORRECTABLE = 0x04
    COMPARE = 0x05
    WRITE_ZEROES = 0x08
    DATASET_MANAGEMENT = 0x09
    VERIFY = 0x0C
    FABRICS = 0x7F


OPC_FABRICS = 0x7F
"""Opcode shared by all Fabrics commands; the command type is in FCTYPE (byte 4)."""


AUTH_PROTOCOL_ID = 0xE9
"""SECP of Authentication Send/Receive for NVMe in-band authentication (DH-HMAC-CHAP)."""


class FabricsType(IntEnum):
    """Fabrics command types, FCTYPE (NVMe Base 2.0, "Fabrics Command Types")."""

    PROPERTY_SET = 0x00
    CONNECT = 0x01
    PROPERTY_GET = 0x04
    AUTH_SEND = 0x05
    AUTH_RECEIVE = 0x06
    DISCONNECT = 0x08


class Cns(IntEnum):
    """Identify CNS values (NVMe Base 2.0, "CNS Values")."""

    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NS_LIST = 0x02
    NS_DESCRIPTOR_LIST = 0x03


class FeatureId(IntEnum):
    """Feature identifiers used by an initiator (NVMe Base 2.0, "Feature Identifiers")."""

    VOLATILE_WRITE_CACHE = 0x06
    NUMBER_OF_QUEUES = 0x07
    ASYNC_EVENT_CONFIG = 0x0B
    KEEP_ALIVE_TIMER = 0x0F


class LogPageId(IntEnum):
    """Log page identifiers (NVMe Base 2.0, "Log Page Identifiers")."""

    ERROR = 0x01
    SMART = 0x02
    FIRMWARE_SLOT = 0x03
    CHANGED_NS_LIST = 0x04
    ANA = 0x0C
    DISCOVERY = 0x70


class Property(IntEnum):
    """Controller property offsets for Property Get/Set (NVMe Base 2.0, "Controller Properties")."""

    CAP = 0x00
    VS = 0x08
    CC = 0x14
    CSTS = 0x1C
    NSSR = 0x20
