"""The FUSE view of a controller: one file per namespace plus a ``.nvmeof`` info dir."""

from nvmeof_fuse.fs.mount_options import MountOptions

__all__ = ["MountOptions"]
