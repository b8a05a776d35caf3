"""Which path a command takes: the kernel's multipath I/O policies, sans I/O.

A path is usable for a namespace when its controller is live and the namespace
is optimized or non-optimized there.  Optimized paths come first; non-optimized
ones serve only when no optimized path is usable (``__nvme_find_path``).

- ``failover``: one active path, kept while it stays optimized (the kernel's
  ``numa`` policy on one node).
- ``round-robin``: the next usable path after the last one (``nvme_round_robin_path``).
- ``queue-depth`` (the default): the usable path with the fewest commands
  outstanding (``nvme_queue_depth_path``); equals are taken in turn, so that
  a light load spreads too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from ..errors import InvalidArgument
from ..nvme.ana import AnaState

FAILOVER = "failover"
ROUND_ROBIN = "round-robin"
QUEUE_DEPTH = "queue-depth"
POLICIES = (FAILOVER, ROUND_ROBIN, QUEUE_DEPTH)
DEFAULT_POLICY = QUEUE_DEPTH

P = TypeVar("P")


def check_policy(name: str) -> str:
    """``name`` if it is an I/O policy, else InvalidArgument naming the choices."""
    if name not in POLICIES:
        raise InvalidArgument(f"unknown iopolicy {name!r}: choose one of {', '.join(POLICIES)}")
    return name


class PathSelector(Generic[P]):
    """Chooses among paths by ``policy``; remembers the last choice (failover keeps to it,
    round-robin and queue-depth go on after it)."""

    def __init__(self, policy: str = DEFAULT_POLICY) -> None:
        self.policy = check_policy(policy)
        self.last: P | None = None

    def choose(self, paths: Sequence[P], state: Callable[[P], AnaState | None],
               depth: Callable[[P], int]) -> P | None:
        """The path for the next command, or None if none is usable.

        ``state(path)`` is the path's usable ANA state (None: not usable now);
        ``depth(path)`` its commands outstanding.
        """
        last = self.last
        if self.policy == FAILOVER and last is not None and last in paths:
            if state(last) is AnaState.OPTIMIZED:
                return last
        start = paths.index(last) + 1 if last is not None and last in paths else 0
        n = len(paths)
        best: P | None = None
        best_key: tuple[int, int] | None = None
        for i in range(n):
            path = paths[(start + i) % n] if self.policy != FAILOVER else paths[i]
            s = state(path)
            if s is None:
                continue
            rank = 0 if s is AnaState.OPTIMIZED else 1
            if self.policy == QUEUE_DEPTH:
                key = (rank, depth(path))
            else:
                key = (rank, 0)
            if best_key is None or key < best_key:
                best, best_key = path, key
                if self.policy != QUEUE_DEPTH and rank == 0:
                    break
        if (self.policy == FAILOVER and best is not None and best_key is not None
                and best_key[0] == 1 and last is not None and last in paths
                and state(last) is AnaState.NON_OPTIMIZED):
            best = last  # no optimized path: stay on the non-optimized one in use
        if best is not None:
            self.last = best
        return best

    def forget(self, path: P) -> None:
        """``path`` is gone (removed, or failed): do not keep to it."""
        if self.last is path:
            self.last = None
