"""A File on NVMe/TCP queues of its own: a real mount (in this process, reached over its
companion socket as another process reaches it) of the fake NVMe/TCP target."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os

import numpy as np
import pytest
import trio
from companion_fakes import wait_for
from tcp_target import NQN, FakeTcpTarget, served_in_thread

import nvmeof_fuse
from nvmeof_fuse.companion.client import file as client
from nvmeof_fuse.companion.client.file import QUEUES_PER_CLIENT, File

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse")


class Target:
    """The fake target served from a thread of its own; ``run`` calls into its loop."""

    def __init__(self, target: FakeTcpTarget, token: trio.lowlevel.TrioToken) -> None:
        self.target = target
        self.token = token

    def cut(self) -> None:
        """Close every connection, as an outage does (the daemon reconnects)."""
        async def close_all() -> None:
            for stream in list(self.target.streams):
                await stream.aclose()

        trio.from_thread.run(close_all, trio_token=self.token)


@contextlib.contextmanager
def tcp_target(**kw):
    with served_in_thread(io_queues=32, **kw) as (target, token):
        yield Target(target, token)


@pytest.fixture
def mounted(tmp_path, monkeypatch):
    """``(target, mount)``: a File opened here reaches the mount over its socket, as a
    client in another process does (so it leases queues of its own)."""
    monkeypatch.setattr(client, "served_here", lambda socket: None)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with tcp_target() as target, nvmeof_fuse.mount(
            str(mnt), traddr="127.0.0.1", nqn=NQN, transport="tcp",
            trsvcid=target.target.port, keep_alive_tmo=0, reconnect_delay=1) as m:
        yield target, m


def own_connects(target: FakeTcpTarget, qids) -> list[tuple[int, int]]:
    return [(qid, cntlid) for qid, cntlid, _ in target.io_connects if qid in qids]


def test_reads_and_writes_are_byte_exact_on_the_files_own_tcp_queues(mounted):
    target, m = mounted
    fake = target.target
    size, offset = 100_000, 12_345  # partial LBAs at both ends: read-modify-written here
    data = np.frombuffer(os.urandom(size), np.uint8).copy()
    out = np.zeros(size, np.uint8)
    with File(m.path(1)) as f:
        own = f.own_queues
        assert len(own) == QUEUES_PER_CLIENT
        daemon_commands = len(fake.commands)
        assert f.write(data, file_offset=offset) == size
        assert f.read(out, file_offset=offset) == size
        futures = [f.pread(out[i * 4096:(i + 1) * 4096], file_offset=i * 4096)
                   for i in range(16)]
        assert [fut.get(30) for fut in futures] == [4096] * 16
        placement = f.placement
        stats = f.stats()
    assert bytes(fake.data[offset:offset + size]) == data.tobytes()
    assert out[:65536].tobytes() == bytes(fake.data[:65536])
    # connected with the mount's controller ID and host identity
    assert {(qid, cntlid) for qid, cntlid, _ in fake.io_connects if qid in own} == {
        (qid, fake.cntlid) for qid in own}
    assert len({nqn for _, _, nqn in fake.io_connects}) == 1  # the daemon's and ours
    assert len(fake.commands) > daemon_commands
    assert placement["host"] == placement["shared"] == (
        "direct: received and sent by this process's own NVMe/TCP queues")
    assert stats["client_queue_read_bytes"] == size + 16 * 4096
    assert stats["client_queue_write_bytes"] == size
    for counter in ("direct_read_bytes", "direct_write_bytes", "staged_read_bytes",
                    "staged_write_bytes", "daemon_copied_bytes"):
        assert stats[counter] == 0, counter
    (session,) = [s for s in stats["sessions"] if s["qids"]]
    assert session["qids"] == list(own) and session["lease_transport"] == "tcp"


def test_a_lost_connection_revokes_the_lease_and_it_is_granted_again(mounted):
    target, m = mounted
    fake = target.target
    data = np.frombuffer(os.urandom(8192), np.uint8).copy()
    out = np.zeros(8192, np.uint8)
    with File(m.path(1)) as f:
        own = f.own_queues
        first = fake.cntlid
        assert f.read(out, file_offset=0) == 8192
        target.cut()  # the daemon reconnects: a new controller ID; our queues follow it
        assert wait_for(lambda: fake.cntlid != first and m.controller.state == "live", 60)
        assert wait_for(lambda: sorted(own_connects(fake, own)[-len(own):]) ==
                        [(qid, fake.cntlid) for qid in sorted(own)], 60)
        assert f.write(data, file_offset=700) == 8192
        assert f.read(out, file_offset=700) == 8192
        assert f.own_queues == own
        stats = f.stats()
    assert out.tobytes() == data.tobytes() == bytes(fake.data[700:700 + 8192])
    assert stats["errors"] == 0 and stats["client_queue_write_bytes"] == 8192


def test_each_write_on_own_tcp_queues_holds_the_daemons_range_lock(mounted, monkeypatch):
    """A read-modify-write of the daemon (a FUSE write) never slips into a client's write."""
    target, m = mounted
    server = m.server
    held: list[tuple[int, int]] = []
    lock = server.lock

    async def watched(session, nsid, offset, length, timeout, delegate=False, **kw):
        reply = await lock(session, nsid, offset, length, timeout, delegate=delegate, **kw)
        held.append((offset, length))
        return reply

    monkeypatch.setattr(server, "lock", watched)
    data = np.full(5000, 7, np.uint8)
    with File(m.path(1)) as f:
        assert f.write(data, file_offset=1000) == 5000
    assert held and held[0] == (1000, 5000)
    assert bytes(target.target.data[1000:6000]) == data.tobytes()


def test_cuda_memory_is_staged_by_the_client_itself_over_its_own_tcp_queues(mounted, cuda):
    target, m = mounted
    size, offset = 300_000, 777
    data = np.frombuffer(os.urandom(size), np.uint8)
    tensor = cuda.tensor(size)
    tensor.bytes[:] = data

    def run(fn, *args, **kwargs):  # on a thread that never touched CUDA, as the fake wants
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(fn, *args, **kwargs).result(60)

    with File(m.path(1), task_size=64 << 10, staging_bytes=256 << 10) as f:
        assert run(f.write, tensor, file_offset=offset) == size
        tensor.bytes[:] = 0
        assert run(f.read, tensor, file_offset=offset) == size
        placement = f.placement["cuda"]
        stats = f.stats()
    assert tensor.bytes.tobytes() == data.tobytes()
    assert bytes(target.target.data[offset:offset + size]) == data.tobytes()
    assert placement.startswith("staged: by this process over its own queues (NVMe/TCP")
    assert "export" not in cuda.names()  # no dma-buf asked for: a socket cannot take one
    assert stats["client_queue_read_bytes"] >= size
    assert stats["client_queue_write_bytes"] >= size
    for counter in ("direct_read_bytes", "direct_write_bytes", "staged_read_bytes",
                    "staged_write_bytes", "daemon_copied_bytes"):
        assert stats[counter] == 0, counter
    assert stats["file"]["staging_pinned"]
