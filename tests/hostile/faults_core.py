"""Poison commands (issue #49, items 1-3): protocol violations on every try of one I/O
command, so that each try breaks the connection (tests/hostile/test_core.py runs them)."""

from __future__ import annotations

import struct

from hostile_target import Fault, HostileTarget, fault, is_io

from nvmeof_fuse.nvme import tcp_pdu as pdu

BAD_CID = 0x8000  # flipped into a command ID: a generation (or slot) not in flight


def c2h_data(cid: int, offset: int, payload: bytes, *, plen: int | None = None,
             success: bool = True) -> bytes:
    flags = pdu.FLAG_LAST_PDU | (pdu.FLAG_SUCCESS if success else 0)
    return (pdu.COMMON_HEADER.pack(pdu.C2H_DATA, flags, 24, 24,
                                   24 + len(payload) if plen is None else plen)
            + struct.pack("<HHII4x", cid, 0, offset, len(payload)) + payload)


def r2t(cid: int, offset: int, length: int) -> bytes:
    return (pdu.COMMON_HEADER.pack(pdu.R2T, 0, 24, 0, 24)
            + struct.pack("<HHII4x", cid, 7, offset, length))


class ReadFault(Fault):
    """Lies on every I/O Read's data; a good target's data otherwise (Identify and so on)."""

    async def read_data(self, target: HostileTarget, stream, cid: int, payload: bytes,
                        send, success: bool) -> None:
        qid, sqe = target.sqe_of.get((stream, cid), (None, None))
        if is_io(qid, sqe) and self.fire():
            await self.lie(target, stream, cid, payload, send)
        else:
            await send(payload)

    async def lie(self, target: HostileTarget, stream, cid: int, payload: bytes, send) -> None:
        raise NotImplementedError


@fault("poison c2h past buffer", "a Read's C2HData names bytes past the command's buffer")
class C2HPastBuffer(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(c2h_data(cid, len(payload), payload))


@fault("poison c2h unknown cid", "a Read's C2HData names a command ID not in flight")
class C2HUnknownCid(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(c2h_data(cid ^ BAD_CID, 0, payload))


@fault("poison resp unknown cid",
       "a Read is answered by a CapsuleResp for a command ID not in flight")
class RespUnknownCid(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await send(payload, success=False)
        await stream.send_all(target._response(cid ^ BAD_CID, 0))


@fault("poison pdu length", "a PDU whose length says 0xFFFFFFF0")
class PduLength(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(c2h_data(cid, 0, payload, plen=0xFFFFFFF0))


@fault("poison unknown pdu type", "a PDU of type 0x0C, which NVMe/TCP does not define")
class UnknownPduType(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(pdu.COMMON_HEADER.pack(0x0C, 0, 24, 0, 24) + bytes(16))


@fault("poison c2h term req", "a C2HTermReq in answer to a Read")
class C2HTermReq(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(pdu.COMMON_HEADER.pack(pdu.C2H_TERM_REQ, 0, 24, 0, 24)
                              + struct.pack("<HI", 3, 0).ljust(16, b"\0"))


@fault("poison read without data", "a Read answered with success and no C2HData")
class ReadWithoutData(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(target._response(cid, 0))


@fault("poison late duplicate resp", "a second CapsuleResp for the queue's first command (its "
       "Connect), sent after the Read reused its slot")
class LateDuplicateResp(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        # The first command ID this connection used: the Connect's, whose slot the Read
        # took again (with the same ID, before command IDs carried a generation).
        first = next(c for (s, c) in target.sqe_of if s is stream)
        await stream.send_all(target._response(first, 0))
        await send(payload)


@fault("poison r2t unknown cid", "a Write's R2T names a command ID not in flight")
class R2TUnknownCid(Fault):
    async def r2t(self, target, stream, cid, length, send):
        if self.fire():
            await stream.send_all(r2t(cid ^ BAD_CID, 0, length))
        else:
            await send(length)


@fault("poison r2t past write", "a Write's R2T asks for more data than the write has")
class R2TPastWrite(Fault):
    async def r2t(self, target, stream, cid, length, send):
        await send(2 * length if self.fire() else length)
