"""A fake CUDA driver on the CPU, as strict as the real one about contexts.

"Device memory" is a memfd mapping, so its "dma-buf" is the memfd (a fake
transport maps it) and copies are ``memmove``.  What it enforces, as libcuda
does: every call that acts on a context fails with CUDA_ERROR_INVALID_CONTEXT
(201) on a thread with no context pushed, and a copy into or out of memory of
another device's context fails too.  Pointer queries need no context.

Install it with ``gpu.use(gpu.Cuda(FakeDriver()))`` (the ``cuda`` fixture).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from nvmeof_fuse.companion.client import shm
from nvmeof_fuse.companion.cuda.driver import INVALID_CONTEXT, CudaError, PointerInfo

MEMORYTYPE_DEVICE = 2


class FakeTensor:
    """A 1-D uint8 "CUDA array" in a memfd (the CUDA Array Interface, as cupy's)."""

    def __init__(self, nbytes: int, *, device: int = 0, driver: FakeDriver | None = None,
                 base: FakeTensor | None = None, offset: int = 0) -> None:
        self.device = device
        if base is None:
            self.mem = shm.allocate(max(nbytes, 1))
            self.addr = self.mem.addr
            if driver is not None:
                driver.allocate(self)
        else:  # a view into another tensor's allocation
            self.mem = base.mem
            self.addr = base.addr + offset
        self.nbytes = nbytes
        self.bytes = np.frombuffer(self.mem, dtype=np.uint8, count=nbytes,
                                   offset=self.addr - self.mem.addr)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.addr, False),
                "version": 3, "strides": None}

    def view(self, offset: int, nbytes: int) -> FakeTensor:
        return FakeTensor(nbytes, device=self.device, base=self, offset=offset)


class FakeDriver:
    """:class:`~nvmeof_fuse.companion.cuda.driver.LibCuda`'s methods, on the CPU."""

    def __init__(self, devices: int = 2, *, vmm: bool = False) -> None:
        self.contexts = {device: 0xC0DE0 + device for device in range(devices)}
        self.vmm = vmm  # memory belongs to no context (CONTEXT attribute is NULL)
        self.dmabuf_devices = set(range(devices))  # devices that export dma-bufs
        self.bus_ids: dict[int, str] = {}  # device -> PCI address (default: bus 1a + device)
        self.export_error: CudaError | None = None
        self.pin_error: CudaError | None = None
        self.calls: list[tuple[str, int]] = []  # (call, context it ran in)
        self.pinned: dict[int, int] = {}  # host address -> length
        self.exported: dict[int, Callable[[int, int], int]] = {}
        self._allocations: dict[int, tuple[FakeTensor, int]] = {}  # base -> (tensor, id)
        self._ids = itertools.count(1)
        self._handles = itertools.count(0x5000)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.export = self._export_memfd  # (base, length) -> fd; the VM swaps in udmabuf

    def tensor(self, nbytes: int, device: int = 0) -> FakeTensor:
        """A new allocation of ``nbytes`` on ``device``."""
        return FakeTensor(nbytes, device=device, driver=self)

    def allocate(self, tensor: FakeTensor) -> None:
        with self._lock:
            self._allocations[tensor.addr] = (tensor, next(self._ids))

    def free(self, tensor: FakeTensor) -> None:
        """The allocation is freed; a new one at the same address gets a new buffer ID."""
        with self._lock:
            self._allocations.pop(tensor.addr, None)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    # -- no context needed --------------------------------------------------------------

    def _find(self, ptr: int) -> tuple[FakeTensor, int] | None:
        with self._lock:
            for base, (tensor, buffer_id) in self._allocations.items():
                if base <= ptr < base + len(tensor.mem):  # allocations are whole pages
                    return tensor, buffer_id
        return None

    def pointer_info(self, ptr: int) -> PointerInfo:
        found = self._find(ptr)
        if found is None:
            return PointerInfo(0, 0, 0, 0, 0, 0)  # as libcuda: defaults, no error
        tensor, buffer_id = found
        context = 0 if self.vmm else self.contexts[tensor.device]
        return PointerInfo(context, tensor.device, buffer_id, tensor.addr, len(tensor.mem),
                           MEMORYTYPE_DEVICE)

    def primary_context(self, device: int) -> int:
        return self.contexts[device]

    def dmabuf_supported(self, device: int) -> bool:
        return device in self.dmabuf_devices

    def pci_bus_id(self, device: int) -> str:
        """As libcuda spells it; CUDA_ERROR_INVALID_DEVICE (101) for one not here."""
        if device not in self.contexts:
            raise CudaError("cuDeviceGet", 101, "CUDA_ERROR_INVALID_DEVICE")
        return self.bus_ids.get(device, f"00000000:{0x1a + device:02X}:00.0")

    # -- the context stack ----------------------------------------------------------------

    @property
    def _stack(self) -> list[int]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def push(self, ctx: int) -> None:
        if ctx not in self.contexts.values():
            raise CudaError("cuCtxPushCurrent", INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT")
        self._stack.append(ctx)

    def pop(self) -> None:
        if not self._stack:
            raise CudaError("cuCtxPopCurrent", INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT")
        self._stack.pop()

    def _current(self, call: str) -> int:
        """The thread's current context, or the error libcuda gives without one."""
        if not self._stack:
            raise CudaError(call, INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT")
        ctx = self._stack[-1]
        with self._lock:
            self.calls.append((call, ctx))
        return ctx

    def _in_current(self, call: str, ptr: int, nbytes: int) -> None:
        """``[ptr, ptr + nbytes)`` must be device memory of the current context's device."""
        ctx = self._current(call)
        found = self._find(ptr)
        if found is None or self.contexts[found[0].device] != ctx:
            raise CudaError(call, 1, "CUDA_ERROR_INVALID_VALUE")
        tensor = found[0]
        if ptr + nbytes > tensor.addr + len(tensor.mem):
            raise CudaError(call, 1, "CUDA_ERROR_INVALID_VALUE")

    # -- context-bound calls --------------------------------------------------------------

    def synchronize(self) -> None:
        self._current("synchronize")

    def flush_gpudirect_writes(self) -> None:
        self._current("flush")

    def export_dmabuf(self, base: int, length: int) -> int:
        self._in_current("export", base, length)
        if self.export_error is not None:
            raise self.export_error
        return self.export(base, length)

    def _export_memfd(self, base: int, length: int) -> int:
        mem, offset = shm.find(base, length)
        assert offset == 0, "the fake transport maps a dma-buf from its start"
        return os.dup(mem.fd)

    def host_register(self, addr: int, length: int) -> None:
        self._current("host_register")
        if self.pin_error is not None:
            raise self.pin_error
        self.pinned[addr] = length

    def host_unregister(self, addr: int) -> None:
        self._current("host_unregister")
        del self.pinned[addr]

    def stream_create(self) -> int:
        self._current("stream_create")
        return next(self._handles)

    def stream_synchronize(self, stream: int) -> None:
        with self._lock:
            self.calls.append(("stream_synchronize", stream))

    def event_create(self) -> int:
        self._current("event_create")
        return next(self._handles)

    def event_record(self, event: int, stream: int) -> None:
        with self._lock:
            self.calls.append(("event_record", stream))

    def event_synchronize(self, event: int) -> None:
        pass

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._in_current("to_device", dst, nbytes)
        self._note_stream(stream)
        ctypes.memmove(dst, src, nbytes)

    def copy_to_host(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._in_current("to_host", src, nbytes)
        self._note_stream(stream)
        ctypes.memmove(dst, src, nbytes)

    def _note_stream(self, stream: int) -> None:
        with self._lock:
            self.calls.append(("on_stream", stream))


def install(driver: FakeDriver | None = None) -> tuple[FakeDriver, Any]:
    """Install a fake driver behind the companion API's CUDA seam: ``(driver, seam)``."""
    from nvmeof_fuse.companion.cuda import gpu

    driver = driver or FakeDriver()
    seam = gpu.Cuda(driver)
    gpu.use(seam)
    return driver, seam

