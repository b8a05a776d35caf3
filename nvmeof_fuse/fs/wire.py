"""The FUSE kernel protocol (``include/uapi/linux/fuse.h``), sans I/O: bytes in, bytes out.

Parses what the kernel sends on ``/dev/fuse`` (a ``fuse_in_header`` and the arguments of
the opcodes we serve) and encodes the replies and notifications we send back.  Also the
small types the filesystem layer answers with (:class:`EntryAttributes`, :class:`FileInfo`,
:class:`StatvfsData`, :class:`FUSEError`).  Nothing here reads or writes a file descriptor.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

ROOT_INODE = 1
KERNEL_VERSION = 7
KERNEL_MINOR = 38  # the header this is written against (Linux 6.2+); older kernels get theirs
OLDEST_MINOR = 23  # init_out's full layout (max_pages came with 28: sent only with the flag)

# opcodes (enum fuse_opcode)
LOOKUP, FORGET, GETATTR, SETATTR = 1, 2, 3, 4
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK = 8, 9, 10, 11, 12, 13
SYMLINK = 6
OPEN, READ, WRITE, STATFS, RELEASE = 14, 15, 16, 17, 18
FSYNC, FLUSH, INIT = 20, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR = 27, 28, 29, 30
ACCESS, CREATE, INTERRUPT, DESTROY = 34, 35, 36, 38
BATCH_FORGET, RENAME2 = 42, 45
NO_REPLY = frozenset({FORGET, BATCH_FORGET, INTERRUPT})  # the kernel expects no answer
TREE_CHANGES = {MKNOD: "mknod", MKDIR: "mkdir", UNLINK: "unlink", RMDIR: "rmdir",
                RENAME: "rename", RENAME2: "rename", LINK: "link", SYMLINK: "symlink",
                CREATE: "create"}
_OPCODE_NAMES = {
    LOOKUP: "LOOKUP", FORGET: "FORGET", GETATTR: "GETATTR", SETATTR: "SETATTR",
    SYMLINK: "SYMLINK", MKNOD: "MKNOD", MKDIR: "MKDIR", UNLINK: "UNLINK", RMDIR: "RMDIR",
    RENAME: "RENAME", LINK: "LINK", OPEN: "OPEN", READ: "READ", WRITE: "WRITE",
    STATFS: "STATFS", RELEASE: "RELEASE", FSYNC: "FSYNC", FLUSH: "FLUSH", INIT: "INIT",
    OPENDIR: "OPENDIR", READDIR: "READDIR", RELEASEDIR: "RELEASEDIR", FSYNCDIR: "FSYNCDIR",
    ACCESS: "ACCESS", CREATE: "CREATE", INTERRUPT: "INTERRUPT", DESTROY: "DESTROY",
    BATCH_FORGET: "BATCH_FORGET", RENAME2: "RENAME2",
    # those we never serve, named for the counts (enum fuse_opcode)
    5: "READLINK", 21: "SETXATTR", 22: "GETXATTR", 23: "LISTXATTR", 24: "REMOVEXATTR",
    37: "BMAP", 39: "IOCTL", 40: "POLL", 41: "NOTIFY_REPLY", 43: "FALLOCATE",
    44: "READDIRPLUS", 46: "LSEEK", 47: "COPY_FILE_RANGE", 48: "SETUPMAPPING",
    49: "REMOVEMAPPING", 50: "SYNCFS", 51: "TMPFILE", 52: "STATX"}


def opcode_name(opcode: int) -> str:
    """``GETATTR`` for 3: what a count of requests by opcode is shown under."""
    return _OPCODE_NAMES.get(opcode) or f"opcode {opcode}"


# notification codes (enum fuse_notify_code), sent as the error of a unique-0 reply
NOTIFY_INVAL_INODE, NOTIFY_INVAL_ENTRY = 2, 3

# INIT flags
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
ASYNC_DIO = 1 << 15
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
# What we ask for, as libfuse 3 negotiates by default for a filesystem with our operations
# (O_TRUNC reaches open: see fs/operations.py), plus max_pages for 1 MiB requests.
WANTED_FLAGS = (ASYNC_READ | ATOMIC_O_TRUNC | BIG_WRITES | AUTO_INVAL_DATA | ASYNC_DIO
                | PARALLEL_DIROPS | MAX_PAGES)

# open_out flags
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_PARALLEL_DIRECT_WRITES = 1 << 6

# setattr_in.valid bits
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FATTR_ATIME, FATTR_MTIME, FATTR_FH = 1 << 4, 1 << 5, 1 << 6
FATTR_ATIME_NOW, FATTR_MTIME_NOW, FATTR_CTIME = 1 << 7, 1 << 8, 1 << 10

FSYNC_FDATASYNC = 1 << 0

PAGE = 4096

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
IN_HEADER_SIZE = IN_HEADER.size  # 40
OUT_HEADER_SIZE = OUT_HEADER.size  # 16
READ_IN = struct.Struct("<QQII")  # fh offset size read_flags (lock_owner, flags follow)
WRITE_IN = struct.Struct("<QQII")  # fh offset size write_flags (lock_owner, flags follow)
WRITE_IN_SIZE = 40
WRITE_HEADERS = IN_HEADER_SIZE + WRITE_IN_SIZE  # where a WRITE's data starts (80)
WRITE_OUT = struct.Struct("<II")
WRITE_REPLY = struct.Struct("<IiQII")  # fuse_out_header + fuse_write_out, packed at once
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr, 88 bytes
ENTRY_OUT = struct.Struct("<QQQQII")  # + fuse_attr
ATTR_OUT = struct.Struct("<QII")  # + fuse_attr
OPEN_IN = struct.Struct("<II")
OPEN_OUT = struct.Struct("<QII")
GETATTR_IN = struct.Struct("<IIQ")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
RELEASE_IN = struct.Struct("<QIIQ")
FLUSH_IN = struct.Struct("<QIIQ")
FSYNC_IN = struct.Struct("<QII")
INIT_IN = struct.Struct("<IIII")  # major minor max_readahead flags (flags2 and more follow)
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")  # 64 bytes
KSTATFS = struct.Struct("<QQQQQIIII24x")  # 80 bytes
DIRENT = struct.Struct("<QQII")  # ino off namelen type, then the name, padded to 8
INVAL_INODE_OUT = struct.Struct("<Qqq")
INVAL_ENTRY_OUT = struct.Struct("<QII")


class ProtocolError(Exception):
    """The kernel sent something this module cannot parse."""


class FUSEError(Exception):
    """Answer the request with this errno."""

    def __init__(self, errno_: int) -> None:
        super().__init__(errno_)
        self.errno = errno_

    def __str__(self) -> str:
        import os

        return os.strerror(self.errno)


@dataclass(slots=True)
class EntryAttributes:
    """A node's attributes and how long the kernel may cache them (fuse_entry_out)."""

    st_ino: int = 0
    generation: int = 0
    entry_timeout: float = 0.0
    attr_timeout: float = 0.0
    st_mode: int = 0
    st_nlink: int = 0
    st_uid: int = 0
    st_gid: int = 0
    st_rdev: int = 0
    st_size: int = 0
    st_blksize: int = 0
    st_blocks: int = 0
    st_atime_ns: int = 0
    st_mtime_ns: int = 0
    st_ctime_ns: int = 0


@dataclass(slots=True)
class FileInfo:
    """An open file: its handle and how the kernel treats it (fuse_open_out)."""

    fh: int = 0
    direct_io: bool = False
    keep_cache: bool = False
    nonseekable: bool = False
    parallel_direct_writes: bool = False  # the kernel may send O_DIRECT writes concurrently

    @property
    def open_flags(self) -> int:
        return ((FOPEN_DIRECT_IO if self.direct_io else 0)
                | (FOPEN_KEEP_CACHE if self.keep_cache else 0)
                | (FOPEN_NONSEEKABLE if self.nonseekable else 0)
                | (FOPEN_PARALLEL_DIRECT_WRITES if self.parallel_direct_writes else 0))


@dataclass(slots=True)
class StatvfsData:
    f_bsize: int = 0
    f_frsize: int = 0
    f_blocks: int = 0
    f_bfree: int = 0
    f_bavail: int = 0
    f_files: int = 0
    f_ffree: int = 0
    f_namemax: int = 0


@dataclass(slots=True)
class SetattrFields:
    """Which attributes a SETATTR changes (the kernel's ``valid`` bits)."""

    update_atime: bool = False
    update_mtime: bool = False
    update_ctime: bool = False
    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_size: bool = False


@dataclass(slots=True)
class RequestContext:
    uid: int
    gid: int
    pid: int
    umask: int = 0


# -- requests -------------------------------------------------------------------------------

@dataclass(slots=True)
class Header:
    length: int
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int

    @property
    def ctx(self) -> RequestContext:
        return RequestContext(self.uid, self.gid, self.pid)


def parse_header(buf: bytes | bytearray | memoryview) -> Header:
    if len(buf) < IN_HEADER_SIZE:
        raise ProtocolError(f"a request of {len(buf)} bytes is shorter than its header")
    length, opcode, unique, nodeid, uid, gid, pid, _, _ = IN_HEADER.unpack_from(buf)
    return Header(length, opcode, unique, nodeid, uid, gid, pid)


def _args(buf: bytes | bytearray | memoryview, fmt: struct.Struct, opcode: int) -> tuple:
    if len(buf) < IN_HEADER_SIZE + fmt.size:
        raise ProtocolError(f"opcode {opcode}: {len(buf)} bytes, too short for its arguments")
    return fmt.unpack_from(buf, IN_HEADER_SIZE)


def parse_name(buf: bytes | bytearray | memoryview, offset: int = IN_HEADER_SIZE) -> bytes:
    """The NUL-terminated name after the header (LOOKUP)."""
    name = bytes(buf[offset:])
    end = name.find(b"\0")
    if end < 0:
        raise ProtocolError("a name without its terminating NUL")
    return name[:end]


def parse_fh(buf: bytes | bytearray | memoryview, opcode: int) -> int:
    """The ``fh`` that RELEASE, FLUSH, FSYNC, READDIR and RELEASEDIR start with."""
    return _args(buf, RELEASE_IN if opcode in (RELEASE, RELEASEDIR) else FSYNC_IN, opcode)[0]


def parse_open(buf: bytes | bytearray | memoryview) -> int:
    """The open(2) flags of OPEN or OPENDIR."""
    return _args(buf, OPEN_IN, OPEN)[0]


def parse_fsync(buf: bytes | bytearray | memoryview) -> tuple[int, bool]:
    """(fh, datasync) of FSYNC."""
    fh, flags, _ = _args(buf, FSYNC_IN, FSYNC)
    return fh, bool(flags & FSYNC_FDATASYNC)


def parse_read(buf: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """(fh, offset, size) of READ or READDIR."""
    fh, offset, size, _ = _args(buf, READ_IN, READ)
    return fh, offset, size


def parse_setattr(buf: bytes | bytearray | memoryview
                  ) -> tuple[EntryAttributes, SetattrFields, int | None]:
    """(new attributes, which of them change, fh or None) of SETATTR."""
    (valid, _, fh, size, _, atime, mtime, ctime, atimens, mtimens, ctimens, mode, _, uid, gid,
     _) = _args(buf, SETATTR_IN, SETATTR)
    attr = EntryAttributes(st_mode=mode, st_uid=uid, st_gid=gid, st_size=size,
                           st_atime_ns=atime * 10**9 + atimens,
                           st_mtime_ns=mtime * 10**9 + mtimens,
                           st_ctime_ns=ctime * 10**9 + ctimens)
    fields = SetattrFields(
        update_atime=bool(valid & (FATTR_ATIME | FATTR_ATIME_NOW)),
        update_mtime=bool(valid & (FATTR_MTIME | FATTR_MTIME_NOW)),
        update_ctime=bool(valid & FATTR_CTIME),
        update_mode=bool(valid & FATTR_MODE), update_uid=bool(valid & FATTR_UID),
        update_gid=bool(valid & FATTR_GID), update_size=bool(valid & FATTR_SIZE))
    return attr, fields, fh if valid & FATTR_FH else None


# -- INIT -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class InitParams:
    """What we tell the kernel at INIT."""

    max_write: int = 1 << 20
    max_background: int = 32
    flags: int = WANTED_FLAGS

    @property
    def max_pages(self) -> int:
        return (self.max_write + PAGE - 1) // PAGE


@dataclass(frozen=True)
class Negotiated:
    major: int
    minor: int
    flags: int  # granted: what both sides support


def negotiate(buf: bytes | bytearray | memoryview, params: InitParams) -> tuple[Negotiated, bytes]:
    """The outcome of the kernel's INIT and our reply's body (fuse_init_out).

    Raises ProtocolError for a kernel older than 7.23 or with another major version.
    """
    major, minor, max_readahead, kernel_flags = _args(buf, INIT_IN, INIT)
    if major != KERNEL_VERSION or minor < OLDEST_MINOR:
        raise ProtocolError(f"the kernel speaks FUSE {major}.{minor}; we need "
                            f"{KERNEL_VERSION}.{OLDEST_MINOR} or newer")
    minor = min(minor, KERNEL_MINOR)
    flags = params.flags & kernel_flags
    max_write = params.max_write if flags & MAX_PAGES else min(params.max_write, 32 * PAGE)
    body = INIT_OUT.pack(KERNEL_VERSION, minor, max_readahead, flags, params.max_background,
                         params.max_background * 3 // 4, max_write, 1,
                         params.max_pages if flags & MAX_PAGES else 0, 0, 0)
    return Negotiated(major, minor, flags), body


# -- replies ----------------------------------------------------------------------------------

def out_header(unique: int, body_len: int, error: int = 0) -> bytes:
    """fuse_out_header for a reply of ``body_len`` bytes (``error`` a positive errno)."""
    return OUT_HEADER.pack(OUT_HEADER_SIZE + body_len, -error, unique)


def reply(unique: int, body: bytes) -> bytes:
    """A whole reply: its fuse_out_header, then ``body``."""
    return OUT_HEADER.pack(OUT_HEADER_SIZE + len(body), 0, unique) + body


def error_reply(unique: int, error: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER_SIZE, -error, unique)


def empty_reply(unique: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER_SIZE, 0, unique)


def _split(timeout: float) -> tuple[int, int]:
    if timeout <= 0:
        return 0, 0
    sec = int(timeout)
    return sec, int((timeout - sec) * 1e9)


def _ns(t: int) -> tuple[int, int]:
    return t // 10**9, t % 10**9


def pack_attr(a: EntryAttributes) -> bytes:
    (at, atn), (mt, mtn), (ct, ctn) = _ns(a.st_atime_ns), _ns(a.st_mtime_ns), _ns(a.st_ctime_ns)
    return ATTR.pack(a.st_ino, a.st_size, a.st_blocks, at, mt, ct, atn, mtn, ctn, a.st_mode,
                     a.st_nlink, a.st_uid, a.st_gid, a.st_rdev, a.st_blksize, 0)


def entry_reply(unique: int, a: EntryAttributes) -> bytes:
    """LOOKUP's reply: fuse_entry_out."""
    es, ens = _split(a.entry_timeout)
    ts, tns = _split(a.attr_timeout)
    body = ENTRY_OUT.pack(a.st_ino, a.generation, es, ts, ens, tns) + pack_attr(a)
    return reply(unique, body)


def attr_reply(unique: int, a: EntryAttributes) -> bytes:
    """GETATTR's and SETATTR's reply: fuse_attr_out."""
    ts, tns = _split(a.attr_timeout)
    body = ATTR_OUT.pack(ts, tns, 0) + pack_attr(a)
    return reply(unique, body)


def open_reply(unique: int, fh: int, open_flags: int = 0) -> bytes:
    """OPEN's and OPENDIR's reply: fuse_open_out."""
    return out_header(unique, OPEN_OUT.size) + OPEN_OUT.pack(fh, open_flags, 0)


def write_reply(unique: int, size: int) -> bytes:
    return WRITE_REPLY.pack(WRITE_REPLY.size, 0, unique, size, 0)


def statfs_reply(unique: int, s: StatvfsData) -> bytes:
    body = KSTATFS.pack(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize,
                        s.f_namemax, s.f_frsize or s.f_bsize, 0)
    return reply(unique, body)


class DirBuffer:
    """READDIR's reply body: fuse_dirent records up to the size the kernel asked for."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.parts: list[bytes] = []
        self.used = 0

    def add(self, name: bytes, attr: EntryAttributes, next_id: int) -> bool:
        """Add an entry (``next_id``: the offset that resumes after it); False when full."""
        record = DIRENT.size + len(name)
        padded = (record + 7) & ~7
        if self.used + padded > self.size:
            return False
        dtype = (attr.st_mode >> 12) & 0o17  # S_IFMT >> 12 is the d_type
        self.parts.append(DIRENT.pack(attr.st_ino, next_id, len(name), dtype) + name
                          + b"\0" * (padded - record))
        self.used += padded
        return True

    def reply(self, unique: int) -> bytes:
        return out_header(unique, self.used) + b"".join(self.parts)


# -- notifications ----------------------------------------------------------------------------

def inval_inode(inode: int, offset: int = 0, length: int = 0) -> bytes:
    """FUSE_NOTIFY_INVAL_INODE: drop the attributes of ``inode`` and its cached pages from
    ``offset`` (``length`` 0: to the end; ``offset`` -1: attributes only)."""
    body = INVAL_INODE_OUT.pack(inode, offset, length)
    return OUT_HEADER.pack(OUT_HEADER_SIZE + len(body), NOTIFY_INVAL_INODE, 0) + body


def inval_entry(parent: int, name: bytes) -> bytes:
    """FUSE_NOTIFY_INVAL_ENTRY: forget the name ``name`` in directory ``parent``."""
    body = INVAL_ENTRY_OUT.pack(parent, len(name), 0) + name + b"\0"
    return OUT_HEADER.pack(OUT_HEADER_SIZE + len(body), NOTIFY_INVAL_ENTRY, 0) + body
