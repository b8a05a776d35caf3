"""Host memory a mount daemon in another process can map: memfd-backed numpy arrays.

:func:`empty` allocates an array in a sealed memfd.  When such an array is read
into, the daemon maps the same pages (the fd crosses the socket once) and
registers them, so the target's RDMA writes land in the caller's array.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from ...errors import InvalidArgument

PAGE = mmap.PAGESIZE
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SharedMemory(mmap.mmap):
    """A shared mapping of a sealed memfd; ``fd`` stays open while the mapping lives."""

    fd: int
    addr: int
    key: int

    def __new__(cls, fd: int, length: int) -> SharedMemory:
        self = super().__new__(cls, fd, length)
        self.fd = fd
        anchor = ctypes.c_char.from_buffer(self)  # a buffer export: dropped at once
        self.addr = ctypes.addressof(anchor)
        del anchor
        self.key = self.addr
        return self


_lock = threading.RLock()
"""Reentrant: an allocation in a cycle is freed by the garbage collector, which runs its
finalizer (:func:`_forget`, which takes this lock) on whatever thread allocated when the
collector ran, also one holding the lock already (a plain lock deadlocked there)."""
_live: dict[int, weakref.ref[SharedMemory]] = {}
_on_free: list[weakref.WeakMethod] = []  # told (key) when an allocation is freed


def _forget(key: int, fd: int) -> None:
    with _lock:
        _live.pop(key, None)
        listeners = [ref() for ref in _on_free]
    os.close(fd)
    for listener in listeners:
        if listener is not None:
            listener(key)


def allocate(nbytes: int) -> SharedMemory:
    """``nbytes`` (rounded up to a page) of zeroed memory in a sealed memfd."""
    if nbytes < 0:
        raise InvalidArgument(f"cannot allocate {nbytes} bytes")
    length = max(PAGE, -(-nbytes // PAGE) * PAGE)
    fd = os.memfd_create("nvmeof-fuse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, length)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # the size the daemon maps never changes
        mem = SharedMemory(fd, length)
    except BaseException:
        os.close(fd)
        raise
    with _lock:
        _live[mem.key] = weakref.ref(mem)
    weakref.finalize(mem, _forget, mem.key, fd)
    return mem


def empty(shape: int | Iterable[int], dtype: Any = "uint8") -> Any:
    """A numpy array in memory the mount daemon can map (see :mod:`nvmeof_fuse`)."""
    import numpy as np

    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    count = 1
    for dim in dims:
        if dim < 0:
            raise InvalidArgument(f"negative dimension {dim} in shape {dims}")
        count *= dim
    mem = allocate(count * dt.itemsize)
    return np.frombuffer(mem, dtype=dt, count=count).reshape(dims)


def find(addr: int, nbytes: int) -> tuple[SharedMemory, int] | None:
    """The live allocation holding ``[addr, addr + nbytes)`` and the offset into it."""
    with _lock:
        refs = list(_live.values())
    for ref in refs:
        mem = ref()
        if mem is not None and mem.addr <= addr and addr + nbytes <= mem.addr + len(mem):
            return mem, addr - mem.addr
    return None


def on_free(listener: Any) -> None:
    """Call the bound method ``listener(key)`` whenever an allocation is freed.

    It is held weakly, so an object that forgets to unsubscribe can still go away.
    """
    with _lock:
        _on_free.append(weakref.WeakMethod(listener))


def remove_on_free(listener: Any) -> None:
    with _lock:
        _on_free[:] = [ref for ref in _on_free if ref() not in (None, listener)]
