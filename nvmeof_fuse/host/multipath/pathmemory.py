"""Memory a multipath head registers with every path's transport, and the head seen as one
transport (by those who register memory or lease queues) and as one bounce pool (by each
path's controller)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import TransportError
from ..memory import BouncePool, Registration


class PathsRegistration:
    """Memory registered with every path's transport; ``keys(domain)`` gives the keys of
    whichever path's queue asks.  With one path it is that path's own ``keys``."""

    def __init__(self, addr: int, length: int, owner: object,
                 transports: list[Any]) -> None:
        self.addr = addr
        self.length = length
        self.owner = owner
        self._subs: dict[Any, Registration] = {}
        self._by_domain: dict[object, Registration] = {}
        try:
            for transport in transports:
                self.add(transport)
        except BaseException:
            self.close()
            raise

    def add(self, transport: Any) -> None:
        """Register the memory with ``transport`` (a path joins, or comes back) too."""
        if transport not in self._subs:
            self._subs[transport] = transport.register(self.addr, self.length, self.owner)
            self._bind()

    def drop(self, transport: Any) -> None:
        """Deregister from ``transport`` (its path leaves; no command of it is in flight)."""
        sub = self._subs.pop(transport, None)
        if sub is not None:
            sub.close()
            self._by_domain = {d: r for d, r in self._by_domain.items() if r is not sub}
            self._bind()

    def _bind(self) -> None:
        only = next(iter(self._subs.values())) if len(self._subs) == 1 else None
        if only is not None and hasattr(only, "keys"):
            self.keys = only.keys  # type: ignore[method-assign]
        else:
            self.keys = self._keys_of_any  # type: ignore[method-assign]

    def keys(self, domain: object) -> Any:  # replaced per instance by _bind
        return self._keys_of_any(domain)

    def _keys_of_any(self, domain: object) -> Any:
        sub = self._by_domain.get(domain)
        if sub is not None:
            return sub.keys(domain)
        for sub in self._subs.values():
            try:
                keys = sub.keys(domain)
            except (KeyError, AttributeError):
                continue
            if len(self._by_domain) > 256:  # queues of reconnects past: forget them
                self._by_domain.clear()
            self._by_domain[domain] = sub
            return keys
        raise KeyError(domain)

    def close(self) -> None:
        for sub in self._subs.values():
            sub.close()
        self._subs.clear()
        self._by_domain.clear()
        self.owner = None


class HeadPool:
    """What a path's controller sees as its bounce pool: the head's, so that a teardown of
    the path gives back the head's buffers held for its lost commands."""

    def __init__(self, pool: Callable[[], BouncePool | None]) -> None:
        self._pool = pool

    def reclaim(self) -> None:
        if (pool := self._pool()) is not None:
            pool.reclaim()

    def counts(self) -> dict[str, int]:
        return pool.counts() if (pool := self._pool()) is not None else {}

    def close(self) -> None:
        pass  # the head closes its own


class PathsTransport:
    """The head as a transport to those who register memory or lease queues: memory goes
    to every path's transport."""

    def __init__(self, transports: Callable[[], list[Any]],
                 register: Callable[[int, int, object], PathsRegistration]) -> None:
        self._transports = transports
        self._register = register

    @property
    def name(self) -> str:
        return "+".join(dict.fromkeys(t.name for t in self._transports())) or "none"

    @property
    def address(self) -> str:
        return ", ".join(t.address for t in self._transports())

    @property
    def places_in_other_processes(self) -> bool:
        return any(getattr(t, "places_in_other_processes", False) for t in self._transports())

    @property
    def dmabuf_refusal(self) -> str:
        """Why dma-bufs (GPU memory) are not registered here: they are with one path only."""
        transports = self._transports()
        if len(transports) > 1:
            return (f"this mount has {len(transports)} paths, and a dma-buf is registered "
                    "with one transport only")
        return next((why for t in transports if (why := getattr(t, "dmabuf_refusal", ""))),
                    "")

    def register(self, addr: int, length: int, owner: object) -> PathsRegistration:
        return self._register(addr, length, owner)

    def register_dmabuf(self, fd: int, offset: int, length: int, iova: int) -> Registration:
        transports = self._transports()
        if len(transports) != 1:
            raise TransportError("a dma-buf is registered on one path only; this mount has "
                                 f"{len(transports)} (the caller stages instead)")
        return transports[0].register_dmabuf(fd, offset, length, iova)
