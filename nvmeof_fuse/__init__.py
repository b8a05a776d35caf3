"""nvmeof_fuse: a userspace NVMe over Fabrics initiator on trio, with a FUSE view of namespaces.

The companion API is importable from here: :func:`mount` (see :mod:`nvmeof_fuse.inprocess`),
:class:`File`, :func:`empty` and
:func:`load_safetensors` (see :mod:`nvmeof_fuse.companion`).
"""

from typing import Any

__version__ = "0.1.0"

_COMPANION = ("CompanionError", "File", "FilesystemFile", "IOFuture", "empty",
              "load_safetensors")
_INPROCESS = ("Mount", "Registration", "mount")


def __getattr__(name: str) -> Any:  # imported on first use: the CLI need not load it
    if name in _COMPANION:
        from . import companion

        return getattr(companion, name)
    if name in _INPROCESS:
        from . import inprocess

        return getattr(inprocess, name)
    raise AttributeError(f"module 'nvmeof_fuse' has no attribute {name!r}")
