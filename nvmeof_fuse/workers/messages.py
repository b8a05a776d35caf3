"""What passes between the main process and its FUSE workers, over the companion socket.

A worker is a companion client of the main process that holds the role of a FUSE worker
(:class:`~nvmeof_fuse.companion.server.roles.Role`, registered by the supervisor): it leases
:data:`WORKER_QUEUES` of the queue IDs the mount keeps for its workers (``lease`` with
``worker: true``), says it serves (``fuse`` of kind ``ready``), forwards what it does not
serve itself (``fuse`` of kind ``meta``, ``read`` or ``write``, I/O in pieces of
:data:`FORWARD_CHUNK`), reports its counts each second (``report`` with ``worker``), and
says it took the sizes of a rescan (``fuse`` of kind ``namespaces``), which the main
process sends it as a ``namespaces`` event (:func:`parse_shapes`).  Both sides import this
module; neither imports the other.
"""

from __future__ import annotations

from nvmeof_fuse.companion.protocol import MAX_NAMED_NAMESPACES

WORKER_QUEUES = 1
"""I/O queues each worker leases (one serves a queue depth of its full size)."""
ROLE_FLAG = "worker"
"""The field of a worker's ``lease`` that claims a worker's queue IDs, and of its ``report``
that carries its counts."""
FORWARD_CHUNK = 32 << 10
"""Bytes per forwarded READ or WRITE piece (the main process's socket carries messages of
up to 64 KiB)."""
MAX_FOLLOWED_NAMESPACES = MAX_NAMED_NAMESPACES
"""Namespaces whose sizes a worker's lease and a rescan send the workers in one message;
past them the workers are sent none, so they forward all I/O."""


def worker_queues(workers: int) -> int:
    """Queue IDs a mount with ``workers`` workers reserves for them (the main has its own)."""
    return max(0, workers - 1) * WORKER_QUEUES


def parse_shapes(value: object) -> dict[int, tuple[int, ...]] | None:
    """``{nsid: (lba_size, nlb, generation)}`` out of a ``namespaces`` event's list of
    ``[nsid, lba_size, nlb, generation]`` (:meth:`CompanionServer.namespace_shapes`; from a
    main process of another version, without the generation: ``(lba_size, nlb)``); None
    when it is not one."""
    if not isinstance(value, list):
        return None
    shapes = {}
    for item in value:
        if (not isinstance(item, list) or len(item) not in (3, 4)
                or not all(type(v) is int and v >= 0 for v in item) or not item[1]):
            return None
        shapes[item[0]] = tuple(item[1:])
    return shapes
