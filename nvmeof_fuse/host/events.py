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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from .. import nvme
from ..errors import CommandTimeout, NVMeoFError, TransportError, unavailable_line
from ..nvme import Cns, FeatureId
from ..nvme import command as cmd
from ..nvme.events import (
    AEN_ANA_CHANGE,
    AEN_NS_ATTRIBUTE,
    CHANGED_NS_LIST,
    CHANGED_NS_LIST_BYTES,
    AsyncEvent,
    parse_changed_ns_list,
)
from ..transport.base import Queue
from .identity import IdentityIndex, namespace_identity, replaced_line
from .state import LIVE, CtrlState

log = logging.getLogger(__name__)

ACTIVE_NS_PAGES_MAX = 64
"""Pages of the active namespace list read at the most (65536 namespaces): a target that
says there are more, page after page, is not followed further."""
LAST_NSID = 0xFFFFFFFE  # the highest valid NSID (0xFFFFFFFF is the broadcast value)


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
    options: Any  # its ``nqn`` names the subsystem in messages

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


async def active_nsids(ctrl: EventSource) -> list[int]:
    """The active NSIDs (Identify CNS 02h), ascending: page after page, each of those above
    the last one of the page before, until a page is not full (or goes back); at most
    ACTIVE_NS_PAGES_MAX pages (then one line says the list was cut there)."""
    nsids: list[int] = []
    for _ in range(ACTIVE_NS_PAGES_MAX):
        after = nsids[-1] if nsids else 0
        page = nvme.parse_active_ns_list(await ctrl.identify_raw(Cns.ACTIVE_NS_LIST, after))
        new = [nsid for nsid in page if nsid > after]
        nsids += new
        if (len(page) < nvme.ACTIVE_NS_PER_PAGE or len(new) < len(page)
                or nsids[-1] >= LAST_NSID):  # none can follow (and asking past it is invalid)
            return nsids
    log.warning("%s: the active namespace list goes on past %d pages; serving its first %d "
                "namespaces", ctrl.options.nqn, ACTIVE_NS_PAGES_MAX, len(nsids))
    return nsids


async def identify_namespace(ctrl: EventSource, nsid: int
                             ) -> tuple[nvme.IdentifyNamespace, nvme.NamespaceIdentity] | None:
    """Identify Namespace ``nsid`` and its identity; None if it is not there (NSZE 0)."""
    ident = nvme.IdentifyNamespace.from_bytes(await ctrl.identify_raw(Cns.NAMESPACE, nsid))
    if not ident.nsze:
        return None
    return ident, await namespace_identity(ctrl, nsid, ident)


async def rescan(ctrl: EventSource, nsids: list[int] | None, new_namespace: NewNamespace,
                 changes: list[NamespaceChange] | None = None) -> list[NamespaceChange]:
    """Look at ``nsids`` (all of them: None) again; apply and return what changed (added
    to ``changes`` as each is applied and logged, so that a rescan that fails half-way
    leaves what it applied there).

    A namespace found anew is made by ``new_namespace``; so is the one that replaces a
    namespace whose identity changed (:mod:`.identity`), after the old one was told
    (``replace``) and the controller too (``namespace_replaced``), before this returns."""
    active = set(await active_nsids(ctrl))
    wanted = sorted(set(ctrl.namespaces) | active if nsids is None else set(nsids))
    changes = [] if changes is None else changes
    first = len(changes)
    for nsid in wanted:
        ns: ScannedNamespace | None = ctrl.namespaces.get(nsid)
        found = await identify_namespace(ctrl, nsid) if nsid in active else None
        if found is None:
            if ns is not None:
                del ctrl.namespaces[nsid]
                ns.remove(f"namespace n{nsid} was removed from {ctrl.options.nqn}")
                _applied(changes, NamespaceChange("removed", nsid, ns.size, 0))
            continue
        ident, identity = found
        if ns is None:
            ns = ctrl.namespaces[nsid] = new_namespace(nsid, ident)
            ns.identity = identity
            _applied(changes, NamespaceChange("added", nsid, 0, ns.size))
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
            _applied(changes, NamespaceChange("replaced", nsid, ns.size, new.size, line))
            continue
        ns.identity = identity
        was = ns.unavailable
        old = ns.resize(ident)
        now = ns.unavailable
        if now and now != was:  # values we cannot serve now: say why, once
            log.warning("%s: %s", ctrl.options.nqn, unavailable_line(nsid, now))
        if old is not None:
            _applied(changes, NamespaceChange("resized", nsid, old, ns.size))
    claim_identities(ctrl, [c.nsid for c in changes[first:] if c.kind in ("added", "replaced")])
    return changes[first:]


def _applied(changes: list[NamespaceChange], change: NamespaceChange) -> None:
    changes.append(change)
    log.log(logging.WARNING if change.kind == "replaced" else logging.INFO, "%s",
            change.describe())


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
            log.warning("%s: %s", ctrl.options.nqn, unavailable_line(nsid, ns.conflict))


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
                    log.warning("Asynchronous Event Request failed: %s; re-armed after the "
                                "next reconnect", completion.status_name())
                await self._wait_for_other_than(admin)
                continue
            self.events += 1
            await self._handle(AsyncEvent.from_dw0(completion.dw0))

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
            log.warning("cannot enable namespace attribute and ANA change notices: %s", exc)

    async def _handle(self, event: AsyncEvent) -> None:
        if event.ana_changed:
            log.debug("asynchronous event: %s", event.describe())
            for listener in list(self.ana_listeners):
                listener()
            return
        if not event.namespace_changed:
            log.info("asynchronous event: %s", event.describe())
            return
        try:
            page = await self.ctrl.get_log_page(CHANGED_NS_LIST, CHANGED_NS_LIST_BYTES)
        except NVMeoFError as exc:
            log.warning("cannot read the changed namespace list: %s; rescanning all", exc)
            await self._rescan(None)
            return
        await self._rescan(parse_changed_ns_list(page))

    async def _rescan(self, nsids: list[int] | None) -> None:
        try:
            changes = await rescan(self.ctrl, nsids, self.new_namespace)
        except NVMeoFError as exc:
            if self.ctrl.state is LIVE:
                log.warning("namespace rescan failed: %s", exc)
            else:  # lost or shutting down meanwhile (nvmet answers Command Sequence Error
                # once CC.SHN is set): a reconnect rescans again, a shutdown needs none
                log.debug("namespace rescan stopped (controller %s): %s", self.ctrl.state, exc)
            return
        await self._tell(changes)

    async def _tell(self, changes: list[NamespaceChange]) -> None:
        if changes:
            for listener in list(self.listeners):
                await listener(changes)
