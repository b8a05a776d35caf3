"""Roles: the kinds of session the mount's own processes hold, registered at construction.

The companion server serves companion clients, users' processes.  A mount may also run
processes of its own that talk to the daemon over the same socket; the daemon registers
each kind as a :class:`Role` when it builds the server (:mod:`nvmeof_fuse.workers` registers
the FUSE workers').  A session takes its role by leasing from the queue IDs kept for it;
from then on the server counts it apart from companion clients, keeps what it reports of
itself, and routes it the requests that only its role may send, to the role's handlers.
So the server knows of no kind of process in particular: a role is data and handlers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol import MAX_NAMED_NAMESPACES


class Sender(Protocol):
    """What a role's handler learns of the session that sent the request."""

    pid: int | None
    """The sender's process (SO_PEERCRED)."""


Handler = Callable[[Sender, dict[str, Any], bytes], Awaitable[dict[str, Any]]]
"""``handler(session, header, payload)``: the reply's fields (bytes back under ``_payload``)."""


@dataclass(frozen=True, eq=False)
class Role:
    """A kind of session one of the mount's own processes holds (see the module)."""

    name: str
    """What one such process is called in messages (``"FUSE worker"``)."""
    flag: str
    """The request field that claims the role: a ``lease`` with ``FLAG: true`` leases from
    its queue IDs (on any transport: its processes move data through memory of their own),
    and a ``report`` carries a session's own figures under ``FLAG``."""
    counter: str
    """The stats counter of its sessions connected now (``COUNTER``) and ever
    (``COUNTER_total``)."""
    queues: int = 0
    """Leasable queue IDs kept for it (the last ones); with none, nobody holds the role."""
    requests: Mapping[str, Handler] = field(default_factory=dict)
    """Requests only its sessions may send, by op, and the handler that answers each."""
    max_named: int = MAX_NAMED_NAMESPACES
    """A lease that asks for all namespaces names them while there are at most this many,
    else none (a client's names them while they fit a reply)."""
