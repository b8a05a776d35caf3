"""The small seam between the companion API and CUDA.

Everything CUDA-specific the companion API needs is a method of
:class:`CudaOps`.  :class:`TorchCuda` implements it with ``ibverbs.cuda``
(dma-buf export, GPUDirect flush, context synchronize) and torch (host <->
device copies); tests substitute a fake with :func:`use`.

Ordering rules for GPUDirect RDMA:

* before the target reads GPU memory (an NVMe Write), the work producing it
  must be finished: :meth:`CudaOps.synchronize`;
* after the target has written GPU memory (an NVMe Read completed), the writes
  must be made visible to CUDA: :meth:`CudaOps.flush_gpudirect_writes`.
"""

from __future__ import annotations

import mmap
import sys
from typing import Any, Protocol

from ..errors import InvalidArgument

PAGE = mmap.PAGESIZE


class CudaOps(Protocol):
    def is_cuda(self, obj: Any) -> bool: ...

    def span(self, tensor: Any) -> tuple[int, int]:
        """``(device address, nbytes)`` of a contiguous tensor."""
        ...

    def export_dmabuf(self, base: int, length: int) -> int:
        """A dma-buf fd for the page-aligned device range ``[base, base + length)``."""
        ...

    def synchronize(self) -> None: ...

    def flush_gpudirect_writes(self) -> None: ...

    def to_device(self, tensor: Any, byte_offset: int, data: memoryview) -> None:
        """Copy host bytes into the tensor's bytes at ``byte_offset``."""
        ...

    def to_host(self, tensor: Any, byte_offset: int, out: memoryview) -> None:
        """Copy ``len(out)`` bytes of the tensor at ``byte_offset`` to host memory."""
        ...


class TorchCuda:
    """:class:`CudaOps` over torch tensors and ``ibverbs.cuda``."""

    def is_cuda(self, obj: Any) -> bool:
        np = sys.modules.get("numpy")
        if np is not None and type(obj) is np.ndarray:  # never: skip probing its attributes
            return False
        return bool(getattr(obj, "is_cuda", False))

    def span(self, tensor: Any) -> tuple[int, int]:
        if not tensor.is_contiguous():
            raise InvalidArgument("CUDA tensor must be contiguous")
        return int(tensor.data_ptr()), int(tensor.numel()) * int(tensor.element_size())

    def export_dmabuf(self, base: int, length: int) -> int:
        from ibverbs import cuda

        return cuda.dmabuf_fd(base, length)

    def synchronize(self) -> None:
        from ibverbs import cuda

        cuda.synchronize()

    def flush_gpudirect_writes(self) -> None:
        from ibverbs import cuda

        cuda.flush_gpudirect_writes()

    def _bytes(self, tensor: Any, byte_offset: int, length: int) -> Any:
        import torch

        flat = tensor.reshape(-1).view(torch.uint8)
        return flat[byte_offset:byte_offset + length]

    def to_device(self, tensor: Any, byte_offset: int, data: memoryview) -> None:
        import torch

        src = torch.frombuffer(data, dtype=torch.uint8)
        self._bytes(tensor, byte_offset, len(data)).copy_(src)
        torch.cuda.current_stream(tensor.device).synchronize()

    def to_host(self, tensor: Any, byte_offset: int, out: memoryview) -> None:
        import torch

        dst = torch.frombuffer(out, dtype=torch.uint8)
        dst.copy_(self._bytes(tensor, byte_offset, len(out)))


def page_span(ptr: int, nbytes: int) -> tuple[int, int, int]:
    """``(base, offset, length)``: the page-aligned range around ``[ptr, ptr + nbytes)``."""
    base = ptr - ptr % PAGE
    offset = ptr - base
    return base, offset, -(-(offset + nbytes) // PAGE) * PAGE


_ops: CudaOps | None = None


def ops() -> CudaOps:
    """The CUDA seam in use (``TorchCuda`` unless a test installed another)."""
    global _ops
    if _ops is None:
        _ops = TorchCuda()
    return _ops


def use(replacement: CudaOps | None) -> None:
    """Install a CUDA seam (tests); ``None`` restores the default."""
    global _ops
    _ops = replacement
