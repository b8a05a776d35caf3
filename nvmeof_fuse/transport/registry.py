"""Transports by name, as the kernel's ``nvmf_register_transport``: the host never names one.

Each transport module registers its factory when it is imported; a lookup of a name not
registered yet imports that transport's module first (as the kernel's fabrics core asks
for ``nvme-<name>``), so a transport's dependencies (``ibverbs`` for RDMA) load only when
that transport is used.  A transport may offer ``take_over(queue, timeout)``: a connected
queue handed to callers' threads to drive (:class:`~.base.Transport`).

What each transport can do is declared here, before any is made (:class:`Capabilities`, as
the kernel's ``nvmf_transport_ops.allowed_opts``): the options it takes, its default ports,
what memory it places data in itself.  Everything above ``transport/`` asks these instead
of comparing transport names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidArgument

if TYPE_CHECKING:  # (base imports trio: the CLI checks options without it)
    from .base import Transport

IO_PORT = 4420
"""The IANA port of NVMe over Fabrics, where I/O controllers listen on every transport."""


@dataclass(frozen=True)
class Capabilities:
    """What one transport can do (see the module)."""

    title: str
    """How messages name it (``NVMe/TCP``)."""
    module: str
    """Its module (under ``transport/``) that registers it when imported."""
    places_directly: bool
    """Whether the fabric places data in registered memory itself (RDMA); else this
    process receives and sends every byte (a socket)."""
    digests: bool = False
    """Whether it takes header and data digests (``--hdr-digest``, ``--data-digest``)."""
    discovery_port: int = IO_PORT
    """Where its discovery controllers listen unless told (NVMe/TCP: 8009)."""
    port: int = IO_PORT
    """Where its I/O controllers listen unless told."""
    tls: bool = False
    """Whether it takes TLS 1.3 with a PSK (``--tls``, ``--tls-key``)."""


TRANSPORTS = {
    "rdma": Capabilities("NVMe/RDMA", "rdma.polled", places_directly=True),
    "tcp": Capabilities("NVMe/TCP", "tcp.transport", places_directly=False, digests=True,
                        discovery_port=8009, tls=True),
}
"""The transports this package has, by the names nvme-cli uses (``-t``).  RDMA's module is
the one whose queues callers' threads may also drive."""
NAMES = tuple(TRANSPORTS)
DEFAULT = "rdma"
"""The transport of a mount or a discovery that names none (as nvme-cli's ``-t``)."""


def capabilities(name: str) -> Capabilities:
    """What transport ``name`` can do; InvalidArgument, in one line, for one we lack."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise InvalidArgument(f"--transport {name!r} is not supported "
                              f"(supported: {', '.join(NAMES)})") from None


def with_tls() -> str:
    """The ``-t`` options of the transports that take TLS, for messages."""
    return " or ".join(f"-t {name}" for name, caps in TRANSPORTS.items() if caps.tls)


def with_digests() -> str:
    """The ``-t`` options of the transports that take digests, for messages."""
    return " or ".join(f"-t {name}" for name, caps in TRANSPORTS.items() if caps.digests)

Factory = Callable[..., "Transport"]
"""``factory(traddr, trsvcid, host_traddr, *, connect_timeout, hdr_digest, data_digest,
host_iface)``, and ``tls`` (a :class:`~nvmeof_fuse.nvme.tls_psk.TlsPsk`) for a transport that
takes TLS."""

_factories: dict[str, Factory] = {}


def register(name: str, factory: Factory) -> None:
    """Called by a transport module as it is imported."""
    _factories[name] = factory


def create(name: str, traddr: str, trsvcid: int, host_traddr: str | None = None, *,
           connect_timeout: float, hdr_digest: bool = False,
           data_digest: bool = False, host_iface: str | None = None,
           tls: object | None = None) -> Transport:
    """A new transport ``name`` to the controller at ``traddr``:``trsvcid`` (``tls``: the
    PSK identity and key each connection's TLS handshake offers, or a callable giving them
    anew for each connection)."""
    caps = capabilities(name)
    if name not in _factories:
        importlib.import_module(f"{__package__}.{caps.module}")  # registers itself
    extra = {}
    if tls is not None:
        if not caps.tls:
            raise InvalidArgument(f"--tls applies only to {with_tls()}")
        extra["tls"] = tls
    return _factories[name](traddr, trsvcid, host_traddr, connect_timeout=connect_timeout,
                            hdr_digest=hdr_digest, data_digest=data_digest,
                            host_iface=host_iface, **extra)
