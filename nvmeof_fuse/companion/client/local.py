"""Mounts served by this very process (``nvmeof_fuse.mount``), found by their socket name.

A :class:`~nvmeof_fuse.File` on such a mount calls into it directly
(:class:`~nvmeof_fuse.companion.client.channel.LocalChannel`) instead of over its socket.
The mount publishes itself here; the companion layer never imports the mount.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class LocalMount(Protocol):
    """What the companion layer uses of a mount served in this process."""

    mountpoint: str
    server: Any  # its CompanionServer
    session: Any  # the in-process ClientSession on that server

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T: ...

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T: ...

    def registered(self, addr: int, nbytes: int) -> tuple[int, int] | None: ...


_served: dict[str, LocalMount] = {}
_lock = threading.Lock()


def publish(socket_name: str, mount: LocalMount) -> None:
    with _lock:
        _served[socket_name] = mount


def withdraw(mount: LocalMount) -> None:
    with _lock:
        for name in [n for n, m in _served.items() if m is mount]:
            del _served[name]


def served_here(socket_name: str) -> LocalMount | None:
    """The mount of this process publishing ``socket_name``, if any."""
    with _lock:
        return _served.get(socket_name)
