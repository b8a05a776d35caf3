"""CUDA memory for the companion API: each driver call in the memory's own context, on any thread.

A caller's thread may never have touched CUDA (a copy thread of ``File``, a data
loader's thread), and a process may drive several GPUs.  So every call that
acts on a context (dma-buf export, synchronize, GPUDirect flush, copies,
pinning) pushes the context that owns the memory around it and pops it after,
as kvikio's ``PushAndPopContext`` does.  The context comes from the pointer
(``CU_POINTER_ATTRIBUTE_CONTEXT``), or for memory mapped with the VMM API
(which belongs to no context) the device's primary context.

Ordering rules:

* before the target reads GPU memory directly (an NVMe Write), the work
  producing it must be done: :meth:`Cuda.synchronize` (the device's context, or
  only ``stream`` when the caller gave one);
* after the target wrote GPU memory directly (a Read), the writes are made
  visible to CUDA: :meth:`Cuda.flush_gpudirect_writes`;
* staged copies run on a stream of the calling thread's own (ordered with the
  legacy default stream), or on the caller's ``stream``, and are complete when
  :meth:`Cuda.to_device` / :meth:`Cuda.to_host` return.

The driver is :func:`~nvmeof_fuse.companion.cuda.driver.libcuda` unless a test
installs another with :func:`use`.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

from ...errors import InvalidArgument
from .driver import CudaError, libcuda

PAGE = mmap.PAGESIZE

__all__ = ["PAGE", "Cuda", "CudaError", "DeviceMemory", "ops", "page_span", "stream_handle",
           "use"]


class DeviceMemory(NamedTuple):
    """A caller's CUDA buffer, resolved once per call."""

    ptr: int
    nbytes: int
    context: int  # the context to push around calls on this memory
    device: int
    base: int  # the allocation holding it
    size: int
    buffer_id: int  # changes when the allocation is freed and its addresses reused


def page_span(ptr: int, nbytes: int) -> tuple[int, int, int]:
    """``(base, offset, length)``: the page-aligned range around ``[ptr, ptr + nbytes)``."""
    base = ptr - ptr % PAGE
    offset = ptr - base
    return base, offset, -(-(offset + nbytes) // PAGE) * PAGE


def stream_handle(stream: Any) -> int | None:
    """The ``CUstream`` of a torch or cupy stream, or of an int handle; None for None."""
    if stream is None:
        return None
    for attribute in ("cuda_stream", "ptr", "handle"):  # torch, cupy, cuda-python
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    if isinstance(stream, int) and not isinstance(stream, bool) and stream >= 0:
        return stream
    raise InvalidArgument(f"stream must be a CUDA stream (torch, cupy) or its handle, "
                          f"got {stream!r}")


class Cuda:
    """The companion API's CUDA work over a driver (:class:`~.driver.LibCuda`)."""

    def __init__(self, driver: Any = None) -> None:
        self._driver = driver
        self._lock = threading.Lock()
        self._primary: dict[int, int] = {}  # device -> its retained primary context
        self._dmabuf: dict[int, bool] = {}  # device -> supports dma-buf export
        self._bus_ids: dict[int, str] = {}  # device -> its PCI address
        self._local = threading.local()  # .streams, .events: {context: handle}

    @property
    def driver(self) -> Any:
        if self._driver is None:
            self._driver = libcuda()
        return self._driver

    # -- what the caller's object is --------------------------------------------------------

    @staticmethod
    def is_cuda(obj: Any) -> bool:
        np = sys.modules.get("numpy")
        if np is not None and type(obj) is np.ndarray:  # never: skip probing its attributes
            return False
        if getattr(obj, "is_cuda", False):  # torch
            return True
        return hasattr(obj, "__cuda_array_interface__")  # cupy, numba, ...

    @staticmethod
    def span(obj: Any) -> tuple[int, int]:
        """``(device address, nbytes)`` of a contiguous CUDA array or tensor."""
        if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch
            if not obj.is_contiguous():
                raise InvalidArgument("CUDA tensor must be contiguous")
            return int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size())
        face = obj.__cuda_array_interface__
        ptr = int(face["data"][0])
        shape = tuple(face["shape"])
        itemsize = int(face["typestr"][2:])
        nbytes = itemsize
        for extent in shape:
            nbytes *= int(extent)
        strides = face.get("strides")
        if strides is not None:  # C-contiguous strides may be given explicitly
            expected, step = [], itemsize
            for extent in reversed(shape):
                expected.insert(0, step)
                step *= int(extent)
            if nbytes and tuple(strides) != tuple(expected):
                raise InvalidArgument("CUDA array must be C-contiguous")
        return ptr, nbytes

    def memory(self, obj: Any) -> DeviceMemory:
        """``obj``'s device memory, its allocation and the context to act in."""
        ptr, nbytes = self.span(obj)
        info = self.driver.pointer_info(ptr)
        if not info.memory_type or info.device < 0:
            raise InvalidArgument(f"the CUDA buffer at {ptr:#x} is not memory the CUDA "
                                  "driver knows (freed?)")
        context = info.context or self.primary_context(info.device)
        base, size = (info.base, info.size) if info.size else (ptr, nbytes)
        return DeviceMemory(ptr, nbytes, context, info.device, base, size, info.buffer_id)

    def primary_context(self, device: int) -> int:
        with self._lock:
            ctx = self._primary.get(device)
            if ctx is None:
                ctx = self._primary[device] = self.driver.primary_context(device)
            return ctx

    def dmabuf_supported(self, device: int) -> bool:
        with self._lock:
            known = self._dmabuf.get(device)
        if known is None:
            known = self.driver.dmabuf_supported(device)
            with self._lock:
                self._dmabuf[device] = known
        return known

    def pci_bus_id(self, device: int) -> str:
        """Device ``device``'s PCI address (as the driver spells it), asked once: where
        its memory sits on the PCIe tree, for the nearest path (issue #59)."""
        with self._lock:
            known = self._bus_ids.get(device)
        if known is None:
            known = self.driver.pci_bus_id(device)
            with self._lock:
                self._bus_ids[device] = known
        return known

    # -- context-bound calls ----------------------------------------------------------------

    @contextlib.contextmanager
    def current(self, context: int) -> Iterator[Any]:
        """``context`` current on this thread for the block: the driver, to call."""
        driver = self.driver
        driver.push(context)
        try:
            yield driver
        finally:
            driver.pop()

    def export_dmabuf(self, mem: DeviceMemory, base: int, length: int) -> int:
        """A dma-buf fd of the page-aligned range ``[base, base + length)`` of ``mem``'s
        allocation; the caller closes it."""
        with self.current(mem.context) as driver:
            return driver.export_dmabuf(base, length)

    def synchronize(self, mem: DeviceMemory, stream: int | None = None) -> None:
        """Wait for the work that produces ``mem``: its device's, or ``stream``'s only."""
        with self.current(mem.context) as driver:
            if stream is None:
                driver.synchronize()
            else:
                driver.stream_synchronize(stream)

    def flush_gpudirect_writes(self, mem: DeviceMemory) -> None:
        with self.current(mem.context) as driver:
            driver.flush_gpudirect_writes()

    def pin(self, mem: DeviceMemory, addr: int, length: int) -> None:
        """Page-lock host memory (for every context) so copies run at full speed."""
        with self.current(mem.context) as driver:
            driver.host_register(addr, length)

    def unpin(self, context: int, addr: int) -> None:
        with self.current(context) as driver:
            driver.host_unregister(addr)

    def _own(self, driver: Any, context: int, kind: str) -> int:
        """This thread's stream (or event) in ``context``, made on first use."""
        handles = getattr(self._local, kind, None)
        if handles is None:
            handles = {}
            setattr(self._local, kind, handles)
        handle = handles.get(context)
        if handle is None:
            handle = handles[context] = (driver.stream_create() if kind == "streams"
                                         else driver.event_create())
        return handle

    def to_device(self, mem: DeviceMemory, offset: int, src: int, nbytes: int,
                  stream: int | None = None) -> None:
        """Copy ``nbytes`` of host memory at ``src`` to ``mem`` at ``offset``; done on return."""
        _inside(mem, offset, nbytes)
        self._copy(mem, stream, True, mem.ptr + offset, src, nbytes)

    def to_host(self, mem: DeviceMemory, offset: int, dst: int, nbytes: int,
                stream: int | None = None) -> None:
        """Copy ``nbytes`` of ``mem`` at ``offset`` to host memory at ``dst``; done on return."""
        _inside(mem, offset, nbytes)
        self._copy(mem, stream, False, dst, mem.ptr + offset, nbytes)

    def _copy(self, mem: DeviceMemory, stream: int | None, to_device: bool, dst: int,
              src: int, nbytes: int) -> None:
        with self.current(mem.context) as driver:
            own = stream is None
            queue = self._own(driver, mem.context, "streams") if own else stream
            copy = driver.copy_to_device if to_device else driver.copy_to_host
            copy(dst, src, nbytes, queue)
            if own:
                driver.stream_synchronize(queue)
            else:  # wait for our copy only, not for what the caller queues after it
                event = self._own(driver, mem.context, "events")
                driver.event_record(event, queue)
                driver.event_synchronize(event)


def _inside(mem: DeviceMemory, offset: int, nbytes: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > mem.nbytes:
        raise InvalidArgument(f"a copy of {nbytes} bytes at offset {offset} leaves the "
                              f"{mem.nbytes}-byte CUDA buffer")


_ops: Cuda | None = None


def ops() -> Cuda:
    """The CUDA seam in use (over ``libcuda`` unless a test installed another)."""
    global _ops
    if _ops is None:
        _ops = Cuda()
    return _ops


def use(replacement: Cuda | None) -> None:
    """Install a CUDA seam (tests: ``Cuda(FakeDriver())``); ``None`` restores the default."""
    global _ops
    _ops = replacement

