"""A hostile NVMe/TCP target for host tests: ``tcp_target.FakeTcpTarget`` that answers
correctly except for one selectable fault.

A fault is a :class:`Fault` subclass registered by name with :func:`fault`; each hook it
overrides is one place where the target lies (Identify data, a log page, a completion's
status, a read's C2HData, a write's R2T, the ICResp, a command it swallows).  The hooks
it leaves alone answer as a good target does, so one fault is tested at a time::

    @fault("crd of hours", "every I/O fails once with CRD 1 while CRDT1 is 0xFFFF")
    class CrdOfHours(Fault):
        def identify(self, target, cns, nsid, page): ...
        def status(self, target, sqe): ...

Each developer's faults live in a module of their own, ``tests/hostile/faults_*.py``
(:func:`load_faults` imports them all).  ``HostileTarget(fault="crd of hours")`` serves
one; ``python tests/hostile_target.py NAME`` serves it until killed and prints the port
(``--list`` names every fault).  A fault fires
on every chance unless it sets ``times`` (then only that many times, e.g. once, to check
that the host recovers); ``fired`` counts the times it did.
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio
from tcp_target import ADMIN_IDENTIFY, ADMIN_KEEP_ALIVE, NQN, READ, WRITE, FakeTcpTarget

from nvmeof_fuse.nvme import DISCOVERY_NQN, LogPageId
from nvmeof_fuse.nvme.ana import CMIC_ANA, AnaLogPage, AnaState

LID_ANA, LID_CHANGED_NS, LID_DISCOVERY = (LogPageId.ANA, LogPageId.CHANGED_NS_LIST,
                                          LogPageId.DISCOVERY)
Send = Callable[..., Awaitable[None]]


class Fault:
    """A good target's answers; a subclass overrides the hooks where it lies.

    ``times``: how many times the fault fires (None: every time); :meth:`fire` says
    whether it fires now and counts it.
    """

    name = "none"
    description = "a good target"
    times: int | None = None

    def __init__(self) -> None:
        self.fired = 0

    def fire(self) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        self.fired += 1
        return True

    def icresp(self, target: HostileTarget, icresp: bytearray) -> None:
        """Edit the 128-byte ICResp in place."""

    def identify(self, target: HostileTarget, cns: int, nsid: int, page: bytearray) -> None:
        """Edit a 4 KiB Identify page (CNS ``cns``, NSID ``nsid``) in place."""

    def answer(self, target: HostileTarget, sqe: bytes, result: int, payload: bytes
               ) -> tuple[int, bytes]:
        """Any admin or fabrics command's answer (a completion's result, its data), after
        :meth:`identify` and :meth:`log_page` had their say: e.g. a Property Get of CAP."""
        return result, payload

    def log_page(self, target: HostileTarget, lid: int, offset: int, length: int,
                 page: bytes) -> bytes:
        """The bytes sent for Get Log Page ``lid``; ``page`` is the whole good page."""
        return page[offset:offset + length].ljust(length, b"\0")

    def swallow(self, target: HostileTarget, qid: int | None, sqe: bytes) -> bool:
        """True: never answer command ``sqe`` on queue ``qid`` (None: before Connect)."""
        return False

    def setup(self, target: HostileTarget) -> None:
        """Set the target up for this fault (e.g. ``target.ana = True``)."""

    def status(self, target: HostileTarget, qid: int | None, sqe: bytes | None) -> int:
        """The CapsuleResp's 16-bit status field for ``sqe`` on queue ``qid``, as on the
        wire (:func:`status_field`; 0: success)."""
        return 0

    async def async_event(self, target: HostileTarget, stream, cid: int) -> None:
        """An Asynchronous Event Request came: a good target holds it (returns) until an
        event happens; ``target.complete(stream, cid, dw0)`` completes it."""

    async def read_data(self, target: HostileTarget, stream, cid: int, payload: bytes,
                        send: Send, success: bool) -> None:
        """Send a command's data (C2HData); ``send(payload, **kw)`` sends it as a good
        target does (``kw``: FakeTcpTarget._send_read's).  ``success``: the last C2HData
        ends the command (SUCCESS flag), no CapsuleResp follows; else one follows, with
        :meth:`status`."""
        await send(payload)

    async def r2t(self, target: HostileTarget, stream, cid: int, length: int,
                  send: Send) -> None:
        """Ask for a write's data; ``send(length)`` sends the good R2T (``send(n, offset=o)``
        another: a target may ask for a write's data in several R2Ts, each after the data
        of the one before came)."""
        await send(length)


FAULTS: dict[str, type[Fault]] = {"none": Fault}
"""Every fault by name: what ``HostileTarget(fault=NAME)`` and the tests pick from."""


def status_field(sct: int, sc: int, *, crd: int = 0, dnr: bool = False) -> int:
    """A completion's status field as on the wire: phase 0, SC 8:1, SCT 11:9, CRD 13:12,
    DNR 15."""
    return sc << 1 | sct << 9 | crd << 12 | int(dnr) << 15


def fault(name: str, description: str):
    """Register a :class:`Fault` subclass under ``name``."""
    def register(cls: type[Fault]) -> type[Fault]:
        if name in FAULTS:
            raise ValueError(f"fault {name!r} is registered twice")
        cls.name, cls.description = name, description
        FAULTS[name] = cls
        return cls
    return register


class HostileTarget(FakeTcpTarget):
    """FakeTcpTarget with one :class:`Fault` (by name or instance), ANA reporting when
    ``ana`` (one group, optimized, holding namespace 1), and the discovery log page when
    the host connects to the discovery NQN."""

    def __init__(self, fault: str | Fault = "none", *, ana: bool = False,
                 discovery: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.hostile = FAULTS[fault]() if isinstance(fault, str) else fault
        self.ana = ana
        self.discovery = discovery  # a discovery controller (CNTRLTYPE 2)
        self.keep_alives = 0
        self.log_pages: list[tuple[int, int, int]] = []  # (lid, offset, length) asked
        self.hostile.setup(self)

    # -- what a good target says, handed to the fault -----------------------------------------

    def _icresp(self, icreq: bytes) -> bytes:
        icresp = bytearray(super()._icresp(icreq))
        self.hostile.icresp(self, icresp)
        return bytes(icresp)

    def _admin(self, sqe: bytes) -> tuple[int, bytes] | None:
        answer = super()._admin(sqe)
        if answer is None:
            return None
        result, payload = answer
        if sqe[0] == ADMIN_IDENTIFY:
            cns, nsid = sqe[40], struct.unpack_from("<I", sqe, 4)[0]
            page = bytearray(payload)
            self._good_identify(cns, nsid, page)
            self.hostile.identify(self, cns, nsid, page)
            payload = bytes(page)
        elif sqe[0] == ADMIN_KEEP_ALIVE:
            self.keep_alives += 1
        return self.hostile.answer(self, sqe, result, payload)

    def _swallow(self, qid: int | None, sqe: bytes) -> bool:
        return super()._swallow(qid, sqe) or self.hostile.swallow(self, qid, sqe)

    def _good_identify(self, cns: int, nsid: int, page: bytearray) -> None:
        if cns == 1 and self.discovery:
            page[111] = 2
            page[768:1024] = DISCOVERY_NQN.encode().ljust(256, b"\0")
        if cns == 1 and self.ana:
            page[76] |= CMIC_ANA
            page[343] = 1 << 0 | 1 << 6  # ANACAP: reports optimized; ANAGRPID static
            struct.pack_into("<II", page, 344, 1, 1)  # ANAGRPMAX, NANAGRPID
            struct.pack_into("<I", page, 540, 1)  # MNAN
            page[342] = 10  # ANATT, s
        elif cns == 0 and nsid == 1 and self.ana:
            struct.pack_into("<I", page, 92, 1)  # ANAGRPID

    def _log_page(self, lid: int, offset: int, length: int) -> bytes:
        self.log_pages.append((lid, offset, length))
        return self.hostile.log_page(self, lid, offset, length, self.good_log_page(lid))

    def good_log_page(self, lid: int) -> bytes:
        """The whole log page ``lid`` as a good target has it."""
        if lid == LID_ANA:
            return AnaLogPage.of({1: (AnaState.OPTIMIZED, (1,))}).to_bytes()
        if lid == LID_DISCOVERY:
            return discovery_page(self.port)
        return bytes(4096)

    async def _respond(self, stream, cid: int, result: int) -> None:
        qid, sqe = self.sqe_of.get((stream, cid), (None, None))
        status = self.hostile.status(self, qid, sqe)
        await stream.send_all(self._response(cid, result, status))

    async def _async_event(self, stream, cid: int) -> None:
        await self.hostile.async_event(self, stream, cid)

    async def complete(self, stream, cid: int, result: int = 0) -> None:
        """Send a CapsuleResp for ``cid`` (its status from the fault)."""
        await self._respond(stream, cid, result)

    async def _send_read(self, stream, cid: int, payload: bytes, faults: bool = True,
                         success: bool = False) -> None:
        async def send(data: bytes = payload, **kw) -> None:
            await FakeTcpTarget._send_read(self, stream, cid, data, **{
                "faults": faults, "success": success, **kw})
        await self.hostile.read_data(self, stream, cid, payload, send, success)

    async def _r2t(self, stream, cid: int, length: int, offset: int = 0) -> None:
        async def send(size: int = length, **kw) -> None:
            await FakeTcpTarget._r2t(self, stream, cid, size, **{"offset": offset, **kw})
        await self.hostile.r2t(self, stream, cid, length, send)


def discovery_page(port: int, records: int = 1) -> bytes:
    """A discovery log page with ``records`` entries naming NQN on 127.0.0.1:``port``."""
    head = struct.pack("<QQH", 1, records, 0).ljust(1024, b"\0")
    entry = bytearray(1024)
    struct.pack_into("<BBBBHHHH", entry, 0, 3, 1, 2, 2, 1, 0xFFFF, 128, 0)
    entry[32:32 + len(str(port))] = str(port).encode()
    entry[256:256 + len(NQN)] = NQN.encode()
    entry[512:521] = b"127.0.0.1"
    return head + bytes(entry) * records


def is_io(qid: int | None, sqe: bytes | None, *opcodes: int) -> bool:
    """Whether ``sqe`` on queue ``qid`` is an I/O Read or Write (or one of ``opcodes``)."""
    return bool(qid) and sqe is not None and sqe[0] in (opcodes or (READ, WRITE))


def load_faults() -> dict[str, type[Fault]]:
    """Register the faults of every ``tests/hostile/faults_*.py`` (each developer's fault
    classes live in a module of their own there); FAULTS."""
    for path in sorted((Path(__file__).parent / "hostile").glob("faults_*.py")):
        name = f"hostile_{path.stem}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    return FAULTS


async def _serve_forever(target: HostileTarget) -> None:
    async with trio.open_nursery() as nursery:
        print(await nursery.start(target.serve), flush=True)


if __name__ == "__main__":  # python tests/hostile_target.py NAME [MIB]: serve until killed
    sys.modules.setdefault("hostile_target", sys.modules[__name__])  # one FAULTS for all
    load_faults()
    if sys.argv[1:] == ["--list"]:
        for name, cls in FAULTS.items():
            print(f"{name}: {cls.description}")
        sys.exit(0)
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    trio.run(_serve_forever, HostileTarget(sys.argv[1], size=mib << 20))
