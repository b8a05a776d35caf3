"""The FUSE session: against a fake kernel (a SOCK_SEQPACKET socket keeps each request one
message, as /dev/fuse does), and through the real kernel (two mounts in one process)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import socket
import struct
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from nvmeof_fuse.fs import wire
from nvmeof_fuse.fs.mount import MountOptions, serve
from nvmeof_fuse.fs.operations import NamespaceFS
from nvmeof_fuse.fs.session import FuseSession, receive_buffer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fakes import make_controller  # noqa: E402

STEP = 20  # s: bound on every wait
BURST = 60  # requests queued at once: their replies fit in a socket's default buffer


def request(opcode, args=b"", unique=1, nodeid=1):
    return struct.pack("<IIQQIIIHH", 40 + len(args), opcode, unique, nodeid, 0, 0, 0, 0,
                       0) + args


class FakeKernel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def ask(self, opcode, args=b"", unique=1, nodeid=1):
        """(errno, body) of the reply to one request."""
        await trio.to_thread.run_sync(self.sock.send, request(opcode, args, unique, nodeid))
        with trio.fail_after(STEP):
            reply = await trio.to_thread.run_sync(self.sock.recv, 2 << 20)
        length, error, got_unique = struct.unpack_from("<IiQ", reply)
        assert (length, got_unique) == (len(reply), unique)
        return -error, reply[16:]


async def with_session(test):
    ctrl = make_controller((1, 512, 64))
    ops = NamespaceFS(ctrl)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = FuseSession(ops, os.dup(ours.fileno()))
    ours.close()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        kernel = FakeKernel(theirs)
        init = struct.pack("<IIII", 7, 38, 65536, 0xFFFFFFFF) + bytes(48)
        assert (await kernel.ask(wire.INIT, init))[0] == 0
        await test(kernel, ctrl)
        theirs.close()  # the session ends as on an unmount
    assert session.gone
    session.close()
    return session


def test_requests_through_a_fake_kernel():
    async def test(kernel, ctrl):
        err, body = await kernel.ask(wire.LOOKUP, b"n1\0", unique=2)
        assert err == 0
        inode = struct.unpack_from("<Q", body)[0]
        err, body = await kernel.ask(wire.OPEN, struct.pack("<II", os.O_RDWR | os.O_DIRECT, 0),
                                     unique=3, nodeid=inode)
        fh, flags, _ = struct.unpack("<QII", body)
        assert flags == wire.FOPEN_DIRECT_IO | wire.FOPEN_PARALLEL_DIRECT_WRITES
        payload = bytes(range(256)) * 4
        args = struct.pack("<QQIIQII", fh, 512, len(payload), 0, 0, 0, 0) + payload
        assert await kernel.ask(wire.WRITE, args, unique=4) == (0, struct.pack("<II", 1024, 0))
        assert bytes(ctrl.namespaces[1].device.data[512:1536]) == payload
        args = struct.pack("<QQIIQII", fh, 768, 100, 0, 0, 0, 0)
        assert await kernel.ask(wire.READ, args, unique=5) == (0, payload[256:356])
        assert (await kernel.ask(wire.MKDIR, bytes(8) + b"x\0", unique=6))[0] == errno.EPERM
        assert (await kernel.ask(22, bytes(8) + b"user.x\0", unique=7))[0] == (
            errno.ENOSYS)
        assert (await kernel.ask(wire.LOOKUP, b"n9\0", unique=8))[0] == errno.ENOENT
        args = struct.pack("<QQIIQII", fh, 64 * 512, 512, 0, 0, 0, 0) + bytes(512)
        assert (await kernel.ask(wire.WRITE, args, unique=9))[0] == errno.ENOSPC

    trio.run(with_session, test)


def test_write_data_lands_page_aligned():
    buf = receive_buffer(wire.PAGE * 3)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert len(buf) == wire.PAGE * 3 and address % mmap.PAGESIZE == 0


def test_a_kernel_too_old_gets_eproto(caplog):
    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        session = FuseSession(NamespaceFS(make_controller((1, 512, 8))), os.dup(ours.fileno()))
        ours.close()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run)
            init = struct.pack("<IIII", 7, 19, 65536, 0) + bytes(48)
            assert (await FakeKernel(theirs).ask(wire.INIT, init))[0] == errno.EPROTO
            theirs.close()
        session.close()

    trio.run(main)
    assert "FUSE INIT: the kernel speaks FUSE 7.19; we need 7.23 or newer" in caplog.text


needs_fuse = pytest.mark.skipif(
    not os.access("/dev/fuse", os.R_OK | os.W_OK) or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3")


@needs_fuse
def test_two_mounts_in_one_process(tmp_path):
    """Each mount has its own session: one process can serve several."""
    paths = [tmp_path / "a", tmp_path / "b"]

    def use_both() -> list[bytes]:
        got = []
        for p in paths:
            assert sorted(os.listdir(p)) == [".nvmeof", "n1"]
            with open(p / "n1", "r+b", buffering=0) as f:
                f.write(p.name.encode() * 512)
                f.seek(0)
                got.append(f.read(4))
        return got

    async def main():
        ctrls = [make_controller((1, 512, 64)), make_controller((1, 512, 64))]
        with trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                for p, ctrl in zip(paths, ctrls, strict=True):
                    p.mkdir()
                    await nursery.start(serve, ctrl, str(p), MountOptions())
                assert await trio.to_thread.run_sync(use_both) == [b"aaaa", b"bbbb"]
                nursery.cancel_scope.cancel()
        assert [bytes(c.namespaces[1].device.data[:2]) for c in ctrls] == [b"aa", b"bb"]

    trio.run(main)
    assert not any(os.path.ismount(p) for p in paths)


def test_queued_requests_each_get_one_reply():
    """Many requests queued at once (tasks take most of them straight from the
    descriptor): every one is answered once, with its own data.  Over RAM (a controller
    that starts no I/O) no request is offered to a callback."""
    asked: list = []

    async def test(kernel, ctrl):
        ctrl.namespaces[1].device.data[:] = bytes(range(256)) * (512 * 64 // 256)
        ctrl.namespaces[1].start_read_lent = ctrl.namespaces[1].start_write = (
            lambda *args: asked.append(args))
        err, body = await kernel.ask(wire.LOOKUP, b"n1\0", unique=2)
        inode = struct.unpack_from("<Q", body)[0]
        err, body = await kernel.ask(wire.OPEN, struct.pack("<II", os.O_RDWR, 0), unique=3,
                                     nodeid=inode)
        fh = struct.unpack_from("<Q", body)[0]
        expected = {}
        requests = []
        for i in range(300):
            unique = 100 + i
            if i % 3 == 0:
                off = (i % 32) * 512
                requests.append(request(wire.READ, struct.pack("<QQIIQII", fh, off, 64, 0, 0,
                                                               0, 0), unique))
                expected[unique] = bytes(ctrl.namespaces[1].device.data[off:off + 64])
            elif i % 3 == 1:
                off = (32 + i % 32) * 512
                payload = bytes([i % 256]) * 512
                requests.append(request(wire.WRITE, struct.pack("<QQIIQII", fh, off, 512, 0, 0,
                                                                0, 0) + payload, unique))
                expected[unique] = struct.pack("<II", 512, 0)
            else:
                requests.append(request(wire.GETATTR, bytes(16), unique, nodeid=inode))
                expected[unique] = None

        def exchange() -> dict[int, bytes]:
            # In rounds of BURST queued at once: unlike /dev/fuse, the fake kernel's socket
            # can refuse a reply when too many wait unread (the reply would be lost).
            replies = {}
            kernel.sock.settimeout(STEP)
            for first in range(0, len(requests), BURST):
                for r in requests[first:first + BURST]:
                    kernel.sock.send(r)
                while len(replies) < min(first + BURST, len(requests)):
                    reply = kernel.sock.recv(1 << 16)
                    length, error, unique = struct.unpack_from("<IiQ", reply)
                    assert error == 0 and length == len(reply) and unique not in replies
                    replies[unique] = reply[16:]
            return replies

        replies = await trio.to_thread.run_sync(exchange)
        assert replies.keys() == expected.keys()
        for unique, body in expected.items():
            if body is not None:
                assert replies[unique] == body

    session = trio.run(with_session, test)
    assert not asked
    assert session.requests == 3 + 300  # INIT, LOOKUP, OPEN and the 300: each counted
    assert 0 < session.parks <= session.requests  # (queued in bursts: fewer waits than requests)


def test_a_destroy_ends_the_session_and_stop_reading_wakes_the_reader():
    """DESTROY ends run(); stop_reading() wakes the reader parked on the descriptor (and
    the idle tasks), so run() returns."""
    async def main():
        for ending in ("destroy", "stop"):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            session = FuseSession(NamespaceFS(make_controller((1, 512, 8))),
                                  os.dup(ours.fileno()))
            ours.close()
            with theirs, trio.fail_after(STEP):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(session.run)
                    await trio.testing.wait_all_tasks_blocked()
                    assert session._loop is not None and session._loop.parked
                    if ending == "destroy":
                        theirs.send(request(wire.DESTROY, unique=9))
                    else:
                        session.stop_reading()
                assert session._loop is None  # run() returned
                if ending == "destroy":
                    assert struct.unpack("<IiQ", theirs.recv(64)) == (16, 0, 9)
                    assert session.gone
            session.close()

    trio.run(main)


def test_stop_reading_before_run_takes_nothing():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = FuseSession(NamespaceFS(make_controller((1, 512, 8))), os.dup(ours.fileno()))
    ours.close()
    with theirs:
        theirs.send(request(wire.GETATTR, bytes(16), unique=4))
        session.stop_reading()
        trio.run(session.run)
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            theirs.recv(64)  # not answered: not taken
    session.close()


def session_on_a_socket(ctrl) -> tuple[FuseSession, FakeKernel]:
    """A session serving ``ctrl``'s namespaces to a fake kernel (bounded waits)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = FuseSession(NamespaceFS(ctrl), os.dup(ours.fileno()))
    ours.close()
    theirs.settimeout(STEP)
    return session, FakeKernel(theirs)


async def open_n1(kernel: FakeKernel, flags: int) -> int:
    """INIT, then LOOKUP and OPEN ``n1`` with ``flags``: its file handle."""
    init = struct.pack("<IIII", 7, 38, 65536, 0xFFFFFFFF) + bytes(48)
    assert (await kernel.ask(wire.INIT, init))[0] == 0
    _, body = await kernel.ask(wire.LOOKUP, b"n1\0", unique=2)
    inode = struct.unpack_from("<Q", body)[0]
    _, body = await kernel.ask(wire.OPEN, struct.pack("<II", flags, 0), unique=3, nodeid=inode)
    return struct.unpack_from("<Q", body)[0]


async def next_reply(sock: socket.socket) -> tuple[int, bytes]:
    """The next reply the fake kernel gets: (unique, body)."""
    data = await trio.to_thread.run_sync(sock.recv, 1 << 16)
    return struct.unpack_from("<Q", data, 8)[0], data[16:]


def test_reads_in_flight_together_are_answered_by_callbacks():
    """A READ that arrives while another is in flight is started with a callback
    (``ops.start_read``) and answered from it, with no task waiting; one whose callback
    says it failed runs again as a task (for a retry, or its errno).  A READ alone runs as
    a task, which polls for its completion.  Stopping waits for the callbacks in flight."""
    async def main():
        ctrl = make_controller((1, 512, 64))
        ns = ctrl.namespaces[1]
        ns.device.data[:] = bytes(range(256)) * (512 * 64 // 256)
        release = trio.Event()
        plain_read = ns.read_lent
        started: list = []  # (offset, size, done)

        async def held_read(offset: int, length: int):
            await release.wait()
            return await plain_read(offset, length)

        ns.read_lent = held_read
        ns.start_read_lent = lambda offset, size, done: started.append((offset, size, done)) or 1
        ctrl.starts_io = True  # as a Controller's namespaces
        session, kernel = session_on_a_socket(ctrl)
        theirs = kernel.sock

        def read(unique: int, offset: int) -> bytes:
            return request(wire.READ, struct.pack("<QQIIQII", fh, offset, 64, 0, 0, 0, 0), unique)

        with theirs, trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.run)
                fh = await open_n1(kernel, os.O_RDONLY)
                for unique, offset in ((10, 0), (11, 512), (12, 1024)):
                    theirs.send(read(unique, offset))
                await trio.testing.wait_all_tasks_blocked()
                assert [s[:2] for s in started] == [(512, 64), (1024, 64)]  # not the first
                loop = session._loop
                assert loop is not None and loop.running == 3
                data = bytes(ns.device.data[512:576])
                started[0][2](memoryview(data))  # as the queue's reaper does
                assert await next_reply(theirs) == (11, data)
                started[1][2](None)  # failed: _read runs it (held, as the first)
                session.stop_reading()
                await trio.testing.wait_all_tasks_blocked()
                assert session._loop is loop  # two reads still in flight
                release.set()
            replies = dict([await next_reply(theirs) for _ in range(2)])
            assert replies == {10: bytes(ns.device.data[:64]), 12: bytes(ns.device.data[1024:1088])}
            assert session._loop is None and loop.running == 0
        session.close()

    trio.run(main)


def test_writes_in_flight_together_are_answered_by_callbacks():
    """As reads: a WRITE that arrives while another is in flight is started with a
    callback (``ops.start_write``), answered from it, and its data buffer reused; one whose
    callback says it failed runs again as a task."""
    async def main():
        ctrl = make_controller((1, 512, 64))
        ns = ctrl.namespaces[1]
        release = trio.Event()
        plain_write = ns.write
        started: list = []  # (offset, data, done)

        async def held_write(offset: int, data):
            await release.wait()
            return await plain_write(offset, data)

        ns.write = held_write
        ns.start_write = lambda offset, data, done: started.append(
            (offset, bytes(data), done)) or 1
        ctrl.starts_io = True
        session, kernel = session_on_a_socket(ctrl)
        theirs = kernel.sock

        def write(unique: int, offset: int) -> bytes:
            args = struct.pack("<QQIIQII", fh, offset, 512, 0, 0, 0, 0)
            return request(wire.WRITE, args + bytes([unique]) * 512, unique)

        with theirs, trio.fail_after(STEP):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.run)
                fh = await open_n1(kernel, os.O_RDWR)
                for unique, offset in ((10, 0), (11, 512), (12, 1024)):
                    theirs.send(write(unique, offset))
                await trio.testing.wait_all_tasks_blocked()
                assert [(o, d) for o, d, _ in started] == [(512, b"\x0b" * 512),
                                                           (1024, b"\x0c" * 512)]
                free = len(session._free)
                started[0][2](True)  # as the queue's reaper does
                assert await next_reply(theirs) == (11, struct.pack("<II", 512, 0))
                assert len(session._free) == free + 1  # its data buffer is free again
                started[1][2](False)  # failed: _write runs it (held, as the first)
                release.set()
                replies = dict([await next_reply(theirs) for _ in range(2)])
                assert replies == {u: struct.pack("<II", 512, 0) for u in (10, 12)}
                assert ns.device.data[1024:1536] == b"\x0c" * 512
                theirs.close()
        session.close()

    trio.run(main)
