"""The hostile-target harness (tests/hostile/conftest.py's ``hostile`` fixture): a
:class:`hostile_target.HostileTarget` in a thread of the test process, the real daemon
(``python -m nvmeof_fuse.cli mount``, our FUSE session) on it, a 32 KiB ``dd`` through the
mount, and the checks every fault must pass (:meth:`Outcome.check`): its outcome within a
bound, no traceback in the daemon's log, the daemon's peak RSS under a bound, a clean
unmount within a bound.

A test picks a fault by name (``hostile_target.FAULTS``) and what the user should see::

    def test_x(hostile):
        hostile.run("crd of hours", "read").check("ok")
        hostile.run("lbads 63", "read").check("ENXIO")
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from hostile_target import NQN, HostileTarget, load_faults

from nvmeof_fuse.cli.mount import read_line
from nvmeof_fuse.fs.mount import read_mountinfo

MOUNT_OPTIONS = ("-c", "1", "-l", "5", "-k", "1")
"""What the issue's user mounted with: reconnect every 1 s, give up after 5 s, keep-alive 1 s."""
READY_BOUND = 60.0  # s: the mount comes up or refuses in one line
DD_BOUND = 30.0  # s: a 32 KiB dd ends (done, or EIO) within this
UNMOUNT_BOUND = 20.0  # s: fusermount3 -u, and the daemon exits
RSS_BOUND_MIB = 200  # the daemon's peak RSS, whatever the target claims
DD_SIZE = 32 << 10

load_faults()

needs_fuse = pytest.mark.skipif(
    not os.access("/dev/fuse", os.R_OK | os.W_OK) or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3",
)


def mounted(path: Path) -> bool:
    return any(m.mountpoint == str(path) for m in read_mountinfo())


@dataclass
class Outcome:
    """What one fault did to one mount, for :meth:`check`."""

    fault: str
    ready: str
    """"ready", or the mount's error line."""
    dd: subprocess.CompletedProcess | None
    """None: not run (the mount refused), or it outran DD_BOUND (``dd_timed_out``)."""
    dd_seconds: float
    dd_timed_out: bool
    rss_mib: float
    unmount_seconds: float
    unmounted: bool
    """fusermount3 -u worked and the daemon exited 0 within UNMOUNT_BOUND."""
    log: str

    def failed_with(self, errno_name: str) -> bool:
        """Whether dd failed with ``errno_name`` ("EIO", "ENXIO", ...)."""
        return self.dd is not None and self.dd.returncode != 0 and (
            os.strerror(getattr(errno, errno_name)) in self.dd.stderr)

    def check(self, expect: str) -> Outcome:
        """The checks of every fault; ``expect``: "ok" (dd succeeds), "refused" (the mount
        fails with one line), an errno name (dd fails with it: "EIO", "ENXIO"), or
        "ok or EIO"."""
        where = f"fault {self.fault!r}; daemon log:\n{self.log[-4000:]}"
        assert "Traceback" not in self.log, where
        assert self.rss_mib < RSS_BOUND_MIB, f"peak RSS {self.rss_mib:.0f} MiB; {where}"
        if expect == "refused":
            assert self.ready.startswith("error: ") and "\n" not in self.ready, where
            return self
        assert self.ready == "ready", f"the mount said {self.ready!r}; {where}"
        assert not self.dd_timed_out, f"dd ran past {DD_BOUND} s; {where}"
        assert self.dd is not None
        ok = self.dd.returncode == 0
        said = f"dd: rc {self.dd.returncode} {self.dd.stderr.strip()!r}; {where}"
        if expect == "ok":
            assert ok, said
        elif expect == "ok or EIO":
            assert ok or self.failed_with("EIO"), said
        else:
            assert self.failed_with(expect), said
        assert self.unmounted, f"unmount took {self.unmount_seconds:.1f} s or failed; {where}"
        return self


class HostileMount:
    """One HostileTarget served from a thread, and the daemon mounted on it."""

    def __init__(self, target: HostileTarget, mountpoint: Path, log_path: Path,
                 options: tuple[str, ...]) -> None:
        self.target, self.mountpoint, self.log_path = target, mountpoint, log_path
        self.options = options
        self.port: int | None = None
        """The port the daemon connects to: the target's (None), or a front's before it."""
        self.fronts = contextlib.ExitStack()
        """What stands between the daemon and the target (a TLS front: tests/hostile/
        faults_tls.py), closed once the daemon is gone."""
        self.proc: subprocess.Popen | None = None
        self.stragglers: list[subprocess.Popen] = []  # dd's that outran their bound
        self._trio: dict = {}
        self._thread: threading.Thread | None = None

    # -- the target ----------------------------------------------------------------------------

    def start_target(self) -> None:
        ready = threading.Event()

        async def main() -> None:
            self._trio["token"] = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as self._trio["scope"]:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.target.serve)
                    ready.set()

        self._thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
        self._thread.start()
        assert ready.wait(10), "the hostile target did not start"

    def stop_target(self) -> None:
        if self._thread is None:
            return
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(self._trio["scope"].cancel, trio_token=self._trio["token"])
        self._thread.join(10)

    # -- the daemon ----------------------------------------------------------------------------

    def mount(self, nqn: str = NQN) -> str:
        """Start the daemon; "ready", or its error line, within READY_BOUND."""
        rfd, wfd = os.pipe()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nvmeof_fuse.cli", "mount", "-t", "tcp",
                 "-a", "127.0.0.1", "-s", str(self.port or self.target.port), "-n", nqn,
                 *self.options,
                 "--ready-fd", str(wfd), str(self.mountpoint)],
                pass_fds=(wfd,), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        os.close(wfd)
        try:
            line = read_line(rfd, READY_BOUND)
        finally:
            os.close(rfd)
        return "<no answer>" if line is None else line or "<exited>"

    def dd(self, direction: str, *, size: int = DD_SIZE, offset: int = 0,
           bound: float = DD_BOUND) -> tuple[subprocess.CompletedProcess | None, float]:
        """A ``size``-byte O_DIRECT dd ("read" or "write") at ``offset`` of n1."""
        n1 = self.mountpoint / "n1"
        if direction == "read":
            cmd = ["dd", f"if={n1}", "of=/dev/null", "iflag=direct,skip_bytes"]
        else:
            cmd = ["dd", "if=/dev/urandom", f"of={n1}", "oflag=direct,seek_bytes",
                   "conv=notrunc"]
        place = f"skip={offset}" if direction == "read" else f"seek={offset}"
        cmd += [f"bs={size}", "count=1", place, "status=none"]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=bound)
        except subprocess.TimeoutExpired:
            # A FUSE request the daemon never answers holds dd, even when killed, until
            # the daemon goes: close() reaps it then.
            proc.kill()
            self.stragglers.append(proc)
            return None, time.monotonic() - start
        return (subprocess.CompletedProcess(cmd, proc.returncode, out, err),
                time.monotonic() - start)

    def rss_mib(self) -> float:
        """The daemon's peak RSS (VmHWM), MiB; 0 once it exited."""
        assert self.proc is not None
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except FileNotFoundError:
            pass
        return 0.0

    def unmount(self, bound: float = UNMOUNT_BOUND) -> tuple[bool, float]:
        """fusermount3 -u and wait for the daemon: (clean, seconds)."""
        assert self.proc is not None
        start = time.monotonic()
        if self.proc.poll() is not None:
            return False, 0.0
        try:
            done = subprocess.run(["fusermount3", "-u", str(self.mountpoint)],
                                  capture_output=True, timeout=bound)
            self.proc.wait(timeout=max(bound - (time.monotonic() - start), 0.1))
        except subprocess.TimeoutExpired:
            return False, time.monotonic() - start
        clean = done.returncode == 0 and self.proc.returncode == 0
        return clean, time.monotonic() - start

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for_log(self, pattern: str, bound: float) -> re.Match | None:
        """The first match of ``pattern`` (multiline) in the daemon's log, waited for up to
        ``bound`` s, or while the daemon runs; None if it did not come."""
        deadline = time.monotonic() + bound
        while True:
            found = re.search(pattern, self.log(), re.M)
            if found or time.monotonic() > deadline or self.proc.poll() is not None:
                return found
            time.sleep(0.05)

    def close(self) -> None:
        """Whatever is left: the daemon (SIGTERM, then SIGKILL), the mount, the target."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=0 if self.stragglers else UNMOUNT_BOUND)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=UNMOUNT_BOUND)
        for proc in self.stragglers:
            proc.communicate(timeout=UNMOUNT_BOUND)
        if mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-uz", str(self.mountpoint)], timeout=UNMOUNT_BOUND,
                           check=False)
        self.fronts.close()
        self.stop_target()


class Hostile:
    """The ``hostile`` fixture: start mounts on hostile targets; all closed after the test."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.mounts: list[HostileMount] = []

    def start(self, fault, *, options: tuple[str, ...] = MOUNT_OPTIONS, **target_kw
              ) -> HostileMount:
        """A target with ``fault`` (a name or a Fault) served; mount it with ``m.mount()``."""
        n = len(self.mounts)
        mountpoint = self.tmp_path / f"mnt{n}"
        mountpoint.mkdir()
        m = HostileMount(HostileTarget(fault, **target_kw), mountpoint,
                         self.tmp_path / f"daemon{n}.log", options)
        self.mounts.append(m)
        m.start_target()
        return m

    def run(self, fault, direction: str = "read", **kw) -> Outcome:
        """The issue's user: mount, a 32 KiB dd, then unmount; what happened."""
        m = self.start(fault, **kw)
        ready = m.mount()
        dd, seconds, timed_out = None, 0.0, False
        if ready == "ready":
            dd, seconds = m.dd(direction)
            timed_out = dd is None
        rss = m.rss_mib()
        clean, unmount_seconds = (True, 0.0) if ready != "ready" else (
            (False, 0.0) if timed_out else m.unmount())
        name = fault if isinstance(fault, str) else fault.name
        return Outcome(name, ready, dd, seconds, timed_out, rss, unmount_seconds, clean,
                       m.log())

    def discover(self, fault, *, bound: float = DD_BOUND, **target_kw
                 ) -> subprocess.CompletedProcess:
        """``nvmeof-fuse discover`` of a discovery controller with ``fault``; its outcome
        (TimeoutExpired past ``bound``)."""
        m = self.start(fault, discovery=True, **target_kw)
        return subprocess.run(
            [sys.executable, "-m", "nvmeof_fuse.cli", "discover", "-t", "tcp",
             "-a", "127.0.0.1", "-s", str(m.target.port)],
            capture_output=True, text=True, timeout=bound, stdin=subprocess.DEVNULL)

    def close(self) -> None:
        for m in self.mounts:
            m.close()
