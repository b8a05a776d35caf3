"""The PCIe topology as sysfs shows it, under a root that tests (and the testbed) replace.

``NVMEOF_FUSE_SYSFS`` names the root (default ``/sys``).  What is read: a PCI function's
resolved path (``bus/pci/devices/<bdf>``), its ``numa_node`` (-1: unknown) and ``physfn`` (a
virtual function's physical one), the PCI device behind an RDMA device
(``class/infiniband/<dev>/device``, or for Soft-RoCE the ``parent`` netdev's) and behind a
netdev (``class/net/<if>/device``), GPUs (NVIDIA's display and 3D controllers), and the NUMA
nodes' CPUs.  Nothing here raises: what cannot be read is None, and a machine whose PCI tree
cannot be read at all says why in :attr:`Topology.unavailable`, so that callers choose as
they would without a topology.
"""

from __future__ import annotations

import os

from .pcie import Distance, PciDevice, bus_id, distance, distance_to_node, parse_device_path

ROOT_VARIABLE = "NVMEOF_FUSE_SYSFS"
NVIDIA = "0x10de"
DISPLAY_CLASS = "0x03"  # VGA (0x0300) and 3D (0x0302) controllers


def default_root() -> str:
    return os.environ.get(ROOT_VARIABLE) or "/sys"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def parse_cpulist(text: str) -> set[int]:
    """``0-3,8,10-11`` as a set; what is not a list is empty."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            return set()
        low, high = int(first), int(last or first)
        if high < low or high - low > 65536:
            return set()
        cpus.update(range(low, high + 1))
    return cpus


class Topology:
    """The PCI devices, RDMA devices, netdevs, GPUs and NUMA nodes under ``root``."""

    def __init__(self, root: str | None = None) -> None:
        self.root = root or default_root()
        devices = os.path.join(self.root, "bus", "pci", "devices")
        self.unavailable: str | None = None
        """One line saying why no device can be placed, or None."""
        try:
            self._bus_ids = sorted(os.listdir(devices))
        except OSError as exc:
            self._bus_ids = []
            self.unavailable = (f"no PCIe topology: {devices} cannot be read "
                                f"({exc.strerror or exc}); paths are chosen as without one")
        self._nodes = self._read_nodes()
        self._devices: dict[str, PciDevice | None] = {}

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _read_nodes(self) -> dict[int, set[int]]:
        nodes: dict[int, set[int]] = {}
        where = self._path("devices", "system", "node")
        try:
            entries = os.listdir(where)
        except OSError:
            return nodes
        for entry in entries:
            if entry.startswith("node") and entry[4:].isdigit():
                cpus = _read(os.path.join(where, entry, "cpulist"))
                nodes[int(entry[4:])] = parse_cpulist(cpus) if cpus else set()
        return nodes

    @property
    def single_node(self) -> bool:
        """One NUMA node (or none shown): a node sysfs leaves unknown is that one."""
        return len(self._nodes) <= 1

    def node_of_cpu(self, cpu: int) -> int | None:
        return next((node for node, cpus in self._nodes.items() if cpu in cpus), None)

    def node_of_cpus(self, cpus: set[int]) -> int | None:
        """The NUMA node that holds all of ``cpus``, or None (several, or unknown)."""
        found = {self.node_of_cpu(cpu) for cpu in cpus}
        return found.pop() if len(found) == 1 else None

    def pci_device(self, address: str) -> PciDevice | None:
        """The PCI function at ``address`` (any spelling :func:`bus_id` takes), or None;
        each read once."""
        try:
            address = bus_id(address)
        except ValueError:
            return None
        if address not in self._devices:
            self._devices[address] = self._read_pci_device(address)
        return self._devices[address]

    def _read_pci_device(self, address: str) -> PciDevice | None:
        link = self._path("bus", "pci", "devices", address)
        if not os.path.exists(link):
            return None
        resolved = os.path.realpath(link)
        node = _read(os.path.join(resolved, "numa_node"))
        physfn = os.path.join(resolved, "physfn")
        return parse_device_path(
            os.path.relpath(resolved, self.root),
            numa_node=int(node) if node and node.lstrip("-").isdigit() else None,
            physfn=os.path.basename(os.path.realpath(physfn)) if os.path.exists(physfn)
            else None)

    def _device_behind(self, link: str) -> PciDevice | None:
        if not os.path.exists(link):
            return None
        return self.pci_device(os.path.basename(os.path.realpath(link)))

    def net_device(self, name: str) -> PciDevice | None:
        """The PCI function behind netdev ``name``, or None (virtual, or unknown)."""
        if not name or "/" in name or name in (".", ".."):
            return None
        return self._device_behind(self._path("class", "net", name, "device"))

    def rdma_device(self, name: str) -> PciDevice | None:
        """The PCI function behind RDMA device ``name``: its own, or (Soft-RoCE) its netdev's."""
        if not name or "/" in name or name in (".", ".."):
            return None
        found = self._device_behind(self._path("class", "infiniband", name, "device"))
        if found is None:
            parent = _read(self._path("class", "infiniband", name, "parent"))
            found = self.net_device(parent) if parent else None
        return found

    def rdma_devices(self) -> list[str]:
        try:
            return sorted(os.listdir(self._path("class", "infiniband")))
        except OSError:
            return []

    def gpus(self) -> list[str]:
        """NVIDIA GPUs' PCI addresses, in bus order."""
        found = []
        for address in self._bus_ids:
            where = self._path("bus", "pci", "devices", address)
            if _read(os.path.join(where, "vendor")) == NVIDIA and \
                    (_read(os.path.join(where, "class")) or "").startswith(DISPLAY_CLASS):
                found.append(address)
        return found

    def distance(self, a: PciDevice, b: PciDevice) -> Distance:
        return distance(a, b, single_node=self.single_node)

    def distance_to_node(self, device: PciDevice, node: int | None) -> Distance:
        return distance_to_node(device, node, single_node=self.single_node)
