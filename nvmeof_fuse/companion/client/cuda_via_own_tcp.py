"""Staged transfers on a client's own queues: CUDA memory over NVMe/TCP.

A socket receives into host memory only, so over NVMe/TCP a client's CUDA memory moves
through the file's staging memory (page-locked once), copied to and from the GPU in this
process.  The tasks and their pipeline are those of staging through the daemon
(:class:`~.via_daemon.DaemonIO`); only each task's request differs: its LBAs move over this
client's own queues instead of being asked of the daemon, so the daemon leaves the data
path (a write still holds its range lock: :mod:`.locked_writes`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Any

from ...errors import TransportError
from ..protocol import Piece
from .shared_bounce import Staging

CLOSED = "our own queues were closed"
NOT_STARTED = "our own queues were closed before this request started"


class OwnQueueRequests:
    """A channel's ``read_async`` and ``write_async``, as staged tasks make them, run on a
    client's own queues (:class:`~.own_queues.DirectQueues`) into and out of ``staging``."""

    def __init__(self, direct: Any, staging: Staging, lba_size: int) -> None:
        self._direct = direct
        self._staging = staging
        self._lba = lba_size
        self._lock = threading.Lock()  # guards _pending and _ended
        self._pending: set[concurrent.futures.Future] = set()  # submitted, not yet ended
        self._ended = False  # our queues' loop has ended: nothing submitted starts now
        direct.at_loop_end(self._loop_ended)

    def _region(self, at: int, nbytes: int) -> tuple[Any, int, Any]:
        """``(region, offset, release)`` of staging memory at ``at`` in our queues' memory."""
        staging = self._staging
        region, offset, temporary = self._direct.host_region(staging.addr + at, nbytes,
                                                             staging.mem)
        return region, offset, region.close if temporary else None

    def read_async(self, nsid: int, pieces: list[Piece], timeout: float
                   ) -> concurrent.futures.Future:
        """Whole LBAs into staging memory (a staged read task has one piece)."""
        (piece,) = pieces
        nbytes = piece.nlb * self._lba
        region, at, release = self._region(piece.offset, nbytes)
        return self._start(self._direct.read, nsid, region, at, nbytes, piece.slba * self._lba,
                           _whole_lbas, release)

    def write_async(self, nsid: int, offset: int, length: int, rid: int, region_offset: int,
                    head: bytes, tail: bytes, timeout: float) -> concurrent.futures.Future:
        """``length`` bytes at ``offset`` from staging memory at ``region_offset``; the
        partial LBAs at its ends are ``head`` and ``tail`` (read-modify-written)."""
        region, at, release = self._region(region_offset, length)

        def edge(start: int, nbytes: int) -> bytes:
            return head if start == 0 else tail

        return self._start(self._direct.write, nsid, region, at, length, offset, edge, release)

    def _start(self, job: Any, *args: Any) -> concurrent.futures.Future:
        """``job(*args)`` on our queues' loop: a future its callbacks can wait on (the
        loop's own futures are waited for, not called back)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._ended:
                raise TransportError(NOT_STARTED)
            self._pending.add(future)
        try:
            self._direct.start(functools.partial(self._completing, future, job), *args)
        except BaseException:
            with self._lock:
                self._pending.discard(future)
            raise
        return future

    async def _completing(self, future: concurrent.futures.Future, job: Any, *args: Any
                          ) -> Any:
        """Run ``job(*args)`` and complete ``future`` with its end, whatever it is."""
        try:
            result = await job(*args)
        except BaseException as exc:
            self._settle(future, exc if isinstance(exc, Exception) else TransportError(CLOSED))
            raise
        self._settle(future, None, result)
        return result

    def _settle(self, future: concurrent.futures.Future, error: BaseException | None,
                result: Any = None) -> None:
        with self._lock:
            if future not in self._pending:
                return  # failed already, as the loop ended
            self._pending.discard(future)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _loop_ended(self) -> None:
        """Fail the requests the ended loop will never start (their tasks' callers wait)."""
        with self._lock:
            self._ended = True
            pending, self._pending = self._pending, set()
        for future in pending:
            future.set_exception(TransportError(NOT_STARTED))


def _whole_lbas(at: int, data: Any) -> None:
    raise AssertionError("a staged read task moves whole LBAs only")
