"""Memory the target can reach: registered regions, host buffers and the bounce pool.

A :class:`Region` is memory registered with a controller's transport once; it
is valid on every queue, though its keys may differ per queue (for RDMA: one MR
in each queue's protection domain, see :meth:`Registration.keys`).
Commands address it through :class:`DataRef` slices, which the transport turns
into keyed SGL descriptors or in-capsule data.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from ..errors import CommandTimeout, InvalidArgument, TransportError


class Keys(Protocol):
    """The keys one queue uses for registered memory."""

    lkey: int
    rkey: int


class Registration(Protocol):
    """What a transport hands back for registered memory."""

    def keys(self, domain: object) -> Keys:
        """The keys valid on queues of ``domain`` (for RDMA: a queue's protection domain)."""
        ...

    def close(self) -> None: ...


Register = Callable[[int, int, object], Registration]
"""``register(addr, length, owner)``: a transport's memory registration call."""


class Region:
    """``length`` bytes at ``addr`` registered with a transport; ``view`` when host-visible."""

    def __init__(self, addr: int, length: int, registration: Registration,
                 owner: object = None, view: memoryview | None = None) -> None:
        self.addr = addr
        self.length = length
        self.registration = registration
        self.owner = owner  # keeps the backing allocation alive
        self.view = view

    def ref(self, offset: int = 0, length: int | None = None) -> DataRef:
        """The slice ``[offset, offset + length)`` of this region, bounds-checked."""
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise InvalidArgument(
                f"range [{offset}, {offset + length}) is outside the {self.length}-byte region")
        return DataRef(self, offset, length)

    def close(self) -> None:
        if self.registration is not None:
            self.registration.close()
            self.registration = None  # type: ignore[assignment]
        self.view = None


@dataclass(frozen=True, slots=True)
class DataRef:
    """A slice of a registered region: what a command's data pointer describes."""

    region: Region
    offset: int
    length: int

    @property
    def addr(self) -> int:
        return self.region.addr + self.offset


def host_buffer(register: Register, length: int) -> Region:
    """Allocate ``length`` bytes of page-aligned host memory and register it."""
    if length <= 0:
        raise InvalidArgument(f"buffer length must be positive, got {length}")
    mem = mmap.mmap(-1, length)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    view = memoryview(mem)
    try:
        registration = register(addr, length, mem)
    except BaseException:
        view.release()
        mem.close()
        raise
    return Region(addr, length, registration, owner=mem, view=view)


def buffer_address(obj: Any) -> tuple[int, int, object]:
    """``(addr, nbytes, owner)`` of caller memory: a numpy array, a host tensor, a buffer.

    The memory must be contiguous; CUDA tensors go through :mod:`nvmeof_fuse.gpu`.
    """
    if getattr(obj, "is_cuda", False):
        raise InvalidArgument("CUDA tensors are registered through nvmeof_fuse.gpu")
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch CPU tensor
        if not obj.is_contiguous():
            raise InvalidArgument("tensor must be contiguous to be registered")
        return int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size()), obj
    if hasattr(obj, "__array_interface__"):  # numpy array and friends
        import numpy as np

        arr = np.asarray(obj)
        if not arr.flags.c_contiguous:
            raise InvalidArgument("array must be C-contiguous to be registered")
        if not arr.flags.writeable:
            raise InvalidArgument("array must be writable to be registered")
        return int(arr.ctypes.data), int(arr.nbytes), obj
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

    @property
    def available(self) -> int:
        """Buffers free right now."""
        return self._available.value

    async def take(self) -> Region:
        """A free buffer, waiting up to ``timeout`` for one; pair with :meth:`give`.

        Does not yield when a buffer is free: this is on every bounced I/O.
        """
        try:
            self._available.acquire_nowait()
        except trio.WouldBlock:
            with trio.move_on_after(self.timeout) as waited:
                await self._available.acquire()
            if waited.cancelled_caught:
                raise CommandTimeout(
                    f"no bounce buffer came free within {self.timeout:g} s") from None
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
