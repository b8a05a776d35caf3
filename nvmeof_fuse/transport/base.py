"""What the host core needs from a transport (like the kernel's ``nvme_ctrl_ops``).

A transport connects queues and registers memory; the host core builds
commands with :mod:`nvmeof_fuse.nvme` and runs them through
:meth:`Queue.execute`, which stamps the command ID and the data pointer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from ..nvme import Completion
from .region import DataRef, Registration


@dataclass(frozen=True)
class LocalDevice:
    """The local device a transport's queues go through, as sysfs names it: its class
    (``infiniband`` for an RDMA device, ``net`` for a netdev) and its name (``mlx5_3``)."""

    sysfs_class: str
    name: str

    def __str__(self) -> str:
        return self.name


class Queue(Protocol):
    """One connected submission/completion queue pair."""

    qid: int
    size: int
    """Entries in the queue; at most ``size - 1`` commands are outstanding."""
    available: int
    """Free command slots right now."""
    connect_cattr: int
    """CATTR of this queue's Fabrics Connect (bit 2 asks to disable SQ flow control)."""

    async def execute(self, sqe: bytearray, data: DataRef | None = None, *,
                      to_controller: bool = False, timeout: float) -> Completion:
        """Send ``sqe`` (with ``data`` read or written) and return its completion.

        Cancellation waits for the command to finish (bounded by ``timeout``),
        since the target may still be moving data into ``data``.
        """
        ...

    def start(self, sqe: bytearray, data: DataRef | None, done: Callable[[Finished], None], *,
              to_controller: bool = False, timeout: float) -> bool:
        """Send ``sqe`` and return at once, if this queue takes it now; ``done`` is called
        once it finished, by the trio thread (never before this returns), and must not
        raise.  False: nothing was sent (no free slot, or the queue failed)."""
        ...

    def cut_timeouts(self, deadline: float) -> None:
        """The commands in flight time out by ``deadline`` (trio time) at the latest, as
        if their timeouts had been shorter (the mount stops)."""
        ...

    def close(self) -> None: ...


class Finished(Protocol):
    """A command :meth:`Queue.start` sent, as its callback is told of its end."""

    completion: Completion | None
    error: Exception | None
    """Set instead of ``completion`` when the command failed (TransportError) or timed
    out (CommandTimeout): the target may still move its data."""


class Transport(Protocol):
    """Connects a controller's queues; owns the fabric resources they share.

    Its factory takes ``host_iface``: the local device the queues must use (an RDMA device
    the transport refuses to be bound elsewhere, a netdev its sockets are bound to), and
    its ``local_device`` (:class:`LocalDevice`) names the device its last queue went
    through (None before one connected, or where it cannot be told).

    Optional, where a transport has it: ``probe_after`` (seconds), after which a command
    still waiting has the controller send a Keep Alive at once, for a transport whose lost
    peer shows only when a SEND fails (RDMA); its queues then offer ``oldest_command()``
    (:mod:`.overdue`).  And ``take_over(queue, timeout)``, which hands a
    connected queue to callers' threads to drive themselves (polled; None if it cannot).
    """

    name: str

    needs_keyed_sgls: bool
    """Whether the controller must support keyed SGL data blocks (NVMe/RDMA does)."""

    places_in_other_processes: bool
    counts_read_data: bool
    """Whether a read's success means all its data arrived (NVMe/TCP counts each read's
    C2HData bytes; a target's RDMA writes cannot be counted, so a read's bounce buffer is
    cleared before it goes out: no reply carries another request's bytes)."""
    """Whether a process other than the mount's can connect queues of the controller and
    have data placed in its own memory (companion clients' leased queues)."""

    address: str
    """Where the controller is, for messages: ``rdma 10.0.0.1:4420``."""

    local_device: LocalDevice | None

    async def connect_queue(self, nursery: trio.Nursery, qid: int, size: int,
                            in_capsule_bytes: int = 0, cntlid: int = 0) -> Queue:
        """Connect queue ``qid`` at the transport level; its tasks run in ``nursery``.

        Writes of up to ``in_capsule_bytes`` may travel inside the command capsule.
        """
        ...

    async def drop_queues(self) -> None:
        """Tear down every queue (waiting commands fail); registered memory stays valid."""
        ...

    def register(self, addr: int, length: int, owner: object) -> Registration: ...

    def close(self) -> None: ...
