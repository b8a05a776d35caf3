"""A small NVMe/TCP target on 127.0.0.1 for host tests: Read/Write over shared memory.

It speaks real PDUs (ICResp, CapsuleCmd, C2HData, R2T/H2CData, CapsuleResp,
digests when asked) and can be told to break the protocol on the next read in
one of several ways (``fault``: FAULTS, and "stall"/"cut", which send half a
C2HData payload and then nothing more, or close; "late", which holds the next
read's data or write's R2T until ``release`` is set; "twice", which answers the next
read with two CapsuleResps), so the host transport's error
paths can be checked without a kernel.

Like nvmet it has one controller at a time, whose controller ID changes with each admin
Connect: an I/O queue's Connect must name the live one (a companion client's leased
queues carry the mount's), and a QID connects once (nvmet answers Command Sequence Error).

:meth:`FakeTcpTarget.serve` serves every connection on the caller's trio loop, where a test
may inspect the target's state and inject faults.  :meth:`FakeTcpTarget.serve_forked` serves
each connection from a process of its own (the namespace and the controller's state in
shared memory), so that a bench measures the host's side, not the target's one core.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import signal
import socket
import struct
import threading

import trio

from nvmeof_fuse.nvme import tcp_pdu as pdu

READ, WRITE, FLUSH = 0x02, 0x01, 0x00
ADMIN_IDENTIFY, ADMIN_SET_FEATURES, ADMIN_KEEP_ALIVE, FABRICS = 0x06, 0x09, 0x18, 0x7F
ADMIN_ASYNC_EVENT, ADMIN_GET_LOG_PAGE = 0x0C, 0x02
LBA = 512
NQN = "nqn.2026-11.io.nvmeof-fuse:fake-tcp"
SC_CONNECT_INVALID = 1 << 9 | 0x82 << 1  # status: Connect Invalid Parameters (SCT 1)
SC_SEQUENCE_ERROR = 0x0C << 1  # status: Command Sequence Error (the QID is connected)
STATE = struct.Struct("<HBB")  # the controller: its ID, live, whether any admin Connect came
MAX_QID = 1024
FAULTS = ("header digest", "data digest", "length", "unknown type", "unknown command",
          "term req", "close", "offset")


class FakeTcpTarget:
    def __init__(self, *, size: int = 1 << 20, maxh2cdata: int = 8192, cpda: int = 0,
                 success_flag: bool = False, c2h_pieces: int = 1, pad: int = 0,
                 mdts: int = 3, io_queues: int = 2, r2t_bytes: int = 0) -> None:
        # shared with the processes of serve_forked (an anonymous mapping is MAP_SHARED)
        self.data = mmap.mmap(-1, size)
        self.io_queues = io_queues  # what Set Features Number of Queues grants at most
        self._state = mmap.mmap(-1, STATE.size + MAX_QID)  # STATE, then a byte per QID
        self.io_connects: list[tuple[int, int, str]] = []  # (qid, cntlid, HostNQN) accepted
        self.mdts = mdts  # Identify's MDTS: 2^mdts 4 KiB pages a command, 0 for no limit
        self.maxh2cdata = maxh2cdata
        self.r2t_bytes = r2t_bytes
        """Bytes one R2T asks for at most, the next asked once its data came (as SPDK's
        target does); 0: one R2T for all of a write (as nvmet)."""
        self.r2t_ends: dict = {}  # (stream, command ID) -> where the data of its last R2T ends
        self.cpda = cpda
        self.success_flag = success_flag
        self.c2h_pieces = c2h_pieces
        self.pad = pad  # extra bytes between a C2HData header and its data (PDO)
        self.fault: str | None = None
        self.port = 0
        self.connections = 0
        self.h2c_lengths: list[int] = []
        self.icreqs: list[bytes] = []
        self.commands: list[bytes] = []
        self.hdgst = self.ddgst = False
        self.streams: list = []
        self.sqe_of: dict = {}  # (stream, command ID) -> (queue ID, the last command with it)
        self.csts = 0
        self.sqflow_off: list[bool] = []  # per queue Connect: SQ flow control disabled
        self.release = trio.Event()  # lets a "late" answer go
        self.late_sent = trio.Event()  # the held answer went out (or its connection was gone)

    @property
    def cntlid(self) -> int:
        """The live controller's ID (0 before the first admin Connect)."""
        return STATE.unpack_from(self._state)[0]

    def _controller(self) -> tuple[int, bool, bool]:
        return STATE.unpack_from(self._state)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    def serve_forked(self, started=None) -> None:
        """Serve until killed, each connection from a child process of its own;
        ``started(port)`` once listening.  Blocking, without trio: call it in a process of
        its own (the children die with it)."""
        listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = listener.getsockname()[1]
        signal.signal(signal.SIGCHLD, _reap)  # (their CPU time then counts as ours: cutime)
        if started is not None:
            started(self.port)
        target = os.getpid()
        while True:
            conn, _ = listener.accept()
            if os.fork() == 0:  # the child: this connection only
                listener.close()
                _die_with_parent(target)
                try:
                    trio.run(self._forked_connection, conn)
                finally:
                    os._exit(0)
            conn.close()

    async def _forked_connection(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await self._connection(trio.SocketStream(trio.socket.from_stdlib_socket(conn)))

    async def _connection(self, socket_stream: trio.SocketStream) -> None:
        self.connections += 1
        stream = OneSenderAtATime(socket_stream)
        reader = Reader(stream)
        self.streams.append(stream)
        state = {"qid": None, "writes": {}, "sqflow_off": False, "cntlid": 0}
        try:
            icreq = await reader.read(128)
            self.icreqs.append(icreq)
            self.hdgst, self.ddgst = bool(icreq[11] & 1), bool(icreq[11] & 2)
            await stream.send_all(self._icresp(icreq))
            while True:
                await self._pdu(stream, reader, state)
        except (trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
            pass
        finally:
            self._disconnected(state)
            await stream.aclose()

    def _disconnected(self, state: dict) -> None:
        """A queue's connection ended: its QID is free; an admin queue's ends the controller
        (nvmet tears its I/O queues down with it: here their hosts find out as they use
        them, or reconnect)."""
        qid, cntlid = state["qid"], state["cntlid"]
        if qid is None or cntlid != self.cntlid:
            return
        if qid == 0:
            live_id, _, ever = self._controller()
            STATE.pack_into(self._state, 0, live_id, 0, ever)
        elif qid < MAX_QID:
            self._state[STATE.size + qid] = 0

    def _connect(self, state: dict, sqe: bytes, data: bytes) -> int:
        """A fabrics Connect: the status, and on the admin queue a new controller."""
        qid = struct.unpack_from("<H", sqe, 42)[0]
        live_id, live, ever = self._controller()
        if qid == 0:
            live_id = live_id % 0xFFEF + 1
            STATE.pack_into(self._state, 0, live_id, 1, 1)
            self._state[STATE.size:] = bytes(MAX_QID)
            state.update(qid=0, cntlid=live_id)
            return 0
        asked = struct.unpack_from("<H", data, 16)[0] if len(data) >= 18 else live_id
        if ever and (asked != live_id or not live):
            return SC_CONNECT_INVALID  # no such controller (any more)
        if ever and qid < MAX_QID:
            if self._state[STATE.size + qid]:
                return SC_SEQUENCE_ERROR
            self._state[STATE.size + qid] = 1
        hostnqn = data[512:768].rstrip(b"\0").decode(errors="replace")
        self.io_connects.append((qid, asked, hostnqn))
        state.update(qid=qid, cntlid=asked)
        return 0

    def _icresp(self, icreq: bytes) -> bytes:
        icresp = pdu.COMMON_HEADER.pack(pdu.ICRESP, 0, 128, 0, 128) + struct.pack(
            "<HBBI", 0, self.cpda, icreq[11], self.maxh2cdata)
        return icresp.ljust(128, b"\0")

    def _swallow(self, qid: int | None, sqe: bytes) -> bool:
        """Whether to leave command ``sqe`` unanswered ("silent": the next one)."""
        if self.fault == "silent":
            self.fault = None
            return True
        return False

    async def _async_event(self, stream, cid: int) -> None:
        """An Asynchronous Event Request: held, as a real controller holds it until an
        event happens."""

    def _header(self, head: bytes) -> bytes:
        if self.hdgst:
            return head + pdu.digest(head)
        return head

    async def _pdu(self, stream, reader: Reader, state: dict) -> None:
        """One PDU from the host: a command capsule, or data for a write sent an R2T."""
        common = await reader.read(8)
        ptype, flags, hlen, pdo, plen = pdu.COMMON_HEADER.unpack(common)
        rest = await reader.read(plen - 8)
        if ptype == pdu.H2C_DATA:
            await self._h2c_data(stream, state, common, rest)
            return
        assert ptype == pdu.CAPSULE_CMD, f"expected a CapsuleCmd, got {ptype:#x}"
        head = common + rest[:hlen - 8]
        if self.hdgst:
            assert flags & pdu.FLAG_HDGST and rest[hlen - 8:hlen - 4] == pdu.digest(head)
        sqe = head[8:72]
        self.commands.append(sqe)
        self.sqe_of[stream, struct.unpack_from("<H", sqe, 2)[0]] = (state["qid"], sqe)
        inline = b""
        if pdo:
            dd = 4 if flags & pdu.FLAG_DDGST else 0
            inline = rest[pdo - 8:plen - 8 - dd]
            if dd:
                assert rest[plen - 8 - dd:] == pdu.digest(inline), "bad in-capsule data digest"
        opcode, cid = sqe[0], struct.unpack_from("<H", sqe, 2)[0]
        if self._swallow(state["qid"], sqe):
            return
        if opcode == ADMIN_ASYNC_EVENT and state["qid"] == 0:
            await self._async_event(stream, cid)
            return
        if opcode == FABRICS and sqe[4] == 0x01:
            status = self._connect(state, sqe, inline)
            if status:
                await stream.send_all(self._response(cid, 0, status))
                return
            state["sqflow_off"] = bool(sqe[46] & 0x04)  # then reads end with SUCCESS, as nvmet
            self.sqflow_off.append(state["sqflow_off"])
        admin = self._admin(sqe) if opcode == FABRICS or state["qid"] == 0 else None
        if admin is not None:
            result, payload = admin
            if payload:
                await self._send_read(stream, cid, payload, faults=False)
            await self._respond(stream, cid, result)
            return
        slba, nlb = struct.unpack_from("<QH", sqe, 40)
        length = struct.unpack_from("<I", sqe, 32)[0]
        start = slba * LBA
        if self.fault == "late" and opcode in (READ, WRITE) and length:
            self.fault = None
            await self.release.wait()
            try:
                await self._answer_late(stream, state, opcode, cid, start, length)
            finally:
                self.late_sent.set()
            return
        if opcode == READ and length:
            twice = self.fault == "twice"
            success = self.success_flag or state["sqflow_off"]
            await self._send_read(stream, cid, bytes(self.data[start:start + length]),
                                  success=success and not twice)
            if twice:  # two CapsuleResps for it, in one segment
                response = self._response(cid, 0)
                await stream.send_all(response + response)
                return
            if success:
                return
        elif opcode == WRITE and length:
            if not inline:  # the data comes in H2CData PDUs; the response after the last
                state["writes"][cid] = (start, length, bytearray())
                await self._r2t(stream, cid, min(length, self.r2t_bytes or length))
                return
            self.data[start:start + len(inline)] = inline
        await self._respond(stream, cid, 0)

    async def _answer_late(self, stream, state: dict, opcode: int, cid: int, start: int,
                           length: int) -> None:
        if opcode == READ:
            await self._send_read(stream, cid, bytes(self.data[start:start + length]))
            await self._respond(stream, cid, 0)
        else:
            state["writes"][cid] = (start, length, bytearray())
            await self._r2t(stream, cid, length)

    async def _respond(self, stream, cid: int, result: int) -> None:
        await stream.send_all(self._response(cid, result))

    def _response(self, cid: int, result: int, status: int = 0) -> bytes:
        """A CapsuleResp; ``status`` is the completion's status field (phase bit 0)."""
        return self._header(pdu.COMMON_HEADER.pack(
            pdu.CAPSULE_RESP, pdu.FLAG_HDGST if self.hdgst else 0, 24, 0,
            24 + (4 if self.hdgst else 0)) + struct.pack("<QHHHH", result, 0, 1, cid, status))

    def _admin(self, sqe: bytes) -> tuple[int, bytes] | None:
        """The admin and fabrics commands a controller needs to come up: (result, data)."""
        opcode = sqe[0]
        if opcode == FABRICS:
            fctype = sqe[4]
            offset = struct.unpack_from("<I", sqe, 44)[0]
            if fctype == 0x01:  # Connect (checked by _connect): the controller's ID
                return self.cntlid, b""
            if fctype == 0x04:  # Property Get
                if offset == 0x00:  # CAP: MQES 127, TO 1 (500 ms)
                    return 127 | 1 << 24, b""
                return {0x08: 0x10400, 0x1C: self.csts}.get(offset, 0), b""
            if fctype == 0x00:  # Property Set: CC.EN sets CSTS.RDY, CC.SHN sets SHST done
                value = struct.unpack_from("<Q", sqe, 48)[0]
                self.csts = (value & 1) | (2 << 2 if value >> 14 & 3 else 0)
                return 0, b""
        if opcode == ADMIN_IDENTIFY:
            cns, nsid = sqe[40], struct.unpack_from("<I", sqe, 4)[0]
            page = bytearray(4096)
            if cns == 1:  # controller: MDTS, SGLs, IOCCSZ 4 KiB in-capsule, I/O
                page[24:32] = b"fake-tcp"
                page[77] = self.mdts
                page[111] = 1
                struct.pack_into("<H", page, 514, 128)
                struct.pack_into("<I", page, 536, 1 | 1 << 20)
                struct.pack_into("<II", page, 1792, (64 + 4096) // 16, 1)
                page[768:768 + len(NQN)] = NQN.encode()
            elif cns == 2:  # active namespaces: 1
                struct.pack_into("<I", page, 0, 1)
            elif cns == 0 and nsid == 1:
                nlb = len(self.data) // LBA
                struct.pack_into("<QQQ", page, 0, nlb, nlb, nlb)
                page[130] = 9  # LBA format 0: 512-byte LBAs
            return 0, bytes(page)
        if opcode == ADMIN_SET_FEATURES:  # Number of Queues: up to io_queues
            asked = (struct.unpack_from("<I", sqe, 44)[0] & 0xFFFF) + 1
            granted = max(2, min(asked, self.io_queues))
            return (granted - 1) | (granted - 1) << 16, b""
        if opcode == ADMIN_KEEP_ALIVE:
            return 0, b""
        if opcode == ADMIN_GET_LOG_PAGE:
            lid, numdl = sqe[40], struct.unpack_from("<H", sqe, 42)[0]
            numdu, offset = struct.unpack_from("<HxxQ", sqe, 44)
            length = ((numdu << 16 | numdl) + 1) * 4
            return 0, self._log_page(lid, offset, length)
        return None

    def _log_page(self, lid: int, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of log page ``lid``: all zero here (no changed
        namespaces, no errors)."""
        return bytes(length)

    async def _send_read(self, stream, cid: int, payload: bytes, faults: bool = True,
                         success: bool = False) -> None:
        fault = None
        if faults:
            fault, self.fault = self.fault, None
        if fault == "close":
            await stream.aclose()
            return
        if fault == "term req":
            await stream.send_all(pdu.COMMON_HEADER.pack(pdu.C2H_TERM_REQ, 0, 24, 0, 24)
                                  + struct.pack("<HI", 3, 0).ljust(16, b"\0"))
            return
        if fault == "unknown type":
            await stream.send_all(pdu.COMMON_HEADER.pack(0x0C, 0, 24, 0, 24) + bytes(16))
            return
        if fault == "unknown command":
            cid ^= 0x100
        # "offset": two halves, both said to start at 0 (a hole and an overlap)
        step = -(-len(payload) // (2 if fault == "offset" else self.c2h_pieces))
        for at in range(0, len(payload), step):
            piece = payload[at:at + step]
            last = at + step >= len(payload)
            flags = pdu.FLAG_HDGST if self.hdgst else 0
            if self.ddgst:
                flags |= pdu.FLAG_DDGST
            if last:
                flags |= pdu.FLAG_LAST_PDU | (pdu.FLAG_SUCCESS if success else 0)
            hd = 4 if self.hdgst else 0
            pdo = 24 + hd + self.pad
            plen = pdo + len(piece) + (4 if self.ddgst else 0)
            if fault == "length":
                plen += 4
            head = pdu.COMMON_HEADER.pack(pdu.C2H_DATA, flags, 24, pdo, plen) + struct.pack(
                "<HHII4x", cid, 0, 0 if fault == "offset" else at, len(piece))
            if self.hdgst:
                head += (pdu.digest(head) if fault != "header digest" else b"\0\0\0\0")
            wire = head + bytes(self.pad) + piece
            if self.ddgst:
                wire += pdu.digest(piece if fault != "data digest" else piece + b"x")
            if fault in ("stall", "cut"):  # half the payload, then nothing, or the end
                await stream.send_all(wire[:len(head) + self.pad + len(piece) // 2])
                if fault == "cut":
                    await stream.aclose()
                return
            await stream.send_all(wire)

    async def _r2t(self, stream, cid: int, length: int, offset: int = 0) -> None:
        hd = 4 if self.hdgst else 0
        self.r2t_ends[stream, cid] = offset + length
        await stream.send_all(self._header(pdu.COMMON_HEADER.pack(
            pdu.R2T, pdu.FLAG_HDGST if hd else 0, 24, 0, 24 + hd)
            + struct.pack("<HHII4x", cid, 7, offset, length)))

    async def _h2c_data(self, stream, state: dict, common: bytes, rest: bytes) -> None:
        ptype, flags, hlen, pdo, plen = pdu.COMMON_HEADER.unpack(common)
        head = common + rest[:16]
        if self.hdgst:
            assert rest[16:20] == pdu.digest(head), "bad H2CData header digest"
        cid, ttag, datao, datal = struct.unpack_from("<HHII", head, 8)
        start, length, got = state["writes"][cid]
        assert (ttag, datao) == (7, len(got))
        assert datal <= self.maxh2cdata
        data = rest[pdo - 8:pdo - 8 + datal]
        if self.ddgst:
            assert rest[pdo - 8 + datal:] == pdu.digest(data), "bad H2CData data digest"
        r2t_end = self.r2t_ends.get((stream, cid), length)
        assert bool(flags & pdu.FLAG_LAST_PDU) == (len(got) + datal == r2t_end)  # of its R2T
        self.h2c_lengths.append(datal)
        got += data
        if len(got) == length:
            del state["writes"][cid]
            self.data[start:start + length] = got
            await self._respond(stream, cid, 0)
        elif len(got) == r2t_end:  # the next piece (r2t_bytes)
            await self._r2t(stream, cid, min(length - r2t_end, self.r2t_bytes or length),
                            r2t_end)


class OneSenderAtATime:
    """A connection's stream whose ``send_all`` waits its turn: a held Asynchronous Event
    Request may be completed by another task (a test's notice) while the connection's own
    task sends a command's data, and trio refuses two senders at once (BusyResourceError,
    which ended the whole target).  A PDU sent in one ``send_all`` stays whole."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._sending = trio.Lock()

    async def send_all(self, data) -> None:
        async with self._sending:
            await self._stream.send_all(data)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class Reader:
    def __init__(self, stream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise EOFError
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


@contextlib.contextmanager
def served_in_thread(**kw):
    """``(target, token)``: a :class:`FakeTcpTarget` (``kw``) served on a trio loop of a
    thread of its own, and that loop's token (a test calls into the target's loop with it)."""
    target, state, ready = FakeTcpTarget(**kw), {}, threading.Event()

    async def main() -> None:
        state["token"] = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as state["scope"]:
            async with trio.open_nursery() as nursery:
                await nursery.start(target.serve)
                ready.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert ready.wait(10), "the fake target did not start"
    try:
        yield target, state["token"]
    finally:
        trio.from_thread.run_sync(state["scope"].cancel, trio_token=state["token"])
        thread.join(10)


def _reap(signum: int, frame: object) -> None:
    """Wait for the connection processes that ended."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _die_with_parent(parent: int) -> None:
    """This process ends with ``parent`` (prctl PR_SET_PDEATHSIG), also if that ended
    before the prctl took hold."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if os.getppid() != parent:
        os._exit(0)


def like_nvmet(size: int = 64 << 20, **kw) -> FakeTcpTarget:
    """No MDTS and MAXH2CDATA 4 MiB, as Linux nvmet-tcp (a 1 MiB write is one command
    answering one R2T, as in the testbed VM); companion queues to lease."""
    return FakeTcpTarget(**{"size": size, "maxh2cdata": 1 << 22, "mdts": 0, "io_queues": 64,
                            **kw})


def serve_like_nvmet(port_queue, size: int = 64 << 20, single: bool = False) -> None:
    """A bench's target (:func:`like_nvmet`), run in a child process: a process per
    connection unless ``single``; its port goes to ``port_queue``.  It ends with the process
    that started it (a test or bench killed outright leaves no target behind)."""
    _die_with_parent(os.getppid())
    target = like_nvmet(size)
    if not single:
        target.serve_forked(port_queue.put)
        return

    async def main():
        async with trio.open_nursery() as nursery:
            port_queue.put(await nursery.start(target.serve))

    trio.run(main)


class _Printer:
    @staticmethod
    def put(port: int) -> None:
        print(port, flush=True)


if __name__ == "__main__":
    # python tests/tcp_target.py MIB [--single]: serve until killed (a process per connection,
    # or all on one loop), print the port
    import sys

    serve_like_nvmet(_Printer, int(sys.argv[1]) << 20, "--single" in sys.argv[2:])
