"""Faults of a target's life cycle (issue #56 items 2, 3 and 7): writes acknowledged without
their data, a shutdown never confirmed, a final flush never answered, a target that stops
answering at the exit or after a loss (tests/hostile/test_lifecycle.py runs them)."""

from __future__ import annotations

import struct

from hostile_target import Fault, HostileTarget, fault
from tcp_target import ADMIN_KEEP_ALIVE, FABRICS, FLUSH, READ

PROPERTY_SET, CONNECT, PROPERTY_GET = 0x00, 0x01, 0x04  # fabrics command types
CSTS = 0x1C
SHST_MASK = 3 << 2


def fabrics(sqe: bytes | None, fctype: int) -> bool:
    return sqe is not None and sqe[0] == FABRICS and sqe[4] == fctype


# -- writes answered without their data (item 2) ----------------------------------------------


@fault("write success without r2t", "a Write past the in-capsule data is answered with "
       "success, and no R2T ever asked for its data")
class WriteWithoutR2T(Fault):
    async def r2t(self, target, stream, cid, length, send):
        if self.fire():
            await stream.send_all(target._response(cid, 0))
        else:
            await send(length)


@fault("write success after half its r2t", "a Write's R2T asks for the first half of its "
       "data, then success comes for the whole")
class WriteHalfR2T(Fault):
    async def r2t(self, target, stream, cid, length, send):
        if self.fire():
            await send(length // 2)
            await stream.send_all(target._response(cid, 0))
        else:
            await send(length)


# -- a shutdown never confirmed (item 3) ---------------------------------------------------


@fault("shst never set", "CSTS.SHST never reports the shutdown complete")
class ShstNeverSet(Fault):
    def answer(self, target, sqe, result, payload):
        if fabrics(sqe, PROPERTY_GET) and struct.unpack_from("<I", sqe, 44)[0] == CSTS:
            result &= ~SHST_MASK
        return result, payload


@fault("shst never set, rtd3e 60 s", "Identify states an RTD3E of 60 s, and CSTS.SHST never "
       "reports the shutdown complete")
class ShstNeverSetRtd3e(ShstNeverSet):
    def identify(self, target, cns, nsid, page):
        if cns == 1:
            struct.pack_into("<I", page, 88, 60_000_000)  # RTD3E, microseconds


@fault("cc.shn never answered", "the Property Set of CC.SHN (the shutdown) is never answered")
class ShutdownNeverAnswered(Fault):
    def swallow(self, target, qid, sqe):
        return (qid == 0 and fabrics(sqe, PROPERTY_SET)
                and struct.unpack_from("<Q", sqe, 48)[0] >> 14 & 3 != 0)


# -- silent at the exit (item 3) --------------------------------------------------------------


@fault("flush never answered", "an I/O Flush is never answered (the rest is)")
class FlushNeverAnswered(Fault):
    def swallow(self, target, qid, sqe):
        if qid and sqe[0] == FLUSH:
            self.fired += 1
            return True
        return False


@fault("silent once armed", "once the test arms it, no command is answered at all, on any "
       "queue (keep-alives, Flush, the shutdown, a new connection's Connect)")
class SilentOnceArmed(Fault):
    armed = False

    def swallow(self, target, qid, sqe):
        if self.armed:
            self.fired += 1
        return self.armed


@fault("reads never answered once armed", "once the test arms it, I/O Reads are never "
       "answered (the rest is)")
class ReadsNeverAnsweredOnceArmed(Fault):
    armed = False

    def swallow(self, target, qid, sqe):
        if self.armed and qid and sqe[0] == READ:
            self.fired += 1
            return True
        return False


# -- silent after a loss (item 7) ------------------------------------------------------------


class SilentAfterLoss(Fault):
    """A good target until the test arms it; then keep-alives go unanswered, so that the
    connection is lost, and each new connection waits for ever at one step of its bring-up
    (:meth:`silent`)."""

    armed = False

    def swallow(self, target: HostileTarget, qid: int | None, sqe: bytes) -> bool:
        if not self.armed:
            return False
        if qid == 0 and sqe[0] == ADMIN_KEEP_ALIVE:
            return True
        if self.silent(qid, sqe):
            self.fired += 1
            return True
        return False

    def silent(self, qid: int | None, sqe: bytes) -> bool:
        return False


@fault("icresp never after a loss", "once armed: keep-alives unanswered, and a new connection "
       "is accepted but never sent its ICResp")
class IcrespNeverAfterLoss(SilentAfterLoss):
    def icresp(self, target, icresp):
        if self.armed:
            self.fired += 1
            icresp[:] = b""  # nothing sent: the host waits for it


@fault("connect never answered after a loss", "once armed: keep-alives unanswered, and a new "
       "connection's ICResp comes but its fabrics Connect is never answered")
class ConnectNeverAfterLoss(SilentAfterLoss):
    def silent(self, qid, sqe):
        return qid is None and fabrics(sqe, CONNECT)


@fault("property get never answered after a loss", "once armed: keep-alives unanswered, and a "
       "new admin queue connects, but its first Property Get (CAP) is never answered")
class PropertyGetNeverAfterLoss(SilentAfterLoss):
    def silent(self, qid, sqe):
        return qid == 0 and fabrics(sqe, PROPERTY_GET)
