"""A served mount: the controller, its companion socket and the FUSE filesystem together.

:func:`serve_mount` is what ``nvmeof-fuse mount`` and :func:`nvmeof_fuse.mount`
run: connect, listen for companion clients, mount, serve until unmounted or
cancelled, then flush the namespaces written since their last flush and disconnect.
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

FLUSH_TIMEOUT = 30.0
"""Seconds the final flush takes at most, all namespaces together."""
FLUSHES_IN_FLIGHT = 8
"""Final flushes in flight at once: however many namespaces were written, they neither crowd
the I/O queues nor keep the loop from the keep-alive, which runs until they are done."""

Ready = Callable[["ControllerLike", "CompanionServer"], None]
"""``ready(controller, companion_server)``: called once the mount exists."""
Connect = Callable[["ConnectOptions"], AbstractAsyncContextManager["ControllerLike"]]
"""``connect(options)``: the controller a mount serves, connected while in the context (a
multipath head: :func:`paths_connect`)."""


def written_namespaces(ctrl: ControllerLike) -> list[tuple[int, NamespaceLike]]:
    """``(nsid, namespace)`` of those written since their last flush, by NSID; a namespace
    that cannot say (no ``written``) counts as written."""
    return [(nsid, ns) for nsid, ns in sorted(ctrl.namespaces.items())
            if getattr(ns, "written", True)]


def _names(nsids: list[int]) -> str:
    """``n1, n2, ..., n8 and 12 more``: one short line however many there are."""
    return brief_list(f"n{nsid}" for nsid in nsids)


async def flush_all(ctrl: ControllerLike) -> None:
    """Flush the namespaces written since their last flush, FLUSHES_IN_FLIGHT at once, all
    within FLUSH_TIMEOUT, shielded (this runs while shutting down); what could not be
    flushed is said in one line.  The controller (its keep-alive too) runs meanwhile."""
    state = getattr(ctrl, "state", "live")
    if state != "live":  # nothing would answer: do not wait for a reconnect here
        log.warning("no final flush: the connection to the controller is %s", state)
        return
    written = written_namespaces(ctrl)
    if not written:
        return
    flushed: list[int] = []
    failed: list[tuple[int, NVMeoFError]] = []

    async def flush(item: tuple[int, NamespaceLike]) -> None:
        nsid, ns = item
        try:
            await ns.flush()
            flushed.append(nsid)
        except NVMeoFError as exc:
            failed.append((nsid, exc))

    with trio.move_on_after(FLUSH_TIMEOUT, shield=True) as scope:
        await run_bounded(written, flush, FLUSHES_IN_FLIGHT)
    of = f"the {len(written)} of {len(ctrl.namespaces)} namespaces written since their last flush"
    if flushed:
        log.info("flushed %s (%s)", _names(sorted(flushed)), of)
    if failed:
        nsid, exc = min(failed, key=lambda f: f[0])
        more = f" (and of {len(failed) - 1} more)" if len(failed) > 1 else ""
        log.warning("final flush of n%d failed: %s%s", nsid, exc, more)
    if scope.cancelled_caught:
        done = set(flushed) | {nsid for nsid, _ in failed}
        left = [nsid for nsid, _ in written if nsid not in done]
        log.warning("final flush not done within %g s: %s not flushed", FLUSH_TIMEOUT,
                    _names(left))


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
    async with connect(conn) as ctrl:
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
                                    task_status=task_status)
                    if pool is not None:  # their descriptors end with the mount: they drain
                        await pool.stop()
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
                    stop_retrying = getattr(ctrl, "stop_retrying", None)
                    if stop_retrying is not None:  # no command caught retrying holds us
                        stop_retrying(f"{mountpoint} is being unmounted")
                    if pool is None:
                        inner.cancel_scope.cancel()
                    else:  # the filesystem drains, then its workers, then the rest stops
                        fs_scope.cancel()
        finally:
            await flush_all(ctrl)
            ratelimit.report_suppressed(final=True)
    return "; ".join(getattr(ctrl, "shutdown_notes", ()))
