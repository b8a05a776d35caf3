"""A blocking handle on a controller for callers outside trio (scripts, notebooks, threads).

The controller lives on a thread of its own running ``trio.run``; every method
hands its work to that loop through :mod:`trio.from_thread` and blocks until it
is done.  Any number of threads may call in at once.

    with SyncController(ConnectOptions("10.0.0.1", nqn)) as ctrl:
        data = ctrl.namespaces[1].read(0, 4096)
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar

import trio

from ..concurrency import first_error
from ..errors import CommandTimeout, ConnectError
from . import controller as _controller
from .controller import ConnectOptions
from .memory import DataRef, Region

log = logging.getLogger(__name__)

T = TypeVar("T")
Connect = Callable[[ConnectOptions], AbstractAsyncContextManager[Any]]
SHUTDOWN_GRACE = 10.0
"""Seconds allowed for the orderly shutdown on top of draining in-flight calls."""


def _unwrap(exc: BaseException) -> BaseException:
    """A nursery's group as its first real error (the caller sees ConnectError, not a group)."""
    if isinstance(exc, BaseExceptionGroup):
        return first_error(exc) or exc
    return exc


class CallFuture(Generic[T]):
    """The result of :meth:`SyncController.submit`, set once by the loop.

    Lighter than :class:`concurrent.futures.Future` (one lock, no condition): a
    small read's future is made and waited for on the hot path.  A caller about
    to block on a call the loop has not started yet first wakes the loop for it
    (one that has started will, as it ends, start those submitted after it).
    """

    __slots__ = ("_owner", "_lock", "_done", "_started", "_result", "_error")

    def __init__(self, owner: SyncController) -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self._lock.acquire()  # released once, when the result is set
        self._done = False
        self._started = False  # set on the loop: the call runs there
        self._result: Any = None
        self._error: BaseException | None = None

    def set_result(self, result: T) -> None:
        self._result = result
        self._done = True
        self._lock.release()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._done = True
        self._lock.release()

    def done(self) -> bool:
        if not self._started:
            self._owner.flush()
        return self._done

    def result(self, timeout: float | None = None) -> T:
        """The call's result (or its error raised); ``TimeoutError`` after ``timeout`` s."""
        if not self._done:
            if not self._started:
                self._owner.flush()
            if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                raise concurrent.futures.TimeoutError
            self._lock.release()  # for other waiters on the same future
        if self._error is not None:
            raise self._error
        return self._result


class SyncNamespace:
    """Blocking view of one :class:`~nvmeof_fuse.host.namespace.namespace.Namespace`."""

    def __init__(self, owner: SyncController, namespace: Any) -> None:
        self._owner = owner
        self._namespace = namespace
        self.nsid: int = namespace.nsid
        self.lba_size: int = namespace.lba_size
        self.nlb: int = namespace.nlb
        self.size: int = namespace.size

    def __repr__(self) -> str:
        return f"<SyncNamespace {self.nsid}: {self.nlb} x {self.lba_size} B>"

    def read(self, offset: int, length: int) -> bytes:
        """Read at any byte offset; short at the end of the namespace."""
        return self._owner.call(self._namespace.read, offset, length)

    def write(self, offset: int, data: bytes | memoryview) -> int:
        """Write at any byte offset; returns the bytes written."""
        return self._owner.call(self._namespace.write, offset, data)

    def flush(self) -> None:
        self._owner.call(self._namespace.flush)

    def read_into(self, slba: int, nlb: int, ref: DataRef) -> None:
        """Read ``nlb`` LBAs at ``slba`` straight into registered memory."""
        self._owner.call(self._namespace.read_into, slba, nlb, ref)

    def write_from(self, slba: int, nlb: int, ref: DataRef) -> None:
        """Write ``nlb`` LBAs at ``slba`` straight from registered memory."""
        self._owner.call(self._namespace.write_from, slba, nlb, ref)


class SyncController:
    """Connects on a background trio thread at construction; use as a context manager.

    ``connect`` substitutes :func:`nvmeof_fuse.host.controller.connect`: any async
    context manager that yields a controller-like object (an attached controller,
    a served mount).  ``ready_timeout`` bounds the connect (default: the options'
    connect timeout plus command timeout), ``stop_timeout`` the orderly shutdown.
    """

    def __init__(self, options: ConnectOptions, *, connect: Connect | None = None,
                 ready_timeout: float | None = None, stop_timeout: float | None = None
                 ) -> None:
        self.options = options
        self._connect = connect
        self._ready_timeout = (options.connect_timeout + options.timeout
                               if ready_timeout is None else ready_timeout)
        self._stop_timeout = (options.timeout + SHUTDOWN_GRACE
                              if stop_timeout is None else stop_timeout)
        self._where = (f"{options.transport} {options.traddr}:{options.trsvcid} "
                       f"({options.nqn})")
        self._lock = threading.Lock()
        self._settled = threading.Event()  # connected, or the loop has ended
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._scope: trio.CancelScope | None = None
        self._controller: Any = None
        self._namespaces: dict[int, SyncNamespace] = {}
        self._error: BaseException | None = None
        self._error_raised = False
        self._closed = False
        self._inflight = 0
        self._idle: trio.Event | None = None
        self._tasks: trio.Nursery  # runs submitted calls, once connected
        self._submit_lock = threading.Lock()
        self._submitted: list[tuple[Any, tuple, concurrent.futures.Future]] = []
        self._wake_pending = False  # the loop was asked to start what is submitted
        self._running = 0  # submitted calls started on the loop and not finished
        self._jobs: deque = deque()  # admitted calls for the workers (loop-owned)
        self._idle_workers: list = []  # parked worker tasks (loop-owned)
        self._thread = threading.Thread(target=self._main, daemon=True,
                                        name=f"nvmeof {options.traddr}:{options.trsvcid}")
        self._thread.start()

    # -- the trio thread ----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # handed to the caller's thread
            self._error = _unwrap(exc)
        finally:
            self._settled.set()

    async def _serve(self) -> None:
        self._stop = trio.Event()
        self._scope = trio.CancelScope()
        with self._lock:
            if self._closed:
                return
            self._token = trio.lowlevel.current_trio_token()
        connect = self._connect or _controller.connect
        with self._scope:
            async with connect(self.options) as controller:
                async with trio.open_nursery() as self._tasks:
                    self._namespaces = {nsid: SyncNamespace(self, ns)
                                        for nsid, ns in controller.namespaces.items()}
                    self._controller = controller
                    self._settled.set()
                    await self._stop.wait()
                    await self._drain()
                    self._tasks.cancel_scope.cancel()

    async def _drain(self) -> None:
        """Let calls already running finish (bounded) before the controller goes away."""
        if self._inflight:
            self._idle = trio.Event()
            with trio.move_on_after(self.options.timeout):
                await self._idle.wait()

    def _request_stop(self) -> None:
        assert self._stop is not None and self._scope is not None
        self._stop.set()
        if self._controller is None:  # still connecting: give up on it
            self._scope.cancel()

    def _admit(self) -> None:
        if self._stop is None or self._stop.is_set():
            raise self._closed_error()
        self._inflight += 1

    def _leave(self) -> None:
        self._inflight -= 1
        if not self._inflight and self._idle is not None:
            self._idle.set()

    async def _guarded(self, fn: Callable[..., Awaitable[T]], args: tuple) -> T:
        self._admit()
        try:
            return await fn(*args)
        finally:
            self._leave()

    def _guarded_sync(self, fn: Callable[..., T], args: tuple) -> T:
        self._admit()
        try:
            return fn(*args)
        finally:
            self._leave()

    # -- the caller's thread --------------------------------------------------------------------

    def _finished_error(self) -> ConnectError:
        """The loop has ended: its error, once the thread has recorded it (bounded)."""
        if threading.current_thread() is not self._thread:
            self._thread.join(self._stop_timeout)
        return self._closed_error()

    def _closed_error(self) -> ConnectError:
        if self._error is not None:
            return ConnectError(f"controller {self._where} stopped: {self._error}")
        return ConnectError(f"controller {self._where} is closed")

    def _wait_connected(self) -> None:
        limit = self._ready_timeout
        if not self._settled.wait(limit):
            self._shutdown(quiet=True)
            raise ConnectError(f"controller {self._where}: not connected within {limit:g} s")
        if self._controller is None:  # the connect failed or was abandoned
            self._shutdown(quiet=True)
            if self._error is not None and not self._error_raised:
                self._error_raised = True
                raise self._error
            raise self._closed_error()

    def _live_token(self) -> trio.lowlevel.TrioToken:
        if self._closed:
            raise self._closed_error()
        if self._controller is None:  # connected once is enough: a dead loop says so itself
            self._wait_connected()
        assert self._token is not None
        return self._token

    def call(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await async_fn(*args)`` on the controller's loop and return its result."""
        token = self._live_token()
        try:
            return trio.from_thread.run(self._guarded, async_fn, args, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled):
            raise self._finished_error() from None

    def submit(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> CallFuture[T]:
        """Start ``await async_fn(*args)`` on the loop without waiting: its future.

        No thread waits per call: the loop completes the future.  The loop is woken
        (a syscall, and a fight for the GIL) only when nothing submitted runs there;
        otherwise the call is started when the next submitted call finishes there,
        or when a caller blocks on a future, whichever comes first.
        """
        token = self._live_token()
        future: CallFuture[T] = CallFuture(self)
        with self._submit_lock:
            self._submitted.append((async_fn, args, future))
            wake = not self._running and not self._wake_pending
            if wake:
                self._wake_pending = True
        if wake:
            self._wake(token)
        return future

    def flush(self) -> None:
        """Wake the loop for calls submitted but not started yet (a caller is about to wait)."""
        with self._submit_lock:
            wake = bool(self._submitted) and not self._wake_pending
            if wake:
                self._wake_pending = True
        if wake and self._token is not None:
            try:
                self._wake(self._token)
            except ConnectError:  # their futures hold the error now
                pass

    def _wake(self, token: trio.lowlevel.TrioToken) -> None:
        try:
            token.run_sync_soon(self._start_submitted)
        except trio.RunFinishedError:  # the loop is gone: nothing will start them
            with self._submit_lock:
                batch, self._submitted = self._submitted, []
            error = self._finished_error()
            for _, _, future in batch:
                future.set_exception(error)
            raise error from None

    def _start_submitted(self) -> None:
        with self._submit_lock:
            batch, self._submitted = self._submitted, []
            self._wake_pending = False
            self._running += len(batch)
        self._start(batch)

    def _start(self, batch: list) -> None:
        """Start submitted calls (on the loop); each was counted in ``_running``."""
        for async_fn, args, future in batch:
            future._started = True
            try:
                self._admit()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
                future.set_exception(exc)
                self._finished_one()
                continue
            self._jobs.append((async_fn, args, future))
            if self._idle_workers:
                trio.lowlevel.reschedule(self._idle_workers.pop())
                continue
            try:  # every worker is busy: one more, kept for later calls
                self._tasks.start_soon(self._worker)
            except RuntimeError:  # the nursery is closed: the loop is ending
                self._jobs.pop()
                self._leave()
                future.set_exception(self._closed_error())
                self._finished_one()

    async def _worker(self) -> None:
        """Runs submitted calls one after another; parks when there are none (cheaper
        than a task per call)."""
        jobs, idle = self._jobs, self._idle_workers
        while True:
            if not jobs:
                task = trio.lowlevel.current_task()

                def abort(_: Any, task: Any = task) -> trio.lowlevel.Abort:
                    idle.remove(task)  # cancelled while parked: nobody may wake it now
                    return trio.lowlevel.Abort.SUCCEEDED

                idle.append(task)
                await trio.lowlevel.wait_task_rescheduled(abort)
                continue
            await self._complete(*jobs.popleft())

    def _finished_one(self) -> None:
        """A submitted call ended (on the loop): start those that waited for one to."""
        with self._submit_lock:
            self._running -= 1
            batch, self._submitted = self._submitted, []
            self._running += len(batch)
        if batch:
            self._start(batch)

    async def _complete(self, async_fn: Callable[..., Awaitable[T]], args: tuple,
                        future: CallFuture[T]) -> None:
        error: BaseException | None = None
        try:
            result = await async_fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
            error = (_unwrap(exc) if not isinstance(exc, trio.Cancelled)
                     else self._closed_error())
        finally:
            self._leave()
            # Calls submitted meanwhile start first: the caller woken by this future
            # finds them running and need not wake the loop for them.
            self._finished_one()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    @property
    def controller(self) -> Any:
        """The connected controller; touch it only in functions run on its loop."""
        self._live_token()
        return self._controller

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the controller's loop (it may touch loop-owned state)."""
        token = self._live_token()
        try:
            return trio.from_thread.run_sync(self._guarded_sync, fn, args, trio_token=token)
        except trio.RunFinishedError:
            raise self._finished_error() from None

    def describe(self) -> dict:
        return self.call_sync(lambda: self._controller.describe())

    @property
    def namespaces(self) -> dict[int, SyncNamespace]:
        self._live_token()
        return dict(self._namespaces)

    def register(self, obj: Any) -> Region:
        """Register caller memory (numpy array, host tensor, writable buffer) for I/O."""
        return self.call_sync(lambda: self._controller.register(obj))

    def unregister(self, region: Region) -> None:
        self.call_sync(lambda: self._controller.unregister(region))

    def allocate(self, length: int) -> Region:
        """Registered, page-aligned host memory owned by the controller."""
        return self.call_sync(lambda: self._controller.allocate(length))

    # -- lifetime -------------------------------------------------------------------------------

    def _shutdown(self, quiet: bool = False) -> None:
        """Ask the loop to exit, wait for the thread; raise its error once unless ``quiet``."""
        with self._lock:
            first = not self._closed
            self._closed = True
            token = self._token
        if first and token is not None:
            try:
                trio.from_thread.run_sync(self._request_stop, trio_token=token)
            except trio.RunFinishedError:
                pass
        limit = self._stop_timeout
        self._thread.join(limit)
        if self._thread.is_alive():
            raise CommandTimeout(f"controller {self._where} did not shut down within {limit:g} s")
        if not quiet and self._error is not None and not self._error_raised:
            self._error_raised = True
            raise self._error

    def close(self) -> None:
        """Disconnect (orderly shutdown) and re-raise the loop's error, if any; idempotent."""
        self._shutdown()

    def __enter__(self) -> SyncController:
        self._live_token()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # keep the body's exception, not a shutdown error on top of it
            self.close()
        except Exception as error:
            log.warning("closing controller %s after an error: %s", self._where, error)
