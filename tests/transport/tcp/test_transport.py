"""NVMe/TCP: the ICReq/ICResp handshake, the probe, and queues against a fake target."""

import math
import random
import re
import socket
import struct
import threading

import pytest
import trio
import trio.testing
from fakes import CommandEnds
from tcp_target import LBA, FakeTcpTarget

from nvmeof_fuse.errors import CommandTimeout, ConnectError, TransportError
from nvmeof_fuse.host.memory import host_buffer
from nvmeof_fuse.nvme import command as cmd
from nvmeof_fuse.nvme.sgl import NULL_SGL
from nvmeof_fuse.procstat import children
from nvmeof_fuse.transport.base import LocalDevice
from nvmeof_fuse.transport.tcp.transport import (
    ICResp,
    TcpTransport,
    icreq_pdu,
    interface_of,
    parse_icresp,
    probe,
)

TIMEOUT = 10.0


def icresp(*, pfv=0, cpda=0, dgst=0, maxh2cdata=0x20000, pdu_type=1, hlen=128, plen=128):
    head = struct.pack("<BBBBI", pdu_type, 0, hlen, 0, plen)
    return (head + struct.pack("<HBBI", pfv, cpda, dgst, maxh2cdata)).ljust(128, b"\0")


# --- ICReq ----------------------------------------------------------------------------------------


def test_icreq_layout():
    pdu = icreq_pdu()
    assert len(pdu) == 128
    assert struct.unpack_from("<BBBBI", pdu) == (0, 0, 128, 0, 128)
    assert struct.unpack_from("<HBBI", pdu, 8) == (0, 0, 0, 0)  # PFV, HPDA, DGST, MAXR2T
    assert pdu[16:] == bytes(112)


@pytest.mark.parametrize(("header", "data", "dgst"),
                         [(False, False, 0), (True, False, 1), (False, True, 2), (True, True, 3)])
def test_icreq_digests(header, data, dgst):
    assert icreq_pdu(header_digest=header, data_digest=data)[11] == dgst


def test_icreq_hpda_and_maxr2t():
    pdu = icreq_pdu(hpda=2, maxr2t=7)
    assert pdu[10] == 2 and struct.unpack_from("<I", pdu, 12) == (7,)


# --- ICResp ---------------------------------------------------------------------------------------


def test_parse_icresp():
    resp = parse_icresp(icresp(cpda=1, dgst=3, maxh2cdata=131072))
    assert resp == ICResp(pfv=0, cpda=1, header_digest=True, data_digest=True,
                          maxh2cdata=131072)


def test_parse_icresp_data_digest_only():
    resp = parse_icresp(icresp(dgst=2))
    assert not resp.header_digest and resp.data_digest


@pytest.mark.parametrize("length", [0, 8, 127, 129])
def test_parse_icresp_wrong_length(length):
    with pytest.raises(ValueError, match=f"ICResp must be 128 bytes, got {length}"):
        parse_icresp(bytes(length))


@pytest.mark.parametrize("fields", [{"pdu_type": 0}, {"hlen": 24}, {"plen": 256}])
def test_parse_icresp_not_an_icresp(fields):
    with pytest.raises(ValueError, match="not an ICResp PDU"):
        parse_icresp(icresp(**fields))


# --- probe ----------------------------------------------------------------------------------------


class OneShotServer:
    """A listener on 127.0.0.1 that reads one ICReq and answers with ``reply`` (then closes)."""

    def __init__(self, reply: bytes, chunks: int = 1) -> None:
        self.reply = reply
        self.chunks = chunks
        self.received = b""
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(TIMEOUT)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(TIMEOUT)
            while len(self.received) < 128:
                chunk = conn.recv(128 - len(self.received))
                if not chunk:
                    break
                self.received += chunk
            step = -(-len(self.reply) // self.chunks) if self.reply else 1
            for at in range(0, len(self.reply), step):
                conn.sendall(self.reply[at:at + step])

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.thread.join(TIMEOUT)
        self.sock.close()
        assert not self.thread.is_alive()


def test_probe_gets_icresp():
    with OneShotServer(icresp(cpda=2, maxh2cdata=65536)) as server:
        resp = probe("127.0.0.1", server.port, timeout=TIMEOUT)
    assert resp.cpda == 2 and resp.maxh2cdata == 65536
    assert server.received == icreq_pdu()


def test_probe_reassembles_a_split_icresp():
    with OneShotServer(icresp(maxh2cdata=4096), chunks=4) as server:
        assert probe("127.0.0.1", server.port, timeout=TIMEOUT).maxh2cdata == 4096


def test_probe_peer_closes_early():
    with OneShotServer(icresp()[:40]) as server:
        with pytest.raises(ConnectError, match="closed the connection before its ICResp"):
            probe("127.0.0.1", server.port, timeout=TIMEOUT)


def test_probe_closed_port():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    with pytest.raises(ConnectError, match=f"NVMe/TCP probe of 127.0.0.1:{port} failed"):
        probe("127.0.0.1", port, timeout=TIMEOUT)


# --- queues against a fake target -----------------------------------------------------------------

HANG_GUARD = 30


def with_target(test, *, transport_kw=None, target_class=None, **target_kw):
    """Run ``test(target, transport, queue)`` with an I/O queue to a fresh fake target."""

    async def main():
        target = (target_class or FakeTcpTarget)(**target_kw)
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(target.serve)
                transport = TcpTransport("127.0.0.1", port, **(transport_kw or {}))
                try:
                    queue = await transport.connect_queue(nursery, 1, 32, in_capsule_bytes=4096)
                    await test(target, transport, queue)
                finally:
                    await transport.drop_queues()
                    transport.close()
                    nursery.cancel_scope.cancel()

    trio.run(main)


async def write(queue, transport, slba: int, data: bytes):
    buf = host_buffer(transport.register, len(data))
    buf.view[:] = data
    return await queue.execute(cmd.write(1, slba, len(data) // LBA, NULL_SGL),
                               buf.ref(), to_controller=True, timeout=5)


async def read(queue, transport, slba: int, length: int) -> tuple[bytes, object]:
    buf = host_buffer(transport.register, length)
    buf.view[:] = b"\xee" * length
    completion = await queue.execute(cmd.read(1, slba, length // LBA, NULL_SGL),
                                     buf.ref(), timeout=5)
    return bytes(buf.view), completion


def test_a_reused_slot_carries_a_new_command_id_and_a_late_answer_for_the_old_one_fails():
    """Command IDs with a generation (the kernel's nvme_cid): a duplicate CapsuleResp of an
    earlier command, after its slot was reused, names an ID not in flight."""
    async def test(target, transport, queue):
        cids = []
        for _ in range(3):
            _, completion = await read(queue, transport, 0, LBA)
            cids.append(completion.command_id)
        mask = queue._ids.mask
        assert len(set(cids)) == 3 and len({cid & mask for cid in cids}) == 1
        # The target's own send of that answer may not have returned yet (its bytes are
        # already here): once every task waits, its stream is free for ours.
        await trio.testing.wait_all_tasks_blocked()
        await target.streams[-1].send_all(target._response(cids[-1], 0))
        with pytest.raises(TransportError, match=f"CapsuleResp for command ID {cids[-1]}, "
                                                 "which is not in flight"):
            await read(queue, transport, 0, LBA)

    with_target(test)


DIGESTS = [{}, {"header_digest": True}, {"data_digest": True},
           {"header_digest": True, "data_digest": True}]


@pytest.mark.parametrize("digests", DIGESTS, ids=["none", "header", "data", "both"])
def test_writes_inline_and_by_r2t_read_back(digests):
    rng = random.Random(1)

    async def test(target, transport, queue):
        small, large = rng.randbytes(4096), rng.randbytes(40 * 1024)
        assert (await write(queue, transport, 0, small)).ok
        assert (await write(queue, transport, 100, large)).ok
        assert target.h2c_lengths == [8192] * 5  # the large one by R2T, split at MAXH2CDATA
        assert target.data[:4096] == small and target.data[100 * LBA:][:len(large)] == large
        got, completion = await read(queue, transport, 100, len(large))
        assert got == large and completion.ok and completion.command_id & queue._ids.mask < 31
        assert (target.hdgst, target.ddgst) == (bool(digests.get("header_digest")),
                                                bool(digests.get("data_digest")))

    with_target(test, transport_kw=digests)


def test_commands_carry_the_transport_sgls():
    async def test(target, transport, queue):
        await write(queue, transport, 0, bytes(4096))  # in-capsule
        await write(queue, transport, 0, bytes(8192))  # R2T
        await read(queue, transport, 0, 512)
        sgls = [sqe[24:40] for sqe in target.commands]
        assert sgls[0] == struct.pack("<QI3xB", 0, 4096, 0x01)
        assert sgls[1] == struct.pack("<QI3xB", 0, 8192, 0x5A)
        assert sgls[2] == struct.pack("<QI3xB", 0, 512, 0x5A)

    with_target(test)


@pytest.mark.parametrize("kw", [{"success_flag": True}, {"c2h_pieces": 3}, {"pad": 8},
                                {"cpda": 3}], ids=["success", "pieces", "pdo-pad", "cpda"])
def test_reads_in_the_forms_a_target_may_send(kw):
    data = random.Random(2).randbytes(12 * 1024)

    async def test(target, transport, queue):
        target.data[:len(data)] = data
        got, completion = await read(queue, transport, 0, len(data))
        assert got == data and completion.ok
        assert (await write(queue, transport, 0, data[:1024])).ok  # padded for CPDA
        assert target.data[:1024] == data[:1024]

    with_target(test, **kw)


async def read_lbas_at_once(target, transport, queue, count: int) -> list[int]:
    """Fill LBAs 0..count-1 with their own number, read them all concurrently: the wrong ones."""
    for i in range(count):
        target.data[i * LBA:(i + 1) * LBA] = bytes([i]) * LBA
    wrong = []

    async def one(i):
        got, _ = await read(queue, transport, i, LBA)
        if got != bytes([i]) * LBA:
            wrong.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    return wrong


def test_many_pipelined_commands_each_get_their_own_data():
    async def test(target, transport, queue):
        wrong = await read_lbas_at_once(target, transport, queue, 64)
        assert wrong == [] and queue.available == 31

    with_target(test)


class CountingSocket:
    """A queue's socket that counts ``sendmsg`` calls, or refuses every send (``full``)."""

    def __init__(self, sock, *, full: bool = False) -> None:
        self.sock = sock
        self.full = full
        self.sendmsgs = 0

    def sendmsg(self, buffers, *args):
        self.sendmsgs += 1
        if self.full:
            raise BlockingIOError
        return self.sock.sendmsg(buffers, *args)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_capsules_submitted_together_go_out_in_one_sendmsg():
    async def test(target, transport, queue):
        queue.sock = counting = CountingSocket(queue.sock)
        wrong = await read_lbas_at_once(target, transport, queue, 16)
        # the first alone, at once; the fifteen submitted with it in the same trio batch
        # together, by the sender
        assert wrong == [] and counting.sendmsgs == 2 and len(target.commands) == 16

    with_target(test)


def test_a_command_that_cannot_be_sent_fails_the_queue_by_name_at_its_timeout():
    async def test(target, transport, queue):
        queue.sock = CountingSocket(queue.sock, full=True)
        buf = host_buffer(transport.register, 4096)
        with pytest.raises(TransportError, match=r"^I/O queue 1: command \d+ could not be "
                                                 r"sent within 0.2 s$"):
            await queue.execute(cmd.write(1, 0, 8, NULL_SGL), buf.ref(), to_controller=True,
                                timeout=0.2)
        with pytest.raises(TransportError, match="could not be sent"):
            await queue.execute(cmd.flush(1), timeout=5)
        assert target.commands == []

    with_target(test)


@pytest.mark.parametrize("splice", [True, False, None], ids=["spliced", "copied", "default"])
@pytest.mark.parametrize("digests", [{}, {"header_digest": True, "data_digest": True}],
                         ids=["plain", "digests"])
def test_large_write_data_is_copied_or_spliced_into_the_socket_and_lands(splice, digests,
                                                                         monkeypatch):
    """Copied unless the transport is asked to splice."""
    from nvmeof_fuse.nvme import tcp_pdu as pdu
    from nvmeof_fuse.transport.tcp import queue as tcp_queue
    from nvmeof_fuse.transport.tcp import splice as splicing

    spliced, threaded = [], []
    send, send_pdus = splicing.Splicer.send, tcp_queue.send_pdus

    def counting(self, fd, data, more=False):
        sent = send(self, fd, data, more)
        spliced.append((sent, more))
        return sent

    def handed(sock, splicer, pdus):
        threaded.extend(buffers[0][0] for buffers in pdus)  # each PDU's type
        return send_pdus(sock, splicer, pdus)

    monkeypatch.setattr(splicing.Splicer, "send", counting)
    monkeypatch.setattr(tcp_queue, "send_pdus", handed)
    data = random.Random(5).randbytes(768 * 1024)

    async def test(target, transport, queue):
        assert (await write(queue, transport, 8, data)).ok
        assert target.h2c_lengths == [512 * 1024, 256 * 1024]
        assert target.data[8 * LBA:8 * LBA + len(data)] == data
        assert sum(sent for sent, _ in spliced) == (len(data) if splice else 0)
        # the thread sends each H2CData PDU whole, header and data, pushed after the last
        assert threaded == [pdu.H2C_DATA] * 2
        if splice:  # MSG_MORE but for the last bytes (with digests: the digest after it)
            assert [more for _, more in spliced] == [True] * (len(spliced) - 1) + [bool(digests)]
        got, _ = await read(queue, transport, 8, len(data))
        assert got == data

    spliced_kw = {} if splice is None else {"splice": splice}
    with_target(test, transport_kw={**spliced_kw, **digests}, maxh2cdata=512 * 1024)


def test_a_failing_splice_fails_the_queue_by_name(monkeypatch):
    import errno

    from nvmeof_fuse.transport.tcp import splice as splicing

    def failing(self, fd, data, more=False):
        raise OSError(errno.EIO, "vmsplice: Input/output error")

    monkeypatch.setattr(splicing.Splicer, "send", failing)

    async def test(target, transport, queue):
        with pytest.raises(TransportError, match=r"^I/O queue 1: sending to 127.0.0.1:\d+ "
                                                 r"failed: vmsplice: Input/output error$"):
            await write(queue, transport, 0, bytes(128 * 1024))

    with_target(test, transport_kw={"splice": True}, maxh2cdata=512 * 1024)


def count_threads(monkeypatch) -> list[str]:
    """Bulk sends handed to worker threads, and C2HData PDUs read (``c2h_data`` of more
    than BULK_BYTES, ``small_c2h_data`` the others), as they start, with whether on the
    main (trio) thread."""
    from nvmeof_fuse.transport.tcp import data as tcp_data
    from nvmeof_fuse.transport.tcp import reader as tcp_reader

    started = []

    def counted(name, fn):
        def counting(*args):
            if name == "c2h_data" and args[1].length <= tcp_data.BULK_BYTES:
                name_ = "small_c2h_data"
            else:
                name_ = name
            started.append((name_, threading.current_thread() is threading.main_thread()))
            return fn(*args)
        return counting

    monkeypatch.setattr(tcp_data, "send_exactly", counted("send_exactly", tcp_data.send_exactly))
    monkeypatch.setattr(tcp_reader.PduReader, "_c2h_data",
                        counted("c2h_data", tcp_reader.PduReader._c2h_data))
    return started


@pytest.mark.parametrize("digests", DIGESTS, ids=["none", "header", "data", "both"])
def test_bulk_payloads_move_in_worker_threads_between_small_pdus(digests, monkeypatch):
    started = count_threads(monkeypatch)
    rng = random.Random(6)
    big = [rng.randbytes(256 * 1024) for _ in range(4)]
    small = rng.randbytes(16 * LBA)

    async def test(target, transport, queue):
        for i, data in enumerate(big):
            assert (await write(queue, transport, i * 1024, data)).ok
        target.data[4096 * LBA:4096 * LBA + len(small)] = small
        wrong = []

        async def one(slba, want):  # bulk and small reads pipelined on one connection
            got, completion = await read(queue, transport, slba, len(want))
            if got != want or not completion.ok:
                wrong.append(slba)

        async with trio.open_nursery() as nursery:
            for i, data in enumerate(big):
                nursery.start_soon(one, i * 1024, data)
                for j in range(4):
                    at = 4096 + 4 * j
                    nursery.start_soon(one, at, small[4 * j * LBA:4 * (j + 1) * LBA])
        assert wrong == [] and queue.available == 31
        # large payloads are read by the queue's receiver thread; the small ones between
        # them too while it runs, otherwise on the trio thread
        assert started[:4] == [("send_exactly", False)] * 4
        names = sorted(name for name, _ in started[4:])
        assert names == ["c2h_data"] * 4 + ["small_c2h_data"] * 16
        assert ("c2h_data", True) not in started

    with_target(test, transport_kw=digests, maxh2cdata=1 << 20, size=4 << 20)


@pytest.mark.parametrize("digests", DIGESTS, ids=["none", "header", "data", "both"])
def test_pipelined_bulk_writes_sent_together_by_one_thread_all_land(digests):
    rng = random.Random(7)
    big = [rng.randbytes(256 * 1024) for _ in range(6)]
    small = [rng.randbytes(8 * LBA) for _ in range(6)]

    async def test(target, transport, queue):
        async with trio.open_nursery() as nursery:  # R2Ts answered back to back
            for i in range(6):
                nursery.start_soon(write, queue, transport, i * 1024, big[i])
                nursery.start_soon(write, queue, transport, 8192 + i * 64, small[i])
        for i in range(6):
            assert (await read(queue, transport, i * 1024, len(big[i])))[0] == big[i]
            assert (await read(queue, transport, 8192 + i * 64, len(small[i])))[0] == small[i]
        assert queue.available == 31

    with_target(test, transport_kw=digests, maxh2cdata=1 << 17, size=8 << 20)


def test_small_reads_stay_on_the_trio_thread_and_return_there_after_bulk(monkeypatch):
    started = count_threads(monkeypatch)

    async def test(target, transport, queue):
        for _ in range(3):
            await read(queue, transport, 0, 4096)
        assert started == [("small_c2h_data", True)] * 3 and queue._threads == 0
        await read(queue, transport, 0, 256 * 1024)
        assert started[-1] == ("c2h_data", False)
        while queue._threads:  # the receiver thread hands back once the stream is quiet
            await trio.sleep(0.01)
        started.clear()
        await read(queue, transport, 0, 4096)
        assert started == [("small_c2h_data", True)]

    with_target(test)


def test_a_bad_data_digest_on_a_bulk_payload_is_named(monkeypatch):
    started = count_threads(monkeypatch)

    async def test(target, transport, queue):
        target.fault = "data digest"
        with pytest.raises(TransportError, match=r"^I/O queue 1: data digest mismatch on "
                                                 r"C2HData for command \d+ \(got "):
            await read(queue, transport, 0, 512 * 1024)
        assert started == [("c2h_data", False)]

    with_target(test, transport_kw={"data_digest": True})


@pytest.mark.parametrize("fault, message", [
    ("stall", r"^I/O queue 1: command \d+'s data did not all arrive within 0.5 s$"),
    ("cut", r"^I/O queue 1: 127.0.0.1:\d+ closed the connection$")])
def test_a_bulk_payload_that_stops_halfway_fails_the_queue_by_name(fault, message):
    async def test(target, transport, queue):
        target.fault = fault
        buf = host_buffer(transport.register, 512 * 1024)
        with pytest.raises(TransportError, match=message):
            await queue.execute(cmd.read(1, 0, 1024, NULL_SGL), buf.ref(), timeout=0.5)
        assert queue._threads == 0 and queue.sock.fileno() == -1  # closed once the thread ended

    with_target(test)


def test_stopping_a_queue_ends_a_bulk_receive_at_once():
    async def test(target, transport, queue):
        target.fault = "stall"
        errors = []

        async def reading():
            try:
                await read(queue, transport, 0, 512 * 1024)
            except TransportError as exc:
                errors.append(str(exc))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reading)
            while queue.reader.mid_payload is None:  # the receiver thread
                await trio.sleep(0.01)  # waits for the payload's second half
            with trio.fail_after(2):  # far below the command's timeout (5 s)
                await transport.drop_queues()
        assert errors == ["I/O queue 1: stopped"]

    with_target(test)


@pytest.mark.parametrize("target_kw", [{}, {"success_flag": True, "c2h_pieces": 3}],
                         ids=["response", "success flag"])
def test_only_the_trio_thread_changes_a_request(target_kw, monkeypatch):
    """The receiver thread hands over (request, completion) and (request, R2T) pairs; it
    never writes a request, which the trio thread alone changes."""
    from nvmeof_fuse.transport.tcp import queue as tcp_queue

    elsewhere = []

    class Watched(tcp_queue.Request):
        __slots__ = ()

        def __setattr__(self, name, value):
            if threading.current_thread() is not threading.main_thread():
                elsewhere.append(name)
            super().__setattr__(name, value)

    monkeypatch.setattr(tcp_queue, "Request", Watched)
    started = count_threads(monkeypatch)
    rng = random.Random(8)
    big = [rng.randbytes(256 * 1024) for _ in range(4)]

    async def test(target, transport, queue):
        wrong = []

        async def one(i):  # bulk writes (R2Ts), bulk and small reads, pipelined
            assert (await write(queue, transport, i * 1024, big[i])).ok
            got, completion = await read(queue, transport, i * 1024, len(big[i]))
            small, _ = await read(queue, transport, i * 1024, 4096)
            if got != big[i] or small != big[i][:4096] or not completion.ok:
                wrong.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        assert wrong == [] and queue.available == 31
        assert ("c2h_data", False) in started  # the receiver thread read them
        assert elsewhere == []

    with_target(test, maxh2cdata=1 << 20, size=4 << 20, **target_kw)


def test_an_answer_handed_over_but_not_yet_handled_is_no_timeout():
    """The watchdog first takes what the threads handed over: an answer that waits for the
    trio thread when the deadline passes lets its caller go with it, not a timeout."""
    from nvmeof_fuse.nvme import Completion

    class HeldWakeups:
        def run_sync_soon(self, fn, *args):
            pass

    async def test(target, transport, queue):
        target.fault = "silent"
        done = []

        async def flushing():
            done.append(await queue.execute(cmd.flush(1), timeout=5))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flushing)
            await trio.testing.wait_all_tasks_blocked()
            [request] = queue._pending.values()
            queue._mailbox._token = HeldWakeups()  # nothing handed over but by drain()
            answer = Completion(0, 0, 1, request.cid, 0, False)
            await trio.to_thread.run_sync(queue._mailbox.post, [(request, answer)])
            queue._expire(math.inf)  # every deadline has passed
        assert done == [answer] and queue._failed is None and queue.available == 31

    with_target(test)


def test_a_second_response_read_by_the_receiver_thread_fails_the_queue_by_name():
    async def test(target, transport, queue):
        target.data[:512 * 1024] = random.Random(9).randbytes(512 * 1024)
        target.fault = "twice"
        got, completion = await read(queue, transport, 0, 512 * 1024)
        assert got == target.data[:512 * 1024] and completion.ok  # the first answer
        with pytest.raises(TransportError, match=r"^I/O queue 1: (second response for command "
                                                 r"ID \d+|CapsuleResp for command ID \d+, "
                                                 r"which is not in flight)$"):
            await queue.execute(cmd.flush(1), timeout=5)

    with_target(test)


def test_registered_memory_without_a_view_is_received_in_place():
    import numpy as np

    async def test(target, transport, queue):
        target.data[:4096] = bytes(range(256)) * 16
        array = np.zeros(4096, dtype=np.uint8)
        from nvmeof_fuse.host.memory import Region, buffer_address

        addr, length, owner = buffer_address(array)
        region = Region(addr, length, transport.register(addr, length, owner), owner)
        assert region.view is None
        assert (await queue.execute(cmd.read(1, 0, 8, NULL_SGL), region.ref(),
                                    timeout=5)).ok
        assert array.tobytes() == bytes(range(256)) * 16

    with_target(test)


@pytest.mark.parametrize("size", [4096, 512 * 1024], ids=["trio thread", "receiver thread"])
def test_an_answered_command_holds_no_caller_memory(size):
    import gc
    import weakref

    import numpy as np

    from nvmeof_fuse.host.memory import Region, buffer_address

    async def test(target, transport, queue):
        array = np.zeros(size, dtype=np.uint8)
        addr, length, owner = buffer_address(array)
        region = Region(addr, length, transport.register(addr, length, owner), owner)
        assert (await queue.execute(cmd.read(1, 0, size // LBA, NULL_SGL), region.ref(),
                                    timeout=5)).ok
        gone = weakref.ref(array)
        region.close()
        del array, owner, region
        gc.collect()
        assert gone() is None  # the queue kept nothing of the answered read
        assert (await queue.execute(cmd.flush(1), timeout=5)).ok  # its command ID reused

    with_target(test)


def test_a_failed_command_holds_no_caller_memory():
    """The queue's error is raised to every caller of the failed queue: it must not carry a
    caller's frame (its DataRef) on its traceback, nor the reader's (the request it parsed)."""
    import gc
    import weakref

    import numpy as np

    from nvmeof_fuse.host.memory import Region, buffer_address

    async def failing_read(queue, transport) -> weakref.ref:
        array = np.zeros(4096, dtype=np.uint8)
        addr, length, owner = buffer_address(array)
        region = Region(addr, length, transport.register(addr, length, owner), owner)
        try:
            await queue.execute(cmd.read(1, 0, 8, NULL_SGL), region.ref(), timeout=5)
        except TransportError:
            pass
        region.close()
        return weakref.ref(array)

    async def test(target, transport, queue):
        target.fault = "data digest"  # raised while the reader holds the request
        first = await failing_read(queue, transport)
        second = await failing_read(queue, transport)  # refused by the failed queue
        gc.collect()
        assert first() is None and second() is None  # the failed queue keeps neither
        with pytest.raises(TransportError, match="data digest mismatch"):
            await queue.execute(cmd.flush(1), timeout=5)

    with_target(test, transport_kw={"data_digest": True})


FAULTS = {
    "header digest": ("header_digest", r"header digest mismatch on C2HData PDU"),
    "data digest": ("data_digest", r"data digest mismatch on C2HData for command \d+"),
    "length": (None, r"C2HData PDU length \d+ disagrees with its header"),
    "unknown type": (None, r"unknown PDU type 0xc from the controller"),
    "unknown command": (None, r"C2HData for command ID \d+, which is not in flight"),
    "term req": (None, r"ended the connection with a C2HTermReq \(header digest error\)"),
    "close": (None, r"127.0.0.1:\d+ closed the connection"),
    "offset": (None, r"C2HData for command \d+ at offset 0, expected 2048"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_broken_pdu_fails_the_queue_by_name_and_a_new_connection_works(fault):
    digest, message = FAULTS[fault]
    kw = {digest: True} if digest else {}
    data = random.Random(3).randbytes(4096)

    async def test(target, transport, queue):
        target.data[:4096] = data
        target.fault = "silent"  # for the first command: it stays in flight
        buf = host_buffer(transport.register, 4096)
        buf.view[:] = b"\xee" * 4096
        others = []

        async def waiting():  # a second command in flight fails too, not hangs
            try:
                await queue.execute(cmd.flush(1), timeout=5)
            except TransportError as exc:
                others.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiting)
            await trio.testing.wait_all_tasks_blocked()
            target.fault = fault
            with pytest.raises(TransportError, match=message) as info:
                await queue.execute(cmd.read(1, 0, 8, NULL_SGL), buf.ref(), timeout=5)
        assert "\n" not in str(info.value) and str(info.value).startswith("I/O queue 1: ")
        assert len(others) == 1
        assert queue.available == 0
        with pytest.raises(TransportError, match=message):
            await queue.execute(cmd.flush(1), timeout=5)
        # what the controller does to reconnect: drop the queues, connect again
        await transport.drop_queues()
        async with trio.open_nursery() as nursery:
            again = await transport.connect_queue(nursery, 1, 32, in_capsule_bytes=4096)
            got, completion = await read(again, transport, 0, 4096)
            assert got == data and completion.ok
            nursery.cancel_scope.cancel()
        assert target.connections == 2

    with_target(test, transport_kw=kw)


def test_a_plen_past_the_last_bytes_sent_is_named_not_waited_for():
    """A read that ends with its C2HData (SUCCESS) has nothing behind it: a PLEN claiming
    more is refused from the header, not waited for until the command times out."""
    async def test(target, transport, queue):
        target.fault = "length"
        with pytest.raises(TransportError, match=r"^I/O queue 1: C2HData PDU length \d+ "
                                                 r"disagrees with its header"):
            await read(queue, transport, 0, 4096)

    with_target(test, success_flag=True)


def test_a_command_without_an_answer_times_out_by_name_and_closes_its_queue():
    async def test(target, transport, queue):
        target.fault = "silent"
        with pytest.raises(CommandTimeout, match=r"^I/O queue 1: command \d+ got no completion "
                                                 r"within 0.2 s \(its connection is closed\)$"):
            await queue.execute(cmd.flush(1), timeout=0.2)
        with pytest.raises(TransportError, match=r"^I/O queue 1: closed as command \d+ timed "
                                                 r"out \(the target may still move its data\)$"):
            await queue.execute(cmd.flush(1), timeout=5)

    with_target(test)


def test_started_commands_end_through_their_callbacks_with_their_own_data():
    """Queue.start: no task waits; the trio thread calls each back once its data is in
    place (reads) or taken (writes, inline and by R2T)."""
    async def test(target, transport, queue):
        bufs, ends = [], CommandEnds()
        for i in range(16):
            target.data[i * LBA:(i + 1) * LBA] = bytes([i]) * LBA
            buf = host_buffer(transport.register, LBA)
            bufs.append(buf)
            assert queue.start(cmd.read(1, i, 1, NULL_SGL), buf.ref(), ends, timeout=5)
        big = host_buffer(transport.register, 40 * 1024)
        big.view[:] = b"\x7f" * (40 * 1024)
        assert queue.start(cmd.write(1, 100, 40 * 1024 // LBA, NULL_SGL), big.ref(),
                           ends, to_controller=True, timeout=5)
        await ends.wait_for(17)
        assert all(r.completion.ok and r.error is None for r in ends)
        assert [bytes(b.view) for b in bufs] == [bytes([i]) * LBA for i in range(16)]
        assert target.data[100 * LBA:][:40 * 1024] == b"\x7f" * (40 * 1024)
        assert queue.available == 31

    with_target(test)


def test_a_command_issued_as_the_queue_is_cancelled_fails_with_it():
    """The idle sender, once cancelled, is already due to run: a command issued in that same
    trio batch must not reschedule it a second time."""
    async def test(target, transport, queue):
        await trio.testing.wait_all_tasks_blocked()  # the sender idles
        queue._receiver.cancel()  # no checkpoint from here on: it is due to run, not run yet
        assert not queue.start(cmd.flush(1), None, CommandEnds(), timeout=5)
        with pytest.raises(TransportError, match=r"^I/O queue 1: stopped$"):
            await queue.execute(cmd.flush(1), timeout=5)

    with_target(test)


def test_a_started_command_without_an_answer_times_out_through_its_callback():
    async def test(target, transport, queue):
        target.fault = "silent"
        ends = CommandEnds()
        assert queue.start(cmd.flush(1), None, ends, timeout=0.2)
        await ends.wait_for(1)
        assert isinstance(ends[0].error, CommandTimeout) and "connection is closed" in str(
            ends[0].error)
        assert not queue.start(cmd.flush(1), None, ends, timeout=5)  # failed: no more

    with_target(test)


def test_queue_sockets_close_with_a_reset_as_linux_does():
    """SO_LINGER 0 (Linux sock_no_linger): closing drops spliced data still queued, which
    refers to the pages of a caller that a failed queue lets go."""
    async def test(target, transport, queue):
        assert struct.unpack("ii", queue.sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                         8)) == (1, 0)

    with_target(test)


def test_an_error_answering_an_r2t_fails_the_queue_by_name(monkeypatch):
    """R2Ts are answered in a batch callback; an error there fails the queue, not the run."""
    from nvmeof_fuse.transport.tcp import transport as tcp

    def broken(*args):
        raise ValueError("no pieces today")

    monkeypatch.setattr(tcp.pdu, "h2c_pieces", broken)

    async def test(target, transport, queue):
        with pytest.raises(TransportError, match=r"^I/O queue 1: no pieces today$"):
            await write(queue, transport, 100, bytes(40 * 1024))  # past in-capsule: by R2T

    with_target(test)


@pytest.mark.parametrize(("size", "r2t_bytes"), [(40 * 1024, 16384), (256 * 1024, 65536)],
                         ids=["trio thread", "receiver thread"])
def test_a_write_asked_for_in_several_r2ts_lands_whole(size, r2t_bytes):
    """As SPDK's target asks: an R2T of at most ``r2t_bytes``, the next once its data came;
    the success after the last counts all of them (issue #56's check lets it through)."""
    data = random.Random(3).randbytes(size)

    async def test(target, transport, queue):
        assert (await write(queue, transport, 8, data)).ok
        assert target.data[8 * LBA:8 * LBA + size] == data
        assert sum(target.h2c_lengths) == size

    with_target(test, r2t_bytes=r2t_bytes, maxh2cdata=65536)


class AnswersWritesAtOnce(FakeTcpTarget):
    """Sends a write's R2T and its success together, before the data can have come."""

    async def _r2t(self, stream, cid, length, offset=0):
        await super()._r2t(stream, cid, length, offset)
        await self._respond(stream, cid, 0)


def test_a_write_answered_while_its_h2cdata_waits_to_be_sent_fails_the_queue():
    """A success read while the write's data still waits in our queue for the socket (here
    held back on purpose) cannot be true: the queue fails, naming the lie (issue #56)."""
    from nvmeof_fuse.transport.tcp import queue as tcp_queue

    async def test(target, transport, queue):
        answer_r2t = queue._send_h2c

        def held_back(request, header):
            queue._flush_locked = lambda: tcp_queue._BLOCKED  # the socket takes nothing more
            answer_r2t(request, header)

        queue._send_h2c = held_back
        with pytest.raises(TransportError, match=r"^I/O queue 1: CapsuleResp for command \d+ "
                                                 r"claims success for a write before all its "
                                                 r"data was sent$"):
            await write(queue, transport, 100, bytes(8192))  # past in-capsule: by R2T

    with_target(test, target_class=AnswersWritesAtOnce)


@pytest.mark.parametrize("opcode", ["read", "write"])
def test_late_data_for_a_timed_out_command_never_reaches_its_reused_buffer(opcode):
    """As Linux (nvme_tcp_timeout: the queue is stopped before the request completes): the
    caller gets its buffer back only once no C2HData can land in it, no R2T read it."""
    async def test(target, transport, queue):
        target.data[:4096] = b"\x11" * 4096
        buf = host_buffer(transport.register, 4096)
        buf.view[:] = b"\x22" * 4096
        target.fault = "late"
        reads = opcode == "read"
        sqe = (cmd.read if reads else cmd.write)(1, 0, 8, NULL_SGL)
        with pytest.raises(CommandTimeout):
            await queue.execute(sqe, buf.ref(), to_controller=not reads, timeout=0.2)
        buf.view[:] = b"\x33" * 4096  # the caller reuses its buffer at once
        target.release.set()
        await target.late_sent.wait()
        try:  # answered after the late PDUs if the connection were still open
            await queue.execute(cmd.flush(1), timeout=5)
        except TransportError:
            pass
        assert bytes(buf.view) == b"\x33" * 4096, "late C2HData landed in a reused buffer"
        assert target.data[:4096] == b"\x11" * 4096, "a late R2T read a reused buffer"

    with_target(test)


def test_connection_refused_is_one_line():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]

    async def main():
        async with trio.open_nursery() as nursery:
            with pytest.raises(ConnectError) as info:
                await TcpTransport("127.0.0.1", port).connect_queue(nursery, 0, 32)
        return str(info.value)

    assert trio.run(main) == (f"NVMe/TCP admin queue connect to 127.0.0.1:{port} refused: "
                              "is an NVMe/TCP port listening there?")


def test_a_host_traddr_that_is_not_local_is_named():
    async def main():
        async with trio.open_nursery() as nursery:
            with pytest.raises(ConnectError, match="--host-traddr 192.0.2.7 is not a local"):
                await TcpTransport("127.0.0.1", 9, host_traddr="192.0.2.7").connect_queue(
                    nursery, 0, 32)

    trio.run(main)


def test_an_icresp_with_a_digest_not_asked_for_is_refused():
    with OneShotServer(icresp(dgst=1)) as server:
        async def main():
            async with trio.open_nursery() as nursery:
                with pytest.raises(ConnectError, match=r"127.0.0.1:\d+ answered with ICResp "
                                                       "enables a header digest the host did "
                                                       "not ask for"):
                    await TcpTransport("127.0.0.1", server.port).connect_queue(nursery, 0, 32)

        trio.run(main)


# --- the controller over TCP, against the fake target ---------------------------------------------


def with_controller(test, *, digests=False, timeout=30.0, **target_kw):
    from tcp_target import NQN

    from nvmeof_fuse.host.controller import ConnectOptions, connect

    async def main():
        target = FakeTcpTarget(**target_kw)
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(target.serve)
                options = ConnectOptions("127.0.0.1", NQN, transport="tcp", trsvcid=port,
                                         reconnect_delay=1, keep_alive_tmo=0,
                                         hdr_digest=digests, data_digest=digests,
                                         timeout=timeout)
                async with connect(options) as ctrl:
                    await test(target, ctrl)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_controller_comes_up_over_tcp_and_moves_data_many_at_once():
    async def test(target, ctrl):
        assert ctrl.describe()["transport"] == "tcp" and len(ctrl.io_queues) == 2
        ns = ctrl.namespaces[1]
        data = random.Random(4).randbytes(200 * LBA)
        await ns.write_lbas(0, data)  # in-capsule and R2T, across both queues
        wrong = []

        async def one(i):
            if await ns.read_lbas(i, 1) != data[i * LBA:(i + 1) * LBA]:
                wrong.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(one, i)
        assert wrong == []

    with_controller(test, digests=True)


def test_io_queues_disable_sq_flow_control_and_reads_end_with_their_data():
    """As Linux with --disable-sqflow: the I/O queues' Connect sets CATTR bit 2, and the
    controller ends a successful read with its C2HData (SUCCESS flag), no CapsuleResp."""
    async def test(target, ctrl):
        assert target.sqflow_off == [False, True, True]  # admin, I/O 1, I/O 2
        ns = ctrl.namespaces[1]
        data = random.Random(10).randbytes(300 * LBA)
        await ns.write_lbas(0, data)
        assert await ns.read_lbas(0, 300) == data  # in pieces of MDTS, on both queues

    with_controller(test)


@pytest.mark.parametrize("fault", ["header digest", "data digest", "length", "unknown type",
                                   "unknown command"])
def test_a_broken_pdu_makes_the_controller_reconnect_and_the_read_lands(fault, caplog):
    digest = FAULTS[fault][0]

    async def test(target, ctrl):
        ns = ctrl.namespaces[1]
        data = random.Random(5).randbytes(8 * LBA)
        await ns.write_lbas(8, data)
        target.fault = fault
        assert await ns.read_lbas(8, 8) == data  # fails, reconnects, runs again
        assert ctrl.losses == ctrl.reconnects == 1 and target.connections == 6

    with_controller(test, digests=digest is not None)
    lost = [r.getMessage() for r in caplog.records if "lost the connection" in r.getMessage()]
    assert len(lost) == 1, lost
    assert lost[0].startswith("lost the connection to nqn.2026-11.io.nvmeof-fuse:fake-tcp at "
                              "tcp 127.0.0.1:"), lost
    assert re.search(FAULTS[fault][1], lost[0]), lost


def test_a_timed_out_read_makes_the_controller_reconnect_and_the_read_lands(caplog):
    async def test(target, ctrl):
        ns = ctrl.namespaces[1]
        data = random.Random(6).randbytes(8 * LBA)
        await ns.write_lbas(8, data)
        target.fault = "late"  # this read's data is held until after the reconnect
        assert await ns.read_lbas(8, 8) == data
        target.release.set()
        assert ctrl.losses == ctrl.reconnects == 1

    with_controller(test, timeout=0.5)
    lost = [r.getMessage() for r in caplog.records if "lost the connection" in r.getMessage()]
    assert len(lost) == 1 and re.search(r"command \d+ got no completion within 0.5 s", lost[0])


def test_gpu_memory_is_refused_by_name():
    from types import SimpleNamespace

    transport = TcpTransport("192.0.2.1")
    with pytest.raises(TransportError, match=r"^cannot register the dma-buf: NVMe/TCP receives "
                       r"data into host memory only, so GPU memory is staged"):
        transport.register_dmabuf(5, 0, 4096, 1 << 40)
    for owner in (SimpleNamespace(is_cuda=True), SimpleNamespace(__cuda_array_interface__={})):
        with pytest.raises(TransportError, match="^cannot register GPU memory: NVMe/TCP"):
            transport.register(1 << 40, 4096, owner)
    assert transport.register(0, 0, SimpleNamespace(is_cuda=False)).length == 0


def test_an_r2t_for_bulk_data_is_answered_by_the_receiver_thread_itself(monkeypatch):
    """No hand-off to the trio thread and on to another thread: the receiver thread sends
    the H2CData the moment it reads the R2T; a small R2T is still answered by trio."""
    from nvmeof_fuse.transport.tcp import queue as tcp_queue

    senders, answered_by_trio = [], []
    send_pdus, send_h2c = tcp_queue.send_pdus, tcp_queue.TcpQueue._send_h2c

    def sending(sock, splicer, pdus):
        senders.append(threading.current_thread() is threading.main_thread())
        return send_pdus(sock, splicer, pdus)

    def by_trio(self, request, header):
        answered_by_trio.append(header.length)
        return send_h2c(self, request, header)

    monkeypatch.setattr(tcp_queue, "send_pdus", sending)
    monkeypatch.setattr(tcp_queue.TcpQueue, "_send_h2c", by_trio)
    rng = random.Random(11)
    big, small = rng.randbytes(256 * 1024), rng.randbytes(16 * 1024)

    async def test(target, transport, queue):
        assert (await write(queue, transport, 1024, small)).ok  # past in-capsule, not bulk
        assert (await write(queue, transport, 0, big)).ok
        assert senders == [False] and answered_by_trio == [16 * 1024]
        assert (await read(queue, transport, 0, len(big)))[0] == big
        assert (await read(queue, transport, 1024, len(small)))[0] == small

    with_target(test, maxh2cdata=1 << 20)


def test_the_receiver_thread_failing_to_send_h2cdata_in_time_fails_the_queue_by_name(
        monkeypatch):
    from nvmeof_fuse.transport.tcp import data as tcp_data
    from nvmeof_fuse.transport.tcp import queue as tcp_queue

    def stalled(sock, splicer, pdus):
        raise tcp_data.Stalled

    monkeypatch.setattr(tcp_queue, "send_pdus", stalled)

    async def test(target, transport, queue):
        with pytest.raises(TransportError, match=r"^I/O queue 1: sending H2CData for command "
                                                 r"\d+ to 127.0.0.1:\d+: the socket took no "
                                                 r"data within 30 s$"):
            await write(queue, transport, 0, bytes(128 * 1024))

    with_target(test, maxh2cdata=1 << 20)


class HalfSocket:
    """A queue's socket whose first ``sendmsg`` takes 10 bytes, then none until ``open``."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.calls = 0
        self.open = False
        self.refused = trio.Event()  # a send after the partial one was refused

    def sendmsg(self, buffers, *args):
        self.calls += 1
        if self.calls == 1:
            return self.sock.send(bytes(buffers[0][:10]))
        if not self.open:
            self.refused.set()
            raise BlockingIOError
        return self.sock.sendmsg(buffers, *args)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_a_half_sent_capsule_keeps_the_send_lock_until_its_last_byte_went():
    """The receiver thread sends H2CData under the same lock: it must never land in the
    middle of a capsule that the socket took only part of."""
    async def test(target, transport, queue):
        real = queue.sock
        queue.sock = half = HalfSocket(real)
        done = trio.Event()

        async def flush():
            assert (await queue.execute(cmd.flush(1), timeout=5)).ok
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flush)
            await half.refused.wait()
            assert queue._send_lock.locked()  # held by the trio thread across the wait
            assert not queue._send_lock.acquire(timeout=0.01)
            half.open = True
            await done.wait()
        queue.sock = real
        assert not queue._send_lock.locked()
        assert (await write(queue, transport, 0, bytes(128 * 1024))).ok  # by the thread

    with_target(test, maxh2cdata=1 << 20)


def test_a_receiver_thread_waiting_for_the_send_lock_ends_when_its_queue_fails():
    """A command timed out while the receiver thread waits for the send lock (held by the
    trio thread for a half-sent PDU): the queue fails, the thread ends, the caller goes."""
    async def test(target, transport, queue):
        target.fault = "late"  # the R2T waits for target.release
        buf = host_buffer(transport.register, 128 * 1024)
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                async def write_late():
                    with pytest.raises(CommandTimeout, match=r"^I/O queue 1: command \d+ got no "
                                       r"completion within 1 s \(its connection is closed\)$"):
                        await queue.execute(cmd.write(1, 0, 256, NULL_SGL), buf.ref(),
                                            to_controller=True, timeout=1)

                nursery.start_soon(write_late)
                await trio.testing.wait_all_tasks_blocked()  # the capsule went out
                assert queue._send_lock.acquire(False)  # as the trio thread, mid-PDU
                queue._trio_sending = queue._partial = True
                target.release.set()
        assert queue._threads == 0 and not queue._send_lock.locked()

    with_target(test, maxh2cdata=1 << 20)


def test_the_forked_target_serves_each_queue_from_a_process_of_its_own():
    """tests/tcp_target.py's bench mode: one namespace, shared by every connection's process,
    and one controller, whose ID each I/O queue's Connect must name (as nvmet)."""
    import multiprocessing

    from tcp_target import NQN, serve_like_nvmet

    from nvmeof_fuse.host.controller import ConnectOptions, connect

    ports = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(
        target=serve_like_nvmet, args=(ports, 4 << 20), daemon=True)
    child.start()
    try:
        port = ports.get(timeout=30)

        async def main():
            options = ConnectOptions("127.0.0.1", NQN, transport="tcp", trsvcid=port,
                                     reconnect_delay=1, keep_alive_tmo=0, nr_io_queues=4)
            with trio.fail_after(HANG_GUARD):
                async with connect(options) as ctrl:
                    assert len(ctrl.io_queues) == 4 and ctrl.lease_qids  # to lease
                    ns = ctrl.namespaces[1]
                    data = random.Random(11).randbytes(64 * LBA)
                    await ns.write_lbas(0, data)  # spread over the queues' processes

                    async def check(i):
                        assert await ns.read_lbas(i * 8, 8) == data[i * 8 * LBA:(i + 1) * 8 * LBA]

                    async with trio.open_nursery() as nursery:
                        for i in range(8):
                            nursery.start_soon(check, i)
                    pids = children(child.pid)
                    assert len(pids) == 5, pids  # the admin queue and four I/O queues

        trio.run(main)
    finally:
        child.terminate()
        child.join(10)




def _local_device_after_connect(**kw) -> object:
    with OneShotServer(icresp()) as server:
        async def main():
            transport = TcpTransport("127.0.0.1", server.port, **kw)
            async with trio.open_nursery() as nursery:
                queue = await transport.connect_queue(nursery, 0, 32)
                queue.close()
                nursery.cancel_scope.cancel()
            return transport.local_device

        return trio.run(main)


def test_the_netdev_a_connection_goes_through_is_known():
    assert _local_device_after_connect() == LocalDevice("net", "lo")  # from its route
    assert _local_device_after_connect(host_iface="lo") == LocalDevice("net", "lo")  # bound


def test_a_host_iface_that_is_no_interface_is_named():
    async def main():
        async with trio.open_nursery() as nursery:
            with pytest.raises(ConnectError, match=r"connect to 127.0.0.1:9 failed: host_iface "
                                                   r"nosuch0 is no network interface here$"):
                await TcpTransport("127.0.0.1", 9, host_iface="nosuch0").connect_queue(
                    nursery, 0, 32)

    trio.run(main)


def test_an_address_names_the_interface_that_holds_it():
    assert interface_of("127.0.0.1") == "lo" and interface_of("::ffff:127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None and interface_of("not an address") is None
