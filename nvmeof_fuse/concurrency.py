"""Small trio helpers: run jobs concurrently and surface their error as itself, not a group;
run a blocking call in a thread with a bound; count the tasks waiting to run, cheaply."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import trio

T = TypeVar("T")

_RUN_CONTEXT = getattr(getattr(trio._core, "_run", None), "GLOBAL_RUN_CONTEXT", None)
"""trio's per-thread run context: its ``runner.runq`` is the run queue (trio < 0.36 in
pyproject.toml; tests/test_concurrency.py fails loudly when a trio keeps it elsewhere)."""


def first_error(group: BaseExceptionGroup) -> BaseException | None:
    """The first leaf of ``group`` that is not a cancellation, or None."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = first_error(exc)
            if found is not None:
                return found
        elif not isinstance(exc, trio.Cancelled):
            return exc
    return None


@contextlib.contextmanager
def unwrap_groups() -> Iterator[None]:
    """Re-raise a nursery's exception group as its first real error (one-line messages)."""
    try:
        yield
    except BaseExceptionGroup as group:
        first = first_error(group)
        if first is None:
            raise
        raise first from None


async def run_all(jobs: list[Callable[[], Awaitable[object]]]) -> None:
    """Run ``jobs`` concurrently (inline when there is one); the first failure wins."""
    if len(jobs) == 1:
        await jobs[0]()
        return
    with unwrap_groups():
        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(job)


async def run_bounded(items: Iterable[T], job: Callable[[T], Awaitable[object]],
                      limit: int) -> None:
    """``job(item)`` for each of ``items``, in their order, at most ``limit`` at once (so
    that thousands of commands neither wait for each other's round trips nor crowd a
    queue); the first failure wins and cancels the rest."""
    pending = iter(items)

    async def worker() -> None:
        for item in pending:  # shared: each item is taken by one worker
            await job(item)

    with unwrap_groups():
        async with trio.open_nursery() as nursery:
            for _ in range(max(1, limit)):
                nursery.start_soon(worker)


async def in_thread(fn: Callable[..., T], *args: Any, timeout: float,
                    too_slow: BaseException) -> T:
    """``fn(*args)`` in a worker thread, abandoned after ``timeout`` s; then raise ``too_slow``.

    For blocking calls that may hang for good (a stat() on a hung FUSE mount).
    """
    with trio.move_on_after(timeout):
        return await trio.to_thread.run_sync(functools.partial(fn, *args),
                                             abandon_on_cancel=True)
    raise too_slow


def tasks_runnable() -> int:
    """How many tasks wait to run on this thread's trio loop.

    ``trio.lowlevel.current_statistics().tasks_runnable``, without the rest of those
    statistics: they cost several times more (the I/O backend counts its waiters, two
    objects are built), and a caller that polls for its command asks once per I/O.  Read,
    never written, from trio's run queue; where a trio keeps no such queue, the public call.
    """
    try:
        return len(_RUN_CONTEXT.runner.runq)  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        return trio.lowlevel.current_statistics().tasks_runnable
