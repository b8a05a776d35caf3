"""Which queues hold a command that has waited too long (no I/O: the caller gives the time).

A queue is seen through its oldest command in flight (``oldest_command()``): the same
command at two looks, ``after`` seconds or more apart, is overdue.  Nothing on the command
path records a time for this: the looks are a timer's, a few per ``after``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Watched(Protocol):
    def oldest_command(self) -> object | None: ...


class OverdueWatch:
    """Tells, look by look, whether a queue has had the same oldest command for ``after``
    seconds."""

    def __init__(self, after: float) -> None:
        self.after = after
        self._seen: dict[Watched, tuple[object, float]] = {}  # queue -> (oldest, first seen)

    def overdue(self, queues: Iterable[Watched], now: float) -> bool:
        """Whether one of ``queues`` holds a command first seen ``after`` s or more before
        ``now``; queues not passed are forgotten."""
        seen: dict[Watched, tuple[object, float]] = {}
        late = False
        for queue in queues:
            oldest = queue.oldest_command()
            if oldest is None:
                continue
            before = self._seen.get(queue)
            since = before[1] if before is not None and before[0] is oldest else now
            seen[queue] = (oldest, since)
            late = late or now - since >= self.after
        self._seen = seen
        return late
