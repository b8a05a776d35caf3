"""The companion API: move data between a mounted namespace and caller memory, zero-copy.

``nvmeof_fuse.File`` reads and writes a namespace file of any mount of the same
user straight into the caller's memory; ``nvmeof_fuse.empty`` allocates arrays a
daemon in another process can map.  (``nvmeof_fuse.mount``, which mounts from
Python, sits above this layer: :mod:`nvmeof_fuse.inprocess`.)
"""

from .client import File, IOFuture
from .protocol import CompanionError
from .shm import empty

__all__ = ["CompanionError", "File", "IOFuture", "empty"]
