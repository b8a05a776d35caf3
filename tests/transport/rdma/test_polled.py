"""PolledQueue over fake verbs: callers' threads post and reap; detach and failures end waits.

The fakes are test_transport_queue's: the test plays the target (SEND completions, responses),
from another thread where a waiter must sleep on the completion channel.
"""

from __future__ import annotations

import math
import os
import threading
import time
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from transport.rdma.test_transport_queue import fake_rdma_queue

from nvmeof_fuse.errors import CommandTimeout, TransportError
from nvmeof_fuse.nvme import command as cmd
from nvmeof_fuse.nvme.sgl import NULL_SGL
from nvmeof_fuse.transport.pollbudget import PollBudget
from nvmeof_fuse.transport.rdma import polled as rdma_polled
from nvmeof_fuse.transport.rdma.polled import PolledQueue, take_over
from nvmeof_fuse.transport.region import host_buffer


class Keys:
    lkey, rkey = 0x11, 0x22


@pytest.fixture
def queue(monkeypatch):
    yield from fake_rdma_queue(monkeypatch)


@pytest.fixture
def memory():
    buf = host_buffer(lambda addr, length, owner: SimpleNamespace(keys=lambda pd: Keys(),
                                                                  close=lambda: None), 65536)
    yield buf
    buf.close()


def reads(memory, count: int) -> list:
    return [(cmd.read(1, i, 1, NULL_SGL), memory.ref(i * 4096, 4096)) for i in range(count)]


def answer(qp, cid: int, status_word: int = 0) -> None:
    qp.send_done(cid)
    qp.respond(cid, status_word)


def later(delay: float, fn, *args) -> threading.Thread:
    """``fn(*args)`` from another thread once ``delay`` s passed (the target answering)."""
    def run() -> None:
        time.sleep(delay)
        fn(*args)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_posted_read_is_reaped_by_its_waiter_and_frees_its_slot(queue, memory):
    polled = PolledQueue(queue)
    (request,) = polled.submit(reads(memory, 1))
    assert len(queue.qp.sent) == 1 and polled.available == 6
    answer(queue.qp, request.cid)
    completion = polled.wait(request, time.perf_counter() + 30)
    assert completion.ok and completion.command_id == request.cid
    assert polled.available == 7 and polled.pending == 0


def test_a_read_submitted_alone_is_the_capsule_a_list_of_one_writes(queue, memory):
    """submit_read encodes its command in place: the same bytes as submit's, its own CID."""
    polled = PolledQueue(queue)
    ((sqe, ref),) = reads(memory, 1)
    listed = polled.submit([(sqe, ref)])[0]
    capsule = queue.capsules.view
    at = listed.slot * 64
    expected = bytes(capsule[at:at + 64])
    alone = polled.submit_read(1, 0, 1, ref)
    at = alone.slot * 64
    assert alone.cid != listed.cid and bytes(capsule[at + 4:at + 64]) == expected[4:]
    assert int.from_bytes(capsule[at + 2:at + 4], "little") == alone.cid
    for request in (listed, alone):
        answer(queue.qp, request.cid)
        assert polled.wait(request, time.perf_counter() + 30).ok
    posts = list(queue.qp.posts)
    with pytest.raises(ValueError, match="number of logical blocks"):
        polled.submit_read(1, 0, 0, ref)
    assert polled.available == 7 and queue.qp.posts == posts  # its slot back, nothing sent


def test_a_read_reaped_before_its_wait_teaches_the_budget_nothing(queue, memory):
    """Its caller came late (busy elsewhere): that delay is not the command's latency."""
    polled = PolledQueue(queue)
    first, second = polled.submit(reads(memory, 2))
    answer(queue.qp, first.cid)
    answer(queue.qp, second.cid)
    assert polled.wait(first, time.perf_counter() + 30).ok  # reaps both
    learned = polled.poll_budget.latency(4096)
    assert second.finished
    time.sleep(0.05)
    assert polled.wait(second, time.perf_counter() + 30).ok
    assert polled.poll_budget.latency(4096) == learned


def test_a_read_answered_before_its_send_completed_is_pending_but_not_unanswered(queue,
                                                                                memory):
    polled = PolledQueue(queue)
    (request,) = polled.submit(reads(memory, 1))
    assert polled.unanswered == polled.pending == 1
    queue.qp.respond(request.cid)  # its SEND completion comes later
    assert polled.wait(request, time.perf_counter() + 30).ok
    assert polled.pending == 1 and polled.unanswered == 0


def test_many_reads_go_out_in_one_post(queue, memory):
    polled = PolledQueue(queue)
    requests = polled.submit(reads(memory, 4))
    assert queue.qp.posts == [4]
    for request in requests:
        answer(queue.qp, request.cid)
    assert all(polled.wait(r, time.perf_counter() + 30).ok for r in requests)


def test_reads_submitted_unposted_go_out_together_on_flush(queue, memory):
    polled = PolledQueue(queue)
    first = polled.submit(reads(memory, 2), post=False)
    second = polled.submit(reads(memory, 1), post=False)
    assert queue.qp.posts == [] and polled.available == 4  # their slots are taken
    polled.flush()
    polled.flush()  # nothing left: no empty post
    assert queue.qp.posts == [3]
    for request in first + second:
        answer(queue.qp, request.cid)
    assert all(polled.wait(r, time.perf_counter() + 30).ok for r in first + second)


def test_a_post_takes_the_unposted_reads_along(queue, memory):
    polled = PolledQueue(queue)
    polled.submit(reads(memory, 2), post=False)
    polled.submit(reads(memory, 1))
    assert queue.qp.posts == [3]


@pytest.mark.parametrize("waiting", ["wait", "progress"])
def test_waiting_on_the_queue_posts_what_was_left_unposted(queue, memory, waiting):
    polled = PolledQueue(queue)
    (request,) = polled.submit(reads(memory, 1), post=False)
    if waiting == "wait":
        target = later(0.05, answer, queue.qp, request.cid)
        assert polled.wait(request, time.perf_counter() + 30).ok
        target.join()
    else:
        polled.progress()
    assert queue.qp.posts == [1]


@pytest.fixture
def hold_long(monkeypatch):
    """Held doorbells are posted by the caller's calls, never for their age."""
    monkeypatch.setattr(rdma_polled, "HOLD_SHARE", 1e9)


def harvesting(queue, memory) -> tuple[PolledQueue, list]:
    """A polled queue whose caller reaped 3 answered reads and collected the first."""
    polled = PolledQueue(queue)
    requests = polled.submit(reads(memory, 3))
    for request in requests:
        answer(queue.qp, request.cid)
    assert polled.wait(requests[0], time.perf_counter() + 30).ok  # reaps all three
    assert all(r.finished for r in requests) and queue.qp.posts == [3]
    return polled, requests


def test_reads_submitted_while_their_caller_collects_reaped_ones_go_out_together(
        queue, memory, hold_long):
    """One doorbell for a harvest's refills: held until the last reaped read is collected."""
    polled, (_, second, third) = harvesting(queue, memory)
    ((sqe, ref),) = reads(memory, 1)
    refills = [polled.submit_read(1, 0, 1, ref)]
    assert queue.qp.posts == [3]  # held
    assert polled.wait(second, time.perf_counter() + 30).ok
    refills += polled.submit([(sqe, ref)])
    assert queue.qp.posts == [3]
    assert polled.wait(third, time.perf_counter() + 30).ok  # the last one: they go
    assert queue.qp.posts == [3, 2]
    refills.append(polled.submit_read(1, 0, 1, ref))  # nothing left to collect: at once
    assert queue.qp.posts == [3, 2, 1]
    for request in refills:
        answer(queue.qp, request.cid)
        assert polled.wait(request, time.perf_counter() + 30).ok


def test_answers_that_came_during_a_harvest_extend_it(queue, memory, hold_long):
    """Its end reaps again: the refills of both bursts go out together."""
    polled = PolledQueue(queue)
    first, second, late = polled.submit(reads(memory, 3))
    answer(queue.qp, first.cid)
    answer(queue.qp, second.cid)
    assert polled.wait(first, time.perf_counter() + 30).ok
    ((_, ref),) = reads(memory, 1)
    refill = polled.submit_read(1, 0, 1, ref)
    answer(queue.qp, late.cid)  # not reaped yet
    assert polled.wait(second, time.perf_counter() + 30).ok
    assert late.finished and queue.qp.posts == [3]  # reaped at the harvest's end: held on
    assert polled.wait(late, time.perf_counter() + 30).ok  # found waiting: no block either
    assert queue.qp.posts == [3, 1]
    answer(queue.qp, refill.cid)
    assert polled.wait(refill, time.perf_counter() + 30).ok


def test_a_caller_about_to_block_posts_what_was_held_back(queue, memory, hold_long):
    polled, _ = harvesting(queue, memory)
    ((_, ref),) = reads(memory, 1)
    request = polled.submit_read(1, 0, 1, ref)
    assert queue.qp.posts == [3]
    target = later(0.05, answer, queue.qp, request.cid)
    assert polled.wait(request, time.perf_counter() + 30).ok  # not answered yet: posts first
    target.join()
    assert queue.qp.posts == [3, 1]
    polled.submit_read(1, 0, 1, ref)  # the harvest ended with that wait
    assert queue.qp.posts == [3, 1, 1]


def test_a_caller_polling_for_progress_posts_what_was_held_back(queue, memory, hold_long):
    polled, _ = harvesting(queue, memory)
    ((_, ref),) = reads(memory, 1)
    polled.submit_read(1, 0, 1, ref)
    polled.progress()  # a future's done()
    assert queue.qp.posts == [3, 1]


def test_a_doorbell_held_its_share_of_the_latency_goes_at_the_callers_next_call(
        queue, memory, monkeypatch):
    """The caller collects slowly (it works on each read): a refill is held no longer than
    a share of what its reads take, not for the whole harvest."""
    now = [100.0]
    monkeypatch.setattr(rdma_polled.time, "perf_counter", lambda: now[0])
    polled = PolledQueue(queue)
    requests = polled.submit(reads(memory, 4))
    for request in requests:
        answer(queue.qp, request.cid)
    assert polled.wait(requests[0], now[0] + 30).ok  # reaps all four: three to collect
    window = rdma_polled.HOLD_SHARE * polled.poll_budget.latency(4096)
    ((_, ref),) = reads(memory, 1)
    polled.submit_read(1, 0, 1, ref)
    now[0] += window * 0.6
    polled.submit_read(1, 0, 1, ref)  # the first one's age counts
    assert polled.wait(requests[1], now[0] + 30).ok
    assert queue.qp.posts == [4]  # young enough: held on
    now[0] += window * 0.6
    assert polled.wait(requests[2], now[0] + 30).ok  # one still to collect, but held long
    assert queue.qp.posts == [4, 2]
    polled.submit_read(1, 0, 1, ref)  # a new hold, timed from now
    assert queue.qp.posts == [4, 2]
    now[0] += window
    polled.submit_read(1, 0, 1, ref)  # held long: the submit itself posts both
    assert queue.qp.posts == [4, 2, 2]


@pytest.mark.parametrize("ahead", [1, 2, 4, 7])  # (7 slots)
def test_a_prefetch_loop_has_its_reads_held_a_quarter_of_their_latency_at_most(
        queue, memory, monkeypatch, ahead):
    """``pread`` the block ``ahead``, ``get`` the last, compute on it for 10 ms; the target
    answers all that went out meanwhile.  Reads are then held (answers wait for the
    caller), but no more turns than a quarter of what a read takes, submission to
    reaping (``ahead - 1`` turns here), and none is lost."""
    now = [100.0]
    monkeypatch.setattr(rdma_polled.time, "perf_counter", lambda: now[0])
    polled = PolledQueue(queue)
    ((_, ref),) = reads(memory, 1)
    submitted = [polled.submit_read(1, block, 1, ref) for block in range(ahead - 1)]
    answered = 0

    def target_answers() -> None:
        nonlocal answered
        posted = sum(queue.qp.posts)  # (posts go out in submission order)
        for request in submitted[answered:posted]:
            answer(queue.qp, request.cid)
        answered = posted

    most = math.ceil(rdma_polled.HOLD_SHARE * (ahead - 1))
    for block in range(ahead - 1, ahead + 40):
        submitted.append(polled.submit_read(1, block, 1, ref))  # pread
        target_answers()
        assert polled.wait(submitted[block - ahead + 1], now[0] + 30).ok  # get
        assert len(submitted) - sum(queue.qp.posts) <= most
        now[0] += 0.01  # compute
    for request in submitted[len(submitted) - ahead + 1:]:
        target_answers()
        assert polled.wait(request, now[0] + 30).ok


def test_a_failed_queue_holds_nothing_back(queue, memory, hold_long):
    """(A held read is posted by any wait for it, or fails with the queue: never lost.)"""
    polled, _ = harvesting(queue, memory)
    ((_, ref),) = reads(memory, 1)
    held = polled.submit_read(1, 0, 1, ref)
    polled.detach("the test is over")
    with pytest.raises(TransportError, match="the test is over"):
        polled.wait(held, time.perf_counter() + 30)
    polled.flush()
    assert queue.qp.posts == [3]  # a failed read is never posted later


def test_a_failed_flush_fails_the_unposted_reads_and_the_queue(queue, memory):
    polled = PolledQueue(queue)
    (request,) = polled.submit(reads(memory, 1), post=False)
    queue.qp.fail_posts = True
    polled.flush()
    assert "cannot post a command" in str(polled.failed)
    with pytest.raises(TransportError, match="cannot post a command"):
        polled.wait(request, time.perf_counter() + 30)
    queue.qp.fail_posts = False
    polled.flush()
    assert queue.qp.posts == []  # failed reads are never posted later


def test_a_queue_without_the_slots_for_all_posts_nothing(queue, memory):
    polled = PolledQueue(queue)
    assert polled.submit(reads(memory, 8)) is None  # 7 slots
    assert queue.qp.posts == [] and polled.available == 7


def test_a_waiter_sleeps_on_the_channel_until_the_answer_comes(queue, memory):
    polled = PolledQueue(queue)
    (request,) = polled.submit(reads(memory, 1))
    target = later(0.05, answer, queue.qp, request.cid)  # past the spin: armed, asleep
    assert polled.wait(request, time.perf_counter() + 30).ok
    target.join()


def test_a_channel_past_select_s_fd_limit_is_still_slept_on(queue, memory, monkeypatch):
    # A sleeper wakes for the answer only (not every slice), so the count below does not
    # depend on how late the answer comes.
    monkeypatch.setattr(rdma_polled, "BLOCK_SLICE", 30.0)
    channel = queue.channel
    high = os.dup2(channel.fd, 1500)  # select() refuses fds from FD_SETSIZE (1024) on
    os.close(channel.fd)
    channel.fd = high
    polled = PolledQueue(queue)
    polled.poll_budget = PollBudget(0.0)  # never polls: its waiter sleeps at once
    (request,) = polled.submit(reads(memory, 1))
    drains = 0
    drain = polled._drain

    def counted() -> int:
        nonlocal drains
        drains += 1
        return drain()

    polled._drain = counted
    target = later(0.2, answer, queue.qp, request.cid)
    assert polled.wait(request, time.perf_counter() + 30).ok
    target.join()
    assert drains < 50  # slept on the channel: a spinning waiter polls thousands of times


def test_two_waiting_threads_are_served_by_one_poller(queue, memory):
    polled = PolledQueue(queue)
    first, second = polled.submit(reads(memory, 2))
    results = {}

    def wait(request) -> None:
        results[request.cid] = polled.wait(request, time.perf_counter() + 30).ok

    waiters = [threading.Thread(target=wait, args=(r,)) for r in (first, second)]
    for waiter in waiters:
        waiter.start()
    later(0.02, answer, queue.qp, second.cid).join()
    later(0.02, answer, queue.qp, first.cid).join()
    for waiter in waiters:
        waiter.join(30)
    assert results == {first.cid: True, second.cid: True}


def test_no_answer_times_the_wait_out_and_keeps_the_slot(queue, memory):
    polled = PolledQueue(queue)
    (request,) = polled.submit(reads(memory, 1))
    with pytest.raises(CommandTimeout, match=r"I/O queue 1: command \d+ got no completion"):
        polled.wait(request, time.perf_counter() + 0.05)
    assert polled.pending == 1  # the target may still write: its slot stays taken


def test_detach_fails_the_waiting_read_and_later_submits(queue, memory):
    polled = PolledQueue(queue)
    (request,) = polled.submit(reads(memory, 1))
    later(0.05, polled.detach, "its connection is being reset")
    with pytest.raises(TransportError, match="I/O queue 1: its connection is being reset"):
        polled.wait(request, time.perf_counter() + 30)
    assert polled.submit(reads(memory, 1)) is None


def test_a_failed_work_request_fails_every_read_in_flight(queue, memory):
    polled = PolledQueue(queue)
    first, second = polled.submit(reads(memory, 2))
    queue.qp.send_done(first.cid, status=5)
    with pytest.raises(TransportError, match="work request failed: flushed"):
        polled.wait(first, time.perf_counter() + 30)
    with pytest.raises(TransportError, match="work request failed"):
        polled.wait(second, time.perf_counter() + 30)
    assert polled.failed is not None


def test_a_failed_post_fails_the_queue(queue, memory):
    polled = PolledQueue(queue)
    queue.qp.fail_posts = True
    assert polled.submit(reads(memory, 1)) is None
    assert "cannot post a command" in str(polled.failed)


def test_take_over_waits_for_the_queue_to_be_idle_then_stops_its_reaper(queue, memory):
    async def main() -> PolledQueue | None:
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.reap)
            results = []

            async def connect_like() -> None:
                results.append(await queue.execute(cmd.read(1, 0, 1, NULL_SGL), timeout=30))

            nursery.start_soon(connect_like)
            await trio.testing.wait_all_tasks_blocked()
            (cid,) = queue.qp.sent
            queue.qp.respond(cid)  # answered, its SEND completion still due
            await trio.testing.wait_all_tasks_blocked()
            assert results and queue._slots.pending
            taking = trio.Event()
            taken = []

            async def take() -> None:
                taken.append(await take_over(queue, 30))
                taking.set()

            nursery.start_soon(take)
            await trio.testing.wait_all_tasks_blocked()
            assert not taken  # waits for the SEND completion
            queue.qp.send_done(cid)
            await taking.wait()
            return taken[0]

    polled = trio.run(main)
    assert isinstance(polled, PolledQueue) and queue._reaped.is_set()
    queue.qp.sent.clear()
    (request,) = polled.submit(reads(memory, 1))
    answer(queue.qp, request.cid)
    assert polled.wait(request, time.perf_counter() + 30).ok


def test_the_owner_of_the_memory_is_held_until_the_response_came(queue, memory):
    polled = PolledQueue(queue)
    owner = object()
    (request,) = polled.submit(reads(memory, 1), owner)
    assert owner in polled._held.values()
    answer(queue.qp, request.cid)
    polled.progress()
    assert request.finished and owner not in polled._held.values()


def test_a_failed_queue_holds_no_caller_memory(queue):
    """The queue's error is raised to every waiter: it must not carry a waiter's frame (its
    request and DataRef) on its traceback, nor the poller's (the request it was handling)."""
    import gc
    import weakref

    import numpy as np

    from nvmeof_fuse.host.memory import buffer_address
    from nvmeof_fuse.transport.region import Region

    polled = PolledQueue(queue)
    arrays = []

    def submit_one():
        array = np.zeros(4096, dtype=np.uint8)
        addr, length, owner = buffer_address(array)
        region = Region(addr, length, SimpleNamespace(keys=lambda pd: Keys(), close=lambda: None),
                        owner)
        arrays.append(weakref.ref(array))
        (request,) = polled.submit([(cmd.read(1, 0, 1, NULL_SGL), region.ref())])
        return request

    requests = [submit_one(), submit_one()]
    answer(queue.qp, requests[0].cid)
    queue.qp.respond(requests[0].cid)  # a second response: raised while the poller holds it
    for request in requests:
        try:
            polled.wait(request, time.perf_counter() + 30)
        except TransportError:
            pass
    del requests, request
    gc.collect()
    assert polled.failed is not None and [ref() for ref in arrays] == [None, None]
