"""Faults of lengths and counts (issue #49 item 4): a target that claims more than it
has, or values we cannot serve."""

from __future__ import annotations

import struct

from hostile_target import (
    LID_ANA,
    LID_CHANGED_NS,
    LID_DISCOVERY,
    Fault,
    HostileTarget,
    discovery_page,
    fault,
    is_io,
    status_field,
)

from nvmeof_fuse.nvme import tcp_pdu as pdu

HUGE = 0x0FFFFFF0


@fault("forged ana log", "ANA reporting with NN, MNAN and NANAGRPID 0x0FFFFFF0: a 9 GiB "
       "ANA log (MDTS is 32 KiB), and a log page whose header claims 65535 groups")
class ForgedAnaLog(Fault):
    def setup(self, target):
        target.ana = True

    def identify(self, target, cns, nsid, page):
        if cns == 1:
            struct.pack_into("<I", page, 516, HUGE)  # NN
            struct.pack_into("<II", page, 344, HUGE, HUGE)  # ANAGRPMAX, NANAGRPID
            struct.pack_into("<I", page, 540, HUGE)  # MNAN

    def log_page(self, target, lid, offset, length, page):
        if lid == LID_ANA:
            page = bytearray(page)
            struct.pack_into("<H", page, 8, 0xFFFF)  # NGRPS
        return super().log_page(target, lid, offset, length, bytes(page))


@fault("ana ngrps huge", "the ANA log page's header claims 65535 groups, with one there")
class AnaNgrpsHuge(Fault):
    def setup(self, target):
        target.ana = True

    def log_page(self, target, lid, offset, length, page):
        if lid == LID_ANA:
            page = bytearray(page)
            struct.pack_into("<H", page, 8, 0xFFFF)
        return super().log_page(target, lid, offset, length, bytes(page))


class NamespaceIdentify(Fault):
    """Identify Namespace of n1 with some fields forged: ``fields`` (offset, format, value)."""

    fields: tuple[tuple[int, str, int], ...] = ()

    def identify(self, target, cns, nsid, page):
        if cns == 0 and nsid == 1:
            for offset, fmt, value in self.fields:
                struct.pack_into(fmt, page, offset, value)


@fault("lbads 63", "n1's LBA format has LBADS 63: 2^63-byte blocks")
class Lbads63(NamespaceIdentify):
    fields = ((130, "B", 63),)


@fault("lbads 0", "n1's LBA format has LBADS 0: 1-byte blocks, which the spec forbids")
class Lbads0(NamespaceIdentify):
    fields = ((130, "B", 0),)


@fault("lbads 17", "n1's LBA format has LBADS 17: 128 KiB blocks, past 64 KiB")
class Lbads17(NamespaceIdentify):
    fields = ((130, "B", 17),)


@fault("nsze max", "n1 has NSZE, NCAP and NUSE 2^64-1")
class NszeMax(NamespaceIdentify):
    fields = ((0, "<Q", 2**64 - 1), (8, "<Q", 2**64 - 1), (16, "<Q", 2**64 - 1))


@fault("nsze overflow", "n1's NSZE times its 512-byte LBA is 2^64 bytes, past 2^63")
class NszeOverflow(NamespaceIdentify):
    fields = ((0, "<Q", 2**55), (8, "<Q", 2**55))


@fault("flbas past nlbaf", "n1's FLBAS selects LBA format 9 of one")
class FlbasPastNlbaf(NamespaceIdentify):
    fields = ((26, "B", 9),)


@fault("crd of hours", "CRDT1 is 0xFFFF (109 min); the first I/O fails retryably with CRD 1")
class CrdOfHours(Fault):
    times = 1

    def identify(self, target, cns, nsid, page):
        if cns == 1:
            struct.pack_into("<HHH", page, 128, 0xFFFF, 0xFFFF, 0xFFFF)

    failing: bytes | None = None  # the read that fails, no data sent

    async def read_data(self, target, stream, cid, payload, send, success):
        qid, sqe = target.sqe_of.get((stream, cid), (None, None))
        if not (is_io(qid, sqe) and self.fire()):
            await send(payload)
            return
        self.failing = sqe
        if success:  # else the CapsuleResp follows, with status()
            await stream.send_all(target._response(cid, 0, self.status(target, qid, sqe)))

    def status(self, target, qid, sqe):
        if sqe is not None and sqe is self.failing:
            self.failing = None
            return status_field(0, 0x06, crd=1)  # Internal Error, retry after CRDT1
        return 0


@fault("huge discovery log", "the discovery log claims 2^64-1 records and a new GENCTR each read")
class HugeDiscoveryLog(Fault):
    def log_page(self, target, lid, offset, length, page):
        if lid == LID_DISCOVERY:
            self.fired += 1
            page = bytearray(discovery_page(target.port, records=4))
            struct.pack_into("<QQ", page, 0, self.fired, 2**64 - 1)
        return super().log_page(target, lid, offset, length, bytes(page))


@fault("many discovery records", "the discovery log holds 300 records (300 KiB, past MDTS)")
class ManyDiscoveryRecords(Fault):
    def log_page(self, target, lid, offset, length, page):
        if lid == LID_DISCOVERY:
            page = discovery_page(target.port, records=300)
        return super().log_page(target, lid, offset, length, page)


@fault("namespace list of 1024", "the active namespace list is full (1024 NSIDs) and NN "
       "0xFFFFFFFF; each is a 4 KiB namespace")
class NamespaceListFull(Fault):
    def identify(self, target, cns, nsid, page):
        if cns == 1:
            struct.pack_into("<I", page, 516, 0xFFFFFFFF)
        elif cns == 2:
            struct.pack_into("<1024I", page, 0, *range(1, 1025))
        elif cns == 0 and nsid > 1:
            struct.pack_into("<QQQ", page, 0, 8, 8, 8)
            page[130] = 9


@fault("namespace list unsorted", "the active namespace list repeats and unsorts NSIDs and "
       "names NSID 0xFFFFFFFF")
class NamespaceListUnsorted(Fault):
    def identify(self, target, cns, nsid, page):
        if cns == 2:
            page[:] = bytes(4096)
            struct.pack_into("<5I", page, 0, 1, 1, 0xFFFFFFFF, 1, 0)


class OnceOnRead(Fault):
    """The first I/O read's C2HData broken one way (then good: the host reconnects and
    the read lands)."""

    times = 1

    async def read_data(self, target, stream, cid, payload, send, success):
        qid, sqe = target.sqe_of.get((stream, cid), (None, None))
        if is_io(qid, sqe) and self.fire():
            await self.broken(target, stream, cid, payload, send)
        else:
            await send(payload)

    async def broken(self, target: HostileTarget, stream, cid, payload, send) -> None:
        raise NotImplementedError


def c2h_header(target: HostileTarget, cid: int, *, datao: int, datal: int, plen: int,
               hlen: int = 24, pdo: int | None = None, flags: int = 0) -> bytes:
    head = pdu.COMMON_HEADER.pack(pdu.C2H_DATA, flags | pdu.FLAG_LAST_PDU, hlen,
                                  24 if pdo is None else pdo, plen)
    return head + struct.pack("<HHII4x", cid, 0, datao, datal)


@fault("pdu length huge", "the first read's C2HData says PLEN 0xFFFFFFF0")
class PduLengthHuge(OnceOnRead):
    async def broken(self, target, stream, cid, payload, send):
        await stream.send_all(c2h_header(target, cid, datao=0, datal=len(payload),
                                         plen=0xFFFFFFF0) + payload)


@fault("data length huge", "the first read's C2HData says DATAL 0x7FFFFFF0 at offset 0")
class DataLengthHuge(OnceOnRead):
    async def broken(self, target, stream, cid, payload, send):
        await stream.send_all(c2h_header(target, cid, datao=0, datal=0x7FFFFFF0,
                                         plen=24 + len(payload)) + payload)


@fault("data offset huge", "the first read's C2HData says DATAO 0xFFFFF000")
class DataOffsetHuge(OnceOnRead):
    async def broken(self, target, stream, cid, payload, send):
        await stream.send_all(c2h_header(target, cid, datao=0xFFFFF000, datal=len(payload),
                                         plen=24 + len(payload)) + payload)


@fault("header length huge", "the first read's C2HData says HLEN 255 and PDO 8")
class HeaderLengthHuge(OnceOnRead):
    async def broken(self, target, stream, cid, payload, send):
        await stream.send_all(c2h_header(target, cid, datao=0, datal=len(payload),
                                         plen=24 + len(payload), hlen=255, pdo=8) + payload)


@fault("close mid-payload", "the first read's C2HData stops halfway and the target closes")
class CloseMidPayload(OnceOnRead):
    async def broken(self, target, stream, cid, payload, send):
        await stream.send_all(c2h_header(target, cid, datao=0, datal=len(payload),
                                         plen=24 + len(payload)) + payload[:len(payload) // 2])
        await stream.aclose()


@fault("data digest wrong", "with data digests on, the first read's C2HData digest is wrong")
class DataDigestWrong(OnceOnRead):
    async def broken(self, target, stream, cid, payload, send):
        target.fault = "data digest"  # tcp_target's own: one PDU with a wrong digest
        await send(payload)


@fault("r2t huge", "the first write's R2T asks for 0x7FFFFFF0 bytes, past the write's")
class R2tHuge(Fault):
    times = 1

    async def r2t(self, target, stream, cid, length, send):
        await send(0x7FFFFFF0 if self.fire() else length)


@fault("r2t past the write", "the first write's R2T asks for its bytes at offset 4096 on")
class R2tPastTheWrite(Fault):
    times = 1

    async def r2t(self, target, stream, cid, length, send):
        if not self.fire():
            await send(length)
            return
        hd = 4 if target.hdgst else 0
        await stream.send_all(target._header(pdu.COMMON_HEADER.pack(
            pdu.R2T, pdu.FLAG_HDGST if hd else 0, 24, 0, 24 + hd)
            + struct.pack("<HHII4x", cid, 7, 4096, length)))


@fault("changed namespace list forged", "an Asynchronous Event says namespaces changed; the "
       "changed namespace list names 1024 NSIDs, 0xFFFFFFFF among them")
class ChangedNamespaceListForged(Fault):
    times = 1

    async def async_event(self, target, stream, cid):
        if self.fire():
            await target.complete(stream, cid, 0x04 << 16 | 0x00 << 8 | 0x2)  # notice: NS attr

    def log_page(self, target, lid, offset, length, page):
        if lid == LID_CHANGED_NS:
            page = struct.pack("<1024I", 0xFFFFFFFF, *range(2, 1025))
        return super().log_page(target, lid, offset, length, page)


@fault("async event storm", "every Asynchronous Event Request completes at once with a "
       "namespace change notice")
class AsyncEventStorm(Fault):
    async def async_event(self, target, stream, cid):
        self.fired += 1
        await target.complete(stream, cid, 0x04 << 16 | 0x00 << 8 | 0x2)


@fault("icresp pfv 1", "the ICResp says PDU format version 1")
class IcrespPfv(Fault):
    def icresp(self, target, icresp):
        struct.pack_into("<H", icresp, 8, 1)


@fault("icresp maxh2cdata 0", "the ICResp says MAXH2CDATA 0")
class IcrespMaxh2cdata0(Fault):
    def icresp(self, target, icresp):
        struct.pack_into("<I", icresp, 12, 0)


@fault("icresp cpda 128", "the ICResp says CPDA 128")
class IcrespCpda128(Fault):
    def icresp(self, target, icresp):
        icresp[10] = 128


@fault("connect stall", "the admin queue's Fabrics Connect is never answered")
class ConnectStall(Fault):
    def swallow(self, target, qid, sqe):
        return sqe[0] == 0x7F and sqe[4] == 0x01


def property_get(sqe: bytes, offset: int) -> bool:
    return sqe[0] == 0x7F and sqe[4] == 0x04 and struct.unpack_from("<I", sqe, 44)[0] == offset


@fault("cap mqes 0", "CAP.MQES 0: queues of one entry, which the spec forbids")
class CapMqes0(Fault):
    def answer(self, target, sqe, result, payload):
        if property_get(sqe, 0):
            result &= ~0xFFFF
        return result, payload


@fault("cap to max", "CAP.TO 255 (127.5 s to become ready) while CSTS.RDY comes at once")
class CapToMax(Fault):
    def answer(self, target, sqe, result, payload):
        if property_get(sqe, 0):
            result |= 0xFF << 24
        return result, payload


@fault("queues granted 65535", "Set Features Number of Queues grants 65535 of each")
class QueuesGranted(Fault):
    def answer(self, target, sqe, result, payload):
        if sqe[0] == 0x09 and sqe[40] == 0x07:
            result = 0xFFFE | 0xFFFE << 16
        return result, payload


@fault("maxcmd 1", "Identify Controller's MAXCMD is 1: one command outstanding per queue")
class Maxcmd1(Fault):
    def identify(self, target, cns, nsid, page):
        if cns == 1:
            struct.pack_into("<H", page, 514, 1)


@fault("identify controller absurd", "MDTS 31, MAXCMD 0xFFFF, IOCCSZ 0xFFFFFFFF, KAS 0, "
       "AERL 255, NN 0xFFFFFFFF")
class IdentifyControllerAbsurd(Fault):
    def identify(self, target, cns, nsid, page):
        if cns == 1:
            page[77] = 31
            struct.pack_into("<H", page, 514, 0xFFFF)  # MAXCMD
            struct.pack_into("<I", page, 1792, 0xFFFFFFFF)  # IOCCSZ
            struct.pack_into("<H", page, 320, 0)  # KAS
            page[259] = 255  # AERL
            struct.pack_into("<I", page, 516, 0xFFFFFFFF)  # NN
