"""File over the real companion socket, with a controller that places data at addresses."""

from __future__ import annotations

import errno
import gc
import os
import socket

import numpy as np
import pytest
import trio
from companion_fakes import AddressController, serving, wait_for

import nvmeof_fuse
from nvmeof_fuse.companion import protocol
from nvmeof_fuse.companion.client import shm
from nvmeof_fuse.companion.client.file import File, locate
from nvmeof_fuse.companion.protocol import CompanionError
from nvmeof_fuse.errors import CommandTimeout, InvalidArgument, NVMeoFError


@pytest.fixture
def served(tmp_path):
    ctrl = AddressController()
    with serving(ctrl, tmp_path) as (server, mnt):
        yield ctrl, server, mnt


def stats(server) -> dict:
    return server.snapshot()


@pytest.mark.parametrize("nsid", [1, 2])
def test_unaligned_read_lands_directly_in_a_shared_array(served, nsid):
    ctrl, server, mnt = served
    disk = ctrl.disks[nsid]
    arr = nvmeof_fuse.empty(100_000)
    with File(str(mnt / f"n{nsid}")) as f:
        assert f.read(arr, 70_001, file_offset=12_345, buf_offset=7) == 70_001
    assert bytes(arr[7:7 + 70_001]) == disk[12_345:12_345 + 70_001]
    assert not arr[:7].any() and not arr[7 + 70_001:].any()  # nothing outside the range
    s = stats(server)
    lba = ctrl.namespaces[nsid].lba_size
    assert s["direct_read_bytes"] == (12_345 + 70_001) // lba * lba - (-(-12_345 // lba) * lba)
    assert s["staged_read_bytes"] == 2 * lba  # the two partial LBAs, copied by the client
    assert s["daemon_copied_bytes"] == 0


def test_plain_array_is_staged_and_reported(served, caplog):
    ctrl, server, mnt = served
    arr = np.zeros(3 << 20, dtype=np.uint8)  # bigger than one staging slot
    with File(str(mnt / "n1")) as f:
        assert f.read(arr, file_offset=1000) == len(arr)
    assert bytes(arr) == ctrl.disks[1][1000:1000 + len(arr)]
    s = stats(server)
    assert s["direct_read_bytes"] == 0 and s["staged_read_bytes"] >= len(arr)
    assert "staging data through a bounce buffer" in caplog.text


def test_typed_array_views_and_futures(served):
    ctrl, server, mnt = served
    arr = nvmeof_fuse.empty((64, 16), dtype=np.float32)
    with File(str(mnt / "n2")) as f:
        futures = [f.pread(arr[i], file_offset=i * 4096) for i in range(64)]
        assert [fut.get(10) for fut in futures] == [64] * 64
    raw = arr.view(np.uint8)
    for i in range(64):
        assert bytes(raw[i]) == ctrl.disks[2][i * 4096:i * 4096 + 64]


@pytest.mark.parametrize("shared", [True, False])
def test_unaligned_write_reaches_the_disk(served, shared):
    ctrl, server, mnt = served
    data = np.frombuffer(os.urandom(50_000), dtype=np.uint8)
    buf = nvmeof_fuse.empty(len(data)) if shared else np.empty(len(data), dtype=np.uint8)
    buf[:] = data
    before = bytes(ctrl.disks[1])
    with File(str(mnt / "n1")) as f:
        assert f.pwrite(buf, file_offset=777).get(10) == len(data)
    after = bytes(ctrl.disks[1])
    assert after[777:777 + len(data)] == data.tobytes()
    assert after[:777] == before[:777] and after[777 + len(data):] == before[777 + len(data):]
    s = stats(server)
    key = "direct_write_bytes" if shared else "staged_write_bytes"
    assert s[key] > 0
    assert s["daemon_copied_bytes"] == 512 - 777 % 512 + (777 + len(data)) % 512


def test_the_mount_hears_of_each_write_before_the_client_does(served):
    ctrl, server, mnt = served
    heard = []

    async def on_write(nsid, offset, length):
        await trio.sleep(0.05)  # the client's write waits for this
        heard.append(nsid)

    server.on_write = on_write
    with File(str(mnt / "n1")) as f:
        f.write(nvmeof_fuse.empty(1000), file_offset=12)
        assert heard == [1]
        f.read(nvmeof_fuse.empty(1000))
        assert heard == [1]


def test_end_of_namespace(served):
    ctrl, server, mnt = served
    size = len(ctrl.disks[1])
    arr = nvmeof_fuse.empty(4096)
    with File(str(mnt / "n1")) as f:
        assert f.nbytes == size
        assert f.read(arr, file_offset=size - 100) == 100
        assert f.read(arr, file_offset=size) == 0
        with pytest.raises(NVMeoFError, match="extends past the end") as exc:
            f.write(arr, file_offset=size - 100)
        assert exc.value.errno == errno.ENOSPC
        with pytest.raises(InvalidArgument, match="overruns the 4096-byte buffer"):
            f.read(arr, 5000)
        # read is pread().get(): the same short count, the same refusal
        assert f.pread(arr, file_offset=size - 100).get() == 100
        assert f.pread(arr, file_offset=size).get() == 0
        with pytest.raises(InvalidArgument, match="overruns the 4096-byte buffer"):
            f.pread(arr, 5000)


def test_a_staging_slot_whose_request_timed_out_is_not_lent_again_until_answered(served):
    """The daemon may still use a slot whose request the client gave up on: lent again
    before the answer, another request's bytes would reach the disk at the first one's
    offset."""
    ctrl, server, mnt = served
    plain_command = ctrl.io_command
    delayed = []

    async def slow_first_write(sqe, data=None, *, to_controller=False):
        if sqe[0] == 0x01 and not delayed:
            delayed.append(True)
            await trio.sleep(6.0)  # far past the file's timeout, however loaded the host
        await plain_command(sqe, data, to_controller=to_controller)

    ctrl.io_command = slow_first_write
    before = bytes(ctrl.disks[1][:512])
    with File(str(mnt / "n1"), timeout=2.0, staging_bytes=4 * 4096, task_size=4096) as f:
        with pytest.raises(CompanionError, match="did not finish within") as exc:
            f.write(np.full(512, 1, dtype=np.uint8), file_offset=0)  # staged: a plain array
        assert exc.value.errno == errno.ETIMEDOUT
        for i in range(2, 8):  # the other three pages, each more than once
            f.write(np.full(512, i, dtype=np.uint8), file_offset=i * 512)
        assert f._staging.snapshot()["staging_free_bytes"] == 3 * 4096  # held until answered
        assert wait_for(lambda: ctrl.commands == 1 + 6, 30)  # the first one too
        assert wait_for(lambda: f._staging.snapshot()["staging_free_bytes"] == 4 * 4096, 30)
    assert bytes(ctrl.disks[1][:512]) in (before, bytes([1]) * 512)


def test_a_staging_slot_whose_command_timed_out_in_the_daemon_is_lent_again(served):
    """A daemon that answered (its command timed out: ETIMEDOUT) is done with the slot."""
    ctrl, server, mnt = served
    plain_command = ctrl.io_command
    failing = [True] * 4

    async def timing_out(sqe, data=None, *, to_controller=False):
        if sqe[0] == 0x01 and failing:
            failing.pop()
            raise CommandTimeout("I/O queue 1: command 3 timed out")
        await plain_command(sqe, data, to_controller=to_controller)

    ctrl.io_command = timing_out
    with File(str(mnt / "n1"), timeout=5.0, staging_bytes=4096, task_size=4096) as f:
        for _ in range(4):  # the one page of staging memory, each time
            with pytest.raises(CompanionError) as exc:
                f.write(np.full(512, 1, dtype=np.uint8), file_offset=0)
            assert exc.value.errno == errno.ETIMEDOUT
        assert f.write(np.full(512, 2, dtype=np.uint8), file_offset=512) == 512
    assert bytes(ctrl.disks[1][512:1024]) == bytes([2]) * 512


def test_numpy_integers_are_offsets_and_sizes_and_floats_are_refused_by_name(served):
    ctrl, server, mnt = served
    offsets = np.arange(4, dtype=np.int64) * 1000 + 7  # as computed offsets usually are
    arr = nvmeof_fuse.empty(4096)
    with File(str(mnt / "n1")) as f:
        assert f.read(arr, np.int64(3000), file_offset=offsets[1], buf_offset=np.int32(5)) == 3000
        assert bytes(arr[5:3005]) == ctrl.disks[1][1007:4007]
        assert f.pwrite(np.ones(100, dtype=np.uint8), file_offset=offsets[2]).get(5) == 100
        assert ctrl.disks[1][2007:2107] == bytes([1]) * 100
        with pytest.raises(InvalidArgument, match=r"^file_offset must be an integer, got 1\.5$"):
            f.read(arr, file_offset=1.5)
        with pytest.raises(InvalidArgument, match=r"^size must be an integer, got 10\.0$"):
            f.write(arr, 10.0)


@pytest.mark.parametrize("op", ["read", "write"])
def test_an_array_of_python_objects_is_refused(served, op):
    """Disk bytes over its object pointers would crash the process (pointers on disk leak)."""
    ctrl, server, mnt = served
    ctrl.disks[1][:512] = bytes(512)  # were it read, NULL pointers: a failure, not a crash
    arr = np.full(64, None, dtype=object)
    with File(str(mnt / "n1")) as f:
        with pytest.raises(InvalidArgument, match="dtype object"):
            getattr(f, op)(arr)
    assert list(arr) == [None] * 64 and ctrl.disks[1][:512] == bytes(512)


def test_close_releases_registrations(served):
    ctrl, server, mnt = served
    baseline = ctrl.transport.live
    arr = nvmeof_fuse.empty(8192)
    f = File(str(mnt / "n1"))
    f.read(arr)
    assert wait_for(lambda: stats(server)["regions"] == 2)  # staging + arr
    f.close()
    assert wait_for(lambda: stats(server)["clients"] == 0)
    assert stats(server)["regions"] == 0 and ctrl.transport.live == baseline


def test_a_vanished_client_is_cleaned_up(served):
    ctrl, server, mnt = served
    baseline = ctrl.transport.live
    f = File(str(mnt / "n1"))
    f.read(nvmeof_fuse.empty(4096))
    f._channel._sock.shutdown(socket.SHUT_RDWR)  # as if the process died
    assert wait_for(lambda: stats(server)["clients"] == 0)
    assert ctrl.transport.live == baseline
    with File(str(mnt / "n1")) as g:  # the daemon still serves
        assert g.read(nvmeof_fuse.empty(10)) == 10


def test_a_file_dropped_unclosed_lets_go_of_its_session(served):
    ctrl, server, mnt = served
    baseline = ctrl.transport.live
    f = File(str(mnt / "n1"))
    f.read(nvmeof_fuse.empty(4096))
    assert stats(server)["clients"] == 1
    del f  # never closed: its connection, registrations and threads must not outlive it
    gc.collect()
    assert wait_for(lambda: stats(server)["clients"] == 0, 30)
    assert stats(server)["regions"] == 0 and ctrl.transport.live == baseline


def test_freed_shared_array_is_unregistered(served):
    ctrl, server, mnt = served
    with File(str(mnt / "n1")) as f:
        arr = nvmeof_fuse.empty(8192)
        f.read(arr)
        assert wait_for(lambda: stats(server)["regions"] == 2)
        del arr  # its finalizer only notes the region: unregistered on the next call
        f.read(nvmeof_fuse.empty(4096))
        assert wait_for(lambda: stats(server)["regions"] == 2)  # staging + the new array
    assert wait_for(lambda: stats(server)["regions"] == 0)


def test_malformed_requests_get_named_errors(served):
    ctrl, server, mnt = served
    with File(str(mnt / "n1")) as f:
        ch = f._channel
        with pytest.raises(CompanionError, match="unknown companion request 'bogus'"):
            ch.call("bogus")
        with pytest.raises(CompanionError, match="field 'nsid' must be int"):
            ch.call("read", nsid="1", pieces=[])
        with pytest.raises(CompanionError, match="region 99 is not registered"):
            ch.call("read", nsid=1, pieces=[[0, 1, 99, 0]])
        with pytest.raises(CompanionError, match="namespace 9 does not exist"):
            ch.call("read", nsid=9, pieces=[])
        with pytest.raises(CompanionError, match=r"LBA range 16383\.\.16384 is outside"):
            ch.call("read", nsid=1, pieces=[[16383, 2, f._staging.rid, 0]])
        with pytest.raises(CompanionError, match="outside the"):
            ch.call("read", nsid=1, pieces=[[0, 1, f._staging.rid, len(f._staging.mem)]])
        with pytest.raises(CompanionError, match="register needs one file descriptor"):
            ch.call("register", kind="memfd", length=4096)
        assert f.read(nvmeof_fuse.empty(10)) == 10  # the connection survives all of that
    assert stats(server)["errors"] == 7


def test_malformed_lock_and_report_fields_are_named_not_internal_errors(served):
    ctrl, server, mnt = served
    with File(str(mnt / "n1")) as f:
        ch = f._channel
        with pytest.raises(CompanionError, match="hold_s -1 is negative") as exc:
            ch.call("lock", nsid=1, offset=0, length=512, hold_s=-1)
        assert exc.value.errno == errno.EINVAL
        for op in ("report", "stats"):
            with pytest.raises(CompanionError, match="field 'moved' must be an object") as exc:
                ch.call(op, moved=[1])
            assert exc.value.errno == errno.EPROTO


def test_a_malformed_register_closes_the_descriptor_it_carried(served):
    ctrl, server, mnt = served
    mem = shm.allocate(4096)
    with File(str(mnt / "n1")) as f:
        open_fds = len(os.listdir("/proc/self/fd"))  # the daemon serves in this process
        for fields in ({"kind": "memfd"}, {"kind": "dmabuf", "length": 4096, "iova": 0}):
            with pytest.raises(CompanionError, match="must be int, got None"):
                f._channel.call("register", fds=(mem.fd,), **fields)
        assert len(os.listdir("/proc/self/fd")) == open_fds


def test_locate_names_what_is_wrong(tmp_path, served):
    ctrl, server, mnt = served
    with pytest.raises(InvalidArgument, match="not a namespace file"):
        locate(str(mnt / ".nvmeof" / "companion.json"))
    (tmp_path / "n1").touch()
    with pytest.raises(CompanionError, match="is not an nvmeof-fuse mount"):
        File(str(tmp_path / "n1"))
    with pytest.raises(CompanionError, match="namespace 5 is not on this mount"):
        (mnt / "n5").touch()
        File(str(mnt / "n5"))


def test_a_dead_daemon_is_reported(tmp_path):
    ctrl = AddressController()
    with serving(ctrl, tmp_path) as (server, mnt):
        pass
    with pytest.raises(CompanionError, match="cannot reach the mount daemon"):
        File(str(mnt / "n1"))


def test_peer_rule():
    from nvmeof_fuse.companion.server.server import peer_allowed

    assert peer_allowed(1000, 1000) and peer_allowed(0, 1000)
    assert not peer_allowed(1001, 1000)


def test_protocol_round_trip_and_limits():
    header, payload = protocol.decode(protocol.encode({"op": "x", "id": 3}, b"ab"))
    assert header == {"op": "x", "id": 3} and payload == b"ab"
    with pytest.raises(protocol.ProtocolError, match="too short"):
        protocol.decode(b"\0")
    with pytest.raises(protocol.ProtocolError, match="overruns"):
        protocol.decode(b"\0\0\0\x09{}")
    with pytest.raises(InvalidArgument, match="exceeds"):
        protocol.encode({}, bytes(protocol.MAX_MESSAGE))


def test_a_closed_file_says_so(served):
    ctrl, server, mnt = served
    f = File(str(mnt / "n1"))
    f.close()
    arr = nvmeof_fuse.empty(512)
    for call in (f.read, f.pread, f.write, f.pwrite):
        with pytest.raises(CompanionError, match=r"n1 is closed") as exc:
            call(arr)
        assert exc.value.errno == errno.EBADF


def test_a_read_only_mount_refuses_writes_on_both_sides(tmp_path):
    ctrl = AddressController()
    with serving(ctrl, tmp_path, read_only=True) as (server, mnt), File(str(mnt / "n1")) as f:
        arr = nvmeof_fuse.empty(1024)
        with pytest.raises(CompanionError, match="n1 is mounted read-only"):
            f.write(arr)
        assert f.read(arr) == 1024
        with pytest.raises(CompanionError, match="the namespace is mounted read-only") as exc:
            f._channel.write(1, 0, 512, f._staging.rid, 0, b"", b"", 10)
        assert exc.value.errno == errno.EROFS


def test_a_silent_daemon_times_out_by_name(tmp_path):
    import json

    name = f"\0nvmeof-fuse-test/{os.getpid()}/silent"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(name)
    listener.listen(1)  # connects queue up; nothing ever answers
    mnt = tmp_path / "mnt"
    (mnt / ".nvmeof").mkdir(parents=True)
    (mnt / "n1").touch()
    (mnt / ".nvmeof" / "companion.json").write_text(json.dumps({"socket": "@" + name[1:]}))
    try:
        with pytest.raises(CompanionError, match=r"did not answer hello within 0\.3 s") as exc:
            File(str(mnt / "n1"), timeout=0.3)
        assert exc.value.errno == errno.ETIMEDOUT
    finally:
        listener.close()


@pytest.mark.parametrize("source", ["bytes", "read-only array"])
def test_a_write_from_read_only_memory_is_written(served, source):
    """A write only reads its buffer: bytes and read-only arrays are sources too."""
    ctrl, server, mnt = served
    data = bytes(range(256)) * 4
    buf = data if source == "bytes" else np.frombuffer(data, dtype=np.uint8)
    with File(str(mnt / "n1")) as f:
        assert f.write(buf, file_offset=512) == 1024
        assert f.pwrite(buf, 100, file_offset=4096, buf_offset=3).get(5) == 100
    assert bytes(ctrl.disks[1][512:1536]) == data
    assert bytes(ctrl.disks[1][4096:4196]) == data[3:103]
