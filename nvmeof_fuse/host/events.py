"""Asynchronous events and namespace rescans, as the kernel's ``nvme_async_event_work`` and
``nvme_scan_work`` do them.

One Asynchronous Event Request stays outstanding on the admin queue, re-armed
after each event and after each reconnect.  A Namespace Attribute Changed
notice reads the Changed Namespace List (which also lets the controller report
the next one) and rescans those namespaces; a reconnect rescans them all, before
I/O resumes (:meth:`AsyncEvents.check_after_reconnect`).  Each change is applied to
``controller.namespaces``, logged in one line, and handed to the listeners (the
mount adds, removes, resizes or replaces its files).  A namespace whose identity
changed (:mod:`.identity`) is *replaced*: the old one refuses all I/O from then
on, and a new one, of another generation, takes its NSID.

This module knows the controller and its namespaces only by what it uses of them
(:class:`EventSource`, :class:`ScannedNamespace`); the controller hands it the
factory that makes a namespace it finds.

A target decides how often events come: at most :data:`EVENTS_PER_SECOND` are taken a
second (the next request is sent later; the controller keeps what happened meanwhile), and
every line they cause is rate-limited.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from .. import nvme
from ..concurrency import run_bounded
from ..errors import CommandTimeout, NVMeoFError, TransportError, unavailable_line
from ..nvme import Cns, FeatureId, NVMeStatusError
from ..nvme import command as cmd
from ..nvme.events import (
    AEN_ANA_CHANGE,
    AEN_NS_ATTRIBUTE,
    CHANGED_NS_LIST,
    CHANGED_NS_LIST_BYTES,
    AsyncEvent,
    parse_changed_ns_list,
)
from ..nvme.status import SCT_GENERIC
from ..ratelimit import LIST_SHOWN, RateLimitedLog, brief_list
from ..transport.base import Queue
from .connect_options import DEFAULT_MAX_NAMESPACES
from .identity import IdentityIndex, namespace_identity, replaced_line
from .state import LIVE, CtrlState

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
"""Lines a target can make us write again and again (events, rescans)."""

COUNT_PAGES_MAX = 64
"""Pages of the active namespace list read past ``--max-namespaces``, only to say how many
are refused (65,536 more; a list that goes on is said to hold more than that)."""
LAST_NSID = 0xFFFFFFFE  # the highest valid NSID (0xFFFFFFFF is the broadcast value)
EVENTS_PER_SECOND = 20
"""Asynchronous events taken per second at the most: past it, the next Asynchronous Event
Request waits for the second to end (a target that completes each at once costs us that
much, not a core)."""
SC_INVALID_NAMESPACE = 0x0B  # generic: Invalid Namespace or Format
IDENTIFY_IN_FLIGHT = 16
"""Identify commands of a scan in flight at once: 65,536 namespaces take two each (as in
Linux, which identifies each namespace it scans), and one at a time they wait for each
other's round trips.  Well below the admin queue's 31 commands, which the keep-alive and
the Asynchronous Event Request share."""


@dataclass(frozen=True)
class NamespaceChange:
    """One namespace that appeared, went away, changed size, or was replaced by another
    behind its NSID (``detail``: the line that says how)."""

    kind: str  # "added", "removed", "resized", "replaced"
    nsid: int
    old_size: int = 0
    new_size: int = 0
    detail: str = ""

    def describe(self) -> str:
        if self.kind == "added":
            return f"namespace n{self.nsid} added ({self.new_size} bytes)"
        if self.kind == "removed":
            return f"namespace n{self.nsid} removed"
        if self.kind == "replaced":
            return self.detail or f"namespace n{self.nsid} replaced"
        return f"namespace n{self.nsid} resized from {self.old_size} to {self.new_size} bytes"


def describe_changes(changes: list[NamespaceChange]) -> list[str]:
    """The lines that say ``changes``: one each while few, else one per kind with the
    first few namespaces and a count (a rescan may change thousands)."""
    if len(changes) <= LIST_SHOWN:
        return [change.describe() for change in changes]
    kinds: dict[str, list[str]] = {}
    for change in changes:
        kinds.setdefault(change.kind, []).append(f"n{change.nsid}")
    return [f"{len(names):,} namespaces {kind}: {brief_list(names)}"
            for kind, names in kinds.items()]


Listener = Callable[[list[NamespaceChange]], Awaitable[None]]


class ScannedNamespace(Protocol):
    """What a rescan changes of a namespace it knows."""

    size: int
    unavailable: str
    identity: nvme.NamespaceIdentity | None
    conflict: str

    def resize(self, identify: nvme.IdentifyNamespace) -> int | None: ...

    def remove(self, reason: str) -> None: ...

    def replace(self, reason: str) -> None: ...

    def refuse_as(self, conflict: str) -> None: ...


NewNamespace = Callable[[int, nvme.IdentifyNamespace], ScannedNamespace]
"""Makes the namespace a rescan found, from its nsid and Identify data."""


class EventSource(Protocol):
    """What the AER loop and the rescan use of a controller."""

    admin: Queue | None
    identify: nvme.IdentifyController | None
    namespaces: dict[int, Any]
    options: Any  # its ``nqn`` names the subsystem in messages; ``max_namespaces``
    refused_namespaces: tuple[int, str] | None  # what say_refused last said (set there)

    @property
    def state(self) -> CtrlState: ...

    async def wait_connected(self) -> bool: ...

    async def wait_changed(self) -> None: ...

    def connection_lost(self, queue: Queue | None, exc: BaseException) -> None: ...

    async def identify_raw(self, cns: int, nsid: int = 0) -> bytes: ...

    async def get_log_page(self, lid: int, length: int, offset: int = 0) -> bytes: ...

    async def set_features(self, fid: int, cdw11: int) -> int: ...

    def namespace_replaced(self, nsid: int, old: Any, new: Any) -> None:
        """``old`` was replaced by ``new`` behind ``nsid`` (already in ``namespaces``):
        fence what waits to be sent for the old one (:class:`Controller`)."""


@dataclass
class ActiveList:
    """The active namespace list as read: NSIDs ascending, up to ``--max-namespaces`` and
    COUNT_PAGES_MAX pages more; ``ended``: it was read to its end."""

    nsids: list[int]
    ended: bool

    def describe_total(self) -> str:
        return f"{len(self.nsids)}" if self.ended else f"more than {len(self.nsids)}"


def max_namespaces(ctrl: EventSource) -> int:
    """The controller's ``--max-namespaces`` (its default for a stand-in without one)."""
    return getattr(ctrl.options, "max_namespaces", DEFAULT_MAX_NAMESPACES)


async def read_active_list(ctrl: EventSource) -> ActiveList:
    """The active NSIDs (Identify CNS 02h), page after page, each of those above the last
    one of the page before, until a page is not full (or goes back); past
    ``--max-namespaces`` at most COUNT_PAGES_MAX pages more, only to count."""
    nsids: list[int] = []
    pages = -(-max_namespaces(ctrl) // nvme.ACTIVE_NS_PER_PAGE) + COUNT_PAGES_MAX
    for _ in range(pages):
        after = nsids[-1] if nsids else 0
        page = nvme.parse_active_ns_list(await ctrl.identify_raw(Cns.ACTIVE_NS_LIST, after))
        new = [nsid for nsid in page if nsid > after]
        nsids += new
        if (len(page) < nvme.ACTIVE_NS_PER_PAGE or len(new) < len(page)
                or nsids[-1] >= LAST_NSID):  # none can follow (and asking past it is invalid)
            return ActiveList(nsids, True)
    return ActiveList(nsids, False)


def say_refused(ctrl: EventSource, listed: ActiveList) -> None:
    """One line when the list holds more than ``--max-namespaces``, and again only when
    its count changes (a rescan finds the same: a target cannot make us repeat it)."""
    cap = max_namespaces(ctrl)
    refused = (cap, listed.describe_total()) if len(listed.nsids) > cap else None
    if refused != getattr(ctrl, "refused_namespaces", None):
        ctrl.refused_namespaces = refused
        if refused is not None:
            log.warning("%s: serving the first %d of %s namespaces (--max-namespaces)",
                        ctrl.options.nqn, *refused)


async def active_nsids(ctrl: EventSource) -> list[int]:
    """The active NSIDs a mount serves: the first ``--max-namespaces`` of the list (the
    rest refused in one line, :func:`say_refused`)."""
    listed = await read_active_list(ctrl)
    say_refused(ctrl, listed)
    return listed.nsids[:max_namespaces(ctrl)]


Identified = tuple[nvme.IdentifyNamespace, nvme.NamespaceIdentity]


async def identify_namespaces(ctrl: EventSource, nsids: list[int]) -> dict[int, Identified]:
    """Identify Namespace and the identity of each of ``nsids`` that is there
    (:func:`identify_namespace`), IDENTIFY_IN_FLIGHT at once."""
    found: dict[int, Identified] = {}

    async def identify(nsid: int) -> None:
        got = await identify_namespace(ctrl, nsid)
        if got is not None:
            found[nsid] = got

    await run_bounded(nsids, identify, IDENTIFY_IN_FLIGHT)
    return found


async def identify_namespace(ctrl: EventSource, nsid: int) -> Identified | None:
    """Identify Namespace ``nsid`` and its identity; None if it is not there (any more):
    all zeros, or Invalid Namespace or Format, as when it went away since the active list
    was read (the kernel's ``nvme_validate_ns`` removes it then too).  Any other status
    fails the rescan: nvmet answers Command Sequence Error, with DNR, once shutdown began."""
    try:
        ident = nvme.IdentifyNamespace.from_bytes(await ctrl.identify_raw(Cns.NAMESPACE, nsid))
    except NVMeStatusError as exc:
        if (exc.sct, exc.sc) == (SCT_GENERIC, SC_INVALID_NAMESPACE):
            log.debug("namespace n%d is gone: %s", nsid, exc)
            return None
        raise
    if not ident.nsze:
        return None
    return ident, await namespace_identity(ctrl, nsid, ident)


async def rescan(ctrl: EventSource, nsids: list[int] | None, new_namespace: NewNamespace,
                 changes: list[NamespaceChange] | None = None) -> list[NamespaceChange]:
    """Look at ``nsids`` (all of them: None) again; apply and return what changed (added
    to ``changes`` as each is applied, and logged even when the rescan fails half-way, so
    that what it applied stays there).

    A namespace found anew is made by ``new_namespace``, while fewer than
    ``--max-namespaces`` are served; one past the part of the list read is left as it is.
    So is the one that replaces a namespace whose identity changed (:mod:`.identity`),
    after the old one was told (``replace``) and the controller too
    (``namespace_replaced``), before this returns."""
    listed = await read_active_list(ctrl)
    active = set(listed.nsids)
    beyond = listed.nsids[-1] if listed.nsids and not listed.ended else LAST_NSID
    wanted = sorted(set(ctrl.namespaces) | active if nsids is None else set(nsids))
    wanted = [nsid for nsid in wanted if nsid <= beyond]
    identified = await identify_namespaces(ctrl, [nsid for nsid in wanted if nsid in active])
    gone = sum(nsid in ctrl.namespaces and nsid not in identified for nsid in wanted)
    room = max_namespaces(ctrl) - len(ctrl.namespaces) + gone
    changes = [] if changes is None else changes
    first = len(changes)
    try:
        for nsid in wanted:
            ns: ScannedNamespace | None = ctrl.namespaces.get(nsid)
            found = identified.get(nsid)
            if found is None:
                if ns is not None:
                    del ctrl.namespaces[nsid]
                    ns.remove(f"namespace n{nsid} was removed from {ctrl.options.nqn}")
                    changes.append(NamespaceChange("removed", nsid, ns.size, 0))
                continue
            ident, identity = found
            if ns is None:
                if room <= 0:
                    continue  # past --max-namespaces: counted in say_refused's line
                ns = ctrl.namespaces[nsid] = new_namespace(nsid, ident)
                ns.identity = identity
                changes.append(NamespaceChange("added", nsid, 0, ns.size))
                room -= 1
                continue
            change = ns.identity.change(identity) if ns.identity is not None else ""
            if change:
                assert ns.identity is not None
                line = replaced_line(ctrl.options.nqn, nsid, ns.identity, identity, change)
                new = ctrl.namespaces[nsid] = new_namespace(nsid, ident)
                new.identity = identity
                ns.replace(f"namespace n{nsid} of {ctrl.options.nqn} was replaced by another "
                           f"namespace ({change})")
                ctrl.namespace_replaced(nsid, ns, new)
                changes.append(NamespaceChange("replaced", nsid, ns.size, new.size, line))
                continue
            ns.identity = identity
            was = ns.unavailable
            old = ns.resize(ident)
            now = ns.unavailable
            if now and now != was:  # values we cannot serve now: say why, once
                limited.log("unavailable", logging.WARNING, "%s: %s", ctrl.options.nqn,
                            unavailable_line(nsid, now))
            if old is not None:
                changes.append(NamespaceChange("resized", nsid, old, ns.size))
        say_refused(ctrl, listed)
        claim_identities(ctrl, [c.nsid for c in changes[first:]
                                if c.kind in ("added", "replaced")])
    finally:
        log_changes(changes[first:])
    return changes[first:]


def log_changes(changes: list[NamespaceChange]) -> None:
    """A replaced namespace gets a warning of its own, naming both identities (rate-limited:
    a target may swap thousands); the rest are said together (:func:`describe_changes`)."""
    for change in changes:
        if change.kind == "replaced":
            limited.log("replaced", logging.WARNING, "%s", change.describe())
    for line in describe_changes([c for c in changes if c.kind != "replaced"]):
        limited.log("changes", logging.INFO, "%s", line)


def claim_identities(ctrl: EventSource, found: list[int]) -> None:
    """Namespaces ``found`` anew (or again) that report another one's identifiers are
    refused (:class:`IdentityIndex`), each said once."""
    if not found:
        return
    fresh = set(found)
    index = IdentityIndex((n, ns) for n, ns in sorted(ctrl.namespaces.items())
                          if n not in fresh)
    for nsid in found:
        ns = ctrl.namespaces.get(nsid)
        if ns is None:
            continue
        index.claim(nsid, ns)
        if ns.conflict:
            limited.log("conflict", logging.WARNING, "%s: %s", ctrl.options.nqn,
                        unavailable_line(nsid, ns.conflict))



class AsyncEvents:
    """Keeps an AER outstanding on ``ctrl``'s admin queue and rescans on namespace changes
    (making the namespaces it finds with ``new_namespace``)."""

    def __init__(self, ctrl: EventSource, new_namespace: NewNamespace) -> None:
        self.ctrl = ctrl
        self.new_namespace = new_namespace
        self.listeners: list[Listener] = []
        self.ana_listeners: list[Callable[[], None]] = []
        """Told of each ANA-change notice (a multipath head reads the ANA log page then,
        which also lets the controller report the next one)."""
        self.replaced_listeners: list[Callable[[int, Any, Any], None]] = []
        """Told at once, ``(nsid, old, new)``, of each namespace replaced by another behind
        its NSID: after a reconnect, before I/O resumes (a multipath head fences its own
        namespace then); the listeners hear of it later, with the other changes."""
        self.events = 0  # AER completions seen
        self._second = (-math.inf, 0)  # (start, events taken in it): EVENTS_PER_SECOND
        self._after_reconnect: list[NamespaceChange] = []

    async def check_after_reconnect(self) -> None:
        """Rescan every namespace on a new connection before I/O resumes on it: what
        changed is applied now (a namespace of another identity refuses I/O from here on),
        and handed to the listeners once the loop re-arms on the new admin queue.  Raises
        what the rescan raised (the reconnect failed then, and is tried again)."""
        await rescan(self.ctrl, None, self.new_namespace, self._after_reconnect)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Until the controller is gone: arm, wait, handle, re-arm (also on new queues)."""
        task_status.started()
        ctrl = self.ctrl
        armed_on = ctrl.admin
        await self._configure()
        while await ctrl.wait_connected():
            admin = ctrl.admin
            if admin is None:
                await trio.sleep(0)
                continue
            if admin is not armed_on:  # reconnected: the rescan before I/O resumed found
                armed_on = admin  # what changed meanwhile (check_after_reconnect)
                await self._configure()
                changes, self._after_reconnect = self._after_reconnect, []
                await self._tell(changes)
                continue
            try:
                completion = await admin.execute(cmd.async_event_request(), timeout=math.inf)
            except (TransportError, CommandTimeout) as exc:
                ctrl.connection_lost(admin, exc)
                await self._wait_for_other_than(admin)  # re-arm on the next admin queue
                continue
            if not completion.ok:
                if ctrl.state is LIVE and ctrl.admin is admin:
                    limited.log("aer failed", logging.WARNING, "Asynchronous Event Request "
                                "failed: %s; re-armed after the next reconnect",
                                completion.status_name())
                await self._wait_for_other_than(admin)
                continue
            self.events += 1
            await self._handle(AsyncEvent.from_dw0(completion.dw0))
            await self._pace()

    async def _pace(self) -> None:
        """Past EVENTS_PER_SECOND events in this second, wait for its end."""
        start, taken = self._second
        now = trio.current_time()
        if now - start >= 1.0:
            start, taken = now, 0
        self._second = (start, taken + 1)
        if taken + 1 >= EVENTS_PER_SECOND:
            await trio.sleep_until(start + 1.0)

    async def _wait_for_other_than(self, admin: object) -> None:
        while self.ctrl.admin is admin and self.ctrl.state is LIVE:
            await self.ctrl.wait_changed()

    async def _configure(self) -> None:
        """Ask for namespace attribute and ANA change notices where the controller offers
        them (nvmet sends an ANA change only to controllers that asked)."""
        ident = self.ctrl.identify
        wanted = ident.oaes & (AEN_NS_ATTRIBUTE | AEN_ANA_CHANGE) if ident is not None else 0
        if not wanted:
            return
        try:
            await self.ctrl.set_features(FeatureId.ASYNC_EVENT_CONFIG, wanted)
        except NVMeoFError as exc:
            limited.log("aen config", logging.WARNING, "cannot enable namespace attribute and "
                        "ANA change notices: %s", exc)

    async def _handle(self, event: AsyncEvent) -> None:
        if event.ana_changed:
            log.debug("asynchronous event: %s", event.describe())
            for listener in list(self.ana_listeners):
                listener()
            return
        if not event.namespace_changed:
            limited.log("event", logging.INFO, "asynchronous event: %s", event.describe())
            return
        try:  # one command (4 KiB), so no torn read; it has no change counter either
            page = await self.ctrl.get_log_page(CHANGED_NS_LIST, CHANGED_NS_LIST_BYTES)
        except NVMeoFError as exc:
            limited.log("changed list", logging.WARNING, "cannot read the changed namespace "
                        "list: %s; rescanning all", exc)
            await self._rescan(None)
            return
        await self._rescan(parse_changed_ns_list(page))

    async def _rescan(self, nsids: list[int] | None) -> None:
        try:
            changes = await rescan(self.ctrl, nsids, self.new_namespace)
        except NVMeoFError as exc:
            if self.ctrl.state is LIVE:
                limited.log("rescan failed", logging.WARNING, "namespace rescan failed: %s",
                            exc)
            else:  # lost or shutting down meanwhile (nvmet answers Command Sequence Error
                # once CC.SHN is set): a reconnect rescans again, a shutdown needs none
                log.debug("namespace rescan stopped (controller %s): %s", self.ctrl.state, exc)
            return
        await self._tell(changes)

    async def _tell(self, changes: list[NamespaceChange]) -> None:
        if changes:
            for listener in list(self.listeners):
                await listener(changes)
