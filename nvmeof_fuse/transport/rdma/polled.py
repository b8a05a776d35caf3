"""An RDMA queue driven by its callers' threads instead of a trio loop (progress on wait).

A companion client's small reads paid two thread switches each when its trio
loop thread posted the command and reaped its completion for the caller's
thread (futex wake-ups, the GIL handed over and back).  A :class:`PolledQueue`
takes one connected :class:`~nvmeof_fuse.transport.rdma.transport.RdmaQueue` away from
trio (its reaper is stopped first): any thread posts commands on its QP, and a
thread that waits for a command polls the CQs itself and finishes every
request it finds done, as MPI or kvikio runtimes make progress while waiting.

- One lock guards the slots (command IDs) and every verbs call on the queue.
- Exactly one waiter polls at a time; others sleep on a condition and take over
  when it leaves.  A poller spins for about twice the queue's recent latency for
  commands of its size (:mod:`..pollbudget`), then arms the CQs and sleeps on the
  completion channel's fd: nothing spins while nobody waits, and every wait is
  bounded by the caller's deadline.
- Doorbells are coalesced while a caller collects what one poll reaped: a command
  submitted then is written but posted with the others when that caller has collected
  them all or is about to block (as the block layer's plug is flushed when its task
  sleeps), or at its next call once they were held :data:`HOLD_SHARE` of the queue's
  recent latency.  Holding needs no timer: it happens only while the caller is behind
  (answers wait for it), and a wait for a held command posts it first.
- :meth:`detach` (the owner's loop, before the queue is torn down) fails every
  request in flight with :class:`TransportError`; callers then retry elsewhere.
"""

from __future__ import annotations

import errno
import select
import threading
import time
from typing import Any

import trio

from ...errors import CommandTimeout, TransportError
from ...nvme import Completion
from ...nvme import command as nvme_cmd
from .. import registry
from ..parking import for_caller
from ..region import DataRef
from .transport import _CID, SQE_BYTES, CommandSlots, RdmaQueue, RdmaTransport, Request

BLOCK_SLICE = 0.05
"""Seconds a poller sleeps on the channel at most before it looks at the queue again (a
detach closes the fd under it)."""
HOLD_SHARE = 0.25
"""A doorbell is held at most this share of the recent latency of commands of its size
(posting to reaping, so a caller's own delays count) before the caller's next call posts
it.  A prefetch loop that reaps answers late thus loses at most a quarter of its depth."""


class PolledQueue:
    """A connected RDMA queue whose callers post and reap themselves (see the module)."""

    def __init__(self, queue: RdmaQueue) -> None:
        self.queue = queue
        self.name = queue.name
        self._slots = CommandSlots(queue.size)
        self._lock = threading.Lock()  # slots and verbs calls
        self._role = threading.Lock()  # held by the one thread polling
        self._wakeup = threading.Condition(threading.Lock())
        self._sleepers = 0
        self._recv_armed = self._send_armed = False
        self._held: dict[int, Any] = {}  # command ID -> what keeps its memory alive
        self._unposted: list = []  # work requests written but not posted yet (post=False)
        self._harvest = 0  # responses a poll reaped that their callers have not collected
        self._held_until = 0.0  # perf_counter past which held doorbells go at the next call
        self.failed: TransportError | None = None
        self.detached = False
        self.poll_budget = queue.poll_budget  # the queue's own: it has left trio for good

    @property
    def available(self) -> int:
        return self._slots.available

    @property
    def pending(self) -> int:
        return len(self._slots.pending)

    @property
    def unanswered(self) -> int:
        """Commands the target has not answered yet (a slot whose SEND completion is not
        reaped yet is still pending, but no load on the target)."""
        return len(self._slots.pending) - self._slots.awaiting_send

    # -- submission (any thread) -----------------------------------------------------------

    def submit(self, sqes: list[tuple[bytearray, DataRef]], keep: Any = None, *,
               post: bool = True) -> list[Request] | None:
        """Post reads (``(sqe, dest)`` each) at once: their requests, or None when the queue
        failed or lacks the slots for all of them (nothing posted then).

        ``keep`` (the owner of the memory) is held until each response came, even if
        the caller drops its requests: freed memory would have its registration dropped
        while the target still writes there.  After a failure it is held until the
        queue itself goes (after its QP).

        With ``post=False`` the commands are written but wait for :meth:`flush` (or for
        the next post, wait or progress on this queue), so that a batch of calls goes
        out in one ``post_send``: one doorbell, one trip through the kernel's rxe.
        With ``post=True`` they may still be held back a little (coalesced: see the module).
        """
        with self._lock:
            if self.failed is not None or len(self._slots.free) < len(sqes):
                return None
            requests = [self._write(sqe, ref, keep) for sqe, ref in sqes]
            now = time.perf_counter()
            for request in requests:
                request.deadline = now  # when it was written (no watchdog reads it)
            if post and not self._hold_or_post(now, requests[0].data):
                return None  # the queue failed (so did these requests): nothing went out
        return requests

    def submit_read(self, nsid: int, slba: int, nlb: int, ref: DataRef, keep: Any = None, *,
                    post: bool = True) -> Request | None:
        """:meth:`submit` of one Read (a small read's hot path: no lists, and the command
        encoded straight into its capsule)."""
        with self._lock:
            if self.failed is not None or not self._slots.free:
                return None
            request = self._write(None, ref, keep, (nsid, slba, nlb))
            request.deadline = now = time.perf_counter()
            if post and not self._hold_or_post(now, ref):
                return None
        return request

    def _write(self, sqe: bytearray | None, ref: DataRef, keep: Any,
               read: tuple[int, int, int] | None = None) -> Request:
        """Write one command into a free slot's capsule, to be posted (the lock is held):
        ``sqe``, or a Read of ``read`` (``(nsid, slba, nlb)``)."""
        q = self.queue
        request = self._slots.allocate(ref)
        cid, slot = request.cid, request.slot
        offset = slot * SQE_BYTES
        capsule = q.capsules.view
        if read is None:
            capsule[offset:offset + SQE_BYTES] = sqe
        else:
            try:
                nvme_cmd.read_into(capsule, offset, *read)
            except ValueError:  # a field out of range: the slot goes back unused
                self._slots.release(request)
                raise
        _CID.pack_into(capsule, offset + 2, cid)
        q._place_data(capsule, offset + 24, ref, False)
        self._unposted.extend(q._sends[slot])
        self._held[cid] = keep
        return request

    def flush(self) -> None:
        """Post the commands submitted with ``post=False`` (any thread)."""
        if self._unposted:
            with self._lock:
                self._post()

    def _hold_or_post(self, now: float, data: DataRef | None) -> bool:
        """Post now, or hold the doorbell while a caller collects what a poll reaped and
        not for long (the lock is held; ``data``: the command's); False if the post failed."""
        if self._harvest:
            if not self._held_until:
                nbytes = data.length if data is not None else 0
                self._held_until = now + HOLD_SHARE * self.poll_budget.latency(nbytes)
            if now < self._held_until:
                return True
        return self._post()

    def _post(self) -> bool:
        """One ``post_send`` of every unposted work request (the lock is held); False if it
        failed: then the queue fails, and with it every request in flight (their callers
        retry elsewhere)."""
        wrs, self._unposted = self._unposted, []
        self._held_until = 0.0
        if not wrs:
            return True
        try:
            self.queue.qp.post_send(wrs)
        except OSError as exc:
            self._fail(TransportError(f"{self.name}: cannot post a command: {exc}"))
            return False
        return True

    # -- completion (the waiting thread) ---------------------------------------------------

    def progress(self) -> None:
        """Finish what has completed, if no other thread polls right now (never blocks)."""
        if self._unposted:
            self.flush()
        self._reap()

    def _reap(self) -> None:
        """Finish what has completed, if no other thread polls right now; post nothing."""
        if self._role.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._role.release()
            self._notify()

    def wait(self, request: Request, until: float) -> Completion:
        """Poll until ``request`` finished; its completion.  ``until`` is a ``perf_counter``
        deadline: past it, :class:`CommandTimeout` (the request stays in flight)."""
        clock = time.perf_counter
        if self._harvest and self._unposted and not request.finished:
            self._reap()  # what came meanwhile extends the harvest: posts stay held
        if request.finished:  # reaped before anyone waited for it: how long ago it went
            if request.error is not None:  # out says nothing of its latency (its caller
                raise for_caller(request.error)  # was busy), so no sample is taken
            if self._harvest:
                self._collected()
            elif self._unposted:
                self.flush()
            return request.completion  # type: ignore[return-value]
        if self._unposted or self._harvest:  # about to block: what was held back goes now
            with self._lock:
                self._harvest = 0
                self._post()
        data = request.data
        nbytes = data.length if data is not None else 0
        spin: float | None = None  # asked of the budget once per command, when it is polled
        polled = False
        while not request.finished:
            if clock() >= until:
                raise CommandTimeout(f"{self.name}: command {request.cid} got no completion "
                                     "in time")
            if self._role.acquire(blocking=False):
                try:
                    if spin is None:
                        spin = self.poll_budget.budget(nbytes)
                    polled = self._poll(request, until, spin)
                finally:
                    self._role.release()
                self._notify()
            else:
                with self._wakeup:
                    self._sleepers += 1
                    try:
                        if not request.finished:
                            self._wakeup.wait(max(0.0, min(until - clock(), BLOCK_SLICE)))
                    finally:
                        self._sleepers -= 1
        if request.error is not None:
            raise for_caller(request.error)
        self.poll_budget.record(nbytes, clock() - request.deadline, polled=polled)
        if self._harvest:  # counted when reaped, with the others
            self._collected()
        return request.completion  # type: ignore[return-value]

    def _collected(self) -> None:
        """A caller took one reaped response.  Once none is left, reap again: responses
        that came meanwhile extend the harvest; with none, post what was held back (and
        in any case once it was held long enough)."""
        with self._lock:
            if not self._harvest:
                return
            self._harvest -= 1
            if self._harvest:
                if self._held_until and time.perf_counter() >= self._held_until:
                    self._post()  # held long enough
                return
        if self._unposted:
            self._reap()
        with self._lock:
            if not self._harvest or time.perf_counter() >= self._held_until:
                self._post()

    def _notify(self) -> None:
        if self._sleepers:
            with self._wakeup:
                self._wakeup.notify_all()

    def _poll(self, request: Request, until: float, spin: float) -> bool:
        """Spin for ``spin`` seconds, then sleep on the completion channel, until ``request``
        finished, the queue failed or ``until`` passed (the caller holds the poller's role);
        True if it was found while spinning, before any sleep.

        The spin is twice the recent latency of commands of its size when that is short,
        as the trio path's hybrid polling; none for slow ones, which would waste a CPU the
        target side needs (the testbed's rxe and nvmet share the VM's)."""
        clock = time.perf_counter
        spin_until = clock() + spin
        slept = False
        while not request.finished and self.failed is None:
            if self._drain():
                if self._sleepers:
                    self._notify()
                continue
            now = clock()
            if now >= until:
                return False
            if now < spin_until:
                continue
            with self._lock:
                if self.failed is not None:
                    return False
                self._arm()
            if self._drain():
                continue
            self._sleep(min(until - now, BLOCK_SLICE))
            slept = True
            spin_until = clock() + spin
        return request.finished and not slept

    def _sleep(self, limit: float) -> None:
        """Wait for the completion channel's event (bounded) and consume it."""
        # poll(), not select(): a process with many files (a PyTorch job) has fds past
        # select's FD_SETSIZE, and a failing select would turn this sleep into a spin.
        poller = select.poll()
        try:
            poller.register(self.queue.channel.fd, select.POLLIN)
            events = poller.poll(max(0.0, limit) * 1000)
        except (OSError, ValueError):  # the fd was closed by a detach meanwhile
            return
        if not events or events[0][1] & select.POLLNVAL:
            return
        with self._lock:
            if self.failed is not None:
                return
            channel = self.queue.channel
            try:
                cq = channel.get_cq_event()
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    self._fail(TransportError(f"{self.name}: completion channel failed: {exc}"))
                return
            cq.ack_events(1)
            if cq is self.queue.recv_cq:
                self._recv_armed = False
            elif cq is self.queue.send_cq:
                self._send_armed = False
            else:
                self._recv_armed = self._send_armed = False

    def _arm(self) -> None:
        q = self.queue
        if not self._recv_armed:
            q.recv_cq.req_notify()
            self._recv_armed = True
        if self._slots.awaiting_send and not self._send_armed:
            q.send_cq.req_notify()
            self._send_armed = True

    def _drain(self) -> int:
        """Handle every completion there is (under the lock); how many there were."""
        q = self.queue
        slots = self._slots
        with self._lock:
            if self.failed is not None:
                return 0
            try:
                return q.take_completions(slots, self._release)
            except TransportError as exc:
                self._fail(exc)
                return 1
            except OSError as exc:
                self._fail(TransportError(f"{self.name}: completion queue failed: {exc}"))
                return 1

    def _release(self, cid: int) -> None:
        """Command ``cid`` was answered (its caller may collect it now): its memory need
        not be kept alive for it any more."""
        self._held.pop(cid, None)
        self._harvest += 1

    def _fail(self, error: TransportError) -> None:
        """Fail every request in flight (the lock is held)."""
        if self.failed is None:
            self.failed = error.with_traceback(None)  # the poller's frames hold requests
        self._unposted = []  # their requests fail below: nothing may post them later
        self._harvest = 0
        self._held_until = 0.0
        self._slots.fail_all(error)

    # -- the owner's loop ------------------------------------------------------------------

    def detach(self, why: str) -> None:
        """Stop using the queue (before it is torn down): requests in flight fail."""
        with self._lock:
            self.detached = True
            self._fail(TransportError(f"{self.name}: {why}"))
        self._notify()

    def drain(self, until: float) -> None:
        """Reap until nothing is in flight, the queue failed, or ``until`` (``perf_counter``)."""
        while self.pending and self.failed is None and time.perf_counter() < until:
            self.progress()
            if self.pending:
                time.sleep(0.001)

    def describe(self) -> dict[str, Any]:
        return {"qid": self.queue.qid, "pending": self.pending, "failed": str(self.failed or "")}


async def take_over(queue: RdmaQueue, timeout: float) -> PolledQueue | None:
    """Take ``queue`` away from trio once it is idle (no command or SEND completion due):
    its reaper stops and callers' threads drive it.  None if it stayed busy ``timeout`` s."""
    with trio.move_on_after(timeout):
        while queue._slots.pending:  # a stale SEND completion would land in our slots
            await trio.sleep(0.001)
    if queue._slots.pending or queue._failed is not None:
        return None
    await queue.stop()
    return PolledQueue(queue)


class PolledRdmaTransport(RdmaTransport):
    """The RDMA transport whose queues callers' threads may drive (:meth:`take_over`)."""

    async def take_over(self, queue: RdmaQueue, timeout: float) -> PolledQueue | None:
        return await take_over(queue, timeout)


def _create(traddr: str, trsvcid: int, host_traddr: str | None = None, *,
            connect_timeout: float, host_iface: str | None = None,
            **_digests: bool) -> PolledRdmaTransport:
    return PolledRdmaTransport(traddr, trsvcid, host_traddr, connect_timeout=connect_timeout,
                               host_iface=host_iface)


registry.register("rdma", _create)
