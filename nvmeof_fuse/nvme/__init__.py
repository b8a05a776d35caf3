"""Sans-I/O NVMe and NVMe-oF wire layer: builders give bytes, parsers give typed objects.

``command`` builds 64-byte SQEs, ``sgl`` the 16-byte data descriptors,
``completion`` parses CQEs, ``status`` names and maps status codes, ``fabrics``
decodes controller properties, ``identify``, ``logpage`` and ``ana`` parse returned data.
Nothing here does I/O.
"""

from . import command, constants, sgl
from .ana import AnaLogPage, AnaState
from .command import set_command_id
from .completion import Completion
from .constants import (
    CNTLID_DYNAMIC,
    DISCOVERY_NQN,
    NSID_ALL,
    AdminOpcode,
    Cns,
    FabricsType,
    FeatureId,
    IoOpcode,
    LogPageId,
    Property,
)
from .fabrics import (
    Capabilities,
    ConnectResult,
    ControllerStatus,
    cc_enable_value,
    cc_shutdown_value,
    decode_version,
)
from .identify import (
    ACTIVE_NS_PER_PAGE,
    IdentifyController,
    IdentifyNamespace,
    LbaFormat,
    NamespaceIdentity,
    NamespaceIds,
    controller_change,
    parse_active_ns_list,
)
from .logpage import DiscoveryLogEntry, DiscoveryLogPage, ErrorLogEntry, SmartLog
from .sgl import NULL_SGL, in_capsule_data, keyed_data_block
from .status import NVMeStatusError, connect_invalid_parameter, status_errno, status_name

__all__ = [
    "ACTIVE_NS_PER_PAGE",
    "CNTLID_DYNAMIC",
    "DISCOVERY_NQN",
    "NSID_ALL",
    "NULL_SGL",
    "AdminOpcode",
    "AnaLogPage",
    "AnaState",
    "Capabilities",
    "Cns",
    "Completion",
    "ConnectResult",
    "ControllerStatus",
    "DiscoveryLogEntry",
    "DiscoveryLogPage",
    "ErrorLogEntry",
    "FabricsType",
    "FeatureId",
    "IdentifyController",
    "IdentifyNamespace",
    "IoOpcode",
    "LbaFormat",
    "LogPageId",
    "NamespaceIdentity",
    "NamespaceIds",
    "NVMeStatusError",
    "Property",
    "SmartLog",
    "cc_enable_value",
    "cc_shutdown_value",
    "command",
    "controller_change",
    "connect_invalid_parameter",
    "constants",
    "decode_version",
    "in_capsule_data",
    "keyed_data_block",
    "parse_active_ns_list",
    "set_command_id",
    "sgl",
    "status_errno",
    "status_name",
]
