"""File on a regular file of a filesystem on a namespace (companion/fsfile.py), over the real
companion socket and a fake controller; the chain and FIEMAP are the test's (the ioctl and
sysfs run for real in tests/testbed/test_files.py)."""

from __future__ import annotations

import errno
import logging
import os
import random

import numpy as np
import pytest
from companion_fakes import AddressController, serving

import nvmeof_fuse
from nvmeof_fuse.companion.client import file as client
from nvmeof_fuse.companion.files import fiemap as fm
from nvmeof_fuse.companion.files import fsfile, fsmap
from nvmeof_fuse.companion.files.fiemap import Extent
from nvmeof_fuse.companion.files.fsfile import FilesystemFile
from nvmeof_fuse.companion.protocol import CompanionError
from nvmeof_fuse.errors import InvalidArgument

BASE = 1 << 20  # where the "filesystem" starts in n1 (a partition at sector 2048)
BLOCK = 4096


@pytest.fixture(autouse=True)
def _warnings_stay_ours():
    """What these tests log once is logged again for the tests after them."""
    before = set(client._warned)
    yield
    client._warned.intersection_update(before)


class Layout:
    """A file whose blocks the test placed on the fake disk: what FIEMAP reports."""

    def __init__(self, ctrl, path, fstype: str = "ext4") -> None:
        self.ctrl, self.path, self.fstype = ctrl, path, fstype
        self.extents: list[Extent] = []
        self.calls = 0
        self.on_call = None  # run on each FIEMAP call (to move the file under a read)
        self.journalled = False  # ext4 writes the file's data to its journal first

    def fiemap(self, fd, start, length, flags=fm.FIEMAP_FLAG_SYNC, per_call=256):
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        return [e for e in self.extents if e.logical + e.length > start
                and e.logical < start + length]

    def place(self, logical: int, physical: int, length: int, flags: int = 0,
              data: bytes | None = None) -> None:
        """An extent; its bytes on the disk are the file's (or ``data``: what the disk
        holds where the file's bytes are not, for holes, unwritten and flagged extents)."""
        self.extents.append(Extent(logical, physical, length, flags))
        with open(self.path, "rb") as f:
            f.seek(logical)
            content = f.read(length).ljust(length, b"\0")
        disk = self.ctrl.disks[1]
        disk[BASE + physical:BASE + physical + length] = content if data is None else data


@pytest.fixture
def fs(tmp_path, monkeypatch):
    ctrl = AddressController()
    with serving(ctrl, tmp_path) as (server, mnt):
        path = tmp_path / "file.bin"
        layout = Layout(ctrl, path)

        def resolve(p, st=None):
            return fsmap.Chain(str(p), layout.fstype, "loop0p1", "loop0", str(mnt / "n1"),
                               BASE, 0, 512, True)

        monkeypatch.setattr(fsmap, "resolve", resolve)
        monkeypatch.setattr(fsmap, "fiemap", layout.fiemap)
        monkeypatch.setattr(fsmap, "journals_data", lambda fd, dev: layout.journalled)
        yield layout, server, path


def sparse_file(layout: Layout, path) -> bytes:
    """64 KiB + 100 bytes: data, a hole, data, an unwritten extent, a tail; scattered."""
    rng = random.Random(7)
    content = bytearray(rng.randbytes(16 * BLOCK + 100))
    content[4 * BLOCK:6 * BLOCK] = bytes(2 * BLOCK)  # a hole
    content[10 * BLOCK:12 * BLOCK] = bytes(2 * BLOCK)  # unwritten
    path.write_bytes(bytes(content))
    garbage = random.Random(8).randbytes(2 * BLOCK)
    layout.place(0, 40 * BLOCK, 4 * BLOCK)
    layout.place(6 * BLOCK, 7 * BLOCK, 4 * BLOCK)  # below the first: out of order on disk
    layout.place(10 * BLOCK, 100 * BLOCK, 2 * BLOCK, fm.UNWRITTEN, data=garbage)
    layout.place(12 * BLOCK, 60 * BLOCK, 5 * BLOCK, fm.LAST)
    return bytes(content)


@pytest.mark.parametrize("alloc", ["empty", "numpy"])
def test_random_ranges_equal_the_kernels_read(fs, alloc):
    layout, server, path = fs
    content = sparse_file(layout, path)
    rng = random.Random(1)
    with nvmeof_fuse.File(str(path)) as f:
        assert isinstance(f, FilesystemFile) and f.nbytes == len(content)
        for _ in range(40):
            offset = rng.randrange(0, len(content) + 10)
            size = rng.randrange(0, len(content) + 10)
            buf = (nvmeof_fuse.empty(size + 9) if alloc == "empty"
                   else np.full(size + 9, 0xAA, dtype=np.uint8))
            buf[:] = 0xAA
            got = f.read(buf, size, offset, buf_offset=9)
            want = content[offset:offset + size]
            assert got == len(want)
            assert bytes(buf[9:9 + got]) == want, (offset, size)
            assert not (buf[:9] != 0xAA).any()  # nothing before the range
        whole = (nvmeof_fuse.empty(len(content)) if alloc == "empty"
                 else np.zeros(len(content), dtype=np.uint8))
        assert f.read(whole) == len(content) and bytes(whole) == content
        placement = f.placement["extents"]
    if alloc == "empty":
        assert placement == "direct: 3 extents"
    else:
        assert placement.startswith("staged: 3 extents (")


def test_unwritten_extents_and_holes_cost_no_io(fs):
    layout, server, path = fs
    content = sparse_file(layout, path)
    before = server.snapshot()
    with FilesystemFile(str(path)) as f:
        buf = nvmeof_fuse.empty(6 * BLOCK)
        assert f.read(buf, 6 * BLOCK, 4 * BLOCK) == 6 * BLOCK  # hole, then 4 blocks
        assert bytes(buf) == content[4 * BLOCK:10 * BLOCK]
        moved = server.snapshot()["direct_read_bytes"] - before["direct_read_bytes"]
        assert moved == 4 * BLOCK
        buf2 = nvmeof_fuse.empty(2 * BLOCK)
        f.read(buf2, 2 * BLOCK, 10 * BLOCK)  # the unwritten extent: zeros, not the garbage
        assert not buf2.any()
        assert server.snapshot()["direct_read_bytes"] - before["direct_read_bytes"] == moved
        assert f.placement["extents"] == "direct: 0 extents (holes only)"


def test_a_flagged_extent_is_read_by_the_kernel_and_said_once(fs, caplog):
    layout, server, path = fs
    content = os.urandom(8 * BLOCK)
    path.write_bytes(content)
    layout.place(0, 0, 4 * BLOCK)
    layout.place(4 * BLOCK, 20 * BLOCK, 4 * BLOCK, 0x2000 | fm.LAST,  # shared (reflink)
                 data=bytes(4 * BLOCK))
    caplog.set_level(logging.WARNING)
    with FilesystemFile(str(path)) as f:
        for _ in range(2):
            buf = nvmeof_fuse.empty(len(content))
            assert f.read(buf) == len(content) and bytes(buf) == content
        assert f.placement["extents"] == "direct: 1 extent; kernel: 1 range (extent shared)"
    said = [r for r in caplog.records if "extent shared" in r.getMessage()]
    assert len(said) == 1 and "the kernel reads part of it" in said[0].getMessage()


def test_a_filesystem_other_than_ext4_or_xfs_is_read_by_the_kernel(fs, caplog):
    layout, server, path = fs
    layout.fstype = "btrfs"
    content = os.urandom(3 * BLOCK + 5)
    path.write_bytes(content)
    caplog.set_level(logging.WARNING)
    with FilesystemFile(str(path)) as f:
        buf = np.zeros(len(content), dtype=np.uint8)
        assert f.read(buf) == len(content) and bytes(buf) == content
        assert f.placement["extents"] == "kernel: filesystem btrfs is not ext4 or xfs"
    assert layout.calls == 0
    assert any("filesystem btrfs is not ext4 or xfs" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("failure", [
    OSError(errno.EOPNOTSUPP, "Operation not supported"),
    fm.FiemapError("FIEMAP extent 1 at 0 overlaps the one before it"),
])
def test_a_failed_or_nonsense_fiemap_goes_to_the_kernel(fs, failure):
    layout, server, path = fs
    content = os.urandom(4 * BLOCK)
    path.write_bytes(content)
    layout.place(0, 0, 4 * BLOCK, fm.LAST, data=bytes(4 * BLOCK))  # not the file's bytes

    def fail(call: int) -> None:
        raise failure

    layout.on_call = fail
    with FilesystemFile(str(path)) as f:
        buf = nvmeof_fuse.empty(len(content))
        assert f.read(buf) == len(content) and bytes(buf) == content
        assert f.placement["extents"] == f"kernel: FIEMAP failed: {failure}"


def test_an_error_mid_read_waits_for_the_extents_already_started(fs, monkeypatch):
    layout, server, path = fs
    content = os.urandom(8 * BLOCK)
    path.write_bytes(content)
    layout.place(0, 0, 4 * BLOCK)
    layout.place(4 * BLOCK, 20 * BLOCK, 4 * BLOCK, 0x2000 | fm.LAST)  # shared: the kernel's
    started, waited = [], []
    start_device = FilesystemFile._start_device

    class Watched:
        def __init__(self, future):
            self.future = future
            started.append(self)

        def get(self, *args):
            waited.append(self)
            return self.future.get(*args)

    def record(self, *args):
        return [(Watched(future), n) for future, n in start_device(self, *args)]

    def fail(self, *args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(FilesystemFile, "_start_device", record)
    monkeypatch.setattr(FilesystemFile, "_kernel_read", fail)
    with FilesystemFile(str(path)) as f:
        with pytest.raises(OSError, match="Input/output error"):
            f.read(nvmeof_fuse.empty(len(content)))
        assert started and waited == started  # none left writing into the buffer


def test_a_file_whose_data_ext4_journals_is_read_by_the_kernel(fs):
    layout, server, path = fs
    content = os.urandom(4 * BLOCK)
    path.write_bytes(content)
    layout.place(0, 0, 4 * BLOCK, fm.LAST, data=bytes(4 * BLOCK))  # not checkpointed yet
    layout.journalled = True
    with FilesystemFile(str(path)) as f:
        buf = nvmeof_fuse.empty(len(content))
        assert f.read(buf) == len(content) and bytes(buf) == content
        assert f.placement["extents"] == ("kernel: ext4 journals the file's data "
                                          "(data=journal or chattr +j)")
    assert layout.calls == 0


def test_a_file_changed_under_a_read_is_read_again(fs):
    layout, server, path = fs
    content = os.urandom(4 * BLOCK)
    path.write_bytes(content)
    layout.place(0, 0, 4 * BLOCK, fm.LAST)
    touched = []

    def change_once(call: int) -> None:
        if call == 2 and not touched:  # the check after the first try's data landed
            os.utime(path)  # moves the change time
            touched.append(call)

    layout.on_call = change_once
    with FilesystemFile(str(path)) as f:
        buf = nvmeof_fuse.empty(len(content))
        assert f.read(buf) == len(content) and bytes(buf) == content
        assert f.placement["extents"] == "direct: 1 extent"
    assert layout.calls == 4  # two tries, each mapped before and checked after


def test_a_file_that_keeps_changing_goes_to_the_kernel(fs):
    layout, server, path = fs
    content = os.urandom(4 * BLOCK)
    path.write_bytes(content)
    layout.place(0, 0, 4 * BLOCK, fm.LAST, data=bytes(4 * BLOCK))  # stale on the device
    layout.on_call = lambda call: os.utime(path)
    with FilesystemFile(str(path), retries=2) as f:
        buf = nvmeof_fuse.empty(len(content))
        assert f.read(buf) == len(content) and bytes(buf) == content
        assert f.placement["extents"] == "kernel: the file kept changing while read (3 tries)"


def test_a_remapped_file_is_read_again(fs):
    layout, server, path = fs
    content = os.urandom(4 * BLOCK)
    path.write_bytes(content)
    layout.place(0, 0, 4 * BLOCK, fm.LAST)

    def remap(call: int) -> None:
        if call == 2:  # moved elsewhere (defragmented) while we read: same ctime
            layout.extents = []
            layout.place(0, 30 * BLOCK, 4 * BLOCK, fm.LAST)

    layout.on_call = remap
    with FilesystemFile(str(path)) as f:
        buf = nvmeof_fuse.empty(len(content))
        assert f.read(buf) == len(content) and bytes(buf) == content
    assert layout.calls == 4


def test_batch_reads_map_once(fs):
    layout, server, path = fs
    content = sparse_file(layout, path)
    with FilesystemFile(str(path), chunk=BLOCK) as f:  # extents cut into chunks too
        bufs = [nvmeof_fuse.empty(1000) for _ in range(5)]
        offsets = [0, 5 * BLOCK, 9 * BLOCK + 7, 16 * BLOCK + 50, 10 * BLOCK]
        assert f.read_batch([(b, 1000, o) for b, o in zip(bufs, offsets, strict=True)]) == \
            [1000, 1000, 1000, 50, 1000]
        for b, o in zip(bufs, offsets, strict=True):
            n = min(1000, len(content) - o)
            assert bytes(b[:n]) == content[o:o + n]
        assert [fut.get() for fut in f.pread_batch([(bufs[0], 10, 0)])] == [10]
    assert layout.calls == 4  # one mapping and one check per batch


def test_writes_go_through_the_kernel_and_say_so_once(fs, caplog):
    layout, server, path = fs
    path.write_bytes(bytes(2 * BLOCK))
    caplog.set_level(logging.WARNING)
    with FilesystemFile(str(path)) as f:
        assert f.write(b"hello", file_offset=100) == 5
        assert f.write(np.frombuffer(b"world", dtype=np.uint8), file_offset=BLOCK) == 5
    data = path.read_bytes()
    assert data[100:105] == b"hello" and data[BLOCK:BLOCK + 5] == b"world"
    said = [r for r in caplog.records if "go through the kernel" in r.getMessage()]
    assert len(said) <= 1  # once per process (an earlier test may have said it)
    with pytest.raises(CompanionError, match="is closed"):
        f.read(np.zeros(4, dtype=np.uint8))


def test_a_namespace_file_still_opens_as_one(fs):
    layout, server, path = fs
    with nvmeof_fuse.File(str(layout.ctrl and path.parent / "mnt" / "n1")) as f:
        assert not isinstance(f, FilesystemFile) and f.nbytes == len(layout.ctrl.disks[1])


def test_open_file_leaves_what_is_not_a_regular_file_to_file(tmp_path):
    assert fsfile.open_file(str(tmp_path)) is None
    assert fsfile.open_file(str(tmp_path / "missing")) is None


def test_bad_options_and_an_unwritable_file_are_named(fs, monkeypatch):
    layout, server, path = fs
    path.write_bytes(bytes(BLOCK))
    with pytest.raises(InvalidArgument, match="chunk must be positive and retries not "
                                              "negative, got 0 and 3"):
        FilesystemFile(str(path), chunk=0)
    real_open = os.open

    def no_writes(name, flags, *args):  # as for a read-only file (root may write those)
        if name == str(path) and flags & os.O_WRONLY:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(name, flags, *args)

    with FilesystemFile(str(path)) as f:
        monkeypatch.setattr(os, "open", no_writes)
        with pytest.raises(CompanionError, match=f"^cannot open {path} for writing: "
                                                 "Permission denied$"):
            f.write(b"x")
