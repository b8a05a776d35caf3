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

from ...errors import InvalidArgument
from ...nvme.ana import AnaState

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
        self._turn = -1

    def choose(self, paths: Sequence[P], state: Callable[[P], AnaState | None],
               depth: Callable[[P], int]) -> P | None:
        """The path for the next command, or None if none is usable.

        ``state(path)`` is the path's usable ANA state (None: not usable now);
        ``depth(path)`` its commands outstanding.
        """
        optimized, fallback = [], []
        for path in paths:
            s = state(path)
            if s is AnaState.OPTIMIZED:
                optimized.append(path)
            elif s is not None:
                fallback.append(path)
        return self.pick(optimized, fallback, depth)

    def pick(self, optimized: Sequence[P], fallback: Sequence[P],
             depth: Callable[[P], int]) -> P | None:
        """:meth:`choose` where the usable paths are known: the optimized ones (in path
        order), else the non-optimized ones."""
        group = optimized or fallback
        n = len(group)
        if n <= 1:
            choice = group[0] if n else None
        elif self.policy == FAILOVER:
            choice = self.last if self.last in group else group[0]
        elif self.policy == ROUND_ROBIN:
            self._turn = (self._turn + 1) % n
            choice = group[self._turn]
        else:  # queue-depth: the fewest outstanding, equals in turn after the last
            start = (self._turn + 1) % n
            best = start
            fewest = depth(group[start])
            for step in range(1, n):
                i = (start + step) % n
                d = depth(group[i])
                if d < fewest:
                    best, fewest = i, d
            self._turn = best
            choice = group[best]
        if choice is not None:
            self.last = choice
        return choice

    def forget(self, path: P) -> None:
        """``path`` is gone (removed, or failed): do not keep to it."""
        if self.last is path:
            self.last = None
