"""How a :class:`~nvmeof_fuse.companion.client.file.File` reaches the mount daemon.

:class:`SocketChannel` talks to a daemon in another process over its Unix
socket (memory crosses as memfd or dma-buf descriptors).  :class:`LocalChannel`
calls a mount served by this very process (any memory can be registered by
address).  Both expose the same blocking calls, each bounded by a timeout.
"""

from __future__ import annotations

import array
import concurrent.futures
import errno
import itertools
import os
import socket
import threading
from typing import Any

import trio

from ...errors import NamespaceReplaced, NVMeoFError
from .. import protocol
from ..protocol import CompanionError, NoAnswer, Piece
from .shm import SharedMemory


class SocketChannel:
    """A connection to a mount daemon's companion socket; any thread may call."""

    local = False

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._broken: NVMeoFError | None = None
        self.on_event: Any = None
        """Called on the reader thread with each event the daemon sends unasked."""
        self.on_closed: Any = None
        """Called on the reader thread once the connection is gone (the daemon closed it)."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(address)
        except OSError as exc:
            self._sock.close()
            where = "@" + address[1:] if address.startswith("\0") else address
            raise CompanionError(f"cannot reach the mount daemon at {where}: "
                                 f"{exc.strerror or exc} (is the mount still served?)",
                                 exc.errno or errno.ECONNREFUSED) from None
        self._sock.settimeout(None)  # the reader blocks; callers bound their waits
        self._reader = threading.Thread(target=self._read_replies, daemon=True,
                                        name="nvmeof-fuse companion reader")
        self._reader.start()

    def _read_replies(self) -> None:
        error: NVMeoFError = CompanionError("the mount daemon closed the connection",
                                            errno.ECONNRESET)
        try:
            while True:
                data = self._sock.recv(protocol.MAX_MESSAGE)
                if not data:
                    break
                header, payload = protocol.decode(data)
                if payload:  # bytes of a reply (a forwarded FUSE request's)
                    header["_payload"] = payload
                if header.get("event") and self.on_event is not None:
                    self.on_event(header)  # news the daemon sends unasked
                    continue
                with self._lock:
                    future = self._pending.pop(header.get("id"), None)
                if future is not None:
                    future.set_result(header)
                    del future  # while recv blocks, hold nothing its callbacks hold
                elif not header.get("ok", True):  # unsolicited: a refusal
                    error = CompanionError(str(header.get("error")),
                                           int(header.get("errno") or errno.EIO))
                    break
        except (OSError, NVMeoFError):
            pass
        with self._lock:
            self._broken = self._broken or error
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(self._broken)
        if self.on_closed is not None:
            self.on_closed()

    def call_future(self, op: str, *, fds: tuple[int, ...] = (), payload: bytes = b"",
                    **fields: Any) -> concurrent.futures.Future:
        """Send one request; the future gets its reply's header (check it with
        :func:`protocol.raise_for_reply`).  Waiting on it is the caller's, bounded."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._broken is not None:
                raise self._broken
            request_id = next(self._ids)
            self._pending[request_id] = future
        message = protocol.encode({"op": op, "id": request_id, **fields}, payload)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            with self._send_lock:
                self._sock.sendmsg([message], ancillary)
        except OSError as exc:
            with self._lock:
                self._pending.pop(request_id, None)
            self._reader.join(1.0)  # a refusal may be on its way
            raise self._broken or CompanionError(
                f"lost the mount daemon: {exc.strerror or exc}", errno.ECONNRESET) from None
        future.request_id = request_id  # type: ignore[attr-defined]
        return future

    def call(self, op: str, *, fds: tuple[int, ...] = (), payload: bytes = b"",
             timeout: float | None = None, **fields: Any) -> dict:
        """Send one request and wait (bounded) for its reply's fields."""
        future = self.call_future(op, fds=fds, payload=payload, **fields)
        limit = self.timeout if timeout is None else timeout
        try:
            header = future.result(limit)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._pending.pop(future.request_id, None)  # type: ignore[attr-defined]
            raise NoAnswer(f"the mount daemon did not answer {op} within {limit:g} s") from None
        return protocol.raise_for_reply(header)

    def request(self, op: str, *, payload: bytes = b"", **fields: Any
                ) -> concurrent.futures.Future:
        """Send one request without waiting: the future gets its reply's fields, or the
        daemon's :class:`CompanionError` (waiting on it is the caller's, bounded)."""
        reply = self.call_future(op, payload=payload, **fields)
        result: concurrent.futures.Future = concurrent.futures.Future()

        def answered(future: concurrent.futures.Future) -> None:
            try:
                result.set_result(protocol.raise_for_reply(future.result()))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                result.set_exception(exc)

        reply.add_done_callback(answered)
        return result

    # -- the channel calls ---------------------------------------------------------------

    def hello(self, nsid: int | None = None) -> dict:
        """The mount's hello; with ``nsid`` it describes that namespace alone."""
        if nsid is None:
            return self.call("hello", version=protocol.VERSION)
        return self.call("hello", version=protocol.VERSION, nsid=nsid)

    def register_shared(self, mem: SharedMemory, staging: bool = False) -> int:
        return self.call("register", fds=(mem.fd,), kind="memfd", length=len(mem),
                         staging=staging)["region"]

    def register_dmabuf(self, fd: int, offset: int, length: int, iova: int) -> int:
        """Register a dma-buf; ``fd`` is closed here once sent."""
        try:
            return self.call("register", fds=(fd,), kind="dmabuf", offset=offset,
                             length=length, iova=iova)["region"]
        finally:
            os.close(fd)

    def register_local(self, addr: int, length: int, owner: object,
                       staging: bool = False) -> int | None:
        return None  # another process cannot reach our address space

    def unregister(self, rid: int) -> None:
        self.call("unregister", region=rid)

    def forget(self, rid: int) -> None:
        """:meth:`unregister` without waiting (safe on the reader thread)."""
        try:
            self.call_future("unregister", region=rid)
        except NVMeoFError:  # the daemon is gone, and the region with it
            pass

    def read(self, nsid: int, pieces: list[Piece], timeout: float) -> None:
        self.call("read", nsid=nsid, pieces=[p.to_list() for p in pieces], timeout=timeout)

    def read_async(self, nsid: int, pieces: list[Piece], timeout: float
                   ) -> concurrent.futures.Future:
        """:meth:`read` without waiting (``timeout`` bounds the waiter, not the request)."""
        return self.request("read", nsid=nsid, pieces=[p.to_list() for p in pieces])

    def write_async(self, nsid: int, offset: int, length: int, rid: int, region_offset: int,
                    head: bytes, tail: bytes, timeout: float) -> concurrent.futures.Future:
        return self.request("write", payload=head + tail, nsid=nsid, offset=offset,
                            length=length, region=rid, region_offset=region_offset,
                            head=len(head), tail=len(tail))

    def report(self, **fields: Any) -> None:
        """Tell the daemon something (counts, placement) without waiting for the answer."""
        self.call_future("report", **fields)

    def write(self, nsid: int, offset: int, length: int, rid: int, region_offset: int,
              head: bytes, tail: bytes, timeout: float) -> None:
        self.call("write", payload=head + tail, timeout=timeout, nsid=nsid, offset=offset,
                  length=length, region=rid, region_offset=region_offset, head=len(head),
                  tail=len(tail))

    def stats(self) -> dict:
        return self.call("stats")["stats"]

    def close(self) -> None:
        with self._lock:
            self._broken = self._broken or CompanionError("the file is closed", errno.EBADF)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(self.timeout)
        self._sock.close()


LOCAL_CALLS = 8  # requests of an in-process File under way at once


class LocalChannel:
    """Calls into a mount served by this process (``nvmeof_fuse.mount``).

    The in-process mount has one session for all its files, so a channel itself binds its
    file to the namespace its ``hello`` named (as a socket client's session does): once
    another namespace took that NSID, its reads and writes fail, never reaching that one.
    """

    local = True

    def __init__(self, mount: Any, timeout: float) -> None:
        self.mount = mount
        self.timeout = timeout
        self._opened: dict[int, Any] = {}  # nsid -> the namespace its hello named
        self._owned: set[int] = set()
        self._calls = concurrent.futures.ThreadPoolExecutor(
            LOCAL_CALLS, "nvmeof-fuse local channel")  # each waits on the mount's loop

    def _run(self, fn: Any, *args: Any, timeout: float | None = None) -> Any:
        limit = self.timeout if timeout is None else timeout

        async def bounded() -> Any:
            with trio.fail_after(limit):
                return await fn(*args)

        try:
            return self.mount.run(bounded)
        except trio.TooSlowError:
            raise NoAnswer(f"the mount did not finish within {limit:g} s") from None

    def hello(self, nsid: int | None = None) -> dict:
        reply = self.mount.run_sync(self.mount.server.hello, nsid)
        if nsid is not None:
            ns = self.mount.run_sync(self.mount.server.controller.namespaces.get, nsid)
            if ns is not None:
                self._opened.setdefault(nsid, ns)
        return reply

    async def _opened_one(self, fn: Any, nsid: int, *args: Any) -> Any:
        """``await fn(*args)`` on the mount's loop, if namespace ``nsid`` is still the one
        this file opened (else NamespaceReplaced: it was removed or replaced since)."""
        opened = self._opened.get(nsid)
        if opened is not None and self.mount.server.controller.namespaces.get(nsid) is not opened:
            raise NamespaceReplaced(f"namespace n{nsid} was replaced by another namespace, or "
                                    "removed, since this file opened it")
        return await fn(*args)

    def _registered(self, rid: int) -> int:
        self._owned.add(rid)
        return rid

    def register_shared(self, mem: SharedMemory, staging: bool = False) -> int:
        return self._registered(self.mount.run_sync(
            self.mount.session.register_address, mem.addr, len(mem), mem, staging))

    def register_dmabuf(self, fd: int, offset: int, length: int, iova: int) -> int:
        return self._registered(self.mount.run_sync(
            self.mount.session.register_dmabuf, fd, offset, length, iova))

    def register_local(self, addr: int, length: int, owner: object,
                       staging: bool = False) -> int | None:
        return self._registered(self.mount.run_sync(
            self.mount.session.register_address, addr, length, owner, staging))

    def unregister(self, rid: int) -> None:
        self._owned.discard(rid)
        self.mount.run_sync(self.mount.session.unregister, rid)

    def forget(self, rid: int) -> None:
        try:
            self.unregister(rid)
        except NVMeoFError:  # the mount is gone, and the region with it
            pass

    def read(self, nsid: int, pieces: list[Piece], timeout: float) -> None:
        self._run(self._opened_one, self.mount.session.read, nsid, nsid, pieces,
                  timeout=timeout)

    def write(self, nsid: int, offset: int, length: int, rid: int, region_offset: int,
              head: bytes, tail: bytes, timeout: float) -> None:
        self._run(self._opened_one, self.mount.server.write, nsid, self.mount.session, nsid,
                  offset, length, rid, region_offset, head, tail, timeout=timeout)

    def read_async(self, nsid: int, pieces: list[Piece], timeout: float
                   ) -> concurrent.futures.Future:
        return self._calls.submit(self.read, nsid, pieces, timeout)

    def write_async(self, nsid: int, offset: int, length: int, rid: int, region_offset: int,
                    head: bytes, tail: bytes, timeout: float) -> concurrent.futures.Future:
        return self._calls.submit(self.write, nsid, offset, length, rid, region_offset, head,
                                  tail, timeout)

    def report(self, **fields: Any) -> None:
        session = self.mount.session
        self.mount.run_sync(session.report, fields.get("moved") or {}, fields.get("placement"))

    def stats(self) -> dict:
        return self.mount.run_sync(self.mount.server.snapshot, self.mount.session)

    def close(self) -> None:
        self._calls.shutdown(wait=True)
        for rid in list(self._owned):
            try:
                self.unregister(rid)
            except NVMeoFError:
                pass
