"""pyfuse3 as the FUSE server: the same operations (:class:`NamespaceFS`) through libfuse.

``-o fuse=pyfuse3`` picks it; our own session (:mod:`nvmeof_fuse.fs.session`) stays the
default, because pyfuse3 costs several times its CPU per request (the host bench,
``scripts/bench --host``, measures both).  An optional extra: ``pip install
'nvmeof-fuse[pyfuse3]'`` (it builds against libfuse3-dev, with pkg-config).

:class:`Pyfuse3Operations` answers pyfuse3's calls with NamespaceFS's handlers, their answers
converted to pyfuse3's types and every failure to ``pyfuse3.FUSEError`` (an errno, EIO for
the unexpected, as our session answers).  :class:`Pyfuse3Server` runs pyfuse3's main loop
with the methods mount.py drives (``run``, ``stop_reading``, ``close``, ``gone``, and the
kernel's invalidations).  What pyfuse3 cannot do: grant parallel direct writes (the kernel
then serializes O_DIRECT writes to a file), set ``max_background`` at INIT (fusectl raises it
where it can: ``mount.raise_max_background``), and serve more than one mount per process.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from dataclasses import fields
from typing import Any

import pyfuse3
import trio

from nvmeof_fuse.fs.operations import NamespaceFS
from nvmeof_fuse.fs.wire import EntryAttributes, FileInfo, FUSEError, StatvfsData

log = logging.getLogger(__name__)

SYNC_REQUESTS = 4  # synchronous requests the kernel may send beside max_background async ones
TREE_CHANGES = ("create", "mknod", "mkdir", "symlink", "link", "unlink", "rmdir", "rename")

_serving = False  # pyfuse3 keeps one session in module state: one mount per process


class Pyfuse3MountError(Exception):
    """pyfuse3 could not mount (libfuse printed why on stderr), or already serves one."""


def _failure(exc: Exception, what: str) -> pyfuse3.FUSEError:
    """The pyfuse3.FUSEError to answer ``exc`` with: its errno, or EIO (logged) for the
    unexpected, which pyfuse3 would otherwise raise out of its main loop."""
    if isinstance(exc, FUSEError):
        return pyfuse3.FUSEError(exc.errno)
    log.error("%s failed", what, exc_info=exc)
    return pyfuse3.FUSEError(errno.EIO)


_ATTR_FIELDS = tuple(f.name for f in fields(EntryAttributes))
_STATFS_FIELDS = tuple(f.name for f in fields(StatvfsData))


def entry_attributes(attr: EntryAttributes) -> pyfuse3.EntryAttributes:
    out = pyfuse3.EntryAttributes()
    for name in _ATTR_FIELDS:
        setattr(out, name, getattr(attr, name))
    return out


def file_info(fi: FileInfo) -> pyfuse3.FileInfo:
    """pyfuse3's FileInfo (it has no parallel_direct_writes: that flag is dropped)."""
    return pyfuse3.FileInfo(fh=fi.fh, direct_io=fi.direct_io, keep_cache=fi.keep_cache,
                            nonseekable=fi.nonseekable)


def statvfs_data(s: StatvfsData) -> pyfuse3.StatvfsData:
    out = pyfuse3.StatvfsData()
    for name in _STATFS_FIELDS:
        setattr(out, name, getattr(s, name))
    return out


class _Entries:
    """What NamespaceFS.readdir fills (wire.DirBuffer's ``add``), onto pyfuse3's token."""

    def __init__(self, token: Any) -> None:
        self.token = token

    def add(self, name: bytes, attr: EntryAttributes, next_id: int) -> bool:
        return pyfuse3.readdir_reply(self.token, name, entry_attributes(attr), next_id)


class Pyfuse3Operations(pyfuse3.Operations):
    """pyfuse3's handlers, answered by ``fs``."""

    supports_dot_lookup = False  # as our session: no NFS export support asked of the kernel

    def __init__(self, fs: NamespaceFS) -> None:
        super().__init__()
        self.fs = fs

    async def _call(self, what: str, handler: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        try:
            return await handler(*args)
        except Exception as exc:  # noqa: BLE001 -- every failure becomes the request's errno
            raise _failure(exc, what) from None

    async def lookup(self, parent_inode, name, ctx):
        return entry_attributes(await self._call("lookup", self.fs.lookup, parent_inode, name,
                                                 ctx))

    async def getattr(self, inode, ctx):
        return entry_attributes(await self._call("getattr", self.fs.getattr, inode, ctx))

    async def setattr(self, inode, attr, fields, fh, ctx):
        # pyfuse3's attr and fields have the attribute names NamespaceFS reads
        return entry_attributes(await self._call("setattr", self.fs.setattr, inode, attr,
                                                 fields, fh, ctx))

    async def statfs(self, ctx):
        return statvfs_data(await self._call("statfs", self.fs.statfs, ctx))

    async def opendir(self, inode, ctx):
        return await self._call("opendir", self.fs.opendir, inode, ctx)

    async def readdir(self, fh, start_id, token):
        await self._call("readdir", self.fs.readdir, fh, start_id, _Entries(token))

    async def releasedir(self, fh):
        await self._call("releasedir", self.fs.releasedir, fh)

    async def open(self, inode, flags, ctx):
        return file_info(await self._call("open", self.fs.open, inode, flags, ctx))

    async def read(self, fh, off, size):
        # Lent data, as our session gets it: pyfuse3 replies from it before its task yields.
        try:
            return await self.fs.read(fh, off, size)
        except Exception as exc:  # noqa: BLE001
            raise _failure(exc, f"read of {size} bytes at {off}") from None

    async def write(self, fh, off, buf):
        try:
            return await self.fs.write(fh, off, buf)
        except Exception as exc:  # noqa: BLE001
            raise _failure(exc, f"write of {len(buf)} bytes at {off}") from None

    async def flush(self, fh):
        await self._call("flush", self.fs.flush, fh)

    async def fsync(self, fh, datasync):
        await self._call("fsync", self.fs.fsync, fh, datasync)

    async def release(self, fh):
        await self._call("release", self.fs.release, fh)


def _refuse(name: str) -> Callable[..., Awaitable[None]]:
    """The tree is fixed: NamespaceFS refuses these (EPERM), as through our session."""

    async def refuse(self: Pyfuse3Operations, *_args: Any) -> None:
        await self._call(name, getattr(self.fs, name))

    refuse.__name__ = name
    return refuse


for _name in TREE_CHANGES:
    setattr(Pyfuse3Operations, _name, _refuse(_name))


class Pyfuse3Server:
    """pyfuse3's main loop serving ``ops`` on a new mount at ``path`` (made here: blocking,
    as fusermount3 runs; call it in a thread).  ``options`` are libfuse's ``-o`` options.

    pyfuse3.main's worker tasks each read one request and serve it.  With its default
    min_tasks=1 a worker that finds two others idle exits, and the next burst starts new ones,
    each with a fresh 1 MiB libfuse receive buffer: under load that churn costs more CPU than a
    request.  So as many stay as the kernel may send at once (``max_background`` async requests
    and a few synchronous ones); idle workers cost only memory.
    """

    def __init__(self, ops: NamespaceFS, path: str, options: list[str],
                 max_background: int) -> None:
        global _serving
        if _serving:
            raise Pyfuse3MountError("pyfuse3 serves one mount per process, and this process "
                                    "already serves one (use fuse=builtin)")
        try:
            pyfuse3.init(Pyfuse3Operations(ops), path, set(options))
        except (RuntimeError, UnicodeError) as exc:
            if "mount" in str(exc):  # the session exists: destroy it
                pyfuse3.close(unmount=False)
            raise Pyfuse3MountError(str(exc)) from None
        _serving = True
        self.workers = max_background + SYNC_REQUESTS
        self.gone = False  # the kernel ended the session (unmounted): nothing to unmount
        self._stopped = False
        self._closed = False

    async def run(self) -> None:
        """Serve until the kernel ends the session or :meth:`stop_reading`, then wait for
        the requests still in flight."""
        if self._stopped:
            return
        await pyfuse3.main(min_tasks=self.workers, max_tasks=2 * self.workers)
        if not self._stopped:
            self.gone = True  # only the kernel ends pyfuse3's loop otherwise

    def stop_reading(self) -> None:
        """Take no new requests; :meth:`run` returns once those in flight are answered."""
        if not self._stopped and not self._closed:
            self._stopped = True
            pyfuse3.terminate()

    async def invalidate_inode(self, inode: int, attr_only: bool = False, offset: int = 0,
                               length: int = 0) -> None:
        """Drop ``inode``'s attributes, and unless ``attr_only`` all its cached pages (pyfuse3
        takes no range: more than ``offset``/``length`` asked for, never less).  In a thread:
        the kernel may wait on pages that this loop must serve first."""
        await trio.to_thread.run_sync(pyfuse3.invalidate_inode, inode, attr_only,
                                      abandon_on_cancel=True)

    async def invalidate_entry(self, parent: int, name: bytes) -> None:
        await trio.to_thread.run_sync(pyfuse3.invalidate_entry, parent, name,
                                      abandon_on_cancel=True)

    def close(self) -> None:
        """Let go of the session and its /dev/fuse descriptor (mount.py unmounts first)."""
        global _serving
        if not self._closed:
            self._closed = True
            pyfuse3.close(unmount=False)
            _serving = False
