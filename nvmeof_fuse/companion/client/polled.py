"""A companion client's polled reads: the caller's thread posts and reaps a queue of its own.

Whole-LBA reads into registered host memory need no trip through the client's trio
thread: the caller posts the command on a polled queue (:mod:`nvmeof_fuse.transport.rdma.polled`)
and waits for it by reaping that queue's completions.  A read that cannot go there (partial
LBAs, no free slot, reconnecting) takes the loop's path; one whose queue fails under it is
run again there.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import CommandTimeout, NVMeoFError, TransportError
from ...host.memory import Region
from ...nvme import command as nvme_cmd
from ...nvme.sgl import NULL_SGL
from .future import IOFuture

log = logging.getLogger(__name__)

POLLED_QUEUES = 2
"""Of a client's leased queues, how many its callers' threads drive themselves (whole-LBA
reads into registered host memory); the loop keeps the others, half at least (writes,
partial LBAs, CUDA).  Reads up to :data:`POLLED_MAX_BYTES` keep to the first, larger ones
go to the one with fewer commands unanswered: large reads then cost the client far less CPU
(no trip through its trio thread), and small ones poll one completion queue, cheaper than
two (the A/B: docs/performance-history.md, "Figures that stood in docstrings")."""
POLLED_MAX_BYTES = 128 * 1024
"""Reads up to this size keep to the first polled queue.  What a small read costs is CPU per
command, which polling one queue saves; what a large one costs is the transfer, which the
target and the fabric move in parallel per queue (one polled queue held 1 MiB reads back),
so those are spread over two polled queues, or over the loop's when only one is polled."""


class PolledReads:
    """The polled queues of one client's controller, and the reads posted on them.

    ``shapes``: the leased namespaces by nsid; ``per_command``: LBAs one command moves, per
    nsid; ``on_loop(nsid, region, at, size, file_offset, keep)``: the loop's path for a read
    (a future); ``report_lost(queue, exc)``: tell the loop a polled queue failed.
    """

    def __init__(self, shapes: dict[int, Any], per_command: dict[int, int], timeout: float,
                 on_loop: Callable[..., concurrent.futures.Future],
                 report_lost: Callable[[Any, BaseException], None]) -> None:
        self.ctrl: Any = None  # the attached controller, once connected
        self.shapes = shapes
        self.per_command = per_command
        self.timeout = timeout
        self.read_on_loop = on_loop
        self._report_lost = report_lost
        self.read_bytes = 0  # moved by polled reads (callers' threads)
        self._lock = threading.Lock()

    def queues(self, size: int) -> list:
        """The polled queues a read of ``size`` bytes may take now: the first for a small
        read, all of them for a large one; none (a large read with one queue polled, or
        while reconnecting): the loop's path serves it."""
        ctrl = self.ctrl
        if ctrl is None or size <= 0:
            return []
        polled = ctrl.polled_queues
        if size <= POLLED_MAX_BYTES:
            return polled[:1]  # small reads keep to one queue: one CQ to poll
        return polled if len(polled) > 1 else []

    def read(self, nsid: int, region: Region, at: int, size: int, file_offset: int,
             keep: Any, limit: float, post: bool = True) -> PolledRead | None:
        """Post a read of whole LBAs from this thread on a polled queue (no loop, no thread
        switch); None when it cannot go there (partial LBAs, no free slot, no polled
        queue), and then the loop's path serves it.  ``keep`` (the owner of the memory) is
        held until the read is done; ``limit`` bounds a ``get()`` given no timeout.
        With ``post=False`` the read waits for :meth:`post` (a batch)."""
        shape = self.shapes.get(nsid)
        if shape is None:
            return None
        lba_size = shape.lba_size
        if file_offset % lba_size or size % lba_size:
            return None
        slba, nlb = file_offset // lba_size, size // lba_size
        if slba + nlb > shape.nsze:
            return None  # the loop's path names the error
        polled = self.queues(size)
        if not polled:
            return None
        return self.read_lbas(polled, nsid, region, at, size, file_offset, slba, nlb, keep,
                              limit, post)

    def read_lbas(self, polled: list, nsid: int, region: Region, at: int, size: int,
                  file_offset: int, slba: int, nlb: int, keep: Any, limit: float,
                  post: bool) -> PolledRead | None:
        """:meth:`read` of whole LBAs the caller checked: ``nlb`` of them from ``slba`` (at
        ``file_offset``, ``size`` bytes), all on namespace ``nsid``, on one of ``polled``
        (:meth:`queues`); None once that namespace was replaced or removed.

        The check comes after the caller took ``polled``: the loop forgets a replaced
        namespace's shape before it hands out the queues of the new connection, so queues
        taken before the check are old ones (a read there fails and goes to the loop,
        which refuses it), and none of the new ones ever reads the other namespace."""
        if nsid not in self.shapes:
            return None
        # A large read: the less loaded, ties to the first.
        queue = polled[0] if len(polled) == 1 else min(polled, key=lambda q: q.unanswered)
        per = self.per_command[nsid]
        if nlb <= per:  # one command: the common case
            request = queue.submit_read(nsid, slba, nlb, region.ref(at, size), keep, post=post)
            requests = None if request is None else [request]
        else:
            lba_size = size // nlb
            requests = queue.submit(
                [(nvme_cmd.read(nsid, slba + start, min(per, nlb - start), NULL_SGL),
                  region.ref(at + start * lba_size, min(per, nlb - start) * lba_size))
                 for start in range(0, nlb, per)], keep, post=post)
        if requests is None:  # full, or failed: the loop's queues serve it
            return None
        return PolledRead(self, queue, requests, size, limit,
                          (nsid, region, at, size, file_offset, keep))

    def post(self) -> None:
        """Post the reads started with ``post=False``: one ``post_send`` per queue."""
        ctrl = self.ctrl
        for queue in ctrl.polled_queues if ctrl is not None else ():
            queue.flush()

    def done(self, size: int) -> None:
        with self._lock:
            self.read_bytes += size

    def failed(self, queue: Any, exc: BaseException) -> None:
        """A polled queue failed under a caller: have the loop reconnect (unless it did)."""
        if queue.detached:
            return
        try:
            self._report_lost(queue, exc)
        except NVMeoFError as error:  # the loop is gone: the fallback will say so
            log.debug("reporting a lost queue: %s", error)

    def drain(self, until: float) -> None:
        """Wait for the reads in flight, up to ``until`` (``time.perf_counter``)."""
        ctrl = self.ctrl
        if ctrl is not None:
            for queue in list(ctrl.polled_queues):
                queue.drain(until)


class PolledRead(IOFuture):
    """A read posted on a polled queue; waiting for it reaps the queue in the waiter's thread.

    If the queue fails under it (lost connection, command timeout), the read is
    run again on the loop's path, which waits for the reconnect and fails with
    the same EIO rules as any other request.
    """

    __slots__ = ("_reads", "_queue", "_requests", "_size", "_fallback", "_done")

    def __init__(self, reads: PolledReads, queue: Any, requests: list, size: int,
                 limit: float | None, fallback: tuple) -> None:
        """``fallback``: the arguments of :meth:`PolledReads.read_on_loop`."""
        super().__init__(None, None, limit)  # _future: the loop's, once the read went there
        self._reads = reads
        self._queue = queue
        self._requests = requests
        self._size = size
        self._fallback = fallback
        self._done = False  # read and counted: a second result() counts nothing

    def done(self) -> bool:
        if self._done:
            return True
        if self._future is not None:
            return self._future.done()
        if not all(r.finished for r in self._requests):
            self._queue.progress()
        return all(r.finished for r in self._requests)

    def result(self, timeout: float | None = None) -> int:
        """Bytes read; ``concurrent.futures.TimeoutError`` after ``timeout`` s."""
        if self._done:
            return self._size
        if self._future is not None:
            return self._future.result(timeout)
        clock = time.perf_counter
        limit = math.inf if timeout is None else clock() + timeout
        queue = self._queue
        try:
            for request in self._requests:
                if not request.finished:
                    give_up = request.deadline + self._reads.timeout  # posted + its timeout
                    try:
                        completion = queue.wait(request, min(limit, give_up))
                    except CommandTimeout:
                        if clock() < give_up:  # the caller's own bound, not the command's
                            raise concurrent.futures.TimeoutError from None
                        raise
                else:
                    completion = queue.wait(request, limit)
                if not completion.ok:
                    completion.raise_for_status("Read")
        except (TransportError, CommandTimeout) as exc:
            self._reads.failed(queue, exc)
            self._future = self._reads.read_on_loop(*self._fallback)
            return self._future.result(None if timeout is None else max(0.0, limit - clock()))
        self._reads.done(self._size)
        self._done = True
        return self._size
