"""A FUSE worker process: READ and WRITE of one mount on queues of its own.

Python threads share one core, so a mount scales with processes (``--workers N``).  Its main
process (:mod:`.supervisor`) starts each worker with a /dev/fuse descriptor of its own,
cloned from the mount's.  A worker is a companion client of the main process
(:mod:`.messages`): it leases I/O queue IDs over the companion socket (on any transport: it
moves data through bounce memory it registers itself), connects them with the mount's
controller ID (:func:`~nvmeof_fuse.host.attached.attach`, which also follows reconnects and
path changes), and serves READ and WRITE there (:class:`~nvmeof_fuse.workers.fs.WorkerFS`).
Each write takes its LBAs' range lock itself, in the mount's file of range locks that
the main process handed it (``--range-locks``,
:mod:`~nvmeof_fuse.host.namespace.sharedranges`), which every FUSE and companion write of
the mount takes: no message to the main process.  Every other request (LOOKUP, OPEN,
RELEASE, FLUSH, reads of
``.nvmeof``, ...) it forwards to the main process, which answers it on its behalf: the
worker sends the answer on its own descriptor, as the kernel requires.  Each second it
reports its counts, which ``.nvmeof/stats.json`` sums.

Run as ``python -m nvmeof_fuse.workers``, by the main process only.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

import trio

from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.ratelimit import RateLimitedLog, brief_list, cap_lines
from nvmeof_fuse.workers.messages import ROLE_FLAG, WORKER_QUEUES, parse_shapes

if TYPE_CHECKING:
    from nvmeof_fuse.fs.session import FuseSession
    from nvmeof_fuse.host.attached import AttachedController, Lease
    from nvmeof_fuse.workers.fs import WorkerFS

log = logging.getLogger("nvmeof-fuse")
limited = RateLimitedLog(log)

WORKER_BOUNCE_BUFFERS = 32
"""Bounce buffers of a whole transfer each: one per request the kernel keeps in flight."""
REPORT_INTERVAL = 1.0  # s between a worker's reports of its counts
MAX_REPORTED_NAMESPACES = 64
TO_MAIN_KINDS = ("lease", "ready", "namespaces", "report", "meta", "read", "write")
"""What a worker sends the main process, as its report counts them: ``lease`` (its first,
and again after each loss), ``ready``, ``namespaces`` (a rescan's sizes taken) and
``report`` go with its life, not with requests; ``meta`` (a request other than READ and
WRITE, forwarded), ``read`` and ``write`` (a forwarded piece of a READ or WRITE it could
not serve on its own queues) are sent because of a request."""
PER_REQUEST_KINDS = ("meta", "read", "write")


class _Worker:
    """One worker process: its companion channel, leased queues and FUSE session."""

    def __init__(self, args: argparse.Namespace) -> None:
        from nvmeof_fuse.companion.client.channel import SocketChannel

        self.args = args
        self.index = args.index
        self.timeout = args.timeout
        address = "\0" + args.socket[1:] if args.socket.startswith("@") else args.socket
        self.channel = SocketChannel(address, args.timeout)
        self.session: FuseSession | None = None
        self.ctrl: AttachedController | None = None
        self.fs: WorkerFS | None = None
        self.shapes: dict[int, tuple[int, int]] | None = None  # heard before self.fs was made
        self.lost = trio.Event()  # the main process went away
        # messages sent the main process, by kind (TO_MAIN_KINDS), and forwarded requests
        # by opcode: an increment of a preset key per message, nothing made per request
        self.to_main = dict.fromkeys(TO_MAIN_KINDS, 0)
        self.meta_to_main: dict[int, int] = {}

    def send(self, op: str, **fields: Any) -> Any:
        """Send the main process ``op`` (its reply's future), counted by kind (a ``fuse``
        request's, else ``op``): every message of ours passes here (:meth:`counts`)."""
        kind = fields.get("kind", op)
        to_main = self.to_main
        to_main[kind] = to_main.get(kind, 0) + 1
        if kind == "meta":
            opcode = fields["opcode"]
            self.meta_to_main[opcode] = self.meta_to_main.get(opcode, 0) + 1
        return self.channel.call_future(op, **fields)

    async def ask(self, op: str, timeout: float | None = None, payload: bytes = b"",
                  **fields: Any) -> dict:
        from nvmeof_fuse.companion import protocol
        from nvmeof_fuse.companion.client.own_queues import wait_future

        future = self.send(op, payload=payload, **fields)
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
        from nvmeof_fuse.host.namespace.sharedranges import SharedRanges, share_range_locks

        token = trio.lowlevel.current_trio_token()
        self.channel.on_closed = lambda: token.run_sync_soon(self._main_gone)
        # from the lease on: a rescan's sizes are kept until our filesystem takes them
        self.channel.on_event = lambda event: token.run_sync_soon(self._on_event, event)
        # asks for no nsids: names all namespaces while the mount has at most
        # MAX_FOLLOWED_NAMESPACES, else none (and we forward their I/O)
        first = await self.ask("lease", want=WORKER_QUEUES, **{ROLE_FLAG: True})
        options = options_from(first, self.timeout)  # the mount's timeout: we had it (--timeout)
        leases = [lease_from(first)]

        async def lease_source() -> Lease:
            if leases:
                return leases.pop()
            return lease_from(await self.ask("lease", renew_timeout(options),
                                             want=WORKER_QUEUES, **{ROLE_FLAG: True}))

        async with attach(options, lease_source, make_transport(options),
                          bounce_buffers=WORKER_BOUNCE_BUFFERS) as ctrl:
            share_range_locks(ctrl, SharedRanges(self.args.range_locks, self.timeout))
            self.ctrl = ctrl
            await self.ask("fuse", kind="ready", index=self.index, pid=os.getpid(),
                           qids=list(first["qids"]))
            await self._serve_fuse(ctrl)

    async def _serve_fuse(self, ctrl: AttachedController) -> None:
        from nvmeof_fuse.fs.mount import MAX_BACKGROUND, MAX_WRITE
        from nvmeof_fuse.fs.mount_options import MountOptions
        from nvmeof_fuse.fs.session import FuseSession
        from nvmeof_fuse.fs.wire import InitParams
        from nvmeof_fuse.workers.fs import WorkerFS

        self.fs = fs = WorkerFS(
            ctrl, MountOptions(read_only=self.args.read_only), forward_read=self._forward_read,
            forward_write=self._forward_write)
        if self.shapes is not None:  # the main process rescanned while we connected
            self._follow(self.shapes)
        self.session = session = FuseSession(
            fs, self.args.fd, InitParams(max_write=MAX_WRITE, max_background=MAX_BACKGROUND),
            debug=self.args.debug, forward=self._forward_meta, shared=True,
            in_flight_limit=MAX_BACKGROUND)
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
                if self.session is not None:
                    self.session.stop_reading()  # answer what was read, then exit
                return

    def _on_event(self, event: dict) -> None:
        """The main process rescanned the namespaces (take their sizes, and say so: it waits
        for that), or lost the controller or our path (reconnect our queues)."""
        from nvmeof_fuse.companion.protocol import ProtocolError, generation_field
        from nvmeof_fuse.errors import TransportError

        if event.get("event") == "namespaces":
            shapes = parse_shapes(event.get("namespaces"))
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
                self.send("fuse", kind="namespaces", index=self.index,
                                         pid=os.getpid(), generation=generation)
            return
        ctrl = self.ctrl
        if event.get("event") != "revoked" or ctrl is None or not ctrl.io_queues:
            return
        limited.log("revoked", logging.INFO, "FUSE worker %d: the main process lost the "
                    "controller (%s): reconnecting our queues", self.index, event.get("state"))
        ctrl.connection_lost(ctrl.io_queues[0], TransportError(
            "the main process lost the controller; our queues were revoked"))

    def _follow(self, shapes: dict[int, tuple[int, ...]]) -> None:
        assert self.fs is not None
        self.fs.follow(shapes)
        limited.log("namespaces", logging.INFO, "FUSE worker %d: namespaces now %s",
                    self.index, brief_list(f"n{nsid} {shape[0] * shape[1]} bytes"
                                           for nsid, shape in sorted(shapes.items()))
                    or "none")

    async def _report(self, ctrl: AttachedController, fs: WorkerFS) -> None:
        while True:
            namespaces = {f"n{nsid}": ns.stats.snapshot() for nsid, ns in
                          sorted(ctrl.namespaces.items())[:MAX_REPORTED_NAMESPACES]}
            report = {"index": self.index, "pid": os.getpid(), "state": ctrl.state,
                      "reconnects": ctrl.reconnects, "forwarded": fs.forwarded,
                      **self.counts(), "namespaces": namespaces}
            tls = ctrl.connection_snapshot().get("tls")  # its own queues' records
            if tls is not None:
                report["tls"] = tls
            with contextlib.suppress(NVMeoFError):
                self.send("report", **{ROLE_FLAG: report})
            await trio.sleep(REPORT_INTERVAL)

    def counts(self) -> dict[str, Any]:
        """The requests this worker read and the messages it sent the main process, by
        kind (``meta OPCODE`` for each forwarded opcode), and those sent because of a
        request per request read (``to_main_per_request``): where a mount's requests
        still wait for the main process (issue #60)."""
        from nvmeof_fuse.fs.wire import opcode_name

        session = self.session
        requests = session.requests if session is not None else 0
        sent = {**self.to_main, **{f"meta {opcode_name(op)}": n
                                   for op, n in sorted(self.meta_to_main.items())}}
        per_request = sum(self.to_main[kind] for kind in PER_REQUEST_KINDS)
        return {"requests": requests, "parks": session.parks if session is not None else 0,
                "full_waits": session.full_waits if session is not None else 0,
                "to_main": sent,
                "to_main_per_request": round(per_request / requests, 4) if requests else 0.0}

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

    def close(self) -> None:
        self.channel.close()
        if self.session is not None:
            self.session.close()
        else:
            os.close(self.args.fd)


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
    parser.add_argument("--range-locks", type=int, required=True,
                        help="the mount's file of range locks (a memfd)")
    parser.add_argument("--read-only", action="store_true")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format=f"nvmeof-fuse worker {args.index}: %(message)s")
    cap_lines()
    os.set_inheritable(args.fd, False)
    os.set_inheritable(args.range_locks, False)
    try:
        return trio.run(_serve_worker, args)
    except KeyboardInterrupt:
        return 1


if __name__ == "__main__":
    sys.exit(main())
