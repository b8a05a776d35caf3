"""The client side of write delegations: each write of a client on its own queues holds the
daemon's range lock, or writes under its delegation of the namespace (the daemon's side, and
why: :mod:`~nvmeof_fuse.companion.server.delegations`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ...errors import NVMeoFError

log = logging.getLogger(__name__)

REDELEGATE_AFTER = 1.0
"""Seconds after a recall before this client asks for a namespace's delegation again (a
namespace that FUSE or another client uses now and then is not bounced back and forth)."""
REDELEGATE_MAX = 16.0
"""Seconds between asks at most while the daemon keeps refusing or recalling (the namespace
is in use): each ask waits for this client's range-locked writes of it to finish first."""
DELEGATION_TERM = 10.0
"""Seconds a delegation is written under after the daemon last confirmed it (its grant, or
a ``report`` reply, each second): shorter than the grace the daemon gives a recalled
holder beyond its write bound (``server.LOCK_GRACE``), so a recall that never arrived
cannot leave writes going on after the daemon took the namespace back."""


class Delegated:
    """A namespace the daemon delegated to us (:mod:`~nvmeof_fuse.companion.server.delegations`)."""

    __slots__ = ("token", "hold_s", "inflight", "recalled", "returned", "since",
                 "valid_until")

    def __init__(self, token: int, hold_s: int, asked_at: float, recalled: bool = False
                 ) -> None:
        self.token = token
        self.hold_s = hold_s  # what our writes under it may take (the daemon's bound)
        self.inflight = 0  # writes under it not done yet
        self.recalled = recalled  # no new writes under it: hand it back once idle
        self.returned = False
        self.since = time.monotonic()  # known to the daemon's replies from here on
        self.valid_until = asked_at + DELEGATION_TERM  # no new writes under it after this

    def usable(self, hold_s: int) -> bool:
        return (not self.recalled and hold_s <= self.hold_s
                and time.monotonic() < self.valid_until)

    def confirmed(self, hold_s: int, asked_at: float) -> None:
        """The daemon confirmed it, bounding our writes by ``hold_s``, to an ask sent at
        ``asked_at``."""
        self.hold_s = max(self.hold_s, hold_s)
        self.valid_until = max(self.valid_until, asked_at + DELEGATION_TERM)


class LockedWrites:
    """A client's writes, each under the daemon's range lock or a delegation (loop-owned).

    ``ask(op, timeout, **fields)``: a request to the daemon, its reply; ``moved()``: the
    client's byte counts, which an ``unlock`` reports.  ``nursery`` is set while the
    client's loop runs (hand-backs run there).
    """

    def __init__(self, ask: Callable[..., Awaitable[dict]], moved: Callable[[], dict[str, int]],
                 timeout: float) -> None:
        self._ask = ask
        self._moved = moved
        self._timeout = timeout
        self.nursery: trio.Nursery | None = None
        self.delegated: dict[int, Delegated] = {}  # nsid -> its delegation
        self._delegate_after: dict[int, float] = {}  # nsid -> no asking before (monotonic)
        self._delegate_delay: dict[int, float] = {}  # nsid -> next wait after a refusal
        self._asking: dict[int, trio.Event] = {}  # nsid -> set once its delegation ask ends
        self._range_locked: dict[int, int] = {}  # nsid -> our range-locked writes in flight
        self._drained: dict[int, trio.Event] = {}  # nsid -> set when those reach none

    async def write(self, nsid: int, file_offset: int, size: int,
                    move: Callable[[], Awaitable[None]]) -> None:
        """Run ``move()``, the write of ``size`` bytes at ``file_offset`` of ``n<nsid>``,
        under the daemon's write lock or its delegation of the namespace."""
        budget = self._timeout + size / 5e6
        hold_s = math.ceil(budget)
        while True:
            held = self.delegated.get(nsid)
            if held is not None and held.usable(hold_s):
                break  # the common case once delegated: no round trip to the daemon
            asking = self._asking.get(nsid)
            if asking is not None:  # another write asks for the delegation: wait for it
                await asking.wait()
                continue
            # Ours but its term or its bound runs short: the daemon confirms it.  (Recalled
            # and not handed back yet: range locks, which wait for the hand-back.)
            ours = held is not None and not held.recalled
            asked_at = time.monotonic()
            if ours or ((held is None or held.returned) and self._may_delegate(nsid)):
                reply = await self._ask_delegation(nsid, file_offset, size, hold_s, budget)
            else:
                reply = await self._ask("lock", budget, nsid=nsid, offset=file_offset,
                                        length=size, hold_s=hold_s)
            if not reply.get("delegated"):
                await self._write_range_locked(nsid, move, reply["token"])
                return
            held = self.delegated.get(nsid)
            if held is None or held.token != reply["token"]:  # a new delegation
                held = self.delegated[nsid] = Delegated(reply["token"], hold_s, asked_at)
                break
            if not held.returned:  # ours still (maybe recalled: this write ends first)
                held.confirmed(hold_s, asked_at)
                break
        held.inflight += 1
        try:
            await move()
        finally:
            held.inflight -= 1
            if held.recalled and not held.inflight:
                self._hand_back(nsid, held)

    async def _ask_delegation(self, nsid: int, file_offset: int, size: int, hold_s: int,
                              budget: float) -> dict:
        """Ask for ``n<nsid>``'s delegation (or else a range lock of this write), one write
        at a time; the others wait for the answer.  The daemon delegates only a namespace
        of which nobody holds a range, so our own range-locked writes drain first."""
        asking = self._asking[nsid] = trio.Event()
        try:
            with trio.move_on_after(budget):  # (each is bounded; if not, the daemon refuses)
                while self._range_locked.get(nsid):
                    await self._drained.setdefault(nsid, trio.Event()).wait()
            reply = await self._ask("lock", budget, nsid=nsid, offset=file_offset,
                                    length=size, hold_s=hold_s, delegate=True)
        finally:
            del self._asking[nsid]
            asking.set()
        if not reply.get("delegated"):  # used by others
            self._back_off(nsid)
        return reply

    def _back_off(self, nsid: int, reset: bool = False) -> None:
        """Ask for ``n<nsid>``'s delegation again later, less often each time (``reset``:
        a delegation that was held long)."""
        delay = REDELEGATE_AFTER if reset else self._delegate_delay.get(nsid, REDELEGATE_AFTER)
        self._delegate_after[nsid] = time.monotonic() + delay
        self._delegate_delay[nsid] = min(2 * delay, REDELEGATE_MAX)

    async def _write_range_locked(self, nsid: int, move: Callable[[], Awaitable[None]],
                                  token: int) -> None:
        self._range_locked[nsid] = self._range_locked.get(nsid, 0) + 1
        try:
            await move()
        finally:
            try:
                with trio.CancelScope(shield=True):
                    await self._ask("unlock", self._timeout, token=token, nsid=nsid,
                                    moved=self._moved())
            finally:
                self._range_locked[nsid] -= 1
                if not self._range_locked[nsid] and nsid in self._drained:
                    self._drained.pop(nsid).set()

    def _may_delegate(self, nsid: int) -> bool:
        return time.monotonic() >= self._delegate_after.get(nsid, 0.0)

    def recalled(self, nsid: Any, token: Any) -> None:
        """The daemon wants ``n<nsid>`` back: no new writes under it; hand it back once the
        writes under it are done."""
        if not isinstance(nsid, int) or not isinstance(token, int):
            return
        held = self.delegated.get(nsid)
        if held is not None and held.token == token and held.recalled:
            return  # heard already (a report's reply, then the recall itself)
        self._back_off(nsid, reset=held is not None and held.token == token
                       and time.monotonic() - held.since >= REDELEGATE_MAX)
        if held is None or held.token != token:  # granted, the reply still on its way
            held = self.delegated[nsid] = Delegated(token, 0, time.monotonic(),
                                                      recalled=True)
            if self.nursery is not None:  # its writer hands it back, or this does
                self.nursery.start_soon(self._hand_back_unclaimed, nsid, held)
            return
        held.recalled = True
        if not held.inflight:
            self._hand_back(nsid, held)

    def _hand_back(self, nsid: int, held: Delegated) -> None:
        if held.returned or self.nursery is None:
            return  # (with no loop left, the daemon takes it back as the client goes)
        held.returned = True
        self.nursery.start_soon(self._give_back, nsid, held.token)

    async def _hand_back_unclaimed(self, nsid: int, held: Delegated) -> None:
        """Hand back a recalled delegation whose grant no write took up (its lock request
        had timed out here): the daemon need not wait for its bound."""
        await trio.sleep(REDELEGATE_AFTER)
        if not held.inflight:
            self._hand_back(nsid, held)

    async def _give_back(self, nsid: int, token: int) -> None:
        try:
            await self._ask("unlock", self._timeout, token=token, nsid=nsid, moved=self._moved())
        except NVMeoFError as exc:  # the daemon is gone, or takes it back at its bound
            log.debug("handing back the delegation of n%d: %s", nsid, exc)

    def live(self) -> dict[int, Delegated]:
        """The delegations held and not recalled (the daemon renews them)."""
        return {nsid: held for nsid, held in self.delegated.items()
                if not held.recalled and not held.returned}

    async def renew(self, live: dict[int, Delegated], moved: dict[str, int]) -> bool:
        """Report, and renew the term of each delegation the daemon still counts as ours;
        one it does not (taken back, its recall lost) is handed back once idle.  Whether the
        daemon answered (then it has ``moved``)."""
        asked_at = time.monotonic()
        try:
            reply = await self._ask("report", self._timeout, moved=moved)
        except NVMeoFError as exc:  # their terms run out: writes ask the daemon again
            log.debug("renewing delegations: %s", exc)
            return False
        tokens = reply.get("delegated") or []
        for nsid, held in live.items():
            if held.token in tokens:
                held.confirmed(0, asked_at)
            elif held.since < asked_at and self.delegated.get(nsid) is held:
                self.recalled(nsid, held.token)
        return True
