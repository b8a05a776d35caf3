"""A multipath head: one set of namespaces over several controllers (paths) to a subsystem.

Like the kernel's ``nvme_ns_head``: each path is a :class:`Controller` of its own, with
its queues, keep-alive, reconnect and authentication; the head's namespaces run their
commands through :class:`MultipathController`, which satisfies the namespaces'
:class:`~nvmeof_fuse.host.io.CommandIssuer` as a controller does, so nothing above
needs to know about paths.

- A command goes to the path the I/O policy picks among the usable ones (live, and
  the namespace optimized or non-optimized there: :mod:`.iopolicy`).
- A command that fails with a path-related status, a lost connection or a timeout
  runs again at once on another usable path (``nvme_failover_req``); an ANA status
  also has the path's ANA log read again.  The caller sees an error only when no path
  can serve: every path's controller gave up (``--ctrl-loss-tmo``), or none became
  usable within it.
- Each path's ANA log page is read at connect, on each ANA-change notice and after
  each reconnect (:mod:`.ana`); a group in the change state past twice ANATT resets
  that path's controller, as the kernel does.
- A path is admitted only to the same subsystem (subsystem NQN, serial and model
  number) and only if each namespace it shares has the same identity (identifiers, as
  ``nvme_ns_ids_equal``, and format: :mod:`.identity`); a refusal is one line.
- A path whose controller finds another namespace behind an NSID (after a reconnect,
  or at a rescan) is told at once, before its I/O resumes: it serves that NSID no more
  while another path still serves the mount's namespace; once none does, the head's
  namespace is replaced too (its I/O fails from then on, and a new one, of the next
  generation, takes the NSID), as the kernel's head goes with its last path.
- Memory the head registers (bounce buffers, caller regions) is registered with
  every path's transport (:class:`~.pathmemory.PathsRegistration`), so any path can move it.
- With one path the head hands commands straight to that path's controller: choosing a
  path costs nothing then.  A path whose controller gave up is connected anew every
  ``--reconnect-delay``, so the mount works again when the target comes back.

Why one module: failover, ANA, admission and reviving a path all act on one head's paths
and which of them serve; what needs no head lives apart (a path, its ANA states, the I/O
policies, the memory of every path).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio

from ... import nvme
from ...concurrency import unwrap_groups
from ...errors import (
    CommandTimeout,
    ControllerLost,
    InvalidArgument,
    NamespaceReplaced,
    NVMeoFError,
    TransportError,
)
from ...nvme import Completion, LogPageId, NamespaceIdentity
from ...nvme.ana import AnaLogPage, AnaState, ana_log_size
from ...nvme.status import fails_over, is_ana_error
from ...nvme.uri import DEFAULT_PORT, parse_uri
from ...ratelimit import LIST_SHOWN, FailureStreak, RateLimitedLog, brief_list
from ...transport.base import Finished, Queue
from ..connect_options import ConnectOptions
from ..controller import (
    BOUNCE_BUFFERS,
    BOUNCE_WAIT_FACTOR,
    IO_RETRIES,
    SCRATCH_BYTES,
    Controller,
    out_of_tries,
)
from ..controller import connect as connect_controller
from ..events import NamespaceChange
from ..identity import namespace_identity, replaced_line
from ..logread import read_whole
from ..memory import BouncePool, DataRef, Region, buffer_address, host_buffer
from ..namespace import Namespace
from ..namespace.sharedranges import SharedRanges
from ..state import DEAD, DELETING, LIVE
from ..topology.pcie import Distance
from ..topology.sysfs import Topology
from .ana import PathAna
from .iopolicy import DEFAULT_POLICY, PathSelector
from .nearest import MemoryPlace, distance, nearest
from .path import Path, PathRefused, path_uri
from .pathmemory import HeadPool, PathsRegistration, PathsTransport

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
"""Lines a target can make us write again and again (ANA changes, path state changes)."""

ANA_POLL_INTERVAL = 1.0
"""Seconds between reads of a path's ANA log while it is pending or changing (a notice
normally comes first)."""
ANA_HEADER_BYTES = 16
"""The ANA log page's header: CHGCNT, NGRPS."""
NO_PATH_WAIT = 1.0
"""Seconds between looks for a usable path while a command waits for one."""

Connect = Callable[[ConnectOptions], contextlib.AbstractAsyncContextManager[Controller]]


class HeadEvents:
    """The head's namespace changes, for the mount to follow (as a controller's events)."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[list[NamespaceChange]], Any]] = []
        self.events = 0


class MultipathController:
    """The namespaces of one subsystem over several paths (see the module's docstring).

    Built by :func:`connect`; paths join with :meth:`add_path` and leave with
    :meth:`remove_path`.
    """

    starts_io = True

    def __init__(self, nursery: trio.Nursery, *, policy: str = DEFAULT_POLICY,
                 connect: Connect | None = None, topology: Topology | None = None) -> None:
        self._nursery = nursery
        self._topology = topology
        self._advised: set[MemoryPlace] = set()  # memory told its nearest path is SYS
        self._connect: Connect = connect or connect_controller
        self.selector: PathSelector[Path] = PathSelector(policy)
        self.paths: list[Path] = []
        self._next_index = 0
        self.nqn = ""
        self.namespaces: dict[int, Namespace] = {}
        self.shared_ranges: SharedRanges | None = None
        """The mount's range locks across its processes (FUSE workers), which its
        namespaces' writes take (:func:`~.namespace.sharedranges.share_range_locks`)."""
        self.ids: dict[int, NamespaceIdentity] = {}
        """The identity of each namespace the mount serves (the first path's, at first)."""
        self.controller_identity: nvme.IdentifyController | None = None  # the first path's
        self.replacements = 0  # namespaces replaced (see _settle)
        self._replaced: dict[int, int] = {}  # nsid -> replacements at its last replacement
        self._generations: dict[int, int] = {}  # nsid -> the last namespace's generation
        self._changes: list[NamespaceChange] = []  # replacements the listeners hear of next
        self.events = HeadEvents()
        self.max_transfer = 0
        self.bounce: BouncePool | None = None
        self._registrations: list[PathsRegistration] = []
        self._regions: list[Region] = []
        self._scratch: Region | None = None
        self._scratch_lock = trio.Lock()
        self._changed = trio.Event()
        self._closed = ""
        self._stopping = ""  # why commands whose connection fails are not run again
        self._wound_down_by = math.inf  # by when the paths' commands end, once stopping
        self.shutdown_notes: list[str] = []
        """What the paths' orderly shutdowns skipped as the mount closed (for its last line)."""
        self._attempts: dict[int, trio.CancelScope] = {}  # by path index: its connect and serve
        self._admit_lock = trio.Lock()
        self.failovers = 0
        self._generation = 0  # of what is known of the paths: see _usable
        self._usable_paths: dict[int, tuple[int, list[Path], list[Path]]] = {}
        self._direct: Path | None = None  # the one path commands go straight to
        self._baseline = (0, 0)  # the namespaces' (ops, bytes) when it became so
        self._bind()

    # -- the path set -----------------------------------------------------------------------

    @property
    def policy(self) -> str:
        return self.selector.policy

    @property
    def topology(self) -> Topology:
        """Where the paths' devices sit (sysfs, read at first use; where it cannot be read,
        one line says so and paths are chosen as without it)."""
        if self._topology is None:
            self._topology = Topology()
            if self._topology.unavailable:
                log.info("%s", self._topology.unavailable)
        return self._topology

    @property
    def primary(self) -> Controller | None:
        """The first path's controller that is connected (identity, options, Identify)."""
        for path in self.paths:
            if path.ctrl is not None:
                return path.ctrl
        return None

    @property
    def options(self) -> ConnectOptions:
        return self.paths[0].options if self.paths else ConnectOptions("", self.nqn)

    @property
    def identify(self) -> nvme.IdentifyController | None:
        ctrl = self.primary
        return ctrl.identify if ctrl is not None else None

    def _bind(self) -> None:
        """Commands straight to the controller with one connected path, else through the
        path choice (:meth:`_io_multipath`); first, a namespace no path serves any more
        under the mount's identity is replaced (:meth:`_settle`)."""
        for nsid in sorted({n for p in self.paths for n in p.stale}):
            self._settle(nsid)
        connected = [p for p in self.paths if p.ctrl is not None]
        direct = connected[0] if len(self.paths) == 1 and connected else None
        if direct is not self._direct:  # the direct path's commands are the namespaces'
            ops, nbytes = self._namespace_totals()
            if self._direct is not None:
                self._direct.ios += ops - self._baseline[0]
                self._direct.bytes += nbytes - self._baseline[1]
            self._direct, self._baseline = direct, (ops, nbytes)
        if direct is not None:
            ctrl = direct.ctrl
            assert ctrl is not None
            self.io_command = ctrl.io_command  # type: ignore[method-assign]
            self.start_io = ctrl.start_io  # type: ignore[method-assign]
            self.io_failed = ctrl.io_failed  # type: ignore[method-assign]
        else:
            self.io_command = self._io_multipath  # type: ignore[method-assign]
            self.start_io = self._start_none  # type: ignore[method-assign]
            self.io_failed = self._io_failed_none  # type: ignore[method-assign]
        self._wake()

    def _wake(self) -> None:
        """Something about the paths changed: forget the usable paths worked out, and wake
        those waiting for a path."""
        self._generation += 1
        self._changed.set()
        self._changed = trio.Event()

    async def add_path(self, options: ConnectOptions, *, must_connect: bool = True) -> Path:
        """Connect a path and admit it; PathRefused (one line) if it cannot serve this
        mount.  If it cannot be reached: the connect error, or with ``must_connect`` False
        (a mount's further paths) the path joins anyway and is connected in the background
        every ``--reconnect-delay``, as a path that was lost."""
        if self._closed:
            raise ControllerLost(self._closed)
        if self.nqn and options.nqn != self.nqn:
            raise PathRefused(f"path {path_uri(options)} refused: it names subsystem "
                              f"{options.nqn}, not this mount's subsystem {self.nqn}")
        for path in self.paths:
            if _same_place(path_uri(options), path):
                raise PathRefused(f"path {path_uri(options)} is already path {path.index} "
                                  "of this mount")
        path = Path(self._next_index, options)
        self._next_index += 1
        await self._nursery.start(self._run_path, path, must_connect)
        return path

    async def remove_path(self, uri: str) -> Path:
        """Take the path ``uri`` (or its index) out: no new commands go there, those in
        flight end, then its controller disconnects."""
        path = self.find_path(uri)
        if len(self.paths) == 1:
            raise PathRefused(f"{path.name} is the last path of this mount; unmount instead")
        self.paths.remove(path)
        self.selector.forget(path)
        self._bind()
        self._remove(path)
        log.info("%s removed", path.name)
        return path

    def _remove(self, path: Path) -> None:
        """Take ``path`` out: a serving one lets its commands end first (:meth:`_serve_path`),
        one still connecting stops at once, so that a target that never answers cannot
        hold an unmount for its connect and command timeouts."""
        path.removed.set()
        attempt = self._attempts.get(path.index)
        if attempt is not None and path.ctrl is None:
            attempt.cancel()

    def find_path(self, uri: str) -> Path:
        for path in self.paths:
            if uri in (path.uri, str(path.index)) or _same_place(uri, path):
                return path
        known = ", ".join(p.uri for p in self.paths) or "none"
        raise InvalidArgument(f"{uri} is not a path of this mount (its paths: {known})")

    async def _run_path(self, path: Path, must_connect: bool = True, *,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
        """A path's life: connect and admit (errors go to :meth:`add_path`'s caller), serve,
        and while it is not removed connect anew each time its controller gives up."""
        started = False
        failing = FailureStreak(log)  # logged when it starts, then ever more rarely
        while not path.removed.is_set():
            delay = path.options.reconnect_delay
            try:
                with unwrap_groups(), trio.CancelScope() as self._attempts[path.index]:
                    await self._connect_and_serve(path, started, task_status, failing)
                started = True
                if not path.removed.is_set():
                    failing.failed(logging.WARNING, "%s: its controller gave up; connecting "
                                   "anew every %g s", path.name, delay)
            except PathRefused as exc:
                if not started:
                    raise
                failing.failed(logging.ERROR, "%s: %s; it stays out until connected again "
                               "(tried every %g s)", path.name, exc, delay)
            except NVMeoFError as exc:
                if not started and must_connect:
                    raise
                if not started:  # a mount's further path: it joins, and comes when it can
                    self.paths.append(path)
                    self._bind()
                    task_status.started(path)
                    started = True
                failing.failed(logging.WARNING, "%s: connect failed: %s; connecting anew "
                               "every %g s", path.name, exc, delay)
            if path.removed.is_set():
                return
            with trio.move_on_after(delay):
                await path.removed.wait()

    @contextlib.asynccontextmanager
    async def _connected(self, path: Path) -> AsyncIterator[Controller]:
        """The path's controller, connected; when it closes with the mount, what its orderly
        shutdown skipped joins :attr:`shutdown_notes`."""
        ctrl = None
        try:
            async with self._connect(path.options) as ctrl:
                yield ctrl
        finally:
            note = getattr(ctrl, "shutdown_note", "")
            if note and self._closed:
                self.shutdown_notes.append(f"{path.name}: {note}")

    async def _connect_and_serve(self, path: Path, started: bool, task_status,
                                 failing: FailureStreak) -> None:
        async with self._connected(path) as ctrl:
            async with self._admit_lock:
                await self._admit(path, ctrl)
            if not started:
                self.paths.append(path)
                task_status.started(path)
            if path.connected_once:
                path.revivals += 1
            path.connected_once = True
            try:
                self._attach(path, ctrl, failing.end())
                await self._serve_path(path, ctrl)
            finally:
                self._detach(path, ctrl)

    async def _admit(self, path: Path, ctrl: Controller) -> None:
        """Check that ``ctrl`` reaches this mount's subsystem and namespaces; the first
        path sets them.  A path connected again (its controller had given up) that finds
        another namespace behind an NSID is not refused: it serves that NSID no more,
        as after a reconnect (:meth:`_settle`)."""
        ident = ctrl.identify
        assert ident is not None
        subnqn = ident.subnqn or ctrl.options.nqn
        first = not self.nqn
        if not first and subnqn != self.nqn:
            raise PathRefused(f"path {path.uri} refused: it reaches subsystem {subnqn}, "
                              f"not this mount's subsystem {self.nqn}")
        if not first and self.controller_identity is not None:
            change = nvme.controller_change(self.controller_identity, ident)
            if change:
                raise PathRefused(f"path {path.uri} refused: its controller is not of this "
                                  f"mount's subsystem: its {change}")
        ids = {}
        for nsid, ns in sorted(ctrl.namespaces.items()):
            if ns.identity is None:  # a controller brought up without one (tests' fakes)
                ns.identity = await namespace_identity(ctrl, nsid, ns.identify)
            ids[nsid] = ns.identity
        stale = set()
        if not first:
            for nsid, mine in sorted(self.ids.items()):
                theirs = ids.get(nsid)
                if theirs is None:
                    continue  # not on this path: it serves the others
                mismatch = mine.change(theirs)
                if mismatch and path.connected_once:
                    stale.add(nsid)
                elif mismatch:
                    theirs_first = theirs.change(mine).replace(" != ", " != the mount's ")
                    raise PathRefused(f"path {path.uri} refused: namespace {nsid} differs "
                                      f"there (its {theirs_first})")
                head_ns, ns = self.namespaces.get(nsid), ctrl.namespaces[nsid]
                if (nsid not in stale and head_ns is not None
                        and (ns.size, ns.lba_size) != (head_ns.size, head_ns.lba_size)):
                    raise PathRefused(
                        f"path {path.uri} refused: namespace {nsid} has {ns.size} bytes in "
                        f"{ns.lba_size}-byte blocks there, {head_ns.size} in "
                        f"{head_ns.lba_size}-byte blocks on this mount's paths")
            if ctrl.max_transfer < self.max_transfer:
                raise PathRefused(f"path {path.uri} refused: its controller moves at most "
                                  f"{ctrl.max_transfer} bytes per command, the mount "
                                  f"{self.max_transfer}")
        path.ids, path.stale = ids, stale
        path.ana = PathAna(reporting=ident.ana_reporting, anatt=ident.anatt)
        if path.ana.reporting:
            path.ana_log_bytes = ana_log_size(ident.nanagrpid or 1, ident.mnan or ident.nn or 1)
            if path.ana_log_bytes > ctrl.max_transfer:  # as Linux's nvme_mpath_init_identify
                limited.log(("ana off", path.index), logging.WARNING, "%s: the ANA log page "
                            "may take %d bytes, more than one command moves (%d, MDTS): ANA "
                            "reporting is off on this path", path.name, path.ana_log_bytes,
                            ctrl.max_transfer)
                path.ana = PathAna(reporting=False, anatt=ident.anatt)
        for nsid, ns in ctrl.namespaces.items():
            path.ana.set_namespace_group(nsid, ns.identify.anagrpid)
        if path.ana.reporting:
            await self._read_ana(path, ctrl)
        if first:
            self.nqn = subnqn
            self.controller_identity = ident
            self.ids = dict(ids)
            self.max_transfer = ctrl.max_transfer
            for nsid, ns in sorted(ctrl.namespaces.items()):
                self.namespaces[nsid] = self._new_namespace(nsid, ns)

    def _new_namespace(self, nsid: int, source: Namespace) -> Namespace:
        """The head's namespace ``nsid`` as path namespace ``source`` shows it, of the next
        generation of that NSID on this mount."""
        generation = self._generations[nsid] = self._generations.get(nsid, -1) + 1
        ns = Namespace(self, nsid, source.identify, generation)
        ns.identity = source.identity
        if source.conflict:
            ns.refuse_as(source.conflict)
        return ns

    # -- namespace identity -------------------------------------------------------------------

    def _path_replaced(self, path: Path, nsid: int, old: Namespace, new: Namespace) -> None:
        """``path``'s controller found ``new`` behind ``nsid`` instead of ``old`` (told at
        once: after a reconnect, before its I/O resumes)."""
        if new.identity is None:
            return
        path.ids[nsid] = new.identity
        mine = self.ids.get(nsid)
        if mine is not None and mine.change(new.identity):
            path.stale.add(nsid)
        else:
            path.stale.discard(nsid)
        self._settle(nsid)
        if nsid in path.stale:
            log.warning("%s: namespace n%d there is not the one this mount serves (%s); "
                        "it serves n%d no more while another path does", path.name, nsid,
                        new.identity.describe(), nsid)
        self._wake()

    def _settle(self, nsid: int) -> None:
        """Replace the head's namespace ``nsid`` once no connected path serves it under the
        mount's identity, but one serves another: the old one fails its I/O from then on,
        the new one (that path's) takes the NSID, and the paths that show it serve it."""
        mine, head_ns = self.ids.get(nsid), self.namespaces.get(nsid)
        if mine is None or head_ns is None:
            return
        holders = [p for p in self.paths if p.ctrl is not None and nsid in p.ids]
        if not holders or any(nsid not in p.stale for p in holders):
            return  # a path still serves the mount's namespace, or none is connected
        source = holders[0]
        assert source.ctrl is not None
        theirs = source.ids[nsid]
        shown = source.ctrl.namespaces.get(nsid)
        if shown is None:
            return
        change = mine.change(theirs)
        new = self._new_namespace(nsid, shown)
        head_ns.replace(f"namespace n{nsid} of {self.nqn} was replaced by another namespace "
                        f"({change})")
        self.namespaces[nsid] = new
        self.ids[nsid] = theirs
        self.replacements += 1
        self._replaced[nsid] = self.replacements
        for path in self.paths:
            other = path.ids.get(nsid)
            if other is not None and theirs.change(other):
                path.stale.add(nsid)
            else:
                path.stale.discard(nsid)
        self._changes.append(NamespaceChange(
            "replaced", nsid, head_ns.size, new.size,
            replaced_line(self.nqn, nsid, mine, theirs, change)))
        self._nursery.start_soon(self._tell_replaced)
        self._wake()

    async def _tell_replaced(self) -> None:
        """Hand the namespaces replaced (:meth:`_settle`) to the listeners."""
        changes, self._changes = self._changes, []
        if changes:
            self.events.events += 1
            for listener in list(self.events.listeners):
                await listener(changes)

    def _refuse_if_replaced(self, nsid: int, mark: int) -> None:
        """Raise NamespaceReplaced if the head's namespace ``nsid`` was replaced since
        :attr:`replacements` was ``mark``."""
        if self._replaced.get(nsid, 0) > mark:
            raise NamespaceReplaced(f"namespace n{nsid} of {self.nqn} was replaced by another "
                                    "namespace while this command waited for a path: it "
                                    "does not run on the other")

    def _attach(self, path: Path, ctrl: Controller, after: str = "") -> None:
        """``ctrl`` serves ``path`` now: the head's memory is registered with it (``after``:
        how long connecting failed before, for its line)."""
        for registration in self._registrations:
            registration.add(ctrl.transport)
        path.ctrl = ctrl
        if self.bounce is None:
            self.bounce = BouncePool(self._register, self.max_transfer, BOUNCE_BUFFERS,
                                     timeout=BOUNCE_WAIT_FACTOR * ctrl.options.timeout,
                                     patient=self.bounce_wait_expected, clear_reads=False)
        if not getattr(ctrl.transport, "counts_read_data", False):
            self.bounce.clear_reads = True  # a path that cannot count a read's data joined
        if ctrl.bounce is not None and not isinstance(ctrl.bounce, HeadPool):
            ctrl.bounce.close()  # the path's own buffers: the head's serve instead
        ctrl.bounce = HeadPool(lambda: self.bounce)  # type: ignore[assignment]
        if self._stopping:  # connected while the mount stops: it winds down with the rest
            ctrl.wind_down(self._stopping, self._wound_down_by)
        ctrl.events.ana_listeners.append(path.kick)
        ctrl.events.listeners.append(self._follow_namespaces)
        ctrl.events.replaced_listeners.append(
            lambda nsid, old, new: self._path_replaced(path, nsid, old, new))
        self._bind()
        words = self._ana_words(path, LIST_SHOWN)
        more = len(path.ids) - len(words)  # one line, however many the target lists
        names = ", ".join(words) + (f" and {more:,} more" if more > 0 else "")
        limited.log(("connected", path.index), logging.INFO, "%s: connected as controller "
                    "%d%s (%s)", path.name, ctrl.cntlid, after, names or "no namespaces")

    def _detach(self, path: Path, ctrl: Controller) -> None:
        path.retire(ctrl)
        path.ctrl = None
        self.selector.forget(path)
        for registration in self._registrations:
            registration.drop(ctrl.transport)
        self._bind()

    def _ana_words(self, path: Path, first: int) -> list[str]:
        """``n<nsid> <ana state>`` of the path's first namespaces."""
        words = []
        for nsid in heapq.nsmallest(first, path.ids):
            state = path.ana.state(nsid)
            words.append(f"n{nsid} {state.label if state is not None else 'ana unknown'}")
        return words

    async def _serve_path(self, path: Path, ctrl: Controller) -> None:
        """Until the path is removed or its controller gives up: follow its state and its
        ANA log; when removed, let its commands end first, for a command timeout at most,
        or as long as the mount's last seconds leave before its shutdown (:meth:`wind_down`:
        its controller's command timeout is cut to that)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_state, path, ctrl, nursery.cancel_scope)
            nursery.start_soon(self._follow_ana, path, ctrl)
            await path.removed.wait()
            with trio.move_on_after(ctrl.command_timeout()):
                while path.outstanding or ctrl.outstanding:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    async def _follow_state(self, path: Path, ctrl: Controller,
                            scope: trio.CancelScope) -> None:
        old = ctrl.state
        while True:
            new = await ctrl.next_state()
            if new != old:
                limited.log(("state", path.index), logging.INFO, "%s: %s -> %s", path.name,
                            old, new)
                if new is LIVE:
                    path.kick()  # read the ANA log after each reconnect
                old = new
            self._wake()
            if new in (DELETING, DEAD):
                scope.cancel()
                return

    async def _follow_ana(self, path: Path, ctrl: Controller) -> None:
        """Read the ANA log when kicked; poll while pending or changing; reset the
        controller when a change outlasts twice ANATT."""
        if not path.ana.reporting:
            return
        while True:
            interval = math.inf
            if path.ana.pending or path.ana.change_since is not None:
                interval = ANA_POLL_INTERVAL
            with trio.move_on_after(interval):
                await path.kicked()
            if not await ctrl.wait_connected():
                return
            await self._read_ana(path, ctrl)
            now = trio.current_time()
            if path.ana.anatt_expired(now):
                limited.log(("anatt", path.index), logging.WARNING, "%s: an ANA group stayed "
                            "in the change state past twice ANATT (%g s): resetting its "
                            "controller", path.name, path.ana.anatt)
                path.ana.change_since = None
                ctrl.connection_lost(ctrl.admin, CommandTimeout("ANA transition timeout"))

    async def _read_ana(self, path: Path, ctrl: Controller) -> None:
        try:
            page = AnaLogPage.from_bytes(await read_whole(
                ctrl, LogPageId.ANA, header=ANA_HEADER_BYTES, length=path.ana_log_bytes,
                counter=lambda head: int.from_bytes(head[:8], "little"),
                what=f"{path.name}: the ANA log page"))
        except (NVMeoFError, ValueError) as exc:
            limited.log(("ana read", path.index), logging.WARNING,
                        "%s: cannot read the ANA log page: %s", path.name, exc)
            return
        watched = set(path.ids) or set(ctrl.namespaces)
        before = {nsid: path.ana.state(nsid) for nsid in watched}
        path.ana.update(page, trio.current_time())
        if path.ctrl is not None:  # (at connect, its "connected" line names the states)
            self._log_ana_changes(path, before)
        self._wake()

    def _log_ana_changes(self, path: Path, before: dict[int, AnaState | None]) -> None:
        """A line for the namespaces whose usability on ``path`` changed (rate-limited, as
        a target may flip states thousands of times a second); other changes at debug."""
        usability: dict[tuple[bool, str, str], list[str]] = {}
        others: dict[tuple[str, str], list[str]] = {}
        for nsid in sorted(before):
            old, new = before[nsid], path.ana.state(nsid)
            if new is None or old is new:
                continue
            old_label = old.label if old is not None else "unknown"
            if (old is not None and old.usable) != new.usable:
                usability.setdefault((new.usable, old_label, new.label), []).append(f"n{nsid}")
            else:
                others.setdefault((old_label, new.label), []).append(f"n{nsid}")
        for (usable, old_label, new_label), names in usability.items():
            limited.log(("ana", path.index), logging.INFO, "%s: %s %s (ana %s -> %s)",
                        path.name, brief_list(names), "usable" if usable else "not usable",
                        old_label, new_label)
        if others and log.isEnabledFor(logging.DEBUG):
            for (old_label, new_label), names in others.items():
                log.debug("%s: %s ana %s -> %s", path.name, brief_list(names), old_label,
                          new_label)

    async def _follow_namespaces(self, changes: list[NamespaceChange]) -> None:
        """A path's controller saw namespaces change: apply them to the head's once (its
        replacements are applied already: :meth:`_settle`)."""
        applied = []
        for change in changes:
            ns = self.namespaces.get(change.nsid)
            source = next((p.ctrl.namespaces.get(change.nsid) for p in self.paths
                           if p.ctrl is not None and change.nsid in p.ctrl.namespaces), None)
            if change.kind == "added" and ns is None and source is not None:
                self.namespaces[change.nsid] = self._new_namespace(change.nsid, source)
                if source.identity is not None:
                    self.ids[change.nsid] = source.identity
                applied.append(change)
            elif change.kind == "removed" and ns is not None:
                del self.namespaces[change.nsid]
                ns.remove(f"namespace n{change.nsid} was removed from {self.nqn}")
                applied.append(change)
            elif change.kind == "resized" and ns is not None and source is not None:
                if ns.resize(source.identify) is not None:
                    applied.append(change)
                mine = self.ids.get(change.nsid)
                if source.identity is not None and (mine is None or not mine.change(
                        source.identity)):
                    self.ids[change.nsid] = ns.identity = source.identity
        if applied:
            self.events.events += 1
            for listener in list(self.events.listeners):
                await listener(applied)

    # -- what the mount shows -----------------------------------------------------------------

    def _namespace_totals(self) -> tuple[int, int]:
        ops = nbytes = 0
        for ns in self.namespaces.values():
            stats = ns.io_stats
            for st in stats.ops.values() if stats is not None else ():
                ops += st.ops
                nbytes += st.bytes
        return ops, nbytes

    def paths_snapshot(self) -> list[dict[str, Any]]:
        """``.nvmeof/paths.json``: one object per path (keys as the multipath contract)."""
        first = min(self.namespaces, default=None)
        out = []
        for path in self.paths:
            ios, nbytes = path.ios, path.bytes
            if path is self._direct:
                ops, moved = self._namespace_totals()
                ios += ops - self._baseline[0]
                nbytes += moved - self._baseline[1]
            ctrl = path.ctrl
            group, state = path.ana_summary(first)
            usable = first is not None and path.usable_state(first) is not None
            out.append({
                "index": path.index, "uri": path.uri, "transport": path.options.transport,
                "traddr": path.options.traddr, "trsvcid": path.options.trsvcid,
                "cntlid": ctrl.cntlid if ctrl is not None else None,
                "ana_group": group, "ana_state": state, "state": path.state,
                "usable": usable,
                "outstanding": ctrl.outstanding if ctrl is not None else 0,
                "ios": ios, "bytes": nbytes,
                "losses": path.losses, "reconnects": path.reconnects,
                "failovers": path.failovers, **path.device_snapshot(self.topology),
            })
        return out

    def describe(self) -> dict[str, Any]:
        ctrl = self.primary
        doc: dict[str, Any] = ctrl.describe() if ctrl is not None else {
            "subnqn": self.nqn, "namespaces": sorted(self.namespaces)}
        doc.update({"state": self.state, "iopolicy": self.policy})
        return doc

    def connection_snapshot(self) -> dict[str, Any]:
        ctrl = self.primary
        doc = ctrl.connection_snapshot() if ctrl is not None else {}
        doc.update({"state": self.state, "paths": len(self.paths),
                    "paths_usable": sum(1 for p in self.paths_snapshot() if p["usable"]),
                    "failovers": self.failovers,
                    "losses": sum(p.losses for p in self.paths),  # with one path: its
                    "reconnects": sum(p.reconnects for p in self.paths)})  # controller's
        return doc

    # -- companion clients' queues --------------------------------------------------------------

    @property
    def transport(self) -> PathsTransport:
        return PathsTransport(self._transports, self._register)

    async def lease_controller(self, prefer: tuple[str, str, int] | None = None,
                               any_transport: bool = False, *, near: MemoryPlace | None = None,
                               path: int | None = None,
                               load: Callable[[Controller], int] | None = None) -> Controller:
        """A live path whose transport lets companion clients connect queues of their own
        (``any_transport``: any live path, for a FUSE worker, which moves data through memory
        of its own), of ``prefer``'s transport (transport, traddr, trsvcid: where the
        client's queues were; they keep their transport); waits while none is;
        ControllerLost once none can be.  Among those ANA lets serve: path ``path`` if named
        and live, else the nearest ``near`` (:mod:`.nearest`; of equals where the queues
        were, then the one with the least ``load``); with neither, ``prefer`` if it is live,
        else the first."""
        while True:
            pool = self._lease_pool(prefer[0] if prefer is not None else None, any_transport)
            if pool:
                if near is None and path is None:  # as before: where its queues were
                    for each in pool[1]:
                        if _place(each) == prefer:
                            return each.ctrl  # type: ignore[return-value]
                chosen = self._chosen(pool[0], prefer, near, path, load)
                if near is not None:
                    self._advise(chosen, near)
                return chosen.ctrl  # type: ignore[return-value]
            self._check_servable()
            with trio.move_on_after(NO_PATH_WAIT):
                await self._changed.wait()

    def _lease_pool(self, transport: str | None, any_transport: bool
                    ) -> tuple[list[Path], list[Path]] | None:
        """The live paths a lease may go to (of ``transport``, when named, and unless
        ``any_transport`` only those whose clients connect queues of their own): those ANA
        lets serve (all where none does), and all of them; None while there are none."""
        leasable = [p for p in self.paths if p.ctrl is not None and p.ctrl.live
                    and (any_transport or getattr(p.ctrl.transport,
                                                  "places_in_other_processes", False))
                    and (transport is None or p.options.transport == transport)]
        if not leasable:
            return None
        first = min(self.namespaces, default=None)
        usable = [p for p in leasable if first is None or p.usable_state(first) is not None]
        return usable or leasable, leasable

    def _chosen(self, pool: list[Path], prefer: tuple[str, str, int] | None,
                near: MemoryPlace | None, index: int | None,
                load: Callable[[Controller], int] | None) -> Path:
        """Of ``pool``: path ``index`` if there, else the nearest ``near`` (where the queues
        were among equals, then the least loaded), else the first."""
        named = [p for p in pool if p.index == index]
        if named:
            return named[0]
        if near is None:
            return pool[0]
        return nearest(pool, lambda p: self.distance(p, near),
                       lambda p: (_place(p) != prefer, load(p.ctrl) if load else 0))

    def nearer_path(self, ctrl: Controller, near: MemoryPlace | None = None,
                    index: int | None = None) -> Path | None:
        """Where a client's lease on ``ctrl`` belongs now, when that is another path: the
        one it named (``index``), or one nearer its memory (``near``), live and served by
        ANA (a near path come back); None where it is best where it is."""
        current = next((p for p in self.paths if p.ctrl is ctrl), None)
        if current is None or (near is None and index is None):
            return None
        pool = self._lease_pool(current.options.transport, False)
        if pool is None:
            return None
        if index is not None:
            named = [p for p in pool[0] if p.index == index]
            return named[0] if named and named[0] is not current else None
        assert near is not None
        best = self._chosen(pool[0], _place(current), near, None, None)
        here, there = self.distance(current, near), self.distance(best, near)
        if best is current or there is None or (here is not None and here <= there):
            return None
        return best

    def distance(self, path: Path, near: MemoryPlace) -> Distance | None:
        """How far ``near`` is from ``path``'s local device; None where it cannot be told."""
        return distance(near, path.pci_device(self.topology), self.topology)

    def nearness(self, ctrl: Controller, near: MemoryPlace | None) -> dict[str, Any] | None:
        """The lease reply's ``path``: which path ``ctrl`` is, its device, and how far
        ``near`` is from it (``distance`` None: not known)."""
        path = next((p for p in self.paths if p.ctrl is ctrl), None)
        if path is None:
            return None
        device = path.local_device
        known = self.distance(path, near) if near is not None else None
        return {"index": path.index, "device": device.name if device is not None else None,
                "distance": known.name if known is not None else None,
                "memory": str(near) if near is not None else None}

    def _advise(self, path: Path, near: MemoryPlace) -> None:
        """One line, once per memory, when even its nearest path crosses the sockets (not
        while a nearer one is only down: the lease comes back to it)."""
        if self.distance(path, near) != Distance.SYS or near in self._advised:
            return
        if any((d := self.distance(p, near)) is not None and d < Distance.SYS
               for p in self.paths):
            return
        self._advised.add(near)
        log.warning("%s: its nearest path, %s via %s, is SYS to it (across the sockets), where "
                    "reads lose up to 70%%: add a path through a NIC on its socket "
                    "(--path URI?host_iface=DEVICE)", near, path.name, path.local_device)

    # -- commands (the CommandIssuer) --------------------------------------------------------

    @property
    def live(self) -> bool:
        return any(p.ctrl is not None and p.ctrl.live for p in self.paths)

    @property
    def state(self) -> str:
        states = [p.ctrl.state for p in self.paths if p.ctrl is not None]
        if LIVE in states:
            return str(LIVE)
        return str(states[0]) if states else ("dead" if self._closed else "connecting")

    def wind_down(self, why: str, deadline: float = math.inf) -> None:
        """The mount stops: a command whose connection fails from now on, or that waits for
        a path, fails (ControllerLost) instead of waiting for a reconnect, so that no
        command caught retrying keeps the unmount waiting; and every path's commands end by
        ``deadline``, before the shutdowns (:meth:`Controller.wind_down`)."""
        self._stopping, self._wound_down_by = why, deadline
        for path in self.paths:
            if path.ctrl is not None:
                path.ctrl.wind_down(why, deadline)
        self._wake()

    def shutdown_timeout(self) -> float:
        """Seconds the paths' orderly shutdowns take at most (they run side by side)."""
        return max((p.ctrl.shutdown_timeout() if p.ctrl is not None
                    else p.options.shutdown_timeout for p in self.paths), default=0.0)

    async def wait_live(self, *, fail_fast: bool = True) -> None:
        while not self.live:
            self._check_servable()
            with trio.move_on_after(NO_PATH_WAIT):
                await self._changed.wait()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def _check_servable(self) -> None:
        """Raise ControllerLost when no path can serve again: every path's controller gave
        up (or fails I/O fast meanwhile), or the head is closed."""
        if self._closed:
            raise ControllerLost(self._closed)
        if self._stopping:
            raise ControllerLost(self._stopping)
        reasons = []
        for path in self.paths:
            ctrl = path.ctrl
            if ctrl is None:
                reasons.append(f"{path.name}: not connected")
                continue
            if ctrl.state not in (DELETING, DEAD) and not ctrl.failing_io:
                return
            reasons.append(f"{path.name}: {ctrl.failing_io or ctrl.dead_reason}")
        raise ControllerLost(f"no path to {self.nqn} can serve: " + "; ".join(reasons)
                             if reasons else f"no path to {self.nqn} is left")

    def _start_none(self, sqe: bytearray, data: DataRef | None,
                    done: Callable[[Finished], None], *, to_controller: bool = False
                    ) -> Queue | None:
        """With several paths commands are not started with a callback (a failed one must
        run again elsewhere, which a task does): the caller runs it with io_command."""
        return None

    def _io_failed_none(self, queue: Queue, exc: BaseException) -> None:
        for path in self.paths:
            if path.ctrl is not None and queue in path.ctrl.io_queues:
                path.ctrl.io_failed(queue, exc)

    def _usable(self, nsid: int) -> tuple[list[Path], list[Path]]:
        """The paths that may take a command for ``nsid``: (optimized, non-optimized), worked
        out again only after something changed (:meth:`_wake`)."""
        known = self._usable_paths.get(nsid)
        if known is not None and known[0] == self._generation:
            return known[1], known[2]
        optimized, fallback = [], []
        for path in self.paths:
            state = path.usable_state(nsid)
            if state is AnaState.OPTIMIZED:
                optimized.append(path)
            elif state is not None:
                fallback.append(path)
        self._usable_paths[nsid] = (self._generation, optimized, fallback)
        return optimized, fallback

    def _choose(self, nsid: int, skip: set[int]) -> Path | None:
        optimized, fallback = self._usable(nsid)
        if skip:
            optimized = [p for p in optimized if p.index not in skip]
            fallback = [p for p in fallback if p.index not in skip]
        path = self.selector.pick(optimized, fallback, _outstanding)
        if path is not None and (path.ctrl is None or not path.ctrl.live):
            self._wake()  # its controller changed state just now: look again
            return self._choose(nsid, skip)
        return path

    async def _io_multipath(self, sqe: bytearray, data: DataRef | None = None, *,
                            to_controller: bool = False) -> Completion:
        """Run an NVM command on the path the policy picks; fail it over at once on a path
        error, a lost connection or a timeout (see the module's docstring)."""
        nsid = int.from_bytes(sqe[4:8], "little")
        nbytes = data.length if data is not None else 0
        mark = self.replacements  # a namespace replaced while this waits: not on the other
        skip: set[int] = set()  # paths that failed this command with a path status
        tries = 1  # status retries, timeouts and lost connections, as Controller.io_command
        failovers = 0
        waited_since: float | None = None
        last: Completion | None = None
        while True:
            if self.replacements != mark:
                self._refuse_if_replaced(nsid, mark)
            path = self._choose(nsid, skip)
            if path is None:
                if skip:  # every usable path answered with a path status: try them again
                    skip.clear()
                    tries += 1
                    if tries > IO_RETRIES and last is not None:
                        break
                    with trio.move_on_after(NO_PATH_WAIT):
                        await self._changed.wait()
                    continue
                waited_since = await self._wait_for_path(nsid, waited_since)
                continue
            waited_since = None
            ctrl = path.ctrl
            assert ctrl is not None
            path.outstanding += 1
            try:
                completion = await ctrl.io_once(sqe, data, to_controller=to_controller)
            except (TransportError, CommandTimeout) as exc:
                path.outstanding -= 1
                path.failovers += 1
                self.failovers += 1
                failovers += 1
                self.selector.forget(path)
                log.debug("%s: command failed (%s): failing over", path.name, exc)
                if isinstance(exc, CommandTimeout) or exc.sent:
                    # Counted across paths: a command that breaks each connection it goes
                    # on (a target's protocol violation) must not take every path down in turn.
                    tries += 1
                    if tries > IO_RETRIES:
                        if isinstance(exc, CommandTimeout):
                            raise
                        raise out_of_tries(sqe, tries - 1, exc) from None
                if self._stopping:
                    raise ControllerLost(f"{self._stopping} ({exc})") from None
                continue
            path.outstanding -= 1
            if completion.ok:
                path.ios += 1
                path.bytes += nbytes
                return completion
            last = completion
            if fails_over(completion.sct, completion.sc, completion.dnr):
                if is_ana_error(completion.sct, completion.sc):
                    path.ana.mark_pending()
                    path.kick()
                    self._wake()
                path.failovers += 1
                self.failovers += 1
                failovers += 1
                skip.add(path.index)
                self.selector.forget(path)
                if failovers > IO_RETRIES * max(1, len(self.paths)):
                    break
                continue
            if completion.dnr or tries >= IO_RETRIES:
                break
            tries += 1
            delay = ctrl.retry_delay(completion.crd)
            if delay:
                await trio.sleep(delay)
        assert last is not None
        last.raise_for_status(nvme.command.command_name(sqe, admin=False))
        return last  # not reached

    async def _wait_for_path(self, nsid: int, since: float | None) -> float | None:
        """No path can take a command for ``nsid`` now: wait for a change, as the kernel
        requeues while a path may come back; ControllerLost once none can, or no live path
        became usable within the longest ``--ctrl-loss-tmo``.  When the wait began."""
        self._check_servable()
        now = trio.current_time()
        if not self.live:  # the controllers bound this wait themselves (--ctrl-loss-tmo)
            since = None
        since = now if since is None else since
        limits = [p.options.ctrl_loss_tmo for p in self.paths]
        limit = math.inf if not limits or min(limits) < 0 else max(limits)
        if now - since > limit:
            states = "; ".join(
                f"{p.name}: {p.state}, ana {p.ana_summary(nsid)[1] or 'unknown'}"
                for p in self.paths)
            raise ControllerLost(f"no usable path to namespace {nsid} of {self.nqn} for "
                                 f"{now - since:.0f} s ({states})")
        with trio.move_on_after(NO_PATH_WAIT):
            await self._changed.wait()
        return since

    # -- memory --------------------------------------------------------------------------------

    def _transports(self) -> list[Any]:
        return [p.ctrl.transport for p in self.paths if p.ctrl is not None]

    def _register(self, addr: int, length: int, owner: object) -> PathsRegistration:
        """Register memory with every path's transport, now and as paths join."""
        registration = PathsRegistration(addr, length, owner, self._transports())
        self._registrations.append(registration)
        return registration

    def register_raw(self, addr: int, length: int, owner: object) -> PathsRegistration:
        """:meth:`_register` for callers that keep the registration (companion sessions)."""
        return self._register(addr, length, owner)

    def register(self, obj: Any) -> Region:
        """Register caller memory on every path (numpy array, host tensor, buffer)."""
        addr, length, owner = buffer_address(obj)
        if length == 0:
            raise InvalidArgument("cannot register an empty buffer")
        region = Region(addr, length, self._register(addr, length, owner), owner)
        self._regions.append(region)
        return region

    def unregister(self, region: Region) -> None:
        if region in self._regions:
            self._regions.remove(region)
        registration = region.registration
        if registration in self._registrations:
            self._registrations.remove(registration)  # type: ignore[arg-type]
        region.close()

    def allocate(self, length: int) -> Region:
        """Registered, page-aligned host memory, reachable on every path."""
        region = host_buffer(self._register, length)
        self._regions.append(region)
        return region

    @contextlib.asynccontextmanager
    async def scratch(self, length: int) -> AsyncIterator[DataRef]:
        """A registered buffer for small command payloads, reachable on every path."""
        async with self._scratch_lock:
            if self._scratch is None:
                self._scratch = host_buffer(self._register, SCRATCH_BYTES)
            assert self._scratch.view is not None
            ref = self._scratch.ref(0, length)
            self._scratch.view[:length] = bytes(length)
            yield ref

    def bounce_wait_expected(self) -> bool:
        """Whether a wait for a bounce buffer may go on: while any path is reconnecting or
        only just live (see Controller.bounce_wait_expected)."""
        return any(p.ctrl is None or p.ctrl.bounce_wait_expected() for p in self.paths)

    def close(self, why: str) -> None:
        self._closed = why
        self._wake()

    def release(self) -> None:
        for region in self._regions:
            region.close()
        self._regions.clear()
        if self.bounce is not None:
            self.bounce.close()
        if self._scratch is not None:
            self._scratch.close()
        for registration in self._registrations:
            registration.close()
        self._registrations.clear()


def _outstanding(path: Path) -> int:
    return path.outstanding


def _place(path: Path) -> tuple[str, str, int]:
    """Where a path's controller is, as a lease remembers it: transport, address, port."""
    return (path.options.transport, path.options.traddr, path.options.trsvcid)


def _same_place(text: str, path: Path) -> bool:
    """Whether ``text`` (a URI) names ``path``'s transport, address, port and subsystem."""
    try:
        uri = parse_uri(text)
    except InvalidArgument:
        return False
    port = uri.trsvcid if uri.trsvcid is not None else DEFAULT_PORT
    return (uri.transport, uri.traddr, port, uri.subnqn) == (
        path.options.transport, path.options.traddr, path.options.trsvcid, path.options.nqn)


@contextlib.asynccontextmanager
async def connect(paths: list[ConnectOptions], *, policy: str = DEFAULT_POLICY,
                  connect_path: Connect | None = None,
                  topology: Topology | None = None) -> AsyncIterator[MultipathController]:
    """Connect the paths (the first one first: it sets the subsystem and namespaces) and
    yield the head; on exit every path's controller shuts down and the memory is freed.

    The first path must connect; a further one that cannot be reached joins anyway and is
    connected in the background.  A refused path fails the whole connect, in one line.
    """
    if not paths:
        raise InvalidArgument("a mount needs at least one path")
    for options in paths:
        options.validate()
    head = None
    try:
        with unwrap_groups():
            async with trio.open_nursery() as nursery:
                head = MultipathController(nursery, policy=policy, connect=connect_path,
                                           topology=topology)
                head.topology  # noqa: B018 - read now: where it cannot be, one line says so
                try:
                    for i, options in enumerate(paths):
                        await head.add_path(options, must_connect=i == 0)
                    yield head
                finally:
                    head.close(f"the mount of {head.nqn or paths[0].nqn} is closed")
                    for path in list(head.paths):
                        head._remove(path)
    finally:
        if head is not None:
            head.release()
