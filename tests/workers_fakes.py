"""The FUSE workers' side of a companion server the tests serve: the role the daemon
registers, and a worker process's side on the server's socket."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from nvmeof_fuse.companion.server.roles import Role
from nvmeof_fuse.workers.supervisor import FuseWorkers
from nvmeof_fuse.workers.worker import _Worker


def workers_role(count: int = 2, **requests: Any) -> Role:
    """The FUSE workers' role of a mount of ``count`` processes, as the daemon registers it
    (with ``requests`` in place of the supervisor's handlers, where given)."""
    role = FuseWorkers(count).role
    return dataclasses.replace(role, requests=requests) if requests else role


def worker_of(server: Any) -> _Worker:
    """A FUSE worker's side (its channel, not yet leased) on ``server``'s socket, as index 1."""
    return _Worker(argparse.Namespace(socket="@" + server.info()["socket"][1:], timeout=10.0,
                                      index=1, fd=-1, read_only=False, debug=False))
