"""A controller whose commands copy between an in-memory disk and real addresses.

It stands in for the target's RDMA placement: a read command's data lands at
the registered address (as the NIC would put it), so the companion server and
client run unchanged over a real Unix socket.  dma-bufs are memfds here: the
fake transport maps them and translates their IOVA to the mapping.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import random
import threading
import uuid
from types import SimpleNamespace
from typing import Any

import trio

from nvmeof_fuse.companion.server.server import CompanionServer
from nvmeof_fuse.errors import TransportError
from nvmeof_fuse.host.controller import ConnectOptions
from nvmeof_fuse.host.memory import BouncePool, DataRef
from nvmeof_fuse.host.namespace import Namespace
from nvmeof_fuse.nvme import Completion

OPC_FLUSH, OPC_WRITE, OPC_READ = 0x00, 0x01, 0x02


class FakeRegistration:
    lkey = rkey = 1

    def __init__(self, transport: FakeTransport, cleanup: Any = None) -> None:
        self.transport = transport
        self.cleanup = cleanup
        transport.live += 1

    def keys(self, domain: object) -> FakeRegistration:
        return self

    def close(self) -> None:
        self.transport.live -= 1
        if self.cleanup:
            self.cleanup()


class FakeTransport:
    def __init__(self) -> None:
        self.live = 0  # registrations not yet closed
        self.dmabufs: list[tuple[int, int, int]] = []  # iova, length, host address
        self.dmabuf_error: Exception | None = None

    def register(self, addr: int, length: int, owner: object) -> FakeRegistration:
        return FakeRegistration(self)

    def register_dmabuf(self, fd: int, offset: int, length: int, iova: int) -> FakeRegistration:
        if self.dmabuf_error is not None:
            raise self.dmabuf_error
        mem = mmap.mmap(fd, offset + length)
        anchor = ctypes.c_char.from_buffer(mem)
        host = ctypes.addressof(anchor) + offset
        del anchor
        entry = (iova, length, host)
        self.dmabufs.append(entry)

        def unmap() -> None:
            self.dmabufs.remove(entry)
            mem.close()
        return FakeRegistration(self, unmap)

    def translate(self, addr: int) -> int:
        for iova, length, host in self.dmabufs:
            if iova <= addr < iova + length:
                return host + addr - iova
        return addr


class AddressController:
    """What Namespace, the companion server and NamespaceFS need, with disks in memory."""

    def __init__(self, specs=((1, 512, 16384), (2, 4096, 512)), max_transfer: int = 16384,
                 seed: int = 1) -> None:
        self.transport = FakeTransport()
        self.max_transfer = max_transfer
        self.bounce = BouncePool(self.transport.register, max_transfer, 4)
        rng = random.Random(seed)
        self.disks = {nsid: bytearray(rng.randbytes(ls * nlb)) for nsid, ls, nlb in specs}
        self.namespaces = {}
        for nsid, ls, nlb in specs:
            ident = SimpleNamespace(lba_size=ls, nsze=nlb, to_dict=lambda: {})
            self.namespaces[nsid] = Namespace(self, nsid, ident)
        self.commands = 0
        self.on_command: Any = None  # called with each I/O command's opcode
        self.identify = SimpleNamespace(mn="fake", sn="1", fr="1", subnqn="nqn.x:fake",
                                        to_dict=lambda: {"mn": "fake"})

    live = True  # commands run now (Namespace asks before it takes a bounce buffer)

    def describe(self) -> dict:
        return {"transport": "fake"}

    async def wait_live(self) -> None:
        pass

    async def io_command(self, sqe: bytearray, data: DataRef | None = None, *,
                         to_controller: bool = False) -> None:
        opcode = sqe[0]
        nsid = int.from_bytes(sqe[4:8], "little")
        slba = int.from_bytes(sqe[40:48], "little")
        nlb = int.from_bytes(sqe[48:50], "little") + 1
        self.commands += 1
        if self.on_command is not None:
            self.on_command(opcode)
        await trio.sleep(0)
        if opcode == OPC_FLUSH:
            return
        ls = self.namespaces[nsid].lba_size
        length = nlb * ls
        assert data is not None and data.length == length <= self.max_transfer
        disk = self.disks[nsid]
        addr = self.transport.translate(data.addr)
        at = slba * ls
        if opcode == OPC_READ:
            ctypes.memmove(addr, (ctypes.c_char * length).from_buffer(disk, at), length)
        else:
            assert opcode == OPC_WRITE and to_controller
            disk[at:at + length] = ctypes.string_at(addr, length)


@contextlib.contextmanager
def serving(ctrl: AddressController, tmp_path: Any, *, read_only: bool = False,
            roles: Any = ()):
    """Serve ``ctrl``'s companion socket on a trio thread, with the mount's own ``roles``;
    yields (server, mount dir)."""
    server = CompanionServer(ctrl, read_only=read_only, roles=roles)
    started = threading.Event()
    state: dict[str, Any] = {}

    async def main() -> None:
        state["token"] = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            state["scope"] = scope
            async with trio.open_nursery() as nursery:
                await nursery.start(server.serve)
                started.set()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # surfaced by the test
            state["error"] = exc
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10), "companion server did not start"
    if "error" in state:
        raise state["error"]
    server.trio_token = state["token"]  # for tests that run work on the server's loop
    mnt = tmp_path / "mnt"
    (mnt / ".nvmeof").mkdir(parents=True)
    for nsid in ctrl.namespaces:
        (mnt / f"n{nsid}").touch()
    (mnt / ".nvmeof" / "companion.json").write_text(json.dumps(server.info()))
    try:
        yield server, mnt
    finally:
        trio.from_thread.run_sync(state["scope"].cancel, trio_token=state["token"])
        thread.join(10)
        assert not thread.is_alive()


def wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class LeasingController(AddressController):
    """The fake controller with what leasing reads: options, QIDs, identity, liveness."""

    def __init__(self, companion_queues: int = 3, transport: str = "rdma",
                 specs=((1, 512, 16384), (2, 4096, 512))) -> None:
        super().__init__(specs)
        self.options = ConnectOptions("10.0.0.1", "nqn.2026-11.io.x:sub",
                                      companion_queues=companion_queues)
        self.transport.name = transport
        self.transport.places_in_other_processes = transport in ("rdma", "tcp")
        self.lease_qids = list(range(3, 3 + companion_queues))
        self.cntlid = 7
        self.state = "live"
        self.in_capsule_bytes = 8192
        self.identity = SimpleNamespace(hostnqn="nqn.2014-08.org.nvmexpress:uuid:x",
                                        hostid=uuid.UUID(int=5))

    def io_queue_size(self) -> int:
        return 128

    async def wait_live(self, *, fail_fast: bool = True) -> None:
        await trio.lowlevel.checkpoint()

    async def next_state(self) -> str:
        self.state_changed = trio.Event()
        await self.state_changed.wait()
        return self.state


# -- a client's own queues on the fake controller ------------------------------------------------

OPC_FABRICS = 0x7F


class FakeQueue:
    """An I/O queue a companion client connected itself: commands land on ``ctrl``'s disks."""

    size = 32
    available = 31
    connect_cattr = 0

    def __init__(self, fabric: FakeFabric, qid: int) -> None:
        self.fabric = fabric
        self.qid = qid

    async def execute(self, sqe: bytearray, data: DataRef | None = None, *,
                      to_controller: bool = False, timeout: float) -> Completion:
        fabric = self.fabric
        if fabric.fail_next:
            fabric.fail_next -= 1
            raise TransportError(f"I/O queue {self.qid}: work request failed: fake")
        if sqe[0] == OPC_FABRICS:
            fabric.connects.append(self.qid)
            status = fabric.connect_status.pop(0) if fabric.connect_status else 0
        else:
            fabric.commands.append((sqe[0], self.qid))
            await fabric.ctrl.io_command(sqe, data, to_controller=to_controller)
            status = 0
        return Completion(0, 0, self.qid, 0, status, True)

    def close(self) -> None:
        self.fabric.closed.append(self.qid)


class FakeFabric:
    """The transport a client's DirectQueues makes: memory registers, queues connect."""

    name = "rdma"
    address = "rdma fake"

    def __init__(self, ctrl: AddressController) -> None:
        self.ctrl = ctrl
        self.registrations = ctrl.transport  # shared: its dma-bufs translate for the disks
        self.connects: list[int] = []
        self.commands: list[tuple[int, int]] = []
        self.closed: list[int] = []
        self.connect_status: list[int] = []  # statuses for the next Connects (0: success)
        self.fail_next = 0  # commands to fail with a TransportError

    def __call__(self, options: Any) -> FakeFabric:  # the transport factory
        return self

    async def connect_queue(self, nursery, qid, size, in_capsule_bytes=0, cntlid=0):
        return FakeQueue(self, qid)

    async def drop_queues(self) -> None:
        await trio.lowlevel.checkpoint()

    def register(self, addr: int, length: int, owner: object) -> FakeRegistration:
        return self.registrations.register(addr, length, owner)

    def register_dmabuf(self, fd: int, offset: int, length: int, iova: int):
        return self.registrations.register_dmabuf(fd, offset, length, iova)

    def close(self) -> None:
        pass
