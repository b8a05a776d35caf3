"""A small NVMe/TCP target on 127.0.0.1 for host tests: Read/Write over a bytearray.

It speaks real PDUs (ICResp, CapsuleCmd, C2HData, R2T/H2CData, CapsuleResp,
digests when asked) and can be told to break the protocol on the next read in
one of several ways (``fault``), so the host transport's error paths can be
checked without a kernel.
"""

from __future__ import annotations

import struct

import trio

from nvmeof_fuse.nvme import tcp_pdu as pdu

READ, WRITE = 0x02, 0x01
LBA = 512
FAULTS = ("header digest", "data digest", "length", "unknown type", "unknown command",
          "term req", "close")


class FakeTcpTarget:
    def __init__(self, *, size: int = 1 << 20, maxh2cdata: int = 8192, cpda: int = 0,
                 success_flag: bool = False, c2h_pieces: int = 1, pad: int = 0) -> None:
        self.data = bytearray(size)
        self.maxh2cdata = maxh2cdata
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

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        reader = Reader(stream)
        try:
            icreq = await reader.read(128)
            self.icreqs.append(icreq)
            self.hdgst, self.ddgst = bool(icreq[11] & 1), bool(icreq[11] & 2)
            icresp = pdu.COMMON_HEADER.pack(pdu.ICRESP, 0, 128, 0, 128) + struct.pack(
                "<HBBI", 0, self.cpda, icreq[11], self.maxh2cdata)
            await stream.send_all(icresp.ljust(128, b"\0"))
            while True:
                await self._command(stream, reader)
        except (trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
            pass
        finally:
            await stream.aclose()

    def _header(self, head: bytes) -> bytes:
        if self.hdgst:
            return head + pdu.digest(head)
        return head

    async def _command(self, stream, reader: Reader) -> None:
        common = await reader.read(8)
        ptype, flags, hlen, pdo, plen = pdu.COMMON_HEADER.unpack(common)
        assert ptype == pdu.CAPSULE_CMD, f"expected a CapsuleCmd, got {ptype:#x}"
        rest = await reader.read(plen - 8)
        head = common + rest[:hlen - 8]
        if self.hdgst:
            assert flags & pdu.FLAG_HDGST and rest[hlen - 8:hlen - 4] == pdu.digest(head)
        sqe = head[8:72]
        self.commands.append(sqe)
        inline = b""
        if pdo:
            dd = 4 if flags & pdu.FLAG_DDGST else 0
            inline = rest[pdo - 8:plen - 8 - dd]
            if dd:
                assert rest[plen - 8 - dd:] == pdu.digest(inline), "bad in-capsule data digest"
        opcode, cid = sqe[0], struct.unpack_from("<H", sqe, 2)[0]
        if self.fault == "silent":
            self.fault = None
            return
        slba, nlb = struct.unpack_from("<QH", sqe, 40)
        length = struct.unpack_from("<I", sqe, 32)[0]
        start = slba * LBA
        if opcode == READ and length:
            await self._send_read(stream, cid, bytes(self.data[start:start + length]))
            if self.success_flag:
                return
        elif opcode == WRITE and length:
            if not inline:
                inline = await self._r2t(stream, reader, cid, length)
            self.data[start:start + len(inline)] = inline
        await stream.send_all(self._header(pdu.COMMON_HEADER.pack(
            pdu.CAPSULE_RESP, pdu.FLAG_HDGST if self.hdgst else 0, 24, 0,
            24 + (4 if self.hdgst else 0)) + struct.pack("<QHHHH", 0, 0, 1, cid, 0)))

    async def _send_read(self, stream, cid: int, payload: bytes) -> None:
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
        step = -(-len(payload) // self.c2h_pieces)
        for at in range(0, len(payload), step):
            piece = payload[at:at + step]
            last = at + step >= len(payload)
            flags = pdu.FLAG_HDGST if self.hdgst else 0
            if self.ddgst:
                flags |= pdu.FLAG_DDGST
            if last:
                flags |= pdu.FLAG_LAST_PDU | (pdu.FLAG_SUCCESS if self.success_flag else 0)
            hd = 4 if self.hdgst else 0
            pdo = 24 + hd + self.pad
            plen = pdo + len(piece) + (4 if self.ddgst else 0)
            if fault == "length":
                plen += 4
            head = pdu.COMMON_HEADER.pack(pdu.C2H_DATA, flags, 24, pdo, plen) + struct.pack(
                "<HHII4x", cid, 0, at, len(piece))
            if self.hdgst:
                head += (pdu.digest(head) if fault != "header digest" else b"\0\0\0\0")
            wire = head + bytes(self.pad) + piece
            if self.ddgst:
                wire += pdu.digest(piece if fault != "data digest" else piece + b"x")
            await stream.send_all(wire)

    async def _r2t(self, stream, reader: Reader, cid: int, length: int) -> bytes:
        hd = 4 if self.hdgst else 0
        await stream.send_all(self._header(pdu.COMMON_HEADER.pack(
            pdu.R2T, pdu.FLAG_HDGST if hd else 0, 24, 0, 24 + hd)
            + struct.pack("<HHII4x", cid, 7, 0, length)))
        got = bytearray()
        while len(got) < length:
            common = await reader.read(8)
            ptype, flags, hlen, pdo, plen = pdu.COMMON_HEADER.unpack(common)
            assert ptype == pdu.H2C_DATA, f"expected H2CData, got {ptype:#x}"
            rest = await reader.read(plen - 8)
            head = common + rest[:16]
            if self.hdgst:
                assert rest[16:20] == pdu.digest(head), "bad H2CData header digest"
            dcid, ttag, datao, datal = struct.unpack_from("<HHII", head, 8)
            assert (dcid, ttag, datao) == (cid, 7, len(got))
            assert datal <= self.maxh2cdata
            data = rest[pdo - 8:pdo - 8 + datal]
            if self.ddgst:
                assert rest[pdo - 8 + datal:] == pdu.digest(data), "bad H2CData data digest"
            assert bool(flags & pdu.FLAG_LAST_PDU) == (len(got) + datal == length)
            self.h2c_lengths.append(datal)
            got += data
        return bytes(got)


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
