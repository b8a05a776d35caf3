"""One read path (issue #42, acceptance 2): a FUSE READ goes request loop -> session ->
operations -> namespace -> byte range -> controller -> transport, and never back into a
module it left.

A real FuseSession serves a fake kernel (a SOCK_SEQPACKET socket) with the real NamespaceFS,
Namespace, ByteRangeIO and Controller, over tests/fabric_fakes.py's transport.  Where the
transport takes a command (``execute`` for a read that a task waits for, ``start`` for one a
callback answers), the test walks the Python stack back to the request loop and records
which module each frame belongs to.  Read from the request loop down, those modules must be exactly
the chain above: each module once, in that order (a U-turn, say byte range -> namespace,
shows as a module twice, and a path that skips the byte range shows as a shorter chain).

At QD1 each READ runs in a task of the request loop (the await chain is the stack); at QD16
the reads that arrive while others are in flight start with a callback instead (a plain call
chain).
Both are checked, and both must have happened.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from types import SimpleNamespace

import pytest
import trio
from fabric_fakes import FakeQueue, FakeTarget, FakeTransport

from nvmeof_fuse.fs import wire
from nvmeof_fuse.fs.operations import NamespaceFS
from nvmeof_fuse.fs.session import FuseSession
from nvmeof_fuse.host.controller import ConnectOptions, Controller
from nvmeof_fuse.host.namespace import Namespace
from nvmeof_fuse.host.state import CONNECTING, LIVE

LBA = 512
NLB = 4096
CHUNK = 16384
STEP = 20  # s: bound on every wait

LAYERS = {
    "nvmeof_fuse.fs.requestloop": "request loop",
    "nvmeof_fuse.fs.session": "session",
    "nvmeof_fuse.fs.operations": "operations",
    "nvmeof_fuse.host.namespace.namespace": "namespace",
    "nvmeof_fuse.host.namespace.byterange": "byte range",
    "nvmeof_fuse.host.controller": "controller",
    "fabric_fakes": "transport",
}
CHAIN = ["request loop", "session", "operations", "namespace", "byte range", "controller",
         "transport"]


def modules_on_stack(frame) -> list[str]:
    """The modules of the frames from the request loop's down to ``frame``, each run of frames
    in one module counted once; frames outside the package (trio's) are left out, and a
    module of the package outside the chain shows by its own name."""
    names: list[str] = []
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("nvmeof_fuse") or module in LAYERS:
            names.append(LAYERS.get(module, module))
        frame = frame.f_back
    names.reverse()
    return [name for i, name in enumerate(names) if i == 0 or names[i - 1] != name]


@pytest.fixture
def recorded(monkeypatch) -> dict[str, list[list[str]]]:
    """The module chain of every command the fake transport takes, by how it took it."""
    stacks: dict[str, list[list[str]]] = {"execute": [], "start": []}
    plain_execute, plain_start = FakeQueue.execute, FakeQueue.start

    # These wrappers are the transport's first frame: what called them is the chain above.
    def execute(self, sqe, *args, **kwargs):
        if self.qid:  # I/O queues only
            stacks["execute"].append(modules_on_stack(sys._getframe(1)) + ["transport"])
        return plain_execute(self, sqe, *args, **kwargs)

    def start(self, sqe, *args, **kwargs):
        stacks["start"].append(modules_on_stack(sys._getframe(1)) + ["transport"])
        return plain_start(self, sqe, *args, **kwargs)

    monkeypatch.setattr(FakeQueue, "execute", execute)
    monkeypatch.setattr(FakeQueue, "start", start)
    return stacks


async def live_controller(nursery: trio.Nursery, target: FakeTarget) -> Controller:
    """A live Controller with two I/O queues to ``target`` and its namespace as n1."""
    transport = FakeTransport(target)
    options = ConnectOptions("192.0.2.1", "nqn.2014-08.org.example:read-path", keep_alive_tmo=0)
    ctrl = Controller(options, transport, nursery)
    ctrl.admin = await transport.connect_queue(nursery, 0, 32)
    ctrl.io_queues = [await transport.connect_queue(nursery, qid, 32) for qid in (1, 2)]
    ctrl.max_transfer = CHUNK
    ctrl.bounce = ctrl.new_bounce_pool(CHUNK, 32)
    ctrl.namespaces[1] = Namespace(ctrl, 1, SimpleNamespace(lba_size=LBA, nsze=NLB))
    assert ctrl._change_state(CONNECTING) and ctrl._change_state(LIVE)
    return ctrl


def read_request(unique: int, fh: int, offset: int, size: int) -> bytes:
    args = struct.pack("<QQIIQII", fh, offset, size, 0, 0, 0, 0)
    return struct.pack("<IIQQIIIHH", wire.IN_HEADER_SIZE + len(args), wire.READ, unique, 0,
                       0, 0, 0, 0, 0) + args


async def serve_reads(depth: int, reads: int) -> dict[int, bytes]:
    """READs of 4 KiB at odd offsets through a session, ``depth`` in flight at a time; the
    data of each reply by unique, checked against the target's disk."""
    target = FakeTarget(LBA, NLB)
    target.disk[:] = os.urandom(len(target.disk))
    replies: dict[int, bytes] = {}
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.settimeout(STEP)

    async def ask(message: bytes) -> bytes:
        await trio.to_thread.run_sync(theirs.send, message)
        return await trio.to_thread.run_sync(theirs.recv, 1 << 20)

    with theirs, trio.fail_after(STEP):
        async with trio.open_nursery() as nursery:
            ctrl = await live_controller(nursery, target)
            session = FuseSession(NamespaceFS(ctrl), os.dup(ours.fileno()))
            ours.close()
            nursery.start_soon(session.run)
            init = struct.pack("<IIII", 7, 38, 65536, 0xFFFFFFFF) + bytes(48)
            await ask(struct.pack("<IIQQIIIHH", 40 + len(init), wire.INIT, 1, 0, 0, 0, 0, 0, 0)
                      + init)
            lookup = await ask(struct.pack("<IIQQIIIHH", 43, wire.LOOKUP, 2, 1, 0, 0, 0, 0, 0)
                               + b"n1\0")
            inode = struct.unpack_from("<Q", lookup, 16)[0]
            opened = await ask(struct.pack("<IIQQIIIHH", 48, wire.OPEN, 3, inode, 0, 0, 0, 0, 0)
                               + struct.pack("<II", os.O_RDONLY, 0))
            fh = struct.unpack_from("<Q", opened, 16)[0]
            offsets = {100 + u: (u * 7919 * LBA + 100) % (LBA * (NLB - 16)) for u in range(reads)}
            for first in range(0, reads, depth):
                batch = list(offsets)[first:first + depth]
                for unique in batch:
                    theirs.send(read_request(unique, fh, offsets[unique], 4096))
                for _ in batch:
                    reply = await trio.to_thread.run_sync(theirs.recv, 1 << 20)
                    length, error, unique = struct.unpack_from("<IiQ", reply)
                    assert error == 0 and length == len(reply)
                    replies[unique] = reply[16:]
            session.stop_reading()
            nursery.cancel_scope.cancel()
    session.close()
    for unique, data in replies.items():
        assert data == target.disk[offsets[unique]:offsets[unique] + 4096], unique
    return replies


def test_a_read_at_qd1_goes_down_the_chain_once(recorded):
    replies = trio.run(serve_reads, 1, 8)
    assert len(replies) == 8
    assert recorded["execute"] and not recorded["start"]  # alone, each read runs as a task
    for chain in recorded["execute"]:
        assert chain == CHAIN, chain


def test_reads_at_qd16_go_down_the_chain_once_started_or_awaited(recorded):
    replies = trio.run(serve_reads, 16, 64)
    assert len(replies) == 64
    assert recorded["start"], "no read at depth was started with a callback"
    assert recorded["execute"], "no read at depth ran as a task"
    for chain in recorded["execute"] + recorded["start"]:
        assert chain == CHAIN, chain


def test_the_check_sees_a_u_turn():
    """The stack walk itself: a chain that comes back into a module it left is caught."""
    def in_namespace(then):
        return then()

    def in_byterange(then):
        return then()

    fake = SimpleNamespace(namespace={"__name__": "nvmeof_fuse.host.namespace.namespace"},
                           byterange={"__name__": "nvmeof_fuse.host.namespace.byterange"})
    namespace_frame = type(in_namespace)(in_namespace.__code__, fake.namespace)
    byterange_frame = type(in_byterange)(in_byterange.__code__, fake.byterange)
    chain = namespace_frame(lambda: byterange_frame(
        lambda: namespace_frame(lambda: modules_on_stack(sys._getframe(1)))))
    assert chain == ["namespace", "byte range", "namespace"]
