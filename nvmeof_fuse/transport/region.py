"""Registered memory as transports see it: regions, slices of them, host buffers.

A :class:`Region` is memory registered with a controller's transport once; it
is valid on every queue, though its keys may differ per queue (for RDMA: one MR
in each queue's protection domain, see :meth:`Registration.keys`).  Commands
address it through :class:`DataRef` slices, which the transport turns into
keyed SGL descriptors or in-capsule data.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import InvalidArgument


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


