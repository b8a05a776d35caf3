"""The topology in words, as ``scripts/gpu-check`` prints it: the GPUs and RDMA devices sysfs
shows, and for each GPU the device a lease near it would take, with the distance in NCCL's
words (what ``nvidia-smi topo -m`` calls it).  So that on a machine with GPUs one sees what
the leases would do before a mount has several paths, and on one without an RDMA NIC why
they would go as without a topology.
"""

from __future__ import annotations

from .pcie import Distance, bus_id, nearest
from .sysfs import Topology


def _where(topology: Topology, address: str) -> str:
    device = topology.pci_device(address)
    if device is None:
        return f"{address}, not in sysfs"
    node = device.numa_node if device.numa_node is not None else "unknown"
    return f"{device.bus_id}, NUMA {node}"


def report(topology: Topology, gpus: list[str] | None = None) -> list[str]:
    """Lines that say what ``topology`` holds: its GPUs (``gpus``: the CUDA driver's PCI
    addresses, else those sysfs shows), its RDMA devices, and each GPU's nearest."""
    if topology.unavailable:
        return [topology.unavailable]
    addresses = []
    for address in gpus if gpus is not None else topology.gpus():
        try:
            addresses.append(bus_id(address))
        except ValueError:
            addresses.append(address)
    nics = {name: topology.rdma_device(name) for name in topology.rdma_devices()}
    lines = [f"PCIe topology from {topology.root}: {len(addresses)} GPU(s), "
             f"{len(nics)} RDMA device(s)"]
    lines += [f"  GPU {address} ({_where(topology, address)})" for address in addresses]
    lines += [f"  RDMA {name} ({_where(topology, nic.bus_id) if nic else 'no PCI function'})"
              for name, nic in nics.items()]
    if not nics:
        lines.append("  no RDMA device: a lease goes to the first usable path, as without a "
                     "topology")
        return lines
    for address in addresses:
        gpu = topology.pci_device(address)
        distances: dict[str, Distance] = {
            name: topology.distance(gpu, nic)
            for name, nic in nics.items() if gpu is not None and nic is not None}
        best = nearest(distances)
        if not best:
            lines.append(f"  GPU {address}: distance unknown to every RDMA device: leases go "
                         "as without a topology")
            continue
        words = distances[best[0]].name
        advice = " (across the sockets: reads lose up to 70%)" \
            if distances[best[0]] == Distance.SYS else ""
        lines.append(f"  GPU {address}: nearest {', '.join(best)}, {words}{advice}")
    return lines
