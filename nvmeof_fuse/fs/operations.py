"""FUSE operations: namespaces as fixed-size files, plus a read-only ``.nvmeof`` dir.

Namespace files behave like block devices: their size never changes, writes
past the end get ENOSPC, truncation to another size fails with EINVAL, and
O_TRUNC at open is ignored (the session negotiates atomic_o_trunc, as libfuse 3
does, so the kernel passes O_TRUNC to ``open`` instead of sending a size-0 setattr).
The session (fs/session.py) calls these handlers and encodes their answers.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import trio

from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.fs import info
from nvmeof_fuse.fs.info import ControllerLike, NamespaceLike
from nvmeof_fuse.fs.mount_options import MountOptions
from nvmeof_fuse.fs.wire import (
    ROOT_INODE,
    DirBuffer,
    EntryAttributes,
    FileInfo,
    FUSEError,
    StatvfsData,
)
from nvmeof_fuse.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)
"""A target that fails every command would otherwise give a line per request."""

INVALIDATE_TIMEOUT = 10.0  # s for the kernel to drop a file's cached pages

INFO_DIR = b".nvmeof"
_STATIC_TIMEOUT = 60.0  # s: namespace sizes and the tree never change while mounted


class Kernel(Protocol):
    """Where the filesystem asks the kernel to forget what it caches (the FUSE session)."""

    async def invalidate_inode(self, inode: int, attr_only: bool = False, offset: int = 0,
                               length: int = 0) -> None: ...

    async def invalidate_entry(self, parent: int, name: bytes) -> None: ...


@dataclass(slots=True)
class _Dir:
    inode: int
    entries: dict[bytes, int] = field(default_factory=dict)
    parent: int = ROOT_INODE
    subdirs: int = 0  # for st_nlink, without a look at each entry


@dataclass(slots=True)
class _NsFile:
    inode: int
    ns: NamespaceLike
    generation: int = -1
    """The namespace's generation as handles carry it (:func:`pack_fh`); -1 where they
    cannot (past :data:`GENERATION_MAX`): then only the main process serves it."""


@dataclass(slots=True)
class _InfoFile:
    inode: int
    render: Callable[[], bytes]


_Node = _Dir | _NsFile | _InfoFile


@dataclass(slots=True)
class _Handle:
    node: _NsFile | _InfoFile
    writable: bool
    content: bytes = b""  # info files: rendered once at open


NSID_BITS = 32
GENERATION_BITS = 8
GENERATION_MAX = (1 << GENERATION_BITS) - 1
"""A handle names generations below this; a namespace of this generation or later (its NSID
replaced that often on one mount) is served by the main process alone, which knows each
handle it opened."""
SERIAL_BITS = 64 - 1 - NSID_BITS - GENERATION_BITS
_GENERATION_SHIFT = NSID_BITS + 1
_SERIAL_SHIFT = _GENERATION_SHIFT + GENERATION_BITS


def pack_fh(serial: int, nsid: int, writable: bool, generation: int = 0) -> int:
    """A file handle that says what it opened: any process serving the mount (a FUSE worker)
    can read a namespace file's nsid, the namespace's generation (:attr:`Namespace.generation`:
    a handle of a namespace replaced since names an older one) and the access mode out of
    it (nsid 0: not a namespace).  64 bits: ``serial`` wraps (see :meth:`NamespaceFS.open`)."""
    return ((serial & (1 << SERIAL_BITS) - 1) << _SERIAL_SHIFT
            | min(generation, GENERATION_MAX) << _GENERATION_SHIFT | nsid << 1 | int(writable))


def unpack_fh(fh: int) -> tuple[int, bool]:
    """``(nsid, writable)`` of a :func:`pack_fh` handle (nsid 0: not a namespace file)."""
    return fh >> 1 & (1 << NSID_BITS) - 1, bool(fh & 1)


def fh_generation(fh: int) -> int:
    """The namespace generation a :func:`pack_fh` handle was opened on."""
    return fh >> _GENERATION_SHIFT & GENERATION_MAX


class _SharedHandles(dict):
    """Open handles where other processes open files too: a namespace file's handle that
    this process did not open is read out of its number (:func:`pack_fh`)."""

    def __init__(self, fs: NamespaceFS) -> None:
        super().__init__()
        self._fs = fs

    def __missing__(self, fh: int) -> _Handle:
        nsid, writable = unpack_fh(fh)
        inode = self._fs.ns_inodes.get(nsid)
        node = self._fs.nodes.get(inode) if inode is not None else None
        # a handle of another generation of the namespace (replaced since it was opened, or
        # since we last heard): not ours to serve (the main process knows it)
        if not isinstance(node, _NsFile) or fh >> _GENERATION_SHIFT & GENERATION_MAX != \
                node.generation:
            raise KeyError(fh)
        return _Handle(node, writable)

    def get(self, fh: int, default: object = None) -> object:  # type: ignore[override]
        try:
            return self[fh]
        except KeyError:
            return default


def _fuse_error(exc: NVMeoFError, what: str) -> FUSEError:
    """The FUSEError(errno) for ``exc``, after logging its one-line message (rate-limited)."""
    limited.log("failed request", logging.WARNING, "%s: %s", what, exc)
    return FUSEError(exc.errno)


@contextmanager
def _fuse_errors(what: str) -> Iterator[None]:
    """Turn NVMeoFError into FUSEError(errno) (for the rarer calls; read/write inline it)."""
    try:
        yield
    except NVMeoFError as exc:
        raise _fuse_error(exc, what) from None


async def _deny(*_args: object, **_kwargs: object) -> None:
    raise FUSEError(errno.EPERM)


class NamespaceFS:
    """One file ``n<NSID>`` per active namespace and ``.nvmeof/`` with reports.

    ``kernel`` is set by the session once mounted (None before: nothing is cached then).
    ``shared_handles``: other processes serve this mount too (FUSE workers), so each handle
    says what it opened (:func:`pack_fh`).
    """

    def __init__(self, controller: ControllerLike, options: MountOptions | None = None,
                 companion: info.CompanionLike | None = None,
                 shared_handles: bool = False) -> None:
        self.kernel: Kernel | None = None
        self.controller = controller
        self.companion = companion  # reported in .nvmeof/ (stats, companion.json)
        self.options = options or MountOptions()
        self.uid = os.getuid() if self.options.uid is None else self.options.uid
        self.gid = os.getgid() if self.options.gid is None else self.options.gid
        self.mount_ns = time.time_ns()
        self.nodes: dict[int, _Node] = {}
        self.ns_inodes: dict[int, int] = {}  # nsid -> inode of n<nsid>
        self.shared_handles = shared_handles
        self.handles: dict[int, _Handle] = _SharedHandles(self) if shared_handles else {}
        self.before_open: Callable[[int], Awaitable[None]] | None = None
        """Awaited with the nsid when a namespace file is opened, before the open is
        answered (the companion server recalls a write delegation of it)."""
        self.starts_io = bool(getattr(controller, "starts_io", False))
        """Whether :meth:`start_read` and :meth:`start_write` can start I/O (the controller's
        namespaces have ``start_read_lent`` and ``start_write``); else no one need try."""
        self._fh = itertools.count(1)
        self._idle = trio.Event()  # set while no file is open
        self._idle.set()
        self._build_tree()

    # --- tree -----------------------------------------------------------------

    def _served(self) -> dict[str, int] | None:
        """The FUSE requests this process read and its waits for them (our session's; none
        under pyfuse3), for stats beside each FUSE worker's."""
        kernel = self.kernel
        if kernel is None or not hasattr(kernel, "requests"):
            return None
        return {"requests": kernel.requests, "parks": kernel.parks,
                "full_waits": kernel.full_waits}

    def _build_tree(self) -> None:
        self._inodes = itertools.count(ROOT_INODE + 1)
        root = self._root = self._add(_Dir(ROOT_INODE, parent=ROOT_INODE))
        infodir = self._infodir = self._add(_Dir(next(self._inodes)))
        root.entries[INFO_DIR] = infodir.inode
        root.subdirs = 1
        ctrl = self.controller
        add_info = self._add_info
        add_info("controller", lambda: info.controller_text(ctrl))
        add_info("controller.json", lambda: info.to_json(info.controller_dict(ctrl)))
        companion = self.companion
        options = self.options
        serving = {"processes": options.worker_processes,
                   "chosen": options.workers_chosen or "given"}
        add_info("stats", lambda: info.stats_text(ctrl, companion, serving))
        add_info("stats.json", lambda: info.to_json(info.stats_dict(
            ctrl, companion, self._served(), serving)))
        add_info("companion.json", lambda: info.to_json(info.companion_dict(companion)))
        if hasattr(ctrl, "paths_snapshot"):  # a multipath head (every mount the CLI makes)
            add_info("paths", lambda: info.paths_text(ctrl))
            add_info("paths.json", lambda: info.to_json(info.paths_list(ctrl)))
        for nsid in sorted(ctrl.namespaces):
            if self.options.nsid is not None and nsid != self.options.nsid:
                continue
            self._add_namespace(ctrl.namespaces[nsid])
        infodir.parent = root.inode

    def _add_info(self, name: str, render: Callable[[], bytes]) -> None:
        assert isinstance(self._infodir, _Dir)
        node = self._add(_InfoFile(next(self._inodes), render))
        self._infodir.entries[name.encode()] = node.inode

    def _add_namespace(self, ns: NamespaceLike) -> None:
        """``n<nsid>``; its ``.nvmeof/n<nsid>`` and ``.nvmeof/n<nsid>.json`` come when first
        looked up or listed (:meth:`_add_namespace_info`): a target may have 65,536
        namespaces, and few of their reports are ever read."""
        assert isinstance(self._root, _Dir)
        nsid = ns.nsid
        generation = ns.generation if ns.generation < GENERATION_MAX else -1
        inode = self.ns_inodes[nsid] = self._add(
            _NsFile(next(self._inodes), ns, generation)).inode
        self._root.entries[f"n{nsid}".encode()] = inode

    def _add_namespace_info(self, nsid: int) -> bool:
        """``.nvmeof/n<nsid>`` and ``.nvmeof/n<nsid>.json`` of a namespace shown, if not
        there yet; whether they are there now."""
        assert isinstance(self._infodir, _Dir)
        inode = self.ns_inodes.get(nsid)
        if inode is None:
            return False
        if f"n{nsid}".encode() in self._infodir.entries:
            return True
        node = self.nodes[inode]
        assert isinstance(node, _NsFile)
        ns = node.ns
        self._add_info(f"n{nsid}", lambda: info.namespace_text(ns))
        self._add_info(f"n{nsid}.json", lambda: info.to_json(info.namespace_dict(ns)))
        return True

    def _namespace_info_named(self, name: bytes) -> bool:
        """Add the reports of the namespace ``name`` (``n<nsid>`` or ``n<nsid>.json``) names,
        if it is shown; whether they are there now."""
        stem = name.removesuffix(b".json")
        digits = stem[1:]
        if stem[:1] != b"n" or not digits.isdigit() or len(digits) > 10 or digits[:1] == b"0":
            return False
        return self._add_namespace_info(int(digits))

    def _remove_namespace(self, nsid: int) -> list[tuple[int, bytes]]:
        """Take ``n<nsid>`` out of the tree (open handles keep their node); the
        ``(parent inode, name)`` entries the kernel must forget."""
        assert isinstance(self._root, _Dir) and isinstance(self._infodir, _Dir)
        gone = []
        self.ns_inodes.pop(nsid, None)
        for parent, name in ((self._root, f"n{nsid}"), (self._infodir, f"n{nsid}"),
                             (self._infodir, f"n{nsid}.json")):
            inode = parent.entries.pop(name.encode(), None)
            if inode is not None:
                gone.append((parent.inode, name.encode()))
        return gone

    async def apply_changes(self, changes: list) -> None:
        """Follow namespaces added, removed, resized or replaced on the target
        (host.events).  A replaced one shows as a new file (a new inode) under its name;
        the old inode's handles refuse I/O (its namespace does), and the kernel forgets
        its cached pages, so that its readers see that too."""
        forget: list[tuple[int, bytes]] = []
        resized, dropped = [], []
        for change in changes:
            if change.kind == "replaced":
                old = self.ns_inodes.get(change.nsid)
                forget += self._remove_namespace(change.nsid)
                if old is not None:
                    dropped.append(old)
            if change.kind in ("added", "replaced"):
                ns = self.controller.namespaces.get(change.nsid)
                shown = self.options.nsid is None or change.nsid == self.options.nsid
                if ns is not None and shown and change.nsid not in self.ns_inodes:
                    self._add_namespace(ns)
            elif change.kind == "removed":
                forget += self._remove_namespace(change.nsid)
            elif change.nsid in self.ns_inodes:
                resized.append(self.ns_inodes[change.nsid])
        for parent, name in forget:
            await self._forget_entry(parent, name)
        for inode in resized:
            await self._invalidate(inode, attr_only=True)
        for inode in dropped:
            await self._invalidate(inode)

    async def _forget_entry(self, parent: int, name: bytes) -> None:
        await self._ask_kernel(lambda kernel: kernel.invalidate_entry(parent, name),
                               f"make the kernel forget {name.decode()!r}")

    async def _invalidate(self, inode: int, attr_only: bool = False, offset: int = 0,
                          length: int = 0) -> None:
        """Make the kernel forget what it caches of ``inode`` (its pages, those of
        ``length`` bytes at ``offset`` when ``length`` is not 0, or its attributes)."""
        await self._ask_kernel(
            lambda kernel: kernel.invalidate_inode(inode, attr_only, offset, length),
            f"drop the kernel's cache of inode {inode}")

    async def _ask_kernel(self, ask: Callable[[Kernel], Awaitable[None]], what: str) -> None:
        """Have the kernel forget something it caches, within INVALIDATE_TIMEOUT; ENOENT
        (it cached nothing of it) is no failure."""
        kernel = self.kernel
        if kernel is None:
            return
        # The session writes from a thread: the kernel waits for pages being read, and the
        # trio loop answers those reads.
        with trio.move_on_after(INVALIDATE_TIMEOUT) as scope:
            try:
                await ask(kernel)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    log.warning("cannot %s: %s", what, exc)
        if scope.cancelled_caught:
            log.warning("could not %s within %g s", what, INVALIDATE_TIMEOUT)

    def _add(self, node: _Node) -> _Node:
        self.nodes[node.inode] = node
        return node

    def _node(self, inode: int) -> _Node:
        try:
            return self.nodes[inode]
        except KeyError:
            raise FUSEError(errno.ENOENT) from None

    # --- attributes -------------------------------------------------------------

    def _attr(self, node: _Node) -> EntryAttributes:
        a = EntryAttributes()
        a.st_ino = node.inode
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self.mount_ns
        a.entry_timeout = a.attr_timeout = _STATIC_TIMEOUT
        a.st_blksize = 4096
        if isinstance(node, _Dir):
            a.st_mode = stat.S_IFDIR | 0o555
            a.st_nlink = 2 + node.subdirs
        elif isinstance(node, _NsFile):
            mode = self.options.mode & 0o7777
            if self.options.read_only:
                mode &= ~0o222
            a.st_mode = stat.S_IFREG | mode
            a.st_nlink = 1
            a.st_size = node.ns.size
            a.st_blksize = node.ns.lba_size
            a.st_blocks = (node.ns.size + 511) // 512
        else:
            a.st_mode = stat.S_IFREG | 0o444
            a.st_nlink = 1
            a.st_size = len(node.render())  # a hint only: opened with direct_io
            a.st_blocks = (a.st_size + 511) // 512
            a.attr_timeout = 0
        return a

    async def getattr(self, inode, ctx=None):
        return self._attr(self._node(inode))

    async def lookup(self, parent_inode, name, ctx=None):
        parent = self._node(parent_inode)
        if not isinstance(parent, _Dir):
            raise FUSEError(errno.ENOTDIR)
        if name == b".":
            return self._attr(parent)
        if name == b"..":
            return self._attr(self._node(parent.parent))
        if name not in parent.entries and not (parent is self._infodir
                                               and self._namespace_info_named(name)):
            raise FUSEError(errno.ENOENT)
        return self._attr(self._node(parent.entries[name]))

    async def setattr(self, inode, attr, fields, fh, ctx):
        node = self._node(inode)
        if fields.update_mode or fields.update_uid or fields.update_gid:
            raise FUSEError(errno.EPERM)  # fixed by mount options
        if fields.update_size:
            if not isinstance(node, _NsFile):
                raise FUSEError(errno.EPERM)
            if self.options.read_only:
                raise FUSEError(errno.EROFS)
            if attr.st_size != node.ns.size:
                log.debug("refused resize of n%d to %d bytes", node.ns.nsid, attr.st_size)
                raise FUSEError(errno.EINVAL)  # a namespace has a fixed size
        return self._attr(node)  # atime/mtime updates are accepted and ignored

    async def statfs(self, ctx):
        s = StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        total = sum(ns.size for ns in self.controller.namespaces.values())
        s.f_blocks = total // 4096
        s.f_files = len(self.nodes)
        s.f_namemax = 255
        return s

    # --- directories ------------------------------------------------------------

    async def opendir(self, inode, ctx):
        if not isinstance(self._node(inode), _Dir):
            raise FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, out: DirBuffer) -> None:
        """Add the entries from ``start_id`` on to ``out`` until it is full."""
        node = self._node(fh)
        assert isinstance(node, _Dir)
        if node is self._infodir and start_id == 0:  # every report listed (appended: the
            for nsid in list(self.ns_inodes):  # offsets of a listing going on stay)
                self._add_namespace_info(nsid)
        entries = itertools.islice(node.entries.items(), start_id, None)
        for i, (name, inode) in enumerate(entries, start_id):
            if not out.add(name, self._attr(self._node(inode)), i + 1):
                break

    async def releasedir(self, fh):
        pass

    # --- files --------------------------------------------------------------------

    async def open(self, inode, flags, ctx):
        node = self._node(inode)
        if isinstance(node, _Dir):
            raise FUSEError(errno.EISDIR)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if writable and isinstance(node, _InfoFile):
            raise FUSEError(errno.EACCES)
        if writable and self.options.read_only:
            raise FUSEError(errno.EROFS)
        if isinstance(node, _NsFile):
            if self.ns_inodes.get(node.ns.nsid) != inode:
                raise FUSEError(errno.ESTALE)  # removed or replaced since it was looked up
            if node.ns.unavailable:
                raise FUSEError(errno.ENXIO)  # values we cannot serve: shown with size 0
        fh = next(self._fh)
        if self.shared_handles:
            fh = self._shared_fh(fh, node, writable)
        if self._idle.is_set():
            self._idle = trio.Event()
        if isinstance(node, _InfoFile):
            self.handles[fh] = _Handle(node, False, node.render())
            return FileInfo(fh=fh, direct_io=True, keep_cache=False)
        # O_TRUNC is deliberately ignored, as on a block device.
        self.handles[fh] = _Handle(node, writable)
        if self.before_open is not None:
            try:
                await self.before_open(node.ns.nsid)
            except BaseException:
                await self.release(fh)  # never answered: the kernel will not release it
                raise
        direct = bool(flags & os.O_DIRECT)
        # Parallel direct writes: the namespace's range lock orders overlapping writes (and
        # their read-modify-write), so the kernel need not serialize them per file.
        return FileInfo(fh=fh, direct_io=direct, keep_cache=False, parallel_direct_writes=True)

    def _shared_fh(self, serial: int, node: _NsFile | _InfoFile, writable: bool) -> int:
        """A handle that names what it opened (:func:`pack_fh`), none of those open (the
        serial wraps)."""
        nsid = generation = 0
        if isinstance(node, _NsFile):  # (GENERATION_MAX: a generation no worker serves)
            nsid = node.ns.nsid
            generation = node.generation if node.generation >= 0 else GENERATION_MAX
        fh = pack_fh(serial, nsid, writable, generation)
        while dict.__contains__(self.handles, fh):
            fh = pack_fh(next(self._fh), nsid, writable, generation)
        return fh

    async def read(self, fh, off, size):
        h = self.handles[fh]
        if isinstance(h.node, _InfoFile):
            return h.content[off : off + size]
        ns = h.node.ns
        try:
            # Lent data (straight from the bounce buffer): the session sends the reply
            # before this task yields again, so no copy is needed.
            return await ns.read_lent(off, size)
        except NVMeoFError as exc:
            raise _fuse_error(exc, f"read of {size} bytes at offset {off} of n{ns.nsid}") from None

    def start_read(self, fh: int, off: int, size: int,
                   done: Callable[[memoryview | None], None]) -> bool:
        """:meth:`read` with no task waiting, where the namespace can
        (:meth:`Namespace.start_read_lent`): ``done`` gets the data, lent for that call, or
        None when the read failed (then :meth:`read` it, for the error or a retry).  False:
        nothing started, :meth:`read` it."""
        h = self.handles.get(fh)
        if h is None or not isinstance(h.node, _NsFile):
            return False
        return h.node.ns.start_read_lent(off, size, done)

    def start_write(self, fh: int, off: int, buf: memoryview,
                    done: Callable[[bool], None]) -> bool:
        """:meth:`write` with no task waiting, where the namespace can
        (:meth:`Namespace.start_write`): ``done`` is told whether all of ``buf`` landed
        (False: :meth:`write` it, for the error or a retry).  False: nothing started,
        :meth:`write` it."""
        h = self.handles.get(fh)
        if h is None or not h.writable or not isinstance(h.node, _NsFile):
            return False
        return h.node.ns.start_write(off, buf, done)

    async def write(self, fh, off, buf):
        h = self.handles[fh]
        if not isinstance(h.node, _NsFile) or not h.writable:
            raise FUSEError(errno.EBADF)
        ns = h.node.ns
        if off >= ns.size:
            raise FUSEError(errno.ENOSPC)
        # Like a block device: a write straddling the end is cut short there.
        data = memoryview(buf)[: ns.size - off] if off + len(buf) > ns.size else buf
        try:
            return await ns.write(off, data)
        except NVMeoFError as exc:
            what = f"write of {len(data)} bytes at offset {off} of n{ns.nsid}"
            raise _fuse_error(exc, what) from None

    async def flush(self, fh):
        h = self.handles[fh]
        if h.writable and isinstance(h.node, _NsFile):
            await self._flush(h.node.ns)

    async def fsync(self, fh, datasync):
        h = self.handles[fh]
        if isinstance(h.node, _NsFile):
            await self._flush(h.node.ns)

    async def _flush(self, ns: NamespaceLike) -> None:
        with _fuse_errors(f"flush of n{ns.nsid}"):
            await ns.flush()

    async def release(self, fh):
        self.handles.pop(fh, None)
        if not self.handles:
            self._idle.set()

    def file_open(self, nsid: int) -> bool:
        """Whether a handle of ``n<nsid>`` is open."""
        return any(isinstance(h.node, _NsFile) and h.node.ns.nsid == nsid
                   for h in self.handles.values())

    async def drop_cached(self, nsid: int, offset: int = 0, length: int = 0) -> None:
        """Make the kernel forget its cached pages of ``n<nsid>`` (of ``length`` bytes at
        ``offset``; 0: all), whose data changed behind FUSE (a companion write), so
        buffered readers see the new data."""
        inode = self.ns_inodes.get(nsid)
        if inode is None:
            return
        await self._invalidate(inode, offset=offset, length=length)

    async def wait_idle(self) -> None:
        """Return once no file is open (after the last release)."""
        while not self._idle.is_set():
            await self._idle.wait()

    # The tree is fixed: creating, removing and renaming entries is not permitted.
    create = mknod = mkdir = symlink = link = _deny  # type: ignore[assignment]
    unlink = rmdir = rename = _deny  # type: ignore[assignment]
