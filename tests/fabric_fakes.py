"""A target and a transport in memory that can go away with commands in flight.

:class:`FakeTarget` holds one namespace's LBAs and answers reads, writes and anything else
(success) on every queue connected to it, while it is ``up``.  When it goes away
(:meth:`FakeTarget.go_away`) the commands in flight get no answer, as from an nvmet whose
subsystem left the port; :meth:`FakeTarget.fail_queues` then fails them the way a transport
notices a lost connection (a failed work request): tasks wake with the error, callbacks are
told, at once.  Connecting fails while it is away.  :class:`FakeTransport` is one
controller's (or one companion client's) side of it, with the :class:`Transport` calls the
host core makes.
"""

from __future__ import annotations

import copy
import ctypes
import itertools

import trio

from nvmeof_fuse.errors import CommandTimeout, ConnectError, TransportError
from nvmeof_fuse.nvme import Completion
from nvmeof_fuse.nvme.ana import AnaLogPage, AnaState
from nvmeof_fuse.nvme.identify import NamespaceIds

OPC_WRITE, OPC_READ = 0x01, 0x02
OPC_GET_LOG_PAGE, OPC_IDENTIFY, CNS_NS_DESCRIPTORS, LID_ANA = 0x02, 0x06, 0x03, 0x0C
CNS_NAMESPACE, CNS_CONTROLLER, CNS_ACTIVE_LIST = 0x00, 0x01, 0x02


class FakeRegistration:
    lkey = rkey = 1

    def keys(self, domain: object) -> FakeRegistration:
        return self

    def close(self) -> None:
        pass


class Request:
    """A command in flight on a :class:`FakeQueue`."""

    def __init__(self, cid: int, sqe: bytearray, data, done=None) -> None:
        self.cid = cid
        self.sqe = bytes(sqe)
        self.data = data
        self.done = done  # a callback (start), or None for a waiting task (execute)
        self.completion: Completion | None = None
        self.error: Exception | None = None
        self.finished = trio.Event()


class FakeQueue:
    """One queue: commands go to the target, which answers them on its own task."""

    connect_cattr = 0

    def __init__(self, target: FakeTarget, transport: FakeTransport, qid: int,
                 size: int) -> None:
        self.target = target
        self.transport = transport
        self.qid = qid
        self.size = size
        self.pending: dict[int, Request] = {}
        self.failed: Exception | None = None
        self._cids = itertools.count()
        self._send, self._receive = trio.open_memory_channel[Request](size)
        self.waits: dict[int, trio.CancelScope] = {}  # command ID -> its caller's wait

    @property
    def available(self) -> int:
        return self.size - 1 - len(self.pending)

    async def execute(self, sqe: bytearray, data=None, *, to_controller: bool = False,
                      timeout: float) -> Completion:
        if self.failed is not None:
            raise copy.copy(self.failed)
        request = self._post(sqe, data)
        with trio.CancelScope(shield=True):  # a command is waited for, not cancelled
            with trio.move_on_after(timeout) as self.waits[request.cid]:
                await request.finished.wait()
        del self.waits[request.cid]
        if not request.finished.is_set():
            self.fail(TransportError(f"{self.name}: closed as a command timed out"))
            raise CommandTimeout(f"{self.name}: command {request.cid} got no completion "
                                 f"within {timeout:g} s")
        if request.error is not None:
            raise copy.copy(request.error)
        assert request.completion is not None
        return request.completion

    def start(self, sqe: bytearray, data, done, *, to_controller: bool = False,
              timeout: float) -> bool:
        if self.failed is not None or not self.available:
            return False
        self._post(sqe, data, done)
        return True

    def cut_timeouts(self, deadline: float) -> None:
        for scope in self.waits.values():
            scope.deadline = min(scope.deadline, deadline)

    @property
    def name(self) -> str:
        return f"I/O queue {self.qid}" if self.qid else "admin queue"

    def _post(self, sqe: bytearray, data, done=None) -> Request:
        request = Request(next(self._cids), sqe, data, done)
        self.pending[request.cid] = request
        self._send.send_nowait(request)
        return request

    def _finish(self, request: Request) -> None:
        if self.pending.pop(request.cid, None) is None:
            return  # failed meanwhile
        request.finished.set()
        if request.done is not None:
            request.done(request)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The target's side: answer each command, unless it is away (then never)."""
        task_status.started()
        async for request in self._receive:
            await trio.sleep(0.001)  # the target takes a moment
            if not self.target.up or self.failed is not None:
                continue  # lost with the connection: its caller hears from fail()
            request.completion = self.target.run(request.sqe, request.data, admin=not self.qid)
            self._finish(request)

    def fail(self, error: Exception) -> None:
        """The connection is lost: every command in flight fails with ``error`` at once."""
        if self.failed is None:
            self.failed = error
        pending, self.pending = list(self.pending.values()), {}
        for request in pending:
            request.error = error
            request.finished.set()
            if request.done is not None:
                request.done(request)

    def close(self) -> None:
        self.fail(TransportError(f"{self.name} is closed"))
        self._send.close()


class FakeTarget:
    """One namespace of ``nlb`` LBAs of ``lba_size`` bytes; answers while ``up``."""

    def __init__(self, lba_size: int = 512, nlb: int = 4096) -> None:
        self.lba_size = lba_size
        self.nlb = nlb
        self.disk = bytearray(lba_size * nlb)
        self.up = True
        self.transports: list[FakeTransport] = []
        self.statuses: list[int] = []  # error statuses for the next I/O commands, in turn
        # as one port of a multipath subsystem: its ANA state (of group 1, holding NSID 1)
        # and namespace identifiers, answered to Get Log Page 0Ch and Identify CNS 03h
        self.ana_state = AnaState.OPTIMIZED
        self.ana_chgcnt = 1
        self.ns_ids = NamespaceIds(nguid=bytes(range(16)))
        self.controller_page = bytes(4096)  # Identify Controller (a test sets its own)
        self.io_count = 0

    def set_ana(self, state: AnaState) -> None:
        self.ana_state = state
        self.ana_chgcnt += 1

    def _admin(self, sqe: bytes, data) -> Completion:
        opcode, cdw10 = sqe[0], int.from_bytes(sqe[40:44], "little")
        payload = b""
        nsid = int.from_bytes(sqe[4:8], "little")
        if opcode == OPC_IDENTIFY and cdw10 & 0xFF == CNS_NS_DESCRIPTORS:
            payload = self.ns_ids.to_descriptors()
        elif opcode == OPC_IDENTIFY and cdw10 & 0xFF == CNS_NAMESPACE and nsid == 1:
            payload = self.namespace_page()
        elif opcode == OPC_IDENTIFY and cdw10 & 0xFF == CNS_CONTROLLER:
            payload = self.controller_page
        elif opcode == OPC_IDENTIFY and cdw10 & 0xFF == CNS_ACTIVE_LIST:
            payload = (1).to_bytes(4, "little")
        elif opcode == OPC_GET_LOG_PAGE and cdw10 & 0xFF == LID_ANA:
            page = AnaLogPage.of({1: (self.ana_state, (1,))}, chgcnt=self.ana_chgcnt)
            payload = page.to_bytes()
        if payload and data is not None:
            n = min(len(payload), data.length)
            ctypes.memmove(data.region.addr + data.offset, payload, n)
        return Completion(0, 0, 0, 0, 0, True)

    def namespace_page(self) -> bytes:
        """Identify Namespace of NSID 1: its LBAs, in ANA group 1."""
        page = bytearray(4096)
        page[0:16] = self.nlb.to_bytes(8, "little") * 2  # NSZE, NCAP
        page[92:96] = (1).to_bytes(4, "little")  # ANAGRPID
        page[130] = self.lba_size.bit_length() - 1  # LBA format 0's LBADS
        return bytes(page)

    def run(self, sqe: bytes, data, admin: bool = False) -> Completion:
        """Run a command: reads, writes and some admin commands as the target would
        (others just succeed); its completion."""
        if admin:
            return self._admin(sqe, data)
        opcode = sqe[0]
        if opcode in (OPC_READ, OPC_WRITE) and self.statuses:
            return Completion(0, 0, 1, 0, self.statuses.pop(0), True)
        if opcode in (OPC_READ, OPC_WRITE) and not self.ana_state.usable:
            sc = {AnaState.PERSISTENT_LOSS: 0x01, AnaState.INACCESSIBLE: 0x02}.get(
                self.ana_state, 0x03)  # nvmet_check_ana_state, no DNR
            return Completion(0, 0, 1, 0, 0x300 | sc, True)
        self.io_count += 1
        if opcode in (OPC_READ, OPC_WRITE):
            slba = int.from_bytes(sqe[40:48], "little")
            nlb = int.from_bytes(sqe[48:50], "little") + 1
            at, length = slba * self.lba_size, nlb * self.lba_size
            assert data is not None and data.length == length
            if opcode == OPC_READ:
                ctypes.memmove(data.region.addr + data.offset,
                               (ctypes.c_char * length).from_buffer(self.disk, at), length)
            else:
                self.disk[at:at + length] = ctypes.string_at(data.region.addr + data.offset,
                                                             length)
        return Completion(0, 0, 1, 0, 0, True)

    def go_away(self) -> None:
        """Stop answering (commands in flight stay unanswered) and refuse connects."""
        self.up = False

    def fail_queues(self) -> None:
        """Every connected queue notices the loss (a failed work request)."""
        for transport in self.transports:
            for queue in transport.queues:
                queue.fail(TransportError(f"{queue.name}: work request failed: "
                                          "retry counter exceeded"))

    def come_back(self) -> None:
        self.up = True


class FakeTransport:
    """One controller's (or companion client's) queues to a :class:`FakeTarget`."""

    name = "rdma"
    address = "rdma 192.0.2.1:4420"
    places_in_other_processes = True  # as RDMA: companion clients lease queues of their own

    def __init__(self, target: FakeTarget) -> None:
        self.target = target
        self.queues: list[FakeQueue] = []
        self.drops = 0
        target.transports.append(self)

    def register(self, addr: int, length: int, owner: object) -> FakeRegistration:
        return FakeRegistration()

    async def connect_queue(self, nursery: trio.Nursery, qid: int, size: int,
                            in_capsule_bytes: int = 0, cntlid: int = 0) -> FakeQueue:
        await trio.sleep(0.001)
        if not self.target.up:
            raise ConnectError(f"NVMe/RDMA queue {qid} connect to 192.0.2.1:4420 refused")
        queue = FakeQueue(self.target, self, qid, size)
        self.queues.append(queue)
        await nursery.start(queue.serve)
        return queue

    async def drop_queues(self) -> None:
        queues, self.queues = self.queues, []
        for queue in queues:
            queue.close()
        self.drops += 1
        await trio.sleep(0.001)

    def close(self) -> None:
        for queue in self.queues:
            queue.close()
        self.queues = []
