"""nvmeof_fuse: a userspace NVMe over Fabrics initiator on trio, with a FUSE view of namespaces."""

__version__ = "0.1.0"
