"""The FUSE protocol encoder/parser against hand-built bytes (include/uapi/linux/fuse.h)."""

import struct

import pytest

from nvmeof_fuse.fs import wire
from nvmeof_fuse.fs.wire import EntryAttributes, ProtocolError


def header(opcode, length_of_args, unique=7, nodeid=1, uid=1000, gid=100, pid=42):
    return struct.pack("<IIQQIIIHH", 40 + length_of_args, opcode, unique, nodeid, uid, gid, pid,
                       0, 0)


def init_request(major=7, minor=41, max_readahead=131072, flags=0xFFFFFFFF):
    args = struct.pack("<IIII", major, minor, max_readahead, flags) + bytes(48)
    return header(wire.INIT, len(args)) + args


def test_header():
    h = wire.parse_header(header(wire.GETATTR, 16, unique=99, nodeid=5) + bytes(16))
    assert (h.length, h.opcode, h.unique, h.nodeid) == (56, 3, 99, 5)
    assert (h.ctx.uid, h.ctx.gid, h.ctx.pid) == (1000, 100, 42)
    with pytest.raises(ProtocolError, match="^a request of 8 bytes is shorter than its header$"):
        wire.parse_header(bytes(8))


def test_init_negotiates_1_mib_requests_and_32_in_the_background():
    got, body = wire.negotiate(init_request(), wire.InitParams(max_write=1 << 20,
                                                               max_background=32))
    assert len(body) == 64
    (major, minor, readahead, flags, background, congestion, max_write, time_gran, max_pages,
     _, _) = struct.unpack("<IIIIHHIIHHI28x", body)
    assert (major, minor, readahead) == (7, 38, 131072)  # our header's minor; its readahead
    assert flags == wire.WANTED_FLAGS == got.flags
    assert flags & wire.ATOMIC_O_TRUNC and flags & wire.ASYNC_READ and flags & wire.ASYNC_DIO
    assert (background, congestion, max_write, time_gran, max_pages) == (32, 24, 1 << 20, 1, 256)


def test_init_takes_only_what_the_kernel_offers():
    got, body = wire.negotiate(init_request(minor=31, flags=wire.ASYNC_READ), wire.InitParams())
    assert got.minor == 31 and got.flags == wire.ASYNC_READ
    max_write, max_pages = struct.unpack_from("<I4xH", body, 20)
    assert (max_write, max_pages) == (128 * 1024, 0)  # no FUSE_MAX_PAGES: 32 pages at most


def test_init_refuses_an_old_or_foreign_kernel():
    with pytest.raises(ProtocolError, match=r"^the kernel speaks FUSE 7\.19; we need 7\.23 "):
        wire.negotiate(init_request(minor=19), wire.InitParams())
    with pytest.raises(ProtocolError, match=r"^the kernel speaks FUSE 8\.0;"):
        wire.negotiate(init_request(major=8, minor=0), wire.InitParams())
    with pytest.raises(ProtocolError, match="too short for its arguments$"):
        wire.negotiate(header(wire.INIT, 4) + bytes(4), wire.InitParams())


def test_lookup_name_and_entry_reply():
    req = header(wire.LOOKUP, 3) + b"n1\0"
    assert wire.parse_name(req) == b"n1"
    with pytest.raises(ProtocolError, match="NUL"):
        wire.parse_name(header(wire.LOOKUP, 2) + b"n1")
    a = EntryAttributes(st_ino=8, entry_timeout=60.0, attr_timeout=1.5, st_mode=0o100640,
                        st_nlink=1, st_uid=1000, st_gid=100, st_size=4 << 20, st_blksize=512,
                        st_blocks=8192, st_atime_ns=5 * 10**9 + 7, st_mtime_ns=6 * 10**9,
                        st_ctime_ns=7 * 10**9 + 9)
    out = wire.entry_reply(99, a)
    assert struct.unpack_from("<IiQ", out) == (16 + 128, 0, 99)
    assert struct.unpack_from("<QQQQII", out, 16) == (8, 0, 60, 1, 0, 500_000_000)
    assert struct.unpack_from("<QQQQQQIIIIIIIIII", out, 56) == (
        8, 4 << 20, 8192, 5, 6, 7, 7, 0, 9, 0o100640, 1, 1000, 100, 0, 512, 0)


def test_attr_reply():
    out = wire.attr_reply(3, EntryAttributes(st_ino=1, attr_timeout=60.0, st_mode=0o40555))
    assert len(out) == 16 + 16 + 88
    assert struct.unpack_from("<QII", out, 16) == (60, 0, 0)
    assert struct.unpack_from("<Q", out, 32) == (1,)


def test_read_and_write_args():
    args = struct.pack("<QQIIQII", 5, 1 << 30, 4096, 0, 0, 0, 0)
    assert wire.parse_read(header(wire.READ, 40) + args) == (5, 1 << 30, 4096)
    assert wire.WRITE_HEADERS == 80
    assert wire.write_reply(7, 4096) == struct.pack("<IiQII", 24, 0, 7, 4096, 0)


def test_open_reply_flags():
    fi = wire.FileInfo(fh=3, direct_io=True, parallel_direct_writes=True)
    assert fi.open_flags == wire.FOPEN_DIRECT_IO | wire.FOPEN_PARALLEL_DIRECT_WRITES == 0x41
    assert wire.open_reply(9, fi.fh, fi.open_flags) == struct.pack("<IiQQII", 32, 0, 9, 3,
                                                                    0x41, 0)
    assert wire.FileInfo(fh=1, keep_cache=True).open_flags == wire.FOPEN_KEEP_CACHE
    assert wire.parse_open(header(wire.OPEN, 8) + struct.pack("<II", 0o40002, 0)) == 0o40002


def test_setattr_fields():
    args = struct.pack("<IIQQQQQQIIIIIIII", wire.FATTR_SIZE | wire.FATTR_MTIME | wire.FATTR_FH,
                       0, 4, 4096, 0, 0, 12, 0, 0, 5, 0, 0, 0, 0, 0, 0)
    attr, fields, fh = wire.parse_setattr(header(wire.SETATTR, len(args)) + args)
    assert fields.update_size and fields.update_mtime and not fields.update_mode
    assert (attr.st_size, attr.st_mtime_ns, fh) == (4096, 12 * 10**9 + 5, 4)
    args = struct.pack("<IIQQQQQQIIIIIIII", wire.FATTR_MODE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                       0o600, 0, 0, 0, 0)
    attr, fields, fh = wire.parse_setattr(header(wire.SETATTR, len(args)) + args)
    assert fields.update_mode and attr.st_mode == 0o600 and fh is None


def test_fh_args():
    release = header(wire.RELEASE, 24) + struct.pack("<QIIQ", 11, 0, 0, 0)
    assert wire.parse_fh(release, wire.RELEASE) == 11
    flush = header(wire.FLUSH, 24) + struct.pack("<QIIQ", 12, 0, 0, 0)
    assert wire.parse_fh(flush, wire.FLUSH) == 12
    fsync = header(wire.FSYNC, 16) + struct.pack("<QII", 13, wire.FSYNC_FDATASYNC, 0)
    assert wire.parse_fsync(fsync) == (13, True)


def test_errors_and_statfs():
    assert wire.error_reply(5, 2) == struct.pack("<IiQ", 16, -2, 5)
    assert wire.empty_reply(5) == struct.pack("<IiQ", 16, 0, 5)
    out = wire.statfs_reply(1, wire.StatvfsData(f_bsize=4096, f_blocks=10, f_files=3,
                                                f_namemax=255))
    assert len(out) == 16 + 80
    assert struct.unpack_from("<QQQQQIIII", out, 16) == (10, 0, 0, 3, 0, 4096, 255, 4096, 0)


def test_readdir_fills_up_to_the_size_asked():
    out = wire.DirBuffer(64)
    assert out.add(b"n1", EntryAttributes(st_ino=8, st_mode=0o100640), 1)
    assert out.add(b".nvmeof", EntryAttributes(st_ino=2, st_mode=0o40555), 2)
    assert not out.add(b"n2", EntryAttributes(st_ino=9, st_mode=0o100640), 3)  # 32+32+32 > 64
    body = out.reply(4)[16:]
    assert body == (struct.pack("<QQII", 8, 1, 2, 8) + b"n1" + bytes(6)
                    + struct.pack("<QQII", 2, 2, 7, 4) + b".nvmeof" + bytes(1))
    assert struct.unpack_from("<I", out.reply(4)) == (16 + 64,)


def test_notifications():
    assert wire.inval_inode(8, -1, 0) == struct.pack("<IiQQqq", 40, 2, 0, 8, -1, 0)
    assert wire.inval_entry(1, b"n2") == struct.pack("<IiQQII", 35, 3, 0, 1, 2, 0) + b"n2\0"


def test_opcodes_are_named_for_the_counts_and_an_unknown_one_by_its_number():
    assert wire.opcode_name(wire.GETATTR) == "GETATTR"
    assert wire.opcode_name(wire.SYMLINK) == "SYMLINK" and wire.opcode_name(39) == "IOCTL"
    assert wire.opcode_name(4096) == "opcode 4096"
