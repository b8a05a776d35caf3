"""Small trio helpers: run jobs concurrently and surface their error as itself, not a group."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator

import trio


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
