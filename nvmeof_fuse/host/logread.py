"""Log pages read whole and of one generation, however many commands they take.

A log page longer than one command moves (MDTS) is read in pieces, and a target may change
it between two of them: the pieces then hold two generations, a "torn" page (records of
the new log under the old header).  The specification's rule for a log page with a change
counter (the Discovery log's GENCTR, the ANA log's CHGCNT): read the counter again after
the last piece, and read the whole page again if it moved.  libnvme's
``nvme_discovery_log`` does that (header, entries, header again) up to ``max_retries``
times; so does :func:`read_whole`, for every such page, then gives up in one line
(:class:`LogPageChanging`).

A page that one command moves whole is consistent by itself and is not read again.  The
Changed Namespace List (4 KiB, under the smallest MDTS) is always one command and has no
counter.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Callable
from typing import Protocol

from ..errors import TargetProtocolError

LOG_READ_TRIES = 10
"""Whole reads of a page that keeps changing before giving up (nvme-cli's discovery
default, MAX_DISC_RETRIES)."""


class LogPageChanging(TargetProtocolError):
    """A log page changed under each of our reads: no consistent copy to show."""

    errno = _errno.EAGAIN


class LogSource(Protocol):
    """What :func:`read_whole` uses of a controller."""

    def log_page_piece(self) -> int:
        """Bytes one Get Log Page command moves at the most."""
        ...

    async def get_log_page(self, lid: int, length: int, offset: int = 0) -> bytes: ...


async def read_whole(source: LogSource, lid: int, *, header: int,
                     length: int | Callable[[bytes], int], counter: Callable[[bytes], int],
                     what: str, tries: int = LOG_READ_TRIES) -> bytes:
    """Log page ``lid``, all of it from one generation.

    ``header``: bytes at its start that hold its change counter (and its length);
    ``length``: its length in bytes, or a function that gives it from the first
    ``header`` bytes (and refuses one past our bounds, raising); ``counter``: its change
    counter from the first ``header`` bytes.  ``what`` names it in the error when it kept
    changing through ``tries`` whole reads.
    """
    for _ in range(tries):
        if isinstance(length, int):
            total = length
        else:
            total = length(await source.get_log_page(lid, header))
        data = await source.get_log_page(lid, total)
        if not isinstance(length, int) and length(data[:header]) != total:
            continue  # it grew or shrank since its header was read
        if total <= source.log_page_piece():
            return data  # one command: consistent by itself
        if counter(await source.get_log_page(lid, header)) == counter(data):
            return data
    raise LogPageChanging(f"{what} kept changing while it was read ({tries} tries)")
