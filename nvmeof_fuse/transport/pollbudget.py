"""How long a caller polls for its command before it sleeps: hybrid polling's arithmetic.

As blk-mq's hybrid polling keeps its completion-time statistics per transfer-size bucket,
a queue keeps a moving average of its commands' latency per size class (powers of two):
a 1 MiB read that took 300 ms behind fifteen others says nothing of how soon a 4 KiB read
will be answered.  A caller polls for about twice its class's latency when that is under
``poll_max``, and sleeps at once otherwise.  A latency measured across a sleep holds the
wake-up too, so a class whose average passed ``poll_max`` might never come back below it:
every ``PROBE_EVERY``-th command of such a class is polled anyway (for ``poll_max``), and
one caught that way restarts its class's average from what it saw.  Plain arithmetic; the
caller brings the clock.
"""

from __future__ import annotations

WEIGHT = 0.125  # of the newest sample in a class's moving average
PROBE_EVERY = 64  # commands of a class too slow to poll for, per probe


class PollBudget:
    """Recent latency per size class of one queue, and the poll it allows next."""

    def __init__(self, poll_max: float) -> None:
        self.poll_max = poll_max
        self._latency: dict[int, float] = {}  # size class -> moving average, seconds
        self._until_probe: dict[int, int] = {}

    @staticmethod
    def size_class(nbytes: int) -> int:
        """4 KiB and 8 KiB commands are classes apart, 4 KiB and 4.5 KiB are not."""
        return (nbytes - 1).bit_length() if nbytes > 0 else 0

    def latency(self, nbytes: int) -> float:
        """The moving average of ``nbytes``' class (``poll_max / 2`` before any sample)."""
        return self._latency.get(self.size_class(nbytes), self.poll_max / 2)

    def budget(self, nbytes: int) -> float:
        """Seconds to poll for a command moving ``nbytes`` before sleeping (0: sleep now)."""
        cls = self.size_class(nbytes)
        latency = self._latency.get(cls, self.poll_max / 2)
        if latency < self.poll_max:
            return 2 * latency
        left = self._until_probe.get(cls, PROBE_EVERY) - 1
        self._until_probe[cls] = left or PROBE_EVERY
        return 0.0 if left else self.poll_max

    def record(self, nbytes: int, seconds: float, *, polled: bool) -> None:
        """A command moving ``nbytes`` was answered ``seconds`` after it went out;
        ``polled``: found while polling for it, not after a sleep."""
        cls = self.size_class(nbytes)
        latency = self._latency.get(cls, self.poll_max / 2)
        if polled and latency >= self.poll_max:  # a probe caught it: start again from here
            self._latency[cls] = seconds
        else:
            self._latency[cls] = latency + (seconds - latency) * WEIGHT
