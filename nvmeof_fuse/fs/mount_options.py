"""How a controller is presented: permissions and ownership of the namespace files."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODE = 0o660
DEFAULT_WORKERS = 1
"""FUSE worker processes of a mount unless told (``--workers``): see README, Mounting."""
FUSE_SERVERS = ("builtin", "pyfuse3")
"""What can serve the FUSE requests: our own session on /dev/fuse (the default), or pyfuse3
(an optional extra)."""


@dataclass(frozen=True)
class MountOptions:
    """Mount settings; ``uid``/``gid`` default to the mounting user, ``mode`` to 0660."""

    read_only: bool = False
    allow_other: bool = False
    uid: int | None = None
    gid: int | None = None
    mode: int = DEFAULT_MODE
    debug: bool = False  # also pass libfuse's ``debug`` (a trace of every request on stderr)
    nsid: int | None = None  # show only this namespace (a URI's ``/NSID``); None: all
    source: str | None = None  # what /proc/self/mountinfo shows as the source (fsname)
    fuse: str = "builtin"  # the FUSE server, one of FUSE_SERVERS
    paths: tuple[str, ...] = ()  # further paths to the subsystem (URIs): --path, -o path=
    iopolicy: str = "queue-depth"  # how commands spread over the paths (host.iopolicy)
    workers: int = DEFAULT_WORKERS  # processes serving READ/WRITE, the main one among them

    @property
    def worker_processes(self) -> int:
        """How many processes serve (pyfuse3 serves one descriptor: one)."""
        return self.workers if self.fuse == "builtin" else 1
