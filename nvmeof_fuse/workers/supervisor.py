"""The main process's side of FUSE workers: it starts them, replaces those that die, drains them.

With ``--workers N`` the main process (the daemon) is worker 0 and starts N-1 more
(:mod:`.worker`), each on a /dev/fuse descriptor cloned from the mount's
(:func:`~nvmeof_fuse.fs.devfuse.clone_fd`), as libfuse's ``fuse_loop_mt`` clones one per
thread.  It keeps the admin queue, keep-alive, events, reconnects and paths.  It replaces a
worker that dies (the kernel fails the requests that worker held, ECONNABORTED; its queue
IDs come back with its companion session), gives up after repeated deaths (serving alone),
and on unmount asks each to drain and waits for it.

Every process of the mount takes each write's range lock itself: the main process makes the
mount's file of range locks (:meth:`FuseWorkers.share_locks`,
:mod:`~nvmeof_fuse.host.namespace.sharedranges`) and hands each worker its descriptor as
it starts it.  The workers talk to it over the mount's companion socket
(:mod:`.messages`): the companion
server knows them only as a role (:attr:`FuseWorkers.role`) whose handler is
:meth:`FuseWorkers.on_fuse`, which answers what they forward with the main process's own
session and filesystem.  A rescan's sizes reach every worker before the files show them
(:meth:`FuseWorkers.follow`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import trio

from nvmeof_fuse.companion.protocol import ProtocolError, field, generation_field
from nvmeof_fuse.companion.server.roles import Role, Sender
from nvmeof_fuse.fs.devfuse import clone_fd
from nvmeof_fuse.fs.wire import FUSEError
from nvmeof_fuse.host.namespace.sharedranges import SharedRanges, share_range_locks
from nvmeof_fuse.workers.messages import (
    FORWARD_CHUNK,
    MAX_FOLLOWED_NAMESPACES,
    ROLE_FLAG,
    worker_queues,
)

if TYPE_CHECKING:
    from nvmeof_fuse.companion.server.server import CompanionServer
    from nvmeof_fuse.fs.operations import NamespaceFS
    from nvmeof_fuse.fs.session import FuseSession

log = logging.getLogger("nvmeof-fuse")

RESTART_LIMIT = 3
"""Deaths in a row, each before the worker served, after which no more are started."""
SIZES_TIMEOUT = 10.0
"""Most seconds a rescan waits for the serving workers to say they took the new sizes,
before the mount's files show them (at most the mount's command timeout: a slow machine
may take seconds)."""


class FuseWorkers:
    """The worker processes of one mount, supervised by the main process."""

    def __init__(self, count: int, *, read_only: bool = False, timeout: float = 30.0,
                 debug: bool = False) -> None:
        self.count = count
        self.read_only = read_only
        self.timeout = timeout
        self.sizes_timeout = min(timeout, SIZES_TIMEOUT)
        self.debug = debug
        self.procs: dict[int, trio.Process] = {}  # index -> running process
        self.started = 0  # processes started, replacements included
        self.replaced = 0
        self.ready: dict[int, int] = {}  # index -> pid of a worker that connected its queues
        self.stopping = False
        self.too_many_said = False  # the line that the workers forward all I/O was logged
        self.generation = 0  # of the namespaces' sizes last sent to the workers
        self.taken: dict[int, tuple[int, int]] = {}  # index -> pid, generation it took
        self.news = trio.Event()  # set (and replaced) when a worker took sizes or ended
        self.role = Role(name="FUSE worker", flag=ROLE_FLAG, counter="fuse_workers",
                         queues=worker_queues(count), requests={"fuse": self.on_fuse},
                         max_named=MAX_FOLLOWED_NAMESPACES)
        """The workers' sessions on the companion server, which the daemon registers when it
        builds the server: their queue IDs, their counts, the requests only they send."""
        # what the workers serve and report to, given by run()
        self.session: FuseSession | None = None  # the main process's (its descriptor, answers)
        self.ops: NamespaceFS | None = None  # the main process's filesystem
        self.companion: CompanionServer | None = None
        self.ranges: SharedRanges | None = None  # the mount's range locks, once shared

    def share_locks(self, ctrl: Any) -> None:
        """Make the mount's range locks across processes and let ``ctrl``'s namespaces take
        them (before the mount serves: from then on every write of the main process takes
        them too); the workers get them as they start."""
        if self.count > 1 and self.ranges is None:
            self.ranges = SharedRanges.create(self.timeout)
            share_range_locks(ctrl, self.ranges)

    def close(self) -> None:
        """Close the range locks' file (the mount is done: nothing writes any more)."""
        if self.ranges is not None:
            self.ranges.close()

    async def run(self, session: FuseSession, ops: NamespaceFS, companion: CompanionServer,
                  *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the workers on ``session``'s connection, answering what they forward with
        ``ops`` and ``session``, and keep them running until :meth:`stop` (or cancelled:
        then they are killed)."""
        self.session, self.ops, self.companion = session, ops, companion
        try:
            async with trio.open_nursery() as nursery:
                for index in range(1, self.count):
                    nursery.start_soon(self._keep, index)
                task_status.started()
        finally:
            for proc in self.procs.values():  # cancelled: nobody waits for them any more
                with contextlib.suppress(OSError):
                    proc.kill()

    async def _keep(self, index: int) -> None:
        """Run worker ``index``; start another when it dies, unless it keeps dying."""
        failures = 0
        while not self.stopping:
            try:
                proc = await self._spawn(index)
            except OSError as exc:
                log.error("cannot start FUSE worker %d: %s; the main process serves its "
                          "share", index, exc)
                return
            began = time.monotonic()
            self.procs[index] = proc
            try:
                status = await proc.wait()
            finally:
                self.procs.pop(index, None)
                self._tell_news()  # a rescan waits for it no more
            if self.stopping or status == 0:  # asked to, or its session ended (unmounted)
                return
            served = self.ready.pop(index, None) == proc.pid
            why = (f"killed by signal {-status}" if status < 0 else f"exited with status {status}")
            failures = 0 if served else failures + 1
            if failures >= RESTART_LIMIT:
                log.error("FUSE worker %d %s %d times before serving; not starting it again "
                          "(the other workers and the main process serve its share)", index, why,
                          failures)
                return
            log.warning("FUSE worker %d (pid %d) %s after %.0f s; the requests it held failed "
                        "(ECONNABORTED); starting another", index, proc.pid, why,
                        time.monotonic() - began)
            await self._gone(proc.pid)
            self.replaced += 1

    async def _gone(self, pid: int) -> None:
        """Wait (bounded) until a dead worker's companion session has ended: then its queue
        IDs are free for the next one."""
        companion = self.companion
        assert companion is not None  # (run() set it)
        with trio.move_on_after(self.timeout):
            while companion.has_client(pid):
                await trio.sleep(0.1)

    async def _spawn(self, index: int) -> trio.Process:
        assert self.session is not None and self.companion is not None  # (run() set them)
        assert self.ranges is not None, "share_locks() before the workers start"
        fd = clone_fd(self.session.fd)
        try:
            argv = [sys.executable, "-m", "nvmeof_fuse.workers", "--fd", str(fd),
                    "--socket", "@" + self.companion.address[1:], "--index", str(index),
                    "--timeout", repr(self.timeout), "--range-locks", str(self.ranges.fd)]
            if self.read_only:
                argv.append("--read-only")
            if self.debug:
                argv.append("--debug")
            proc = await trio.lowlevel.open_process(argv, pass_fds=(fd, self.ranges.fd))
        finally:
            os.close(fd)  # the worker holds it now: the kernel fails its requests if it dies
        self.started += 1
        log.info("FUSE worker %d started (pid %d)", index, proc.pid)
        return proc

    def ask_to_stop(self) -> None:
        """Ask every worker to drain (SIGTERM: no new requests, those read answered); none
        is started any more.  The main process serves what comes meanwhile."""
        self.stopping = True
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGTERM)

    async def stop(self, deadline: float, *, asked_at: float | None = None) -> list[str]:
        """Ask every worker to drain (:meth:`ask_to_stop`, unless asked already) and wait
        for it until ``deadline`` (trio time: the mount's exit gives the drain that long,
        from ``asked_at``, the request to stop); kill those that did not exit.  What was
        cut short, for the mount's last line (a worker killed with requests in flight: the
        kernel fails them)."""
        procs = sorted(self.procs.items())
        if not self.stopping:
            self.ask_to_stop()
        began = trio.current_time() if asked_at is None else asked_at
        skipped = []
        with trio.CancelScope(shield=True):
            with trio.move_on_at(deadline):
                for _, proc in procs:
                    await proc.wait()
            for index, proc in procs:
                if proc.returncode is None:
                    note = (f"FUSE worker {index} (pid {proc.pid}) did not drain within "
                            f"{round(trio.current_time() - began, 1):g} s; killed")
                    log.warning("%s", note)
                    skipped.append(note)
                    with contextlib.suppress(OSError):
                        proc.kill()
                    await proc.wait()
        return skipped

    async def follow(self, changes: list) -> None:
        """Namespaces added, removed or resized on the target (a listener of host.events):
        send every worker the namespaces' sizes (:meth:`WorkerFS.follow`), and return once
        each serving one they were sent to says it took them (bounded:
        :attr:`sizes_timeout`), so that no worker serves a file by its old size after the
        kernel learned the new one."""
        companion = self.companion
        if companion is None:  # no worker runs yet
            return
        shapes = [] if self._too_many() else companion.namespace_shapes()
        self.generation += 1
        generation = self.generation
        told = await companion.tell(self.role, {"event": "namespaces", "namespaces": shapes,
                                                "generation": generation})
        # those sent it that serve (after: one that began to serve while we sent may have
        # built its files before it heard; one not serving yet takes these sizes, or its
        # lease's, before it does; one not sent it, leased after we passed it, has these in
        # its lease, and one whose send failed would never answer)
        pids = {session.pid for session in told}
        serving = {index: pid for index, pid in self.ready.items() if pid in pids}
        with trio.move_on_after(self.sizes_timeout):
            while self._late(serving, generation):
                await self.news.wait()
        for index, pid in self._late(serving, generation):
            log.warning("FUSE worker %d (pid %d) did not say it took the namespaces' new sizes "
                        "within %g s; it may serve by the old ones until it takes them",
                        index, pid, self.sizes_timeout)

    def _late(self, serving: dict[int, int], generation: int) -> list[tuple[int, int]]:
        """``(index, pid)`` of the workers of ``serving`` still running that have not taken
        the sizes of ``generation``."""
        late = []
        for index, pid in sorted(serving.items()):
            proc = self.procs.get(index)
            if proc is None or proc.pid != pid or proc.returncode is not None:
                continue  # ended: its replacement takes the sizes with its lease
            took_pid, took = self.taken.get(index, (0, 0))
            if took_pid != pid or took < generation:
                late.append((index, pid))
        return late

    def _tell_news(self) -> None:
        self.news.set()
        self.news = trio.Event()

    def _too_many(self) -> bool:
        """Whether the mount has more namespaces than the workers are sent (then they
        forward their I/O: said once)."""
        assert self.companion is not None  # (run() set it)
        count = len(self.companion.controller.namespaces)
        if count <= MAX_FOLLOWED_NAMESPACES:
            return False
        if not self.too_many_said:
            log.warning("FUSE workers: %d namespaces are more than the %d whose sizes they "
                        "are sent; they forward their I/O to the main process",
                        count, MAX_FOLLOWED_NAMESPACES)
            self.too_many_said = True
        return True

    # -- what workers forward ------------------------------------------------------------

    async def on_fuse(self, session: Sender, header: dict,
                      payload: bytes) -> dict[str, Any]:
        """A request a worker forwarded (``session``'s, a worker's: the companion server
        checked): ``meta`` (its reply bytes), ``read`` or ``write`` on a handle it cannot
        serve (the bytes, or the count; ``errno`` when refused); or it says it serves
        (``ready``) or took a rescan's sizes (``namespaces``), naming its own pid."""
        kind = header.get("kind")
        if kind in ("ready", "namespaces"):
            pid = field(header, "pid")
            if pid != session.pid:
                raise ProtocolError(f"fuse {kind}: pid {pid} is not the sender's "
                                    f"({session.pid})")
        if kind == "ready":  # connected its queues: it serves
            index, pid = field(header, "index"), field(header, "pid")
            self.ready[index] = pid
            log.info("FUSE worker %d (pid %d) serves on queues %s", index, pid,
                     ",".join(map(str, header.get("qids") or [])))
            self._too_many()  # its lease named no namespaces then
            return {}
        if kind == "namespaces":  # took the sizes of a rescan (follow waits for that)
            index, pid = field(header, "index"), field(header, "pid")
            generation = generation_field(header)
            if 0 < index < self.count:  # (any other is no worker of ours)
                self.taken[index] = (pid, generation)
                self._tell_news()
            return {}
        assert self.session is not None and self.ops is not None  # (run() set them)
        if kind == "meta":
            reply = await self.session.answer(field(header, "opcode"), field(header, "unique"),
                                              field(header, "nodeid"), payload)
            return {"_payload": reply}
        fh, offset = field(header, "fh"), field(header, "offset")
        try:
            if kind == "read":
                size = min(field(header, "size"), FORWARD_CHUNK)
                data = await self.ops.read(fh, offset, size)
                return {"_payload": bytes(data)}  # (lent: copied before we yield)
            if kind == "write":
                return {"written": await self.ops.write(fh, offset, payload)}
        except FUSEError as exc:
            return {"errno": exc.errno}
        except KeyError:
            return {"errno": errno.EBADF}
        return {"errno": errno.ENOSYS}
