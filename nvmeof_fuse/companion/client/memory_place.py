"""Where a companion client's memory is, said in its lease request, so that the mount daemon
leases it queues on the path nearest that memory (issue #59): a GPU by its PCI address (the
CUDA driver's ``cuDeviceGetPCIBusId``), host memory by the NUMA node of its pages
(``move_pages``) or of the calling thread (its CPU affinity, else the CPU it runs on).

What cannot be told is None: the lease then goes where it would without it.  Nothing here
needs a GPU or several NUMA nodes; the sysfs root is the topology's (``NVMEOF_FUSE_SYSFS``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import re
from typing import Any

from ...errors import InvalidArgument
from ...host.memory import buffer_address
from ...host.multipath.nearest import MAX_NUMA_NODE, MemoryPlace
from ...host.topology.pcie import bus_id
from ...host.topology.sysfs import Topology
from ..cuda.driver import CudaError

_MOVE_PAGES = {"x86_64": 279, "aarch64": 239, "ppc64le": 301}
"""``move_pages``' syscall number (glibc has no wrapper; libnuma is not needed for one call)."""
_NAMED = re.compile(r"^(cuda|numa):(\d{1,4})$")

__all__ = ["memory_place", "pages_numa_node", "thread_numa_node"]


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def pages_numa_node(addr: int) -> int | None:
    """The NUMA node of the page at ``addr`` (``move_pages`` with no target nodes only
    asks), or None: not present yet (never touched), no NUMA, or no such call here."""
    number = _MOVE_PAGES.get(platform.machine())
    if number is None:
        return None
    page = ctypes.c_void_p(addr - addr % mmap.PAGESIZE)
    status = ctypes.c_int(-1)
    try:
        done = _libc().syscall(ctypes.c_long(number), 0, ctypes.c_ulong(1), ctypes.byref(page),
                               None, ctypes.byref(status), 0)
    except (OSError, AttributeError):
        return None
    if done != 0 or not 0 <= status.value <= MAX_NUMA_NODE:  # -ENOENT: not present yet
        return None
    return status.value


def thread_numa_node(topology: Topology | None = None) -> int | None:
    """The NUMA node the calling thread runs on: the one that holds all the CPUs it may run
    on, else the one of the CPU it runs on now; None where sysfs shows no nodes."""
    topology = topology or Topology()
    try:
        node = topology.node_of_cpus(os.sched_getaffinity(0))
    except OSError:
        node = None
    if node is not None:
        return node
    try:
        cpu = _libc().sched_getcpu()
    except (OSError, AttributeError):
        return None
    return topology.node_of_cpu(cpu) if cpu >= 0 else None


def _gpu(cuda: Any, device: int, near: Any) -> MemoryPlace:
    try:
        return MemoryPlace(gpu=bus_id(cuda.pci_bus_id(device)))
    except CudaError as exc:
        raise InvalidArgument(f"near={_shown(near)}: no CUDA device {device} ({exc})") from None
    except ValueError as exc:
        raise InvalidArgument(f"near={_shown(near)}: the CUDA driver's PCI address: "
                              f"{exc}") from None


def memory_place(near: Any, cuda: Any, topology: Topology | None = None) -> MemoryPlace | None:
    """Where ``near`` says a File's memory will be, as a lease request says it.

    ``near`` is None (the calling thread's NUMA node), a CUDA device ordinal (``0``,
    ``"cuda:0"``, a ``torch.device``), ``"numa:N"``, a GPU's PCI address, a CUDA buffer
    (its device) or a host buffer (the node of its first page, else the thread's), or a
    :class:`MemoryPlace`.  InvalidArgument, in one line, for anything else.
    """
    if near is None:
        node = thread_numa_node(topology)
        return MemoryPlace(numa_node=node) if node is not None else None
    if isinstance(near, MemoryPlace):
        return near
    if isinstance(near, bool):
        raise InvalidArgument(f"near={near!r} is not a place (a CUDA device, 'numa:N', a "
                              "buffer)")
    if isinstance(near, int):
        if not 0 <= near <= 4095:
            raise InvalidArgument(f"near={near} is not a CUDA device ordinal")
        return _gpu(cuda, near, near)
    if isinstance(near, str):
        named = _NAMED.match(near.strip().lower())
        if named is not None and named.group(1) == "cuda":
            return _gpu(cuda, int(named.group(2)), near)
        if named is not None:
            node = int(named.group(2))
            if node > MAX_NUMA_NODE:
                raise InvalidArgument(f"near={near!r}: NUMA nodes go to {MAX_NUMA_NODE}")
            return MemoryPlace(numa_node=node)
        try:
            return MemoryPlace(gpu=bus_id(near)) if len(near) <= 32 else _bad(near)
        except ValueError:
            return _bad(near)
    if getattr(near, "type", None) == "cuda" and hasattr(near, "index"):  # torch.device
        index = near.index
        return _gpu(cuda, int(index) if index is not None else 0, near)
    if cuda.is_cuda(near):
        try:
            return _gpu(cuda, cuda.memory(near).device, near)
        except CudaError as exc:
            raise InvalidArgument(f"near=<CUDA buffer>: {exc}") from None
    try:
        addr = buffer_address(near)[0]
    except (InvalidArgument, TypeError, ValueError, BufferError):
        return _bad(near)
    node = pages_numa_node(addr)
    if node is None:
        node = thread_numa_node(topology)
    return MemoryPlace(numa_node=node) if node is not None else None


def _shown(near: Any) -> str:
    text = repr(near)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(near: Any) -> MemoryPlace:
    raise InvalidArgument(f"near={_shown(near)} is not a place: a CUDA device (0, 'cuda:0'), "
                          "'numa:N', a GPU's PCI address, or a buffer")
