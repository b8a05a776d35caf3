"""tests/fs/bench_fuse_core.py's server: our FUSE layer over a Controller on fake verbs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).with_name("bench_fuse_core.py")
STEP = 20  # s: bound on any single command or wait

pytestmark = pytest.mark.skipif(
    not os.access("/dev/fuse", os.R_OK | os.W_OK) or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3",
)


def test_the_server_mounts_serves_reads_and_writes_and_ends_with_its_mount(tmp_path):
    sys.path.insert(0, str(BENCH.parent))
    try:
        from bench_fuse_core import _start
    finally:
        sys.path.remove(str(BENCH.parent))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc, target = _start([sys.executable, str(BENCH), "--serve", str(mnt)],
                          str(tmp_path / "log"))
    try:
        assert target == f"{mnt}/n1" and os.path.getsize(target) == 256 << 20
        fd = os.open(target, os.O_RDWR)
        try:
            assert os.pwrite(fd, b"\x5a" * 8192, 4096) == 8192  # in-capsule, to the fake
            assert len(os.pread(fd, 8192, 1 << 20)) == 8192  # a command on a fake queue
        finally:
            os.close(fd)
        subprocess.run(["fusermount3", "-u", str(mnt)], timeout=STEP, check=True)
        assert proc.wait(timeout=STEP) == 0  # unmounted: the controller's tasks end too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STEP)
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, timeout=STEP)
