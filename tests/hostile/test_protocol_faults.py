"""Protocol violations on the I/O path (issue #49, items 1-3), against the real daemon and
FUSE: each breaks the connection every time the command goes out, so the command must
end in EIO after its retry budget (``IO_RETRIES`` tries), the log must name the fault, and
the unmount must not wait on it.

The faults register here (``hostile_target.fault``), beside the harness's own.
"""

from __future__ import annotations

import re
import struct

import pytest
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
                        send) -> None:
        qid, sqe = target.sqe_of.get((stream, cid), (None, None))
        if is_io(qid, sqe) and self.fire():
            await self.lie(target, stream, cid, payload, send)
        else:
            await send(payload)

    async def lie(self, target: HostileTarget, stream, cid: int, payload: bytes, send) -> None:
        raise NotImplementedError


@fault("c2h past buffer", "a Read's C2HData names bytes past the command's buffer")
class C2HPastBuffer(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(c2h_data(cid, len(payload), payload))


@fault("c2h unknown cid", "a Read's C2HData names a command ID not in flight")
class C2HUnknownCid(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(c2h_data(cid ^ BAD_CID, 0, payload))


@fault("resp unknown cid", "a Read is answered by a CapsuleResp for a command ID not in flight")
class RespUnknownCid(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await send(payload, success=False)
        await stream.send_all(target._response(cid ^ BAD_CID, 0))


@fault("pdu length", "a PDU whose length says 0xFFFFFFF0")
class PduLength(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(c2h_data(cid, 0, payload, plen=0xFFFFFFF0))


@fault("unknown pdu type", "a PDU of type 0x0C, which NVMe/TCP does not define")
class UnknownPduType(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(pdu.COMMON_HEADER.pack(0x0C, 0, 24, 0, 24) + bytes(16))


@fault("c2h term req", "a C2HTermReq in answer to a Read")
class C2HTermReq(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(pdu.COMMON_HEADER.pack(pdu.C2H_TERM_REQ, 0, 24, 0, 24)
                              + struct.pack("<HI", 3, 0).ljust(16, b"\0"))


@fault("read without data", "a Read answered with success and no C2HData")
class ReadWithoutData(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        await stream.send_all(target._response(cid, 0))


@fault("late duplicate resp", "a second CapsuleResp for the queue's first command (its "
       "Connect), sent after the Read reused its slot")
class LateDuplicateResp(ReadFault):
    async def lie(self, target, stream, cid, payload, send):
        # The first command ID this connection used: the Connect's, whose slot the Read
        # took again (with the same ID, before command IDs carried a generation).
        first = next(c for (s, c) in target.sqe_of if s is stream)
        await stream.send_all(target._response(first, 0))
        await send(payload)


@fault("r2t unknown cid", "a Write's R2T names a command ID not in flight")
class R2TUnknownCid(Fault):
    async def r2t(self, target, stream, cid, length, send):
        if self.fire():
            await stream.send_all(r2t(cid ^ BAD_CID, 0, length))
        else:
            await send(length)


@fault("r2t past write", "a Write's R2T asks for more data than the write has")
class R2TPastWrite(Fault):
    async def r2t(self, target, stream, cid, length, send):
        await send(2 * length if self.fire() else length)


# fault, dd, and what the log must say of it
CASES = [
    ("c2h past buffer", "read", "C2HData for command .* names bytes 32768\\+32768, past its"),
    ("c2h unknown cid", "read", "C2HData for command ID .*, which is not in flight"),
    ("resp unknown cid", "read", "CapsuleResp for command ID .*, which is not in flight"),
    ("pdu length", "read", "4294967280"),
    ("unknown pdu type", "read", "0xc"),
    ("c2h term req", "read", "C2HTermReq"),
    ("read without data", "read", "claims success after 0 of 32768 bytes"),
    ("late duplicate resp", "read", "CapsuleResp for command ID .*, which is not in flight"),
    ("r2t unknown cid", "write", "R2T for command ID .*, which is not in flight"),
    ("r2t past write", "write", "R2T for command .* names bytes 0\\+65536, past its"),
]


@pytest.mark.parametrize(("name", "direction", "says"), CASES, ids=[c[0] for c in CASES])
def test_a_command_that_breaks_its_connection_each_time_ends_in_eio(hostile, name, direction,
                                                                    says):
    out = hostile.run(name, direction).check("eio")
    target = hostile.mounts[0].target
    assert target.hostile.fired >= 1, f"the fault never fired; {out.log[-2000:]}"
    assert re.search(says, out.log), out.log[-3000:]
    # The error is logged once, naming the target's fault (or the outage's end, when
    # --ctrl-loss-tmo ran out first).
    gave_up = out.log.count("failed under each of its") + out.log.count("gave up after")
    assert gave_up >= 1, out.log[-3000:]


def test_sigterm_does_not_wait_on_a_command_caught_in_the_retry_loop(hostile):
    """SIGTERM took 62 s while a poison read looped.  Here the loop would run for about
    IO_RETRIES * 4 s (--reconnect-delay 4): the daemon must exit long before that."""
    import signal
    import subprocess
    import time

    m = hostile.start("c2h term req", options=("-c", "4", "-l", "600", "-k", "1"))
    assert m.mount() == "ready"
    n1 = m.mountpoint / "n1"
    dd = subprocess.Popen(["dd", f"if={n1}", "of=/dev/null", "iflag=direct", "bs=32768",
                           "count=1", "status=none"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while "C2HTermReq" not in m.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "C2HTermReq" in m.log(), m.log()
        start = time.monotonic()
        m.proc.send_signal(signal.SIGTERM)
        m.proc.wait(timeout=15)
        took = time.monotonic() - start
        _, err = dd.communicate(timeout=15)
    finally:
        if dd.poll() is None:
            dd.kill()
    assert took < 8, f"the daemon took {took:.1f} s to exit; {m.log()[-3000:]}"
    assert dd.returncode != 0
    assert "Traceback" not in m.log(), m.log()
