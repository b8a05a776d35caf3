"""Multipath: the head every mount runs on (``head.py``), one path (``path.py``), memory
registered on every path (``pathmemory.py``), a path's ANA states (``ana.py``) and the I/O
policies (``iopolicy.py``).  Empty here, so that the CLI reads the policies without trio."""
