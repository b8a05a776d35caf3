"""Mount a controller and serve it until unmounted or cancelled.

One of two FUSE servers answers the requests with the same operations (fs/operations.py):
our own session on /dev/fuse (fs/session.py, the default) or pyfuse3 (fs/pyfuse3_server.py,
``MountOptions.fuse == "pyfuse3"``, an optional extra).  Both are a :class:`FuseServer`.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import trio

from nvmeof_fuse.concurrency import in_thread, unwrap_groups
from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.fs.devfuse import FuseMountError, mount_fd
from nvmeof_fuse.fs.info import CompanionLike, ControllerLike
from nvmeof_fuse.fs.mount_options import FUSE_SERVERS, MountOptions
from nvmeof_fuse.fs.operations import Kernel, NamespaceFS
from nvmeof_fuse.fs.session import FuseSession
from nvmeof_fuse.fs.wire import InitParams

__all__ = [
    "FuseServer",
    "MountError",
    "MountOptions",
    "check_fuse_server",
    "check_mountpoint",
    "check_mountpoint_async",
    "serve",
    "stale_message",
]

log = logging.getLogger(__name__)

FSNAME = "nvmeof-fuse"
SUBTYPE = "nvmeof-fuse"  # mounts show up as fstype fuse.nvmeof-fuse, the type fstab names
CHECK_TIMEOUT = 10.0  # s for stat()s of the mountpoint: a hung FUSE mount blocks them
DRAIN_TIMEOUT = 30.0  # s for open files to close, then requests in flight, once asked to stop
ANSWER_LEAST = 1.0
"""Seconds of a drain with a deadline (the mount's exit) kept for answering the requests in
flight: the wait for open files to be closed ends this long before it."""
# Async (aio, O_DIRECT) FUSE requests the kernel keeps in flight to us (INIT's max_background).
# The kernel's default of 12 (FUSE_DEFAULT_MAX_BACKGROUND) holds back a queue depth of 16.
# 32 matches the controller's bounce buffers, which each request in flight holds; with FUSE
# workers each process has its own, so a mount allows 32 per serving process, and each
# process leaves the connection to the others while it holds 32 (RequestLoop's limit).
MAX_BACKGROUND = 32
MAX_WRITE = 1 << 20  # bytes per READ/WRITE request (FUSE_MAX_PAGES)
FUSECTL = "/sys/fs/fuse/connections"


class MountError(NVMeoFError):
    """The mountpoint is unusable or the kernel refused the mount."""

    errno = errno.EBUSY


class Exit(Protocol):
    """A mount's exit as the drain sees it (the daemon's exit plan): by when the drain must
    be done (trio time), and where it says what it left undone (for the mount's last line)."""

    drain_by: float
    skipped: list[str]


class FuseServer(Kernel, Protocol):
    """What answers a mount's FUSE requests with :class:`NamespaceFS`, and asks the kernel to
    forget what it caches (:class:`Kernel`).  :meth:`run` serves until the kernel ends the
    session (unmounted: then ``gone``) or until :meth:`stop_reading`, after which the requests
    in flight are answered before it returns; :meth:`close` lets go of /dev/fuse."""

    gone: bool

    async def run(self) -> None: ...

    def stop_reading(self) -> None: ...

    def close(self) -> None: ...


def check_fuse_server(name: str) -> ModuleType | None:
    """Raise MountError, in one line, unless the FUSE server ``name`` can run here; pyfuse3's
    module when that is the one (None for ours)."""
    if name not in FUSE_SERVERS:
        raise MountError(f"unknown FUSE server {name!r} (known: {', '.join(FUSE_SERVERS)})")
    if name != "pyfuse3":
        return None
    try:
        from nvmeof_fuse.fs import pyfuse3_server
    except ImportError as exc:
        raise MountError(f"fuse=pyfuse3 needs pyfuse3, which cannot be imported ({exc}): "
                         "pip install 'nvmeof-fuse[pyfuse3]' (builds with libfuse3-dev and "
                         "pkg-config)") from None
    return pyfuse3_server


@dataclass(frozen=True)
class MountInfo:
    mountpoint: str
    fstype: str
    source: str
    dev: str = ""  # "major:minor" of the superblock


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def read_mountinfo(path: str = "/proc/self/mountinfo") -> list[MountInfo]:
    """Mounts of this process's namespace (see proc(5))."""
    mounts = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) >= 5 and len(rfields) >= 2:
                mounts.append(MountInfo(_unescape(fields[4]), rfields[0], _unescape(rfields[1]),
                                        fields[2]))
    return mounts


def _find_mount(path: str) -> MountInfo | None:
    path = os.path.abspath(path)
    found = [m for m in read_mountinfo() if m.mountpoint == path]
    return found[-1] if found else None


def stale_message(path: str) -> str:
    path = os.path.abspath(path)
    m = _find_mount(path)
    if m is None or m.source == FSNAME or m.fstype == f"fuse.{SUBTYPE}":
        what = "stale mount from a dead nvmeof-fuse daemon"
    else:
        what = f"stale {m.fstype} mount (its daemon is gone)"
    return f"{what} at {path}; clear it with: fusermount3 -u {path}"


def check_mountpoint(path: str) -> str:
    """Return ``path`` made absolute, or raise MountError saying why it can't be mounted on."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MountError(f"mountpoint {path} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise MountError(stale_message(path)) from None
        raise MountError(f"cannot use mountpoint {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"mountpoint {path} is not a directory")
    real = os.path.realpath(path)
    if os.path.ismount(path) or _find_mount(real) is not None:
        raise MountError(f"{path} is already a mountpoint; unmount it first")
    return os.path.abspath(path)


def fuse_options(options: MountOptions) -> set[str]:
    """The mount options given to fusermount3 (``,`` in the fsname escaped for it)."""
    fsname = (options.source or FSNAME).replace("\\", "\\\\").replace(",", "\\,")
    opts = {f"fsname={fsname}", f"subtype={SUBTYPE}", "default_permissions"}
    if options.allow_other:
        opts.add("allow_other")
    if options.read_only:
        opts.add("ro")
    return opts


def raise_max_background(path: str, value: int = MAX_BACKGROUND,
                         fusectl: str = FUSECTL) -> int | None:
    """Let the kernel send up to ``value`` async requests at once; the limit now, or None.

    Goes through the fusectl file system (``/sys/fs/fuse/connections/<dev>/``),
    which needs it mounted (systemd does) and root; otherwise the kernel's
    default stays and this says so at debug level.  Never lowers the limit.
    """
    m = _find_mount(path)
    if m is None or not m.dev.startswith("0:"):
        return None
    knob = os.path.join(fusectl, m.dev.split(":")[1], "max_background")
    try:  # fusectl files take one read or write each, from offset 0, and cannot seek
        with open(knob, "rb", buffering=0) as f:
            current = int(f.read(32))
        if current < value:
            fd = os.open(knob, os.O_WRONLY)  # no O_TRUNC: it is not a regular file
            try:
                os.write(fd, str(value).encode())
            finally:
                os.close(fd)
            current = value
    except (OSError, ValueError) as exc:
        log.debug("kept the kernel's FUSE max_background: %s", exc)
        return None
    log.debug("FUSE max_background is %d", current)
    return current


def check_nsid(controller: ControllerLike, nsid: int | None) -> None:
    """Raise MountError unless ``nsid`` (when given) is an active namespace of ``controller``."""
    if nsid is not None and nsid not in controller.namespaces:
        active = ", ".join(str(n) for n in sorted(controller.namespaces)) or "none"
        raise MountError(f"namespace {nsid} is not active on the controller (active: {active})")


async def check_mountpoint_async(path: str) -> str:
    """check_mountpoint in a thread, bounded: a hung FUSE mount blocks stat()."""
    return await in_thread(check_mountpoint, path, timeout=CHECK_TIMEOUT, too_slow=MountError(
        f"mountpoint {path} does not respond (a hung FUSE daemon?)"))


def _mount_error(path: str, options: MountOptions, exc: Exception) -> MountError:
    hint = ""
    if options.allow_other and os.geteuid() != 0 and "allow_other" not in str(exc):
        hint = " (allow_other needs user_allow_other in /etc/fuse.conf)"
    return MountError(f"cannot mount at {path}: {exc}{hint}")


def _mount(path: str, options: MountOptions) -> int:
    """The /dev/fuse descriptor of a new mount at ``path``, or MountError saying why not."""
    try:
        return mount_fd(path, sorted(fuse_options(options)))
    except FuseMountError as exc:
        raise _mount_error(path, options, exc) from None


async def start_server(ops: NamespaceFS, path: str, options: MountOptions) -> FuseServer:
    """Mount ``path`` and the FUSE server ``options.fuse`` that will serve ``ops`` on it."""
    pyfuse3_server = check_fuse_server(options.fuse)
    if pyfuse3_server is None:  # ours
        fd = await trio.to_thread.run_sync(_mount, path, options)
        serving = options.worker_processes
        return FuseSession(ops, fd, InitParams(max_write=MAX_WRITE,
                                               max_background=MAX_BACKGROUND * serving),
                           debug=options.debug, shared=serving > 1,
                           in_flight_limit=MAX_BACKGROUND)
    libfuse_options = sorted(fuse_options(options)) + (["debug"] if options.debug else [])
    try:
        server = await trio.to_thread.run_sync(pyfuse3_server.Pyfuse3Server, ops, path,
                                               libfuse_options, MAX_BACKGROUND)
    except pyfuse3_server.Pyfuse3MountError as exc:
        raise _mount_error(path, options, exc) from None
    raise_max_background(path)  # libfuse leaves it to the kernel's default at INIT
    return server


async def serve(
    controller: ControllerLike,
    mountpoint: str,
    options: MountOptions,
    *,
    drain_timeout: float = DRAIN_TIMEOUT,
    exit_plan: Callable[[], Exit] | None = None,
    companion: CompanionLike | None = None,
    task_status: trio.TaskStatus[NamespaceFS] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Mount ``controller`` at ``mountpoint`` and serve until unmounted or cancelled.

    ``task_status.started(filesystem)`` is called once the mount exists. After an external
    unmount (``fusermount3 -u``) serve cleans up and returns. On cancellation
    the mount is detached at once (lazy unmount: no new opens), files still
    open get up to ``drain_timeout`` seconds to be closed, in-flight requests
    finish, then serve re-raises.  With ``exit_plan`` (the mount's exit, asked for when
    the drain begins) the drain is done by its ``drain_by`` instead, and says there what it
    left undone.  ``companion`` (the daemon's companion server) is reported under
    ``.nvmeof/``.
    """
    path = await check_mountpoint_async(mountpoint)
    check_nsid(controller, options.nsid)
    ops = NamespaceFS(controller, options, companion,
                      shared_handles=options.worker_processes > 1)
    if options.workers > 1 and options.worker_processes == 1:
        log.warning("pyfuse3 serves one /dev/fuse descriptor: one process serves this mount, "
                    "not %d workers", options.workers)
    fuse = await start_server(ops, path, options)
    ops.kernel = fuse
    shielded = _ShieldedServer(ops, fuse, path, drain_timeout, exit_plan)
    log.info("mounted at %s%s", path, "" if options.fuse == "builtin" else
             f" (FUSE server: {options.fuse})")
    listeners = getattr(getattr(controller, "events", None), "listeners", [])
    listeners.append(ops.apply_changes)  # namespaces added, removed, resized on the target
    try:
        with unwrap_groups():
            await shielded.run(task_status)
    finally:
        listeners.remove(ops.apply_changes)
        ops.kernel = None
        if not (shielded.gone or fuse.gone):
            with trio.CancelScope(shield=True), trio.move_on_after(CHECK_TIMEOUT):
                await _lazy_unmount(path)
        fuse.close()
        log.info("unmounted %s", path)


class _ShieldedServer:
    """The FUSE server in a shielded task, so that cancelling us drains instead of aborting."""

    def __init__(self, ops: NamespaceFS, fuse: FuseServer, path: str,
                 drain_timeout: float, exit_plan: Callable[[], Exit] | None = None) -> None:
        self.ops = ops
        self.fuse = fuse
        self.path = path
        self.drain_timeout = drain_timeout
        self.exit_plan = exit_plan
        self.done = trio.Event()
        self.main_scope = trio.CancelScope(shield=True)
        self.gone = False  # the mount no longer exists: nothing left to unmount

    async def _main(self) -> None:
        try:
            with self.main_scope:
                await self.fuse.run()
        finally:
            self.done.set()

    async def run(self, task_status: trio.TaskStatus[NamespaceFS]) -> None:
        """Serve until the kernel ends the session (unmount), or drain when cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._main)
            task_status.started(self.ops)
            try:
                await self.done.wait()
            except BaseException:
                await self._drain()
                raise
            self.gone = True

    async def _drain(self) -> None:
        """Detach the mount, wait for its open files to be closed, then answer the requests
        in flight: each for ``drain_timeout``, or all of it by the exit's ``drain_by``."""
        began = trio.current_time()
        plan = self.exit_plan() if self.exit_plan is not None else None
        files_by = (max(began, plan.drain_by - ANSWER_LEAST) if plan is not None
                    else began + self.drain_timeout)
        with trio.move_on_at(files_by, shield=True):
            self.gone = await _lazy_unmount(self.path)
            if self.ops.handles:
                log.info(
                    "stopping: waiting up to %g s for %d open file(s) on %s to be closed",
                    round(files_by - trio.current_time(), 1),
                    len(self.ops.handles),
                    self.path,
                )
            await self._idle_or_ended()
        if not self.done.is_set():
            self.fuse.stop_reading()  # requests in flight are answered, then run() returns
            requests_by = (plan.drain_by if plan is not None
                           else trio.current_time() + self.drain_timeout)
            with trio.move_on_at(requests_by, shield=True):
                await self.done.wait()
        if not self.done.is_set():
            took = round(trio.current_time() - began, 1)
            log.warning("requests still in flight after %g s; abandoning them", took)
            if plan is not None:
                plan.skipped.append(f"FUSE requests still in flight after {took:g} s "
                                    "abandoned")
            self.main_scope.cancel()

    async def _idle_or_ended(self) -> None:
        """Return once no file is open, or once the kernel ended the session: when the last
        file of a detached mount closes, the kernel aborts the connection and that file's
        RELEASE never comes."""
        async with trio.open_nursery() as nursery:

            async def first(wait) -> None:
                await wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(first, self.ops.wait_idle)
            nursery.start_soon(first, self.done.wait)


async def _lazy_unmount(path: str) -> bool:
    """Detach the mount (``fusermount3 -u -z``) so no new opens can start; True if done."""
    try:
        result = await trio.run_process(
            ["fusermount3", "-u", "-z", path], check=False, capture_stderr=True
        )
    except OSError as exc:
        log.warning("cannot run fusermount3 to detach %s: %s", path, exc)
        return False
    if result.returncode != 0:
        log.warning("fusermount3 -u -z %s failed: %s", path, result.stderr.decode().strip())
    return result.returncode == 0
