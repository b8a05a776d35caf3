"""Transfers over the mount daemon's queues: into registered memory directly, or staged.

Placed: the caller's memory is registered with the daemon (a shared array, a
dma-buf): one request moves its whole LBAs; partial LBAs at the ends pass
through staging memory and are copied here.  Staged: the request is cut into
tasks of at most ``task_size`` bytes (:mod:`~nvmeof_fuse.companion.client.shared_bounce`),
pipelined.

Requests go out without a thread waiting for them; the reply starts the next
step, and copies run on the file's copy threads.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, NamedTuple

from ..protocol import Piece, chunks, plan_read, plan_write
from .shared_bounce import CallerMemory, Staging, Transfer

Step = Callable[[], None]
Held = tuple[int, int]  # (offset, bytes) of staging memory a task holds


class Placed(NamedTuple):
    """Caller memory registered with the daemon: region ``rid``, the transfer's first byte at
    ``offset`` in it; ``release`` (or None) once the transfer ended."""

    rid: int
    offset: int
    release: Callable[[], None] | None


class DaemonIO:
    """Reads and writes of one namespace through the daemon, for one :class:`File`."""

    def __init__(self, channel: Any, nsid: int, lba_size: int, staging: Staging,
                 task_size: int, executor: concurrent.futures.ThreadPoolExecutor,
                 budget: Callable[[int], float]) -> None:
        self._channel = channel
        self._nsid = nsid
        self._lba = lba_size
        self._staging = staging
        self._task = max(task_size - task_size % lba_size, lba_size)
        self._executor = executor
        self._budget = budget

    # -- placed: the daemon's transport moves the whole LBAs into the caller's memory ------

    def read_placed(self, mem: CallerMemory, placed: Placed, file_offset: int, size: int,
                    after: Step | None) -> Transfer:
        """Whole LBAs straight into the caller's region, edges through staging memory;
        ``after`` runs once the data is there (the GPUDirect flush)."""
        transfer = Transfer(size, 1)
        staging = self._staging

        def send(at: int | None) -> None:
            plan = plan_read(file_offset, size, self._lba, placed.rid, placed.offset,
                             staging.rid, at or 0)

            def finish() -> None:
                for edge in plan.edges:
                    mem.put(edge.dest, staging.addr + edge.staging, edge.length)
                if after is not None:
                    after()

            self._send(transfer, None if at is None else (at, 2 * self._lba),
                       finish if plan.edges or after else None, self._channel.read_async,
                       self._nsid, plan.pieces, self._budget(size))

        if file_offset % self._lba or size % self._lba:  # partial LBAs: through staging
            staging.acquire(2 * self._lba, send)
        else:
            send(None)
        return transfer

    def write_placed(self, mem: CallerMemory, placed: Placed, file_offset: int, size: int
                     ) -> Transfer:
        """Whole LBAs straight from the caller's region; the edges' bytes in the message."""
        transfer = Transfer(size, 1)
        plan = plan_write(file_offset, size, self._lba)
        try:
            head = mem.get_bytes(plan.head.start, plan.head.stop - plan.head.start)
            tail = mem.get_bytes(plan.tail.start, plan.tail.stop - plan.tail.start)
        except BaseException as exc:
            transfer.task_done(exc)
            return transfer
        self._send(transfer, None, None, self._channel.write_async, self._nsid, file_offset,
                   size, placed.rid, placed.offset, head, tail, self._budget(size))
        return transfer

    # -- staged: through the file's bounce memory, in tasks -------------------------------

    def _tasks(self, file_offset: int, size: int) -> list[tuple[int, int, int, int]]:
        """``(offset, length, first LBA, LBAs)`` of each task: at most a task's bytes of
        whole LBAs each, cut at LBA boundaries."""
        lba = self._lba
        tasks = []
        for offset, length in chunks(file_offset, size, lba, self._task):
            first = offset // lba
            tasks.append((offset, length, first, -(-(offset + length) // lba) - first))
        return tasks

    def read_staged(self, mem: CallerMemory, file_offset: int, size: int) -> Transfer:
        tasks = self._tasks(file_offset, size)
        transfer = Transfer(size, len(tasks))
        for offset, length, first, nlb in tasks:
            self._staging.acquire(
                nlb * self._lba,
                lambda at, o=offset, n=length, s=first, c=nlb: self._read_task(
                    transfer, mem, file_offset, o, n, s, c, at))
        return transfer

    def _read_task(self, transfer: Transfer, mem: CallerMemory, file_offset: int,
                   offset: int, length: int, first: int, nlb: int, at: int) -> None:
        staging = self._staging
        skip = at + offset - first * self._lba
        self._send(transfer, (at, nlb * self._lba),
                   lambda: mem.put(offset - file_offset, staging.addr + skip, length),
                   self._channel.read_async, self._nsid, [Piece(first, nlb, staging.rid, at)],
                   self._budget(nlb * self._lba))

    def write_staged(self, mem: CallerMemory, file_offset: int, size: int) -> Transfer:
        tasks = self._tasks(file_offset, size)
        transfer = Transfer(size, len(tasks))
        for offset, length, _, _ in tasks:
            self._staging.acquire(
                length, lambda at, o=offset, n=length: self._submit(
                    self._write_task, transfer, mem, file_offset, o, n, at))
        return transfer

    def _write_task(self, transfer: Transfer, mem: CallerMemory, file_offset: int,
                    offset: int, length: int, at: int) -> None:
        """On a copy thread: the caller's bytes into staging memory, then the write goes out."""
        staging = self._staging
        try:
            mem.get(offset - file_offset, staging.addr + at, length)
            plan = plan_write(offset, length, self._lba)
            chunk = staging.view[at:at + length]
            head, tail = bytes(chunk[plan.head]), bytes(chunk[plan.tail])
        except BaseException as exc:
            staging.release(at, length)
            transfer.task_done(exc)
            return
        self._send(transfer, (at, length), None, self._channel.write_async, self._nsid, offset,
                   length, staging.rid, at, head, tail, self._budget(length))

    # -- the steps -------------------------------------------------------------------------

    def _send(self, transfer: Transfer, piece: Held | None, then: Step | None,
              request: Callable[..., concurrent.futures.Future], *args: Any) -> None:
        """Send one request; once answered, ``then`` on a copy thread, give the staging ``piece``
        back, and count the task done."""
        try:
            future = request(*args)
        except BaseException as exc:
            self._end(transfer, piece, exc)
            return
        future.add_done_callback(lambda f: self._answered(f, transfer, piece, then))

    def _answered(self, future: concurrent.futures.Future, transfer: Transfer,
                  piece: Held | None, then: Step | None) -> None:
        error = future.exception()
        if error is not None or then is None:
            self._end(transfer, piece, error)
        else:
            self._submit(self._finish, transfer, piece, then)

    def _finish(self, transfer: Transfer, piece: Held | None, then: Step) -> None:
        error = None
        try:
            then()
        except BaseException as exc:  # handed to the caller by the transfer's future
            error = exc
        self._end(transfer, piece, error)

    def _end(self, transfer: Transfer, piece: Held | None, error: BaseException | None) -> None:
        if piece is not None:
            self._staging.release(*piece)  # may start waiting tasks' requests here
        transfer.task_done(error)

    def _submit(self, fn: Callable[..., None], transfer: Transfer, *args: Any) -> None:
        try:
            self._executor.submit(fn, transfer, *args)
        except RuntimeError as exc:  # shut down: only once no transfer is left (a bug)
            transfer.task_done(exc)
