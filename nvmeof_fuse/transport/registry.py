"""Transports by name, as the kernel's ``nvmf_register_transport``: the host never names one.

Each transport module registers its factory when it is imported; a lookup of a name not
registered yet imports that transport's module first (as the kernel's fabrics core asks
for ``nvme-<name>``), so a transport's dependencies (``ibverbs`` for RDMA) load only when
that transport is used.  A transport may offer ``take_over(queue, timeout)``: a connected
queue handed to callers' threads to drive (:class:`~.base.Transport`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import InvalidArgument

if TYPE_CHECKING:  # (base imports trio: the CLI checks options without it)
    from .base import Transport

MODULES = {"rdma": "rdma.polled", "tcp": "tcp.transport"}
"""The transports this package has, by the names nvme-cli uses (``-t``), and the module of
each that registers it (RDMA's is the one whose queues callers' threads may also drive)."""
NAMES = tuple(MODULES)

Factory = Callable[..., "Transport"]
"""``factory(traddr, trsvcid, host_traddr, *, connect_timeout, hdr_digest, data_digest)``."""

_factories: dict[str, Factory] = {}


def register(name: str, factory: Factory) -> None:
    """Called by a transport module as it is imported."""
    _factories[name] = factory


def create(name: str, traddr: str, trsvcid: int, host_traddr: str | None = None, *,
           connect_timeout: float, hdr_digest: bool = False,
           data_digest: bool = False) -> Transport:
    """A new transport ``name`` to the controller at ``traddr``:``trsvcid``."""
    if name not in NAMES:
        raise InvalidArgument(f"--transport {name!r} is not supported "
                              f"(supported: {', '.join(NAMES)})")
    if name not in _factories:
        importlib.import_module(f"{__package__}.{MODULES[name]}")  # registers itself
    return _factories[name](traddr, trsvcid, host_traddr, connect_timeout=connect_timeout,
                            hdr_digest=hdr_digest, data_digest=data_digest)
