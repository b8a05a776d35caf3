"""empty(): memfd-backed arrays the daemon can map, and finding them by address."""

from __future__ import annotations

import fcntl
import gc
import os

import numpy as np
import pytest

import nvmeof_fuse
from nvmeof_fuse.companion.client import shm
from nvmeof_fuse.errors import InvalidArgument


def test_empty_is_a_zeroed_array_in_a_sealed_memfd():
    arr = nvmeof_fuse.empty((3, 5), dtype=np.float64)
    assert arr.shape == (3, 5) and arr.dtype == np.float64 and not arr.any()
    mem, offset = shm.find(arr.ctypes.data, arr.nbytes)
    assert offset == 0 and len(mem) % shm.PAGE == 0 and len(mem) >= arr.nbytes
    assert os.readlink(f"/proc/self/fd/{mem.fd}").startswith("/memfd:nvmeof-fuse")
    seals = fcntl.fcntl(mem.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    with pytest.raises(OSError):
        os.ftruncate(mem.fd, 1)


def test_views_are_found_inside_their_allocation():
    arr = nvmeof_fuse.empty(10_000)
    mem, offset = shm.find(arr[100:].ctypes.data, 50)
    assert offset == 100
    assert shm.find(arr.ctypes.data, len(mem) + 1) is None  # runs past the allocation
    assert shm.find(np.zeros(10).ctypes.data, 8) is None  # ordinary memory


def test_freed_allocation_is_forgotten_and_its_fd_closed():
    arr = nvmeof_fuse.empty(4096)
    addr = arr.ctypes.data
    fd = shm.find(addr, 1)[0].fd
    del arr
    gc.collect()
    assert shm.find(addr, 1) is None
    with pytest.raises(OSError):
        os.fstat(fd)


def test_bad_shapes():
    assert nvmeof_fuse.empty(0).shape == (0,)
    with pytest.raises(InvalidArgument, match="negative dimension -1"):
        nvmeof_fuse.empty((2, -1))


def test_an_allocation_the_garbage_collector_frees_while_the_lock_is_held_does_not_hang():
    """The collector may run inside any allocation, ``on_free``'s and ``find``'s under the
    module's lock among them, and the finalizer takes that lock on the same thread."""
    import gc
    import threading

    from nvmeof_fuse.companion.client import shm

    def collect_under_the_lock() -> None:
        mem = shm.allocate(1)
        cycle: list = [mem]
        cycle.append(cycle)  # freed only by the collector
        del mem, cycle
        with shm._lock:
            gc.collect()

    thread = threading.Thread(target=collect_under_the_lock, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the finalizer waited for a lock its own thread held"
