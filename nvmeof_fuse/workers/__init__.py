"""FUSE workers (``--workers N``): more processes serving one mount's READs and WRITEs."""
