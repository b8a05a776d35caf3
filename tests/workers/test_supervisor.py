"""The main process's side of FUSE workers (workers/supervisor.py): a rescan's sizes sent to
every worker and only to workers, and waited for (bounded) from each that serves; over fake
worker processes, without FUSE."""

from __future__ import annotations

import contextlib
import logging
import signal
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from ramdisk import ram_controller


def _pool_on(ctrl, count: int, **options):
    """FuseWorkers of ``count`` processes, their role registered with a companion server of
    ``ctrl``, and that server given to them as run() gives it (no process started)."""
    from nvmeof_fuse.companion.server.server import CompanionServer
    from nvmeof_fuse.workers.supervisor import FuseWorkers

    pool = FuseWorkers(count, **options)
    pool.companion = CompanionServer(ctrl, roles=[pool.role])
    return pool


def test_the_main_process_sends_every_worker_and_only_workers_the_new_sizes():
    ctrl = ram_controller((1, 512, 64), (2, 4096, 16))
    pool = _pool_on(ctrl, 2)
    server = pool.companion
    told: dict[str, list] = {}
    for peer, worker in (("worker", True), ("client", False)):
        session = server.new_session(peer)
        session.role = pool.role if worker else None

        async def notify(event, peer=peer):
            told.setdefault(peer, []).append(event)
            return True

        session.notify = notify
    trio.run(pool.follow, [])
    assert told == {"worker": [{"event": "namespaces", "generation": 1,
                                "namespaces": [[1, 512, 64, 0], [2, 4096, 16, 0]]}]}


def test_past_the_namespaces_one_message_holds_workers_are_sent_none_and_told_once(caplog):
    """More namespaces than fit the companion socket's 64 KiB: a worker's lease names none
    and a rescan sends none (the workers drop theirs and forward their I/O), and the main
    process says why once (it used to die on the send)."""
    from nvmeof_fuse.companion import protocol
    from nvmeof_fuse.workers.messages import MAX_FOLLOWED_NAMESPACES

    biggest = [[0xFFFFFFFE, 4096, (1 << 64) - 1]] * MAX_FOLLOWED_NAMESPACES
    assert len(protocol.encode({"id": 0, "ok": True, "event": "namespaces",
                                "namespaces": biggest})) < protocol.MAX_MESSAGE
    ctrl = ram_controller(*((nsid, 512, 8) for nsid in range(1, MAX_FOLLOWED_NAMESPACES + 2)))
    pool = _pool_on(ctrl, 2)
    session = pool.companion.new_session("worker", 42)
    session.role = pool.role
    told: list = []

    async def notify(event):
        told.append(event)
        return True

    session.notify = notify
    ready = {"kind": "ready", "index": 1, "pid": 42, "qids": [6]}
    with caplog.at_level(logging.WARNING, logger="nvmeof-fuse"):
        assert trio.run(pool.on_fuse, session, ready, b"") == {}  # its lease named none: once
        trio.run(pool.follow, [])
        trio.run(pool.follow, [])
    assert told == [{"event": "namespaces", "namespaces": [], "generation": g} for g in (1, 2)]
    assert caplog.messages == [f"FUSE workers: {MAX_FOLLOWED_NAMESPACES + 1} namespaces are more "
                               f"than the {MAX_FOLLOWED_NAMESPACES} whose sizes they are sent; "
                               "they forward their I/O to the main process"]


class _Proc:
    """A worker process to the main process: its pid, and its exit when told to die."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode, self.died = pid, None, trio.Event()

    async def wait(self) -> int:
        await self.died.wait()
        self.returncode = -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        self.died.set()


def _serving_pool(count: int, on_notify, timeout: float = 30.0):
    """FuseWorkers with ``count - 1`` serving workers (pid 100 + index), each with a
    companion session whose events go to ``on_notify(pool, index, event)`` (sent unless it
    returns False)."""
    pool = _pool_on(ram_controller((1, 512, 64)), count, timeout=timeout)
    for index in range(1, count):
        session = pool.companion.new_session(f"pid {100 + index} uid 0", 100 + index)
        session.role = pool.role

        async def notify(event, index=index):
            return await on_notify(pool, index, event) is not False

        session.notify = notify
    return pool


@contextlib.asynccontextmanager
async def _running(pool):
    """The pool's supervisors over fake processes, each serving; yields them by index
    (a replacement takes pid 200 + index)."""
    procs: dict = {}

    async def spawn(index):
        procs[index] = _Proc((200 if index in procs else 100) + index)
        return procs[index]

    pool._spawn = spawn
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run, None, None, pool.companion)
        await trio.testing.wait_all_tasks_blocked()
        for index, proc in procs.items():
            await pool.on_fuse(SimpleNamespace(pid=proc.pid),
                               {"kind": "ready", "index": index, "pid": proc.pid, "qids": []},
                               b"")
        yield procs
        nursery.cancel_scope.cancel()


async def _ack(pool, index, event):
    await pool.on_fuse(SimpleNamespace(pid=100 + index),
                       {"kind": "namespaces", "index": index, "pid": 100 + index,
                        "generation": event["generation"]}, b"")


def test_a_rescan_goes_on_once_every_serving_worker_took_the_new_sizes():
    """The files show a new size only after each worker took it (the mount's listener runs
    after this one): a worker takes an event in its own time."""
    order = []

    async def main():
        async def on_notify(pool, index, event):
            async def later():
                await trio.sleep(index / 2)  # a while; worker 2 last
                order.append(f"worker {index} took generation {event['generation']}")
                await _ack(pool, index, event)

            nursery.start_soon(later)

        pool = _serving_pool(3, on_notify)
        async with trio.open_nursery() as nursery, _running(pool):
            for generation in (1, 2):
                await pool.follow([])
                order.append(f"files show generation {generation}")

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert order == ["worker 1 took generation 1", "worker 2 took generation 1",
                     "files show generation 1", "worker 1 took generation 2",
                     "worker 2 took generation 2", "files show generation 2"]


@pytest.mark.parametrize(("timeout", "bound"), [(30.0, 10.0), (3.0, 3.0)])
def test_a_worker_that_never_says_it_took_the_sizes_holds_a_rescan_only_so_long(
        caplog, timeout, bound):
    """As long as the mount's command timeout, at most :data:`SIZES_TIMEOUT`."""
    from nvmeof_fuse.workers.supervisor import SIZES_TIMEOUT

    assert bound == min(timeout, SIZES_TIMEOUT)

    async def on_notify(pool, index, event):
        if index == 1:
            await _ack(pool, index, event)

    async def main():
        pool = _serving_pool(3, on_notify, timeout)
        async with _running(pool):
            began = trio.current_time()
            with caplog.at_level(logging.WARNING, logger="nvmeof-fuse"):
                await pool.follow([])
            return trio.current_time() - began

    waited = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert waited == bound
    assert caplog.messages == [
        f"FUSE worker 2 (pid 102) did not say it took the namespaces' new sizes within "
        f"{bound:g} s; it may serve by the old ones until it takes them"]


def test_a_worker_that_dies_or_does_not_serve_yet_holds_no_rescan(caplog):
    """Its replacement (or the worker itself, once it serves) takes the sizes with its
    lease, or keeps them until its filesystem is up."""
    from nvmeof_fuse.workers.supervisor import SIZES_TIMEOUT

    procs: dict = {}

    async def on_notify(pool, index, event):
        if index == 2:
            procs[2].kill()  # killed before it took them
        elif index == 1:
            await _ack(pool, index, event)

    async def main():
        pool = _serving_pool(4, on_notify)
        async with _running(pool) as running:
            procs.update(running)
            del pool.ready[3]  # connecting its queues still: it says nothing
            with caplog.at_level(logging.WARNING, logger="nvmeof-fuse"):
                await pool.follow([])
            return trio.current_time()

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) < SIZES_TIMEOUT
    assert [m for m in caplog.messages if "did not say" in m] == []


def test_a_rescan_waits_for_no_worker_it_did_not_send_the_sizes(caplog):
    """One that leased after the sending passed it (its lease had the new sizes), or whose
    send failed, would never answer: the rescan goes on without it, unwarned."""
    sessions = {}

    async def on_notify(pool, index, event):
        if index == 1:
            await _ack(pool, index, event)
        return index != 3  # worker 3's send failed

    async def main():
        pool = _serving_pool(4, on_notify)
        for session in pool.companion.sessions:
            sessions[session.pid] = session
        sessions[102].role = None  # leases once the sending passed it
        async with _running(pool):
            with caplog.at_level(logging.WARNING, logger="nvmeof-fuse"):
                await pool.follow([])
            return trio.current_time()

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == 0
    assert [m for m in caplog.messages if "did not say" in m] == []
