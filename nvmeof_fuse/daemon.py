"""A served mount: the controller, its companion socket and the FUSE filesystem together.

:func:`serve_mount` is what ``nvmeof-fuse mount`` and :func:`nvmeof_fuse.mount`
run: connect, listen for companion clients, mount, serve until unmounted or
cancelled, then flush the namespaces written since their last flush and disconnect.

Its exit, from the request to stop (an unmount, SIGTERM, SIGINT) to the disconnect, keeps
one deadline whatever the target does (:class:`ExitPlan`): the drain, the FUSE workers and
the final flush share what the orderly shutdown's own timeout leaves of it, and what was
cut short is said in the mount's last line.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

import trio

from nvmeof_fuse import ratelimit
from nvmeof_fuse.concurrency import run_bounded
from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.ratelimit import brief_list

if TYPE_CHECKING:
    from nvmeof_fuse.companion.server.server import CompanionServer
    from nvmeof_fuse.fs.info import ControllerLike, NamespaceLike
    from nvmeof_fuse.fs.mount_options import MountOptions
    from nvmeof_fuse.fs.operations import NamespaceFS
    from nvmeof_fuse.host.connect_options import ConnectOptions

log = logging.getLogger("nvmeof-fuse")

EXIT_TIMEOUT = 14.0
"""Seconds from the request to stop (an unmount, SIGTERM, SIGINT) to the disconnect, whatever
the target does: issue #56's 15 s to the daemon's end, less a second for the disconnect and
the process's own end.  The orderly shutdown has its own timeout at the end of it
(``--shutdown-timeout``, 5 s by default, RTD3E up to 10 s); the drain, the FUSE workers and the
final flush share what is before it (:class:`ExitPlan`)."""
FLUSH_LEAST = 3.0
"""Seconds the final flush has at least, however long the drain took (the drain ends this
long before the flush must).  Linux bounds neither: ``sync`` at unmount waits for a Flush
through the I/O timeout (30 s) and every reconnect after it, up to ``ctrl_loss_tmo``, and
``nvme disconnect`` flushes nothing, but cancels the I/O in flight and shuts the controller
down, which commits a volatile write cache too.  A healthy target's Flush takes
milliseconds, and seconds only with a large cache to write out: what the flush gets, 9 s with
the default shutdown timeout and 3 s at least, is that, and a target silent for longer is
not answering."""
FLUSHES_IN_FLIGHT = 8
"""Final flushes in flight at once: however many namespaces were written, they neither crowd
the I/O queues nor keep the loop from the keep-alive, which runs until they are done."""
CUT_SLACK = 0.01
"""Seconds before its deadline at which a flush may end that was cut by it: a command's
timeout is cut to the deadline to within 10 ms (``Controller.command_timeout``)."""
FLUSH_BACKSTOP = 1.0
"""Seconds past its deadline at which the final flush stops waiting: its commands time out
at the deadline (their timeouts are cut to it), then wait for their connection's teardown,
our own work; this cuts only what would go on past that."""

Ready = Callable[["ControllerLike", "CompanionServer"], None]
"""``ready(controller, companion_server)``: called once the mount exists."""
Connect = Callable[["ConnectOptions"], AbstractAsyncContextManager["ControllerLike"]]
"""``connect(options)``: the controller a mount serves, connected while in the context (a
multipath head: :func:`paths_connect`)."""


@dataclasses.dataclass
class ExitPlan:
    """When each part of a mount's exit must be done (trio time), decided when it is asked
    to stop, and what was cut short (for the mount's last line).

    The orderly shutdown keeps its whole timeout at the end; the final flush must be done
    before that, and the drain of the filesystem and the FUSE workers :data:`FLUSH_LEAST`
    before the flush.  Every command the mount sends until the shutdown, and every I/O
    command in flight when it was asked to stop, times out by ``flush_by`` (the
    controller's ``wind_down``).  All of it ends by ``exit_by``: :data:`EXIT_TIMEOUT` after
    the request, or later only where ``--shutdown-timeout`` alone asks for more.
    """

    began: float
    drain_by: float
    flush_by: float
    exit_by: float
    skipped: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def starting(cls, now: float, shutdown_timeout: float) -> ExitPlan:
        """The plan of an exit asked for at ``now``, for a shutdown of ``shutdown_timeout``."""
        exit_by = now + max(EXIT_TIMEOUT, shutdown_timeout + FLUSH_LEAST)
        flush_by = exit_by - shutdown_timeout
        return cls(now, flush_by - FLUSH_LEAST, flush_by, exit_by)


def written_namespaces(ctrl: ControllerLike) -> list[tuple[int, NamespaceLike]]:
    """``(nsid, namespace)`` of those written since their last flush, by NSID; a namespace
    that cannot say (no ``written``) counts as written."""
    return [(nsid, ns) for nsid, ns in sorted(ctrl.namespaces.items())
            if getattr(ns, "written", True)]


def _names(nsids: list[int]) -> str:
    """``n1, n2, ..., n8 and 12 more``: one short line however many there are."""
    return brief_list(f"n{nsid}" for nsid in nsids)


async def flush_all(ctrl: ControllerLike, deadline: float) -> list[str]:
    """Flush the namespaces written since their last flush, FLUSHES_IN_FLIGHT at once, all
    by ``deadline`` (trio time), shielded (this runs while shutting down); each outcome is
    said in one line.  The controller (its keep-alive too) runs meanwhile.  What was not
    flushed, for the mount's last line."""
    written = written_namespaces(ctrl)
    if not written:
        return []
    state = getattr(ctrl, "state", "live")
    if state != "live":  # nothing would answer: do not wait for a reconnect here
        note = f"no final flush: the connection to the controller is {state}"
        log.warning("%s", note)
        return [note]
    began = trio.current_time()
    if began >= deadline:  # (the drain ran to it: its commands' connection is gone)
        note = f"no final flush of {_names([nsid for nsid, _ in written])}: no time was left"
        log.warning("%s", note)
        return [note]
    flushed: list[int] = []
    failed: list[tuple[int, NVMeoFError]] = []

    async def flush(item: tuple[int, NamespaceLike]) -> None:
        nsid, ns = item
        try:
            await ns.flush()
            flushed.append(nsid)
        except NVMeoFError as exc:
            if trio.current_time() < deadline - CUT_SLACK:  # else cut: not confirmed
                failed.append((nsid, exc))

    with trio.move_on_at(deadline + FLUSH_BACKSTOP, shield=True):
        await run_bounded(written, flush, FLUSHES_IN_FLIGHT)
    of = f"the {len(written)} of {len(ctrl.namespaces)} namespaces written since their last flush"
    skipped = []
    if flushed:
        log.info("flushed %s (%s)", _names(sorted(flushed)), of)
    if failed:
        nsid, exc = min(failed, key=lambda f: f[0])
        more = f" (and of {len(failed) - 1} more)" if len(failed) > 1 else ""
        log.warning("final flush of n%d failed: %s%s", nsid, exc, more)
        skipped.append(f"final flush of {_names(sorted(n for n, _ in failed))} failed")
    done = set(flushed) | {nsid for nsid, _ in failed}
    left = [nsid for nsid, _ in written if nsid not in done]  # the cut, and any not begun
    if left:
        note = (f"final flush of {_names(left)} not confirmed within "
                f"{round(deadline - began, 1):g} s")
        log.warning("%s", note)
        skipped.append(note)
    return skipped


async def report_suppressed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Every rate-limit window, say what each kind of line left out (ratelimit.py)."""
    task_status.started()
    while True:
        await trio.sleep(ratelimit.INTERVAL)
        ratelimit.report_suppressed()


def paths_connect(mopts: MountOptions) -> Connect:
    """How a mount connects: a multipath head over ``conn`` (path 0) and ``mopts.paths``
    with ``mopts.iopolicy``; with one path it hands commands straight to its controller,
    and paths can still be added to it (``nvmeof-fuse add-path``)."""
    from nvmeof_fuse.host.multipath.head import connect as connect_paths
    from nvmeof_fuse.host.multipath.path import path_options

    def connect(conn: ConnectOptions) -> AbstractAsyncContextManager[ControllerLike]:
        extra = [path_options(conn, uri) for uri in mopts.paths]
        return connect_paths([conn, *extra], policy=mopts.iopolicy)

    return connect


async def serve_mount(conn: ConnectOptions, mopts: MountOptions, mountpoint: str,
                      ready: Ready, connect: Connect | None = None,
                      stop: trio.Event | None = None) -> str:
    """Serve ``conn``'s controller at ``mountpoint`` until unmounted or ``stop`` is set;
    what the orderly disconnect skipped ('' if nothing: the mount's last line says it).

    Setting ``stop`` is the orderly way out: the filesystem drains and unmounts and
    the companion socket closes while the controller still runs, so the final
    flush and the shutdown complete.  Cancelling instead tears everything down at
    once (the controller's queues too), so use it only to abandon a mount.
    """
    from nvmeof_fuse.companion.server.server import CompanionServer
    from nvmeof_fuse.fs.mount import check_fuse_server, check_mountpoint_async, serve
    from nvmeof_fuse.workers.supervisor import FuseWorkers

    if connect is None:
        connect = paths_connect(mopts)
    path = await check_mountpoint_async(mountpoint)  # fail before connecting
    check_fuse_server(mopts.fuse)
    workers = FuseWorkers(mopts.worker_processes, read_only=mopts.read_only,
                          timeout=conn.timeout, debug=mopts.debug)
    if workers.role.queues:  # queue IDs for the workers to lease, beside the companion clients'
        conn = dataclasses.replace(conn, companion_queues=conn.companion_queues
                                   + workers.role.queues)
    plan: ExitPlan | None = None
    async with connect(conn) as ctrl:
        workers.share_locks(ctrl)  # before anything writes: every process takes them

        def exiting() -> ExitPlan:
            """The exit's plan, made when it is first asked for (stop, an unmount from
            outside, cancellation): from then on the controller winds down by it."""
            nonlocal plan
            if plan is None:
                shutdown_timeout = getattr(ctrl, "shutdown_timeout", None)
                plan = ExitPlan.starting(trio.current_time(), shutdown_timeout()
                                         if shutdown_timeout is not None
                                         else conn.shutdown_timeout)
                wind_down = getattr(ctrl, "wind_down", None)
                if wind_down is not None:  # no command caught retrying holds us
                    wind_down(f"{mountpoint} is being unmounted", plan.flush_by)
            return plan

        try:
            async with trio.open_nursery() as inner:
                inner.start_soon(report_suppressed)
                companion = CompanionServer(ctrl, read_only=mopts.read_only,
                                            roles=[workers.role])
                await inner.start(companion.serve)
                fs_scope = trio.CancelScope()
                pool: FuseWorkers | None = None

                async def filesystem(task_status: trio.TaskStatus[NamespaceFS]) -> None:
                    with fs_scope:
                        await serve(ctrl, path, mopts, companion=companion,
                                    exit_plan=exiting, task_status=task_status)
                    if pool is not None:  # their descriptors end with the mount: they drain
                        ending = exiting()
                        ending.skipped += await pool.stop(ending.drain_by,
                                                          asked_at=ending.began)
                    inner.cancel_scope.cancel()  # unmounted from outside: stop the rest

                fs = await inner.start(filesystem)
                if workers.count > 1:
                    pool = workers
                    await inner.start(pool.run, fs.kernel, fs, companion)
                companion.on_write = fs.drop_cached  # companion writes bypass the page cache
                companion.delegations.files_open = fs.file_open
                fs.before_open = companion.delegations.wait_returned
                listeners = getattr(getattr(ctrl, "events", None), "listeners", [])
                listeners.append(companion.delegations.follow)  # namespaces that change
                listeners.append(companion.follow)  # clients' queues on one replaced
                if pool is not None:  # workers are sent the new sizes before the files show them
                    listeners.insert(0, pool.follow)
                names = brief_list(f"n{n}" for n in sorted(ctrl.namespaces))
                log.info("mounted %s at %s", names or "no namespaces", path)
                ready(ctrl, companion)
                if stop is not None:
                    await stop.wait()  # cancelled instead when unmounted from outside
                    exiting()
                    if pool is None:
                        inner.cancel_scope.cancel()
                    else:  # the filesystem and its workers drain, then the rest stops
                        pool.ask_to_stop()
                        fs_scope.cancel()
        finally:
            plan = exiting()
            plan.skipped += await flush_all(ctrl, plan.flush_by)
            workers.close()
            ratelimit.report_suppressed(final=True)
    return "; ".join([*plan.skipped, *getattr(ctrl, "shutdown_notes", ())])
