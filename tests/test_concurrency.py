"""nvmeof_fuse.concurrency: the run-queue count that the polls ask once per I/O."""

from __future__ import annotations

import pytest
import trio

from nvmeof_fuse import concurrency
from nvmeof_fuse.concurrency import tasks_runnable


async def _runnable_now(n: int) -> tuple[int, int]:
    """(ours, trio's public figure) while ``n`` freshly started tasks wait to run."""
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(trio.sleep, 0)
        return tasks_runnable(), trio.lowlevel.current_statistics().tasks_runnable


def test_it_counts_what_trio_calls_tasks_runnable():
    assert trio.run(_runnable_now, 0) == (0, 0)
    assert trio.run(_runnable_now, 5) == (5, 5)


def test_trio_still_keeps_its_run_queue_where_we_read_it():
    """Fails when a trio release moves its run queue: tasks_runnable() then falls back to
    the public statistics (3 us a call, per polled I/O); update it and pyproject's pin."""

    async def main():
        runner = getattr(concurrency._RUN_CONTEXT, "runner", None)
        assert runner is not None and hasattr(runner, "runq"), (
            f"trio {trio.__version__} keeps no run queue at "
            "trio._core._run.GLOBAL_RUN_CONTEXT.runner.runq")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep, 0)
            assert len(runner.runq) == trio.lowlevel.current_statistics().tasks_runnable == 1

    trio.run(main)


def test_without_that_queue_it_asks_the_public_statistics(monkeypatch):
    monkeypatch.setattr(concurrency, "_RUN_CONTEXT", object())
    assert trio.run(_runnable_now, 3) == (3, 3)


def test_outside_trio_it_fails_as_the_public_call_does():
    with pytest.raises(RuntimeError):
        tasks_runnable()


def test_run_bounded_runs_each_item_once_in_order_never_more_than_its_limit_at_once():
    started: list[int] = []
    in_flight = most = 0

    async def job(item: int) -> None:
        nonlocal in_flight, most
        started.append(item)
        in_flight += 1
        most = max(most, in_flight)
        await trio.sleep(0.001 * (item % 3))
        in_flight -= 1

    trio.run(concurrency.run_bounded, range(100), job, 7)
    assert started == list(range(100)) and most == 7


def test_run_bounded_raises_the_first_failure_itself_and_stops_the_rest():
    done: list[int] = []

    async def job(item: int) -> None:
        if item == 3:
            raise ValueError("item 3 is bad")
        await trio.sleep(1)
        done.append(item)

    with pytest.raises(ValueError, match="item 3 is bad"):
        trio.run(concurrency.run_bounded, range(100), job, 4)
    assert done == []
