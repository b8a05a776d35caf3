"""Memory the target can reach: caller buffers, registered regions and the bounce pool.

:class:`Region`, :class:`DataRef` and :func:`host_buffer` live in the transport
layer (:mod:`nvmeof_fuse.transport.region`), which needs them too; they are
re-exported here for the host side.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio

from ..errors import InvalidArgument, NVMeoFError
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
    """A fixed set of registered host buffers of ``chunk`` bytes, lent one per command.

    Buffers are registered once and reused.  ``take()``/``give()`` lend and return one
    (``borrow()`` is the two as a context manager, for commands the controller runs:
    they end only once the target can no longer reach their memory).  A buffer whose
    command was started with a callback and failed with its connection (a lost queue, a
    command timeout) may still be moved by the target until that connection is torn down:
    :meth:`hold` keeps it until the controller, having torn the queues down, calls
    :meth:`reclaim`, which gives every such buffer back; so a reconnect leaves the pool
    whole, whatever became of the commands of the connection it replaced.

    A wait for a buffer ends with an error once ``timeout`` passed while ``patient()``
    (the controller's) said no: while the controller reconnects the buffers' commands
    wait for it too, and otherwise they end within their own timeout.  Such an error
    means buffers went missing, a bug, and says so with the pool's counts.
    """

    def __init__(self, register: Register, chunk: int, count: int,
                 timeout: float = 30.0, patient: Callable[[], bool] | None = None,
                 clear_reads: bool = True) -> None:
        self.chunk = chunk
        self.clear_reads = clear_reads
        """Whether a read's buffer is cleared before the read goes out (:meth:`for_read`):
        where the transport cannot tell that a successful read moved all its data, the
        buffer must not hold the bytes of a request before it."""
        self._zeros = memoryview(bytes(chunk))
        self.timeout = timeout
        self.patient = patient
        self._free = [host_buffer(register, chunk) for _ in range(count)]
        self._all = list(self._free)
        self._available = trio.Semaphore(count)
        self._held: list[Region] = []
        self.generation = 0
        """Teardowns so far (:meth:`reclaim`): a command sent in an earlier one is gone."""
        self.waiters = 0

    @property
    def available(self) -> int:
        """Buffers free right now."""
        return self._available.value

    def counts(self) -> dict[str, int]:
        """What ``.nvmeof/stats`` shows: buffers free, lent to commands, held for a lost
        connection until its teardown, and callers waiting for one."""
        free, held = self._available.value, len(self._held)
        return {"free": free, "lent": len(self._all) - free - held, "held": held,
                "waiters": self.waiters}

    async def take(self) -> Region:
        """A free buffer, waiting for one if need be; pair with :meth:`give`.

        Does not yield when a buffer is free: this is on every bounced I/O.
        """
        try:
            self._available.acquire_nowait()
        except trio.WouldBlock:
            await self._wait()
        return self._free.pop()

    async def _wait(self) -> None:
        self.waiters += 1
        try:
            while True:
                with trio.move_on_after(self.timeout) as waited:
                    await self._available.acquire()
                if not waited.cancelled_caught:
                    return
                if self.patient is not None and self.patient():
                    continue  # reconnecting: the buffers' commands wait for it too
                counts = self.counts()
                raise NVMeoFError(
                    f"internal error: no bounce buffer came back within {self.timeout:g} s "
                    f"while connected ({counts['lent']} lent, {counts['held']} held, "
                    f"{counts['waiters']} waiting): buffers went missing") from None
        finally:
            self.waiters -= 1

    def take_nowait(self) -> Region | None:
        """A free buffer, or None when there is none; pair with :meth:`give`."""
        try:
            self._available.acquire_nowait()
        except trio.WouldBlock:
            return None
        return self._free.pop()

    def for_read(self, view: memoryview, length: int) -> None:
        """A read of ``length`` bytes goes into ``view`` (a buffer of this pool): cleared
        first where :attr:`clear_reads`."""
        if self.clear_reads:
            view[:length] = self._zeros[:length]

    def give(self, region: Region) -> None:
        """Return a buffer from :meth:`take` (never one the target may still reach)."""
        self._free.append(region)
        self._available.release()

    def hold(self, region: Region, sent: int) -> None:
        """``region``'s command, sent in :attr:`generation` ``sent``, failed with its
        connection: the buffer comes back once that connection is torn down (at once if
        it already is)."""
        if sent < self.generation:
            self.give(region)
        else:
            self._held.append(region)

    def reclaim(self) -> None:
        """Every queue is torn down: nothing can reach a held buffer, so each comes back."""
        self.generation += 1
        held, self._held = self._held, []
        for region in held:
            self.give(region)

    @contextlib.asynccontextmanager
    async def borrow(self) -> AsyncIterator[Region]:
        region = await self.take()
        try:
            yield region
        finally:
            self.give(region)

    def close(self) -> None:
        for region in self._all:
            region.close()
        self._all.clear()
        self._free.clear()
        self._held.clear()
