"""``nvmeof_fuse.load_safetensors``: a safetensors checkpoint read straight into arrays or tensors.

    tensors = nvmeof_fuse.load_safetensors("/mnt/ckpt/model.safetensors")          # numpy
    tensors = nvmeof_fuse.load_safetensors(path, device="cuda:0")                 # torch

The header is read and checked (:mod:`.safetensors_header`); then every
tensor gets storage of its own and all are read in one batch by :class:`~nvmeof_fuse.File`:
a namespace file of a mount, or a file of a filesystem on one (:mod:`.fsfile`).  torch is
imported only when ``device`` asks for it.
"""

from __future__ import annotations

import errno
from typing import Any

from ...errors import InvalidArgument
from ..client.file import File
from ..protocol import CompanionError
from . import safetensors_header as sth


def load_safetensors(path: str, device: Any = None, **options: Any) -> dict[str, Any]:
    """The tensors of the safetensors file at ``path`` by name: numpy arrays when ``device``
    is None or ``"numpy"``, else torch tensors on ``device`` (``"cpu"``, ``"cuda"``,
    ``"cuda:1"``, a ``torch.device``).  ``options`` go to :class:`~nvmeof_fuse.File`."""
    make = _numpy_maker() if device is None or device == "numpy" else _torch_maker(device)
    with File(path, **options) as f:
        tensors = _header(path, f)
        out = {t.name: make(t) for t in tensors}
        requests = [(out[t.name], t.nbytes, t.start) for t in tensors if t.nbytes]
        if requests:
            got = f.read_batch(requests)
            for (_, nbytes, start), n in zip(requests, got, strict=True):
                if n != nbytes:
                    raise CompanionError(f"{path}: read {n} of {nbytes} bytes at {start} "
                                         "(the file shrank?)", errno.EIO)
    return {t.name: out[t.name] for t in sorted(tensors, key=lambda t: t.name)}


def _header(path: str, f: Any) -> list[sth.Tensor]:
    """The file's tensors, its header read by ``f`` (as the tensors are) and checked."""
    size = f.nbytes
    try:
        prefix = bytearray(sth.PREFIX)
        length = sth.header_length(bytes(prefix[:f.read(prefix, sth.PREFIX, 0)]), size)
        header = bytearray(max(length, 1))
        got = f.read(header, length, sth.PREFIX) if length else 0
        if got != length:
            raise sth.HeaderError(f"header of {length} bytes is cut short at {got}")
        return sth.parse_header(bytes(header[:length]), size)[0]
    except sth.HeaderError as exc:
        raise InvalidArgument(f"{path}: {exc}") from None


def _numpy_maker() -> Any:
    import numpy as np

    def make(t: sth.Tensor) -> Any:
        dtype = sth.NUMPY.get(t.dtype)
        if dtype is None:
            raise InvalidArgument(f"tensor {t.name!r}: dtype {t.dtype} has no numpy type "
                                  "(load it with a torch device, e.g. device='cpu')")
        return np.empty(t.shape, dtype=dtype)

    return make


def _torch_maker(device: Any) -> Any:
    try:
        import torch
    except ImportError:
        raise InvalidArgument(f"device={device!r} needs torch, which is not installed "
                              "(device=None gives numpy arrays)") from None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgument(f"device {device!r}: {exc}") from None

    def make(t: sth.Tensor) -> Any:
        dtype = getattr(torch, sth.TORCH[t.dtype], None)
        if dtype is None:
            raise InvalidArgument(f"tensor {t.name!r}: dtype {t.dtype} is not in this torch")
        return torch.empty(t.shape, dtype=dtype, device=target)

    return make
