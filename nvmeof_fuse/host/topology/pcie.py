"""PCIe distances in the words of ``nvidia-smi topo -m`` and NCCL, from sysfs paths: pure, no I/O.

A device's resolved sysfs path (``/sys/devices/pci0000:97/0000:97:01.0/0000:98:00.0/
0000:99:01.0/0000:9a:00.0``) names its host bridge (``pci0000:97``), the bridges down to it
and the device.  NCCL (``src/graph/xml.cc``) climbs two levels at a time, so that a PCIe
switch (its upstream port and one downstream port) counts as one node, and stops at the host
bridge; we do the same.  Between two devices:

- PIX: they meet in one switch (at most one bridge node on the way);
- PXB: several switches, without the host bridge;
- PHB: through the host bridge they share (one root complex);
- NODE: across host bridges of one NUMA node;
- SYS: across NUMA nodes (the sockets' interconnect), or where the node is unknown.

Memory in a NUMA node is NODE from a device of that node, SYS from any other.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

_BDF = re.compile(r"^([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")


class Distance(enum.IntEnum):
    """Nearest first; the names are NCCL's and ``nvidia-smi topo -m``'s."""

    PIX = 1
    PXB = 2
    PHB = 3
    NODE = 4
    SYS = 5


def bus_id(text: str) -> str:
    """A PCI address as sysfs spells it (``0000:9a:00.0``), from CUDA's or nvidia-smi's
    (``00000000:9A:00.0``).  ValueError names what is not one."""
    found = _BDF.match(text.strip().lower())
    if found is None:
        raise ValueError(f"{text!r} is not a PCI address (DOMAIN:BUS:DEVICE.FUNCTION, "
                         "as 0000:9a:00.0)")
    domain, bus, device, function = found.groups()
    return f"{int(domain, 16):04x}:{bus}:{device}.{function}"


@dataclass(frozen=True)
class PciDevice:
    """One PCI function where sysfs puts it."""

    bus_id: str
    host_bridge: str
    """Everything of the resolved path up to the host bridge (``.../pci0000:97``): two
    devices with the same one share a root complex."""
    bridges: tuple[str, ...]
    """The bridges from the root port down to the device's parent."""
    numa_node: int | None = None
    """None where sysfs says -1 (unknown) or nothing."""
    physfn: str | None = None
    """The physical function's address, for a virtual function."""

    def switches(self) -> tuple[str, ...]:
        """NCCL's PCI nodes above the device, top first: every second bridge upwards from its
        grandparent (a switch's upstream port stands for the switch), the root port below
        its host bridge only when the count falls on it."""
        return tuple(self.bridges[i] for i in range(len(self.bridges) - 2, -1, -2))[::-1]


def parse_device_path(resolved: str, *, numa_node: int | None = None,
                      physfn: str | None = None) -> PciDevice | None:
    """The device at a resolved sysfs path, or None where the path is not a PCI device's
    below a host bridge (a virtual device, a platform device)."""
    parts = [p for p in resolved.split("/") if p]
    bridge_at = next((i for i, p in enumerate(parts) if _HOST_BRIDGE.match(p)), None)
    if bridge_at is None or bridge_at == len(parts) - 1:
        return None
    chain = parts[bridge_at + 1:]
    if not all(_BDF.match(p) for p in chain):
        return None
    return PciDevice(bus_id=chain[-1], host_bridge="/" + "/".join(parts[:bridge_at + 1]),
                     bridges=tuple(chain[:-1]),
                     numa_node=numa_node if numa_node is not None and numa_node >= 0 else None,
                     physfn=physfn)


def _same_node(a: int | None, b: int | None, single_node: bool) -> bool:
    if a is None or b is None:
        return single_node
    return a == b


def distance(a: PciDevice, b: PciDevice, *, single_node: bool = False) -> Distance:
    """How far apart two devices are.  ``single_node``: the machine has one NUMA node, so a
    node sysfs leaves unknown is that one."""
    if a.host_bridge != b.host_bridge:
        return Distance.NODE if _same_node(a.numa_node, b.numa_node, single_node) \
            else Distance.SYS
    above_a, above_b = a.switches(), b.switches()
    shared = 0
    while shared < min(len(above_a), len(above_b)) and above_a[shared] == above_b[shared]:
        shared += 1
    if a.bus_id == b.bus_id or (a.bridges and a.bridges == b.bridges):  # one parent bridge
        return Distance.PIX
    if not shared:
        return Distance.PHB
    on_the_way = (len(above_a) - shared) + (len(above_b) - shared) + 1
    return Distance.PIX if on_the_way == 1 else Distance.PXB


def distance_to_node(device: PciDevice, node: int | None, *,
                     single_node: bool = False) -> Distance:
    """How far memory in NUMA node ``node`` is from ``device``."""
    return Distance.NODE if _same_node(device.numa_node, node, single_node) else Distance.SYS


def nearest(distances: dict[str, Distance]) -> list[str]:
    """The names at the least distance, in their order: ties share the load."""
    if not distances:
        return []
    least = min(distances.values())
    return [name for name, d in distances.items() if d == least]
