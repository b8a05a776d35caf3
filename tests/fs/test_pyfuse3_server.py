"""fs/pyfuse3_server.py: NamespaceFS's answers in pyfuse3's types and errnos, one mount per
process, and the one-line error when pyfuse3 is missing (mounts through it: test_mount.py)."""

import errno
import logging
import os
import sys
from pathlib import Path

import pyfuse3
import pytest
import trio

from nvmeof_fuse.fs import mount, pyfuse3_server
from nvmeof_fuse.fs.mount import MountError, check_fuse_server
from nvmeof_fuse.fs.mount_options import MountOptions
from nvmeof_fuse.fs.operations import NamespaceFS
from nvmeof_fuse.fs.pyfuse3_server import (
    Pyfuse3MountError,
    Pyfuse3Operations,
    Pyfuse3Server,
    entry_attributes,
    file_info,
    statvfs_data,
)
from nvmeof_fuse.fs.wire import ROOT_INODE, EntryAttributes, FileInfo, FUSEError, StatvfsData

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fakes import make_controller  # noqa: E402


@pytest.fixture
def ops():
    ctrl = make_controller((1, 512, 64), (7, 4096, 4))
    ctrl.namespaces[7].device.data[:] = bytes(range(256)) * 64
    return Pyfuse3Operations(NamespaceFS(ctrl, MountOptions(uid=1000, gid=100, mode=0o600)))


def call(fn, *args):
    return trio.run(fn, *args)


def test_attributes_keep_every_field():
    attr = EntryAttributes(st_ino=5, generation=2, entry_timeout=1.5, attr_timeout=0.25,
                           st_mode=0o100600, st_nlink=1, st_uid=7, st_gid=8, st_rdev=3,
                           st_size=1 << 40, st_blksize=4096, st_blocks=99, st_atime_ns=1,
                           st_mtime_ns=2 * 10**9 + 3, st_ctime_ns=4)
    got = entry_attributes(attr)
    assert isinstance(got, pyfuse3.EntryAttributes)
    for name in attr.__slots__:
        assert getattr(got, name) == getattr(attr, name), name


def test_file_info_and_statfs():
    fi = file_info(FileInfo(fh=9, direct_io=True, keep_cache=False,
                            parallel_direct_writes=True))
    assert (fi.fh, fi.direct_io, fi.keep_cache, fi.nonseekable) == (9, True, False, False)
    s = statvfs_data(StatvfsData(f_bsize=4096, f_frsize=4096, f_blocks=10, f_files=3,
                                 f_namemax=255))
    assert (s.f_bsize, s.f_blocks, s.f_files, s.f_namemax) == (4096, 10, 3, 255)


def test_lookup_open_read_through_the_operations(ops):
    n7 = call(ops.lookup, ROOT_INODE, b"n7", None)
    assert isinstance(n7, pyfuse3.EntryAttributes)
    assert (n7.st_size, n7.st_mode & 0o777, n7.st_uid) == (4 * 4096, 0o600, 1000)
    assert call(ops.getattr, n7.st_ino, None).st_ino == n7.st_ino
    fi = call(ops.open, n7.st_ino, os.O_RDONLY | os.O_DIRECT, None)
    assert isinstance(fi, pyfuse3.FileInfo) and fi.direct_io
    assert bytes(call(ops.read, fi.fh, 4096 + 3, 5)) == bytes(range(3, 8))
    call(ops.release, fi.fh)
    assert call(ops.statfs, None).f_namemax == 255


def test_errors_become_pyfuse3_errnos(ops, caplog):
    with pytest.raises(pyfuse3.FUSEError) as e:
        call(ops.lookup, ROOT_INODE, b"n2", None)
    assert e.value.errno == errno.ENOENT
    with pytest.raises(pyfuse3.FUSEError) as e:
        call(ops.mkdir, ROOT_INODE, b"d", 0o755, None)  # the tree is fixed
    assert e.value.errno == errno.EPERM
    with pytest.raises(pyfuse3.FUSEError) as e:  # unexpected: EIO, logged (not out of main)
        with caplog.at_level(logging.ERROR):
            call(ops.read, 12345, 0, 4096)  # no such handle
    assert e.value.errno == errno.EIO and "read of 4096 bytes at 0 failed" in caplog.text


def test_a_failed_write_answers_its_errno(ops):
    n1 = call(ops.lookup, ROOT_INODE, b"n1", None)
    fh = call(ops.open, n1.st_ino, os.O_WRONLY, None).fh
    with pytest.raises(pyfuse3.FUSEError) as e:
        call(ops.write, fh, n1.st_size, b"x")
    assert e.value.errno == errno.ENOSPC
    assert call(ops.write, fh, 512, b"abc") == 3


def test_one_mount_per_process(monkeypatch, ops):
    monkeypatch.setattr(pyfuse3_server, "_serving", True)
    with pytest.raises(Pyfuse3MountError, match="one mount per process"):
        Pyfuse3Server(ops.fs, "/nonexistent", [], 32)


def test_unknown_server_and_missing_pyfuse3_are_one_line(monkeypatch):
    with pytest.raises(MountError, match=r"unknown FUSE server 'fusepy' \(known: builtin, "):
        check_fuse_server("fusepy")
    assert check_fuse_server("builtin") is None
    assert check_fuse_server("pyfuse3") is pyfuse3_server
    monkeypatch.setitem(sys.modules, "pyfuse3", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "nvmeof_fuse.fs.pyfuse3_server")
    monkeypatch.delattr(sys.modules["nvmeof_fuse.fs"], "pyfuse3_server")
    with pytest.raises(MountError) as e:
        check_fuse_server("pyfuse3")
    message = str(e.value)
    assert message.startswith("fuse=pyfuse3 needs pyfuse3, which cannot be imported (")
    assert "pip install 'nvmeof-fuse[pyfuse3]'" in message and "\n" not in message


def test_serve_refuses_a_missing_server_before_mounting(monkeypatch, tmp_path):
    def missing(name: str) -> None:
        raise MountError(f"no {name}")

    monkeypatch.setattr(mount, "check_fuse_server", missing)
    ctrl = make_controller((1, 512, 64))
    with pytest.raises(MountError, match="no pyfuse3"):
        trio.run(mount.serve, ctrl, str(tmp_path), MountOptions(fuse="pyfuse3"))
    assert not os.path.ismount(tmp_path)


def test_a_wire_error_keeps_its_errno():
    err = pyfuse3_server._failure(FUSEError(errno.EROFS), "write")
    assert isinstance(err, pyfuse3.FUSEError) and err.errno == errno.EROFS
