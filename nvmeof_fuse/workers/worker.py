"""FUSE workers: more processes serving one mount's READs and WRITEs, each on its own queues.

Python threads share one core, so a mount scales with processes.  With ``--workers N`` the
main process (the daemon) is worker 0 and starts N-1 more; each reads requests from a /dev/fuse
descriptor of its own, cloned from the mount's (:func:`~nvmeof_fuse.fs.devfuse.clone_fd`).
A worker is a companion client of the main process: it leases I/O queue IDs over the
companion socket (on any transport: it moves data through bounce memory it registers
itself), connects them with the mount's controller ID (:func:`~nvmeof_fuse.host.attached.attach`,
which also follows reconnects and path changes), and serves READ and WRITE there
(:class:`~nvmeof_fuse.workers.fs.WorkerFS`).  Each write holds the main process's range
lock of its LBAs, the one every FUSE and companion write takes.  Every other request
(LOOKUP, OPEN, RELEASE, FLUSH, reads of ``.nvmeof``, ...) it forwards to the main process,
which answers it on its behalf: the worker sends the answer on its own descriptor, as the
kernel requires.  Each second it reports its counts, which ``.nvmeof/stats.json`` sums.

The main process (:class:`FuseWorkers`) keeps the admin queue, keep-alive, events,
reconnects and paths.  It replaces a worker that dies (the kernel fails the requests that
worker held, ECONNABORTED; its queue IDs come back with its companion session), gives up
after repeated deaths (serving alone), and on unmount asks each to drain and waits for it.

Run as ``python -m nvmeof_fuse.workers``, by the main process only.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import logging
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import trio

from nvmeof_fuse.companion.protocol import MAX_NAMED_NAMESPACES
from nvmeof_fuse.errors import NVMeoFError

log = logging.getLogger("nvmeof-fuse")

WORKER_QUEUES = 1
"""I/O queues each worker leases (one serves a queue depth of its full size)."""
WORKER_BOUNCE_BUFFERS = 32
"""Bounce buffers of a whole transfer each: one per request the kernel keeps in flight."""
REPORT_INTERVAL = 1.0  # s between a worker's reports of its counts
STOP_TIMEOUT = 30.0  # s for a worker to drain and exit once asked
RESTART_LIMIT = 3
"""Deaths in a row, each before the worker served, after which no more are started."""
MAX_REPORTED_NAMESPACES = 64
MAX_FOLLOWED_NAMESPACES = MAX_NAMED_NAMESPACES
"""Namespaces whose sizes a worker's lease and a rescan send the workers in one message;
past them the workers are sent none, so they forward all I/O."""
LOGGED_NAMESPACES = 8  # named in a worker's line after a rescan; the others are counted
SIZES_TIMEOUT = 10.0
"""Most seconds a rescan waits for the serving workers to say they took the new sizes,
before the mount's files show them (at most the mount's command timeout: a slow machine
may take seconds)."""


def worker_queues(workers: int) -> int:
    """Queue IDs a mount with ``workers`` workers reserves for them (the main has its own)."""
    return max(0, workers - 1) * WORKER_QUEUES


# --- the main process's side ------------------------------------------------------------


class FuseWorkers:
    """The worker processes of one mount, supervised by the main process."""

    def __init__(self, session: Any, ops: Any, companion: Any, count: int, *,
                 read_only: bool = False, timeout: float = 30.0, debug: bool = False) -> None:
        self.session = session  # the main process's FuseSession (its descriptor, its answers)
        self.ops = ops  # the main process's NamespaceFS
        self.companion = companion
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
        companion.on_fuse = self.on_fuse
        companion.worker_queues = worker_queues(count)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Start the workers and keep them running until :meth:`stop` (or cancelled: then
        they are killed)."""
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
        with trio.move_on_after(self.timeout):
            while self.companion.has_client(pid):
                await trio.sleep(0.1)

    async def _spawn(self, index: int) -> trio.Process:
        from nvmeof_fuse.fs.devfuse import clone_fd

        fd = clone_fd(self.session.fd)
        try:
            argv = [sys.executable, "-m", "nvmeof_fuse.workers", "--fd", str(fd),
                    "--socket", "@" + self.companion.address[1:], "--index", str(index),
                    "--timeout", repr(self.timeout)]
            if self.read_only:
                argv.append("--read-only")
            if self.debug:
                argv.append("--debug")
            proc = await trio.lowlevel.open_process(argv, pass_fds=(fd,))
        finally:
            os.close(fd)  # the worker holds it now: the kernel fails its requests if it dies
        self.started += 1
        log.info("FUSE worker %d started (pid %d)", index, proc.pid)
        return proc

    async def stop(self) -> None:
        """Ask every worker to drain (SIGTERM: no new requests, those read answered) and
        wait for it, bounded; kill those that did not exit."""
        self.stopping = True
        procs = list(self.procs.values())
        for proc in procs:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGTERM)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(STOP_TIMEOUT):
                for proc in procs:
                    await proc.wait()
            for proc in procs:
                if proc.returncode is None:
                    log.warning("FUSE worker pid %d did not drain within %g s; killed",
                                proc.pid, STOP_TIMEOUT)
                    with contextlib.suppress(OSError):
                        proc.kill()
                    await proc.wait()

    async def follow(self, changes: list) -> None:
        """Namespaces added, removed or resized on the target (a listener of host.events):
        send every worker the namespaces' sizes (:meth:`WorkerFS.follow`), and return once
        each serving one they were sent to says it took them (bounded:
        :attr:`sizes_timeout`), so that no worker serves a file by its old size after the
        kernel learned the new one."""
        shapes = [] if self._too_many() else self.companion.namespace_shapes()
        self.generation += 1
        generation = self.generation
        told = await self.companion.tell_workers({"event": "namespaces", "namespaces": shapes,
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

    async def on_fuse(self, header: dict, payload: bytes) -> dict[str, Any]:
        """A request a worker forwarded: ``meta`` (its reply bytes), ``read`` or ``write``
        on a handle it cannot serve (the bytes, or the count; ``errno`` when refused)."""
        from nvmeof_fuse.companion.protocol import field, generation_field
        from nvmeof_fuse.fs.wire import FUSEError
        from nvmeof_fuse.workers.fs import FORWARD_CHUNK

        kind = header.get("kind")
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


# --- the worker process ------------------------------------------------------------------


class _Worker:
    """One worker process: its companion channel, leased queues and FUSE session."""

    def __init__(self, args: argparse.Namespace) -> None:
        from nvmeof_fuse.companion.client.channel import SocketChannel

        self.args = args
        self.index = args.index
        self.timeout = args.timeout
        address = "\0" + args.socket[1:] if args.socket.startswith("@") else args.socket
        self.channel = SocketChannel(address, args.timeout)
        self.session: Any = None
        self.ctrl: Any = None
        self.fs: Any = None
        self.shapes: dict[int, tuple[int, int]] | None = None  # heard before self.fs was made
        self.lost = trio.Event()  # the main process went away

    async def ask(self, op: str, timeout: float | None = None, payload: bytes = b"",
                  **fields: Any) -> dict:
        from nvmeof_fuse.companion import protocol
        from nvmeof_fuse.companion.client.own_queues import wait_future

        future = self.channel.call_future(op, payload=payload, **fields)
        limit = self.timeout if timeout is None else timeout
        try:
            header = await wait_future(future, limit)
        except trio.TooSlowError:
            raise protocol.NoAnswer(f"the main process did not answer {op} within "
                                    f"{limit:g} s") from None
        return protocol.raise_for_reply(header)

    async def serve(self) -> None:
        from nvmeof_fuse.companion.client.lease import lease_from, options_from, renew_timeout
        from nvmeof_fuse.host.attached import attach
        from nvmeof_fuse.host.controller import make_transport

        token = trio.lowlevel.current_trio_token()
        self.channel.on_closed = lambda: token.run_sync_soon(self._main_gone)
        # from the lease on: a rescan's sizes are kept until our filesystem takes them
        self.channel.on_event = lambda event: token.run_sync_soon(self._on_event, event)
        # asks for no nsids: names all namespaces while the mount has at most
        # MAX_FOLLOWED_NAMESPACES, else none (and we forward their I/O)
        first = await self.ask("lease", want=WORKER_QUEUES, worker=True)
        options = options_from(first, self.timeout)
        leases = [lease_from(first)]

        async def lease_source() -> Any:
            if leases:
                return leases.pop()
            return lease_from(await self.ask("lease", renew_timeout(options),
                                             want=WORKER_QUEUES, worker=True))

        async with attach(options, lease_source, make_transport(options),
                          bounce_buffers=WORKER_BOUNCE_BUFFERS) as ctrl:
            self.ctrl = ctrl
            await self.ask("fuse", kind="ready", index=self.index, pid=os.getpid(),
                           qids=list(first["qids"]))
            await self._serve_fuse(ctrl)

    async def _serve_fuse(self, ctrl: Any) -> None:
        from nvmeof_fuse.fs.mount import MAX_BACKGROUND, MAX_WRITE
        from nvmeof_fuse.fs.mount_options import MountOptions
        from nvmeof_fuse.fs.session import FuseSession
        from nvmeof_fuse.fs.wire import InitParams
        from nvmeof_fuse.workers.fs import WorkerFS

        self.fs = fs = WorkerFS(
            ctrl, MountOptions(read_only=self.args.read_only), forward_read=self._forward_read,
            forward_write=self._forward_write, write_lock=self._write_lock)
        if self.shapes is not None:  # the main process rescanned while we connected
            self._follow(self.shapes)
        self.session = session = FuseSession(
            fs, self.args.fd, InitParams(max_write=MAX_WRITE, max_background=MAX_BACKGROUND),
            debug=self.args.debug, forward=self._forward_meta, shared=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_on_signal)
            nursery.start_soon(self._report, ctrl, fs)
            if self.lost.is_set():
                session.stop_reading()
            await session.run()
            nursery.cancel_scope.cancel()

    def _main_gone(self) -> None:
        """The main process closed our channel (it died, or is done): stop at once, so
        that the mount's connection ends with it."""
        self.lost.set()
        if self.session is not None:
            self.session.stop_reading()

    async def _stop_on_signal(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                self.session.stop_reading()  # answer what was read, then exit
                return

    def _on_event(self, event: dict) -> None:
        """The main process rescanned the namespaces (take their sizes, and say so: it waits
        for that), or lost the controller or our path (reconnect our queues)."""
        from nvmeof_fuse.companion.protocol import ProtocolError, generation_field
        from nvmeof_fuse.errors import TransportError

        if event.get("event") == "namespaces":
            shapes = _shapes(event.get("namespaces"))
            if shapes is None:
                return
            if self.fs is None:
                self.shapes = shapes  # our filesystem takes them before it serves
            else:
                self._follow(shapes)
            try:  # (a main process of another version may send none: it waits for no ack)
                generation = generation_field(event)
            except ProtocolError:
                return
            with contextlib.suppress(NVMeoFError):  # the main process is gone
                self.channel.call_future("fuse", kind="namespaces", index=self.index,
                                         pid=os.getpid(), generation=generation)
            return
        ctrl = self.ctrl
        if event.get("event") != "revoked" or ctrl is None or not ctrl.io_queues:
            return
        log.info("FUSE worker %d: the main process lost the controller (%s): reconnecting "
                 "our queues", self.index, event.get("state"))
        ctrl.connection_lost(ctrl.io_queues[0], TransportError(
            "the main process lost the controller; our queues were revoked"))

    def _follow(self, shapes: dict[int, tuple[int, int]]) -> None:
        self.fs.follow(shapes)
        named = sorted(shapes.items())[:LOGGED_NAMESPACES]
        more = len(shapes) - len(named)
        log.info("FUSE worker %d: namespaces now %s%s", self.index, ", ".join(
            f"n{nsid} {lba_size * nlb} bytes" for nsid, (lba_size, nlb) in named) or "none",
            f" and {more} more" if more else "")

    async def _report(self, ctrl: Any, fs: Any) -> None:
        while True:
            namespaces = {f"n{nsid}": ns.stats.snapshot() for nsid, ns in
                          sorted(ctrl.namespaces.items())[:MAX_REPORTED_NAMESPACES]}
            with contextlib.suppress(NVMeoFError):
                self.channel.call_future("report", worker={
                    "index": self.index, "pid": os.getpid(), "state": ctrl.state,
                    "reconnects": ctrl.reconnects, "forwarded": fs.forwarded,
                    "namespaces": namespaces})
            await trio.sleep(REPORT_INTERVAL)

    async def _forward_meta(self, opcode: int, unique: int, nodeid: int,
                            request: bytes) -> bytes:
        reply = await self.ask("fuse", payload=request, kind="meta", opcode=opcode,
                               unique=unique, nodeid=nodeid)
        return reply.get("_payload", b"")

    async def _forward_read(self, fh: int, offset: int, size: int) -> bytes:
        reply = await self.ask("fuse", kind="read", fh=fh, offset=offset, size=size)
        self._raise_errno(reply)
        return reply.get("_payload", b"")

    async def _forward_write(self, fh: int, offset: int, data: bytes) -> int:
        reply = await self.ask("fuse", payload=data, kind="write", fh=fh, offset=offset)
        self._raise_errno(reply)
        return int(reply.get("written", 0))

    @staticmethod
    def _raise_errno(reply: dict) -> None:
        from nvmeof_fuse.fs.wire import FUSEError

        if reply.get("errno"):
            raise FUSEError(int(reply["errno"]))

    @contextlib.asynccontextmanager
    async def _write_lock(self, nsid: int, offset: int, length: int) -> AsyncIterator[None]:
        """The main process's range lock of a write's bytes, given back without waiting."""
        from nvmeof_fuse.companion.client.own_queues import wait_future
        from nvmeof_fuse.companion.protocol import NoAnswer, raise_for_reply

        future = self.channel.call_future("lock", nsid=nsid, offset=offset, length=length,
                                          hold_s=math.ceil(self.timeout), keep_cache=True)
        try:
            header = await wait_future(future, self.timeout)
        except BaseException as exc:
            future.add_done_callback(functools.partial(self._unlock_late, nsid))
            if isinstance(exc, trio.TooSlowError):
                raise NoAnswer(f"the main process did not grant a write lock within "
                               f"{self.timeout:g} s") from None
            raise
        token = raise_for_reply(header)["token"]
        try:
            yield
        finally:
            self._unlock(token, nsid)

    def _unlock(self, token: int, nsid: int) -> None:
        with contextlib.suppress(NVMeoFError):  # the main process is gone, the lock with it
            self.channel.call_future("unlock", token=token, nsid=nsid)

    def _unlock_late(self, nsid: int, future: Any) -> None:
        if future.exception() is None and future.result().get("ok"):
            self._unlock(future.result()["token"], nsid)

    def close(self) -> None:
        self.channel.close()
        if self.session is not None:
            self.session.close()
        else:
            os.close(self.args.fd)


def _shapes(value: Any) -> dict[int, tuple[int, int]] | None:
    """``{nsid: (lba_size, nlb)}`` out of a ``namespaces`` event's list of ``[nsid,
    lba_size, nlb]`` (:meth:`CompanionServer.namespace_shapes`); None when it is not one."""
    if not isinstance(value, list):
        return None
    shapes = {}
    for item in value:
        if (not isinstance(item, list) or len(item) != 3
                or not all(type(v) is int and v >= 0 for v in item) or not item[1]):
            return None
        shapes[item[0]] = (item[1], item[2])
    return shapes


async def _serve_worker(args: argparse.Namespace) -> int:
    worker = _Worker(args)
    try:
        await worker.serve()
    except NVMeoFError as exc:
        log.error("FUSE worker %d: %s", args.index, exc)
        return 1
    finally:
        worker.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nvmeof-fuse worker", description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="cloned /dev/fuse descriptor")
    parser.add_argument("--socket", required=True, help="the main process's companion socket")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--read-only", action="store_true")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format=f"nvmeof-fuse worker {args.index}: %(message)s")
    os.set_inheritable(args.fd, False)
    try:
        return trio.run(_serve_worker, args)
    except KeyboardInterrupt:
        return 1


if __name__ == "__main__":
    sys.exit(main())
