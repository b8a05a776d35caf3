"""Host-side tests: mount a fake controller through the kernel and use real tools on it.

Each mount runs ``serve_fake.py`` in a child process; every wait is bounded.  Each test runs on
both FUSE servers: ours (builtin) and pyfuse3 (the extra, which scripts/test installs).
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvmeof_fuse.fs.mount import MountError, check_mountpoint, read_mountinfo

SERVE = Path(__file__).with_name("serve_fake.py")
STEP = 20  # s: bound on any single command or wait
N1_SIZE = 512 * 8192

pytestmark = pytest.mark.skipif(
    not os.access("/dev/fuse", os.R_OK | os.W_OK) or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3",
)


def is_mounted(path: Path) -> bool:
    return any(m.mountpoint == str(path) for m in read_mountinfo())


class Mount:
    def __init__(self, path: Path, *args: str) -> None:
        self.path = path
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVE), str(path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self._readline()
        if line != "READY":
            self.stop()
            raise AssertionError(f"serve_fake did not start: {line!r} {self.proc.stderr.read()}")

    def _readline(self) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout=STEP)
        sel.close()
        return self.proc.stdout.readline().strip() if ready else "<timeout>"

    def finish(self) -> tuple[int, dict]:
        """Wait for the server to exit; its return code and flush counts."""
        out, err = self.proc.communicate(timeout=STEP)
        flushes = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        return self.proc.returncode, flushes

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STEP)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STEP)
        if is_mounted(self.path):
            subprocess.run(["fusermount3", "-uz", str(self.path)], timeout=STEP, check=False)


def sh(cmd: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, shell=True, cwd=cwd, capture_output=True, text=True, timeout=STEP, check=check
    )


@pytest.fixture
def mountpoint(tmp_path):
    path = tmp_path / "mnt"
    path.mkdir()
    return path


@pytest.fixture(params=["builtin", "pyfuse3"])
def fuse(request) -> str:
    """``--fuse=SERVER`` for serve_fake.py."""
    return f"--fuse={request.param}"


@pytest.fixture
def mount(mountpoint, fuse):
    m = Mount(mountpoint, fuse)
    yield m
    m.stop()


def test_the_server_asked_for_serves(mount, fuse):
    """pyfuse3 runs libfuse in the serving process; our own session needs no libfuse."""
    with open(f"/proc/{mount.proc.pid}/maps") as f:
        libfuse = "libfuse3.so" in f.read()
    assert libfuse == (fuse == "--fuse=pyfuse3")
    assert sh("ls", mount.path).stdout.split() == ["n1", "n2"]


def test_listing_and_stat(mount):
    out = sh("ls -l", mount.path).stdout
    assert "-rw-r----- 1" in out and f" {N1_SIZE} " in out and " n2" in out
    assert ".nvmeof" in sh("ls -a", mount.path).stdout
    assert sh("stat -c '%s %o %a' n2", mount.path).stdout.split() == ["262144", "4096", "640"]
    names = sh("ls .nvmeof", mount.path).stdout.split()
    assert names == sorted(names)
    assert {"controller", "controller.json", "n1", "n1.json", "n2.json", "stats", "stats.json",
            "companion.json"} <= set(names)


def test_dd_cmp_and_block_device_semantics(mount, tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(1_000_000))
    p = mount.path
    # plain dd opens with O_TRUNC: ignored, the namespace keeps its size and data
    sh("dd if=/dev/urandom of=n1 bs=1000 count=7 seek=2000 conv=notrunc status=none", p)
    tail_before = sh("dd if=n1 bs=1000 skip=2000 count=7 status=none | md5sum", p).stdout
    sh(f"dd if={data} of=n1 bs=4096 status=none", p)
    assert os.path.getsize(p / "n1") == N1_SIZE
    sh(f"cmp -n 1000000 {data} n1", p)
    assert sh("dd if=n1 bs=1000 skip=2000 count=7 status=none | md5sum", p).stdout == tail_before
    # unaligned offsets and sizes: read-modify-write of the edge LBAs
    sh(f"dd if={data} of=n1 bs=1000 seek=3 conv=notrunc,fsync status=none", p)
    sh(f"cmp -i 0:3000 -n 1000000 {data} n1", p)


def test_o_direct(mount, tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(1 << 20))
    p = mount.path
    sh(f"dd if={data} of=n1 bs=64k oflag=direct conv=notrunc status=none", p)
    sh(f"dd if=n1 of={tmp_path}/back.bin bs=64k count=16 iflag=direct status=none", p)
    assert (tmp_path / "back.bin").read_bytes() == data.read_bytes()
    # buffered readers see what O_DIRECT wrote (no stale page cache)
    sh(f"cmp -n {1 << 20} {data} n1", p)


def test_hexdump_of_known_pattern(mount):
    out = sh("hexdump -C -n 32 n2", mount.path).stdout.splitlines()
    assert out[0].startswith("00000000  00 01 02 03 04 05 06 07  08 09 0a 0b 0c 0d 0e 0f")


def test_stats_json_is_live(mount):
    p = mount.path
    first = json.loads(sh("cat .nvmeof/stats.json | python3 -m json.tool", p).stdout)
    sh("dd if=n2 of=/dev/null bs=4096 count=3 iflag=direct status=none", p)
    second = json.loads(sh("cat .nvmeof/stats.json", p).stdout)
    before = first["n2"]["ops"].get("read", {}).get("bytes", 0)
    assert second["n2"]["ops"]["read"]["bytes"] == before + 3 * 4096
    assert "p99.9" in sh("cat .nvmeof/stats", p).stdout
    assert json.loads(sh("cat .nvmeof/controller.json", p).stdout)["identify"]["sn"] == "FAKE0001"


def test_dropping_cached_pages_shows_data_changed_behind_fuse(mount):
    """What a companion write does: buffered readers keep cached pages until they are dropped."""
    with open(mount.path / "n2", "rb", buffering=0) as f:
        first = os.pread(f.fileno(), 4096, 0)
        assert first == bytes(range(256)) * 16
        mount.proc.send_signal(signal.SIGUSR1)
        assert mount._readline() == "CHANGED"
        assert os.pread(f.fileno(), 4096, 0) == first  # the kernel's cached page
        mount.proc.send_signal(signal.SIGUSR2)
        assert mount._readline() == "DROPPED"
        assert os.pread(f.fileno(), 4096, 0) == b"\xab" * 4096


def test_out_of_range_write_and_truncate(mount):
    p = mount.path
    past = sh(f"dd if=/dev/zero of=n1 bs=512 count=1 seek={N1_SIZE // 512} conv=notrunc", p, False)
    assert past.returncode != 0 and "No space left on device" in past.stderr
    seek = N1_SIZE // 1000
    straddle = sh(f"dd if=/dev/zero of=n1 bs=1000 count=2 seek={seek} conv=notrunc", p, False)
    assert "No space left on device" in straddle.stderr
    assert f"{N1_SIZE % 1000} bytes copied" in straddle.stderr  # short write up to the end
    shrink = sh("truncate -s 100 n1", p, False)
    assert shrink.returncode != 0 and "Invalid argument" in shrink.stderr
    sh(f"truncate -s {N1_SIZE} n1", p)  # same size: accepted
    assert os.path.getsize(p / "n1") == N1_SIZE
    assert "Operation not permitted" in sh("touch newfile", p, False).stderr


def test_check_mountpoint_sees_the_live_mount(mount):
    with pytest.raises(MountError, match="already a mountpoint"):
        check_mountpoint(str(mount.path))


def test_fusermount_u_ends_the_server_cleanly(mount):
    sh("dd if=/dev/zero of=n1 bs=4096 count=1 conv=notrunc,fsync status=none", mount.path)
    subprocess.run(["fusermount3", "-u", str(mount.path)], timeout=STEP, check=True)
    rc, flushes = mount.finish()
    assert rc == 0 and flushes["n1"] >= 1
    assert not is_mounted(mount.path)


def test_sigterm_unmounts_cleanly(mount):
    mount.proc.send_signal(signal.SIGTERM)
    rc, _ = mount.finish()
    assert rc == 0 and not is_mounted(mount.path)


def test_stop_drains_in_flight_requests(mountpoint, tmp_path, fuse):
    m = Mount(mountpoint, "--hold-reads", fuse)
    try:
        out = tmp_path / "out.bin"
        reader = subprocess.Popen(
            ["dd", "if=n2", f"of={out}", "bs=4096", "count=1", "iflag=direct", "status=none"],
            cwd=mountpoint,
        )
        assert m._readline() == "INFLIGHT"
        m.proc.send_signal(signal.SIGTERM)  # the held read is released by the same signal
        assert reader.wait(timeout=STEP) == 0
        assert out.read_bytes() == bytes(range(256)) * 16
        rc, _ = m.finish()
        assert rc == 0 and not is_mounted(mountpoint)
    finally:
        m.stop()


def test_read_only_mount(mountpoint, fuse):
    m = Mount(mountpoint, "--read-only", fuse)
    try:
        assert sh("stat -c %a n1", mountpoint).stdout.strip() == "440"
        w = sh("dd if=/dev/zero of=n1 bs=512 count=1 conv=notrunc", mountpoint, False)
        assert "Read-only file system" in w.stderr
        assert sh("od -An -tx1 -N4 n2", mountpoint).stdout.split() == ["00", "01", "02", "03"]
    finally:
        m.stop()


def test_stale_mount_is_reported_with_the_fix(mountpoint, fuse):
    m = Mount(mountpoint, fuse)
    m.proc.kill()  # a dead daemon leaves the mount behind
    m.proc.wait(timeout=STEP)
    try:
        deadline = time.monotonic() + STEP
        while True:  # the kernel notices the closed /dev/fuse fd right away
            try:
                os.stat(mountpoint)
            except OSError as exc:
                assert exc.errno == errno.ENOTCONN
                break
            assert time.monotonic() < deadline, "mount did not go stale"
            time.sleep(0.05)
        with pytest.raises(MountError) as e:
            check_mountpoint(str(mountpoint))
        assert str(e.value) == (
            f"stale mount from a dead nvmeof-fuse daemon at {mountpoint}; "
            f"clear it with: fusermount3 -u {mountpoint}"
        )
        subprocess.run(["fusermount3", "-u", str(mountpoint)], timeout=STEP, check=True)
        assert check_mountpoint(str(mountpoint)) == str(mountpoint)
    finally:
        m.stop()
