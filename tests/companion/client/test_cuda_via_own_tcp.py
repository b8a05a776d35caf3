"""Staged tasks on a client's own queues
(:mod:`nvmeof_fuse.companion.client.cuda_via_own_tcp`): every request's future ends, also
when the queues' loop ends before it started."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from nvmeof_fuse.companion.client.cuda_via_own_tcp import OwnQueueRequests
from nvmeof_fuse.companion.protocol import Piece
from nvmeof_fuse.errors import TransportError

LBA = 512


class Direct:
    """DirectQueues' part that staged tasks use; jobs start only when the test says."""

    def __init__(self) -> None:
        self.ends: list = []
        self.jobs: list = []

    def at_loop_end(self, fn) -> None:
        self.ends.append(fn)

    def host_region(self, addr: int, size: int, obj) -> tuple:
        return SimpleNamespace(close=lambda: None), addr, False

    def start(self, job, nsid, region, at, size, file_offset, edge, release=None):
        self.jobs.append((job, (nsid, region, at, size, file_offset, edge)))

    async def read(self, nsid, region, at, size, file_offset, put) -> int:
        return size

    def end_loop(self) -> None:
        for fn in self.ends:
            fn()


def requests() -> tuple[Direct, OwnQueueRequests]:
    direct = Direct()
    return direct, OwnQueueRequests(direct, SimpleNamespace(addr=0, mem=None), LBA)


def test_a_started_request_completes_its_future():
    direct, own = requests()
    future = own.read_async(1, [Piece(4, 2, 0, 0)], 5.0)
    (job, args), = direct.jobs
    assert trio.run(job, *args) == 2 * LBA
    assert future.result(0) == 2 * LBA
    direct.end_loop()  # ended already: untouched
    assert future.result(0) == 2 * LBA


def test_requests_the_ended_loop_never_started_fail_and_say_so():
    direct, own = requests()
    future = own.read_async(1, [Piece(4, 2, 0, 0)], 5.0)
    direct.end_loop()
    with pytest.raises(TransportError, match="^our own queues were closed before this "
                                             "request started$"):
        future.result(0)
    with pytest.raises(TransportError, match="before this request started"):
        own.read_async(1, [Piece(6, 1, 0, 0)], 5.0)
    assert len(direct.jobs) == 1
