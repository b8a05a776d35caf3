"""``nvmeof_fuse.File``: kvikio-style reads and writes of a mounted namespace file.

    arr = nvmeof_fuse.empty(64 << 20)              # memory the daemon can map
    with nvmeof_fuse.File("/mnt/nvme/n1") as f:
        f.read(arr, file_offset=12345)             # the target writes into arr by RDMA
        fut = f.pwrite(arr, 4096, file_offset=0)   # futures: fut.get()

Direct placement needs memory the daemon can register: an array from
:func:`~nvmeof_fuse.empty` (or a view of one), a CUDA tensor whose memory
exports as a dma-buf, or, in the process that mounted, any memory.  Anything
else is staged through a shared bounce buffer and copied here, like kvikio's
compat mode: it still works, it is logged once, and the daemon counts those
bytes as staged.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import json
import logging
import operator
import os
import queue
import re
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import InvalidArgument, NVMeoFError
from ..host.byterange import NoSpace
from ..host.memory import buffer_address
from ..host.options import QUEUES_PER_CLIENT
from . import gpu, shm
from .channel import LocalChannel, SocketChannel
from .future import IOFuture
from .local import served_here
from .protocol import CompanionError, NoAnswer, Piece, chunks, plan_read, plan_write

if TYPE_CHECKING:
    from .direct import DirectQueues

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0  # s per request, plus time for its bytes at MIN_RATE
MIN_RATE = 5e6  # bytes/s assumed when bounding a large request
STAGING_SLOT = 1 << 20
STAGING_SLOTS = 4
INFO_TIMEOUT = 10.0  # s for reading .nvmeof/companion.json (a hung mount blocks)
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _read_info(path: str) -> dict:
    """``.nvmeof/companion.json`` of a mount, read in a thread (a hung mount blocks)."""
    result: dict[str, Any] = {}

    def read() -> None:
        try:
            with open(path, encoding="utf-8") as f:
                result["info"] = json.load(f)
        except BaseException as exc:  # handed to the caller
            result["error"] = exc

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(INFO_TIMEOUT)
    if reader.is_alive():
        raise CompanionError(f"{path} does not respond within {INFO_TIMEOUT:g} s "
                             "(a hung mount daemon?)", errno.ETIMEDOUT)
    if "error" in result:
        raise result["error"]
    return result["info"]


def locate(path: str) -> tuple[str, int, dict]:
    """``(mountpoint, nsid, companion info)`` of a namespace file of an nvmeof-fuse mount."""
    real = os.path.realpath(path)
    match = re.fullmatch(r"n(\d+)", os.path.basename(real))
    if not match:
        raise InvalidArgument(f"{path} is not a namespace file of an nvmeof-fuse mount "
                              "(expected MOUNTPOINT/nN)")
    mountpoint = os.path.dirname(real)
    info_path = os.path.join(mountpoint, ".nvmeof", "companion.json")
    try:
        info = _read_info(info_path)
    except FileNotFoundError:
        raise CompanionError(f"{mountpoint} is not an nvmeof-fuse mount "
                             "(no .nvmeof/companion.json)", errno.ENODEV) from None
    except PermissionError:
        raise CompanionError(f"cannot read {info_path}: permission denied (the mount belongs "
                             "to another user; only that user and root may use it)",
                             errno.EACCES) from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise CompanionError(f"stale mount at {mountpoint}: its daemon is gone; clear it "
                                 f"with: fusermount3 -u {mountpoint}", errno.ENOTCONN) from None
        raise CompanionError(f"cannot read {info_path}: {exc.strerror or exc}",
                             exc.errno or errno.EIO) from None
    except ValueError as exc:
        raise CompanionError(f"{info_path} is not valid JSON: {exc}", errno.EPROTO) from None
    if not info.get("socket"):
        raise CompanionError(f"the mount at {mountpoint} serves no companion socket",
                             errno.ENOTSUP)
    return mountpoint, int(match.group(1)), info


class _Staging:
    """Shared bounce memory registered once per file: slots borrowed per transfer."""

    def __init__(self, channel: Any, slot: int, count: int, timeout: float) -> None:
        self.slot = slot
        self.timeout = timeout
        self.mem = shm.allocate(slot * count)
        self.view = memoryview(self.mem)
        self.rid = channel.register_shared(self.mem, staging=True)
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(count):
            self._free.put(i * slot)

    @contextmanager
    def borrow(self) -> Iterator[int]:
        try:
            at = self._free.get(timeout=self.timeout)
        except queue.Empty:
            raise CompanionError(f"no staging buffer came free within {self.timeout:g} s",
                                 errno.ETIMEDOUT) from None
        try:
            yield at
        except NoAnswer:  # the daemon may still use the slot: it is never lent again
            raise
        except BaseException:
            self._free.put(at)
            raise
        else:
            self._free.put(at)

    def close(self) -> None:
        self.view.release()


class _Target:
    """Caller memory for one transfer: a region (direct) or None (staged), plus copies."""

    rid: int | None = None
    offset = 0  # of the caller's first byte within region ``rid``
    cleanup: Any = None

    def put(self, at: int, data: memoryview) -> None: ...

    def get(self, at: int, length: int) -> bytes: ...

    def after_read(self) -> None: ...

    def before_write(self) -> None: ...


class _HostTarget(_Target):
    def __init__(self, view: memoryview) -> None:
        self.view = view

    def put(self, at: int, data: memoryview) -> None:
        self.view[at:at + len(data)] = data

    def get(self, at: int, length: int) -> bytes:
        return bytes(self.view[at:at + length])


class _LazyHostTarget(_HostTarget):
    """Host memory whose bytes are touched only for partial LBAs: its view is made then."""

    def __init__(self, owner: Any, start: int, size: int) -> None:  # noqa: D107
        self._owner, self._start, self._size = owner, start, size
        self._view: memoryview | None = None

    @property  # type: ignore[override]
    def view(self) -> memoryview:
        if self._view is None:
            self._view = _host_view(self._owner)[self._start:self._start + self._size]
        return self._view


class _CudaTarget(_Target):
    def __init__(self, cuda: gpu.CudaOps, tensor: Any, byte_offset: int) -> None:
        self.cuda = cuda
        self.tensor = tensor
        self.base = byte_offset

    def put(self, at: int, data: memoryview) -> None:
        self.cuda.to_device(self.tensor, self.base + at, data)

    def get(self, at: int, length: int) -> bytes:
        out = bytearray(length)
        self.cuda.to_host(self.tensor, self.base + at, memoryview(out))
        return bytes(out)

    def after_read(self) -> None:
        if self.rid is not None:  # the target wrote GPU memory: make it visible to CUDA
            self.cuda.flush_gpudirect_writes()

    def before_write(self) -> None:
        self.cuda.synchronize()  # work producing the tensor must be done before the NIC reads


class _Memory(NamedTuple):
    """Caller memory: ``cuda`` is the seam for a CUDA tensor, None for host memory."""

    cuda: gpu.CudaOps | None
    addr: int
    total: int
    owner: Any


class File:
    """A namespace file of a mounted controller, opened for direct placement."""

    def __init__(self, path: str, *, timeout: float = DEFAULT_TIMEOUT,
                 compat_mode: bool | None = None, workers: int = 4,
                 queues: int = QUEUES_PER_CLIENT) -> None:
        self.path = path
        self.timeout = timeout
        if compat_mode is None:
            compat_mode = os.environ.get("NVMEOF_FUSE_COMPAT_MODE", "").upper() in {"ON", "1"}
        self.compat_mode = compat_mode
        self.mountpoint, self.nsid, info = locate(path)
        local = served_here(info["socket"])
        address = "\0" + info["socket"][1:] if info["socket"].startswith("@") else info["socket"]
        self._channel: Any = (LocalChannel(local, timeout) if local is not None
                              else SocketChannel(address, timeout))
        self._mount = local
        self._regions: dict[int, int] = {}  # shared allocation key -> region
        self._stale: list[int] = []  # regions of freed allocations, unregistered on next use
        self._lock = threading.Lock()  # guards _regions and _stale
        self._register_lock = threading.Lock()  # one registration per allocation
        self._closed = False
        try:
            hello = self._channel.hello()
            ns = hello["namespaces"].get(str(self.nsid))
            if ns is None:
                raise CompanionError(f"{path}: namespace {self.nsid} is not on this mount",
                                     errno.ENOENT)
            self.nbytes: int = ns["size"]
            self.lba_size: int = ns["lba_size"]
            self.read_only: bool = hello.get("read_only", False)
            slot = max(STAGING_SLOT, 2 * self.lba_size)
            self._staging = _Staging(self._channel, slot, STAGING_SLOTS, timeout)
            self._direct = self._open_direct(hello, queues)
        except BaseException:
            self._channel.close()
            raise
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, "nvmeof-fuse file")
        # A file dropped unclosed still lets go of its queues, registrations and connection.
        self._dropped = weakref.finalize(self, _release_dropped, self._executor, self._direct,
                                         self._staging, self._channel)
        self._dropped.atexit = False  # at exit the connection goes with the process
        shm.on_free(self._forget)

    def _open_direct(self, hello: dict, queues: int) -> DirectQueues | None:
        """Queues of our own on the mount, unless in-process, compat mode or refused."""
        if self._mount is not None or self.compat_mode or queues <= 0:
            return None
        why = hello.get("leasing", "the mount daemon is too old to lease queues")
        if why == "on":
            from .direct import open_direct

            direct, why = open_direct(self._channel, self.timeout, queues)
            if direct is not None:
                return direct
        _warn_once(f"lease:{why}", f"nvmeof_fuse: {why}; moving data over the mount "
                   "daemon's queues instead (slower; counted as direct_* or staged_*)")
        return None

    @property
    def own_queues(self) -> tuple[int, ...]:
        """The queue IDs this file uses on its own, or () when it uses the daemon's."""
        return self._direct.qids if self._direct is not None else ()

    def __repr__(self) -> str:
        return f"<nvmeof_fuse.File {self.path}: {self.nbytes} bytes>"

    def __enter__(self) -> File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pending futures, then release this file's registrations."""
        if self._closed:
            return
        self._executor.shutdown(wait=True)  # new pread/pwrite calls fail from here on
        self._closed = True
        self._dropped.detach()
        shm.remove_on_free(self._forget)
        _release(self._executor, self._direct, self._staging, self._channel)

    def _forget(self, key: int) -> None:
        """A shared allocation was freed (a finalizer, any thread): unregister it later."""
        with self._lock:
            rid = self._regions.pop(key, None)
            if rid is not None:
                self._stale.append(rid)

    def _unregister_stale(self) -> None:
        with self._lock:
            stale, self._stale = self._stale, []
        for rid in stale:
            try:
                self._channel.unregister(rid)
            except NVMeoFError as exc:
                log.debug("unregistering a freed array's region %d: %s", rid, exc)

    def stats(self) -> dict:
        """The daemon's companion counters: bytes over clients' own queues, over the
        daemon's queues (direct) and staged, in total and per client."""
        if self._direct is not None:
            return self._channel.call("stats", moved=self._direct.moved())["stats"]
        return self._channel.stats()

    # -- caller memory ---------------------------------------------------------------------

    @staticmethod
    def _memory(buf: Any, write: bool = False) -> _Memory:
        """Where ``buf`` lives, resolved once per call; a read-only source of a write
        (``bytes``, a read-only array) is copied first (registered memory is writable)."""
        np = sys.modules.get("numpy")
        if np is not None and type(buf) is np.ndarray:  # the hot path, without probing
            flags = buf.flags
            if buf.dtype.hasobject:
                raise InvalidArgument("an array of Python objects (dtype object) cannot "
                                      "move bytes to or from a namespace")
            if flags.c_contiguous and flags.writeable and buf.nbytes:
                # a third of what __array_interface__ costs (it builds a dict)
                return _Memory(None, ctypes.addressof(ctypes.c_char.from_buffer(buf)),
                               buf.nbytes, buf)
        cuda = gpu.ops()
        if cuda.is_cuda(buf):
            addr, total = cuda.span(buf)
            return _Memory(cuda, addr, total, buf)
        return _Memory(None, *buffer_address(_writable(buf) if write else buf))

    @staticmethod
    def _span(mem: _Memory, size: int | None, file_offset: int, buf_offset: int
              ) -> tuple[int, int, int]:
        """``(size, file_offset, buf_offset)`` as ints (numpy's too), checked: the bytes to
        move are ``size``, or the rest of the buffer."""
        total = mem.total
        buf_offset = _integer(buf_offset, "buf_offset")
        if buf_offset < 0 or buf_offset > total:
            raise InvalidArgument(f"buf_offset {buf_offset} is outside the {total}-byte buffer")
        size = total - buf_offset if size is None else _integer(size, "size")
        if size < 0 or buf_offset + size > total:
            raise InvalidArgument(f"size {size} at buf_offset {buf_offset} overruns the "
                                  f"{total}-byte buffer")
        file_offset = _integer(file_offset, "file_offset")
        if file_offset < 0:
            raise InvalidArgument(f"file_offset {file_offset} is negative")
        return size, file_offset, buf_offset

    @contextmanager
    def _target(self, mem: _Memory, buf_offset: int, size: int) -> Iterator[_Target]:
        if mem.cuda is not None:
            target: _Target = _CudaTarget(mem.cuda, mem.owner, buf_offset)
            if not self.compat_mode:
                self._place_cuda(target, mem.owner, mem.addr + buf_offset, size, mem.cuda)
        else:
            target = _HostTarget(_host_view(mem.owner)[buf_offset:buf_offset + size])
            if not self.compat_mode:
                self._place_host(target, mem.addr + buf_offset, size, mem.owner)
        if target.rid is None and (self.compat_mode or isinstance(target, _HostTarget)):
            what = "compat mode is on" if self.compat_mode else (
                "the buffer is not shared memory (use nvmeof_fuse.empty())")
            _warn_once(f"staged:{what}", f"nvmeof_fuse: {what}; staging data through a "
                       "bounce buffer (slower; the daemon counts it as staged)")
        try:
            yield target
        finally:
            if target.cleanup is not None:
                target.cleanup()

    def _place_host(self, target: _Target, addr: int, size: int, owner: Any) -> None:
        if self._mount is not None:
            found = self._mount.registered(addr, size)
            if found is not None:
                target.rid, target.offset = found
                return
            if size:
                rid = self._channel.register_local(addr, size, owner)
                target.rid, target.offset = rid, 0
                target.cleanup = lambda: self._channel.unregister(rid)
            return
        found = shm.find(addr, size)
        if found is None:
            return
        mem, offset = found
        with self._register_lock:
            with self._lock:
                rid = self._regions.get(mem.key)
            if rid is None:
                rid = self._channel.register_shared(mem)
                with self._lock:
                    self._regions[mem.key] = rid
        target.rid, target.offset = rid, offset

    def _place_cuda(self, target: _Target, tensor: Any, addr: int, size: int,
                    cuda: gpu.CudaOps) -> None:
        if self._mount is not None:
            found = self._mount.registered(addr, size)
            if found is not None:
                target.rid, target.offset = found
                return
        if not size:
            return
        base, offset, length = gpu.page_span(addr, size)
        errors = []
        try:
            fd = cuda.export_dmabuf(base, length)
            rid = self._channel.register_dmabuf(fd, offset, size, addr)
        except (NVMeoFError, RuntimeError, OSError, ValueError, ImportError) as exc:
            errors.append(f"dma-buf: {exc}")
            try:  # the peer-memory path (nvidia_peermem) works only in this process
                rid = self._channel.register_local(addr, size, tensor)
            except NVMeoFError as exc2:
                errors.append(f"peer memory: {exc2}")
                rid = None
        if rid is None:
            why = "; ".join(errors)
            _warn_once("cuda:" + why,
                       f"nvmeof_fuse: cannot place data in GPU memory directly ({why}); "
                       "staging it through host memory")
            return
        target.rid, target.offset = rid, 0
        target.cleanup = lambda: self._channel.unregister(rid)

    # -- transfers ---------------------------------------------------------------------------

    def _budget(self, nbytes: int) -> float:
        return self.timeout + nbytes / MIN_RATE

    def _check_open(self) -> None:
        if self._closed:
            raise CompanionError(f"{self.path} is closed", errno.EBADF)
        if self._stale:
            self._unregister_stale()

    def read(self, buf: Any, size: int | None = None, file_offset: int = 0,
             buf_offset: int = 0) -> int:
        """Read into ``buf``; returns the bytes read (short at the end of the namespace)."""
        direct = self._direct
        if direct is not None and not buf_offset:
            polled = self._pread_array(direct, buf, size, file_offset, True)
            if polled is not None:
                return polled.get()
        self._check_open()
        mem = self._memory(buf)
        size, file_offset, buf_offset = self._span(mem, size, file_offset, buf_offset)
        size = max(0, min(size, self.nbytes - file_offset))
        if not size:
            return 0
        if self._direct is not None:
            future = self._own_queues(mem, buf_offset, size, file_offset, write=False)
            if future is not None:
                return future.get()
        with self._target(mem, buf_offset, size) as target:
            if target.rid is not None:
                self._read_direct(target, file_offset, size)
                target.after_read()
            else:
                self._read_staged(target, file_offset, size)
        return size

    def _read_direct(self, target: _Target, file_offset: int, size: int) -> None:
        staging = self._staging
        with staging.borrow() as at:
            plan = plan_read(file_offset, size, self.lba_size, target.rid, target.offset,
                             staging.rid, at)
            self._channel.read(self.nsid, plan.pieces, self._budget(size))
            for edge in plan.edges:
                target.put(edge.dest, staging.view[edge.staging:edge.staging + edge.length])

    def _read_staged(self, target: _Target, file_offset: int, size: int) -> None:
        staging, lba = self._staging, self.lba_size
        for offset, length in chunks(file_offset, size, lba, staging.slot):
            first = offset // lba
            nlb = -(-(offset + length) // lba) - first
            with staging.borrow() as at:
                self._channel.read(self.nsid, [Piece(first, nlb, staging.rid, at)],
                                   self._budget(nlb * lba))
                skip = at + offset - first * lba
                target.put(offset - file_offset, staging.view[skip:skip + length])

    def write(self, buf: Any, size: int | None = None, file_offset: int = 0,
              buf_offset: int = 0) -> int:
        """Write ``buf`` at ``file_offset``; returns the bytes written.  ``buf`` may be
        read-only (``bytes``): then it is copied first."""
        self._check_open()
        mem = self._memory(buf, write=True)
        size, file_offset, buf_offset = self._span(mem, size, file_offset, buf_offset)
        self._check_write(file_offset, size)
        if not size:
            return 0
        if self._direct is not None:
            future = self._own_queues(mem, buf_offset, size, file_offset, write=True)
            if future is not None:
                return future.get()
        with self._target(mem, buf_offset, size) as target:
            target.before_write()
            if target.rid is not None:
                plan = plan_write(file_offset, size, self.lba_size)
                head = target.get(plan.head.start, plan.head.stop - plan.head.start)
                tail = target.get(plan.tail.start, plan.tail.stop - plan.tail.start)
                self._channel.write(self.nsid, file_offset, size, target.rid, target.offset,
                                    head, tail, self._budget(size))
            else:
                self._write_staged(target, file_offset, size)
        return size

    def _check_write(self, file_offset: int, size: int) -> None:
        if self.read_only:
            raise CompanionError(f"{self.path} is mounted read-only", errno.EROFS)
        if file_offset + size > self.nbytes:
            raise NoSpace(f"write of {size} bytes at offset {file_offset} extends past the "
                          f"end of {self.path} ({self.nbytes} bytes)")

    def _write_staged(self, target: _Target, file_offset: int, size: int) -> None:
        staging = self._staging
        for offset, length in chunks(file_offset, size, self.lba_size, staging.slot):
            with staging.borrow() as at:
                chunk = staging.view[at:at + length]
                chunk[:] = target.get(offset - file_offset, length)
                plan = plan_write(offset, length, self.lba_size)
                self._channel.write(self.nsid, offset, length, staging.rid, at,
                                    bytes(chunk[plan.head]), bytes(chunk[plan.tail]),
                                    self._budget(length))

    def _own_queues(self, mem: _Memory, buf_offset: int, size: int, file_offset: int, *,
                    write: bool, post: bool = True) -> IOFuture | None:
        """Start a transfer on this file's own queues; None when the memory cannot be
        registered here (then the daemon's path serves it)."""
        direct = self._direct
        assert direct is not None
        addr = mem.addr + buf_offset
        if mem.cuda is not None:
            try:
                region, at, temporary = direct.dmabuf_region(mem.cuda, addr, size, mem.owner)
            except (NVMeoFError, RuntimeError, OSError, ValueError, ImportError) as exc:
                _warn_once(f"own-dmabuf:{exc}", f"nvmeof_fuse: cannot register the tensor's "
                           f"dma-buf for our own queues ({exc}); using the mount daemon")
                return None
            target: _Target = _CudaTarget(mem.cuda, mem.owner, buf_offset)
            target.rid = 0  # placed directly: flush after a read
        else:
            try:
                region, at, temporary = direct.host_region(addr, size, mem.owner)
            except NVMeoFError as exc:
                _warn_once(f"own-reg:{exc}", f"nvmeof_fuse: cannot register the buffer for "
                           f"our own queues ({exc}); using the mount daemon")
                return None
            if not write and not temporary:  # the common case first: no target needed
                polled = direct.polled_read(self.nsid, region, at, size, file_offset,
                                            mem.owner, self._budget(size) + direct.renew_timeout,
                                            post)
                if polled is not None:
                    return polled
            target = _LazyHostTarget(mem.owner, buf_offset, size)
        if write:
            target.before_write()
            plan = plan_write(file_offset, size, self.lba_size)
            head = target.get(plan.head.start, plan.head.stop - plan.head.start)
            tail = target.get(plan.tail.start, plan.tail.stop - plan.tail.start)

            def get(start: int, length: int, _buffer: Any = mem.owner) -> bytes:
                """Edge bytes; holds the caller's buffer (the NIC reads it) until done."""
                return head if start == 0 else tail

            future = direct.start(direct.write, self.nsid, region, at, size, file_offset, get,
                                  temporary)
            finish = None
        elif isinstance(target, _LazyHostTarget):  # host memory: nothing to do afterwards
            future = direct.start(direct.read, self.nsid, region, at, size, file_offset,
                                  target.put, temporary)
            finish = None
        else:  # device copies belong to the caller's thread: collected, put in finish
            edges: list[tuple[int, bytes]] = []
            future = direct.start(direct.read, self.nsid, region, at, size, file_offset,
                                  lambda at, data: edges.append((at, bytes(data))), temporary)

            def finish() -> None:
                for dest, data in edges:
                    target.put(dest, memoryview(data))
                target.after_read()

        return IOFuture(future, finish, self._budget(size) + direct.renew_timeout)

    def pread(self, buf: Any, size: int | None = None, file_offset: int = 0,
              buf_offset: int = 0) -> IOFuture:
        """Start :meth:`read`; the future's ``get()`` gives the bytes read."""
        direct = self._direct
        if direct is not None and not buf_offset:
            future = self._pread_array(direct, buf, size, file_offset, True)
            if future is not None:
                return future
        return self._start(False, buf, size, file_offset, buf_offset)

    def _pread_array(self, direct: DirectQueues, buf: Any, size: int | None,
                     file_offset: int, post: bool) -> IOFuture | None:
        """The hot path of :meth:`pread`, :meth:`read` and :meth:`pread_batch`: whole LBAs
        into a writable C-contiguous numpy array whose memory stays registered, on a polled
        queue of ours.  None for anything else (then the general path checks it, and serves
        or refuses it)."""
        np = sys.modules.get("numpy")
        if (np is None or type(buf) is not np.ndarray or type(file_offset) is not int
                or self._closed or self._stale):
            return None
        nbytes = buf.nbytes
        if size is None:
            size = nbytes
        elif type(size) is not int or not 0 < size <= nbytes:
            return None
        polled = direct.polling_queues(size)
        if not polled:  # a large read: its array is resolved there once
            return None
        lba_size = self.lba_size
        if (file_offset < 0 or file_offset + size > self.nbytes or file_offset % lba_size
                or size % lba_size or buf.dtype.hasobject):
            return None
        try:  # refuses a read-only or non-contiguous array (ValueError, TypeError)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        except (ValueError, TypeError):
            return None
        found = direct.array_region(addr, size, buf)
        if found is None:
            return None
        region, at = found
        return direct.polled_read_lbas(polled, self.nsid, region, at, size, file_offset,
                                       file_offset // lba_size, size // lba_size, buf,
                                       self._budget(size) + direct.renew_timeout, post)

    def pwrite(self, buf: Any, size: int | None = None, file_offset: int = 0,
               buf_offset: int = 0) -> IOFuture:
        """Start :meth:`write`; the future's ``get()`` gives the bytes written."""
        return self._start(True, buf, size, file_offset, buf_offset)

    def pread_batch(self, requests: list[tuple[Any, int, int]]) -> list[IOFuture]:
        """Start many reads at once: ``[(buf, size, file_offset), ...]``; one future each.

        Those that take a polled queue of ours go out together, in one ``post_send``."""
        direct = self._direct
        if direct is None:
            return [self.pread(buf, size, file_offset) for buf, size, file_offset in requests]
        try:
            return [self._pread_array(direct, buf, size, file_offset, False)
                    or self._start(False, buf, size, file_offset, 0, post=False)
                    for buf, size, file_offset in requests]
        finally:  # those already written go out even if a later request was refused
            direct.post_reads()

    def read_batch(self, requests: list[tuple[Any, int, int]]) -> list[int]:
        """:meth:`pread_batch` and wait: the bytes read by each request."""
        return [future.get() for future in self.pread_batch(requests)]

    def _start(self, write: bool, buf: Any, size: int | None, file_offset: int,
               buf_offset: int, post: bool = True) -> IOFuture:
        if self._direct is None:
            return self._submit(self.write if write else self.read, buf, size, file_offset,
                                buf_offset)
        self._check_open()
        mem = self._memory(buf, write)
        size, file_offset, buf_offset = self._span(mem, size, file_offset, buf_offset)
        if write:
            self._check_write(file_offset, size)
        else:
            size = max(0, min(size, self.nbytes - file_offset))
        future = (self._own_queues(mem, buf_offset, size, file_offset, write=write, post=post)
                  if size else None)
        if future is None:  # nothing to move, or memory only the daemon's path can serve
            return self._submit(self.write if write else self.read, buf, size, file_offset,
                                buf_offset)
        return future

    def _submit(self, fn: Any, *args: Any) -> IOFuture:
        self._check_open()
        try:
            return IOFuture(self._executor.submit(fn, *args))
        except RuntimeError:  # the executor is shutting down: close() was called
            raise CompanionError(f"{self.path} is closed", errno.EBADF) from None


def _release(executor: concurrent.futures.ThreadPoolExecutor, direct: DirectQueues | None,
             staging: _Staging, channel: Any) -> None:
    """Let go of a file's threads, queues, registrations and connection."""
    executor.shutdown(wait=False)  # close() waited for its futures; a dropped file has none
    try:
        if direct is not None:
            direct.close()  # waits (bounded) for its requests in flight
            channel.call("report", moved=direct.moved())
    except NVMeoFError as exc:
        log.debug("closing the file's own queues: %s", exc)
    finally:
        staging.close()
        channel.close()


def _release_dropped(*resources: Any) -> None:
    """:func:`_release` for a file dropped unclosed, on a thread of its own: the collector
    may run on any thread, one of the file's own included."""
    threading.Thread(target=_release, args=resources, daemon=True,
                     name="nvmeof-fuse dropped file").start()


def _writable(buf: Any) -> Any:
    """``buf``, or a writable copy of it when it is a read-only contiguous buffer."""
    try:
        view = memoryview(buf)
    except TypeError:  # not a buffer: buffer_address names what it is
        return buf
    if not view.readonly or not view.c_contiguous:
        return buf
    return bytearray(view.cast("B"))


def _integer(value: Any, name: str) -> int:
    """``value`` as an int (a numpy integer is one too), or InvalidArgument naming it."""
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{name} must be an integer, got {value!r}") from None


def _host_view(obj: Any) -> memoryview:
    """The bytes of a numpy array, CPU tensor or buffer (shares memory)."""
    if hasattr(obj, "data_ptr"):  # a CPU tensor: its bytes through numpy
        import torch

        obj = obj.reshape(-1).view(torch.uint8).numpy()
    return memoryview(obj).cast("B")
