"""The companion API: move data between a mounted namespace and caller memory, zero-copy.

``nvmeof_fuse.File`` reads and writes a namespace file of any mount of the same
user straight into the caller's memory, and reads a file of an ext4 or xfs
filesystem on such a namespace the same way (:mod:`.fsfile`);
``nvmeof_fuse.empty`` allocates arrays a daemon in another process can map;
``nvmeof_fuse.load_safetensors`` loads a checkpoint from either.  (``nvmeof_fuse.mount``,
which mounts from Python, sits above this layer: :mod:`nvmeof_fuse.inprocess`.)
"""

from .client.file import File, IOFuture
from .client.shm import empty
from .files.fsfile import FilesystemFile
from .files.safetensors_load import load_safetensors
from .protocol import CompanionError

__all__ = ["CompanionError", "File", "FilesystemFile", "IOFuture", "empty", "load_safetensors"]
