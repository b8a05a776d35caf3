"""RdmaQueue's command path over fake verbs: completion, timeouts, cancellation, failures.

The fake QP records what is posted and the test decides when (and whether) the target's SEND
completion and response arrive; the completion channel is a pipe, as the real one is an fd.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import math
import os
import struct
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from nvmeof_fuse.errors import CommandTimeout, TransportError
from nvmeof_fuse.nvme import command as cmd
from nvmeof_fuse.nvme.sgl import NULL_SGL
from nvmeof_fuse.transport import rdma
from nvmeof_fuse.transport.region import host_buffer


class FakeSGE:
    def __init__(self, addr: int, length: int, lkey: int = 0) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class FakeWR:
    def __init__(self, wr_id: int = 0, sg_list=None, **kw) -> None:
        self.wr_id, self.sg_list = wr_id, list(sg_list or [])


FAKE_VERBS = SimpleNamespace(
    SGE=FakeSGE, SendWR=FakeWR, RecvWR=FakeWR, QPInitAttr=lambda **kw: SimpleNamespace(**kw),
    QPType=SimpleNamespace(RC=2), WROpcode=SimpleNamespace(SEND=2, RDMA_WRITE=0),
    SendFlags=SimpleNamespace(SIGNALED=2),
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

    def add(self, wc: WC) -> None:
        self.wcs.append(wc)
        if self.armed:
            self.armed = False
            self.channel.signal(self)

    def poll(self, n: int) -> list:
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
        self.sent: dict[int, FakeWR] = {}  # cid -> capsule SEND
        self.recvs: collections.deque = collections.deque()
        self.posts: list[int] = []  # WRs per post_send call
        self.fail_posts = False

    def post_send(self, wrs) -> None:
        if self.fail_posts:
            raise OSError(errno.ENOMEM, "send queue full")
        self.posts.append(len(wrs))
        for wr in wrs:
            self.sent[wr.wr_id & rdma._INDEX] = wr

    def post_recv(self, wrs) -> None:
        self.recvs.extend(wrs)

    def close(self) -> None:
        pass

    # -- the target's side --
    def send_done(self, cid: int, status: int = 0) -> None:
        self.send_cq.add(WC(self.sent[cid].wr_id, status))

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
    monkeypatch.setattr(rdma, "_ibverbs", FAKE_VERBS)
    transport = SimpleNamespace(traddr="fake", trsvcid=4420)
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


@in_trio
async def test_response_completes_the_command_and_the_send_frees_its_slot(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        results = []
        nursery.start_soon(read_recording, queue, results)
        await trio.testing.wait_all_tasks_blocked()
        (cid,) = queue.qp.sent
        queue.qp.respond(cid)
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
async def test_timeout_abandons_the_command_until_the_target_answers(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        with pytest.raises(CommandTimeout, match="got no completion within 0.01 s"):
            await queue.execute(read_command(), timeout=0.01)
        (cid,) = queue.qp.sent
        assert queue.available == 6  # the target may still write: the slot stays taken
        queue.qp.send_done(cid)
        queue.qp.respond(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert queue.available == 7
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


def with_mock_clock(test):
    """Run an async test under trio with a clock that jumps whenever every task waits."""
    @functools.wraps(test)
    def run(queue):
        async def guarded():
            with trio.fail_after(HANG_GUARD):
                await test(queue)

        trio.run(guarded, clock=trio.testing.MockClock(autojump_threshold=0))

    return run


async def probe_posted(queue) -> int:
    """Wait (in mock time) until the queue probed the target; the probe's command ID."""
    probe = queue._slots.probe_cid
    while probe not in queue.qp.sent:
        await trio.sleep(rdma.PROBE_AFTER / 4)
    return probe


@with_mock_clock
async def test_a_target_that_closed_the_connection_fails_waiting_commands_at_once(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        results = []
        nursery.start_soon(read_recording, queue, results)
        probe = await probe_posted(queue)
        assert not results  # a probe, not a verdict: the command still waits
        queue.qp.send_done(probe, status=rdma._WC_RETRY_EXC_ERR)  # nobody acknowledged it
        await trio.testing.wait_all_tasks_blocked()
        assert results and isinstance(results[0], TransportError), results
        assert "the target at fake:4420 closed the connection" in str(results[0])
        with pytest.raises(TransportError, match="closed the connection"):
            await queue.execute(read_command(), timeout=30)


@with_mock_clock
async def test_a_live_target_acknowledges_the_probe_and_the_command_goes_on(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        results = []
        nursery.start_soon(read_recording, queue, results)
        probe = await probe_posted(queue)
        (cid,) = set(queue.qp.sent) - {probe}
        queue.qp.send_done(probe)  # acknowledged: the send CQ wakes the reaper
        await trio.testing.wait_all_tasks_blocked()
        assert not queue._slots.probing and not results
        del queue.qp.sent[probe]
        assert await probe_posted(queue) == probe  # still unanswered: probed again
        queue.qp.send_done(probe)
        queue.qp.send_done(cid)
        queue.qp.respond(cid)
        await trio.testing.wait_all_tasks_blocked()
        assert results and results[0].ok
        nursery.cancel_scope.cancel()


@with_mock_clock
async def test_an_idle_or_answering_queue_sends_no_probe(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        await trio.sleep(10 * rdma.PROBE_AFTER)  # idle
        results = []
        nursery.start_soon(read_recording, queue, results)
        await trio.sleep(rdma.PROBE_AFTER / 2)  # answered before a probe is due
        (cid,) = queue.qp.sent
        queue.qp.send_done(cid)
        queue.qp.respond(cid)
        await trio.sleep(10 * rdma.PROBE_AFTER)
        assert results and results[0].ok and set(queue.qp.sent) == {cid}
        nursery.cancel_scope.cancel()


@with_mock_clock
async def test_a_command_without_timeout_sends_no_probe(queue):
    async with trio.open_nursery() as nursery:
        await started(queue, nursery)
        async def forever() -> None:
            with pytest.raises(TransportError, match="stopped"):  # by the cancel below
                await queue.execute(read_command(), timeout=math.inf)

        nursery.start_soon(forever)
        await trio.sleep(10 * rdma.PROBE_AFTER)  # an AER waits for ever: no reason to probe
        assert queue._slots.probe_cid not in queue.qp.sent and len(queue.qp.sent) == 1
        nursery.cancel_scope.cancel()
