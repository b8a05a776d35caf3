"""Faults of scale (issue #56 item 6): a target with many active namespaces."""

from __future__ import annotations

import struct

import trio
from hostile_target import LID_CHANGED_NS, Fault, fault, is_io
from tcp_target import FLUSH

from nvmeof_fuse.nvme import ACTIVE_NS_PER_PAGE


class ManyNamespaces(Fault):
    """``count`` active namespaces, n1 the target's data and every other one 4 KiB; the
    active namespace list in pages of 1024, as a controller with that many has it.

    It records the NSID of each Flush (``flushes``) and the highest NSID identified
    (``identified``); a Flush of ``hold_nsid`` is answered ``hold_s`` seconds late, and
    ``keep_alives_held`` says how many keep-alives the target answered meanwhile.
    :meth:`grow` adds namespaces and sends the notice that says so."""

    count = 1

    def __init__(self, *, hold_nsid: int = 0, hold_s: float = 0.0) -> None:
        super().__init__()
        self.hold_nsid, self.hold_s = hold_nsid, hold_s
        self.flushes: list[int] = []
        self.identified = 0
        self.keep_alives_held: int | None = None
        self.changed = trio.Event()  # set (on the target's loop) by grow()
        self.added: list[int] = []

    def grow(self, count: int) -> None:
        """On the target's loop: ``count`` namespaces now, the new ones noticed."""
        self.added = list(range(self.count + 1, count + 1))
        self.count = count
        self.changed.set()

    async def async_event(self, target, stream, cid):
        trio.lowlevel.spawn_system_task(self._notice, target, stream, cid)  # held meanwhile

    async def _notice(self, target, stream, cid: int) -> None:
        await self.changed.wait()
        self.changed = trio.Event()
        try:
            await target.complete(stream, cid, 0x04 << 16 | 0x00 << 8 | 0x2)  # NS attribute
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def log_page(self, target, lid, offset, length, page):
        if lid == LID_CHANGED_NS:
            page = struct.pack(f"<{len(self.added)}I", *self.added).ljust(4096, b"\0")
        return super().log_page(target, lid, offset, length, page)

    def identify(self, target, cns, nsid, page):
        if cns == 2:  # the active NSIDs above ``nsid``, at most a page of them
            first = nsid + 1
            listed = range(first, min(first + ACTIVE_NS_PER_PAGE, self.count + 1))
            page[:] = bytes(4096)
            struct.pack_into(f"<{len(listed)}I", page, 0, *listed)
        elif cns == 0 and 1 <= nsid <= self.count:
            self.identified = max(self.identified, nsid)
            if nsid > 1:
                struct.pack_into("<QQQ", page, 0, 8, 8, 8)
                page[130] = 9

    def swallow(self, target, qid, sqe):
        if not is_io(qid, sqe, FLUSH):
            return False
        nsid = struct.unpack_from("<I", sqe, 4)[0]
        self.flushes.append(nsid)
        if nsid != self.hold_nsid:
            return False
        stream = next(s for (s, _), (_, held) in target.sqe_of.items() if held is sqe)
        cid = struct.unpack_from("<H", sqe, 2)[0]
        trio.lowlevel.spawn_system_task(self._answer_late, target, stream, cid)
        return True

    async def _answer_late(self, target, stream, cid: int) -> None:
        keep_alives = target.keep_alives
        await trio.sleep(self.hold_s)
        self.keep_alives_held = target.keep_alives - keep_alives
        try:
            await target.complete(stream, cid)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the host went away meanwhile: the test says so


@fault("namespaces 100", "100 active namespaces")
class Namespaces100(ManyNamespaces):
    count = 100


@fault("namespaces 1024", "1024 active namespaces (one page of the list)")
class Namespaces1024(ManyNamespaces):
    count = 1024


@fault("namespaces 65536", "65536 active namespaces (64 pages of the list)")
class Namespaces65536(ManyNamespaces):
    count = 65536
