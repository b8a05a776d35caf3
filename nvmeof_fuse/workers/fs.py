"""The filesystem as a FUSE worker serves it: READ and WRITE on this process's own queues.

A worker reads requests from a cloned /dev/fuse descriptor
(:func:`~nvmeof_fuse.fs.devfuse.clone_fd`), and the kernel hands it any request, not only
READ and WRITE.  Those two it serves itself, on
the namespaces of its own controller (queues leased from the main process), with handles
read out of their numbers (:func:`~nvmeof_fuse.fs.operations.pack_fh`).  Everything else its session
forwards to the main process, which holds the open handles and the ``.nvmeof`` reports;
so do READs of a report and I/O on a namespace this worker does not know (added since it
started).  Its writes take their LBAs' range lock themselves, as the main process's do
(the mount's file of range locks: :mod:`~nvmeof_fuse.host.namespace.sharedranges`), so a
write needs no message to the main process, and one of whole LBAs starts with no task.
When the main process rescans
the namespaces it sends their sizes and generations (:meth:`WorkerFS.follow`): ours take the
new size, one gone is dropped (its I/O forwarded, which the main process refuses), and one
replaced by another behind its NSID refuses its I/O, while the new one serves the handles
of its own generation (:func:`.operations.pack_fh`): a handle of the old one never reaches
the new one.  While its own
queues are not live (lost with the controller or their path, waiting to be leased again:
on a multipath mount of two fabrics, for a path of their own fabric), it forwards READ and
WRITE too, so that the main process serves them on whichever path is live.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.fs.info import ControllerLike
from nvmeof_fuse.fs.mount_options import MountOptions
from nvmeof_fuse.fs.operations import NamespaceFS, _fuse_error
from nvmeof_fuse.host.attached import NamespaceShape, gone_line
from nvmeof_fuse.host.namespace import Namespace
from nvmeof_fuse.workers.messages import FORWARD_CHUNK

ForwardRead = Callable[[int, int, int], Awaitable[bytes]]
"""``read(fh, offset, size)`` in the main process: the bytes (fewer at the end)."""
ForwardWrite = Callable[[int, int, bytes], Awaitable[int]]
"""``write(fh, offset, data)`` in the main process: the bytes written."""


class WorkerFS(NamespaceFS):
    """:class:`NamespaceFS` in a FUSE worker (see the module)."""

    def __init__(self, controller: ControllerLike, options: MountOptions, *,
                 forward_read: ForwardRead, forward_write: ForwardWrite) -> None:
        super().__init__(controller, options, shared_handles=True)
        self.forwarded = 0  # READs and WRITEs the main process served for us
        self.forward_read = forward_read
        self.forward_write = forward_write

    def follow(self, shapes: dict[int, tuple[int, ...]]) -> None:
        """The main process's namespaces after a rescan, ``{nsid: (lba_size, nlb,
        generation)}``: each of ours takes its new size; one not there any more is dropped
        from our controller and tree, so that its I/O is forwarded (and refused by the main
        process); one of another generation (replaced) refuses its I/O, and the new one
        takes its place here.  One new to us is forwarded (see the module)."""
        namespaces = self.controller.namespaces
        for nsid, ns in list(namespaces.items()):
            shape = shapes.get(nsid)
            if shape is None:
                del namespaces[nsid]
                ns.remove(f"namespace n{nsid} was removed")
                self._remove_namespace(nsid)
            elif len(shape) > 2 and shape[2] != ns.generation:
                ns.replace(gone_line(nsid))
                new = namespaces[nsid] = Namespace(self.controller, nsid,
                                                   NamespaceShape(nsid, *shape), shape[2])
                self._remove_namespace(nsid)
                self._add_namespace(new)
            else:
                ns.resize(NamespaceShape(nsid, *shape))

    def _own(self) -> bool:
        """Whether our queues serve now (else the main process serves our I/O)."""
        return bool(getattr(self.controller, "live", True))

    def start_read(self, fh, off, size, done):
        return self._own() and super().start_read(fh, off, size, done)

    async def read(self, fh, off, size):
        try:
            h = self.handles[fh]
        except KeyError:  # a report, or a namespace we do not know: the main process's
            return await self._read_forwarded(fh, off, size)
        if not self._own():
            return await self._read_forwarded(fh, off, size)
        ns = h.node.ns
        try:
            return await ns.read_lent(off, size)
        except NVMeoFError as exc:
            raise _fuse_error(exc, f"read of {size} bytes at offset {off} of n{ns.nsid}") from None

    async def _read_forwarded(self, fh: int, off: int, size: int) -> bytes:
        self.forwarded += 1
        parts = []
        while size > 0:
            part = await self.forward_read(fh, off, min(size, FORWARD_CHUNK))
            parts.append(part)
            if len(part) < min(size, FORWARD_CHUNK):
                break
            off += len(part)
            size -= len(part)
        return b"".join(parts)

    def start_write(self, fh, off, buf, done):
        return self._own() and super().start_write(fh, off, buf, done)

    async def write(self, fh, off, buf):
        if self.handles.get(fh) is None or not self._own():  # see read
            return await self._write_forwarded(fh, off, buf)
        return await super().write(fh, off, buf)

    async def _write_forwarded(self, fh: int, off: int, buf: bytes | memoryview) -> int:
        self.forwarded += 1
        view = memoryview(buf)
        done = 0
        while done < len(view):
            piece = bytes(view[done:done + FORWARD_CHUNK])
            written = await self.forward_write(fh, off + done, piece)
            done += written
            if written < len(piece):
                break
        return done
