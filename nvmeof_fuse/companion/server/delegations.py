"""Write delegations: one client writes a namespace without a lock round trip per write.

Each write a client makes on queues of its own holds the namespace's range lock
in the daemon (``lock``/``unlock``): two round trips to the daemon per write.
While nobody else uses the namespace (no FUSE handle of it open, nobody holding
or waiting for a range of it), the daemon may *delegate* the whole namespace to
the asking client instead, as NFS delegations and SMB oplocks do: it holds an
exclusive lock on every LBA on the client's behalf, and the client writes
(read-modify-writing its partial end LBAs under its own range lock) without
asking again.

Whoever then needs the namespace waits on that lock, and the wait recalls the
delegation: a FUSE open, a FUSE or staged write, another client's lock, a change
of the namespace on the target.  The client is told (``recall``), lets its
writes in flight finish and hands the delegation back (``unlock`` with its
token); a client that goes, or that does not hand it back within its bound,
loses it.  The kernel's cached pages of the namespace are dropped before the
waiter goes on.

A recall may never reach the client (stopped, its socket full).  So the client
writes under a delegation only for a term after the daemon last confirmed it (the
grant, or the delegations a ``report`` lists), and that term is shorter than the
grace the daemon gives a recalled holder beyond its write bound.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from ...errors import NVMeoFError
from ..protocol import MAX_NAMED_NAMESPACES

if TYPE_CHECKING:
    from .session import ClientSession

log = logging.getLogger(__name__)

MAX_SESSION_DELEGATIONS = MAX_NAMED_NAMESPACES
"""Delegations one session holds at most (a ``report`` reply lists their tokens); past
them it takes range locks."""


@dataclass(eq=False)
class Delegation:
    """A namespace delegated to one client's session."""

    session: ClientSession
    nsid: int
    token: int
    limit: float  # s the client has to hand it back once recalled
    release: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    settled: trio.Event = field(default_factory=trio.Event)  # granted, or refused
    active: bool = False  # granted: the lock is held for the client
    recalled: bool = False


class Delegations:
    """The daemon's delegations, one namespace to one session at most."""

    def __init__(self, drop_cached: Callable[[int], Awaitable[None]]) -> None:
        self._drop_cached = drop_cached  # the kernel forgets its pages of n<nsid>
        self._by_nsid: dict[int, Delegation] = {}
        self.files_open: Callable[[int], bool] = lambda nsid: False
        """Whether a FUSE handle of ``n<nsid>`` is open (the mount sets it)."""
        self.granted = 0  # delegations granted so far (stats)
        self.recalled = 0  # of those, recalled (counted as they end)

    def held(self, nsid: int) -> Delegation | None:
        return self._by_nsid.get(nsid)

    def of(self, session: ClientSession, token: int) -> Delegation | None:
        """The delegation ``session`` holds under ``token``, if any."""
        for d in self._by_nsid.values():
            if d.session is session and d.token == token:
                return d
        return None

    def live_tokens(self, session: ClientSession) -> list[int]:
        """The tokens of ``session``'s delegations, granted and not recalled."""
        return [d.token for d in self._by_nsid.values()
                if d.session is session and d.active and not d.recalled]

    async def grant(self, session: ClientSession, ns: Any, nsid: int, limit: float) -> int | None:
        """Delegate ``ns`` to ``session`` (or confirm it holds it, its writes now bounded
        by ``limit``): the token, or None when somebody else uses the namespace, it was
        recalled or the session holds the most it may (the caller takes a range lock
        instead)."""
        d = self._by_nsid.get(nsid)
        claimed = d is None
        if d is None:
            if (self.files_open(nsid) or len(ns.write_lock) or session.nursery is None
                    or session.ended or self._count(session) >= MAX_SESSION_DELEGATIONS):
                return None
            # Claimed before any await: asks that arrive meanwhile find it (and wait below).
            session.next_token += 1
            d = self._by_nsid[nsid] = Delegation(session, nsid, session.next_token, limit)
            try:
                session.nursery.start_soon(self._hold, ns, d)
            except RuntimeError:  # the session's nursery closed: it is going
                del self._by_nsid[nsid]
                return None
        elif d.session is not session:
            return None
        await d.settled.wait()  # at once: _hold neither waits nor fails to settle
        if not d.active or (d.recalled and not claimed):
            return None  # (recalled as it was granted: its client hands it back at once)
        d.limit = max(d.limit, limit)
        return d.token

    def _count(self, session: ClientSession) -> int:
        return sum(d.session is session for d in self._by_nsid.values())

    async def _hold(self, ns: Any, d: Delegation) -> None:
        lock = ns.write_lock
        # Checked again (others ran while this task started); with none queued here, only
        # another process of the mount (a FUSE worker's write) can hold a range: refused.
        held = None
        if not (self.files_open(d.nsid) or len(lock) or d.session.ended):
            try:
                held = lock.try_acquire([(0, ns.nlb, True)])
            except NVMeoFError as exc:  # the kernel refused the lock: no delegation
                log.warning("companion: no delegation of n%d: %s", d.nsid, exc)
        if held is None:
            del self._by_nsid[d.nsid]
            d.settled.set()
            d.done.set()
            return
        lock.on_wait = lambda: self.recall(d.nsid)
        d.session.write_locks[d.token] = d.release  # released with the client's other locks
        d.active = True
        self.granted += 1
        if d.recalled:  # while it was being granted
            self._tell_recalled(d)
        d.settled.set()
        try:
            with d.scope:
                await d.release.wait()
            if d.scope.cancelled_caught:
                log.warning("companion: %s did not hand back its delegation of n%d within "
                            "%g s of the recall; taken back", d.session.peer, d.nsid, d.limit)
        finally:
            del self._by_nsid[d.nsid]
            self.recalled += d.recalled
            d.session.write_locks.pop(d.token, None)
            try:
                with trio.CancelScope(shield=True):
                    await self._drop_cached(d.nsid)  # before the waiters read the namespace
            finally:
                lock.release(held)
                d.done.set()

    def recall(self, nsid: int) -> None:
        """Ask the client holding ``n<nsid>`` to hand it back (a wait on its lock began)."""
        d = self._by_nsid.get(nsid)
        if d is None or d.recalled:
            return
        d.recalled = True
        d.scope.deadline = trio.current_time() + d.limit
        if d.active:  # (else once granted, or never: refused)
            self._tell_recalled(d)

    @staticmethod
    def _tell_recalled(d: Delegation) -> None:
        session = d.session
        if session.notify is not None and session.nursery is not None:
            session.nursery.start_soon(session.notify,
                                       {"event": "recall", "nsid": d.nsid, "token": d.token})

    async def wait_returned(self, nsid: int) -> None:
        """Recall ``n<nsid>`` if delegated and wait until it is back (bounded by the
        holder's limit): a FUSE open calls this."""
        d = self._by_nsid.get(nsid)
        if d is not None:
            self.recall(nsid)
            await d.done.wait()

    async def follow(self, changes: list) -> None:
        """Recall the delegations of namespaces removed or resized on the target (a
        listener of ``host.events``): each holds the lock of the namespace it was granted,
        and only its LBAs."""
        for change in changes:
            if change.kind != "added":
                self.recall(change.nsid)

    async def hand_back(self, d: Delegation) -> None:
        """The client hands ``d`` back: return once the namespace is free for others."""
        d.release.set()
        await d.done.wait()
