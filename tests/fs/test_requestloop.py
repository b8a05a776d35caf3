"""The request loop (fs/requestloop.py): leader/follower reading and running, its yields,
and its brief poll at an idle moment; driven by a plain ``take`` over a socket pair."""

from __future__ import annotations

import socket

import trio
import trio.testing

STEP = 20  # s: bound on every wait


def test_the_reader_runs_its_request_and_hands_the_reading_on():
    """Leader/follower: the task that read the last queued request runs it (no hand-over),
    another task reads meanwhile, so a handler that waits holds up only its own task; the
    end of the session lets every task exit."""
    from nvmeof_fuse.fs.requestloop import RequestLoop, SessionEnded

    async def main():
        ran: list[str] = []
        read_by: dict[str, object] = {}
        ran_by: dict[str, object] = {}
        release = trio.Event()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)

        async def job(name: str) -> None:
            ran_by[name] = trio.lowlevel.current_task()
            if name.startswith("held"):
                await release.wait()
            ran.append(name)

        def take():
            name = ours.recv(64).decode()  # BlockingIOError when none is queued
            if name == "end":
                raise SessionEnded
            if name == "none":
                return None  # answered while read: no handler
            read_by[name] = trio.lowlevel.current_task()
            return job, (name,)

        with ours, theirs, trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                loop = RequestLoop(nursery, ours.fileno(), take)
                loop.start()
                await trio.testing.wait_all_tasks_blocked()
                assert loop.reading and loop.parked  # parked on the descriptor
                theirs.send(b"held1")
                theirs.send(b"none")
                theirs.send(b"a")
                await trio.testing.wait_all_tasks_blocked()
                assert ran == ["a"]  # not held up by held1
                theirs.send(b"held2")
                await trio.testing.wait_all_tasks_blocked()
                theirs.send(b"b")
                await trio.testing.wait_all_tasks_blocked()
                assert ran == ["a", "b"]
                # Read alone (or last of a burst): run by the task that read it.
                assert all(read_by[n] is ran_by[n] for n in ("a", "held2", "b"))
                assert ran_by["held1"] is not ran_by["held2"]
                release.set()
                await trio.testing.wait_all_tasks_blocked()
                assert sorted(ran) == ["a", "b", "held1", "held2"]
                theirs.send(b"end")
            assert loop.closing and not loop.idle

    trio.run(main)


def test_the_reader_lets_other_tasks_run_in_a_long_stream_of_requests():
    """Requests answered while read (FORGETs, ...) or handed to other tasks: the reader yields
    every BATCH of them, so a stream of them starves no other task."""
    from nvmeof_fuse.fs.requestloop import BATCH, RequestLoop

    async def main():
        ticks = 0
        seen: list[int] = []
        stream = [None] * (3 * BATCH)

        def take():
            if not stream:
                raise BlockingIOError
            seen.append(ticks)
            return stream.pop()

        async def other():
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours, theirs, trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(other)
                loop = RequestLoop(nursery, ours.fileno(), take)
                loop.start()
                while stream:
                    await trio.sleep(0)
                loop.close()
                nursery.cancel_scope.cancel()
        assert seen[-1] > seen[0]  # the other task ran while the stream was read

    trio.run(main)


async def _start_polling_loop(nursery, fd, take):
    """Workers whose idle poll has a budget no test run outlasts (the tests bound the poll
    by the requests they let arrive, never by time), started and parked on ``fd``."""
    from nvmeof_fuse.fs.idlepoll import MIN_ALONE, IdlePoll
    from nvmeof_fuse.fs.requestloop import RequestLoop

    loop = RequestLoop(nursery, fd, take)
    loop.idle_poll = IdlePoll(poll_max=3600.0)
    loop.idle_poll.alone = MIN_ALONE  # as after a client that kept one request in flight
    loop.start()
    await trio.testing.wait_all_tasks_blocked()
    return loop


def test_a_task_that_answered_the_last_request_polls_for_the_next():
    """With nothing in flight and nothing else to run, the task that answered the last
    request polls the descriptor before it parks: a request that arrives meanwhile is run
    by it, and the reader parked on the descriptor never wakes; the session's end met while
    polling lets every task exit."""
    from nvmeof_fuse.fs.requestloop import SessionEnded

    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        ran_by: dict[str, object] = {}
        arriving: list[str] = []  # come after a few empty reads: while a task polls
        empty_reads = 0

        async def job(name: str) -> None:
            ran_by[name] = trio.lowlevel.current_task()
            arriving.append({"first": "second", "second": "end"}[name])

        def take():
            nonlocal empty_reads
            if arriving:
                if empty_reads < 3:
                    empty_reads += 1
                    raise BlockingIOError
                empty_reads = 0
                name = arriving.pop()
                if name == "end":
                    raise SessionEnded
                return job, (name,)
            return job, (ours.recv(64).decode(),)  # BlockingIOError when none is queued

        with ours, theirs, trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                loop = await _start_polling_loop(nursery, ours.fileno(), take)
                theirs.send(b"first")
            assert ran_by.keys() == {"first", "second"}
            assert ran_by["second"] is not ran_by["first"]  # not the reader: it stayed parked
            assert loop.closing and not loop.idle

    trio.run(main)


def test_no_poll_while_a_request_is_in_flight():
    """A handler still waiting (on the target) keeps the others from polling: its answer
    must not wait behind a poll on this thread."""
    from nvmeof_fuse.fs.requestloop import SessionEnded

    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        release = trio.Event()
        empty_reads = 0
        done: list[str] = []

        async def job(name: str) -> None:
            if name == "held":
                await release.wait()
            done.append(name)

        def take():
            nonlocal empty_reads
            # After "held": the poll that follows ends the session.  Past 50 empty reads a
            # poll ran while "held" was in flight: end it too, so the assertion below fails
            # instead of the test spinning for the poll's hour.
            if "held" in done or empty_reads > 50:
                raise SessionEnded
            try:
                return job, (ours.recv(64).decode(),)
            except BlockingIOError:
                empty_reads += 1
                raise

        with ours, theirs, trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                loop = await _start_polling_loop(nursery, ours.fileno(), take)
                theirs.send(b"held")
                await trio.testing.wait_all_tasks_blocked()
                # As when "held" has waited long and a serial client's requests went by it:
                # the next idle moment follows a single request, the rule that alone allows
                # a poll, and only "held" in flight forbids it.
                loop.served = 0
                theirs.send(b"quick")
                await trio.testing.wait_all_tasks_blocked()
                assert done == ["quick"] and empty_reads < 10  # read, then parked at once
                release.set()
            assert done == ["quick", "held"]

    trio.run(main)


def test_with_a_limit_no_more_requests_are_taken_than_it_until_one_ends():
    """A connection other processes read too (FUSE workers): holding ``limit`` requests, the
    loop leaves the rest queued (for the others) and reads on as each ends; a callback's
    request (begin/end) counts as one held; closing wakes a reader waiting for room."""
    from nvmeof_fuse.fs.requestloop import RequestLoop, SessionEnded

    async def main():
        release = trio.Event()
        running = []
        most = 0
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)

        async def job(name: str) -> None:
            nonlocal most
            running.append(name)
            most = max(most, len(running))
            await release.wait()
            running.remove(name)

        def take():
            name = ours.recv(64).decode()
            if name == "end":
                raise SessionEnded
            return job, (name,)

        with ours, theirs, trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                loop = RequestLoop(nursery, ours.fileno(), take, limit=4)
                loop.start()
                for i in range(10):
                    theirs.send(f"r{i}".encode())
                await trio.testing.wait_all_tasks_blocked()
                assert len(running) == 4 and loop.full_waits == 1  # 6 left for the others
                assert ours.recv(64) == b"r4"  # (another process takes one)
                release.set()  # the held ones end: the loop takes the rest as room comes
                await trio.testing.wait_all_tasks_blocked()
                assert running == [] and most == 4
                release = trio.Event()
                loop.begin()  # a request a callback will answer ...
                for i in range(5):
                    theirs.send(f"s{i}".encode())
                await trio.testing.wait_all_tasks_blocked()
                assert len(running) == 3  # ... holds a place too
                loop.end()
                await trio.testing.wait_all_tasks_blocked()
                assert len(running) == 4
                loop.close()  # the reader waiting for room stops
                release.set()
            assert loop.closing and not loop.idle

    trio.run(main)


def test_without_a_limit_the_loop_takes_all_that_is_queued():
    from nvmeof_fuse.fs.requestloop import RequestLoop

    async def main():
        release = trio.Event()
        running = []
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)

        async def job(name: str) -> None:
            running.append(name)
            await release.wait()

        with ours, theirs, trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                loop = RequestLoop(nursery, ours.fileno(), lambda: (job, (ours.recv(64),)))
                loop.start()
                for i in range(40):
                    theirs.send(b"r%d" % i)
                await trio.testing.wait_all_tasks_blocked()
                assert len(running) == 40 and loop.full_waits == 0
                release.set()
                loop.close()

    trio.run(main)
