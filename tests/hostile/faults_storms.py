"""Storms and changing logs (issue #56 items 4 and 5): a target that flips ANA states, sends
notice after notice, fails every keep-alive, changes its discovery log while it is read in
pieces, or names in its changed namespace list a namespace that went away."""

from __future__ import annotations

import struct

from hostile_target import (
    LID_ANA,
    LID_CHANGED_NS,
    LID_DISCOVERY,
    NQN,
    Fault,
    fault,
    status_field,
)
from tcp_target import ADMIN_IDENTIFY, ADMIN_KEEP_ALIVE, LBA

from nvmeof_fuse.nvme.ana import AnaLogPage, AnaState

NOTICE, SMART = 0x2, 0x1  # asynchronous event types
ANA_CYCLE = (AnaState.OPTIMIZED, AnaState.NON_OPTIMIZED, AnaState.INACCESSIBLE)
SC_INTERNAL, SC_INVALID_NAMESPACE = 0x06, 0x0B  # generic statuses


def event(kind: int, info: int, lid: int) -> int:
    """An AER completion's Dword 0."""
    return lid << 16 | info << 8 | kind


@fault("ana flip storm", "every Asynchronous Event Request completes at once with an ANA "
       "change notice, and each ANA log read finds the group in the next state of optimized, "
       "non-optimized, inaccessible")
class AnaFlipStorm(Fault):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def setup(self, target):
        target.ana = True

    async def async_event(self, target, stream, cid):
        self.fired += 1
        await target.complete(stream, cid, event(NOTICE, 0x03, LID_ANA))

    def log_page(self, target, lid, offset, length, page):
        if lid == LID_ANA:
            self.reads += 1
            state = ANA_CYCLE[self.reads % len(ANA_CYCLE)]
            page = AnaLogPage.of({1: (state, (1,))}, chgcnt=self.reads).to_bytes()
        return super().log_page(target, lid, offset, length, page)


@fault("smart notice storm", "every Asynchronous Event Request completes at once with a "
       "SMART / health notice")
class SmartNoticeStorm(Fault):
    async def async_event(self, target, stream, cid):
        self.fired += 1
        await target.complete(stream, cid, event(SMART, 0x01, 0x02))


@fault("keep-alive fails", "every Keep Alive is answered with Internal Error while "
       "``failing`` (the connection itself holds)")
class KeepAliveFails(Fault):
    failing = True

    def status(self, target, qid, sqe):
        if qid == 0 and sqe is not None and sqe[0] == ADMIN_KEEP_ALIVE and self.failing:
            self.fired += 1
            return status_field(0, SC_INTERNAL)
        return 0


def generation_page(port: int, generation: int, records: int) -> bytes:
    """A discovery log page of ``generation``: GENCTR ``generation`` and ``records``
    entries, each naming NQN with ``:gen<generation>:<i>`` after it."""
    head = struct.pack("<QQH", generation, records, 0).ljust(1024, b"\0")
    entries = []
    for i in range(records):
        entry = bytearray(1024)
        struct.pack_into("<BBBBHHHH", entry, 0, 3, 1, 2, 2, 1, 0xFFFF, 128, 0)
        entry[32:32 + len(str(port))] = str(port).encode()
        nqn = f"{NQN}:gen{generation}:{i}".encode()
        entry[256:256 + len(nqn)] = nqn
        entry[512:521] = b"127.0.0.1"
        entries.append(bytes(entry))
    return head + b"".join(entries)


@fault("discovery log torn", "the discovery log (about 64 records, past MDTS) gains a "
       "generation, one record more or less and new names, after each piece read past its "
       "start, ``changes`` times (None: for ever)")
class DiscoveryLogTorn(Fault):
    changes: int | None = 5

    def __init__(self) -> None:
        super().__init__()
        self.generation = 1
        self.pieces: list[tuple[int, int, int]] = []  # (generation, offset, length) served

    def records(self) -> int:
        return 64 + self.generation % 2

    def log_page(self, target, lid, offset, length, page):
        if lid != LID_DISCOVERY:
            return super().log_page(target, lid, offset, length, page)
        page = generation_page(target.port, self.generation, self.records())
        self.pieces.append((self.generation, offset, length))
        if offset > 0 and (self.changes is None or self.fired < self.changes):
            self.fired += 1
            self.generation += 1
        return page[offset:offset + length].ljust(length, b"\0")


@fault("discovery log never still", "the discovery log changes after each piece read past "
       "its start, for ever")
class DiscoveryLogNeverStill(DiscoveryLogTorn):
    changes = None


@fault("changed namespace gone", "n1 and n2; once ``armed``, the Asynchronous Event Request "
       "held says namespaces changed, and the changed namespace list names n2, which goes "
       "away as the list is read: the active list still names it once, then Identify "
       "Namespace says Invalid Namespace")
class ChangedNamespaceGone(Fault):
    times = 1

    def __init__(self) -> None:
        super().__init__()
        self.armed = False  # set by the test (from its thread) once n2 is seen
        self.held: tuple | None = None  # the (stream, command ID) of the AER held
        self.gone = False
        self.stale_lists = 1  # active lists that still name n2 after it went

    def setup(self, target):
        respond = target._respond

        async def notice_first(stream, cid, result):
            """Once armed, the next answer on the admin queue (a keep-alive's) comes after
            the held AER's completion: sent by the connection's own task, as every PDU."""
            held = self.held
            if held is not None and held[0] is stream and self.armed and self.fire():
                self.held = None
                await respond(stream, held[1], event(NOTICE, 0x00, LID_CHANGED_NS))
            await respond(stream, cid, result)

        target._respond = notice_first

    async def async_event(self, target, stream, cid):
        self.held = (stream, cid)

    def log_page(self, target, lid, offset, length, page):
        if lid == LID_CHANGED_NS:
            page = struct.pack("<I", 2).ljust(4096, b"\0")
            self.gone = True
        return super().log_page(target, lid, offset, length, page)

    def identify(self, target, cns, nsid, page):
        if cns == 2:
            listed = [1, 2] if not self.gone or self.stale_lists > 0 else [1]
            if self.gone:
                self.stale_lists -= 1
            page[:] = struct.pack(f"<{len(listed)}I", *listed).ljust(4096, b"\0")
        elif cns == 0 and nsid == 2 and not self.gone:
            nlb = len(target.data) // LBA
            struct.pack_into("<QQQ", page, 0, nlb, nlb, nlb)
            page[130] = 9

    def status(self, target, qid, sqe):
        if (qid == 0 and sqe is not None and sqe[0] == ADMIN_IDENTIFY and sqe[40] == 0
                and struct.unpack_from("<I", sqe, 4)[0] == 2 and self.gone):
            return status_field(0, SC_INVALID_NAMESPACE)
        return 0
