"""How a controller is presented: permissions and ownership of the namespace files."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MODE = 0o660
DEFAULT_WORKERS = 1
"""FUSE worker processes of a :class:`MountOptions` made without a count (``nvmeof_fuse.mount``
in a user's process); the command line's default is :data:`AUTO_WORKERS`."""
AUTO_WORKERS = "auto"
"""``--workers auto`` (the command line's default): :func:`auto_workers` of the cores the
mount may use (README, FUSE workers)."""
FEW_CORES = 2
"""Usable cores up to which ``auto`` keeps one process: on 2 cores a second one gained
little at 4 KiB and lost in a mixed job (docs/performance-history.md, issue #60)."""
MAX_AUTO_WORKERS = 16
"""The most processes ``auto`` chooses.  Each one leases an I/O queue ID of the target
beside the companion clients' 16, registers 32 bounce buffers of a whole request (32 MiB)
and adds 32 to the mount's FUSE ``max_background``: at 16 the mount holds 512 MiB of
bounce memory and lets the kernel keep 512 requests in flight, more than a job's queue
depth spread over them can fill (below two requests in flight a process serves each on a
task of its own, without the callbacks that batch them).  16 is also the most that
``scripts/gpu-check --scale`` measures.  ``--workers N`` goes past it."""


def usable_cores(affinity: Callable[[int], set[int]] | None = None) -> int:
    """The CPUs this process may run on (its affinity mask, which taskset, numactl,
    systemd's ``CPUAffinity=`` and cgroup cpusets narrow), else all online; at least 1."""
    try:
        cores = len((affinity or os.sched_getaffinity)(0))
    except (AttributeError, OSError):  # (no sched_getaffinity on this platform)
        cores = os.cpu_count() or 1
    return max(1, cores)


def auto_workers(cores: int) -> int:
    """The serving processes ``--workers auto`` chooses on ``cores`` usable cores: one up to
    :data:`FEW_CORES`, where more were not faster; above, half the cores (the other half
    left to the processes that issue the I/O and to the kernel's FUSE and network work on
    their behalf, which share the cores), at most :data:`MAX_AUTO_WORKERS`.  Measured only
    up to 2 cores; above that the rule is the design's, not a measurement's."""
    if cores <= FEW_CORES:
        return 1
    return min(cores // 2, MAX_AUTO_WORKERS)


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
    workers_chosen: str = ""  # how the count was chosen (``auto``: of how many cores), for stats

    @property
    def worker_processes(self) -> int:
        """How many processes serve (pyfuse3 serves one descriptor: one)."""
        return self.workers if self.fuse == "builtin" else 1
