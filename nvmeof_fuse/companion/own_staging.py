"""Staged transfers on a client's own queues: CUDA memory over NVMe/TCP.

A socket receives into host memory only, so over NVMe/TCP a client's CUDA memory moves
through the file's staging memory (page-locked once), copied to and from the GPU in this
process.  The tasks and their pipeline are those of staging through the daemon
(:class:`~.daemon_io.DaemonIO`); only each task's request differs: its LBAs move over this
client's own queues instead of being asked of the daemon, so the daemon leaves the data
path (a write still holds its range lock: :mod:`.client_delegation`).
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any

from ..errors import TransportError
from .protocol import Piece
from .staging import Staging


class OwnQueueRequests:
    """A channel's ``read_async`` and ``write_async``, as staged tasks make them, run on a
    client's own queues (:class:`~.direct.DirectQueues`) into and out of ``staging``."""

    def __init__(self, direct: Any, staging: Staging, lba_size: int) -> None:
        self._direct = direct
        self._staging = staging
        self._lba = lba_size

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
        self._direct.start(functools.partial(_completing, future, job), *args)
        return future


async def _completing(future: concurrent.futures.Future, job: Any, *args: Any) -> Any:
    """Run ``job(*args)`` and complete ``future`` with its end, whatever it is."""
    try:
        result = await job(*args)
    except BaseException as exc:
        future.set_exception(exc if isinstance(exc, Exception) else
                             TransportError("our own queues were closed"))
        raise
    future.set_result(result)
    return result


def _whole_lbas(at: int, data: Any) -> None:
    raise AssertionError("a staged read task moves whole LBAs only")
