"""How long a FUSE server that just went idle polls for the next request before it sleeps.

A client that keeps one request in flight (QD1) sends the next one a short, steady time
after our reply, and nothing of ours runs meanwhile.  Sleeping in between costs a wake-up
per request, which on a host that halts idle CPUs (a VM's vCPUs above all) costs more than
the request itself.  So, as NAPI busy polling and the kernel's hybrid polling do, the server
polls for about twice the gap it saw the last times a poll caught a request, never past
``POLL_MAX``.  Only gaps seen while polling count (one measured across a sleep holds the
wake-up too).  A poll that runs out is followed by 1, 2, 4 ... 64 idle moments that sleep
at once, then by a probe with a longer budget: a client that thinks, or a host where
everything is slower, costs a probe now and then, and an idle mount nothing at all.  Polls
begin only once ``MIN_ALONE`` idle moments in a row each followed a single request: while
the server answers several requests between idle moments it is busy anyway, and where the
CPUs are the limit a poll would take the CPU the client needs to send more.  Plain
arithmetic on what the caller saw.
"""

from __future__ import annotations

POLL_MAX = 0.0001
"""Seconds a poll lasts at most: past about this, a sleep and a wake-up cost little beside
the gap itself."""
GAP_WEIGHT = 0.125  # of the newest gap in the moving average
MAX_SKIP = 64  # idle moments slept through after a run of polls that found nothing
MIN_ALONE = 8  # idle moments in a row after a single request each, before polls begin


class IdlePoll:
    """The gaps that polls caught, and the poll they allow next."""

    def __init__(self, poll_max: float = POLL_MAX) -> None:
        self.poll_max = poll_max
        self.gap = poll_max / 2  # moving average of the gaps polls caught
        self.skip = 0  # idle moments left to sleep through without polling
        self.alone = 0  # idle moments in a row that came after a single request each
        self._backoff = 1

    def budget(self, served: int) -> float:
        """Seconds to poll at this idle moment, after ``served`` requests since the last one,
        before sleeping (0: sleep at once)."""
        self.alone = self.alone + 1 if served == 1 else 0
        if self.alone < MIN_ALONE:
            return 0.0
        if self.skip:
            self.skip -= 1
            return 0.0
        return min(2 * self.gap, self.poll_max)

    def caught(self, gap: float) -> None:
        """A poll caught a request ``gap`` seconds after it began."""
        self.gap += (gap - self.gap) * GAP_WEIGHT
        self._backoff = 1

    def missed(self) -> None:
        """A poll ran out: sleep through the next idle moments, probe longer after them."""
        self.skip = self._backoff
        self._backoff = min(2 * self._backoff, MAX_SKIP)
        self.gap = min(2 * self.gap, self.poll_max / 2)
