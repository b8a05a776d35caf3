"""Paths to one subsystem for multipath tests: one tests/fabric_fakes.py target per port (they
share the disk), each with its ANA state, and real Controllers connected to them (``Port.connect``
stands for ``host.controller.connect``)."""

from __future__ import annotations

import contextlib
import os
import struct

import trio
from fabric_fakes import FakeTarget, FakeTransport

from nvmeof_fuse.concurrency import unwrap_groups
from nvmeof_fuse.errors import ConnectError
from nvmeof_fuse.host.controller import ConnectOptions, Controller
from nvmeof_fuse.host.memory import host_buffer
from nvmeof_fuse.host.state import CONNECTING, LIVE
from nvmeof_fuse.nvme import IdentifyController, IdentifyNamespace

NQN = "nqn.2014-08.org.example:mp"
LBA = 512
NLB = 4096
CHUNK = 16384


def controller_page(subnqn: str, cntlid: int, serial: str = "fake-serial") -> bytes:
    b = bytearray(4096)
    b[4:4 + len(serial)] = serial.encode()
    b[76] = 0x0B  # CMIC: multiple ports, multiple controllers, ANA reporting
    struct.pack_into("<H", b, 78, cntlid)
    struct.pack_into("<I", b, 92, 1 << 11 | 1 << 8)  # OAES: ANA change, namespace attribute
    b[342] = 2  # ANATT
    struct.pack_into("<II", b, 344, 4, 4)  # ANAGRPMAX, NANAGRPID
    struct.pack_into("<I", b, 516, 16)  # NN
    struct.pack_into("<I", b, 540, 16)  # MNAN
    b[768:768 + len(subnqn)] = subnqn.encode()
    return bytes(b)


def identify_namespace(nlb: int = NLB) -> IdentifyNamespace:
    b = bytearray(4096)
    struct.pack_into("<QQ", b, 0, nlb, nlb)
    struct.pack_into("<I", b, 92, 1)  # ANAGRPID
    b[128 + 2] = 9  # LBA format 0: 512-byte blocks
    return IdentifyNamespace.from_bytes(bytes(b))


class Port:
    """The targets by address, and the controllers connected to them (a fake ``connect``)."""

    def __init__(self, count: int = 2) -> None:
        first = FakeTarget(LBA, NLB)
        first.disk[:] = os.urandom(len(first.disk))
        self.targets = {f"192.0.2.{i + 1}": FakeTarget(LBA, NLB) for i in range(count)}
        for target in self.targets.values():
            target.disk = first.disk  # one namespace behind every port
        self.subnqn: dict[str, str] = {}
        self.serial: dict[str, str] = {}  # the serial number each port's controller reports
        self.controllers: list[Controller] = []
        self.on_connect = None  # called with each new controller, if set
        self.devices: dict = {}  # the LocalDevice each port's transport goes through
        self._cntlid = 0

    def __getitem__(self, i: int) -> FakeTarget:
        return list(self.targets.values())[i]

    @contextlib.asynccontextmanager
    async def connect(self, options: ConnectOptions):
        target = self.targets[options.traddr]
        if not target.up:
            raise ConnectError(f"connect to {options.traddr} refused")
        self._cntlid += 1
        with unwrap_groups():
            async with trio.open_nursery() as nursery:
                transport = FakeTransport(target)
                transport.local_device = self.devices.get(options.traddr)
                ctrl = Controller(options, transport, nursery)

                async def connect_admin() -> None:
                    ctrl.admin = await transport.connect_queue(nursery, 0, 32)

                async def connect_io_queues() -> None:
                    ctrl.io_queues = [await transport.connect_queue(nursery, q, 32)
                                      for q in (1, 2)]

                ctrl._connect_admin, ctrl._connect_io_queues = connect_admin, connect_io_queues
                ctrl._scratch = host_buffer(transport.register, 8192)
                await connect_admin()
                await connect_io_queues()
                ctrl.cntlid = self._cntlid
                target.controller_page = controller_page(
                    self.subnqn.get(options.traddr, NQN), self._cntlid,
                    self.serial.get(options.traddr, "fake-serial"))
                ctrl.identify = IdentifyController.from_bytes(target.controller_page)
                ctrl.max_transfer = CHUNK
                ctrl.bounce = ctrl.new_bounce_pool(CHUNK, 4)
                ctrl.namespaces[1] = ctrl.new_namespace(1, identify_namespace())
                assert ctrl._change_state(CONNECTING) and ctrl._change_state(LIVE)
                await nursery.start(ctrl.supervise)
                self.controllers.append(ctrl)
                if self.on_connect is not None:
                    self.on_connect(ctrl)
                try:
                    yield ctrl
                finally:
                    ctrl.close_state("closed")
                    nursery.cancel_scope.cancel()
                    ctrl.release()


def options(traddr: str, **kw) -> ConnectOptions:
    kw.setdefault("reconnect_delay", 1)
    kw.setdefault("ctrl_loss_tmo", 5)
    return ConnectOptions(traddr, NQN, keep_alive_tmo=0, **kw)
