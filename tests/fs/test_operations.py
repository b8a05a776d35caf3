import errno
import json
import logging
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from nvmeof_fuse.errors import CommandTimeout
from nvmeof_fuse.fs.mount_options import MountOptions
from nvmeof_fuse.fs.operations import (
    GENERATION_MAX,
    NamespaceFS,
    fh_generation,
    pack_fh,
    unpack_fh,
)
from nvmeof_fuse.fs.wire import ROOT_INODE, DirBuffer, EntryAttributes, FUSEError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fakes import make_controller  # noqa: E402
from ramdisk import ram_controller  # noqa: E402


def call(fn, *args):
    return trio.run(fn, *args)


@pytest.fixture
def ctrl():
    return make_controller((1, 512, 64), (7, 4096, 4))


@pytest.fixture
def fs(ctrl):
    return NamespaceFS(ctrl, MountOptions(uid=1000, gid=100, mode=0o600))


def lookup(fs, *names):
    inode = ROOT_INODE
    for name in names:
        inode = call(fs.lookup, inode, name.encode(), None).st_ino
    return inode


def listdir(fs, inode, monkeypatch=None, start=0, size=1 << 16):
    out = DirBuffer(size)
    call(fs.readdir, call(fs.opendir, inode, None), start, out)
    return [name.decode() for name in _names(out)]


def _names(out):
    import struct

    data, names = b"".join(out.parts), []
    while data:
        _, _, namelen, _ = struct.unpack_from("<QQII", data)
        names.append(data[24 : 24 + namelen])
        data = data[(24 + namelen + 7) & ~7 :]
    return names


def read_all(fs, inode, flags=os.O_RDONLY):
    fi = call(fs.open, inode, flags, None)
    out, off = b"", 0
    while chunk := call(fs.read, fi.fh, off, 4096):
        out += chunk
        off += len(chunk)
    call(fs.release, fi.fh)
    return out, fi


def fields(**set_):
    names = ("atime", "mtime", "ctime", "mode", "uid", "gid", "size")
    return SimpleNamespace(**{f"update_{n}": set_.get(n, False) for n in names})


def test_tree(fs, monkeypatch):
    assert listdir(fs, ROOT_INODE, monkeypatch) == [".nvmeof", "n1", "n7"]
    infodir = lookup(fs, ".nvmeof")
    assert listdir(fs, infodir, monkeypatch) == [
        "controller",
        "controller.json",
        "stats",
        "stats.json",
        "companion.json",
        "n1",
        "n1.json",
        "n7",
        "n7.json",
    ]
    assert call(fs.lookup, infodir, b"..", None).st_ino == ROOT_INODE
    with pytest.raises(FUSEError) as e:
        call(fs.lookup, ROOT_INODE, b"n2", None)
    assert e.value.errno == errno.ENOENT


def test_namespace_attributes(fs):
    a = call(fs.getattr, lookup(fs, "n7"), None)
    assert stat.S_ISREG(a.st_mode) and stat.S_IMODE(a.st_mode) == 0o600
    assert (a.st_size, a.st_blksize, a.st_blocks) == (16384, 4096, 32)
    assert (a.st_uid, a.st_gid) == (1000, 100)
    assert a.st_mtime_ns == fs.mount_ns


def test_read_only_clears_write_bits_and_refuses_writes(ctrl):
    fs = NamespaceFS(ctrl, MountOptions(read_only=True, mode=0o664))
    inode = lookup(fs, "n1")
    assert stat.S_IMODE(call(fs.getattr, inode, None).st_mode) == 0o444
    for flags in (os.O_WRONLY, os.O_RDWR):
        with pytest.raises(FUSEError) as e:
            call(fs.open, inode, flags, None)
        assert e.value.errno == errno.EROFS


def test_read_write_round_trip_and_bounds(fs, ctrl):
    fi = call(fs.open, lookup(fs, "n1"), os.O_RDWR | os.O_TRUNC, None)
    assert not fi.direct_io
    assert call(fs.write, fi.fh, 1000, b"hello") == 5
    assert call(fs.read, fi.fh, 998, 9) == b"\0\0hello\0\0"
    assert ctrl.namespaces[1].device.data[1000:1005] == b"hello"  # O_TRUNC ignored
    size = ctrl.namespaces[1].size
    assert call(fs.read, fi.fh, size - 3, 100) == b"\0" * 3
    assert call(fs.read, fi.fh, size, 100) == b""
    # straddling the end: cut short like a block device; at or past it: ENOSPC
    assert call(fs.write, fi.fh, size - 3, b"abcdef") == 3
    for off in (size, size + 4096):
        with pytest.raises(FUSEError) as e:
            call(fs.write, fi.fh, off, b"x")
        assert e.value.errno == errno.ENOSPC
    call(fs.flush, fi.fh)
    call(fs.fsync, fi.fh, True)
    assert ctrl.namespaces[1].flushes == 2
    call(fs.release, fi.fh)
    assert fs.handles == {}


def test_read_only_open_does_not_flush_on_close(fs, ctrl):
    fi = call(fs.open, lookup(fs, "n1"), os.O_RDONLY, None)
    call(fs.flush, fi.fh)
    assert ctrl.namespaces[1].flushes == 0


def test_before_open_runs_with_the_handle_counted_and_a_failure_releases_it(fs):
    seen = []

    async def before_open(nsid):
        seen.append((nsid, fs.file_open(nsid), fs.file_open(7)))
        if len(seen) == 2:
            raise FUSEError(errno.EIO)

    fs.before_open = before_open  # the companion recalls a write delegation here
    fi = call(fs.open, lookup(fs, "n1"), os.O_RDONLY, None)
    assert seen == [(1, True, False)]
    with pytest.raises(FUSEError):
        call(fs.open, lookup(fs, "n7"), os.O_RDONLY, None)
    assert not fs.file_open(7) and fs.file_open(1)
    call(fs.release, fi.fh)
    assert not fs.file_open(1)


def test_o_direct_open_gets_direct_io(fs):
    fi = call(fs.open, lookup(fs, "n1"), os.O_RDONLY | os.O_DIRECT, None)
    assert fi.direct_io and not fi.keep_cache


def test_nvme_errors_become_errno_and_a_warning(fs, ctrl, caplog):
    ctrl.namespaces[1].device.fail = CommandTimeout("Read timed out after 30 s (qid 1, cid 7)")
    fi = call(fs.open, lookup(fs, "n1"), os.O_RDWR, None)
    with caplog.at_level(logging.WARNING), pytest.raises(FUSEError) as e:
        call(fs.read, fi.fh, 0, 512)
    assert e.value.errno == errno.ETIMEDOUT
    assert "read of 512 bytes at offset 0 of n1: Read timed out" in caplog.text


def test_setattr_size(fs, ctrl):
    inode = lookup(fs, "n1")
    attr = EntryAttributes()
    attr.st_size = ctrl.namespaces[1].size
    assert call(fs.setattr, inode, attr, fields(size=True), None, None).st_size == attr.st_size
    for size in (0, 100, attr.st_size + 512):
        attr.st_size = size
        with pytest.raises(FUSEError) as e:
            call(fs.setattr, inode, attr, fields(size=True), None, None)
        assert e.value.errno == errno.EINVAL
    with pytest.raises(FUSEError) as e:
        call(fs.setattr, inode, attr, fields(mode=True), None, None)
    assert e.value.errno == errno.EPERM
    call(fs.setattr, inode, attr, fields(atime=True, mtime=True), None, None)  # touch is fine


def test_tree_cannot_change(fs):
    with pytest.raises(FUSEError) as e:
        call(fs.create, ROOT_INODE, b"x", 0o644, os.O_RDWR, None)
    assert e.value.errno == errno.EPERM
    with pytest.raises(FUSEError):
        call(fs.unlink, ROOT_INODE, b"n1", None)


def test_info_files(fs, ctrl):
    text, fi = read_all(fs, lookup(fs, ".nvmeof", "controller"))
    assert fi.direct_io
    assert b"Fake NVMe Controller" in text and b"n7 : 16384 bytes" in text
    doc = json.loads(read_all(fs, lookup(fs, ".nvmeof", "controller.json"))[0])
    assert doc["controller"]["traddr"] == "192.0.2.1"
    assert doc["identify"]["sn"] == "FAKE0001"
    assert doc["namespaces"][1] == {"nsid": 7, "size": 16384, "lba_size": 4096, "nlb": 4}
    ns = json.loads(read_all(fs, lookup(fs, ".nvmeof", "n7.json"))[0])
    assert ns["identify"]["nsze"] == 4
    assert b"namespace 1: 32768 bytes" in read_all(fs, lookup(fs, ".nvmeof", "n1"))[0]
    with pytest.raises(FUSEError):
        call(fs.open, lookup(fs, ".nvmeof", "stats"), os.O_WRONLY, None)


def test_stats_are_regenerated_at_each_open(fs, ctrl):
    inode = lookup(fs, ".nvmeof", "stats.json")
    assert json.loads(read_all(fs, inode)[0])["n1"]["ops"] == {}
    fi = call(fs.open, lookup(fs, "n1"), os.O_RDONLY, None)
    call(fs.read, fi.fh, 0, 1024)
    assert json.loads(read_all(fs, inode)[0])["n1"]["ops"]["read"]["bytes"] == 1024
    text = read_all(fs, lookup(fs, ".nvmeof", "stats"))[0].decode()
    assert text.startswith("n1:\n") and "read" in text and "n7:" in text


def test_statfs(fs):
    s = call(fs.statfs, None)
    assert s.f_bsize * s.f_blocks == 32768 + 16384


def test_nsid_option_shows_only_that_namespace(ctrl, monkeypatch):
    fs = NamespaceFS(ctrl, MountOptions(nsid=7))
    assert listdir(fs, ROOT_INODE, monkeypatch) == [".nvmeof", "n7"]
    infodir = lookup(fs, ".nvmeof")
    names = listdir(fs, infodir, monkeypatch)
    assert "n7.json" in names and "n1" not in names and "n1.json" not in names
    with pytest.raises(FUSEError) as e:
        lookup(fs, "n1")
    assert e.value.errno == errno.ENOENT


def test_drop_cached_asks_the_kernel_for_the_range_or_the_whole_file(fs):
    asked = []

    class Kernel:
        async def invalidate_inode(self, inode, attr_only=False, offset=0, length=0):
            asked.append((inode, attr_only, offset, length))

    fs.kernel = Kernel()
    n1 = lookup(fs, "n1")
    call(fs.drop_cached, 1, 4096, 10_000)  # a companion write's range
    call(fs.drop_cached, 1)  # a delegation's end: any of it may have changed
    call(fs.drop_cached, 99)  # no such namespace: nothing to drop
    assert asked == [(n1, False, 4096, 10_000), (n1, False, 0, 0)]


def test_an_unavailable_namespace_shows_with_size_0_and_open_fails_with_enxio(fs, ctrl):
    ns = ctrl.namespaces[1]
    ns.unavailable, ns.size = "its LBA size 2^63 bytes (LBADS 63) is outside 512 B to 64 KiB", 0
    inode = lookup(fs, "n1")
    assert call(fs.getattr, inode, None).st_size == 0
    with pytest.raises(FUSEError) as refused:
        call(fs.open, inode, os.O_RDONLY, None)
    assert refused.value.errno == errno.ENXIO
    assert not fs.file_open(1) and fs.handles == {}


def test_a_namespace_s_reports_come_at_their_first_lookup_or_listing():
    """Few of a target's 65,536 namespaces' reports are ever read: none is made before."""
    ctrl = make_controller(*((nsid, 512, 8) for nsid in range(1, 2001)))
    fs = NamespaceFS(ctrl)
    nodes = len(fs.nodes)
    assert nodes == 2000 + 2 + 5  # the files, root, .nvmeof and the controller's reports
    n1500 = lookup(fs, ".nvmeof", "n1500.json")
    assert json.loads(read_all(fs, n1500)[0])["nsid"] == 1500
    assert len(fs.nodes) == nodes + 2  # n1500 and n1500.json
    assert lookup(fs, ".nvmeof", "n1500") != n1500
    for name in ("n0", "n01", "n2001", "n", "nx.json", "n1.jsonx", "n99999999999", "1"):
        with pytest.raises(FUSEError) as gone:
            call(fs.lookup, lookup(fs, ".nvmeof"), name.encode(), None)
        assert gone.value.errno == errno.ENOENT, name
    listed = listdir(fs, lookup(fs, ".nvmeof"), size=1 << 20)
    assert len(listed) == 5 + 2 * 2000 and listed[5:7] == ["n1500", "n1500.json"]
    assert sorted(listed[7:9]) == ["n1", "n1.json"]


def test_a_long_directory_lists_whole_across_readdir_calls(monkeypatch):
    ctrl = make_controller(*((nsid, 512, 8) for nsid in range(1, 501)))
    fs = NamespaceFS(ctrl)
    handle = call(fs.opendir, ROOT_INODE, None)
    names: list[str] = []
    while True:
        out = DirBuffer(4096)
        call(fs.readdir, handle, len(names), out)
        page = [name.decode() for name in _names(out)]
        if not page:
            break
        names += page
    assert names == [".nvmeof", *(f"n{nsid}" for nsid in range(1, 501))]
    assert call(fs.getattr, ROOT_INODE, None).st_nlink == 3  # ., .. and .nvmeof's ..


@pytest.mark.parametrize("nsid,writable", [(1, True), (7, False), (0xFFFFFFFE, True), (0, False)])
def test_a_shared_handle_says_what_it_opened(nsid, writable):
    assert unpack_fh(pack_fh(12345, nsid, writable)) == (nsid, writable)


def test_a_shared_handle_names_the_namespaces_generation_up_to_the_most_it_holds():
    assert fh_generation(pack_fh(12345, 7, True, 3)) == 3
    assert unpack_fh(pack_fh(12345, 7, True, 3)) == (7, True)
    assert fh_generation(pack_fh(1, 7, True, 1000)) == GENERATION_MAX
    assert pack_fh((1 << 40) + 5, 0xFFFFFFFE, True, 254) < 1 << 64  # the serial wraps


def test_any_process_reads_a_namespace_handle_it_did_not_open():
    ctrl = ram_controller((1, 512, 64), (2, 4096, 16))
    opener = NamespaceFS(ctrl, shared_handles=True)
    other = NamespaceFS(ctrl, shared_handles=True)

    async def main():
        fi = await opener.open(opener.ns_inodes[2], os.O_RDWR, None)
        assert fi.fh >> 1 & 0xFFFFFFFF == 2
        h = other.handles[fi.fh]  # never opened here
        assert h.node.ns.nsid == 2 and h.writable
        report = await opener.open(opener.nodes[opener._root.entries[b".nvmeof"]]
                                   .entries[b"stats.json"], os.O_RDONLY, None)
        with pytest.raises(KeyError):
            other.handles[report.fh]  # a report: only its opener can read it
        assert other.handles.get(report.fh) is None

    trio.run(main)


def test_without_workers_handles_stay_plain_counters():
    fs = NamespaceFS(ram_controller((1, 512, 64)))

    async def main():
        a = await fs.open(fs.ns_inodes[1], os.O_RDWR, None)
        b = await fs.open(fs.ns_inodes[1], os.O_RDONLY, None)
        assert (a.fh, b.fh) == (1, 2)

    trio.run(main)
