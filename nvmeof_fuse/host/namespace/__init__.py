"""A namespace: its identity, size and the entry to its I/O (``namespace.py``), its one data
path of byte ranges over whole LBAs (``byterange.py``), the LBA range lock writes hold
(``rangelock.py``) and its statistics (``stats.py``)."""

from .namespace import GONE, Namespace

__all__ = ["GONE", "Namespace"]
