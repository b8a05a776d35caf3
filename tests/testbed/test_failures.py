"""A mount that cannot connect fails at once, in one line that names why, and leaves nothing.

Wrong NQN and a host the subsystem does not allow are answered by the target with a
Connect status that has DNR set (never retried); a port nobody listens on is refused by
RDMA-CM.  The ``--daemon`` parent prints the daemon's one-line error and exits non-zero.
"""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest
from nvmet import subsystem
from vm import wait_for

MNT = "/tmp/nvmeof-failures"
CLOSED_NQN = "nqn.2026-11.io.nvmeof-fuse:closed"


@contextlib.contextmanager
def closed_subsystem():
    """A subsystem on the RDMA port that admits no host (attr_allow_any_host=0)."""
    with subsystem(CLOSED_NQN, None, allow_any_host=False):
        yield CLOSED_NQN


def daemons_for(mountpoint: str) -> list[str]:
    """Command lines of processes still running for ``mountpoint``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if mountpoint.encode() in argv and pid != str(os.getpid()):
            found.append(b" ".join(argv).decode(errors="replace"))
    return found


def mount_fails(testbed, *options: str) -> str:
    os.makedirs(MNT, exist_ok=True)
    result = subprocess.run(
        ["nvmeof-fuse", "mount", "-t", "rdma", "-a", testbed.rdma_addr, "--daemon", *options,
         MNT], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, result
    assert wait_for(lambda: not daemons_for(MNT), 60), daemons_for(MNT)
    assert not os.path.ismount(MNT)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("case", ["wrong nqn", "wrong port", "host not allowed"])
def test_a_mount_that_cannot_connect_fails_in_one_line(testbed, case):
    if case == "wrong nqn":
        line = mount_fails(testbed, "-n", "nqn.2026-11.io.no:such")
        assert "(nqn.2026-11.io.no:such) failed: Connect failed: Connect Invalid Parameters" \
            in line and "dnr" in line
    elif case == "wrong port":
        line = mount_fails(testbed, "-n", testbed.nqn, "-s", "4421")
        assert line.endswith(f"connect to {testbed.rdma_addr}:4421 refused: is an NVMe/RDMA "
                             "port listening there?"), line
    else:
        with closed_subsystem() as nqn:
            line = mount_fails(testbed, "-n", nqn)
        assert f"({nqn}) failed: Connect failed: Connect Invalid Host" in line and "dnr" in line
    assert line.startswith("nvmeof-fuse: error: "), line
