"""The CUDA driver API calls the companion API makes, one method per call, over ``libcuda``.

Nothing here decides anything: :mod:`nvmeof_fuse.companion.cuda.gpu` pushes the
right context around these calls and chooses streams.  ``libcuda.so.1`` is
opened on first use with :mod:`ctypes` (its C API is public and stable), so
neither torch nor a CUDA toolkit is needed to import this module.  Tests swap
the whole driver for a fake with the same methods.
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple

# CUpointer_attribute
_ATTR_CONTEXT = 1
_ATTR_MEMORY_TYPE = 2
_ATTR_BUFFER_ID = 7
_ATTR_DEVICE_ORDINAL = 9
_ATTR_RANGE_START_ADDR = 11
_ATTR_RANGE_SIZE = 12
MEMORYTYPE_DEVICE = 2
_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
_FLUSH_TARGET_CURRENT_CTX = 0
_FLUSH_TO_OWNER = 100
_MEMHOSTREGISTER_PORTABLE = 0x01
_STREAM_DEFAULT = 0  # ordered with the legacy default stream, as kvikio's per-thread streams
_EVENT_DISABLE_TIMING = 0x02
INVALID_CONTEXT = 201


class CudaError(RuntimeError):
    """A driver call failed: ``code`` is its CUresult, the message names call and error."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.code = code


class PointerInfo(NamedTuple):
    """What the driver knows of a device address (one ``cuPointerGetAttributes`` call)."""

    context: int  # CUcontext it was allocated in; 0 for VMM memory (see ``device``)
    device: int  # ordinal of the device holding it; -1 when not device memory
    buffer_id: int  # process-wide unique per allocation: detects reuse after free
    base: int  # the allocation's start
    size: int  # and size
    memory_type: int  # MEMORYTYPE_DEVICE for device memory


_c = ctypes
_SIGNATURES: dict[str, tuple[list, type | None]] = {
    "cuInit": ([_c.c_uint], _c.c_int),
    "cuGetErrorName": ([_c.c_int, _c.POINTER(_c.c_char_p)], _c.c_int),
    "cuPointerGetAttributes": ([_c.c_uint, _c.POINTER(_c.c_int), _c.POINTER(_c.c_void_p),
                                _c.c_ulonglong], _c.c_int),
    "cuDeviceGet": ([_c.POINTER(_c.c_int), _c.c_int], _c.c_int),
    "cuDeviceGetAttribute": ([_c.POINTER(_c.c_int), _c.c_int, _c.c_int], _c.c_int),
    "cuDeviceGetPCIBusId": ([_c.c_char_p, _c.c_int, _c.c_int], _c.c_int),
    "cuDevicePrimaryCtxRetain": ([_c.POINTER(_c.c_void_p), _c.c_int], _c.c_int),
    "cuCtxPushCurrent_v2": ([_c.c_void_p], _c.c_int),
    "cuCtxPopCurrent_v2": ([_c.POINTER(_c.c_void_p)], _c.c_int),
    "cuCtxSynchronize": ([], _c.c_int),
    "cuFlushGPUDirectRDMAWrites": ([_c.c_int, _c.c_int], _c.c_int),
    "cuMemGetHandleForAddressRange": ([_c.c_void_p, _c.c_ulonglong, _c.c_size_t, _c.c_int,
                                       _c.c_ulonglong], _c.c_int),
    "cuMemHostRegister_v2": ([_c.c_void_p, _c.c_size_t, _c.c_uint], _c.c_int),
    "cuMemHostUnregister": ([_c.c_void_p], _c.c_int),
    "cuStreamCreate": ([_c.POINTER(_c.c_void_p), _c.c_uint], _c.c_int),
    "cuStreamSynchronize": ([_c.c_void_p], _c.c_int),
    "cuEventCreate": ([_c.POINTER(_c.c_void_p), _c.c_uint], _c.c_int),
    "cuEventRecord": ([_c.c_void_p, _c.c_void_p], _c.c_int),
    "cuEventSynchronize": ([_c.c_void_p], _c.c_int),
    "cuMemcpyHtoDAsync_v2": ([_c.c_ulonglong, _c.c_void_p, _c.c_size_t, _c.c_void_p],
                             _c.c_int),
    "cuMemcpyDtoHAsync_v2": ([_c.c_void_p, _c.c_ulonglong, _c.c_size_t, _c.c_void_p],
                             _c.c_int),
}


class LibCuda:
    """``libcuda.so.1`` through ctypes; every method raises :class:`CudaError` on failure.

    Calls marked *context* act on the calling thread's current context, which the
    caller (:class:`~nvmeof_fuse.companion.cuda.gpu.Cuda`) has pushed.
    """

    def __init__(self, path: str = "libcuda.so.1") -> None:
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise CudaError(f"loading {path}", -1, str(exc)) from None
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name, None)
            if fn is not None:  # cuFlushGPUDirectRDMAWrites came with CUDA 11.3
                fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib
        self._check("cuInit", lib.cuInit(0))

    def _check(self, call: str, code: int) -> None:
        if code:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(code, ctypes.byref(name))
            raise CudaError(call, code, name.value.decode() if name.value else "unknown")

    def pointer_info(self, ptr: int) -> PointerInfo:
        """The allocation around ``ptr`` (needs no current context)."""
        ctx, mtype, buffer_id = ctypes.c_void_p(), ctypes.c_uint(), ctypes.c_ulonglong()
        device, base, size = ctypes.c_int(-1), ctypes.c_ulonglong(), ctypes.c_size_t()
        attrs = (ctypes.c_int * 6)(_ATTR_CONTEXT, _ATTR_MEMORY_TYPE, _ATTR_BUFFER_ID,
                                   _ATTR_DEVICE_ORDINAL, _ATTR_RANGE_START_ADDR,
                                   _ATTR_RANGE_SIZE)
        data = (ctypes.c_void_p * 6)(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in
                                       (ctx, mtype, buffer_id, device, base, size)))
        self._check("cuPointerGetAttributes",
                    self._lib.cuPointerGetAttributes(6, attrs, data, ptr))
        return PointerInfo(ctx.value or 0, device.value, buffer_id.value, base.value,
                           size.value, mtype.value)

    def primary_context(self, device: int) -> int:
        """The device's primary context, retained (as the runtime API, torch included, does)."""
        handle, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(handle), device))
        self._check("cuDevicePrimaryCtxRetain",
                    self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle))
        return ctx.value or 0

    def dmabuf_supported(self, device: int) -> bool:
        handle, value = ctypes.c_int(), ctypes.c_int()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(handle), device))
        self._check("cuDeviceGetAttribute", self._lib.cuDeviceGetAttribute(
            ctypes.byref(value), _DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, handle))
        return bool(value.value)

    def pci_bus_id(self, device: int) -> str:
        """The device's PCI address as the driver spells it (``0000:9A:00.0``)."""
        handle, text = ctypes.c_int(), ctypes.create_string_buffer(32)
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(handle), device))
        self._check("cuDeviceGetPCIBusId",
                    self._lib.cuDeviceGetPCIBusId(text, len(text), handle))
        return text.value.decode("ascii", "replace")

    def push(self, ctx: int) -> None:
        self._check("cuCtxPushCurrent", self._lib.cuCtxPushCurrent_v2(ctx))

    def pop(self) -> None:
        ctx = ctypes.c_void_p()
        self._check("cuCtxPopCurrent", self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctx)))

    def synchronize(self) -> None:
        """*context*: wait for all work of the current context."""
        self._check("cuCtxSynchronize", self._lib.cuCtxSynchronize())

    def flush_gpudirect_writes(self) -> None:
        """*context*: make inbound RDMA writes visible to the current context's work."""
        flush = getattr(self._lib, "cuFlushGPUDirectRDMAWrites", None)
        if flush is not None:  # older drivers order them themselves
            self._check("cuFlushGPUDirectRDMAWrites",
                        flush(_FLUSH_TARGET_CURRENT_CTX, _FLUSH_TO_OWNER))

    def export_dmabuf(self, base: int, length: int) -> int:
        """*context*: a dma-buf fd of the page-aligned device range (the caller closes it)."""
        fd = ctypes.c_int(-1)
        self._check("cuMemGetHandleForAddressRange", self._lib.cuMemGetHandleForAddressRange(
            ctypes.byref(fd), base, length, _RANGE_HANDLE_TYPE_DMA_BUF_FD, 0))
        return fd.value

    def host_register(self, addr: int, length: int) -> None:
        """*context*: page-lock host memory for every context (portable)."""
        self._check("cuMemHostRegister", self._lib.cuMemHostRegister_v2(
            addr, length, _MEMHOSTREGISTER_PORTABLE))

    def host_unregister(self, addr: int) -> None:
        """*context*"""
        self._check("cuMemHostUnregister", self._lib.cuMemHostUnregister(addr))

    def stream_create(self) -> int:
        """*context*: a stream ordered with the legacy default stream."""
        stream = ctypes.c_void_p()
        self._check("cuStreamCreate",
                    self._lib.cuStreamCreate(ctypes.byref(stream), _STREAM_DEFAULT))
        return stream.value or 0

    def stream_synchronize(self, stream: int) -> None:
        self._check("cuStreamSynchronize", self._lib.cuStreamSynchronize(stream))

    def event_create(self) -> int:
        """*context*"""
        event = ctypes.c_void_p()
        self._check("cuEventCreate",
                    self._lib.cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING))
        return event.value or 0

    def event_record(self, event: int, stream: int) -> None:
        self._check("cuEventRecord", self._lib.cuEventRecord(event, stream))

    def event_synchronize(self, event: int) -> None:
        self._check("cuEventSynchronize", self._lib.cuEventSynchronize(event))

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """*context*: queue a host-to-device copy on ``stream``."""
        self._check("cuMemcpyHtoDAsync",
                    self._lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream))

    def copy_to_host(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """*context*: queue a device-to-host copy on ``stream``."""
        self._check("cuMemcpyDtoHAsync",
                    self._lib.cuMemcpyDtoHAsync_v2(dst, src, nbytes, stream))


_driver: LibCuda | None = None
_driver_lock = threading.Lock()


def libcuda() -> LibCuda:
    """The process's :class:`LibCuda`, loaded and initialised once."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = LibCuda()
        return _driver
