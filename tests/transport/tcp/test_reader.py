"""PduReader alone: PDUs written into one end of a socket pair, read from the other.

The queue around it is faked by a small owner (the ReaderOwner protocol); the queue with
the reader inside is tested against a fake target in test_tcp.py.
"""

from __future__ import annotations

import socket
import struct
import threading
from types import SimpleNamespace

import pytest

from nvmeof_fuse.errors import TransportError
from nvmeof_fuse.nvme import tcp_pdu as pdu
from nvmeof_fuse.transport.tcp.reader import DIRECT_RECV_BYTES, PduReader, ReceiverStopped


class Owner:
    name = "I/O queue 3"
    qid = 3

    def __init__(self) -> None:
        self.closed = False
        self.posted: list[list] = []
        self.r2ts: list[tuple] = []

    def post(self, batch: list) -> None:
        self.posted.append(batch)

    def answer_r2t(self, request, header) -> None:
        self.r2ts.append((request, header.offset, header.length, list(self.posted)))

    def closed_by_peer(self) -> TransportError:
        return TransportError(f"{self.name}: the peer closed the connection")


def request(cid: int, size: int = 0, *, write: bool = False, serial: int = 1,
            in_capsule: bool = False):
    memory = bytearray(size)
    return SimpleNamespace(cid=cid, serial=serial, to_controller=write, in_capsule=in_capsule,
                           data=SimpleNamespace(length=size) if size else None,
                           memory=memory, buffer=lambda: memoryview(memory))


def response(cid: int) -> bytes:
    return (pdu.COMMON_HEADER.pack(pdu.CAPSULE_RESP, 0, 24, 0, 24)
            + struct.pack("<QHHHH", 0, 0, 1, cid, 0))


def c2h_data(cid: int, offset: int, payload: bytes, *, success: bool) -> bytes:
    flags = pdu.FLAG_LAST_PDU | pdu.FLAG_SUCCESS if success else 0
    return (pdu.COMMON_HEADER.pack(pdu.C2H_DATA, flags, 24, 24, 24 + len(payload))
            + struct.pack("<HHII4x", cid, 0, offset, len(payload)) + payload)


def r2t(cid: int, offset: int, length: int) -> bytes:
    return (pdu.COMMON_HEADER.pack(pdu.R2T, 0, 24, 0, 24)
            + struct.pack("<HHII4x", cid, 7, offset, length))


@pytest.fixture
def pair():
    # blocking, as the queue's socket: no test waits for bytes it did not send
    ours, theirs = socket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


def reader_for(sock, *requests) -> tuple[PduReader, Owner]:
    owner = Owner()
    pending = {r.cid: r for r in requests}
    return PduReader(sock, owner, pending, header_digest=False, data_digest=False), owner


def test_a_response_is_read_whole_from_the_buffer_and_handed_over(pair):
    ours, theirs = pair
    command = request(5)
    reader, _ = reader_for(ours, command)
    assert not reader.receive_nowait(8)  # nothing sent yet: the trio thread would wait
    theirs.sendall(response(5))
    assert reader.receive_nowait(8)
    assert reader.peek() == (pdu.CAPSULE_RESP, 24, 24)
    assert reader.buffered() == 24
    assert reader.one_pdu() == 24
    [(got, completion)] = reader.take_inbox()
    assert got is command and completion.command_id == 5 and completion.ok
    assert reader.inbox == [] and reader.buffered() == 0


@pytest.mark.parametrize(("wire", "message"), [
    (response(9), r"^I/O queue 3: CapsuleResp for command ID 9, which is not in flight$"),
    (response(5) + response(5), r"^I/O queue 3: second response for command ID 5$"),
    (c2h_data(5, 0, bytes(8), success=True),
     r"^I/O queue 3: C2HData for command 5, which reads no data$"),
    (r2t(5, 0, 512), r"^I/O queue 3: R2T for command 5, which writes no data$"),
], ids=["unknown command", "second response", "data for no read", "R2T for no write"])
def test_pdus_that_do_not_fit_the_commands_in_flight_fail_by_name(pair, wire, message):
    ours, theirs = pair
    reader, _ = reader_for(ours, request(5))
    theirs.sendall(wire)
    with pytest.raises(TransportError, match=message):
        while True:
            reader.one_pdu()


@pytest.mark.parametrize(("command", "wire", "message"), [
    (request(2, 8192), c2h_data(2, 4096, bytes(8192), success=True),
     r"^I/O queue 3: C2HData for command 2 names bytes 4096\+8192, past its 8192-byte buffer$"),
    (request(2, 8192, write=True), r2t(2, 0, 16384),
     r"^I/O queue 3: R2T for command 2 names bytes 0\+16384, past its 8192-byte buffer$"),
], ids=["C2HData", "R2T"])
def test_data_past_the_end_of_a_commands_buffer_fails_by_name(pair, command, wire, message):
    ours, theirs = pair
    reader, _ = reader_for(ours, command)
    theirs.sendall(wire)
    with pytest.raises(TransportError, match=message):
        reader.one_pdu()
    assert not any(command.memory)  # nothing was written into the caller's memory


def response_with(cid: int, status: int) -> bytes:
    return (pdu.COMMON_HEADER.pack(pdu.CAPSULE_RESP, 0, 24, 0, 24)
            + struct.pack("<QHHHH", 0, 0, 1, cid, status << 1))


@pytest.mark.parametrize(("wire", "message"), [
    (response(2), r"^I/O queue 3: CapsuleResp for command 2 claims success after 0 of 8192 "
                  r"bytes of C2HData$"),
    (c2h_data(2, 0, bytes(4096), success=False) + response(2),
     r"^I/O queue 3: CapsuleResp for command 2 claims success after 4096 of 8192 bytes"),
], ids=["no data", "half the data"])
def test_a_read_succeeds_only_with_all_its_data(pair, wire, message):
    # Else the caller's buffer (a bounce buffer: another request's bytes) would be its data.
    ours, theirs = pair
    reader, _ = reader_for(ours, request(2, 8192))
    theirs.sendall(wire)
    with pytest.raises(TransportError, match=message):
        while True:
            reader.one_pdu()


@pytest.mark.parametrize(("wire", "message"), [
    (response(2), r"^I/O queue 3: CapsuleResp for command 2 claims success after 0 of 8192 "
                  r"bytes were asked for by R2T$"),
    (r2t(2, 0, 4096) + response(2),
     r"^I/O queue 3: CapsuleResp for command 2 claims success after 4096 of 8192 bytes were "
     r"asked for by R2T$"),
    (r2t(2, 4096, 4096) + r2t(2, 0, 4096) + response(2),
     r"^I/O queue 3: R2T for command 2 at offset 4096, expected 0$"),
    (r2t(2, 0, 4096) + r2t(2, 0, 4096) + response(2),
     r"^I/O queue 3: R2T for command 2 at offset 0, expected 4096$"),
], ids=["no R2T", "half asked for", "a hole", "asked twice"])
def test_a_write_succeeds_only_once_its_r2ts_asked_for_all_its_data(pair, wire, message):
    # Else a write whose data the target never had would be reported written (issue #56).
    ours, theirs = pair
    reader, _ = reader_for(ours, request(2, 8192, write=True))
    theirs.sendall(wire)
    with pytest.raises(TransportError, match=message):
        while True:
            reader.one_pdu()


def test_writes_asked_for_in_pieces_in_the_capsule_or_failed_are_answered(pair):
    ours, theirs = pair
    pieces, inline = request(2, 8192, write=True), request(3, 4096, write=True, in_capsule=True)
    failed = request(4, 8192, write=True)
    reader, owner = reader_for(ours, pieces, inline, failed)
    theirs.sendall(r2t(2, 0, 4096) + r2t(2, 4096, 4096) + response(2) + response(3)
                   + response_with(4, 0x81))
    for _ in range(5):
        reader.one_pdu()
    answered = reader.take_inbox()
    asked = [(r, what.offset, what.length) for r, what in answered if isinstance(what, pdu.Header)]
    assert asked == [(pieces, 0, 4096), (pieces, 4096, 4096)]  # for the queue to answer
    completions = [(r, what.ok) for r, what in answered if not isinstance(what, pdu.Header)]
    assert completions == [(pieces, True), (inline, True), (failed, False)]


def test_a_read_that_fails_or_got_its_data_is_answered(pair):
    ours, theirs = pair
    failed, whole = request(2, 8192), request(3, 4096)
    reader, _ = reader_for(ours, failed, whole)
    theirs.sendall(response_with(2, 0x81) + c2h_data(3, 0, b"x" * 4096, success=False)
                   + response(3))
    for _ in range(3):
        reader.one_pdu()
    [(first, error), (second, ok)] = reader.take_inbox()
    assert first is failed and not error.ok and second is whole and ok.ok
    assert whole.memory == b"x" * 4096


def test_a_large_payload_lands_in_the_callers_memory_in_order(pair):
    ours, theirs = pair
    size = 4 * DIRECT_RECV_BYTES
    command = request(2, size)
    reader, owner = reader_for(ours, command)
    payload = bytes(range(256)) * (size // 256)
    half = size // 2
    sender = threading.Thread(target=theirs.sendall, args=(
        c2h_data(2, 0, payload[:half], success=False)
        + c2h_data(2, half, payload[half:], success=True),))
    sender.start()
    reader.one_pdu()
    assert reader.inbox == []  # not answered before its last piece
    reader.one_pdu()
    sender.join()
    [(got, completion)] = reader.take_inbox()
    assert got is command and completion.ok and completion.sq_id == 3
    assert command.memory == payload


def test_data_out_of_order_fails_by_name(pair):
    ours, theirs = pair
    reader, _ = reader_for(ours, request(2, 8192))
    theirs.sendall(c2h_data(2, 4096, bytes(4096), success=True))
    with pytest.raises(TransportError, match=r"^I/O queue 3: C2HData for command 2 at offset "
                                             r"4096, expected 0$"):
        reader.one_pdu()


def test_the_receiver_thread_hands_over_and_answers_a_bulk_r2t_itself(pair):
    """run(): answered commands are posted before the R2T is answered (their callers go on
    meanwhile), and once the stream goes quiet the thread hands the reading back."""
    ours, theirs = pair
    read_cmd, write_cmd = request(1), request(4, 1 << 20, write=True)
    reader, owner = reader_for(ours, read_cmd, write_cmd)
    theirs.sendall(response(1) + r2t(4, 0, 1 << 20))
    reader.run()
    [(answered, posted_before)] = [(r[0], r[3]) for r in owner.r2ts]
    assert answered is write_cmd and owner.r2ts[0][1:3] == (0, 1 << 20)
    assert [[pair_[0] for pair_ in batch] for batch in posted_before] == [[read_cmd]]
    assert not reader.in_thread and reader.inbox == []


def test_a_connection_closed_by_the_peer_or_by_the_queue(pair):
    ours, theirs = pair
    reader, owner = reader_for(ours, request(1))
    theirs.shutdown(socket.SHUT_WR)
    with pytest.raises(TransportError, match="the peer closed the connection"):
        reader.receive_nowait(8)
    owner.closed = True  # the queue failed and shut its socket down: the thread just ends
    with pytest.raises(ReceiverStopped):
        reader.one_pdu()
