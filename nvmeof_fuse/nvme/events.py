"""Asynchronous events: the AER completion, the Changed Namespace List, the event config.

An Asynchronous Event Request stays outstanding until the controller has an
event; its completion's Dword 0 says what happened and which log page to read
(NVMe Base spec, "Asynchronous Event Request command", "Changed Namespace List").
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from ._fields import BytesLike
from .constants import LogPageId

CHANGED_NS_LIST_BYTES = 4096
"""1024 NSIDs; an overflowing list holds 0xFFFFFFFF first."""
_OVERFLOW = 0xFFFFFFFF
AEN_NS_ATTRIBUTE = 1 << 8
"""Asynchronous Event Configuration (and OAES): Namespace Attribute Notices."""
AEN_ANA_CHANGE = 1 << 11
"""Asynchronous Event Configuration (and OAES): Asymmetric Namespace Access Change Notices."""


class AsyncEventType(IntEnum):
    ERROR = 0
    SMART = 1
    NOTICE = 2
    IMMEDIATE = 3
    IO_COMMAND_SET = 6
    VENDOR = 7


class NoticeInfo(IntEnum):
    NAMESPACE_ATTRIBUTE_CHANGED = 0x00
    FIRMWARE_ACTIVATION_STARTING = 0x01
    TELEMETRY_LOG_CHANGED = 0x02
    ANA_CHANGE = 0x03
    DISCOVERY_LOG_CHANGED = 0xF0


@dataclass(frozen=True)
class AsyncEvent:
    """What an AER completion reports."""

    type: int
    info: int
    log_page: int

    @classmethod
    def from_dw0(cls, dw0: int) -> AsyncEvent:
        return cls(type=dw0 & 0x7, info=(dw0 >> 8) & 0xFF, log_page=(dw0 >> 16) & 0xFF)

    @property
    def namespace_changed(self) -> bool:
        return (self.type == AsyncEventType.NOTICE
                and self.info == NoticeInfo.NAMESPACE_ATTRIBUTE_CHANGED)

    @property
    def ana_changed(self) -> bool:
        """An ANA group changed state: read the ANA log page (0Ch) again."""
        return self.type == AsyncEventType.NOTICE and self.info == NoticeInfo.ANA_CHANGE

    def describe(self) -> str:
        try:
            kind = AsyncEventType(self.type).name.lower().replace("_", " ")
        except ValueError:
            kind = f"type {self.type}"
        what = f"{kind} event, info {self.info:#04x}"
        if self.type == AsyncEventType.NOTICE:
            try:
                what = NoticeInfo(self.info).name.lower().replace("_", " ")
            except ValueError:
                pass
        return f"{what} (log page {self.log_page:#04x})"


def parse_changed_ns_list(data: BytesLike) -> list[int] | None:
    """The NSIDs of a Changed Namespace List log page; None if more than 1024 changed
    (then every namespace must be looked at again)."""
    view = memoryview(data).cast("B")
    count = len(view) // 4
    nsids = struct.unpack_from(f"<{count}I", view)
    if nsids and nsids[0] == _OVERFLOW:
        return None
    out = []
    for nsid in nsids:
        if nsid == 0:
            break
        out.append(nsid)
    return out


CHANGED_NS_LIST = LogPageId.CHANGED_NS_LIST

__all__ = ["AEN_ANA_CHANGE", "AEN_NS_ATTRIBUTE", "CHANGED_NS_LIST", "CHANGED_NS_LIST_BYTES",
           "AsyncEvent", "AsyncEventType", "NoticeInfo", "parse_changed_ns_list"]
