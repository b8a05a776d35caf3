"""One path of a multipath mount: its options, its controller while connected, its ANA
state and its counters; and the options of a further path from its URI."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import trio

from ...errors import InvalidArgument
from ...nvme import NamespaceIdentity
from ...nvme.ana import AnaState
from ...nvme.uri import DEFAULT_PORT, NVMeURI, parse_uri, split_path_keys
from ...transport import registry
from ...transport.base import LocalDevice
from ..connect_options import ConnectOptions
from ..topology.pcie import PciDevice
from .ana import PathAna

if TYPE_CHECKING:  # only named: the daemon's tests stand a fake controller module in
    from ..controller import Controller
    from ..topology.sysfs import Topology


class PathRefused(InvalidArgument):
    """A path that cannot join the mount: another subsystem, different namespaces."""


def path_uri(options: ConnectOptions) -> str:
    """The ``nvme+<transport>://`` URI of a path's options."""
    return str(NVMeURI(options.transport, options.traddr, options.trsvcid, options.nqn))


def path_options(base: ConnectOptions, uri: str) -> ConnectOptions:
    """The options of a further path ``uri``: the first path's (host identity, timeouts,
    secrets, queues, local address), with the URI's transport, address, port and subsystem,
    and what its keys say of its local side (``?host_iface=mlx5_1``: a device is one
    rail's, so the first path's ``host_iface`` is not taken over)."""
    uri, keys = split_path_keys(uri)
    where = parse_uri(uri)
    if where.nsid is not None:
        raise InvalidArgument(f"path {uri}: a path names no namespace (drop /{where.nsid})")
    digests = registry.capabilities(where.transport).digests
    return dataclasses.replace(
        base, transport=where.transport, traddr=where.traddr,
        trsvcid=where.trsvcid if where.trsvcid is not None else DEFAULT_PORT,
        nqn=where.subnqn, hdr_digest=base.hdr_digest and digests,
        data_digest=base.data_digest and digests, host_iface=keys.get("host_iface"),
        host_traddr=keys.get("host_traddr", base.host_traddr))


class Path:
    """One path: its options, its controller while connected, its ANA state and counters."""

    def __init__(self, index: int, options: ConnectOptions) -> None:
        self.index = index
        self.options = options
        self.uri = path_uri(options)
        self.ctrl: Controller | None = None
        self.ana = PathAna(reporting=False, anatt=0)
        self.ana_log_bytes = 0  # the whole ANA log's size (Identify), once admitted
        self.ids: dict[int, NamespaceIdentity] = {}
        """The identity of each namespace as this path's controller shows it."""
        self.stale: set[int] = set()
        """NSIDs behind which this path shows another namespace than the mount serves: it
        serves those no more (:meth:`usable_state`)."""
        self.outstanding = 0
        self.ios = 0
        self.bytes = 0
        self.failovers = 0
        """Commands that failed here and ran again on another path."""
        self.revivals = 0
        """Controllers connected anew after the one before gave up (--ctrl-loss-tmo)."""
        self._past = (0, 0)  # losses and reconnects of the controllers before this one
        self.connected_once = False
        self._device: LocalDevice | None = None
        self.removed = trio.Event()
        self._kick = trio.Event()

    @property
    def losses(self) -> int:
        """Connections lost on this path, by all its controllers."""
        return self._past[0] + (self.ctrl.losses if self.ctrl is not None else 0)

    @property
    def reconnects(self) -> int:
        """Of them, regained: by its controller's reconnects or a controller anew."""
        return (self._past[1] + self.revivals
                + (self.ctrl.reconnects if self.ctrl is not None else 0))

    @property
    def local_device(self) -> LocalDevice | None:
        """The local device this path's queues went through (RDMA-CM's binding, the
        socket's netdev), once its controller connected; kept after a loss."""
        ctrl = self.ctrl
        device = getattr(ctrl.transport, "local_device", None) if ctrl is not None else None
        if device is not None:
            self._device = device
        return self._device

    def pci_device(self, topology: Topology) -> PciDevice | None:
        """Where :attr:`local_device` sits on the PCIe tree, if sysfs shows it."""
        device = self.local_device
        if device is None:
            return None
        if device.sysfs_class == "infiniband":
            return topology.rdma_device(device.name)
        return topology.net_device(device.name)

    def device_snapshot(self, topology: Topology) -> dict[str, str | int | None]:
        """``paths.json``'s keys of the local device: its name, PCI address, NUMA node."""
        device, pci = self.local_device, self.pci_device(topology)
        return {"device": device.name if device is not None else None,
                "device_pci": pci.bus_id if pci is not None else None,
                "device_numa_node": pci.numa_node if pci is not None else None,
                "host_iface": self.options.host_iface}

    def retire(self, ctrl: Controller) -> None:
        """``ctrl`` leaves this path: keep its counts."""
        self._past = (self._past[0] + ctrl.losses, self._past[1] + ctrl.reconnects)

    @property
    def address(self) -> str:
        return f"{self.options.transport} {self.options.traddr}:{self.options.trsvcid}"

    @property
    def name(self) -> str:
        return f"path {self.index} ({self.address})"

    def usable_state(self, nsid: int) -> AnaState | None:
        """The ANA state if I/O for ``nsid`` may go here now, else None."""
        ctrl = self.ctrl
        if ctrl is None or not ctrl.live or nsid in self.stale:
            return None
        return self.ana.usable_state(nsid)

    def kick(self) -> None:
        """Have the ANA log read again now (a notice came, an ANA status, a reconnect)."""
        self._kick.set()

    async def kicked(self) -> None:
        await self._kick.wait()
        self._kick = trio.Event()

    @property
    def state(self) -> str:
        return str(self.ctrl.state) if self.ctrl is not None else "connecting"

    def ana_summary(self, nsid: int | None) -> tuple[int | None, str | None]:
        """(ANA group, state label) of ``nsid`` here (the mount's first namespace)."""
        if nsid is None or not self.ana.reporting:
            return None, (AnaState.OPTIMIZED.label if self.ctrl is not None else None)
        state = self.ana.state(nsid)
        return self.ana.group(nsid), state.label if state is not None else None

