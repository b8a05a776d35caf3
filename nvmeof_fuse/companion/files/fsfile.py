"""``nvmeof_fuse.File`` on a regular file of an ext4 or xfs filesystem on a mounted namespace.

    with nvmeof_fuse.File("/mnt/ckpt/model.bin") as f:   # ext4 on a loop device over MNT/n2
        f.read(arr, file_offset=4096)
        print(f.placement["extents"])                    # "direct: 3 extents"

The file's byte range is mapped with FS_IOC_FIEMAP (its dirty pages written first,
``FIEMAP_FLAG_SYNC``), and each clean extent is read from the namespace by the
same paths as a namespace read (:class:`~nvmeof_fuse.File` on
the loop's backing file: the client's own queues, dma-bufs, staging).  Holes and unwritten extents
become zeros with no I/O; any other extent, and every file of a filesystem
other than ext4 or xfs, is read by the kernel (``os.preadv``).

Never stale: before the read the file's change time must lie in a clock tick
already past (a write in the same tick could not move it) and a write() under
way must have finished (:meth:`FilesystemFile._settled_stat`); after the data
landed, the mapping, ``st_ctime_ns``, ``st_size`` and the inode must be as they
were.  Otherwise the read runs again, ``retries`` times at most, then the kernel
reads the whole range.  Writes go through the kernel (``os.pwrite``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import stat
import sys
import time
from typing import Any

from ...errors import InvalidArgument
from ..client import shm
from ..client.file import File, warn_once
from ..client.future import IOFuture
from ..client.shared_bounce import CallerMemory
from ..cuda import gpu
from ..protocol import CompanionError
from . import fiemap as fm
from . import fsmap

log = logging.getLogger(__name__)

CHUNK = 8 << 20
"""Bytes of an extent one namespace read moves at most: a large extent spreads over the
client's queues."""
RETRIES = 3
ZEROS = bytes(1 << 20)
COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)
"""The clock file timestamps come from (Linux's CLOCK_REALTIME_COARSE; Python names it not)."""
_TICK_NS = time.clock_getres(COARSE) * 1e9


class FilesystemFile:
    """A regular file of an ext4 or xfs filesystem on a loop device over a namespace file
    of an nvmeof-fuse mount (a partition of one too).  Keyword options not named here go
    to the namespace's :class:`~nvmeof_fuse.File`."""

    def __init__(self, path: str, *, retries: int = RETRIES, chunk: int = CHUNK,
                 **options: Any) -> None:
        self.path = path
        st = os.stat(path)
        self.chain = fsmap.resolve(path, st)
        if chunk <= 0 or retries < 0:
            raise InvalidArgument(f"chunk must be positive and retries not negative, got "
                                  f"{chunk} and {retries}")
        self._retries = retries
        self._chunk = chunk
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._dev = st.st_dev
        self._write_fd = -1
        self._closed = False
        try:
            self.namespace = File(self.chain.namespace, **options)
        except BaseException:
            os.close(self._fd)
            raise
        self._kernel_only = ""
        if self.chain.fstype not in fsmap.DIRECT_FILESYSTEMS:
            self._kernel_only = (f"filesystem {self.chain.fstype or 'unknown'} is not "
                                 f"{' or '.join(fsmap.DIRECT_FILESYSTEMS)}")
            self._tell(self._kernel_only)
        self._extents = (f"kernel: {self._kernel_only}" if self._kernel_only
                         else "direct: no read yet")

    # -- what it is ----------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """The file's size now."""
        return os.fstat(self._fd).st_size

    @property
    def placement(self) -> dict[str, str]:
        """The namespace file's placement per kind of memory, and under ``extents`` how the
        last read went: ``direct: N extents``, ``staged: N extents (why)``, with
        ``; kernel: ... (why)`` for ranges the kernel read."""
        return {**self.namespace.placement, "extents": self._extents}

    def stats(self) -> dict:
        return self.namespace.stats()

    def __repr__(self) -> str:
        return (f"<nvmeof_fuse.File {self.path}: {self.chain.fstype} on /dev/"
                f"{self.chain.device} over {self.chain.namespace}>")

    def __enter__(self) -> FilesystemFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.namespace.close()
        finally:
            os.close(self._fd)
            if self._write_fd >= 0:
                os.close(self._write_fd)

    def _tell(self, why: str) -> None:
        warn_once(f"fsfile:{why}", f"nvmeof_fuse: {self.path}: the kernel reads "
                   f"{'this file' if why == self._kernel_only else 'part of it'}: {why}")

    # -- reads ---------------------------------------------------------------------------------

    def read(self, buf: Any, size: int | None = None, file_offset: int = 0,
             buf_offset: int = 0, *, stream: Any = None) -> int:
        """Read into ``buf``; the bytes read (short at the end of the file)."""
        return self.read_batch([(buf, size, file_offset)], buf_offset=buf_offset,
                               stream=stream)[0]

    def pread(self, buf: Any, size: int | None = None, file_offset: int = 0,
              buf_offset: int = 0, *, stream: Any = None) -> IOFuture:
        """:meth:`read`, done when it returns (the future holds its result)."""
        return IOFuture.finished(self.read(buf, size, file_offset, buf_offset,
                                           stream=stream))

    def pread_batch(self, requests: list[tuple[Any, int, int]]) -> list[IOFuture]:
        return [IOFuture.finished(n) for n in self.read_batch(requests)]

    def read_batch(self, requests: list[tuple[Any, int | None, int]], *, buf_offset: int = 0,
                   stream: Any = None) -> list[int]:
        """Many reads at once, ``[(buf, size, file_offset), ...]``: one sync and mapping for
        all of them, their extents started together; the bytes read by each."""
        if self._closed:
            raise CompanionError(f"{self.path} is closed", errno.EBADF)
        ns = self.namespace
        wanted = []
        for buf, size, file_offset in requests:
            mem = ns._memory(buf)
            size, file_offset, at = ns._span(mem, size, file_offset, buf_offset)
            wanted.append((mem, at, size, file_offset))
        if not wanted:
            return []
        handle = gpu.stream_handle(stream)
        why = self._kernel_only or self._journalled()
        for _attempt in range(self._retries + 1):
            if why:
                break
            before = self._settled_stat()
            if before is None:
                continue
            try:
                counts = self._direct_read(wanted, before, handle)
            except _Unmapped as exc:
                why = str(exc)
                break
            if counts is not None:
                return counts
        why = why or f"the file kept changing while read ({self._retries + 1} tries)"
        self._tell(why)
        self._extents = f"kernel: {why}"
        return [self._kernel_read(mem, at, size, file_offset, handle)
                for mem, at, size, file_offset in wanted]

    def _journalled(self) -> str:
        """Why the device's blocks may be older than the file ("" when they are not)."""
        if self.chain.fstype == "ext4" and fsmap.journals_data(self._fd, self._dev):
            return "ext4 journals the file's data (data=journal or chattr +j)"
        return ""

    def _settled_stat(self) -> os.stat_result | None:
        """The file's stat once its change time lies in a clock tick already past (waits a
        tick at most), after every write() under way then has finished; None if the file
        kept changing meanwhile.

        The clock is read before the stat: any write that starts after it sets a change
        time of at least that clock, later than the one seen.  A write under way holds the
        inode's lock, which ``lseek(SEEK_DATA)`` (ext4) and FIEMAP (xfs) take shared: its
        bytes are in the page cache before the sync that follows."""
        for _ in range(2):
            now = time.clock_gettime_ns(COARSE)
            st = os.fstat(self._fd)
            if now > st.st_ctime_ns:
                try:
                    os.lseek(self._fd, 0, os.SEEK_DATA)
                except OSError:  # no data at all (ENXIO): nothing to wait for
                    pass
                return st
            time.sleep(max(_TICK_NS, 1e6) / 1e9)
        return None

    def _direct_read(self, wanted: list, before: os.stat_result, stream: int | None
                     ) -> list[int] | None:
        """One try: map, read, check; the counts, or None if the file moved meanwhile."""
        size_now = before.st_size
        spans = [(mem, at, max(0, min(size, size_now - off)), off)
                 for mem, at, size, off in wanted]
        live = [span for span in spans if span[2]]
        if not live:
            return [0] * len(spans)
        low = min(off for _, _, _, off in live)
        high = max(off + n for _, _, n, off in live)
        extents = _mapping(self._fd, low, high - low)
        plans = [fm.plan_read(extents, off, n, self.chain.sector) for _, _, n, off in live]
        futures, device, kernel_why = [], 0, []
        shrank = False
        error: BaseException | None = None
        try:
            for (mem, at, _n, _off), pieces in zip(live, plans, strict=True):
                for piece in pieces:
                    if piece.kind == "device" and not self._inside(piece):
                        piece = fm.Piece("kernel", piece.at, piece.offset, piece.length,
                                         why="extent outside the loop device")
                    if piece.kind == "device":
                        device += 1
                        futures.extend(self._start_device(mem, at + piece.at, piece))
                    elif piece.kind == "zeros":
                        _zero(mem, at + piece.at, piece.length, stream)
                    else:
                        kernel_why.append(piece.why)
                        got = self._kernel_read(mem, at + piece.at, piece.length,
                                                piece.offset, stream)
                        shrank |= got != piece.length  # the file shrank under us
        except BaseException as exc:  # the reads already started are waited for below
            error = exc
        short = shrank
        for future, length in futures:  # every one ends before the buffer is used again
            try:
                short |= future.get() != length
            except BaseException as exc:  # raised once none is in flight
                error = error or exc
        if error is not None:
            raise error
        if short:
            return None
        if _mapping(self._fd, low, high - low, 0) != extents:
            return None  # moved (defragmented, reflinked, punched) while we read
        if not _same(before, os.fstat(self._fd)):
            return None  # written, truncated or replaced meanwhile
        self._note(mem_kind=self._kind(live[0][0]), device=device, kernel=kernel_why)
        return [n for _, _, n, _ in spans]

    def _inside(self, piece: fm.Piece) -> bool:
        chain = self.chain
        end = piece.physical + piece.length
        if chain.limit and end > chain.limit:
            return False
        return chain.offset + end <= self.namespace.nbytes

    def _start_device(self, mem: Any, at: int, piece: fm.Piece) -> list[tuple[IOFuture, int]]:
        """Reads of one extent's bytes from the namespace into ``mem`` at ``at``, in chunks."""
        ns = self.namespace
        base = self.chain.offset + piece.physical
        chunks = [(start, min(self._chunk, piece.length - start))
                  for start in range(0, piece.length, self._chunk)]
        flat = _flat_bytes(mem.owner) if mem.device is None else None
        if flat is not None:
            requests = [(flat[at + start:at + start + n], n, base + start)
                        for start, n in chunks]
            return list(zip(ns.pread_batch(requests), (n for _, n in chunks), strict=True))
        return [(ns.pread(mem.owner, n, base + start, at + start), n) for start, n in chunks]

    def _kind(self, mem: Any) -> str:
        if mem.device is not None:
            return "cuda"
        return "shared" if shm.find(mem.addr, 1) is not None else "host"

    def _note(self, mem_kind: str, device: int, kernel: list[str]) -> None:
        """``extents`` of :attr:`placement` after a read, and each kernel reason logged once."""
        how = self.namespace.placement.get(mem_kind, "")
        line = []
        if device:
            extents = f"{device} extent{'s' if device != 1 else ''}"
            line.append(f"direct: {extents}" if how.startswith("direct")
                        else f"staged: {extents} ({how.removeprefix('staged: ')})")
        reasons = sorted(set(kernel))
        for why in reasons:
            self._tell(why)
        if reasons:
            line.append(f"kernel: {len(kernel)} range{'s' if len(kernel) != 1 else ''} "
                        f"({'; '.join(reasons)})")
        self._extents = "; ".join(line) or "direct: 0 extents (holes only)"

    def _kernel_read(self, mem: Any, at: int, size: int, file_offset: int,
                     stream: int | None) -> int:
        """The kernel's read of ``size`` bytes at ``file_offset`` into ``mem`` at ``at``."""
        done = 0
        while done < size:
            n = min(size - done, 64 << 20)
            if mem.device is None:
                view = memoryview((ctypes.c_char * n).from_address(mem.addr + at + done))
                got = os.preadv(self._fd, [view], file_offset + done)
            else:
                data = os.pread(self._fd, n, file_offset + done)
                got = len(data)
                CallerMemory(gpu.ops(), mem.device, mem.addr, at + done, stream,
                             mem.owner).put_bytes(0, data)
            if not got:
                break
            done += got
        return done

    # -- writes ----------------------------------------------------------------------------------

    def write(self, buf: Any, size: int | None = None, file_offset: int = 0,
              buf_offset: int = 0, *, stream: Any = None) -> int:
        """Write through the kernel (``os.pwrite`` on the file): the filesystem allocates
        and journals; the bytes written."""
        if self._closed:
            raise CompanionError(f"{self.path} is closed", errno.EBADF)
        warn_once("fsfile:write", "nvmeof_fuse: writes to a file on a filesystem go "
                   "through the kernel (os.pwrite on the file)")
        if self._write_fd < 0:
            try:
                self._write_fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise CompanionError(f"cannot open {self.path} for writing: "
                                     f"{exc.strerror or exc}", exc.errno or errno.EIO) from None
        ns = self.namespace
        mem = ns._memory(buf, write=True)  # a read-only source (bytes) is copied first
        size, file_offset, at = ns._span(mem, size, file_offset, buf_offset)
        done = 0
        while done < size:
            n = min(size - done, 64 << 20)
            if mem.device is None:
                data: Any = memoryview((ctypes.c_char * n).from_address(mem.addr + at + done))
            else:
                data = CallerMemory(gpu.ops(), mem.device, mem.addr, at + done,
                                    gpu.stream_handle(stream), mem.owner).get_bytes(0, n)
            done += os.pwrite(self._write_fd, data, file_offset + done)
        return done

    pwrite = write


class _Unmapped(Exception):
    """FIEMAP failed or answered nonsense: the kernel reads the range (the message says why)."""


def _mapping(fd: int, start: int, length: int, flags: int = fm.FIEMAP_FLAG_SYNC
             ) -> list[fm.Extent]:
    try:
        return fsmap.fiemap(fd, start, length, flags)
    except (OSError, fm.FiemapError) as exc:
        raise _Unmapped(f"FIEMAP failed: {exc}") from None


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_ino, a.st_dev, a.st_size, a.st_ctime_ns) == \
        (b.st_ino, b.st_dev, b.st_size, b.st_ctime_ns)


def _flat_bytes(owner: Any) -> Any:
    """A writable C-contiguous numpy array as a flat view of its bytes, or None."""
    np = sys.modules.get("numpy")
    if np is None or type(owner) is not np.ndarray:
        return None
    flags = owner.flags
    if not (flags.c_contiguous and flags.writeable) or owner.dtype.hasobject:
        return None
    return owner.reshape(-1).view(np.uint8)


def _zero(mem: Any, at: int, size: int, stream: int | None) -> None:
    if mem.device is None:
        ctypes.memset(mem.addr + at, 0, size)
        return
    caller = CallerMemory(gpu.ops(), mem.device, mem.addr, at, stream, mem.owner)
    for start in range(0, size, len(ZEROS)):
        caller.put_bytes(start, ZEROS[:min(len(ZEROS), size - start)])


def open_file(path: Any, *args: Any, **options: Any) -> FilesystemFile | None:
    """The :class:`FilesystemFile` of ``path`` when it is a regular file that is not a
    namespace file of a mount; None for :class:`~nvmeof_fuse.File` to open it itself.

    A name like a namespace file's (``n1``) is left to :class:`~nvmeof_fuse.File` before anything
    is asked of the filesystem: on a hung mount a stat would never return, and
    :class:`~nvmeof_fuse.File` bounds its wait (open such a file of a filesystem with
    :class:`FilesystemFile` itself)."""
    try:
        path = os.fspath(path)
    except TypeError:
        return None
    if not isinstance(path, str) or re.fullmatch(r"n\d+", os.path.basename(path)):
        return None
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    if re.fullmatch(r"n\d+", os.path.basename(real)) or not _regular(st):
        return None
    return FilesystemFile(path, *args, **options)


def _regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)
