"""Small helpers the VM tests share: run a command, wait for a condition, count RDMA objects,
take the target away."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Collection

NVMET = "/sys/kernel/config/nvmet"
RDMA_PORT = 1  # scripts/vm/testbed-guest: port 1 is rdma, port 2 tcp
TCP_PORT = 2
RAIL_PORT = 3  # rdma on the second rail (rxe1, TESTBED_RAIL_ADDR)
TLS_PORT = 4  # tcp with TLS 1.3 required (TESTBED_TLS_PORT), empty until a test links a subsystem
NVMET_PORTS = {"rdma": RDMA_PORT, "tcp": TCP_PORT}  # by transport


def sh(*cmd: str, timeout: float = 120) -> str:
    """Run ``cmd``; its stdout (raises on a non-zero exit)."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          check=True).stdout


def wait_for(predicate, timeout: float = 60) -> bool:
    """Poll ``predicate`` every 0.2 s until it holds or ``timeout`` s have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def run_guarded(fn, *args, hang_guard: float):
    """``trio.run(fn, *args)``, failing after ``hang_guard`` s: a hang fails the test instead
    of stalling the suite."""
    import trio  # only the tests that run trio code pay for the import

    async def guarded():
        with trio.fail_after(hang_guard):
            return await fn(*args)

    return trio.run(guarded)


def rdma_objects(kind: str, *, pids: Collection[int] | None = None) -> int:
    """How many RDMA resources of ``kind`` (qp, mr, cq, ...) exist in the VM right now
    (``pids``: those of these processes only, which ``rdma`` shows with their pid: not
    nvmet's, whose teardown runs on in the kernel after a test, nor another mount's, which
    may be reconnecting meanwhile)."""
    count = 0
    for line in sh("rdma", "resource", "show", kind).splitlines():
        pid = re.search(r"\bpid (\d+)\b", line)
        if line.strip() and (pids is None or (pid is not None and int(pid.group(1)) in pids)):
            count += 1
    return count


@contextlib.contextmanager
def target_away(nqn: str, *ports: int):
    """The subsystem is off ``ports`` (default: the RDMA port) while inside: nvmet deletes
    our controllers there and refuses new connects until the links are back (as a port
    reconfiguration or a restart does)."""
    links = [f"{NVMET}/ports/{port}/subsystems/{nqn}" for port in ports or (RDMA_PORT,)]
    try:
        for link in links:
            os.unlink(link)
        yield
    finally:
        for link in links:
            if not os.path.lexists(link):
                os.symlink(f"{NVMET}/subsystems/{nqn}", link)


def waits_on_fuse(pid: int) -> bool:
    """Whether process ``pid`` is blocked in the kernel waiting for a FUSE daemon's answer."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read()
        with open(f"/proc/{pid}/stack") as f:
            stack = f.read()
    except OSError:  # gone, or no kernel stacks to show
        return False
    return "fuse" in wchan or "request_wait_answer" in wchan or "fuse_" in stack
