"""``nvmeof-fuse``: mount an NVMe-oF controller's namespaces as files, discover, list.

Option names follow nvme-cli. The modules, each importing only those listed before it:

- ``mounthelper``: mount(8), fstab and systemd's side (``-o`` keys, NVMe URI sources);
- ``mountall``: mount-all's plan and report (pure);
- ``options``: the options every command shares, their checks, one-line errors;
- ``mount``: ``mount`` and its ``--daemon``;
- ``discover``: ``discover`` and ``list``;
- ``admin``: ``mount-all`` and ``install-helper``;
- ``entry``: the parser of every command and :func:`main`.
"""

from nvmeof_fuse.cli.entry import main

__all__ = ["main"]
