"""``nvmeof_fuse.mount``: mount from Python, serve FUSE in the background, reach the controller.

    with nvmeof_fuse.mount("/mnt/nvme", traddr="10.0.0.1", nqn=NQN) as m:
        arr = numpy.zeros(1 << 20, dtype=numpy.uint8)
        with m.register(arr):                       # one MR in the controller's PD
            with nvmeof_fuse.File(m.path(1)) as f:
                f.read(arr, file_offset=4096)       # straight into arr

The mount runs on a thread of its own (``trio.run``); ``ls``, ``fio`` and other
processes (through the companion socket) use it meanwhile.  Leaving the block
drains, flushes, unmounts and disconnects.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from .companion.client import local
from .companion.cuda import gpu
from .companion.protocol import CompanionError
from .companion.server.session import ClientSession
from .daemon import serve_mount
from .errors import InvalidArgument, NVMeoFError
from .host.memory import buffer_address
from .host.sync import SyncController
from .transport import registry

T = TypeVar("T")
READY_TIMEOUT = 120.0  # s for connect + mount
STOP_TIMEOUT = 90.0  # s for drain + flush + unmount + disconnect


class _Unmounted(CompanionError):
    """The mount was unmounted from outside: its normal end, not a failure of close()."""


@dataclass(eq=False)
class Registration:
    """Memory registered on a mount; ``close()`` (or leaving ``with``) unregisters it."""

    mount: Mount
    region: int
    addr: int
    nbytes: int
    obj: Any

    def close(self) -> None:
        self.mount._unregister(self)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Mount:
    """A controller mounted by this process; see :func:`mount`.

    The mount is served on the loop of a :class:`SyncController` (the one bridge
    between trio and the caller's threads); its "controller" is the served mount.
    """

    def __init__(self, mountpoint: str, conn: Any, mopts: Any, *,
                 ready_timeout: float = READY_TIMEOUT, connect: Any = None) -> None:
        self.mountpoint = mountpoint
        self._mopts = mopts
        self._connect = connect
        self.controller: Any = None
        self.server: Any = None
        self.session: ClientSession | None = None
        self._registrations: list[Registration] = []
        self._bridge = SyncController(conn, connect=self._serving, ready_timeout=ready_timeout,
                                      stop_timeout=STOP_TIMEOUT)
        try:
            self._bridge.controller  # mounted, or its error raised here  # noqa: B018
        except BaseException:
            self._bridge.close()
            raise

    @contextlib.asynccontextmanager
    async def _serving(self, conn: Any) -> AsyncIterator[Any]:
        """Serve the mount on the bridge's loop; leaving stops it in order (drain, flush,
        unmount, disconnect).  An unmount from outside ends the bridge with its reason."""
        ready, stop = trio.Event(), trio.Event()

        def on_ready(controller: Any, server: Any) -> None:
            self.controller, self.server = controller, server
            self.session = server.new_session("in-process")
            local.publish(server.info()["socket"], self)
            ready.set()

        async def run() -> None:
            await serve_mount(conn, self._mopts, self.mountpoint, on_ready, self._connect, stop)
            if not stop.is_set():  # ends the bridge: later calls name it
                raise _Unmounted(f"the mount at {self.mountpoint} was unmounted",
                                 errno.ENOTCONN)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await ready.wait()
                try:
                    yield self.controller
                finally:
                    stop.set()
        finally:
            local.withdraw(self)

    # -- calls from other threads -------------------------------------------------------------

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` on the mount's loop (callers bound it themselves)."""
        return self._bridge.call(fn, *args)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        return self._bridge.call_sync(fn, *args)

    @property
    def namespaces(self) -> dict[int, Any]:
        """Namespaces by NSID (``.size``, ``.lba_size``, ``.nlb``)."""
        return dict(self.controller.namespaces)

    def path(self, nsid: int) -> str:
        if nsid not in self.controller.namespaces:
            raise InvalidArgument(f"namespace {nsid} is not on the mount at {self.mountpoint}")
        return f"{self.mountpoint}/n{nsid}"

    def open(self, nsid: int, **kwargs: Any) -> Any:
        """An :class:`~nvmeof_fuse.File` on namespace ``nsid``."""
        from .companion.client.file import File

        return File(self.path(nsid), **kwargs)

    def stats(self) -> dict:
        """The companion counters (direct and staged bytes, clients, regions)."""
        return self.run_sync(self.server.snapshot)

    def register(self, obj: Any) -> Registration:
        """Register a numpy array, a host tensor or a CUDA tensor with the controller.

        CUDA memory is exported as a dma-buf; where that fails, the peer-memory
        path (``nvidia_peermem``) registers the device address itself.
        """
        assert self.session is not None
        session = self.session
        cuda = gpu.ops()
        if cuda.is_cuda(obj):
            device = cuda.memory(obj)
            addr, nbytes = device.ptr, device.nbytes
            base, offset, length = gpu.page_span(addr, nbytes)
            try:
                fd = cuda.export_dmabuf(device, base, length)
                rid = self.run_sync(session.register_dmabuf, fd, offset, nbytes, addr)
            except (NVMeoFError, RuntimeError, OSError, ValueError) as dmabuf_error:
                try:
                    rid = self.run_sync(session.register_address, addr, nbytes, obj)
                except NVMeoFError as peer_error:
                    raise CompanionError(f"cannot register the CUDA tensor: dma-buf: "
                                         f"{dmabuf_error}; peer memory: {peer_error}") from None
        else:
            addr, nbytes, owner = buffer_address(obj)
            rid = self.run_sync(session.register_address, addr, nbytes, owner)
        reg = Registration(self, rid, addr, nbytes, obj)
        self._registrations.append(reg)
        return reg

    def _unregister(self, reg: Registration) -> None:
        if reg in self._registrations:
            self._registrations.remove(reg)
            assert self.session is not None
            try:
                self.run_sync(self.session.unregister, reg.region)
            except NVMeoFError:  # the mount is gone, and its registrations with it
                pass

    def registered(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """``(region, offset)`` of a registration holding ``[addr, addr + nbytes)``."""
        for reg in list(self._registrations):
            if reg.addr <= addr and addr + nbytes <= reg.addr + reg.nbytes:
                return reg.region, addr - reg.addr
        return None

    # -- stopping --------------------------------------------------------------------------------

    def close(self) -> None:
        """Drain, flush, unmount and disconnect (bounded); idempotent.

        A mount already unmounted from outside (``fusermount3 -u``) closes quietly.
        """
        try:
            self._bridge.close()
        except _Unmounted:
            pass

    def __enter__(self) -> Mount:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mount(mountpoint: str, *, traddr: str, nqn: str, transport: str = registry.DEFAULT,
          trsvcid: int = registry.IO_PORT, read_only: bool = False, allow_other: bool = False,
          uid: int | None = None, gid: int | None = None, mode: int | None = None,
          fuse: str = "builtin", connect: Any = None, ready_timeout: float = READY_TIMEOUT,
          **options: Any) -> Mount:
    """Mount ``nqn`` at ``traddr`` on ``mountpoint``; use as a context manager.

    ``options`` are :class:`~nvmeof_fuse.host.controller.ConnectOptions` fields with
    nvme-cli's names (``host_traddr``, ``hostnqn``, ``hostid``, ``nr_io_queues``,
    ``queue_size``, ``keep_alive_tmo``, ``reconnect_delay``, ``ctrl_loss_tmo``, ``timeout``).
    ``fuse`` picks the FUSE server: ``"builtin"`` (ours) or ``"pyfuse3"`` (an extra).
    """
    from .fs.mount_options import DEFAULT_MODE, MountOptions
    from .host.controller import ConnectOptions

    try:
        conn = ConnectOptions(traddr=traddr, nqn=nqn, transport=transport, trsvcid=trsvcid,
                              **options)
    except TypeError as exc:
        raise InvalidArgument(f"mount: {exc}") from None
    conn.validate()
    mopts = MountOptions(read_only=read_only, allow_other=allow_other, uid=uid, gid=gid,
                         mode=DEFAULT_MODE if mode is None else mode, fuse=fuse)
    return Mount(mountpoint, conn, mopts, ready_timeout=ready_timeout, connect=connect)
