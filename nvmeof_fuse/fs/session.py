"""Our FUSE session on ``/dev/fuse``: read requests, answer them.

The protocol is :mod:`nvmeof_fuse.fs.wire`; the answers come from an operations object
(:class:`nvmeof_fuse.fs.operations.NamespaceFS`); tasks read and run the requests,
leader/follower (:class:`~.requestloop.RequestLoop`); the descriptor comes from
:mod:`.devfuse`.  Each reply goes out with one ``writev`` (a READ's data straight from the
buffer the namespace lends, before the task yields again).
A WRITE's data is read into a buffer of its own, which the write task owns until it
completes, so it is never copied here.  Those buffers are page-aligned and reused: see
:func:`receive_buffer`.
A READ or WRITE that arrives while others are in flight runs no task at all where the
namespace can start it with a callback (one command, a free bounce buffer, a free range
lock): the reaper that sees its completion sends the reply (:meth:`FuseSession._start_read`);
one that fails goes back to the request loop and runs as above.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import select
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from nvmeof_fuse.fs import wire
from nvmeof_fuse.fs.requestloop import RequestLoop, SessionEnded
from nvmeof_fuse.fs.wire import (
    IN_HEADER,
    IN_HEADER_SIZE,
    READ,
    READ_IN,
    WRITE,
    WRITE_HEADERS,
    WRITE_IN,
    FUSEError,
)

log = logging.getLogger(__name__)


def receive_buffer(size: int) -> mmap.mmap:
    """A buffer that /dev/fuse reads a request's data into: page-aligned (an anonymous
    mapping), so that the kernel's copy of WRITE data runs page onto page; into a bytearray
    (16 bytes off a cache line) it cost far more CPU (docs/performance-history.md)."""
    return mmap.mmap(-1, size)


Forward = Callable[[int, int, int, bytes], Awaitable[bytes]]
"""``forward(opcode, unique, nodeid, request)``: the reply of a request another process
answers (a FUSE worker's metadata goes to the main process)."""


class FuseSession:
    """Serves ``ops`` on the /dev/fuse descriptor ``fd`` (which it closes in :meth:`close`).

    ``ops`` has NamespaceFS's methods: lookup, getattr, setattr, statfs, opendir, readdir,
    releasedir, open, read, write, flush, fsync, release, and the tree-changing ones (which
    refuse).  Its handlers raise :class:`wire.FUSEError` to answer with an errno.
    """

    def __init__(self, ops: Any, fd: int, params: wire.InitParams | None = None,
                 debug: bool = False, forward: Forward | None = None,
                 shared: bool = False, in_flight_limit: int = 0) -> None:
        self.ops = ops
        self.forward = forward
        """Set in a FUSE worker: what answers the requests other than READ and WRITE (the
        main process, which holds the handles and the ``.nvmeof`` reports)."""
        # Where ops can start I/O with a callback (NamespaceFS over a Controller; not over
        # RAM, whose I/O answers in its task): else no request pays for trying.
        starts = getattr(ops, "starts_io", False)
        self._start_read_op = ops.start_read if starts else None
        self._start_write_op = ops.start_write if starts else None
        self._in_flight = 0  # READs and WRITEs read and not yet answered
        self.requests = 0
        """Requests this process read off the connection (with FUSE workers, its share: the
        denominator of a worker's messages to the main process per request)."""
        self._parks = 0  # of the request loops that ended
        self._full_waits = 0  # of the request loops that ended
        # With other processes on the connection: requests this one holds at most before
        # it leaves the rest to them (RequestLoop's limit; 0: as many as the kernel sends)
        self._limit = in_flight_limit if shared else 0
        self.fd = fd
        # ``shared``: other processes read this connection too (FUSE workers).  Each parks
        # on an epoll of its own that waits on the descriptor exclusively (EPOLLEXCLUSIVE),
        # so that a request wakes one of them, not all.
        self._exclusive: select.epoll | None = None
        if shared:
            self._exclusive = select.epoll()
            self._exclusive.register(fd, select.EPOLLIN | select.EPOLLEXCLUSIVE)
        self.params = params = params or wire.InitParams()
        self.debug = debug
        self.negotiated: wire.Negotiated | None = None
        self.gone = False  # the kernel ended the session (unmounted): nothing to unmount
        self.initialized = trio.Event()
        self._loop: RequestLoop | None = None  # while run() serves
        self._stopped = False  # stop_reading() was called
        # Receive buffers of WRITE data, for reuse (the most recently freed first, still
        # in the cache): at most one per request the kernel lets us hold (max_background
        # and the synchronous ones) plus the one being read into.
        self._free: list[mmap.mmap] = []
        self._bufsize = params.max_write + wire.PAGE
        # Where every request is read to: fuse_in_header + the biggest fixed args we unpack,
        # then a WRITE's data.  One pair serves all readers: each request is parsed (and
        # what it needs copied out, or the data buffer handed over) before anyone reads again.
        self._bufs: list[Any] = [bytearray(WRITE_HEADERS), None]
        os.set_blocking(fd, False)

    # --- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until the kernel ends the session or :meth:`stop_reading`, then wait for
        the requests still in flight."""
        if self._stopped:
            return
        try:
            async with trio.open_nursery() as nursery:
                park = self.fd if self._exclusive is None else self._exclusive.fileno()
                self._loop = RequestLoop(nursery, park, self._next_request, self._limit)
                self._loop.start()
        finally:
            if self._loop is not None:
                self._parks += self._loop.parks
                self._full_waits += self._loop.full_waits
            self._loop = None

    @property
    def parks(self) -> int:
        """Times this process waited for the kernel to hand it a request: per request, the
        cost of a wake-up each request bears (more processes sharing the connection each
        see fewer requests per wake-up)."""
        return self._parks + (self._loop.parks if self._loop is not None else 0)

    @property
    def full_waits(self) -> int:
        """Times this process, sharing the connection, held as many requests as it serves
        at once and left the next to the others (RequestLoop's ``limit``)."""
        return self._full_waits + (self._loop.full_waits if self._loop is not None else 0)

    def stop_reading(self) -> None:
        """Take no new requests; :meth:`run` returns once those in flight are answered."""
        self._stopped = True
        if self._loop is not None:
            self._loop.close()

    def _take(self) -> mmap.mmap:
        return self._free.pop() if self._free else receive_buffer(self._bufsize)

    def _next_request(self) -> tuple[Callable[..., Awaitable[None]], tuple[Any, ...]] | None:
        """Read one request: its handler and arguments, or None when it needs none
        (answered here, no answer due, or interrupted).  Raises BlockingIOError when none
        is queued and SessionEnded when the kernel ends the session."""
        bufs = self._bufs
        if bufs[1] is None:
            bufs[1] = self._take()
        try:
            n = os.readv(self.fd, bufs)
        except BlockingIOError:
            raise
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.ENOENT):  # ENOENT: interrupted meanwhile
                return None
            if exc.errno == errno.ENODEV:  # unmounted: the kernel ended the session
                self.gone = True
                raise SessionEnded from None
            raise
        head = bufs[0]
        if n < IN_HEADER_SIZE:  # 0: the other end closed (only a test's fake kernel does that)
            if n == 0:
                self.gone = True
                raise SessionEnded
            log.warning("ignored a FUSE request of %d bytes", n)
            return None
        _, opcode, unique, nodeid, _, _, _, _, _ = IN_HEADER.unpack_from(head)
        self.requests += 1
        if opcode == READ:
            fh, offset, size, _ = READ_IN.unpack_from(head, IN_HEADER_SIZE)
            self._in_flight += 1
            if (self._in_flight > 1 and self._start_read_op is not None
                    and self._start_read(unique, fh, offset, size)):
                return None
            return self._read, (unique, fh, offset, size)
        if opcode == WRITE:  # its data is at the start of the data buffer, now the write's
            fh, offset, size, _ = WRITE_IN.unpack_from(head, IN_HEADER_SIZE)
            data = bufs[1]
            bufs[1] = None
            self._in_flight += 1
            if (self._in_flight > 1 and self._start_write_op is not None
                    and self._start_write(unique, fh, offset, size, data)):
                return None
            return self._write, (unique, fh, offset, size, data)
        request = bytes(head[:n]) if n <= WRITE_HEADERS else (
            bytes(head) + bytes(memoryview(bufs[1])[: n - WRITE_HEADERS]))
        if opcode in wire.NO_REPLY:
            return None  # FORGET, BATCH_FORGET (the tree is fixed), INTERRUPT
        if opcode == wire.INIT:
            self._init(unique, request)
            return None
        if opcode == wire.DESTROY:
            self._send(wire.empty_reply(unique))
            self.gone = True
            raise SessionEnded
        return self._meta, (opcode, unique, nodeid, request)

    def _init(self, unique: int, request: bytes) -> None:
        try:
            self.negotiated, body = wire.negotiate(request, self.params)
        except wire.ProtocolError as exc:
            log.error("FUSE INIT: %s", exc)
            self._send(wire.error_reply(unique, errno.EPROTO))
            return
        self._send(wire.reply(unique, body))
        log.debug("FUSE %d.%d, flags %#x", self.negotiated.major, self.negotiated.minor,
                  self.negotiated.flags)
        self.initialized.set()

    # --- replies ---------------------------------------------------------------------------

    def _send(self, *parts: bytes | bytearray | memoryview) -> None:
        try:
            os.writev(self.fd, parts)
        except OSError as exc:
            # ENOENT: the request was interrupted and is gone; ENODEV: unmounted meanwhile.
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("cannot answer a FUSE request: %s", exc)

    def _fail(self, unique: int, exc: BaseException, what: str) -> None:
        if isinstance(exc, FUSEError):
            self._send(wire.error_reply(unique, exc.errno))
        else:
            log.error("%s failed", what, exc_info=exc)
            self._send(wire.error_reply(unique, errno.EIO))

    def _start_read(self, unique: int, fh: int, offset: int, size: int) -> bool:
        """Start a READ that a callback answers when the target has (``ops.start_read``):
        no task waits for it, and none is woken to answer it.  Called only while other
        READs or WRITEs are in flight: alone, one is better served by its task, which polls
        for its completion (and then for the next request), so that a QD1 client does not
        wait for a wake-up per request.  False: run :meth:`_read`."""
        loop, start = self._loop, self._start_read_op
        assert loop is not None and start is not None  # a task reads; the caller checked

        def answer(data: memoryview | None) -> None:
            try:
                if data is None:  # failed: _read runs it again, for a retry or the errno
                    loop.end((self._read, (unique, fh, offset, size)))
                else:
                    self._in_flight -= 1
                    self._send_data(unique, data)
                    loop.end()
            except Exception as exc:  # noqa: BLE001 -- called by a queue's reaper, which must go on
                log.warning("cannot answer a FUSE read of %d bytes at %d: %s", size, offset, exc)

        if not start(fh, offset, size, answer):
            return False
        loop.begin()
        return True

    async def _read(self, unique: int, fh: int, offset: int, size: int) -> None:
        try:
            data = await self.ops.read(fh, offset, size)
        except Exception as exc:  # noqa: BLE001 -- every failure becomes the request's errno
            self._fail(unique, exc, f"read of {size} bytes at {offset}")
            return
        finally:
            self._in_flight -= 1
        self._send_data(unique, data)  # lent data: sent before this task yields again

    def _send_data(self, unique: int, data: bytes | memoryview) -> None:
        try:
            os.writev(self.fd, (wire.out_header(unique, len(data)), data))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("cannot answer a FUSE read: %s", exc)

    def _start_write(self, unique: int, fh: int, offset: int, size: int,
                     buf: mmap.mmap) -> bool:
        """Start a WRITE that a callback answers once the target has its data
        (``ops.start_write``), as :meth:`_start_read`.  False: run :meth:`_write`."""
        loop, start = self._loop, self._start_write_op
        assert loop is not None and start is not None  # a task reads; the caller checked

        def answer(landed: bool) -> None:
            try:
                if not landed:  # failed: _write runs it again, for a retry or the errno
                    loop.end((self._write, (unique, fh, offset, size, buf)))
                else:
                    self._in_flight -= 1
                    self._send(wire.write_reply(unique, size))
                    self._free.append(buf)
                    loop.end()
            except Exception as exc:  # noqa: BLE001 -- called by a queue's reaper, which must go on
                log.warning("cannot answer a FUSE write of %d bytes at %d: %s", size, offset,
                            exc)

        if not start(fh, offset, memoryview(buf)[:size], answer):
            return False
        loop.begin()
        return True

    async def _write(self, unique: int, fh: int, offset: int, size: int,
                     buf: mmap.mmap) -> None:
        try:
            written = await self.ops.write(fh, offset, memoryview(buf)[:size])
        except Exception as exc:  # noqa: BLE001
            self._fail(unique, exc, f"write of {size} bytes at {offset}")
        else:
            self._send(wire.write_reply(unique, written))
        finally:
            self._in_flight -= 1
        self._free.append(buf)

    async def _meta(self, opcode: int, unique: int, nodeid: int, request: bytes) -> None:
        if self.debug:
            log.debug("FUSE opcode %d unique %d node %d", opcode, unique, nodeid)
        if self.forward is not None:
            try:
                reply = await self.forward(opcode, unique, nodeid, request)
            except Exception as exc:  # noqa: BLE001 -- the main process is gone: EIO
                log.warning("FUSE opcode %d: the main process did not answer: %s", opcode, exc)
                reply = wire.error_reply(unique, errno.EIO)
            self._send(reply)
            return
        self._send(await self.answer(opcode, unique, nodeid, request))

    async def answer(self, opcode: int, unique: int, nodeid: int, request: bytes) -> bytes:
        """The reply to a request other than READ and WRITE (also one a worker forwarded):
        an error reply when it fails."""
        try:
            return await self._dispatch(opcode, unique, nodeid, request)
        except FUSEError as exc:
            return wire.error_reply(unique, exc.errno)
        except Exception as exc:  # noqa: BLE001
            log.error("FUSE opcode %d failed", opcode, exc_info=exc)
            return wire.error_reply(unique, errno.EIO)

    async def _dispatch(self, opcode: int, unique: int, nodeid: int, request: bytes) -> bytes:
        ops = self.ops
        if opcode == wire.GETATTR:
            return wire.attr_reply(unique, await ops.getattr(nodeid, self._ctx(request)))
        if opcode == wire.LOOKUP:
            name = wire.parse_name(request)
            return wire.entry_reply(unique, await ops.lookup(nodeid, name, self._ctx(request)))
        if opcode == wire.OPEN:
            fi = await ops.open(nodeid, wire.parse_open(request), self._ctx(request))
            return wire.open_reply(unique, fi.fh, fi.open_flags)
        if opcode in (wire.RELEASE, wire.FLUSH, wire.RELEASEDIR, wire.FSYNCDIR):
            fh = wire.parse_fh(request, opcode)
            if opcode == wire.RELEASE:
                await ops.release(fh)
            elif opcode == wire.FLUSH:
                await ops.flush(fh)
            elif opcode == wire.RELEASEDIR:
                await ops.releasedir(fh)
            return wire.empty_reply(unique)
        if opcode == wire.FSYNC:
            await ops.fsync(*wire.parse_fsync(request))
            return wire.empty_reply(unique)
        if opcode == wire.SETATTR:
            attr, fields, fh = wire.parse_setattr(request)
            return wire.attr_reply(unique, await ops.setattr(nodeid, attr, fields, fh,
                                                             self._ctx(request)))
        if opcode == wire.OPENDIR:
            return wire.open_reply(unique, await ops.opendir(nodeid, self._ctx(request)))
        if opcode == wire.READDIR:
            fh, offset, size = wire.parse_read(request)
            entries = wire.DirBuffer(size)
            await ops.readdir(fh, offset, entries)
            return entries.reply(unique)
        if opcode == wire.STATFS:
            return wire.statfs_reply(unique, await ops.statfs(self._ctx(request)))
        if opcode in wire.TREE_CHANGES:
            await getattr(ops, wire.TREE_CHANGES[opcode])()  # refused: the tree is fixed
        raise FUSEError(errno.ENOSYS)

    @staticmethod
    def _ctx(request: bytes) -> wire.RequestContext:
        return wire.parse_header(request).ctx

    # --- notifications ---------------------------------------------------------------------

    async def notify(self, message: bytes) -> None:
        """Send a notification; in a thread, as the kernel may wait on pages that this
        session's loop must serve first.  Raises OSError (ENOENT: nothing cached)."""
        fd = self.fd
        await trio.to_thread.run_sync(os.write, fd, message, abandon_on_cancel=True)

    async def invalidate_inode(self, inode: int, attr_only: bool = False, offset: int = 0,
                               length: int = 0) -> None:
        """Drop ``inode``'s attributes, and its cached pages from ``offset`` (``length`` 0:
        to the end) unless ``attr_only``."""
        await self.notify(wire.inval_inode(inode, -1 if attr_only else offset, length))

    async def invalidate_entry(self, parent: int, name: bytes) -> None:
        await self.notify(wire.inval_entry(parent, name))

    def close(self) -> None:
        if self._exclusive is not None:
            self._exclusive.close()
            self._exclusive = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
