"""Fake sysfs trees in a folder, as the kernel lays them out, for ``host/topology``: PCI
functions under their host bridges and bridges (``devices/pci0000:97/...``), the
``bus/pci/devices`` links to them, RDMA devices and netdevs (``class/.../device``) and NUMA
nodes' CPUs.  The testbed uses them too: ``NVMEOF_FUSE_SYSFS`` points a daemon at one."""

from __future__ import annotations

import os
from pathlib import Path

MELLANOX, NVIDIA = "0x15b3", "0x10de"
ETHERNET, GPU_3D, BRIDGE = "0x020000", "0x030200", "0x060400"


class FakeSysfs:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        for folder in ("bus/pci/devices", "class/infiniband", "class/net",
                       "devices/system/node"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)

    def node(self, node: int, cpus: str) -> None:
        where = self.root / "devices" / "system" / "node" / f"node{node}"
        where.mkdir(parents=True, exist_ok=True)
        (where / "cpulist").write_text(cpus + "\n")

    def _function(self, folder: Path, numa_node: int, vendor: str, pci_class: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for name, value in (("numa_node", str(numa_node)), ("vendor", vendor),
                            ("class", pci_class)):
            if not (folder / name).exists():
                (folder / name).write_text(value + "\n")
        link = self.root / "bus" / "pci" / "devices" / folder.name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(folder, link.parent))

    def device(self, host_bridge: str, *chain: str, numa_node: int = -1,
               vendor: str = MELLANOX, pci_class: str = ETHERNET) -> str:
        """A function at the end of ``chain`` (its bridges, then its address) below
        ``host_bridge`` (``pci0000:97``); the bridges on the way are made too."""
        folder = self.root / "devices" / host_bridge
        for bridge in chain[:-1]:
            folder = folder / bridge
            self._function(folder, numa_node, "0x8086", BRIDGE)
        self._function(folder / chain[-1], numa_node, vendor, pci_class)
        return chain[-1]

    def gpu(self, host_bridge: str, *chain: str, numa_node: int = -1) -> str:
        return self.device(host_bridge, *chain, numa_node=numa_node, vendor=NVIDIA,
                           pci_class=GPU_3D)

    def virtual_function(self, physical: str, address: str) -> str:
        """A VF beside its PF (same bridges), with ``physfn`` pointing at it."""
        pf = Path(os.path.realpath(self.root / "bus" / "pci" / "devices" / physical))
        vf = pf.parent / address
        self._function(vf, int((pf / "numa_node").read_text()), MELLANOX, ETHERNET)
        (vf / "physfn").symlink_to(os.path.relpath(pf, vf))
        return address

    def rdma(self, name: str, address: str | None = None, *, netdev: str | None = None) -> None:
        """An RDMA device on PCI function ``address``, or (Soft-RoCE) over ``netdev``."""
        where = self.root / "class" / "infiniband" / name
        where.mkdir(parents=True)
        if address is not None:
            (where / "device").symlink_to(
                os.path.realpath(self.root / "bus" / "pci" / "devices" / address))
        if netdev is not None:
            (where / "parent").write_text(netdev + "\n")

    def net(self, name: str, address: str | None = None) -> None:
        """A netdev, on PCI function ``address`` or virtual."""
        where = self.root / "class" / "net" / name
        where.mkdir(parents=True)
        if address is not None:
            (where / "device").symlink_to(
                os.path.realpath(self.root / "bus" / "pci" / "devices" / address))


HOST_BRIDGES = (("15", 0), ("37", 0), ("97", 1), ("b8", 1))
"""The two-socket server's host bridges (bus, NUMA node): two on each socket."""


def _bdf(bus: int, device: int = 0) -> str:
    return f"0000:{bus:02x}:{device:02x}.0"


def two_socket_server(fs: FakeSysfs) -> dict[str, str]:
    """8 GPUs and 8 NICs (mlx5_0..7) on two sockets: behind each of 4 host bridges a switch
    with two switches below it, each holding one GPU and one NIC (the DGX shape).  Returns
    each GPU's address with the NIC ``nvidia-smi topo -m`` calls PIX to it."""
    fs.node(0, "0-15")
    fs.node(1, "16-31")
    pairs = {}
    for index, (bus, node) in enumerate(HOST_BRIDGES):
        b = int(bus, 16)
        for leaf in range(2):
            # root port, the top switch's ports, the leaf switch's upstream port and the
            # downstream port of its GPU
            below = (_bdf(b, 1), _bdf(b + 1), _bdf(b + 2, leaf), _bdf(b + 3 + 4 * leaf),
                     _bdf(b + 4 + 4 * leaf, 0))
            gpu = fs.gpu(f"pci0000:{bus}", *below, _bdf(b + 5 + 4 * leaf), numa_node=node)
            nic_port = _bdf(b + 4 + 4 * leaf, 1)
            nic = fs.device(f"pci0000:{bus}", *below[:-1], nic_port, _bdf(b + 6 + 4 * leaf),
                            numa_node=node)
            name = f"mlx5_{2 * index + leaf}"
            fs.rdma(name, nic)
            fs.net(f"ibp{b + 6 + 4 * leaf}s0", nic)
            pairs[gpu] = name
    return pairs
