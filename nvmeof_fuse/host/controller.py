"""A controller on trio: connect, enable, identify, I/O queues, keep-alive, reconnect, shutdown.

Follows the kernel's ``drivers/nvme/host`` flow: the fabrics Connect on the
admin queue, CC.EN then CSTS.RDY within CAP.TO, Identify, Set Features Number
of Queues, one fabrics Connect per I/O queue, and at the end CC.SHN, CSTS.SHST,
then the transport teardown.  Everything runs inside :func:`connect`'s nursery
and is released when it exits, also after errors and cancellation.

When the connection is lost (a failed work request, a command or keep-alive
timeout), the queues are torn down and rebuilt every ``reconnect_delay`` seconds
for up to ``ctrl_loss_tmo`` seconds, as the kernel's fabrics code does.  I/O
waits meanwhile and is retried on the new queues; registered memory stays valid.
Before it resumes, the controller reached again must be of the subsystem we
mounted, and every namespace is looked at again: one whose identity changed is
replaced, and nothing that waited for the old one goes to the new one
(:mod:`.identity`).

Why one module: a controller's life is one state table (:mod:`.state`), and each step of
it (connect, enable, the queues, keep-alive, reconnect, shutdown) acts on the same queues,
nursery and state; what needs none of that lives apart (options, auth, events, the
reconnect policy, memory).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio

from .. import nvme
from ..concurrency import unwrap_groups
from ..errors import (
    CommandTimeout,
    ConnectError,
    ControllerLost,
    InvalidArgument,
    NamespaceReplaced,
    NVMeoFError,
    TargetProtocolError,
    TransportError,
    unavailable_line,
)
from ..nvme import Cns, Completion, FeatureId, NVMeStatusError, Property
from ..nvme import command as cmd
from ..nvme.status import SCT_PATH
from ..ratelimit import FailureStreak, RateLimitedLog
from ..transport import registry
from ..transport.base import Finished, Queue, Transport
from ..transport.overdue import OverdueWatch
from . import auth, keyring
from .connect_options import DEFAULT_COMPANION_QUEUES, ConnectOptions  # noqa: F401 (API)
from .events import (
    IDENTIFY_IN_FLIGHT,
    AsyncEvents,
    active_nsids,
    claim_identities,
    identify_namespaces,
)
from .hostid import host_identity
from .identity import check_controller
from .memory import BouncePool, DataRef, Region, buffer_address, host_buffer
from .namespace import Namespace
from .namespace.sharedranges import SharedRanges
from .reconnect_policy import final_failure
from .state import CONNECTING, DEAD, DELETING, LIVE, RESETTING, CtrlState, StateMachine

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
"""Lines a target can make us write again and again (losses, failed commands)."""

ADMIN_QUEUE_SIZE = 32  # NVME_AQ_DEPTH
MAX_DEFAULT_IO_QUEUES = 8
SPREAD_BYTES = 64 * 1024
"""Commands moving this much or more spread over the I/O queues (see pick_queue)."""
BOUNCE_CHUNK_MAX = 1 << 20
BOUNCE_BUFFERS = 32
SCRATCH_BYTES = 8192
IDENTIFY_BYTES = 4096
IO_RETRIES = 5
"""nvme_max_retries: tries of a command that fails with a status, times out, or was in
flight when its connection failed."""
PROBE_LOOKS = 4
"""Looks for an overdue command per the transport's ``probe_after``."""
PROBES_IN_FLIGHT = 2
"""The most probes unanswered at once: a slow target answers them late, and they must not
pile up on the admin queue; more than one, as a fresh SEND is what notices a target that
acknowledged the one before and then went away."""
RETRY_DELAY_MAX = 10.0
"""Seconds: the longest Command Retry Delay honoured, were retry delays enabled (ACRE)."""
LOG_PAGE_MAX = 4 << 20
"""Bytes: the most of one log page read; a longer one is refused (TargetProtocolError)."""
BOUNCE_WAIT_FACTOR = 2
"""A wait for a bounce buffer ends in an error after this many command timeouts of the
controller being live (the buffers' commands end within one)."""
SHUTDOWN_TIMEOUT_CAP = 10.0
"""Seconds: the most RTD3E raises the shutdown wait to (Linux allows 60), so that an
unmount, SIGTERM or SIGINT ends the daemon within 15 s whatever the target does."""
LEAST_COMMAND_TIMEOUT = 0.01
"""Seconds: a command's timeout when a bound on its wait has (almost) passed."""
TEARDOWN_WAIT_LEAST = 1.0
"""Seconds a failed command waits for its connection's teardown at least, even past a
deadline: the teardown is our own work (closing the queues), never the target's, and the
caller may not have its memory back before it."""
BACKSTOP_GRACE = 0.25
"""Seconds the cancel scope of a bounded bring-up or shutdown waits past its deadline:
waits with a timeout of their own that ends at the deadline fail first, naming their step
(no ICResp, a command's timeout); the scope cuts only those that would go on past it."""
__all__ = ["CONNECTING", "DEAD", "LIVE", "ConnectOptions", "Controller", "connect"]


def reconnect_attempts(ctrl_loss_tmo: float, reconnect_delay: float) -> float:
    """How many reconnects to try (the kernel's max_reconnects); ``inf`` for -1."""
    if ctrl_loss_tmo < 0:
        return math.inf
    return math.ceil(ctrl_loss_tmo / reconnect_delay)


def shutdown_wait(shutdown_timeout: float, rtd3e_us: int) -> float:
    """Seconds an orderly shutdown waits for CSTS.SHST: ``shutdown_timeout`` (the option),
    raised to the controller's RTD3 Entry Latency where it states a longer one, up to
    :data:`SHUTDOWN_TIMEOUT_CAP` (Linux's ``nvme_init_identify``: the same, up to 60 s)."""
    if not rtd3e_us:
        return shutdown_timeout
    return max(shutdown_timeout, min(rtd3e_us / 1e6, SHUTDOWN_TIMEOUT_CAP))


def give_up_time(lost_at: float, ctrl_loss_tmo: float) -> float:
    """When reconnecting stops after an outage that began at ``lost_at`` (``inf``: never)."""
    return math.inf if ctrl_loss_tmo < 0 else lost_at + ctrl_loss_tmo


def try_deadline(start: float, give_up_at: float, connect_timeout: float) -> float:
    """When a reconnect try begun at ``start`` must be done: the give-up time, but never
    less than one connect timeout, so that a try begun just before it has a fair chance
    and the last one ends within ``--ctrl-loss-tmo`` plus one connect timeout."""
    return max(give_up_at, start + connect_timeout)


def out_of_tries(sqe: bytearray, tries: int, failure: BaseException) -> TransportError:
    """The error of a command whose connection failed under each of its ``tries``
    (``failure``: the last), logged once: it names the target's fault."""
    name = nvme.command.command_name(sqe, admin=False)
    error = TransportError(f"{name} failed: its connection failed under each of its {tries} "
                           f"tries (the last: {failure})")
    limited.log("out of tries", logging.ERROR, "%s", error)
    return error


def make_transport(options: ConnectOptions) -> Transport:
    """The transport ``options`` name, looked up by name (the host names none itself)."""
    tls = None
    if options.uses_tls:
        hostnqn = host_identity(options.hostnqn, options.hostid).hostnqn
        options.tls_psk(hostnqn)  # checked now; looked up again at each connection

        def tls():
            return options.tls_psk(hostnqn)

    return registry.create(options.transport, options.traddr, options.trsvcid,
                           options.host_traddr, connect_timeout=options.connect_timeout,
                           hdr_digest=options.hdr_digest, data_digest=options.data_digest,
                           host_iface=options.host_iface, tls=tls)


class Controller:
    """A connected, enabled controller with its admin and I/O queues and namespaces."""

    starts_io = True
    """Its namespaces can start I/O answered by a callback (:meth:`start_io`)."""

    def __init__(self, options: ConnectOptions, transport: Transport,
                 nursery: trio.Nursery) -> None:
        self.options = options
        self.transport = transport
        self._nursery = nursery
        self.identity = host_identity(options.hostnqn, options.hostid)
        self.dhchap = self._load_dhchap()
        self.admin: Queue | None = None
        self.io_queues: list[Queue] = []
        self.cntlid = 0
        self.cap: nvme.Capabilities | None = None
        self.version = ""
        self.identify: nvme.IdentifyController | None = None
        self.namespaces: dict[int, Namespace] = {}
        self.shared_ranges: SharedRanges | None = None
        """The mount's range locks across its processes (FUSE workers), which its
        namespaces' writes take (:func:`~.namespace.sharedranges.share_range_locks`)."""
        self.max_transfer = BOUNCE_CHUNK_MAX
        self.acre = False
        """Host Behavior Support ACRE: whether the controller may ask for Command Retry
        Delays.  We never enable it, so a status's CRD is ignored (retry_delay)."""
        self.bounce: BouncePool | None = None
        self._scratch: Region | None = None
        self._scratch_lock = trio.Lock()
        self._identify_buffers: Region | None = None
        self._identify_free = list(range(IDENTIFY_IN_FLIGHT))  # slots of 4 KiB in it
        self._identify_slot = trio.Semaphore(IDENTIFY_IN_FLIGHT)
        self.refused_namespaces: tuple[int, str] | None = None
        """``--max-namespaces`` and the namespaces listed, while more are (said once by
        events.say_refused)."""
        self._regions: list[Region] = []
        self._next_queue = 0
        self.lease_qids: list[int] = []
        """I/O queue IDs granted by the target beyond our own: companion clients lease them."""
        self.in_capsule_bytes = 0
        self._cc = 0
        self._states = StateMachine()
        self._lost = trio.Event()  # set by connection_lost: supervise() recovers
        self._lost_reason = ""
        self._dead_reason = ""
        self._failing_io = ""  # set while I/O fails fast during a reconnect
        self._stopping = ""  # set once commands whose connection fails are not run again
        self.events = AsyncEvents(self, self.new_namespace)  # AERs and rescans, once live
        self.losses = 0  # connections lost
        self.reconnects = 0  # of them, regained
        self.teardowns = 0
        """Times the queues were torn down: a command sent before the n-th teardown, that
        is while this was below n, can no longer be reached by the target after it."""
        self._live_since = 0.0  # trio time of the last change to live
        self._outage_since = 0.0
        """When the connection was lost and did not hold since (see :meth:`_outage_start`)."""
        self._deadline = math.inf
        """Trio time by which a reconnect try, the shutdown (:meth:`_waits_until`) or, once
        the mount stops, everything before the shutdown (:meth:`wind_down`) must be done:
        the timeouts of the commands sent meanwhile are cut to it."""
        self._wound_down_by = math.inf  # the mount's deadline, once it stops (wind_down)
        self.shutdown_note = ""
        """What the orderly shutdown skipped ('' if nothing), for the mount's last line."""
        self._keep_alive_failing = FailureStreak(log)  # Keep Alives answered with an error
        self._reconnects_failing = FailureStreak(log)  # reconnects of one outage that failed
        self.replacements = 0
        """Namespaces replaced by another behind their NSID (:meth:`namespace_replaced`)."""
        self._replaced: dict[int, tuple[int, int]] = {}
        """nsid -> (:attr:`replacements`, :attr:`teardowns`) at its last replacement."""
        self._generations: dict[int, int] = {}  # nsid -> the last namespace's generation
        self._checking = False  # a reconnect's identity check is under way (keep-alives go on)

    # -- commands -------------------------------------------------------------------------------

    async def admin_command(self, sqe: bytearray, data: DataRef | None = None, *,
                            to_controller: bool = False, fabrics: bool = False) -> Completion:
        """Run an admin command; a non-zero status raises :class:`NVMeStatusError`."""
        if self.admin is None:
            raise TransportError(f"the admin queue to {self.options.nqn} is not connected "
                                 f"(the controller is {self.state})")
        completion = await self.admin.execute(sqe, data, to_controller=to_controller,
                                              timeout=self.command_timeout())
        if not completion.ok:
            completion.raise_for_status(nvme.command.command_name(sqe, admin=True),
                                        fabrics=fabrics)
        return completion

    def command_timeout(self, limit: float | None = None) -> float:
        """A command's timeout: ``limit`` (default: the command timeout), cut to what is
        left of a reconnect try, the shutdown (:meth:`_waits_until`) or the mount's last
        seconds (:meth:`wind_down`).  Commands cannot be cancelled (the target may still
        move their data): their timeouts are what bounds them."""
        timeout = self.options.timeout if limit is None else limit
        if self._deadline != math.inf:  # (to 10 ms: the messages that name it stay short)
            timeout = max(min(timeout, round(self._deadline - trio.current_time(), 2)),
                          LEAST_COMMAND_TIMEOUT)
        return timeout

    @contextlib.contextmanager
    def _waits_until(self, deadline: float):
        """Every wait inside ends by ``deadline`` (trio time): the transport's by the cancel
        scope yielded, commands by their timeouts, cut to it (:meth:`command_timeout`).
        The caller looks at ``cancelled_caught``; a command cut short raises CommandTimeout.
        Afterwards the mount's deadline holds again, if it stops (:meth:`wind_down`)."""
        self._deadline = deadline
        try:
            with trio.CancelScope(deadline=deadline + BACKSTOP_GRACE) as scope:
                yield scope
        finally:
            self._deadline = self._wound_down_by

    def pick_queue(self, nbytes: int = 0) -> Queue:
        """The I/O queue for a command moving ``nbytes``.

        A small one goes to the first queue with a free slot, so that one reaper takes a
        burst of their completions in one pass (spread over queues, small reads cost more
        CPU per request).  A large one (``SPREAD_BYTES`` and up) goes to the queue with the
        most free slots (round-robin among equals), so that the target moves the data of
        several at once (docs/performance-history.md has the measurements).
        """
        queues = self.io_queues
        if len(queues) == 1:
            return queues[0]
        if nbytes < SPREAD_BYTES:
            for queue in queues:
                if queue.available:
                    return queue
        self._next_queue = (self._next_queue + 1) % len(queues)
        best = queues[self._next_queue]
        most = best.available
        for queue in queues:
            free = queue.available
            if free > most:
                best, most = queue, free
        return best

    async def io_command(self, sqe: bytearray, data: DataRef | None = None, *,
                         to_controller: bool = False) -> Completion:
        """Run an NVM command on the least busy I/O queue (waits when all are full).

        A command that fails runs again as the kernel decides (:meth:`_run_again`): after
        the reconnect, if its connection was lost.  It returns or raises only once the
        target can no longer move its data: ``data`` is the caller's again.
        """
        if self._states.current is not LIVE:  # not the property: this is the hot path
            await self._wait_live_for(sqe)
        queue = self.pick_queue(data.length if data is not None else 0)
        sent_in = self.teardowns
        try:
            completion = await queue.execute(
                sqe, data, to_controller=to_controller, timeout=self.options.timeout
                if self._deadline == math.inf else self.command_timeout())
        except (TransportError, CommandTimeout) as exc:
            completion = await self._run_again(queue, sent_in, exc, sqe, data, to_controller)
        else:
            if not completion.ok:
                completion = await self._run_again(queue, sent_in, completion, sqe, data,
                                                   to_controller)
        if not completion.ok:  # name the command only when it failed: this is the hot path
            completion.raise_for_status(nvme.command.command_name(sqe, admin=False))
        return completion

    async def _wait_live_for(self, sqe: bytearray) -> None:
        """:meth:`wait_live` for a command its namespace let through before the wait: it
        fails (NamespaceReplaced) if that namespace was replaced meanwhile (the rescan
        before a reconnect's I/O resumes found another behind its NSID)."""
        mark = self.replacements
        await self.wait_live()
        if self.replacements != mark:
            self._refuse_if_replaced(sqe, lambda at: at[0] > mark)

    def _refuse_if_replaced(self, sqe: bytearray, since: Callable[[tuple[int, int]], bool]
                            ) -> None:
        """Raise NamespaceReplaced if the namespace of ``sqe`` was replaced ``since`` (a
        test of its (replacements, teardowns) at that replacement)."""
        nsid = int.from_bytes(sqe[4:8], "little")
        at = self._replaced.get(nsid)
        if at is not None and since(at):
            raise NamespaceReplaced(f"namespace n{nsid} of {self.options.nqn} was replaced "
                                    "by another namespace while this command waited to run "
                                    "again: it does not run on the other")

    async def io_once(self, sqe: bytearray, data: DataRef | None = None, *,
                      to_controller: bool = False) -> Completion:
        """One try of an NVM command on this controller, for a multipath head that runs it
        again elsewhere: its completion, whatever the status.  A lost connection or a
        timeout raises, once the queues it went on are torn down (the reconnect that
        follows does that first): the target can no longer move ``data`` then."""
        queue = self.pick_queue(data.length if data is not None else 0)
        sent_in = self.teardowns
        try:
            return await queue.execute(sqe, data, to_controller=to_controller,
                                       timeout=self.command_timeout())
        except (TransportError, CommandTimeout) as exc:
            self.connection_lost(queue, exc)
            await self._torn_down(sent_in)
            raise

    @property
    def outstanding(self) -> int:
        """Commands in flight on the I/O queues."""
        return sum(queue.size - 1 - queue.available for queue in self.io_queues)

    def start_io(self, sqe: bytearray, data: DataRef | None,
                 done: Callable[[Finished], None], *, to_controller: bool = False
                 ) -> Queue | None:
        """:meth:`io_command` without a task waiting, where the queue it picks takes the
        command at once (:meth:`Queue.start`): ``done`` is told its end, and must not raise;
        returns that queue.  None, with nothing sent, otherwise (or while not live).  A
        command that fails here is not retried: its caller tells :meth:`io_failed` and runs
        it again with :meth:`io_command`."""
        if self._states.current is not LIVE:
            return None
        queue = self.pick_queue(data.length if data is not None else 0)
        if queue.start(sqe, data, done, to_controller=to_controller,
                       timeout=self.options.timeout if self._deadline == math.inf
                       else self.command_timeout()):
            return queue
        return None

    def io_failed(self, queue: Queue, exc: BaseException) -> None:
        """A command :meth:`start_io` sent on ``queue`` failed with it: reconnect now, so
        that running it again waits for the new connection."""
        self.connection_lost(queue, exc)

    @property
    def failing_io(self) -> str:
        """Why I/O fails fast while reconnecting (``--fast-io-fail-tmo``); '' if it does not."""
        return self._failing_io

    @property
    def dead_reason(self) -> str:
        """Why the controller is gone for good ('' while it is not)."""
        return self._dead_reason

    @property
    def live(self) -> bool:
        """Whether commands run now (else :meth:`wait_live` waits, or says why not)."""
        return self._states.current is LIVE

    async def _run_again(self, queue: Queue, sent_in: int,
                         failure: Completion | TransportError | CommandTimeout,
                         sqe: bytearray, data: DataRef | None, to_controller: bool
                         ) -> Completion:
        """Run a failed command again until it succeeds or may not, as the kernel's
        ``nvme_decide_disposition``; its last completion, or the error that ended it.

        ``failure`` is its completion with an error status, or the error its queue failed
        with; ``sent_in`` is :attr:`teardowns` when it was sent.

        - Its connection was lost under it (TransportError) or it timed out
          (CommandTimeout), which also costs the connection: once reconnected, up to
          ``IO_RETRIES`` tries (``nvme_max_retries``: the kernel counts a command aborted
          with its connection too), so that a command that breaks the connection each time
          (a target's protocol violation) ends in EIO.  A command that never went out (its
          queue had failed before) costs no try.  ``--ctrl-loss-tmo`` or
          ``--fast-io-fail-tmo`` end it sooner (ControllerLost).
        - A status with Do Not Retry is final.  Any other is tried again, up to
          ``IO_RETRIES`` tries: once reconnected if the controller is no longer live (its
          connection is going away), after ``reconnect_delay`` (or a change of state) for
          a Path Related Status, else after the Command Retry Delay it asks for.

        Before it gives up after a lost connection, that connection is torn down: the
        target can no longer move the command's data.
        """
        tries = 1
        nbytes = data.length if data is not None else 0
        first_sent = sent_in
        while True:
            if isinstance(failure, Completion):
                if failure.dnr or tries >= IO_RETRIES:
                    return failure
                await self._before_status_retry(failure)
                tries += 1
            else:
                self.connection_lost(queue, failure)
                await self._torn_down(sent_in)
                if isinstance(failure, CommandTimeout):
                    if tries >= IO_RETRIES:
                        raise failure
                    tries += 1
                elif failure.sent:
                    if tries >= IO_RETRIES:
                        raise out_of_tries(sqe, tries, failure) from None
                    tries += 1
            try:
                await self.wait_live()
            except ControllerLost as lost:
                if not self._stopping or str(lost) != self._stopping:
                    raise
                # the mount stops: say what the command met
                if isinstance(failure, Completion):
                    cause = failure.status_name()
                elif self._lost_reason:  # (its own failure may be only the teardown's)
                    cause = f"the connection was lost: {self._lost_reason}"
                else:
                    cause = str(failure)
                raise ControllerLost(f"{lost} ({cause})") from None
            if self._replaced:  # replaced by a reconnect since it was first sent: not here
                self._refuse_if_replaced(sqe, lambda at: at[1] > first_sent)
            queue = self.pick_queue(nbytes)
            sent_in = self.teardowns
            try:
                completion = await queue.execute(sqe, data, to_controller=to_controller,
                                                 timeout=self.command_timeout())
            except (TransportError, CommandTimeout) as exc:
                failure = exc
                continue
            if completion.ok:
                return completion
            failure = completion

    async def _before_status_retry(self, completion: Completion) -> None:
        """Wait before a command that failed with ``completion``'s status runs again."""
        if self._states.current is not LIVE:
            return  # going away: it runs again once reconnected (wait_live)
        if completion.sct == SCT_PATH:  # the path may be going away: give that time to show
            with trio.move_on_after(self.options.reconnect_delay):
                await self._states.wait_changed()
            return
        delay = self.retry_delay(completion.crd)
        if delay:
            await trio.sleep(delay)

    def retry_delay(self, crd: int) -> float:
        """Seconds of Command Retry Delay ``crd`` (1-3: Identify's CRDT1-3; 0: none).

        Always 0 today: a controller may ask for delays only once the host enabled them
        (ACRE in Host Behavior Support), which we never do (:attr:`acre`); were it enabled,
        they would still be capped at :data:`RETRY_DELAY_MAX`."""
        if not crd or not self.acre or self.identify is None:
            return 0.0
        return min(self.identify.crdt[crd - 1] / 10, RETRY_DELAY_MAX)

    async def _torn_down(self, sent_in: int) -> None:
        """Wait until the queues of :attr:`teardowns` ``sent_in`` are torn down (the reconnect
        that follows a loss does that first), or the controller is closed; shielded, since
        the caller must not reuse the command's memory before, and bounded."""
        limit = max(self.command_timeout(), TEARDOWN_WAIT_LEAST)
        with trio.CancelScope(shield=True), trio.move_on_after(limit) as scope:
            while self.teardowns <= sent_in and self.state not in (DELETING, DEAD):
                await self._states.wait_changed()
        if scope.cancelled_caught:
            limited.log("teardown", logging.WARNING, "the queues of a lost connection were "
                        "not torn down within %g s", limit)

    # -- losing and regaining the connection ---------------------------------------------------

    @property
    def state(self) -> CtrlState:
        return self._states.current

    def _change_state(self, new: CtrlState) -> bool:
        """The one place states change; False (and nothing changes) if not allowed."""
        old = self.state
        if not self._states.change(new):
            log.debug("controller %s: no change from %s to %s", self.options.nqn, old, new)
            return False
        if new is LIVE:
            self._live_since = trio.current_time()
        return True

    def bounce_wait_expected(self) -> bool:
        """Whether a wait for a bounce buffer may go on (:class:`BouncePool`'s ``patient``):
        while reconnecting, and until live for a command timeout; then every buffer's
        command has ended or failed, and a caller still waiting is a bug."""
        return (self._states.current is not LIVE
                or trio.current_time() - self._live_since < self.options.timeout)

    def new_bounce_pool(self, chunk: int, count: int) -> BouncePool:
        """The bounce buffers of this controller's namespaces (see :class:`BouncePool`)."""
        return BouncePool(self.transport.register, chunk, count,
                          timeout=BOUNCE_WAIT_FACTOR * self.options.timeout,
                          patient=self.bounce_wait_expected,
                          clear_reads=not getattr(self.transport, "counts_read_data", False))

    async def next_state(self) -> str:
        """Wait for the next change of state; the new state."""
        await self._states.wait_changed()
        return self.state

    async def wait_live(self, *, fail_fast: bool = True) -> None:
        """Return once the controller is live; raise ControllerLost once it never will be.

        With ``fail_fast`` (I/O), also while ``--fast-io-fail-tmo`` fails I/O.
        """
        while self.state is not LIVE:
            if self.state in (DELETING, DEAD):
                raise ControllerLost(self._dead_reason)
            if fail_fast and (self._failing_io or self._stopping):
                raise ControllerLost(self._failing_io or self._stopping)
            await self._states.wait_changed()

    def wind_down(self, why: str, deadline: float = math.inf) -> None:
        """The mount stops, and what it still does before the orderly shutdown (the drain,
        the final flush) must be done by ``deadline`` (trio time).

        I/O that waits for a reconnect fails now (ControllerLost(why)), so that no command
        caught retrying keeps the unmount waiting; commands on a live connection still run
        (the final flush), but the timeouts of those sent from now on, and of the I/O
        commands in flight, are cut to ``deadline`` (:meth:`command_timeout`), as a
        reconnect try's are to its own.  The shutdown keeps its own
        :meth:`shutdown_timeout` after it."""
        self._stopping = why
        self._wound_down_by = deadline
        self._deadline = min(self._deadline, deadline)
        for queue in self.io_queues:
            queue.cut_timeouts(deadline)
        self._states.wake()

    async def wait_connected(self) -> bool:
        """Wait until live (True) or gone for good (False); --fast-io-fail-tmo aside."""
        while self.state is not LIVE:
            if self.state in (DELETING, DEAD):
                return False
            await self._states.wait_changed()
        return True

    async def wait_changed(self) -> None:
        """Return at the next change of state (or wake-up of waiters)."""
        await self._states.wait_changed()

    def connection_lost(self, queue: Queue | None, exc: BaseException) -> None:
        """``queue`` failed with ``exc``: have :meth:`supervise` reconnect (once per loss)."""
        if self.state is not LIVE or (queue is not self.admin and queue not in self.io_queues):
            return  # an older connection's failure, or one already being handled
        if not self._change_state(RESETTING):
            return
        self.losses += 1
        opts = self.options
        where = f"{opts.nqn} at {self.transport.address}"
        if opts.ctrl_loss_tmo == 0:
            limited.log(("lost", where), logging.ERROR, "lost the connection to %s: %s",
                        where, exc)
        else:
            limit = "ever" if opts.ctrl_loss_tmo < 0 else f"up to {opts.ctrl_loss_tmo:g} s"
            limited.log(("lost", where), logging.ERROR, "lost the connection to %s: %s; "
                        "reconnecting every %g s for %s", where, exc, opts.reconnect_delay,
                        limit)
        self._lost_reason = str(exc)
        self._lost.set()

    async def supervise(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Recover from each loss of the connection; runs as long as the controller."""
        task_status.started()
        while True:
            await self._lost.wait()
            self._lost = trio.Event()
            await self._recover(self._lost_reason)

    async def _recover(self, reason: str) -> None:
        """Reconnect; with --fast-io-fail-tmo, a timer that ends with the recovery."""
        opts = self.options
        async with trio.open_nursery() as timers:
            if opts.fast_io_fail_tmo >= 0 and opts.ctrl_loss_tmo != 0:
                timers.start_soon(self._fail_io_after, opts.fast_io_fail_tmo, reason)
            await self._reconnect(reason)
            timers.cancel_scope.cancel()

    async def _fail_io_after(self, delay: float, reason: str) -> None:
        """--fast-io-fail-tmo: from ``delay`` s after the loss, I/O fails until reconnected."""
        await trio.sleep(delay)
        if self.state in (RESETTING, CONNECTING):
            self._failing_io = (f"the connection to {self.options.nqn} at "
                                f"{self.transport.address} was lost ({reason}); failing I/O "
                                f"while reconnecting (--fast-io-fail-tmo {delay:g})")
            limited.log(("failing io", self.options.nqn), logging.WARNING, "%s",
                        self._failing_io)
            self._states.wake()

    async def _drop_queues(self) -> None:
        """Tear every queue down; then the target can reach none of the memory their
        commands used, so the bounce buffers held for those commands come back."""
        self.admin, self.io_queues = None, []
        await self.transport.drop_queues()
        self.teardowns += 1
        if self.bounce is not None:
            self.bounce.reclaim()
        self._states.wake()  # (commands wait for this in _torn_down)

    def _outage_start(self) -> float:
        """When the outage that a loss now is part of began: now, unless the connection it
        ends was lost before within a command timeout of its reconnect.  A connection that a
        command (a target's protocol violation) breaks again each time it is retried is one
        outage, so that ``--ctrl-loss-tmo`` bounds it as it bounds a target that is gone."""
        now = trio.current_time()
        if not (self.reconnects and now - self._live_since < self.options.timeout):
            self._outage_since = now
        return self._outage_since

    async def _reconnect(self, reason: str) -> None:
        """Tear the queues down, then rebuild them every reconnect_delay until ctrl_loss_tmo
        has passed since the outage began (:meth:`_outage_start`)."""
        opts = self.options
        lost_at = self._outage_start()
        await self._drop_queues()  # commands in flight fail now, and wait for the outcome
        # Tries every reconnect_delay while --ctrl-loss-tmo lasts (of the outage's whole
        # length), the last one at its end; each try's waits are cut to try_deadline, so
        # that giving up takes --ctrl-loss-tmo plus one connect timeout at most, however
        # long the target leaves a try waiting (Linux counts tries instead: a target that
        # accepts and never answers held each for a whole connect timeout, 55 s for -l 5).
        give_up_at = give_up_time(lost_at, opts.ctrl_loss_tmo)
        tried, refused = 0, ""
        if trio.current_time() < give_up_at and not self._change_state(CONNECTING):
            return  # closed meanwhile
        while (now := trio.current_time()) < give_up_at:
            await trio.sleep(min(opts.reconnect_delay, give_up_at - now))
            tried += 1
            start = trio.current_time()
            deadline = try_deadline(start, give_up_at, opts.connect_timeout)
            try:
                with self._waits_until(deadline) as scope:
                    await self._connect_admin()
                    await self._connect_io_queues()
                    await self._check_identity()
                if scope.cancelled_caught:
                    raise ConnectError(f"no answer within the {deadline - start:.1f} s this "
                                       f"try had (--ctrl-loss-tmo {opts.ctrl_loss_tmo:g})")
            except Exception as exc:  # noqa: BLE001 - any failure here means: try again later
                what = exc if isinstance(exc, NVMeoFError) else f"{type(exc).__name__}: {exc}"
                final = final_failure(exc)  # DNR, or a rejected secret: as nvmf_should_reconnect
                if not final:  # (a final one is named once, in the line that ends reconnecting)
                    self._reconnects_failing.failed(logging.WARNING, "reconnect %d to %s "
                                                    "failed: %s", tried, opts.nqn, what)
                await self._drop_queues()
                if final:
                    refused = f"; stopped reconnecting: {what}"
                    break
                continue
            if not self._change_state(LIVE):
                return  # closed meanwhile
            self._failing_io = ""
            self.reconnects += 1
            self._reconnects_failing.end()  # (this line says how long it took)
            limited.log(("reconnected", opts.nqn), logging.INFO, "reconnected to %s at %s as "
                        "controller %d after %.1f s", opts.nqn, self.transport.address,
                        self.cntlid, trio.current_time() - lost_at)
            return
        where = f"{opts.nqn} at {self.transport.address}"
        if refused:
            reason = f"the connection to {where} was lost ({reason}){refused}"
        elif opts.ctrl_loss_tmo == 0:
            reason = (f"the connection to {where} was lost ({reason}) and "
                      "reconnecting is off (--ctrl-loss-tmo 0)")
        else:
            reason = (f"the connection to {where} was lost ({reason}); gave up after {tried} "
                      f"reconnects in {trio.current_time() - lost_at:.0f} s "
                      f"(--ctrl-loss-tmo {opts.ctrl_loss_tmo:g})")
        self._reconnects_failing.end()
        if self.state not in (DELETING, DEAD):
            log.error("%s", reason)
        self.close_state(reason)

    async def _check_identity(self) -> None:
        """Before I/O resumes on a new connection: the controller must be of the subsystem
        we mounted (else ControllerChanged, and this reconnect failed), and every namespace
        is rescanned, so that one replaced meanwhile refuses I/O from now on."""
        first = self.identify
        if first is None:  # never identified (brought up by other means): nothing to compare
            return
        self._checking = True  # (a rescan of many namespaces may outlast the keep-alive)
        try:
            again = nvme.IdentifyController.from_bytes(await self.identify_raw(Cns.CONTROLLER))
            check_controller(first, again,
                             f"the controller reached at {self.transport.address}")
            if first.cntrltype != 2:  # a discovery controller has no namespaces
                await self.events.check_after_reconnect()
        finally:
            self._checking = False

    def namespace_replaced(self, nsid: int, old: Namespace, new: Namespace) -> None:
        """A rescan found ``new`` behind ``nsid`` instead of ``old``: commands of ``old``
        that wait to be sent (or sent again) fail instead (:meth:`_wait_live_for`,
        :meth:`_run_again`); the replaced listeners are told at once."""
        self.replacements += 1
        self._replaced[nsid] = (self.replacements, self.teardowns)
        for listener in list(self.events.replaced_listeners):
            listener(nsid, old, new)

    def connection_snapshot(self) -> dict[str, Any]:
        """What ``.nvmeof/stats`` shows of the connection (and of its bounce buffers)."""
        snapshot = {"state": self.state, "cntlid": self.cntlid, "losses": self.losses,
                    "reconnects": self.reconnects}
        if self._record_layer() is not None:
            snapshot["tls"] = self._record_layer()
        if self.bounce is not None:
            snapshot.update({f"bounce_{k}": v for k, v in self.bounce.counts().items()})
        return snapshot

    def close_state(self, why: str) -> None:
        """No more commands: waiters and new callers get ControllerLost(why)."""
        if self.state not in (DELETING, DEAD):
            self._dead_reason = why
            self._change_state(DELETING)
        self._change_state(DEAD)

    @contextlib.asynccontextmanager
    async def scratch(self, length: int) -> AsyncIterator[DataRef]:
        """A registered host buffer for small admin data (serialized)."""
        async with self._scratch_lock:
            assert self._scratch is not None and self._scratch.view is not None
            ref = self._scratch.ref(0, length)
            self._scratch.view[:length] = bytes(length)
            yield ref

    async def property_get(self, offset: int, size8: bool = False) -> int:
        completion = await self.admin_command(cmd.property_get(offset, size8), fabrics=True)
        return completion.result if size8 else completion.dw0

    async def property_set(self, offset: int, value: int) -> None:
        await self.admin_command(cmd.property_set(offset, value, False), fabrics=True)

    async def identify_raw(self, cns: int, nsid: int = 0) -> bytes:
        """Identify data (4 KiB); up to IDENTIFY_IN_FLIGHT at once, each in registered
        memory of its own (a scan of many namespaces runs them side by side)."""
        async with self._identify_slot:
            if self._identify_buffers is None:
                self._identify_buffers = host_buffer(self.transport.register,
                                                     IDENTIFY_IN_FLIGHT * IDENTIFY_BYTES)
            slot = self._identify_free.pop()
            try:
                ref = self._identify_buffers.ref(slot * IDENTIFY_BYTES, IDENTIFY_BYTES)
                view = ref.region.view[ref.offset:ref.offset + IDENTIFY_BYTES]
                view[:] = bytes(IDENTIFY_BYTES)
                await self.admin_command(cmd.identify(cns, nsid, sgl=nvme.NULL_SGL), ref)
                return bytes(view)
            finally:
                self._identify_free.append(slot)

    def log_page_piece(self) -> int:
        """Bytes of a log page one Get Log Page command reads at the most (MDTS, in
        dwords)."""
        return max(self.max_transfer & ~3, 4)

    async def get_log_page(self, lid: int, length: int, offset: int = 0) -> bytes:
        """Read ``length`` bytes of log page ``lid`` (in registered memory of its own), in
        pieces of at most one command's transfer (MDTS), as libnvme's ``nvme_get_log``
        does; more than :data:`LOG_PAGE_MAX` bytes is refused (TargetProtocolError).
        Pieces may hold two generations of a page: :func:`.logread.read_whole` reads one
        with a change counter consistently."""
        if length > LOG_PAGE_MAX:
            raise TargetProtocolError(f"log page {lid:#04x} of {length} bytes is refused: "
                                      f"we read at most {LOG_PAGE_MAX} bytes of one")
        buf = host_buffer(self.transport.register, max(length, 4))
        step = self.log_page_piece()
        try:
            for at in range(0, length, step):
                n = min(step, length - at)
                await self.admin_command(
                    cmd.get_log_page(lid, n, offset + at, sgl=nvme.NULL_SGL), buf.ref(at, n))
            return bytes(buf.view[:length])
        finally:
            buf.close()

    async def set_features(self, fid: int, cdw11: int) -> int:
        return (await self.admin_command(cmd.set_features(fid, cdw11))).dw0

    async def get_features(self, fid: int) -> int:
        return (await self.admin_command(cmd.get_features(fid))).dw0

    # -- memory ---------------------------------------------------------------------------------

    def register(self, obj) -> Region:
        """Register caller memory (numpy array, host tensor, writable buffer) on every queue."""
        addr, length, owner = buffer_address(obj)
        if length == 0:
            raise InvalidArgument("cannot register an empty buffer")
        region = Region(addr, length, self.transport.register(addr, length, owner), owner)
        self._regions.append(region)
        return region

    def unregister(self, region: Region) -> None:
        if region in self._regions:
            self._regions.remove(region)
        region.close()

    def allocate(self, length: int) -> Region:
        """Registered, page-aligned host memory owned by this controller."""
        region = host_buffer(self.transport.register, length)
        self._regions.append(region)
        return region

    # -- bring-up -------------------------------------------------------------------------------

    async def _fabrics_connect(self, queue: Queue, kato_ms: int = 0) -> None:
        """The fabrics Connect that binds a transport queue to this host and controller."""
        qid = queue.qid
        data = cmd.connect_data(self.identity.hostid,
                                self.cntlid if qid else nvme.CNTLID_DYNAMIC,
                                self.options.nqn, self.identity.hostnqn)
        where = f"{self.transport.address} ({self.options.nqn})"
        async with self.scratch(len(data)) as ref:
            ref.region.view[:len(data)] = data
            try:
                completion = await queue.execute(
                    cmd.connect(qid, queue.size, kato_ms, queue.connect_cattr,
                                sgl=nvme.NULL_SGL), ref,
                    to_controller=True, timeout=self.command_timeout())
                completion.raise_for_status("Connect", fabrics=True)
            except NVMeStatusError as exc:
                raise ConnectError(f"connect to {where} failed: {exc}") from exc
            except CommandTimeout as exc:
                raise ConnectError(f"connect to {where}: no answer to Connect: {exc}") from exc
        result = nvme.ConnectResult.from_dw0(completion.dw0)
        if qid == 0:
            self.cntlid = result.cntlid
        if result.authentication_required:  # DH-HMAC-CHAP, on every queue as the kernel does
            await auth.authenticate_queue(self.dhchap, qid, where,
                                          *auth.queue_messages(self, queue))

    async def _enable(self) -> None:
        self.cap = nvme.Capabilities.from_int(await self.property_get(Property.CAP, True))
        self.version = nvme.decode_version(await self.property_get(Property.VS))
        self._cc = nvme.cc_enable_value()
        await self.property_set(Property.CC, self._cc)
        await self._wait_csts(lambda s: s.rdy, "CSTS.RDY after CC.EN",
                              self.cap.timeout_ms / 1000)

    async def _wait_csts(self, done, what: str, limit: float) -> None:
        with trio.move_on_after(max(limit, 0.5)):
            while True:
                status = nvme.ControllerStatus.from_int(await self.property_get(Property.CSTS))
                if status.cfs:
                    raise ConnectError(f"controller reported a fatal status (CSTS.CFS) "
                                       f"waiting for {what}")
                if done(status):
                    return
                await trio.sleep(0.01)
        raise CommandTimeout(f"controller did not set {what} within {limit:g} s")

    def _io_queue_count(self, granted: int) -> int:
        wanted = self.options.nr_io_queues or min(MAX_DEFAULT_IO_QUEUES,
                                                  max(2, os.cpu_count() or 1))
        return max(1, min(wanted, granted))

    def _load_dhchap(self) -> auth.DhChap | None:
        """The DH-HMAC-CHAP secrets, secret files read (and checked) now."""
        host, ctrl = self.options.dhchap_sources()
        return auth.host_dhchap(host, ctrl, self.identity.hostnqn, self.options.nqn,
                                allow_insecure=self.options.allow_insecure_secret_file)

    async def _connect_admin(self) -> None:
        """The admin queue: transport connect, fabrics Connect, CC.EN (also on reconnects).

        Secret files are read again first: a key rotated in its file is used from the next
        reconnect on.
        """
        self.dhchap = self._load_dhchap()
        kato_ms = int(self.options.keep_alive_tmo * 1000)
        admin = await self.transport.connect_queue(self._nursery, 0, ADMIN_QUEUE_SIZE)
        if self._scratch is None:
            self._scratch = host_buffer(self.transport.register, SCRATCH_BYTES)  # needs the PD
        await self._fabrics_connect(admin, kato_ms)
        self.admin = admin
        await self._enable()

    async def _connect_io_queues(self) -> None:
        """Set Features Number of Queues, then connect each I/O queue (also on reconnects).

        The count asked for includes ``companion_queues`` more than we connect: those
        QIDs stay free for companion clients to connect themselves (``lease_qids``).
        """
        assert self.identify is not None and self.cap is not None
        own = self._io_queue_count(0xFFFF)
        requested = min(0xFFFF, own + self.options.companion_queues)
        dw0 = await self.set_features(FeatureId.NUMBER_OF_QUEUES,
                                      (requested - 1) | (requested - 1) << 16)
        granted = min(dw0 & 0xFFFF, dw0 >> 16) + 1
        count = self._io_queue_count(granted)
        self.lease_qids = list(range(count + 1, min(granted, requested) + 1))
        size = self.io_queue_size()
        in_capsule = self.identify.in_capsule_data_bytes if not self.identify.icdoff else 0
        self.in_capsule_bytes = in_capsule
        queues = []
        for qid in range(1, count + 1):
            queue = await self.transport.connect_queue(self._nursery, qid, size, in_capsule,
                                                       cntlid=self.cntlid)
            await self._fabrics_connect(queue)
            queues.append(queue)
        self.io_queues = queues

    def io_queue_size(self) -> int:
        """Entries per I/O queue: ours, and what a companion client's queues may use."""
        assert self.identify is not None and self.cap is not None
        size = min(self.options.queue_size, self.cap.max_queue_entries)
        if self.identify.maxcmd:
            size = min(size, self.identify.maxcmd)
        if size < 2:  # a queue holds one entry fewer than its size: none would be left
            raise ConnectError(
                f"{self.transport.address}: the controller allows I/O queues of {size} entry "
                f"(CAP.MQES {self.cap.max_queue_entries - 1}, MAXCMD {self.identify.maxcmd}); "
                "at least 2 are needed")
        return size

    async def start(self) -> None:
        opts = self.options
        self._change_state(CONNECTING)
        await self._connect_admin()
        self.identify = nvme.IdentifyController.from_bytes(await self.identify_raw(Cns.CONTROLLER))
        if self.identify.subnqn and self.identify.subnqn != opts.nqn:
            log.warning("controller reports subsystem %s, connected as %s",
                        self.identify.subnqn, opts.nqn)
        page = self.cap.min_page_size
        self.max_transfer = min(self.identify.max_transfer_bytes(page) or BOUNCE_CHUNK_MAX,
                                BOUNCE_CHUNK_MAX)
        if self.identify.cntrltype == 2:  # discovery controller: admin queue only
            self._change_state(LIVE)
            return
        if (getattr(self.transport, "needs_keyed_sgls", False)
                and not self.identify.keyed_sgl_supported):
            raise ConnectError(f"{self.transport.address}: the controller does not support "
                               "keyed SGL data blocks, which NVMe/RDMA requires")
        await self._connect_io_queues()
        if opts.keep_alive_tmo:
            self._nursery.start_soon(self._keep_alive, opts.keep_alive_tmo)
        probe_after = getattr(self.transport, "probe_after", 0)
        if probe_after:
            self._nursery.start_soon(self._probe_when_overdue, probe_after)
        self.bounce = self.new_bounce_pool(self.max_transfer, BOUNCE_BUFFERS)
        await self._identify_namespaces()
        await self._nursery.start(self.supervise)
        self._change_state(LIVE)
        await self._nursery.start(self.events.run)

    def new_namespace(self, nsid: int, identify: nvme.IdentifyNamespace) -> Namespace:
        """The namespace ``nsid`` of this controller, which runs its commands; one whose
        Identify data we cannot serve is unavailable, and says why here, once."""
        generation = self._generations[nsid] = self._generations.get(nsid, -1) + 1
        ns = Namespace(self, nsid, identify, generation)
        if ns.unavailable:
            limited.log(("unavailable", self.options.nqn), logging.WARNING, "%s: %s",
                        self.options.nqn, unavailable_line(nsid, ns.unavailable))
        return ns

    async def _identify_namespaces(self) -> None:
        """The active namespaces, each with its identity (kept to be compared at every
        rescan), IDENTIFY_IN_FLIGHT at once; one that reports another's identifiers is
        refused."""
        nsids = await active_nsids(self)
        identified = await identify_namespaces(self, nsids)
        for nsid in nsids:
            found = identified.pop(nsid, None)  # None: not there (any more)
            if found is not None:
                ns = self.namespaces[nsid] = self.new_namespace(nsid, found[0])
                ns.identity = found[1]
        claim_identities(self, sorted(self.namespaces))

    async def _keep_alive(self, kato: float) -> None:
        """Send Keep Alive at half the negotiated timeout, as the kernel does.

        One unanswered within KATO means the connection is gone (the kernel's rule too).
        """
        while True:
            await trio.sleep(kato / 2)
            await self._send_keep_alive(kato, "keep-alive")

    async def _send_keep_alive(self, timeout: float, why: str) -> None:
        """One Keep Alive; its failure is a lost connection (named by ``why``)."""
        admin = self.admin
        if admin is None or (self.state is not LIVE and not self._checking):
            return
        try:
            completion = await admin.execute(cmd.keep_alive(), timeout=timeout)
        except (TransportError, CommandTimeout) as exc:
            self.connection_lost(admin, CommandTimeout(f"{why}: {exc}"))
            return
        if why != "keep-alive":
            return
        if not completion.ok:  # the connection holds: each is a line only while few
            if self.state is LIVE:
                self._keep_alive_failing.failed(logging.ERROR, "keep-alive failed: %s",
                                                completion.status_name())
        elif self._keep_alive_failing.failing:
            log.info("keep-alive answered again%s", self._keep_alive_failing.end())

    async def _probe_when_overdue(self, after: float) -> None:
        """Send a Keep Alive at once while an I/O command has waited ``after`` s, at most
        one per ``after`` s (the transport's ``probe_after``).

        Over RDMA the target's disconnect does not reach us, and the commands it dropped
        had their SENDs acknowledged already: nothing fails until a SEND goes
        unacknowledged, which a probe brings at once instead of at the next keep-alive.
        A probe is answered by a target that is merely slow, so it never fails over by
        itself; only its transport's retry limit or the keep-alive timeout does.  At most
        ``PROBES_IN_FLIGHT`` are unanswered at once.
        """
        watch = OverdueWatch(after)
        timeout = self.options.keep_alive_tmo or self.options.timeout
        why = f"probe after a command waited {after:g} s"
        last = -math.inf
        in_flight = 0

        async def probe() -> None:
            nonlocal in_flight
            try:
                await self._send_keep_alive(timeout, why)
            finally:
                in_flight -= 1

        while True:
            await trio.sleep(after / PROBE_LOOKS)
            if self.state is not LIVE or in_flight >= PROBES_IN_FLIGHT:
                continue
            now = trio.current_time()
            if watch.overdue(self.io_queues, now) and now - last >= after:
                last = now
                in_flight += 1
                self._nursery.start_soon(probe)

    def shutdown_timeout(self) -> float:
        """Seconds the orderly shutdown may take (:func:`shutdown_wait`)."""
        rtd3e = self.identify.rtd3e if self.identify is not None else 0
        return shutdown_wait(self.options.shutdown_timeout, rtd3e)

    async def shutdown(self, why: str = "") -> None:
        """Deleting: no new keep-alives or I/O (they get ``why``); then CC.SHN, and wait
        for CSTS.SHST complete, all of it within :meth:`shutdown_timeout` (as Linux's
        ``shutdown_timeout``; CAP.TO is the time to *enable* a controller, up to 127.5 s).
        What was skipped is logged and kept in :attr:`shutdown_note`."""
        was_live = self.state is LIVE
        state = self.state
        if self.state not in (DELETING, DEAD):
            self._dead_reason = why or f"the controller of {self.options.nqn} is closed"
            self._change_state(DELETING)
        if self.admin is None or self.cap is None or not was_live:
            if self.cap is not None and state in (RESETTING, CONNECTING):
                self.shutdown_note = f"no orderly shutdown: the controller was {state}"
            return
        limit = self.shutdown_timeout()
        note, step = "", "CC.SHN unanswered"
        try:
            with self._waits_until(trio.current_time() + limit) as scope:
                await self.property_set(Property.CC, nvme.cc_shutdown_value(self._cc))
                step = "CSTS.SHST not set"
                await self._wait_csts(lambda s: s.shutdown_complete, "CSTS.SHST complete",
                                      limit)
            if scope.cancelled_caught:
                note = f"shutdown not confirmed within {limit:g} s ({step})"
        except CommandTimeout:
            note = f"shutdown not confirmed within {limit:g} s ({step})"
        except NVMeoFError as exc:
            note = f"orderly shutdown failed: {exc}"
        if note:
            self.shutdown_note = note
            log.warning("%s at %s: %s; disconnecting", self.options.nqn,
                        self.transport.address, note)

    def release(self) -> None:
        """Free the memory this controller registered, then the transport."""
        for region in self._regions:
            region.close()
        self._regions.clear()
        if self.bounce is not None:
            self.bounce.close()
        if self._scratch is not None:
            self._scratch.close()
        if self._identify_buffers is not None:
            self._identify_buffers.close()
        self.transport.close()

    def _record_layer(self) -> str | None:
        """Where the TLS records go (``kernel (TLS_AES_...)``, ``userspace (...)``); None
        without TLS."""
        layer = getattr(self.transport, "record_layer", None)
        if layer is not None:
            return f"{layer.where} ({layer.suite})"
        return "handshake pending" if getattr(self.transport, "tls", None) else None

    def _secret_sources(self) -> dict[str, str | None]:
        """Where the secrets come from, for ``.nvmeof``: ``inline`` or a file's path; with
        TLS, where the PSK comes from and the identity offered (never the key)."""
        host, ctrl = self.options.dhchap_sources()
        sources = {"dhchap_secret_source": host.shown if host else None,
                   "dhchap_ctrl_secret_source": ctrl.shown if ctrl else None}
        if self.options.uses_tls:
            if self.options.tls_psk_given is not None:
                psk_source = "the mount's"
            elif self.options.tls_key:
                psk_source = auth.SecretSource.of(self.options.tls_key, "--tls-key").shown
            else:
                psk_source = f"keyring {self.options.keyring or keyring.DEFAULT_KEYRING}"
            sources["tls_key_source"] = psk_source
            sources["tls_identity"] = getattr(self.transport, "psk_identity", None)
        return sources

    def describe(self) -> dict:
        ident = self.identify
        return {
            "transport": self.transport.name,
            "traddr": self.options.traddr,
            "trsvcid": self.options.trsvcid,
            "subnqn": self.options.nqn,
            "hostnqn": self.identity.hostnqn,
            "hostid": str(self.identity.hostid),
            "cntlid": self.cntlid,
            "version": self.version,
            "model": ident.mn if ident else "",
            "serial": ident.sn if ident else "",
            "firmware": ident.fr if ident else "",
            "io_queues": len(self.io_queues),
            "queue_size": self.io_queues[0].size if self.io_queues else 0,
            "max_transfer_bytes": self.max_transfer,
            "keep_alive_tmo": self.options.keep_alive_tmo,
            "reconnect_delay": self.options.reconnect_delay,
            "ctrl_loss_tmo": self.options.ctrl_loss_tmo,
            "fast_io_fail_tmo": self.options.fast_io_fail_tmo,
            "dhchap": auth.dhchap_mode(self.dhchap),
            "tls": self._record_layer() or "off",
            **self._secret_sources(),
            "state": self.state,
            "namespaces": sorted(self.namespaces),
        }


@contextlib.asynccontextmanager
async def connect(options: ConnectOptions) -> AsyncIterator[Controller]:
    """Connect and enable a controller; on exit shut it down and release every resource."""
    options.validate()
    transport = make_transport(options)
    controller = None
    try:
        with unwrap_groups():
            async with trio.open_nursery() as nursery:
                controller = Controller(options, transport, nursery)
                try:
                    await controller.start()
                    yield controller
                finally:
                    with trio.CancelScope(shield=True):
                        await controller.shutdown(f"the controller of {options.nqn} is closed")
                    controller.close_state(f"the controller of {options.nqn} is closed")
                    nursery.cancel_scope.cancel()
    finally:
        if controller is not None:
            controller.release()
        else:
            transport.close()
