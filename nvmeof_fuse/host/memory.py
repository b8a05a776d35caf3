"""Memory the target can reach: caller buffers, registered regions and the bounce pool.

:class:`Region`, :class:`DataRef` and :func:`host_buffer` live in the transport
layer (:mod:`nvmeof_fuse.transport.region`), which needs them too; they are
re-exported here for the host side.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import AsyncIterator
from typing import Any

import trio

from ..errors import CommandTimeout, InvalidArgument, TransportError
from ..transport.region import DataRef, Keys, Region, Register, Registration, host_buffer

__all__ = ["BouncePool", "DataRef", "Keys", "Region", "Register", "Registration",
           "buffer_address", "host_buffer"]


def buffer_address(obj: Any) -> tuple[int, int, object]:
    """``(addr, nbytes, owner)`` of caller memory: a numpy array, a host tensor, a buffer.

    The memory must be contiguous; CUDA tensors go through :mod:`nvmeof_fuse.gpu`.
    """
    np = sys.modules.get("numpy")
    if np is not None and type(obj) is np.ndarray:  # the common case, without probing
        return _array_address(obj)
    if getattr(obj, "is_cuda", False):
        raise InvalidArgument("CUDA tensors are registered through nvmeof_fuse.gpu")
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch CPU tensor
        if not obj.is_contiguous():
            raise InvalidArgument("tensor must be contiguous to be registered")
        return int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size()), obj
    if hasattr(obj, "__array_interface__"):  # numpy array and friends
        import numpy as np

        return _array_address(np.asarray(obj), obj)
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidArgument(f"cannot register a {type(obj).__name__}: "
                              "pass a numpy array, a tensor or a writable buffer") from None
    if view.readonly or not view.c_contiguous:
        raise InvalidArgument("buffer must be writable and contiguous to be registered")
    if not view.nbytes:  # ctypes cannot take the address of an empty buffer
        raise InvalidArgument("cannot register an empty buffer")
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return addr, view.nbytes, obj


def _array_address(arr: Any, owner: object = None) -> tuple[int, int, object]:
    flags = arr.flags
    if not flags.c_contiguous:
        raise InvalidArgument("array must be C-contiguous to be registered")
    if not flags.writeable:
        raise InvalidArgument("array must be writable to be registered")
    # __array_interface__ costs a third of .ctypes.data
    return arr.__array_interface__["data"][0], arr.nbytes, arr if owner is None else owner


class BouncePool:
    """A fixed set of registered host buffers of ``chunk`` bytes, borrowed per transfer.

    Buffers are registered once and reused.  A buffer whose command timed out or
    whose transport failed may still be written by the target, so it is never
    handed out again.  ``borrow()`` is the usual way; ``take()``/``give()`` are
    the same two halves for callers that hand the data on after giving the
    buffer back (see :meth:`Namespace.lend_lbas`).
    """

    def __init__(self, register: Register, chunk: int, count: int,
                 timeout: float = 30.0) -> None:
        self.chunk = chunk
        self.timeout = timeout
        self._free = [host_buffer(register, chunk) for _ in range(count)]
        self._all = list(self._free)
        self._available = trio.Semaphore(count)
        self.waiters = 0

    @property
    def available(self) -> int:
        """Buffers free right now."""
        return self._available.value

    def counts(self) -> dict[str, int]:
        """What ``.nvmeof/stats`` shows: buffers free, lent, and callers waiting for one."""
        free = self._available.value
        return {"free": free, "lent": len(self._all) - free, "waiters": self.waiters}

    async def take(self) -> Region:
        """A free buffer, waiting up to ``timeout`` for one; pair with :meth:`give`.

        Does not yield when a buffer is free: this is on every bounced I/O.
        """
        try:
            self._available.acquire_nowait()
        except trio.WouldBlock:
            self.waiters += 1
            try:
                with trio.move_on_after(self.timeout) as waited:
                    await self._available.acquire()
            finally:
                self.waiters -= 1
            if waited.cancelled_caught:
                raise CommandTimeout(
                    f"no bounce buffer came free within {self.timeout:g} s") from None
        return self._free.pop()

    def take_nowait(self) -> Region | None:
        """A free buffer, or None when there is none; pair with :meth:`give`."""
        try:
            self._available.acquire_nowait()
        except trio.WouldBlock:
            return None
        return self._free.pop()

    def give(self, region: Region) -> None:
        """Return a buffer from :meth:`take` (never one the target may still write)."""
        self._free.append(region)
        self._available.release()

    @contextlib.asynccontextmanager
    async def borrow(self) -> AsyncIterator[Region]:
        region = await self.take()
        try:
            yield region
        except (CommandTimeout, TransportError):
            raise  # the target may still write it: it stays taken
        except BaseException:
            self.give(region)
            raise
        else:
            self.give(region)

    def close(self) -> None:
        for region in self._all:
            region.close()
        self._all.clear()
        self._free.clear()
