"""A companion client's registrations: caller memory registered in its own PD, kept while
the object that owns the pages lives (the registration cache of
:class:`~.own_queues.DirectQueues`)."""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

from ...errors import InvalidArgument
from ...host.memory import Region, buffer_address
from . import shm

RECENT_BASES = 256
"""Array bases whose region :meth:`Registrations.find_array` remembers (forgotten all at
once past this: a loop over fresh arrays pays a search each, as before)."""


class Registrations:
    """Caller memory registered in our PD, kept while its owning object lives.

    The key is the object that owns the pages (an ``nvmeof_fuse.empty``
    allocation, a numpy array's base, a tensor): its registration is dropped once
    it is freed, so a later allocation at the same address is never served by a
    stale registration.  Memory with no such owner is registered per call.
    """

    def __init__(self, register) -> None:
        self._register = register
        self._by_owner: dict[int, Region] = {}
        self._lock = threading.Lock()
        self._register_lock = threading.Lock()  # one registration per owner
        self._recent: dict[int, tuple[weakref.ref, Region]] = {}  # id(base) -> its region
        self._closed = False

    def find(self, addr: int, size: int, obj: Any) -> tuple[Region, int, bool]:
        """``(region, offset of addr in it, temporary)``; close a temporary one after use."""
        owner, base, length = owning_span(addr, size, obj)
        if owner is None:
            return Region(addr, size, self._register(addr, size, obj), obj), 0, True
        region = self._owned(owner, base, length)
        return region, addr - region.addr, False

    def _owned(self, owner: Any, base: int, length: int) -> Region:
        """The region of ``owner``'s ``length`` bytes at ``base``, registered on first use."""
        with self._lock:
            region = self._by_owner.get(id(owner))
        if region is None:
            with self._register_lock:  # threads starting on one new array register it once
                with self._lock:
                    region = self._by_owner.get(id(owner))
                if region is None:  # not kept alive by its registration: watched instead
                    region = Region(base, length, self._register(base, length, None))
                    with self._lock:
                        if self._closed:
                            region.close()
                            raise InvalidArgument("the file is closed")
                        self._by_owner[id(owner)] = region
                    weakref.finalize(owner, self._forget, id(owner))
        return region

    def find_array(self, addr: int, size: int, array: Any) -> tuple[Region, int] | None:
        """:meth:`find` for a slice of a numpy array that is not temporary, remembered per
        the array's ``base`` (the rows of one allocation share theirs): ``(region, offset)``,
        or None when its memory is registered per call (the caller takes the general path)."""
        key = array.base
        if key is None:
            key = array
        entry = self._recent.get(id(key))
        if entry is not None and entry[0]() is key:
            region = entry[1]
            at = addr - region.addr
            if 0 <= at and at + size <= region.length and region.registration is not None:
                return region, at
        owner, base, length = owning_span(addr, size, array)
        if owner is None:
            return None
        region = self._owned(owner, base, length)
        at = addr - region.addr
        try:
            ref = weakref.ref(key)
        except TypeError:  # a base that cannot be watched (bytes): found by search each time
            return region, at
        if len(self._recent) >= RECENT_BASES:
            self._recent.clear()
        self._recent[id(key)] = (ref, region)
        return region, at

    def _forget(self, key: int) -> None:
        with self._lock:
            region = self._by_owner.pop(key, None)
        if region is not None:
            region.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            regions, self._by_owner = list(self._by_owner.values()), {}
        for region in regions:
            region.close()


def owning_span(addr: int, size: int, obj: Any) -> tuple[Any, int, int]:
    """``(owner, base, length)`` of the allocation holding ``[addr, addr+size)``.

    ``owner`` is None when no object that owns those pages can be watched.
    """
    np = sys.modules.get("numpy")  # no array without it; hasattr(__array_interface__) builds a dict
    if np is not None and isinstance(obj, np.ndarray):
        root = obj
        while isinstance(getattr(root, "base", None), np.ndarray):
            root = root.base
        if isinstance(root, np.ndarray):
            exporter = root.base.obj if isinstance(root.base, memoryview) else root.base
            if isinstance(exporter, shm.SharedMemory):  # nvmeof_fuse.empty: no search
                if exporter.addr <= addr and addr + size <= exporter.addr + len(exporter):
                    return exporter, exporter.addr, len(exporter)
            elif root.base is None and root.flags.c_contiguous:
                base, length, _ = buffer_address(root)
                if base <= addr and addr + size <= base + length:
                    return root, base, length
    found = shm.find(addr, size)
    if found is not None:
        mem, _ = found
        return mem, mem.addr, len(mem)
    if hasattr(obj, "data_ptr"):  # a CPU tensor: watched as itself, registered whole
        base, length, _ = buffer_address(obj)
        if base <= addr and addr + size <= base + length:
            return obj, base, length
    return None, addr, size
