"""RdmaQueue's command path over fake verbs: completion, timeouts, cancellation, failures.

The fake QP records what is posted and the test decides when (and whether) the target's SEND
completion and response arrive; the completion channel is a pipe, as the real one is an fd.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import os
import re
import struct
import time
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from fakes import CommandEnds

from nvmeof_fuse.errors import CommandTimeout, TransportError
from nvmeof_fuse.nvme import command as cmd
from nvmeof_fuse.nvme.sgl import NULL_SGL
from nvmeof_fuse.transport.rdma import transport as rdma
from nvmeof_fuse.transport.region import host_buffer


class FakeSGE:
    def __init__(self, addr: int, length: int, lkey: int = 0) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class FakeWR:
    def __init__(self, wr_id: int = 0, sg_list=None, **kw) -> None:
        self.wr_id, self.sg_list = wr_id, list(sg_list or [])


FAKE_VERBS = SimpleNamespace(
    SGE=FakeSGE, SendWR=FakeWR, RecvWR=FakeWR, QPInitAttr=lambda **kw: SimpleNamespace(**kw),
    QPType=SimpleNamespace(RC=2), WROpcode=SimpleNamespace(SEND=2),
    SendFlags=SimpleNamespace(SIGNALED=2), QPAttrMask=SimpleNamespace(TIMEOUT=512),
    AccessFlags=SimpleNamespace(LOCAL_WRITE=1, REMOTE_WRITE=2, REMOTE_READ=4))


class WC:
    def __init__(self, wr_id: int, status: int = 0) -> None:
        self.wr_id, self.status = wr_id, status
        self.status_str, self.vendor_err = "flushed" if status else "success", 0


class Channel:
    def __init__(self) -> None:
        self.fd, self._wfd = os.pipe()
        self.events: collections.deque = collections.deque()

    def signal(self, cq) -> None:
        self.events.append(cq)
        os.write(self._wfd, b"x")

    def get_cq_event(self):
        try:
            os.read(self.fd, 1)
        except BlockingIOError:
            raise OSError(errno.EAGAIN, "no event") from None
        return self.events.popleft()

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._wfd)


class CQ:
    def __init__(self, channel: Channel) -> None:
        self.channel, self.wcs, self.armed = channel, collections.deque(), False
        self.asked: list[int] = []  # entries each poll asked for


    def add(self, wc: WC) -> None:
        self.wcs.append(wc)
        if self.armed:
            self.armed = False
            self.channel.signal(self)

    def poll(self, n: int) -> list:
        self.asked.append(n)
        return [self.wcs.popleft() for _ in range(min(n, len(self.wcs)))]

    def req_notify(self) -> None:
        self.armed = True

    def ack_events(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class QP:
    def __init__(self, attr) -> None:
        self.send_cq, self.recv_cq = attr.send_cq, attr.recv_cq
        self.sent: dict[int, FakeWR] = {}  # command ID -> capsule SEND
        self.last_posted: list[int] = []  # the command IDs of the last post_send
        self._cid_fields: dict[int, ctypes.c_uint16] = {}
        self.recvs: collections.deque = collections.deque()
        self.posts: list[int] = []  # WRs per post_send call
        self.fail_posts = False
        self.attrs = {"qp_state": 3, "timeout": 17, "retry_cnt": 7}  # as RDMA-CM left it
        self.refuse_modify = False

    def post_send(self, wrs) -> None:
        if self.fail_posts:
            raise OSError(errno.ENOMEM, "send queue full")
        self.posts.append(len(wrs))
        sent, cids = self.sent, []
        for wr in wrs:  # by the command ID in its capsule (slot and generation)
            cid = self.cid_of(wr)
            sent[cid] = wr
            cids.append(cid)
        self.last_posted = cids

    def cid_of(self, wr) -> int:
        """The command ID in the capsule a SEND work request carries."""
        addr = wr.sg_list[0].addr
        field = self._cid_fields.get(addr)
        if field is None:  # a capsule's place never changes: read it through one object
            field = self._cid_fields[addr] = ctypes.c_uint16.from_address(addr + 2)
        return field.value

    def post_recv(self, wrs) -> None:
        self.recvs.extend(wrs)

    def query(self):
        return dict(self.attrs), None

    def modify(self, attr_mask: int, **fields) -> None:
        if self.refuse_modify:
            raise OSError(errno.EINVAL, "Invalid argument")
        assert attr_mask == FAKE_VERBS.QPAttrMask.TIMEOUT and set(fields) == {"timeout"}
        self.attrs.update(fields)

    def close(self) -> None:
        pass

    # -- the target's side --
    def send_done(self, cid: int, status: int = 0) -> None:
        self.send_cq.add(WC(self.sent[cid].wr_id, status))

    def flush_receives(self) -> None:
        """The QP went to the error state: every posted receive completes, flushed."""
        while self.recvs:
            self.recv_cq.add(WC(self.recvs.popleft().wr_id, status=5))

    def respond(self, cid: int, status_word: int = 0) -> None:
        recv = self.recvs.popleft()
        ctypes.memmove(recv.sg_list[0].addr,
                       struct.pack("<QHHHH", 0, 0, 1, cid, status_word << 1 | 1), 16)
        self.recv_cq.add(WC(recv.wr_id))


class MR:
    lkey, rkey = 0x11, 0x22

    def close(self) -> None:
        pass


class PD:
    def reg_mr(self, addr: int, length: int, access: int) -> MR:
        return MR()


@pytest.fixture
def queue(monkeypatch):
    yield from fake_rdma_queue(monkeypatch)


def fake_rdma_queue(monkeypatch):
    """An RdmaQueue (qid 1, 8 slots) over the fake verbs, its receives posted; closed after."""
    monkeypatch.setattr(rdma, "_ibverbs", FAKE_VERBS)
    transport = SimpleNamespace(traddr="fake", trsvcid=4420, _queues=[], yielded_at=0.0)
    channel = Channel()
    context = SimpleNamespace(create_comp_channel=lambda: channel,
                              create_cq=lambda size, ch: CQ(ch))
    cm = SimpleNamespace(context=context, create_qp=lambda pd, attr: QP(attr), connected=False)
    q = rdma.RdmaQueue(transport, cm, PD(), 1, 8, in_capsule_bytes=4096)
    q.qp.post_recv(q._recvs)
    yield q
    q.close()


HANG_GUARD = 60  # seconds: a hang fails the test instead of stalling the suite


def in_trio(test):
    """Run an async test body under trio (the suite has no trio pytest plugin)."""
    @functools.wraps(test)
    def run(queue):
        async def guarded():
            with trio.fail_after(HANG_GUARD):
                await test(queue)

        trio.run(guarded)

    return run


def read_command():
    return cmd.read(1, 0, 1, NULL_SGL)


async def read_recording(queue, results: list) -> None:
    """One read; its completion, or the TransportError it raised, goes to ``results``."""
    try:
        results.append(await queue.execute(read_command(), timeout=30))
    except TransportError as exc:
        results.append(exc)


async def started(queue, nursery) -> None:
    await nursery.start(queue.reap)


async def answered_read(queue, nursery) -> tuple[list, int]:
    """A read under a started reaper, answered by the target (its SEND completion not
    reaped yet): the list its result lands in, and its command ID."""
    await started(queue, nursery)
    results: list = []
    nursery.start_soon(read_recording, queue, results)
    await trio.testing.wait_all_tasks_blocked()
    (cid,) = queue.qp.sent
    queue.qp.respond(cid)
    return results, cid


@in_trio
async def test_response_completes_the_command_and_the_send_frees_its_slot(queue):
    async with trio.open_nursery() as nursery:
        results, cid = await answered_read(queue, nursery)
        await trio.testing.wait_all_tasks_blocked()
        assert results and results[0].command_id == cid and results[0].ok
        assert queue.available == 6  # the SEND has not completed: its slot stays taken
        queue.qp.send_done(cid)  # the send CQ was armed for it
        await trio.testing.wait_all_tasks_blocked()
        assert queue.available == 7
        nursery.cancel_scope.cancel()


@in_trio
async def test_in_capsule_write_waits_for_its_send(queue):
    buf = host_buffer(lambda addr, length, owner: SimpleNamespace(keys=lambda pd: MR(),
                                                                  close=lambda: None), 4096)
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        done = []

        async def one():
            done.append(await queue.execute(cmd.write(1, 0, 1, NULL_SGL), buf.ref(0, 512),
                                            to_controller=True, timeout=30))

        nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        (cid,) = queue.qp.sent
        assert len(queue.qp.sent[cid].sg_list) == 2  # capsule + the caller's data
        queue.qp.respond(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert not done  # the HCA may still read the caller's buffer
        queue.qp.send_done(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert done and queue.available == 7
        nursery.cancel_scope.cancel()
    buf.close()


@in_trio
async def test_a_timeout_stops_the_queue_before_its_caller_gets_its_memory_back(queue):
    """As Linux nvme_rdma_timeout: the target may still RDMA a timed-out command's data, so
    the QP is disconnected (error state) before the caller may reuse its buffer; the other
    commands of the queue fail with it, and the controller reconnects."""
    seen = {}

    def disconnect():
        seen["before the caller woke"] = "woke" not in seen
        queue.cm.connected = False

    queue.cm.connected = True
    queue.cm.disconnect = disconnect
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        others = []
        nursery.start_soon(read_recording, queue, others)  # in flight, with a longer timeout
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(CommandTimeout, match="got no completion within 0.01 s"):
            await queue.execute(read_command(), timeout=0.01)
        seen["woke"] = True
        assert seen["before the caller woke"] and not queue.cm.connected
        await trio.testing.wait_all_tasks_blocked()
        assert len(others) == 1 and re.search(r"closed as command \d+ timed out", str(others[0]))
        with pytest.raises(TransportError, match="timed out"):
            await queue.execute(read_command(), timeout=30)
        nursery.cancel_scope.cancel()


@in_trio
async def test_cancelled_caller_still_waits_for_its_command(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        outcome = {}

        async def one():
            with trio.CancelScope() as scope:
                outcome["scope"] = scope
                outcome["completion"] = await queue.execute(read_command(), timeout=30)
                await trio.lowlevel.checkpoint()
            outcome["cancelled"] = scope.cancelled_caught

        nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        outcome["scope"].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert "completion" not in outcome  # not abandoned: the target may be moving data
        (cid,) = queue.qp.sent
        queue.qp.send_done(cid)
        queue.qp.respond(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert outcome["completion"].ok and outcome["cancelled"]
        nursery.cancel_scope.cancel()


@in_trio
async def test_failed_work_request_fails_waiting_and_later_commands(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        errors = []
        nursery.start_soon(read_recording, queue, errors)
        await trio.testing.wait_all_tasks_blocked()
        (cid,) = queue.qp.sent
        queue.qp.send_done(cid, status=5)  # flushed: the QP went to error
        queue.qp.respond(cid)  # wakes the reaper, which meets the failed SEND first
        await trio.testing.wait_all_tasks_blocked()
        assert errors and "work request failed: flushed" in str(errors[0])
        with pytest.raises(TransportError, match="work request failed"):
            await queue.execute(read_command(), timeout=30)


@in_trio
async def test_stopping_the_reaper_fails_waiting_callers(queue):
    errors = []
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as reaper:
            await started(queue, reaper)
            outer.start_soon(read_recording, queue, errors)
            await trio.testing.wait_all_tasks_blocked()
            reaper.cancel_scope.cancel()
    assert errors and "stopped" in str(errors[0])


def disconnect_recording(queue, woken: list) -> dict:
    """Connect the fake endpoint; its disconnect notes whether a caller in ``woken`` had run."""
    seen = {}

    def disconnect():
        seen["after a caller woke"] = bool(woken)
        queue.cm.connected = False

    queue.cm.connected = True
    queue.cm.disconnect = disconnect
    return seen


@pytest.mark.parametrize("how", ["stopped", "bad response"])
def test_a_failed_queue_disconnects_before_its_callers_get_their_memory_back(how, queue):
    """As a timeout does (and Linux error recovery, which stops the queues first): the target
    may still RDMA the data of a command in flight, so the QP leaves the connected state
    before a failed caller may reuse its buffer."""
    async def main():
        results = []
        seen = disconnect_recording(queue, results)
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as outer:
                async with trio.open_nursery() as reaper:
                    await started(queue, reaper)
                    outer.start_soon(read_recording, queue, results)
                    await trio.testing.wait_all_tasks_blocked()
                    if how == "stopped":
                        reaper.cancel_scope.cancel()
                    else:
                        queue.qp.respond(0x55)  # a command ID not in flight
        assert len(results) == 1 and isinstance(results[0], TransportError)
        assert seen == {"after a caller woke": False}

    trio.run(main)


@in_trio
async def test_a_command_answered_before_its_queue_failed_keeps_its_completion(queue):
    """The connection drops right after the target answered: its response and then the
    flushed receives are reaped together.  The caller already let go with the response gets
    that completion, not the queue's error (its command is done; a retry would run it twice)."""
    async with trio.open_nursery() as nursery:
        results, cid = await answered_read(queue, nursery)  # its SEND completion not reaped
        queue.recv_cq.add(WC(queue.qp.recvs.popleft().wr_id, status=5))  # flushed
        await trio.testing.wait_all_tasks_blocked()
    assert len(results) == 1 and not isinstance(results[0], TransportError), results
    assert results[0].command_id == cid and results[0].ok


@in_trio
async def test_a_failed_queue_holds_no_caller_memory(queue):
    """The queue's error is raised to every caller in flight: it must not carry a caller's
    frame (its DataRef) on its traceback, nor the reaper's (the request it was handling)."""
    import gc
    import weakref

    import numpy as np

    from nvmeof_fuse.host.memory import buffer_address
    from nvmeof_fuse.transport.region import Region

    arrays = []

    async def reading() -> None:
        array = np.zeros(4096, dtype=np.uint8)
        addr, length, owner = buffer_address(array)
        region = Region(addr, length, SimpleNamespace(keys=lambda pd: MR(), close=lambda: None),
                        owner)
        arrays.append(weakref.ref(array))
        try:
            await queue.execute(read_command(), region.ref(), timeout=30)
        except TransportError:
            pass
        region.close()

    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        for _ in range(3):
            nursery.start_soon(reading)
        await trio.testing.wait_all_tasks_blocked()
        cid = min(queue.qp.sent)
        queue.qp.respond(cid)
        queue.qp.respond(cid)  # a second response: raised while the reaper holds the request
    gc.collect()
    assert len(arrays) == 3 and [ref() for ref in arrays] == [None] * 3


@in_trio
async def test_commands_posted_in_one_batch_share_one_post_send(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        done = []
        for _ in range(4):
            nursery.start_soon(read_recording, queue, done)
        await trio.testing.wait_all_tasks_blocked()
        assert queue.qp.posts == [1, 3]  # the first alone (nothing in flight), then together
        for cid in list(queue.qp.sent):
            queue.qp.send_done(cid)
            queue.qp.respond(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert len(done) == 4 and all(c.ok for c in done) and queue.available == 7
        nursery.cancel_scope.cancel()


@in_trio
async def test_polls_ask_for_no_more_entries_than_commands_in_flight(queue):
    """ibverbs zeroes room for every entry a poll asks for: a queue's size per poll cost
    4x one entry under TCG."""
    answer_at_once(queue)
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        assert (await queue.execute(read_command(), timeout=30)).ok
        assert set(queue.recv_cq.asked) == set(queue.send_cq.asked) == {1}
        del queue.qp.post_send  # these four wait for their answers
        queue.qp.sent.clear()
        done: list = []
        for _ in range(4):
            nursery.start_soon(read_recording, queue, done)
        await trio.testing.wait_all_tasks_blocked()
        queue.recv_cq.asked.clear()
        for cid in list(queue.qp.sent):
            queue.qp.send_done(cid)
            queue.qp.respond(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert len(done) == 4 and all(c.ok for c in done) and queue.available == 7
        assert queue.recv_cq.asked and max(queue.recv_cq.asked) <= 4
        nursery.cancel_scope.cancel()


@in_trio
async def test_a_failed_batched_post_fails_its_callers_and_frees_their_slots(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        results = []
        nursery.start_soon(read_recording, queue, results)
        await trio.testing.wait_all_tasks_blocked()  # one command in flight
        queue.qp.fail_posts = True
        nursery.start_soon(read_recording, queue, results)
        nursery.start_soon(read_recording, queue, results)
        await trio.testing.wait_all_tasks_blocked()
        assert [str(r) for r in results] == ["I/O queue 1: cannot post a command: "
                                             "[Errno 12] send queue full"] * 2
        assert queue.available == 6  # only the first command holds a slot
        nursery.cancel_scope.cancel()


# -- polling for a command alone on its queue (hybrid polling) ----------------------------------

def answer_at_once(queue, status: int = 0) -> None:
    """Make the fake target answer each capsule by the time ``post_send`` returns."""
    qp, post = queue.qp, queue.qp.post_send

    def post_send(wrs) -> None:
        post(wrs)
        for wr in wrs:
            qp.send_done(qp.cid_of(wr), status)
            qp.respond(qp.cid_of(wr))

    qp.post_send = post_send


@in_trio
async def test_a_command_alone_is_polled_for_without_arming_the_channel(queue):
    answer_at_once(queue)
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        for _ in range(3):
            assert (await queue.execute(read_command(), timeout=30)).ok
        # No wake-up was asked for: an idle queue's reaper waits unarmed, and the
        # caller found its completion by polling.
        assert not queue.recv_cq.armed and not queue.send_cq.armed
        assert not queue.channel.events and queue.available == 7
        nursery.cancel_scope.cancel()


@in_trio
async def test_a_send_completion_after_a_polled_response_still_frees_its_slot(queue):
    """The caller polling for its command finds the response before the capsule's SEND
    completion: the reaper must wake (armed) for that completion, or the slot and the
    request, which refers to the caller's memory, stay taken until some later command."""
    qp, post = queue.qp, queue.qp.post_send

    def post_send(wrs) -> None:  # the target answers at once; the SEND completes later
        post(wrs)
        for wr in wrs:
            qp.respond(qp.cid_of(wr))

    qp.post_send = post_send
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        assert (await queue.execute(read_command(), timeout=30)).ok  # found by polling
        (cid,) = qp.sent
        assert queue.available == 6  # its SEND completion is still due
        qp.send_done(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert queue.available == 7 and not queue._slots.pending
        nursery.cancel_scope.cancel()


@in_trio
async def test_an_unanswered_command_stops_polling_and_sleeps_on_the_channel(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        results = []
        nursery.start_soon(read_recording, queue, results)
        await trio.testing.wait_all_tasks_blocked()  # polled in vain, then parked
        assert queue.recv_cq.armed and not results
        (cid,) = queue.qp.sent
        queue.qp.send_done(cid)
        queue.qp.respond(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert results and results[0].ok and queue.available == 7
        nursery.cancel_scope.cancel()


@in_trio
async def test_a_queue_slower_than_the_poll_limit_is_not_polled(queue):
    answer_at_once(queue)
    for _ in range(40):  # commands like this one (no data) took far past the poll limit
        queue.poll_budget.record(0, 1.0, polled=False)
    before = queue.poll_budget.latency(0)
    polls = []
    queue._poll_for = lambda *args: polls.append(args)
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        assert (await queue.execute(read_command(), timeout=30)).ok  # the reaper found it
        assert not polls and queue.poll_budget.latency(0) < before  # back towards polling
        nursery.cancel_scope.cancel()


@in_trio
async def test_a_failed_completion_found_by_polling_fails_the_queue(queue):
    answer_at_once(queue, status=5)
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        with pytest.raises(TransportError, match="work request failed: flushed"):
            await queue.execute(read_command(), timeout=30)
        with pytest.raises(TransportError, match="work request failed"):
            await queue.execute(read_command(), timeout=30)


@in_trio
async def test_a_polling_caller_takes_a_scheduler_pass_while_tasks_wait_to_run(queue):
    answer_at_once(queue)
    ran = []

    async def other() -> None:
        ran.append("other")

    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        await trio.testing.wait_all_tasks_blocked()
        yielded = queue.transport.yielded_at = time.perf_counter()  # only others count now
        nursery.start_soon(other)  # runnable, not run yet
        assert (await queue.execute(read_command(), timeout=30)).ok
        assert queue.transport.yielded_at > yielded  # the caller yielded before polling
        await trio.testing.wait_all_tasks_blocked()
        assert ran == ["other"]
        nursery.cancel_scope.cancel()


@in_trio
async def test_with_nothing_waiting_to_run_a_poll_skips_the_scheduler_pass(queue):
    answer_at_once(queue)
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        await trio.testing.wait_all_tasks_blocked()
        yielded = queue.transport.yielded_at = time.perf_counter()
        for _ in range(3):
            assert (await queue.execute(read_command(), timeout=30)).ok
        assert queue.transport.yielded_at == yielded  # found by polling, no checkpoint
        queue.transport.yielded_at -= 2 * rdma.YIELD_EVERY  # long ago: yields again
        assert (await queue.execute(read_command(), timeout=30)).ok
        assert queue.transport.yielded_at > yielded
        nursery.cancel_scope.cancel()


@in_trio
async def test_a_qd1_caller_that_never_waits_still_lets_timers_fire(queue):
    """Every completion is there at the first poll, so the caller never sleeps; the
    scheduler still runs at least every YIELD_EVERY, and a sleeping task wakes."""
    answer_at_once(queue)
    woke = trio.Event()

    async def sleeper() -> None:
        await trio.sleep(0.01)
        woke.set()

    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        nursery.start_soon(sleeper)
        commands = 0
        while not woke.is_set():
            assert (await queue.execute(read_command(), timeout=30)).ok
            commands += 1
            assert commands < 1_000_000, "the timer never fired"
        nursery.cancel_scope.cancel()


def recorded_polls(queue) -> list:
    """The arguments of each poll ``queue``'s callers make from now on."""
    polls = []
    poll_for = queue._poll_for

    async def recording(*args):
        polls.append(args)
        await poll_for(*args)

    queue._poll_for = recording
    return polls


@in_trio
async def test_no_polling_while_another_queue_has_commands_in_flight(queue):
    answer_at_once(queue)
    busy = SimpleNamespace(qid=2, _slots=SimpleNamespace(pending={5: object()}))
    queue.transport._queues[:] = [queue, busy]  # one thread reaps both: do not hold it up
    polls = recorded_polls(queue)
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        assert (await queue.execute(read_command(), timeout=30)).ok
        assert not polls
        busy._slots.pending.clear()
        assert (await queue.execute(read_command(), timeout=30)).ok
        assert len(polls) == 1
        nursery.cancel_scope.cancel()


@in_trio
async def test_an_event_request_on_the_admin_queue_does_not_stop_polling(queue):
    """The admin queue always holds an Asynchronous Event Request: it would otherwise turn
    polling off for good on every live controller."""
    answer_at_once(queue)
    admin = SimpleNamespace(qid=0, _slots=SimpleNamespace(pending={0: object()}))
    queue.transport._queues[:] = [admin, queue]
    polls = recorded_polls(queue)
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        assert (await queue.execute(read_command(), timeout=30)).ok
        assert len(polls) == 1
        nursery.cancel_scope.cancel()


# -- commands started with a callback (RdmaQueue.start) -------------------------------------------

def start_recording(queue, ends: CommandEnds, timeout: float = 30) -> bool:
    """Start a read whose callback records its request in ``ends``; whether it was sent."""
    return queue.start(read_command(), None, ends, timeout=timeout)


@in_trio
async def test_a_started_command_calls_back_once_answered_with_no_task_waiting(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        await trio.testing.wait_all_tasks_blocked()  # the reaper idles, unarmed
        ends = CommandEnds()
        assert start_recording(queue, ends)
        await trio.testing.wait_all_tasks_blocked()  # the poster posted it
        (cid,) = queue.qp.sent
        assert not ends
        queue.qp.respond(cid)  # the reaper was woken by start(), so it armed for this
        await trio.testing.wait_all_tasks_blocked()
        assert len(ends) == 1 and ends[0].completion.ok and ends[0].error is None
        assert ends[0].completion.command_id == cid
        queue.qp.send_done(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert queue.available == 7
        nursery.cancel_scope.cancel()


@in_trio
async def test_a_started_command_times_out_through_its_callback_after_the_queue_stopped(queue):
    """As for a parked caller: the QP is disconnected before the callback may reuse memory."""
    seen = {}

    def disconnect():
        seen["disconnected first"] = not ends
        queue.cm.connected = False

    queue.cm.connected = True
    queue.cm.disconnect = disconnect
    ends = CommandEnds()
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        assert start_recording(queue, ends, timeout=0.01)
        await ends.wait_for(1)
        assert isinstance(ends[0].error, CommandTimeout) and ends[0].completion is None
        assert seen["disconnected first"]
        assert not start_recording(queue, CommandEnds())  # the queue failed: nothing more is sent
        nursery.cancel_scope.cancel()


@in_trio
async def test_a_failed_queue_tells_started_commands_their_error(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        ends = CommandEnds()
        assert start_recording(queue, ends)
        await trio.testing.wait_all_tasks_blocked()
        (cid,) = queue.qp.sent
        queue.qp.send_done(cid, status=5)  # flushed: the QP went to error
        queue.qp.respond(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert len(ends) == 1 and "work request failed: flushed" in str(ends[0].error)


@in_trio
async def test_start_sends_nothing_while_no_slot_is_free(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        ends = CommandEnds()
        while queue.available:
            assert start_recording(queue, ends)
        assert not start_recording(queue, ends)
        await trio.testing.wait_all_tasks_blocked()
        assert len(queue.qp.sent) == 7 and queue.qp.posts == [7]  # one post_send for all
        nursery.cancel_scope.cancel()


@in_trio
async def test_start_leaves_a_freed_slot_to_a_caller_waiting_for_one(queue):
    """Else a stream of started commands could keep a waiting caller from every slot until
    its timeout."""
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        ends = CommandEnds()
        while queue.available:
            assert start_recording(queue, ends)
        await trio.testing.wait_all_tasks_blocked()
        results: list = []
        nursery.start_soon(read_recording, queue, results)  # waits for a slot
        await trio.testing.wait_all_tasks_blocked()
        cid = next(iter(queue.qp.sent))
        queue.qp.send_done(cid)
        queue.qp.respond(cid)
        queue._drain()  # (as the reaper would) frees the slot and wakes the waiter, not run yet
        assert len(ends) == 1 and queue.available == 1
        assert not start_recording(queue, ends)  # the slot is the waiter's
        await trio.testing.wait_all_tasks_blocked()
        assert queue.available == 0  # the waiter took it, and its read went out
        reused = list(queue.qp.sent)[-1]  # the slot's next generation
        assert reused != cid and reused & queue._slots.mask == cid & queue._slots.mask
        queue.qp.send_done(reused)
        queue.qp.respond(reused)
        await trio.testing.wait_all_tasks_blocked()
        assert len(results) == 1 and results[0].ok
        nursery.cancel_scope.cancel()


async def cancelled_with_a_command_issued_in_the_same_batch(queue, *, in_flight: int) -> list:
    """Start the reaper under a scope, put ``in_flight`` reads in flight, cancel the scope
    and, before the reaper's tasks ran their cancellation, issue a read and start one."""
    scope = trio.CancelScope()

    async def reap(task_status=trio.TASK_STATUS_IGNORED):
        with scope:
            await queue.reap(task_status=task_status)

    results: list = []
    async with trio.open_nursery() as nursery:
        await nursery.start(reap)
        for _ in range(in_flight):
            nursery.start_soon(read_recording, queue, results)
        await trio.testing.wait_all_tasks_blocked()  # the poster and the reaper are parked
        scope.cancel()  # no checkpoint from here on: they are due to run, not run yet
        assert not start_recording(queue, CommandEnds())  # the poster is gone: nothing sent
        await read_recording(queue, results)  # posted directly, failed with the queue
    return results


@pytest.mark.parametrize("in_flight", [1, 0], ids=["poster", "idle reaper"])
def test_a_command_issued_as_the_reaper_is_cancelled_fails_with_the_queue(in_flight, queue):
    """The parked poster and the idle reaper, once cancelled, are already due to run: a
    command issued in that same batch must not reschedule them a second time."""
    results = trio.run(functools.partial(cancelled_with_a_command_issued_in_the_same_batch,
                                         queue, in_flight=in_flight))
    assert [str(r) for r in results] == ["I/O queue 1: stopped"] * (in_flight + 1)


# --- a lost peer: the QP's retry limit, and the oldest command for an overdue check -------

class Endpoint:
    """RDMA-CM's side of connect(): what it was asked, and an accept of 127 entries."""

    def __init__(self, queue) -> None:
        self.asked: dict = {}
        self.context = SimpleNamespace(query_device=lambda: SimpleNamespace(max_qp_rd_atom=4))
        self.connected = False
        queue.cm = self
        queue.transport.connect_timeout = 10.0

    def connect(self, private_data: bytes, **kw) -> bytes:
        self.asked = kw
        self.connected = True
        return struct.pack("<HH28x", 0, 127)

    def disconnect(self) -> None:
        self.connected = False


@pytest.mark.parametrize("cm_timeout, ours", [(17, rdma.ACK_TIMEOUT), (0, rdma.ACK_TIMEOUT),
                                              (14, 14)])
def test_connect_asks_for_a_short_retry_limit_and_lowers_a_longer_ack_timeout(
        queue, cm_timeout, ours):
    """A SEND nobody acknowledges fails after RETRY_COUNT resends of ACK_TIMEOUT each: RDMA-CM's
    7 resends are "forever" on Soft-RoCE, and its timeout (or none, 0) may be longer."""
    cm = Endpoint(queue)
    queue.qp.attrs["timeout"] = cm_timeout
    trio.run(queue.connect, 0)
    assert cm.asked["retry_count"] == rdma.RETRY_COUNT < 7
    assert queue.qp.attrs["timeout"] == ours


def test_a_device_that_keeps_its_ack_timeout_still_connects(queue):
    Endpoint(queue)
    queue.qp.refuse_modify = True
    trio.run(queue.connect, 0)
    assert queue.qp.attrs["timeout"] == 17


def test_the_retry_limit_bounds_how_long_a_lost_peer_goes_unnoticed():
    """(RETRY_COUNT + 1) ACK timeouts of 4.096 us * 2**ACK_TIMEOUT: under a second, so a
    probe sent PROBE_AFTER into a wait fails well within 2 s of the loss."""
    limit = (rdma.RETRY_COUNT + 1) * 4.096e-6 * 2 ** rdma.ACK_TIMEOUT
    assert 0.5 < limit < 1.0
    assert rdma.PROBE_AFTER + limit < 1.5


@in_trio
async def test_a_send_past_its_retry_limit_fails_every_command_on_the_queue(queue):
    """The peer is gone: two commands were acknowledged and wait for answers that never
    come; the next SEND exceeds its retries, the QP flushes its receives, and all three
    fail with the device's reason, without a timeout."""
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        results: list = []
        for _ in range(2):
            nursery.start_soon(read_recording, queue, results)
        await trio.testing.wait_all_tasks_blocked()
        for cid in list(queue.qp.sent):
            queue.qp.send_done(cid)  # acknowledged by the target's device
        await trio.testing.wait_all_tasks_blocked()
        acknowledged = set(queue.qp.sent)
        nursery.start_soon(read_recording, queue, results)  # a probe, as it were
        await trio.testing.wait_all_tasks_blocked()
        (probe,) = set(queue.qp.sent) - acknowledged
        queue.qp.send_cq.wcs.append(WC(queue.qp.sent[probe].wr_id, status=12))
        queue.qp.send_cq.wcs[-1].status_str = "transport retry counter exceeded"
        queue.qp.flush_receives()  # wakes the reaper through the armed receive CQ
        await trio.testing.wait_all_tasks_blocked()
        assert len(results) == 3
        assert all(isinstance(r, TransportError) for r in results), results
        assert all("retry counter exceeded" in str(r) for r in results), results
        nursery.cancel_scope.cancel()


@in_trio
async def test_the_oldest_command_is_the_one_in_flight_the_longest(queue):
    assert queue.oldest_command() is None
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        results: list = []
        for _ in range(3):
            nursery.start_soon(read_recording, queue, results)
            await trio.testing.wait_all_tasks_blocked()
        first, second, _third = list(queue.qp.sent)
        assert queue.oldest_command().cid == first
        queue.qp.send_done(first)
        queue.qp.respond(first)
        await trio.testing.wait_all_tasks_blocked()
        assert queue.oldest_command().cid == second
        for cid in list(queue.qp.sent)[1:]:
            queue.qp.send_done(cid)
            queue.qp.respond(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert len(results) == 3 and queue.oldest_command() is None
        nursery.cancel_scope.cancel()
