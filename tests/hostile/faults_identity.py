"""Another volume behind the same name (issue #56 item 1): a target that answers, after a
reconnect or a notice, with a namespace or a controller that is not the one the host
mounted (tests/hostile/test_identity.py runs them).

Each fault is a good target until the test calls :meth:`Swap.swap` on the target's loop:
then its namespace's data and what Identify says of it change at once, and the connections
are cut (``cut``), so that the host reconnects to what is there now.  ``down`` refuses
every Connect meanwhile (Connect Invalid Parameters, as nvmet while the subsystem is off
its port), so that the host's I/O waits for the reconnect.
"""

from __future__ import annotations

import contextlib
import struct

from hostile_target import Fault, HostileTarget, fault, status_field
from tcp_target import FABRICS

NGUID_A = bytes(range(0x10, 0x20))
NGUID_B = bytes(range(0xB0, 0xC0))
SC_CONNECT_INVALID_PARAMETERS = 0x82


class Swap(Fault):
    """A good target whose namespace becomes another one at :meth:`swap`."""

    def __init__(self) -> None:
        super().__init__()
        self.swapped = False
        self.down = False  # refuse every Connect (the host keeps reconnecting)

    def swap(self, target: HostileTarget, data: bytes) -> None:
        """The namespace is another from now on: ``data`` is its content (on the target's
        loop, between two commands)."""
        target.data[:len(data)] = data
        self.swapped = True
        self.fired += 1

    def status(self, target, qid, sqe):
        if self.down and sqe is not None and sqe[0] == FABRICS and sqe[4] == 0x01:
            return status_field(1, SC_CONNECT_INVALID_PARAMETERS, dnr=True)
        return 0

    def identify(self, target, cns, nsid, page):
        if cns == 0 and nsid == 1:
            self.namespace(page)
        elif cns == 1:
            self.controller(page)

    def namespace(self, page: bytearray) -> None:
        """Edit Identify Namespace of n1 (before and after the swap)."""

    def controller(self, page: bytearray) -> None:
        """Edit Identify Controller (before and after the swap)."""


async def cut(target: HostileTarget) -> None:
    """Close every connection of ``target`` (the host notices and reconnects)."""
    for stream in list(target.streams):
        with contextlib.suppress(Exception):
            await stream.aclose()


@fault("nguid swap", "after a reconnect another namespace (another NGUID, the same size) "
       "answers behind n1")
class NguidSwap(Swap):
    def namespace(self, page):
        page[104:120] = NGUID_B if self.swapped else NGUID_A


@fault("serial swap", "after a reconnect the controller reports another serial number (and "
       "another namespace behind n1)")
class SerialSwap(Swap):
    def namespace(self, page):
        page[104:120] = NGUID_B if self.swapped else NGUID_A

    def controller(self, page):
        page[4:24] = (b"SERIAL-B" if self.swapped else b"SERIAL-A").ljust(20, b" ")


@fault("subsystem swap", "after a reconnect the controller reports another subsystem NQN")
class SubsystemSwap(Swap):
    def controller(self, page):
        if self.swapped:
            nqn = b"nqn.2026-11.io.example:another"
            page[768:1024] = nqn.ljust(256, b"\0")


@fault("size swap without identifiers", "n1 reports no identifiers, and after a reconnect "
       "it is another namespace of half the size")
class SizeSwapWithoutIds(Swap):
    def namespace(self, page):
        if self.swapped:
            nlb = struct.unpack_from("<Q", page, 0)[0] // 2
            struct.pack_into("<QQQ", page, 0, nlb, nlb, nlb)


@fault("identify of another nsid", "two active namespaces, and Identify Namespace of n2 "
       "answers with n1's data (its NGUID)")
class IdentifyOfAnotherNsid(Fault):
    def identify(self, target, cns, nsid, page):
        if cns == 2:
            struct.pack_into("<II", page, 0, 1, 2)
        elif cns == 0 and nsid in (1, 2):
            nlb = len(target.data) // 512
            struct.pack_into("<QQQ", page, 0, nlb, nlb, nlb)
            page[130] = 9
            page[104:120] = NGUID_A  # n2's answer is n1's


@fault("nguid swap by notice", "n1 becomes another namespace (another NGUID) on a live "
       "connection, and a Namespace Attribute Changed notice says n1 changed")
class NguidSwapByNotice(NguidSwap):
    """The swap completes the held Asynchronous Event Request with a namespace attribute
    notice; the changed namespace list names n1."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list = []  # (stream, cid) of the AERs held

    def identify(self, target, cns, nsid, page):
        super().identify(target, cns, nsid, page)
        if cns == 1:
            struct.pack_into("<I", page, 92, 1 << 8)  # OAES: namespace attribute notices

    async def async_event(self, target, stream, cid):
        self.held.append((stream, cid))

    async def notify(self, target: HostileTarget) -> None:
        """Complete the held AER: a notice (type 2h, info 0h, log page 04h)."""
        stream, cid = self.held.pop()  # (its send waits for the connection's own task's)
        await target.complete(stream, cid, 0x2 | 0x00 << 8 | 0x04 << 16)

    def log_page(self, target, lid, offset, length, page):
        if lid == 0x04 and self.swapped:
            page = struct.pack("<I", 1).ljust(len(page), b"\0")
        return super().log_page(target, lid, offset, length, page)

