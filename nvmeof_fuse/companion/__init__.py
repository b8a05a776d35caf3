"""The companion API: move data between a mounted namespace and caller memory, zero-copy.

``nvmeof_fuse.File`` reads and writes a namespace file of any mount of the same
user straight into the caller's memory, and reads a file of an ext4 or xfs
filesystem on such a namespace the same way (:mod:`.files.fsfile`, whose opener ``File``
asks first: registered here, as the client library never imports what sits above it);
``nvmeof_fuse.empty`` allocates arrays a daemon in another process can map;
``nvmeof_fuse.load_safetensors`` loads a checkpoint from either.  (``nvmeof_fuse.mount``,
which mounts from Python, sits above this layer: :mod:`nvmeof_fuse.inprocess`.)
"""

from .client.file import File, IOFuture, open_others_with
from .client.shm import empty
from .files.fsfile import FilesystemFile, open_file
from .files.safetensors_load import load_safetensors
from .protocol import CompanionError

open_others_with(open_file)  # File(path) of a file on a filesystem on a namespace

__all__ = ["CompanionError", "File", "FilesystemFile", "IOFuture", "empty", "load_safetensors"]
