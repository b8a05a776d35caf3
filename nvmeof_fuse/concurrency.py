"""Small trio helpers: run jobs concurrently and surface their error as itself, not a group;
run a blocking call in a thread with a bound."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import trio

T = TypeVar("T")


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


async def in_thread(fn: Callable[..., T], *args: Any, timeout: float,
                    too_slow: BaseException) -> T:
    """``fn(*args)`` in a worker thread, abandoned after ``timeout`` s; then raise ``too_slow``.

    For blocking calls that may hang for good (a stat() on a hung FUSE mount).
    """
    with trio.move_on_after(timeout):
        return await trio.to_thread.run_sync(functools.partial(fn, *args),
                                             abandon_on_cancel=True)
    raise too_slow
