"""host.discovery against a stand-in discovery controller (its log page as bytes)."""

from __future__ import annotations

import contextlib
import struct

import pytest
import trio

from nvmeof_fuse.errors import TargetProtocolError
from nvmeof_fuse.host import discovery
from nvmeof_fuse.host.controller import ConnectOptions


class DiscoveryController:
    """Answers Get Log Page with the slice asked of a header claiming ``numrec`` records."""

    def __init__(self, numrec: int) -> None:
        self.page = struct.pack("<QQH", 1, numrec, 0).ljust(1024, b"\0")
        self.asked: list[int] = []

    async def get_log_page(self, lid: int, length: int, offset: int = 0) -> bytes:
        self.asked.append(length)
        return self.page[offset:offset + length].ljust(length, b"\0")


def test_a_numrec_past_the_cap_is_refused_after_the_header_only(monkeypatch):
    ctrl = DiscoveryController(discovery.MAX_RECORDS + 1)

    @contextlib.asynccontextmanager
    async def connect(options):
        yield ctrl

    monkeypatch.setattr(discovery, "connect", connect)
    with pytest.raises(TargetProtocolError) as refused:
        trio.run(discovery.discover, ConnectOptions("192.0.2.1", "nqn.2014-08.org.example:t"))
    assert str(refused.value) == (f"the discovery log page of 192.0.2.1 claims "
                                  f"{discovery.MAX_RECORDS + 1} records; more than "
                                  f"{discovery.MAX_RECORDS} are refused")
    assert ctrl.asked == [1024]
