"""What a namespace needs from whatever runs its commands: the :class:`CommandIssuer`.

A :class:`~nvmeof_fuse.host.namespace.namespace.Namespace` builds its NVM commands itself; a
:class:`~nvmeof_fuse.host.controller.Controller` runs them on its I/O queues, and a
multipath head could run them on one of its paths.  The namespace depends on this
protocol only, so that neither module imports the other's owner back.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from ..nvme import Completion
from ..transport.base import Finished, Queue
from .memory import BouncePool, DataRef


class CommandIssuer(Protocol):
    """Runs a namespace's commands, and lends it the memory they move data through."""

    max_transfer: int
    """Most bytes one command moves (MDTS, capped by the bounce buffers' size)."""
    bounce: BouncePool | None
    """Registered bounce buffers of ``max_transfer`` bytes (None before the I/O queues)."""

    @property
    def live(self) -> bool:
        """Whether commands run now (else :meth:`wait_live` waits, or says why not)."""
        ...

    async def wait_live(self) -> None:
        """Wait until commands run; raise the error that ends the wait for good."""
        ...

    async def io_command(self, sqe: bytearray, data: DataRef | None = None, *,
                         to_controller: bool = False) -> Completion:
        """Run an NVM command, retried as the kernel would; it returns or raises only once
        the target can no longer move ``data``.  A failure status raises."""
        ...

    def start_io(self, sqe: bytearray, data: DataRef | None,
                 done: Callable[[Finished], None], *, to_controller: bool = False
                 ) -> Queue | None:
        """Send an NVM command with no task waiting, if a queue takes it now; ``done`` is
        told its end.  The queue it went on, or None with nothing sent."""
        ...

    def io_failed(self, queue: Queue, exc: BaseException) -> None:
        """A command :meth:`start_io` sent on ``queue`` failed with ``exc``."""
        ...

    def scratch(self, length: int) -> AbstractAsyncContextManager[DataRef]:
        """A zeroed registered buffer of ``length`` bytes (small command payloads)."""
        ...
