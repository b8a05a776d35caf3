"""The future a companion transfer returns: ``get()`` gives the bytes moved."""

from __future__ import annotations

import concurrent.futures
import errno
from typing import Any

from ..protocol import CompanionError


class IOFuture:
    """The result of :meth:`File.pread` / :meth:`File.pwrite`: ``get()`` gives the bytes moved.

    ``finish`` runs once in the thread that gets the result (GPU ordering wants the
    caller's thread); ``limit`` bounds a ``get()`` given no timeout.
    """

    __slots__ = ("_future", "_finish", "_limit")

    def __init__(self, future: concurrent.futures.Future | None, finish: Any = None,
                 limit: float | None = None) -> None:
        self._future = future
        self._finish = finish
        self._limit = limit

    @classmethod
    def finished(cls, result: int) -> IOFuture:
        """A future already done: ``get()`` gives ``result`` (nothing to move, or moved
        before it was asked for)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(result)
        return cls(future)

    def get(self, timeout: float | None = None) -> int:
        timeout = self._limit if timeout is None else timeout
        try:
            result = self.result(timeout)
        except concurrent.futures.TimeoutError:
            raise CompanionError(f"the transfer did not finish within {timeout:g} s",
                                 errno.ETIMEDOUT) from None
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        return result

    def result(self, timeout: float | None = None) -> int:
        """Bytes moved; ``concurrent.futures.TimeoutError`` after ``timeout`` s."""
        assert self._future is not None
        return self._future.result(timeout)

    def done(self) -> bool:
        assert self._future is not None
        return self._future.done()
