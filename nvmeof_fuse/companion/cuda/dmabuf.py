"""dma-buf registrations of CUDA memory: one per allocation, bounded, never stale.

Exporting a dma-buf and registering it costs far more than a small transfer,
so a registration covers the caller's whole allocation (``cuMemGetAddressRange``
via the pointer's attributes) and is kept for the next transfer into any part
of it, as UCX and NCCL keep theirs.  A freed allocation whose addresses came
back in a new one has a new ``CU_POINTER_ATTRIBUTE_BUFFER_ID``: its old
registration is dropped, never used.  At most ``limit`` are kept (least
recently used go first, once no transfer uses them); all go on close.

Where an allocation cannot be exported whole (VMM memory mapped in pieces),
the page-aligned span of the transfer is exported and kept for that span.

Also here: registering a dma-buf with a transport, or, where the transport
refuses dma-bufs, registering the descriptor's CPU mapping when that can be
pinned (shared memory passed as the buffer, as the tests' fake CUDA driver
does; a GPU's dma-buf cannot be mapped, and udmabuf's mapping cannot be pinned).
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
from collections.abc import Callable
from typing import Any

from ...errors import NVMeoFError, TransportError
from ...host.memory import Region
from .gpu import PAGE, Cuda, CudaError, DeviceMemory, page_span

DMABUF_CACHE_LIMIT = 64
"""Registrations kept per file: each holds its allocation's GPU memory until dropped."""

Register = Callable[[int, int, int, int], Any]
"""``register(fd, offset, length, iova)``: takes ownership of ``fd``; a handle."""


class _Entry:
    __slots__ = ("key", "buffer_id", "base", "length", "handle", "busy", "doomed")

    def __init__(self, key: tuple, buffer_id: int, base: int, length: int, handle: Any) -> None:
        self.key = key
        self.buffer_id = buffer_id
        self.base = base
        self.length = length
        self.handle = handle
        self.busy = 0
        self.doomed = False  # dropped while a transfer used it: released when it is done


class DmabufCache:
    """Registered dma-bufs of CUDA allocations, by allocation."""

    def __init__(self, cuda: Cuda, register: Register, release: Callable[[Any], None],
                 limit: int = DMABUF_CACHE_LIMIT) -> None:
        self._cuda = cuda
        self._register = register
        self._release = release
        self._limit = limit
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._register_lock = threading.Lock()  # one registration of an allocation at a time
        self._closed = False
        self.counts = {"dmabuf_registered": 0, "dmabuf_released": 0, "dmabuf_hits": 0,
                       "dmabuf_reused_after_free": 0}

    def acquire(self, mem: DeviceMemory) -> tuple[_Entry, int]:
        """The registration holding ``mem`` and ``mem``'s offset in it, marked busy: hand
        it to :meth:`done` once the transfer ended.  Raises what export or registration
        raise (:class:`CudaError`, :class:`NVMeoFError`)."""
        entry = self._lookup(mem, (mem.context, mem.base, mem.size))
        if entry is None:
            base, _, length = page_span(mem.ptr, mem.nbytes)
            entry = self._lookup(mem, (mem.context, base, length))
        if entry is not None:
            return entry, mem.ptr - entry.base
        with self._register_lock:
            entry = self._lookup(mem, (mem.context, mem.base, mem.size))
            if entry is None:
                entry = self._add(mem)
        return entry, mem.ptr - entry.base

    def _lookup(self, mem: DeviceMemory, key: tuple) -> _Entry | None:
        stale = None
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.buffer_id != mem.buffer_id:  # freed, and the addresses reused
                stale = self._entries.pop(key)
                self.counts["dmabuf_reused_after_free"] += 1
                entry = None
            else:
                self._entries.move_to_end(key)
                entry.busy += 1
                self.counts["dmabuf_hits"] += 1
        if stale is not None:
            self._drop(stale)
        return entry

    def _add(self, mem: DeviceMemory) -> _Entry:
        try:  # the whole allocation (allocations start on a page)
            base, length = mem.base, -(-mem.size // PAGE) * PAGE
            fd = self._cuda.export_dmabuf(mem, base, length)
        except CudaError:  # mapped in pieces (VMM): just this transfer's pages
            base, _, length = page_span(mem.ptr, mem.nbytes)
            fd = self._cuda.export_dmabuf(mem, base, length)
        key = (mem.context, mem.base, mem.size) if base == mem.base else (mem.context, base,
                                                                           length)
        handle = self._register(fd, 0, length, base)
        entry = _Entry(key, mem.buffer_id, base, length, handle)
        entry.busy = 1
        evicted = []
        with self._lock:
            if self._closed:
                entry.busy = 0
                evicted.append(entry)
            else:
                self._entries[key] = entry
                self.counts["dmabuf_registered"] += 1
                idle = [e for e in self._entries.values() if not e.busy]
                while len(self._entries) > self._limit and idle:
                    evicted.append(self._entries.pop(idle.pop(0).key))
        for old in evicted:
            self._drop(old)
        if self._closed:
            raise NVMeoFError("the file is closed")
        return entry

    def done(self, entry: _Entry) -> None:
        with self._lock:
            entry.busy -= 1
            release = entry.doomed and not entry.busy
        if release:
            self._let_go(entry)

    def _drop(self, entry: _Entry) -> None:
        with self._lock:
            if entry.busy:
                entry.doomed = True
                return
        self._let_go(entry)

    def _let_go(self, entry: _Entry) -> None:
        with self._lock:
            self.counts["dmabuf_released"] += 1
        try:
            self._release(entry.handle)
        except NVMeoFError:  # the daemon is gone, and the registration with it
            pass

    def live(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries, self._entries = list(self._entries.values()), collections.OrderedDict()
        for entry in entries:
            self._drop(entry)


def register_dmabuf(transport: Any, fd: int, offset: int, length: int, iova: int
                    ) -> tuple[Region, Callable[[], None]]:
    """``(region, cleanup)`` of a dma-buf registered with ``transport``; ``fd`` stays the
    caller's.  A transport that refuses dma-bufs gets the buffer's CPU mapping instead,
    when there is one it can register; else the refusal is raised (``TransportError``)."""
    try:
        registration = transport.register_dmabuf(fd, offset, length, iova)
        return Region(iova, length, registration), lambda: None
    except Exception as exc:  # NVMeoFError, or the bindings' own (unsupported, bad fd)
        refusal = str(exc) if isinstance(exc, NVMeoFError) else \
            f"cannot register the dma-buf: {exc}"
    try:
        mapping = mmap.mmap(fd, offset + length, mmap.MAP_SHARED,
                            mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as exc:
        raise TransportError(f"{refusal}; nor can the CPU map it "
                             f"({getattr(exc, 'strerror', None) or exc})") from None
    try:
        anchor = ctypes.c_char.from_buffer(mapping, offset)
        addr = ctypes.addressof(anchor)
        del anchor
        registration = transport.register(addr, length, mapping)
    except NVMeoFError as exc:
        mapping.close()
        raise TransportError(f"{refusal}; nor can its CPU mapping be registered ({exc})") \
            from None
    except BaseException:
        mapping.close()
        raise
    return Region(addr, length, registration, mapping), mapping.close
