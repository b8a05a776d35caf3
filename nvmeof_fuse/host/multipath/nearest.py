"""Which path is nearest a client's memory: its GPU's PCI address or its NUMA node, against
each path's local device on the PCIe tree (:mod:`..topology`).  No I/O here but the
topology's sysfs reads.

Nearest first by NCCL's words (PIX, PXB, PHB, NODE, SYS); a path whose device or distance
cannot be told ranks after every known one, so that a machine with no topology chooses as
before; ties share the load (the path with the fewest leases).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ...errors import InvalidArgument
from ..topology.pcie import Distance, PciDevice, bus_id
from ..topology.sysfs import Topology

MAX_NUMA_NODE = 4095  # Linux's NODES_SHIFT is at most 10


@dataclass(frozen=True)
class MemoryPlace:
    """Where a client's memory is: a GPU (its PCI address) or a NUMA node."""

    gpu: str | None = None
    numa_node: int | None = None

    @classmethod
    def from_field(cls, field: Any) -> MemoryPlace | None:
        """From a lease request's ``memory`` (``{"gpu": "0000:9a:00.0"}`` or
        ``{"numa_node": 1}``); InvalidArgument, in one line, for anything else."""
        if field is None:
            return None
        if not isinstance(field, dict) or set(field) - {"gpu", "numa_node"} or not field:
            raise InvalidArgument(f"memory {_shown(field)} is not {{'gpu': PCI address}} or "
                                  "{'numa_node': N}")
        gpu, node = field.get("gpu"), field.get("numa_node")
        if gpu is not None:
            try:
                gpu = bus_id(gpu) if isinstance(gpu, str) and len(gpu) <= 32 else None
            except ValueError:
                gpu = None
            if gpu is None:
                raise InvalidArgument(f"memory's gpu {_shown(field['gpu'])} is not a PCI address")
        if node is not None and (type(node) is not int or not 0 <= node <= MAX_NUMA_NODE):
            raise InvalidArgument(f"memory's numa_node {_shown(node)} is not "
                                  f"0-{MAX_NUMA_NODE}")
        return cls(gpu, node)

    def to_field(self) -> dict[str, Any]:
        return {"gpu": self.gpu} if self.gpu is not None else {"numa_node": self.numa_node}

    def __str__(self) -> str:
        return f"GPU {self.gpu}" if self.gpu is not None else f"NUMA node {self.numa_node}"


def distance(memory: MemoryPlace, device: PciDevice | None,
             topology: Topology) -> Distance | None:
    """How far ``memory`` is from a path's ``device``; None where it cannot be told."""
    if device is None:
        return None
    if memory.gpu is not None:
        gpu = topology.pci_device(memory.gpu)
        return topology.distance(gpu, device) if gpu is not None else None
    if memory.numa_node is None:
        return None
    return topology.distance_to_node(device, memory.numa_node)


P = TypeVar("P")


def nearest(paths: Sequence[P], distance_of: Callable[[P], Distance | None],
            load: Callable[[P], Any]) -> P:
    """The nearest of ``paths``, the least ``load`` among equals (anything comparable),
    the first among those; those whose distance is unknown after, in their order (as
    without a topology)."""
    def rank(indexed: tuple[int, P]) -> tuple[int, Any, int]:
        at, path = indexed
        known = distance_of(path)
        if known is None:  # as without a topology: the first
            return (Distance.SYS + 1, (), at)
        return (known, load(path), at)

    return min(enumerate(paths), key=rank)[1]


def lease_wish(header: dict[str, Any]) -> dict[str, Any]:
    """What a lease request asks of its path: ``path`` (an index: that path while it is
    live), ``memory`` (``{"gpu": PCI address}`` or ``{"numa_node": N}``: the nearest path
    to it, which the reply's ``path`` names with its device and distance), as keyword
    arguments of the lease, only those given; InvalidArgument, in one line, for a bad one."""
    path = header.get("path")
    if path is not None and (type(path) is not int or not 0 <= path < 2**31):
        raise InvalidArgument(f"lease's path {_shown(path)} is not a path index")
    wish = {"near": MemoryPlace.from_field(header.get("memory")), "path": path}
    return {key: value for key, value in wish.items() if value is not None}


def _shown(value: Any) -> str:
    """A client's value in a one-line error, short whatever it sent."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
