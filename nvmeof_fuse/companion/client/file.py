"""``nvmeof_fuse.File``: kvikio-style reads and writes of a mounted namespace file.

    arr = nvmeof_fuse.empty(64 << 20)              # memory the daemon can map
    with nvmeof_fuse.File("/mnt/nvme/n1") as f:
        f.read(arr, file_offset=12345)             # the target writes into arr by RDMA
        fut = f.pwrite(arr, 4096, file_offset=0)   # futures: fut.get()
        f.read(tensor, stream=torch.cuda.current_stream())  # CUDA memory, from any thread

Direct placement needs memory the daemon (or this process's own queues) can
register: an array from :func:`~nvmeof_fuse.empty` (or a view of one), a CUDA
tensor whose memory exports as a dma-buf to an RDMA mount, or, in the process
that mounted, any memory.  Anything else is staged through pinned bounce
memory shared with the daemon and copied here, like kvikio's compat mode: it
still works, :attr:`File.placement` says why, it is logged once, and the
daemon counts those bytes as staged.

Why one module: ``File`` is the public face, and each call chooses among the ways its
bytes can move (this process's own queues, polled or on its loop, the daemon's queues,
staging, CUDA) by one file's state (registrations, placement, transfers in flight); each
way lives in a module of its own beside this one.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import functools
import json
import logging
import operator
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from ...errors import InvalidArgument, NVMeoFError
from ...host.connect_options import QUEUES_PER_CLIENT
from ...host.memory import buffer_address
from ...host.namespace.byterange import NoSpace
from ..cuda import gpu
from ..cuda.dmabuf import DmabufCache
from ..protocol import CompanionError, plan_write
from . import shm
from .channel import LocalChannel, SocketChannel
from .cuda_via_own_tcp import OwnQueueRequests
from .future import IOFuture
from .local import served_here
from .memory_place import memory_place
from .shared_bounce import CallerMemory, Staging
from .via_daemon import DaemonIO, Placed

if TYPE_CHECKING:
    from .own_queues import DirectQueues

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0  # s per request, plus time for its bytes at MIN_RATE
MIN_RATE = 5e6  # bytes/s assumed when bounding a large request
TASK_SIZE = 4 << 20
"""Bytes a staged request's task moves at most (kvikio's ``task_size``)."""
STAGING_BYTES = 32 << 20
"""Bounce memory per file: what staged transfers may have in flight together."""
INFO_TIMEOUT = 10.0  # s for reading .nvmeof/companion.json (a hung mount blocks)
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` comes, in this process."""
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


class _Memory(NamedTuple):
    """Caller memory, resolved once per call: ``device`` for CUDA memory, else None."""

    device: gpu.DeviceMemory | None
    addr: int
    total: int
    owner: Any


class _NoDirect(Exception):
    """Why CUDA memory cannot be placed directly (then it is staged)."""


_open_other: Callable[..., Any] | None = None


def open_others_with(opener: Callable[..., Any]) -> None:
    """Have ``File(path, **options)`` ask ``opener(path, **options)`` first: another kind of
    file for a path it knows, or None.  The package registers the opener of a regular file
    of a filesystem on a namespace (:mod:`~nvmeof_fuse.companion.files.fsfile`), which
    sits above this module: this module never imports it."""
    global _open_other
    _open_other = opener


STAGED_HOST = "staged: only arrays from nvmeof_fuse.empty() are shared with the mount daemon"


class File:
    """A namespace file of a mounted controller, opened for direct placement.

    ``workers`` threads copy between staging memory and the caller's; staged
    transfers have at most ``staging_bytes`` in flight, cut into tasks of
    ``task_size`` bytes.  ``stream=`` orders the copies into and out of a CUDA
    buffer on the caller's CUDA stream (see :mod:`nvmeof_fuse.companion.cuda.gpu`).

    On a mount of several paths the file's own queues go to the path nearest its memory:
    ``near`` says where that is (a CUDA device: ``0``, ``"cuda:0"``, a ``torch.device`` or
    a tensor; ``"numa:1"``; a host buffer), by default the calling thread's NUMA node;
    ``path_index`` names a path instead (``nvmeof-fuse list`` numbers them).
    """

    def __new__(cls, path: str, *args: Any, **options: Any) -> Any:
        """A namespace file; a regular file of a filesystem on one opens as
        :class:`~nvmeof_fuse.companion.files.fsfile.FilesystemFile` instead."""
        if cls is File and _open_other is not None:
            other = _open_other(path, *args, **options)
            if other is not None:
                return other
        return super().__new__(cls)

    def __init__(self, path: str, *, timeout: float = DEFAULT_TIMEOUT,
                 compat_mode: bool | None = None, workers: int = 4,
                 queues: int = QUEUES_PER_CLIENT, task_size: int = TASK_SIZE,
                 staging_bytes: int = STAGING_BYTES, near: Any = None,
                 path_index: int | None = None) -> None:
        self.path = path
        self.timeout = timeout
        if compat_mode is None:
            compat_mode = os.environ.get("NVMEOF_FUSE_COMPAT_MODE", "").upper() in {"ON", "1"}
        self.compat_mode = compat_mode
        for name, value in (("workers", workers), ("task_size", task_size),
                            ("staging_bytes", staging_bytes)):
            if _integer(value, name) <= 0:
                raise InvalidArgument(f"{name} must be positive, got {value}")
        if path_index is not None and (type(path_index) is not int
                                       or not 0 <= path_index < 2**31):
            raise InvalidArgument(f"path_index must be a path's index (nvmeof-fuse list), "
                                  f"got {path_index!r}")
        if staging_bytes < task_size:
            raise InvalidArgument(f"staging_bytes {staging_bytes} must hold a task of "
                                  f"task_size {task_size} bytes")
        self.mountpoint, self.nsid, info = locate(path)
        local = served_here(info["socket"])
        address = "\0" + info["socket"][1:] if info["socket"].startswith("@") else info["socket"]
        self._channel: Any = (LocalChannel(local, timeout) if local is not None
                              else SocketChannel(address, timeout))
        self._mount = local
        self._cuda = gpu.ops()
        self._regions: dict[int, int] = {}  # shared allocation key -> region
        self._stale: list[int] = []  # regions of freed allocations, unregistered on next use
        self._lock = threading.Lock()  # guards _regions, _stale and _inflight
        self._register_lock = threading.Lock()  # one registration per allocation
        self._inflight: set[concurrent.futures.Future] = set()  # staged or via the daemon
        self._closed = False
        self._cuda_refusal = ""  # why CUDA memory is staged; empty: placed directly
        self._cuda_peer = False  # in-process: CUDA memory registered by address instead
        self._peer_error = ""  # why the in-process dma-buf failed
        self._pin_failure = ""
        try:
            hello = self._channel.hello(self.nsid)
            ns = hello["namespaces"].get(str(self.nsid))
            if ns is None:
                raise CompanionError(f"{path}: namespace {self.nsid} is not on this mount",
                                     errno.ENOENT)
            self.nbytes: int = ns["size"]
            self.lba_size: int = ns["lba_size"]
            self.read_only: bool = hello.get("read_only", False)
            self._task_size = max(task_size, 2 * self.lba_size)
            self._staging = Staging(self._channel, max(staging_bytes, self._task_size))
            self._direct = self._open_direct(hello, queues, near, path_index)
        except BaseException:
            self._channel.close()
            raise
        self._placement = self._first_placement(hello)
        self._report_placement()
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, "nvmeof-fuse file")
        # Nothing a transfer's callbacks hold refers back to this file (a dropped file is
        # collected): the budget is a plain function of the timeout.
        self._io = DaemonIO(self._channel, self.nsid, self.lba_size, self._staging,
                            self._task_size, self._executor, functools.partial(_budget, timeout))
        # CUDA memory on our own NVMe/TCP queues: staged here, the same tasks on our queues
        self._own_io = None if self._direct is None or not self._direct.host_memory_only else \
            DaemonIO(OwnQueueRequests(self._direct, self._staging, self.lba_size), self.nsid,
                     self.lba_size, self._staging, self._task_size, self._executor,
                     functools.partial(_budget, timeout))
        channel = self._channel
        self._dmabufs = DmabufCache(self._cuda, channel.register_dmabuf, channel.forget)
        # A file dropped unclosed still lets go of its queues, registrations and connection.
        self._dropped = weakref.finalize(self, _release_dropped, self._executor, self._direct,
                                         self._staging, self._channel, self._dmabufs)
        self._dropped.atexit = False  # at exit the connection goes with the process
        shm.on_free(self._forget)

    def _open_direct(self, hello: dict, queues: int, near: Any, path_index: int | None
                     ) -> DirectQueues | None:
        """Queues of our own on the mount, unless in-process, compat mode or refused; on a
        multipath mount, on the path nearest ``near`` (:func:`.memory_place.memory_place`),
        or on path ``path_index``."""
        explicit = near is not None
        place = memory_place(near, self._cuda) if explicit else None  # bad: said at once
        if self._mount is not None or self.compat_mode or queues <= 0:
            return None
        why = hello.get("leasing", "the mount daemon is too old to lease queues")
        if why == "on":
            from .own_queues import open_direct

            if not explicit:
                place = memory_place(None, self._cuda)  # the calling thread's NUMA node
            wish = {"memory": place.to_field() if place is not None else None,
                    "path": path_index}
            direct, why = open_direct(self._channel, self.timeout, queues, self.nsid,
                                      {k: v for k, v in wish.items() if v is not None})
            if direct is not None:
                direct.on_path = _weakly(self._moved_path)  # the queues outlive a dropped file
                return direct
        warn_once(f"lease:{why}", f"nvmeof_fuse: {why}; moving data over the mount "
                   "daemon's queues instead (slower; counted as direct_* or staged_*)")
        return None

    def _first_placement(self, hello: dict) -> dict[str, str]:
        """How each kind of caller memory moves, as far as the hello tells."""
        if self.compat_mode:
            self._cuda_refusal = "compat mode is on"
            return dict.fromkeys(("shared", "host", "cuda"), "staged: compat mode is on")
        if self._mount is not None:
            shared = host = "direct: registered by this process, which serves the mount"
        elif self._direct is not None:
            shared = host = f"direct: {self._own_path()}"
        else:
            shared, host = "direct: the mount daemon maps the array's pages", STAGED_HOST
        path = {"path": self._direct.path} if self._direct is not None and \
            self._direct.path else {}
        refusal = (hello.get("placement") or {}).get("dmabuf", "on")
        if self._direct is not None and self._direct.host_memory_only:
            cuda = (f"staged: by this process over its own queues "
                    f"({self._direct.host_memory_only})")
        elif refusal != "on":
            self._cuda_refusal = refusal
            cuda = f"staged: {refusal}"
        else:
            cuda = "direct (dma-buf) if the GPU and the RDMA device take it; not tried yet"
        return {"shared": shared, "host": host, "cuda": cuda, **path}

    def _moved_path(self, path: str) -> None:
        """Our queues stopped serving to reconnect, or serve on a path again (a loss, or a
        nearer one back)."""
        log.info("nvmeof_fuse: %s: queues now %s", self.path, path)
        self._place("path", path)

    @property
    def placement(self) -> dict[str, str]:
        """For each kind of memory (``shared``: arrays from :func:`~nvmeof_fuse.empty`,
        ``host``: other host memory, ``cuda``), whether data is placed directly, and if
        not, why: one line each; on a multipath mount, ``path``: which path this file's
        own queues are on, its device and how near the memory is (``direct via path 1
        (mlx5_1, PIX to GPU 0000:9a:00.0)``), or that they reconnect meanwhile."""
        return dict(self._placement)

    def _place(self, kind: str, how: str, warning: str = "") -> None:
        """Note how ``kind`` memory moves now; tell the daemon, and the log once."""
        if self._placement.get(kind) == how:
            return
        self._placement[kind] = how
        if warning:
            warn_once(f"{kind}:{how}", warning)
        self._report_placement()

    def _report_placement(self) -> None:
        """Tell the daemon (its per-client stats show it), without waiting."""
        try:
            self._channel.report(moved={}, placement=self._placement)
        except NVMeoFError as exc:  # the daemon is gone: transfers will say so
            log.debug("reporting placement: %s", exc)

    def _own_path(self) -> str:
        """How host memory moves on this file's own queues."""
        assert self._direct is not None
        fabric = self._direct.fabric
        if fabric is not None and not fabric.places_directly:
            tls = self._direct.record_layer
            return (f"received and sent by this process's own {fabric.title} queues"
                    + (f" ({tls})" if tls else ""))
        return "registered with this process's own queues"

    def _refuse_cuda(self, reason: str) -> None:
        """CUDA memory of this file is staged from now on (never asked for again)."""
        self._cuda_refusal = reason
        advice = (" (mount over RDMA to place data in GPU memory directly)"
                  if "NVMe/TCP" in reason else "")
        self._place("cuda", f"staged: {reason}",
                    f"nvmeof_fuse: {self.path}: CUDA memory is staged through pinned host "
                    f"memory: {reason}{advice}")

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
        """Wait (bounded) for pending transfers, then release this file's registrations."""
        if self._closed:
            return
        self._closed = True  # new calls fail from here on
        with self._lock:
            pending = list(self._inflight)
        concurrent.futures.wait(pending, timeout=self.timeout)
        self._executor.shutdown(wait=True)
        self._dropped.detach()
        shm.remove_on_free(self._forget)
        _release(self._executor, self._direct, self._staging, self._channel, self._dmabufs)

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
        """The daemon's companion counters (bytes over clients' own queues, over the daemon's
        queues directly and staged, in total and per client), and under ``file`` this
        file's own: its placement, staging slots and dma-buf registrations."""
        if self._direct is not None:
            daemon = self._channel.call("stats", moved=self._direct.moved())["stats"]
        else:
            daemon = self._channel.stats()
        counts = dict(self._dmabufs.counts)
        live = self._dmabufs.live()
        if self._direct is not None:
            for name, value in self._direct.dmabuf_counts().items():
                counts[name] = counts.get(name, 0) + value
            live += self._direct.dmabuf_live()
        return {**daemon, "file": {"placement": self.placement, **self._staging.snapshot(),
                                   **counts, "dmabuf_live": live,
                                   "staging_pin_failure": self._pin_failure}}

    # -- caller memory ---------------------------------------------------------------------

    def _memory(self, buf: Any, write: bool = False) -> _Memory:
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
        if self._cuda.is_cuda(buf):
            device = self._cuda.memory(buf)
            return _Memory(device, device.ptr, device.nbytes, buf)
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

    def _caller(self, mem: _Memory, buf_offset: int, stream: int | None) -> CallerMemory:
        cuda = self._cuda if mem.device is not None else None
        return CallerMemory(cuda, mem.device, mem.addr, buf_offset, stream, mem.owner)

    def _placed(self, mem: _Memory, buf_offset: int, size: int) -> Placed | None:
        """The caller's memory registered with the daemon, or None: staged (and why, once)."""
        if self.compat_mode:
            warn_once("staged:compat", "nvmeof_fuse: compat mode is on; staging data "
                       "through a bounce buffer (slower; the daemon counts it as staged)")
            return None
        if mem.device is not None:
            return self._placed_cuda(mem, buf_offset, size)
        addr = mem.addr + buf_offset
        if self._mount is not None:
            found = self._mount.registered(addr, size)
            if found is not None:
                return Placed(found[0], found[1], None)
            rid = self._channel.register_local(addr, size, mem.owner)
            return Placed(rid, 0, functools.partial(self._channel.forget, rid))
        found = shm.find(addr, size)
        if found is None:
            warn_once("staged:host", "nvmeof_fuse: the buffer is not shared memory (use "
                       "nvmeof_fuse.empty()); staging data through a bounce buffer (slower; "
                       "the daemon counts it as staged)")
            return None
        shared, offset = found
        with self._register_lock:
            with self._lock:
                rid = self._regions.get(shared.key)
            if rid is None:
                rid = self._channel.register_shared(shared)
                with self._lock:
                    self._regions[shared.key] = rid
        return Placed(rid, offset, None)

    def _placed_cuda(self, mem: _Memory, buf_offset: int, size: int) -> Placed | None:
        if self._cuda_refusal:
            return None
        device = mem.device
        assert device is not None
        addr = device.ptr + buf_offset
        if self._mount is not None:
            found = self._mount.registered(addr, size)
            if found is not None:
                return Placed(found[0], found[1], None)
        if not self._cuda_peer:
            try:
                entry, offset = self._dmabuf(self._dmabufs, device)
            except (_NoDirect, gpu.CudaError, NVMeoFError) as exc:
                if self._mount is None:
                    self._refuse_cuda(str(exc))
                    return None
                self._cuda_peer = True  # nvidia_peermem registers device addresses
                self._peer_error = str(exc)
            else:
                self._place("cuda", "direct: dma-buf registered with the mount daemon")
                return Placed(entry.handle, offset + buf_offset,
                              functools.partial(self._dmabufs.done, entry))
        try:  # in-process only: the peer-memory path (nvidia_peermem)
            rid = self._channel.register_local(addr, size, mem.owner)
        except NVMeoFError as exc:
            self._refuse_cuda(f"dma-buf: {self._peer_error}; peer memory: {exc}")
            return None
        self._place("cuda", "direct: registered by address (peer memory)")
        return Placed(rid, 0, functools.partial(self._channel.forget, rid))

    def _dmabuf(self, cache: DmabufCache, device: gpu.DeviceMemory) -> tuple[Any, int]:
        """``cache``'s registration of ``device``'s allocation, if the GPU exports dma-bufs."""
        if not self._cuda.dmabuf_supported(device.device):
            raise _NoDirect(f"GPU {device.device} has no dma-buf support")
        return cache.acquire(device)

    def _pin_staging(self, device: gpu.DeviceMemory) -> None:
        """Page-lock the staging memory once, so copies to and from the GPU run at full
        speed; if the driver refuses, copies still work, slower, and the log says why."""
        staging = self._staging
        if staging.pinned is not None or self._pin_failure:
            return
        with self._register_lock:
            if staging.pinned is not None or self._pin_failure:
                return
            try:
                self._cuda.pin(device, staging.addr, len(staging.mem))
                staging.pinned = (self._cuda, device.context)
            except gpu.CudaError as exc:
                self._pin_failure = str(exc)
                warn_once(f"pin:{exc}", f"nvmeof_fuse: cannot page-lock the staging "
                           f"memory ({exc}); copies to and from the GPU run slower")

    # -- transfers ---------------------------------------------------------------------------

    def _budget(self, nbytes: int) -> float:
        return _budget(self.timeout, nbytes)

    def _check_open(self) -> None:
        if self._closed:
            raise CompanionError(f"{self.path} is closed", errno.EBADF)
        if self._stale:
            self._unregister_stale()

    def read(self, buf: Any, size: int | None = None, file_offset: int = 0,
             buf_offset: int = 0, *, stream: Any = None) -> int:
        """Read into ``buf``; returns the bytes read (short at the end of the namespace).
        :meth:`pread` and wait: the same checks, counts and errors."""
        return self.pread(buf, size, file_offset, buf_offset, stream=stream).get()

    def write(self, buf: Any, size: int | None = None, file_offset: int = 0,
              buf_offset: int = 0, *, stream: Any = None) -> int:
        """Write ``buf`` at ``file_offset``; returns the bytes written.  ``buf`` may be
        read-only (``bytes``): then it is copied first."""
        return self._start(True, buf, size, file_offset, buf_offset, stream).get()

    def pread(self, buf: Any, size: int | None = None, file_offset: int = 0,
              buf_offset: int = 0, *, stream: Any = None) -> IOFuture:
        """Start :meth:`read`; the future's ``get()`` gives the bytes read."""
        direct = self._direct
        if direct is not None and not buf_offset and stream is None and direct.live:
            future = self._pread_array(direct, buf, size, file_offset, True)
            if future is not None:
                return future
        return self._start(False, buf, size, file_offset, buf_offset, stream)

    def pwrite(self, buf: Any, size: int | None = None, file_offset: int = 0,
               buf_offset: int = 0, *, stream: Any = None) -> IOFuture:
        """Start :meth:`write`; the future's ``get()`` gives the bytes written."""
        return self._start(True, buf, size, file_offset, buf_offset, stream)

    def _check_write(self, file_offset: int, size: int) -> None:
        if self.read_only:
            raise CompanionError(f"{self.path} is mounted read-only", errno.EROFS)
        if file_offset + size > self.nbytes:
            raise NoSpace(f"write of {size} bytes at offset {file_offset} extends past the "
                          f"end of {self.path} ({self.nbytes} bytes)")

    def _start(self, write: bool, buf: Any, size: int | None, file_offset: int,
               buf_offset: int, stream: Any, post: bool = True) -> IOFuture:
        self._check_open()
        mem = self._memory(buf, write)
        size, file_offset, buf_offset = self._span(mem, size, file_offset, buf_offset)
        if write:
            self._check_write(file_offset, size)
        else:
            size = max(0, min(size, self.nbytes - file_offset))
        handle = gpu.stream_handle(stream)
        if not size:
            return IOFuture.finished(0)
        # reads go through the daemon while our queues wait for a lease again (a lost path
        # of a multipath mount: the daemon's other paths serve them); writes wait, as they
        # may be under a delegation of ours
        if self._direct is not None and (write or self._direct.live):
            future = self._own_queues(mem, buf_offset, size, file_offset, write, post, handle)
            if future is not None:
                return future
        return self._via_daemon(write, mem, buf_offset, size, file_offset, handle)

    def _via_daemon(self, write: bool, mem: _Memory, buf_offset: int, size: int,
                    file_offset: int, stream: int | None) -> IOFuture:
        """A transfer over the mount daemon's queues: placed in registered memory, or staged."""
        placed = self._placed(mem, buf_offset, size)
        if placed is None:
            return self._staged(self._io, mem, buf_offset, size, file_offset, write, stream)
        caller = self._caller(mem, buf_offset, stream)
        device, io = mem.device, self._io
        try:
            if device is not None and write:
                self._cuda.synchronize(device, stream)  # what produces it is done
        except BaseException:
            if placed.release is not None:
                placed.release()
            raise
        if write:
            transfer = io.write_placed(caller, placed, file_offset, size)
        else:
            after = None  # the target wrote GPU memory: made visible to CUDA after
            if device is not None:
                after = functools.partial(self._cuda.flush_gpudirect_writes, device)
            transfer = io.read_placed(caller, placed, file_offset, size, after)
        future = transfer.future
        if placed.release is not None:
            release = placed.release
            future.add_done_callback(lambda _: release())
        return self._tracked(future, self._budget(size))

    def _staged(self, io: Any, mem: _Memory, buf_offset: int, size: int, file_offset: int,
                write: bool, stream: int | None, extra: float = 0.0) -> IOFuture:
        """A transfer staged through ``io``'s staging memory (the daemon's queues, or our
        own NVMe/TCP queues: :mod:`.cuda_via_own_tcp`) and copied to or from the caller's memory
        here; ``extra`` seconds are added to its wait."""
        device = mem.device
        if device is not None:
            self._pin_staging(device)
            if write and stream is None:  # the copy out of it goes on the thread's own stream
                self._cuda.synchronize(device, stream)
        caller = self._caller(mem, buf_offset, stream)
        transfer = (io.write_staged(caller, file_offset, size) if write else
                    io.read_staged(caller, file_offset, size))
        return self._tracked(transfer.future, self._budget(size) + extra)

    def _tracked(self, future: Any, budget: float) -> IOFuture:
        """``future`` counted in flight (:meth:`close` waits for it) until it is done."""
        with self._lock:
            self._inflight.add(future)
        future.add_done_callback(functools.partial(_discard, self._inflight, self._lock))
        return IOFuture(future, None, budget)

    def _own_queues(self, mem: _Memory, buf_offset: int, size: int, file_offset: int,
                    write: bool, post: bool, stream: int | None) -> IOFuture | None:
        """Start a transfer on this file's own queues; None when the memory cannot be
        registered here (then the daemon's path serves it)."""
        direct = self._direct
        assert direct is not None
        device = mem.device
        if device is not None and self._own_io is not None:
            return self._staged(self._own_io, mem, buf_offset, size, file_offset, write,
                                stream, direct.renew_timeout)
        caller = self._caller(mem, buf_offset, stream)
        if device is not None:
            if self._cuda_refusal:
                return None
            try:
                region, at, release = self._dmabuf_own(direct, device)
            except (_NoDirect, gpu.CudaError, NVMeoFError) as exc:
                self._refuse_cuda(str(exc))
                return None
            at += buf_offset
            self._place("cuda", "direct: dma-buf registered with this process's own queues")
        else:
            addr = mem.addr + buf_offset
            try:
                region, at, temporary = direct.host_region(addr, size, mem.owner)
            except NVMeoFError as exc:
                warn_once(f"own-reg:{exc}", f"nvmeof_fuse: cannot register the buffer for "
                           f"our own queues ({exc}); using the mount daemon")
                return None
            if not write and not temporary:  # the common case first: nothing to do after
                polled = direct.polled.read(self.nsid, region, at, size, file_offset,
                                            mem.owner, self._budget(size) + direct.renew_timeout,
                                            post)
                if polled is not None:
                    return polled
            release = region.close if temporary else None
        finish = None
        try:
            if write:
                if device is not None:  # the NIC reads it: what produces it is done
                    self._cuda.synchronize(device, stream)
                plan = plan_write(file_offset, size, self.lba_size)
                head = caller.get_bytes(plan.head.start, plan.head.stop - plan.head.start)
                tail = caller.get_bytes(plan.tail.start, plan.tail.stop - plan.tail.start)
        except BaseException:
            if release is not None:
                release()
            raise
        if write:
            def get(start: int, length: int, _caller: CallerMemory = caller) -> bytes:
                """Edge bytes; holds the caller's buffer (the NIC reads it) until done."""
                return head if start == 0 else tail

            future = direct.start(direct.write, self.nsid, region, at, size, file_offset, get,
                                  release)
        elif device is None:  # host memory: edges land from the loop, nothing after
            future = direct.start(direct.read, self.nsid, region, at, size, file_offset,
                                  caller.put_bytes, release)
        else:  # edges collected on the loop, copied to the GPU by whoever gets the result
            edges: list[tuple[int, bytes]] = []
            future = direct.start(direct.read, self.nsid, region, at, size, file_offset,
                                  lambda at, data: edges.append((at, bytes(data))), release)

            cuda = self._cuda

            def finish() -> None:
                for dest, data in edges:
                    caller.put_bytes(dest, data)
                cuda.flush_gpudirect_writes(device)

        return IOFuture(future, finish, self._budget(size) + direct.renew_timeout)

    def _dmabuf_own(self, direct: DirectQueues, device: gpu.DeviceMemory
                    ) -> tuple[Any, int, Any]:
        """``(region, offset, release)`` of ``device``'s allocation in our own queues' PD."""
        cache = direct.dmabufs(self._cuda)
        entry, offset = self._dmabuf(cache, device)
        region, _cleanup = entry.handle
        return region, offset, functools.partial(cache.done, entry)

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
        polled = direct.polled.queues(size)
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
        return direct.polled.read_lbas(polled, self.nsid, region, at, size, file_offset,
                                       file_offset // lba_size, size // lba_size, buf,
                                       self._budget(size) + direct.renew_timeout, post)

    def pread_batch(self, requests: list[tuple[Any, int, int]]) -> list[IOFuture]:
        """Start many reads at once: ``[(buf, size, file_offset), ...]``; one future each.

        Those that take a polled queue of ours go out together, in one ``post_send``."""
        direct = self._direct
        if direct is None or not direct.live:
            return [self.pread(buf, size, file_offset) for buf, size, file_offset in requests]
        try:
            return [self._pread_array(direct, buf, size, file_offset, False)
                    or self._start(False, buf, size, file_offset, 0, None, post=False)
                    for buf, size, file_offset in requests]
        finally:  # those already written go out even if a later request was refused
            direct.polled.post()

    def read_batch(self, requests: list[tuple[Any, int, int]]) -> list[int]:
        """:meth:`pread_batch` and wait: the bytes read by each request."""
        return [future.get() for future in self.pread_batch(requests)]


def _release(executor: concurrent.futures.ThreadPoolExecutor, direct: DirectQueues | None,
             staging: Staging, channel: Any, dmabufs: DmabufCache) -> None:
    """Let go of a file's threads, queues, registrations and connection."""
    executor.shutdown(wait=False)  # close() waited for its transfers; a dropped file has none
    dmabufs.close()
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


def _weakly(method: Any) -> Callable[..., None]:
    """``method`` called while its object lives, without keeping it alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


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


def _budget(timeout: float, nbytes: int) -> float:
    """How long a transfer of ``nbytes`` may take."""
    return timeout + nbytes / MIN_RATE


def _discard(inflight: set, lock: threading.Lock, future: concurrent.futures.Future) -> None:
    with lock:
        inflight.discard(future)

