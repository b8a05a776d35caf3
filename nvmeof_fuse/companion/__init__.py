"""The companion API: register caller memory with a mounted controller, zero-copy.

``nvmeof_fuse.mount`` mounts from Python; ``nvmeof_fuse.File`` reads and writes a
namespace file of any mount of the same user straight into registered memory;
``nvmeof_fuse.empty`` allocates arrays a daemon in another process can map.
"""

from .client import File, IOFuture
from .inprocess import Mount, Registration, mount
from .protocol import CompanionError
from .shm import empty

__all__ = ["CompanionError", "File", "IOFuture", "Mount", "Registration", "empty", "mount"]
