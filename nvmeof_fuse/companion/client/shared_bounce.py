"""Staged transfers of a companion client: bounce memory shared with the mount daemon, pipelined.

A request is cut into tasks of at most ``task_size`` bytes, as kvikio's compat
mode cuts it.  Each task borrows the bounce memory it needs when that much is
free (waiting tasks are served in order as memory comes back), asks the daemon
to move its LBAs between the target and that memory, and copies between it and
the caller's memory on a copy thread.  No thread waits on the network: a
task's next step is started by the reply, so the bytes in flight are bounded by
the bounce memory, not by the copy threads, and one task's copy runs while the next
task's data is on the wire.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import ctypes
import mmap
import threading
from collections.abc import Callable
from typing import Any

from . import shm

Start = Callable[[int], None]
PAGE = mmap.PAGESIZE


class Staging:
    """``size`` bytes of bounce memory in one memfd the daemon maps once, lent in pieces.

    A task borrows what it moves (rounded up to a page), so many small requests share
    the memory as well as a few large ones: what is in flight is bounded in bytes.
    Tasks that find too little free wait, and are served in order.
    """

    def __init__(self, channel: Any, size: int) -> None:
        self.size = size
        self.mem = shm.allocate(size)
        self.addr = self.mem.addr
        self.view = memoryview(self.mem)
        self.rid = channel.register_shared(self.mem, staging=True)
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), by offset
        self._waiting: collections.deque[tuple[int, Start]] = collections.deque()
        self._lock = threading.Lock()
        self.pinned: tuple[Any, int] | None = None  # (seam, context) that page-locked it

    @staticmethod
    def _rounded(nbytes: int) -> int:
        return -(-nbytes // PAGE) * PAGE

    def acquire(self, nbytes: int, start: Start) -> None:
        """``start(offset)`` of ``nbytes`` now if they are free, else once they are (then on
        the thread that gave memory back).  Give them back with :meth:`release`."""
        need = self._rounded(nbytes)
        if need > self.size:
            raise ValueError(f"{nbytes} bytes exceed the {self.size}-byte staging memory")
        with self._lock:
            at = None if self._waiting else self._take(need)
            if at is None:
                self._waiting.append((need, start))
                return
        start(at)

    def release(self, at: int, nbytes: int) -> None:
        """Give a piece back, and start the waiting tasks that now fit, in order.  A piece
        goes back only once the daemon answered for it (it may write it until then)."""
        ready = []
        with self._lock:
            self._give(at, self._rounded(nbytes))
            while self._waiting:
                need, start = self._waiting[0]
                got = self._take(need)
                if got is None:
                    break
                self._waiting.popleft()
                ready.append((start, got))
        for start, got in ready:
            start(got)

    def _take(self, need: int) -> int | None:
        for i, (at, length) in enumerate(self._free):  # first fit
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (at + need, length - need)
                return at
        return None

    def _give(self, at: int, length: int) -> None:
        i = bisect.bisect(self._free, (at, 0))
        if i < len(self._free) and at + length == self._free[i][0]:  # merge the next
            length += self._free.pop(i)[1]
        if i and self._free[i - 1][0] + self._free[i - 1][1] == at:  # and the previous
            at, length = self._free[i - 1][0], self._free[i - 1][1] + length
            self._free[i - 1] = (at, length)
        else:
            self._free.insert(i, (at, length))

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"staging_bytes": self.size,
                    "staging_free_bytes": sum(length for _, length in self._free),
                    "staging_waiting": len(self._waiting),
                    "staging_pinned": self.pinned is not None}

    def close(self) -> None:
        if self.pinned is not None:
            seam, context = self.pinned
            self.pinned = None
            try:
                seam.unpin(context, self.addr)
            except RuntimeError:  # the context is gone (device reset): nothing left pinned
                pass
        self.view.release()


class Transfer:
    """One request's tasks; its ``future`` gets the byte count once every task is done, or
    the first task's error once every task has ended (none still touches caller memory)."""

    def __init__(self, size: int, tasks: int) -> None:
        self.size = size
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._left = tasks
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        if not tasks:
            self.future.set_result(size)

    def task_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._left -= 1
            if error is not None and self._error is None:
                self._error = error
            last = not self._left
        if last:
            if self._error is not None:
                self.future.set_exception(self._error)
            else:
                self.future.set_result(self.size)


class CallerMemory:
    """The caller's bytes of one transfer (from ``start``): copies to and from host memory
    at an address, on any thread.  CUDA memory is copied by the seam (in its own context,
    on ``stream`` or the thread's own), host memory by ``memmove``."""

    __slots__ = ("cuda", "device", "addr", "start", "stream", "owner")

    def __init__(self, cuda: Any, device: Any, addr: int, start: int, stream: int | None,
                 owner: Any) -> None:
        self.cuda = cuda  # the seam, for CUDA memory; None for host memory
        self.device = device  # its DeviceMemory
        self.addr = addr  # of the caller's buffer
        self.start = start  # the transfer's first byte in it
        self.stream = stream
        self.owner = owner  # kept alive until the transfer is done

    def put(self, at: int, src: int, nbytes: int) -> None:
        """Host bytes at ``src`` into the transfer's bytes at ``at``."""
        if self.cuda is not None:
            self.cuda.to_device(self.device, self.start + at, src, nbytes, self.stream)
        else:
            ctypes.memmove(self.addr + self.start + at, src, nbytes)

    def get(self, at: int, dst: int, nbytes: int) -> None:
        """The transfer's bytes at ``at`` into host memory at ``dst``."""
        if self.cuda is not None:
            self.cuda.to_host(self.device, self.start + at, dst, nbytes, self.stream)
        else:
            ctypes.memmove(dst, self.addr + self.start + at, nbytes)

    def put_bytes(self, at: int, data: bytes | memoryview) -> None:
        if len(data):
            buf = (ctypes.c_char * len(data)).from_buffer_copy(data)
            self.put(at, ctypes.addressof(buf), len(data))

    def get_bytes(self, at: int, nbytes: int) -> bytes:
        if not nbytes:
            return b""
        buf = ctypes.create_string_buffer(nbytes)
        self.get(at, ctypes.addressof(buf), nbytes)
        return buf.raw
