"""host.logread: a log page read in pieces is of one generation, or refused in one line."""

from __future__ import annotations

import struct

import pytest
import trio

from nvmeof_fuse.errors import TargetProtocolError
from nvmeof_fuse.host.logread import LOG_READ_TRIES, LogPageChanging, read_whole

HEADER = 16
RECORD = 64


def page(generation: int, records: int) -> bytes:
    """A page: counter and record count, then records that each name their generation."""
    head = struct.pack("<QQ", generation, records)
    return head + b"".join(struct.pack("<QQ", generation, i).ljust(RECORD, b"\0")
                           for i in range(records))


def length(header: bytes) -> int:
    records = struct.unpack_from("<Q", header, 8)[0]
    if records > 100:
        raise TargetProtocolError(f"{records} records are too many")
    return HEADER + records * RECORD


def counter(header: bytes) -> int:
    return struct.unpack_from("<Q", header)[0]


class ChangingLog:
    """Serves a page in pieces of ``piece`` bytes; the page changes (a new generation, one
    more record) after each of the first ``changes`` reads that start past the header."""

    def __init__(self, *, piece: int = 128, changes: int = 0, records: int = 4) -> None:
        self.piece = piece
        self.changes = changes
        self.generation, self.records = 1, records
        self.commands: list[tuple[int, int]] = []

    def log_page_piece(self) -> int:
        return self.piece

    async def get_log_page(self, lid: int, length: int, offset: int = 0) -> bytes:
        out = b""
        for at in range(offset, offset + length, self.piece):  # as Controller.get_log_page
            n = min(self.piece, offset + length - at)
            self.commands.append((at, n))
            out += page(self.generation, self.records)[at:at + n].ljust(n, b"\0")
            if at > 0 and self.changes:
                self.changes -= 1
                self.generation += 1
                self.records += 1
        return out


def read(log: ChangingLog, **kw) -> bytes:
    return trio.run(lambda: read_whole(log, 0x70, header=HEADER, length=length,
                                       counter=counter, what="the test log", **kw))


def generations(data: bytes) -> set[int]:
    records = struct.unpack_from("<Q", data, 8)[0]
    return {counter(data)} | {struct.unpack_from("<Q", data, HEADER + i * RECORD)[0]
                              for i in range(records)}


def test_a_page_that_held_still_is_read_once_and_its_counter_again():
    log = ChangingLog()
    data = read(log)
    assert data == page(1, 4) and generations(data) == {1}
    assert log.commands == [(0, 16), (0, 128), (128, 128), (256, 16), (0, 16)]


def test_a_page_that_changed_between_pieces_is_read_again_until_it_holds_still():
    log = ChangingLog(changes=3)
    data = read(log)
    assert len(generations(data)) == 1, generations(data)  # never torn
    assert data == page(log.generation, log.records)


def test_a_page_that_keeps_changing_is_refused_in_one_line_after_its_tries():
    log = ChangingLog(changes=10**6)
    with pytest.raises(LogPageChanging) as refused:
        read(log, tries=4)
    assert str(refused.value) == "the test log kept changing while it was read (4 tries)"
    assert sum(1 for at, _ in log.commands if at == 0) == 4 * 3  # header, page, header
    assert LOG_READ_TRIES == 10


def test_a_page_one_command_moves_is_consistent_by_itself():
    log = ChangingLog(piece=4096)
    assert read(log) == page(1, 4)
    assert log.commands == [(0, 16), (0, 272)]


def test_a_page_that_grew_since_its_header_is_read_again():
    class Grows(ChangingLog):
        async def get_log_page(self, lid, length, offset=0):
            data = await super().get_log_page(lid, length, offset)
            if length == HEADER and self.records < 6:  # it grows after each header read
                self.records += 1
                self.generation += 1
            return data

    log = Grows(piece=4096)
    data = read(log)
    assert data == page(log.generation, 6) and generations(data) == {log.generation}


def test_a_fixed_length_page_skips_the_header_read():
    log = ChangingLog(piece=4096)
    data = trio.run(lambda: read_whole(log, 0x0C, header=HEADER, length=272, counter=counter,
                                       what="the ANA log"))
    assert data == page(1, 4) and log.commands == [(0, 272)]


def test_the_length_function_refuses_a_page_past_our_bounds():
    log = ChangingLog(records=1000)
    with pytest.raises(TargetProtocolError, match="1000 records are too many"):
        read(log)
