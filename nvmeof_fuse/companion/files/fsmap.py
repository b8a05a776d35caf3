"""Where a file's bytes lie on a mounted namespace: the ioctls and sysfs of that chain.

A regular file -> its filesystem (``st_dev``, ``/proc/self/mountinfo``) -> a loop
device, or a partition of one (``/sys/class/block/<part>/start``) -> the loop's
backing file (``/sys/block/loopN/loop/backing_file`` and ``offset``), which must be a
namespace file of an nvmeof-fuse mount.  :func:`resolve` walks it once;
:func:`fiemap` maps a byte range with FS_IOC_FIEMAP (the structures are
:mod:`.fiemap`'s, which does no I/O).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from dataclasses import dataclass

from ..protocol import CompanionError
from . import fiemap as fm

DIRECT_FILESYSTEMS = ("ext4", "xfs")
"""Filesystems whose FIEMAP this reads from the device; others' files go to the kernel."""
EXTENTS_PER_CALL = 256
FS_IOC_GETFLAGS = 0x80086601  # _IOR('f', 1, long); the kernel reads and writes an int
FS_JOURNAL_DATA_FL = 0x4000
SYSFS = "/sys"


@dataclass(frozen=True)
class Chain:
    """How a file reaches a namespace: its filesystem, loop device and the byte offset of
    the filesystem's device in the namespace file."""

    path: str
    fstype: str
    device: str  # the filesystem's block device, e.g. loop0p1
    loop: str  # loop0
    namespace: str  # MOUNTPOINT/nN, the loop's backing file
    offset: int  # of the filesystem's device in the namespace, bytes
    limit: int  # bytes of the namespace the device may use from offset (0: to the end)
    sector: int  # the device's logical block size
    direct_io: bool  # the loop reads its backing file with O_DIRECT


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().strip()


def mount_of(dev: int, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str, str]:
    """``(fstype, source, mountpoint)`` of the filesystem whose ``st_dev`` is ``dev``."""
    fields, sep = _mount_line(dev, mountinfo)
    if not fields:
        return "", "", ""
    return fields[sep + 1], fields[sep + 2], _unescape(fields[4])


def journals_data(fd: int, dev: int, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether ext4 writes the open file's data to its journal first (``data=journal`` for
    the mount, or ``chattr +j`` for the file): the blocks FIEMAP names may then hold an
    older version until the journal is checkpointed, however clean the extent's flags."""
    flags = bytearray(8)
    try:
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags)
    except OSError:
        pass
    else:
        if int.from_bytes(flags[:4], "little") & FS_JOURNAL_DATA_FL:
            return True
    fields, sep = _mount_line(dev, mountinfo)
    return bool(fields) and "data=journal" in fields[sep + 3].split(",")


def _mount_line(dev: int, mountinfo: str) -> tuple[list[str], int]:
    """The fields of ``dev``'s line of ``mountinfo`` and the index of its ``-``."""
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    with open(mountinfo, encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 10 or fields[2] != wanted:
                continue
            return fields, fields.index("-", 6)
    return [], 0


def _unescape(field: str) -> str:
    """A mountinfo path, with its octal escapes (``\\040`` for a space) undone."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def is_namespace_file(path: str) -> bool:
    """Whether ``path`` looks like ``MOUNTPOINT/nN`` of an nvmeof-fuse mount."""
    return (re.fullmatch(r"n\d+", os.path.basename(path)) is not None
            and os.path.exists(os.path.join(os.path.dirname(path), ".nvmeof",
                                            "companion.json")))


def resolve(path: str, st: os.stat_result | None = None) -> Chain:
    """The chain from the regular file ``path`` to a namespace file, or a one-line
    :class:`CompanionError` naming where it breaks."""
    if st is None:
        st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CompanionError(f"{path} is not a regular file", errno.EINVAL)
    fstype, source, mountpoint = mount_of(st.st_dev)
    if fstype in ("tmpfs", "ramfs", "proc", "sysfs", "overlay", "9p", "nfs", "nfs4"):
        raise CompanionError(f"{path} is on {fstype} ({mountpoint}), not on a filesystem "
                             "on a namespace of an nvmeof-fuse mount", errno.ENODEV)
    dev = st.st_dev
    if os.major(dev) == 0 and source.startswith("/dev/"):  # btrfs and others: anonymous
        try:
            dev = os.stat(source).st_rdev
        except OSError:
            pass
    what = fstype or "an unknown filesystem"
    name = _block_name(dev)
    if name is None:
        raise CompanionError(f"{path} is on {what} on device {os.major(dev)}:{os.minor(dev)}"
                             ", which is not a block device", errno.ENODEV)
    block = os.path.join(SYSFS, "class", "block", name)
    start = 0
    loop = name
    if os.path.exists(os.path.join(block, "partition")):
        start = int(_read(os.path.join(block, "start"))) * 512
        loop = os.path.basename(os.path.dirname(os.path.realpath(block)))
    backing_path = os.path.join(SYSFS, "block", loop, "loop", "backing_file")
    if not re.fullmatch(r"loop\d+", loop) or not os.path.exists(backing_path):
        raise CompanionError(f"{path} is on {what} on /dev/{name}, not on a loop device over "
                             "a namespace of an nvmeof-fuse mount", errno.ENODEV)
    backing = _read(backing_path).removesuffix(" (deleted)")
    if not is_namespace_file(backing):
        raise CompanionError(f"{path} is on {what} on /dev/{name}, a loop device over "
                             f"{backing}, not a namespace of an nvmeof-fuse mount",
                             errno.ENODEV)
    loop_dir = os.path.join(SYSFS, "block", loop, "loop")
    offset = int(_read(os.path.join(loop_dir, "offset")))
    limit = int(_read(os.path.join(loop_dir, "sizelimit")))
    dio_path = os.path.join(loop_dir, "dio")
    dio = os.path.exists(dio_path) and _read(dio_path) == "1"
    size = int(_read(os.path.join(block, "size"))) * 512
    sector = int(_read(os.path.join(SYSFS, "block", loop, "queue", "logical_block_size")))
    return Chain(path, fstype, name, loop, backing, offset + start,
                 size if start or limit else 0, sector, dio)


def _block_name(dev: int) -> str | None:
    link = os.path.join(SYSFS, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}")
    try:
        return os.path.basename(os.path.realpath(link, strict=True))
    except OSError:
        return None


def fiemap(fd: int, start: int, length: int, flags: int = fm.FIEMAP_FLAG_SYNC,
           per_call: int = EXTENTS_PER_CALL) -> list[fm.Extent]:
    """Every extent of ``[start, start+length)`` of the open file ``fd``; ``flags``
    (``FIEMAP_FLAG_SYNC`` by default) apply to the first call only."""
    extents: list[fm.Extent] = []
    at, end = start, start + length
    while at < end:
        buf = fm.encode_request(at, end - at, per_call, flags)
        fcntl.ioctl(fd, fm.FS_IOC_FIEMAP, buf)
        got = fm.parse_reply(buf)
        extents.extend(got)
        following = fm.more_after(got, per_call)
        if following is None:
            break
        if following <= at:  # stopping here would read the rest of the range as a hole
            raise fm.FiemapError(f"FIEMAP reply of {per_call} extents from {at} ends at "
                                 f"{following}, not past its start")
        at, flags = following, flags & ~fm.FIEMAP_FLAG_SYNC
    return extents
