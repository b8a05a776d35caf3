"""Leases on a multipath mount's paths: when a client's queues must move to another path.

Each client's queues are on one path's controller (``session.lessor``).  When that one
stops being live, the client is told at once (``revoked``): it asks again and gets a live
path, its own again when it is back first.  A client that said where its memory is (or
named a path: ``session.lease_wish``) is told as well when a path nearer it (or the one it
named) is back, so that its next lease goes there (issue #59): a GPU's reads come back to
the NIC beside it after a failover.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)


async def revoke_leases_of_moved_paths(head: Any, sessions: Iterable[Any]) -> None:
    """Tell each client whose path was lost, or whose nearer path is back, after each
    change of the paths (until cancelled)."""
    while True:
        await head.wait_changed()
        for session in list(sessions):
            lessor = session.lessor
            if not session.qids or session.notify is None or lessor is None:
                continue
            if not lessor.live:
                state = lessor.state
            else:
                back = head.nearer_path(lessor, session.lease_wish.get("near"),
                                        session.lease_wish.get("path"))
                if back is None:
                    continue
                state = f"{back.name} is back, nearer"
                log.info("companion: %s moves to %s", session.peer, back.name)
            session.lessor = None  # told once; the next lease names the path
            await session.notify({"event": "revoked", "state": state})
