"""Mounting the way admins do, against the real target: fstab + mount(8), mount -t, mount-all."""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager

import pytest
from nvmet import null_blk, subsystem
from vm import wait_for

from nvmeof_fuse.cli.mounthelper import SYSTEMD_PATH
from nvmeof_fuse.fs.mount import read_mountinfo

ROOT = "/tmp/nvmeof-admin"
TIMEOUT = 600  # s: a mount takes two Python start-ups in the slow guest
FSTYPE = "fuse.nvmeof-fuse"
SECOND_NQN = "nqn.2026-11.io.nvmeof-fuse:admin-second"


def run(*cmd: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env,
                          check=False)


def ok(*cmd: str, env: dict | None = None) -> str:
    out = run(*cmd, env=env)
    assert out.returncode == 0, f"{cmd}: rc {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def rc_qps() -> int:
    """RC queue pairs in the VM (ours and the target's side of them)."""
    return sum(" type RC " in line for line in ok("rdma", "resource", "show", "qp").splitlines())


def mount_of(path: str):
    found = [m for m in read_mountinfo() if m.mountpoint == path]
    return found[-1] if found else None


def one_error_line(out: subprocess.CompletedProcess, match: str) -> None:
    assert out.returncode != 0, out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvmeof-fuse: error:"), out.stderr
    assert match in lines[0] and "Traceback" not in out.stderr, out.stderr


def unmount_and_wait(path: str, baseline_qps: int) -> None:
    ok("umount", path)
    assert mount_of(path) is None
    assert wait_for(lambda: rc_qps() == baseline_qps, TIMEOUT), "queue pairs left behind"


@pytest.fixture
def root():
    os.makedirs(ROOT, exist_ok=True)
    yield ROOT
    for m in reversed(read_mountinfo()):
        if m.mountpoint.startswith(ROOT + "/"):
            run("umount", m.mountpoint)


@pytest.fixture
def fstab():
    """Lines appended to the guest's /etc/fstab (an overlay), taken out again afterwards."""
    with open("/etc/fstab", encoding="utf-8") as f:
        saved = f.read()

    class Fstab:
        lines: list[str] = []

        def __call__(self, *lines: str) -> None:
            self.lines += lines
            self._write()

        def keep_only(self, mountpoint: str) -> None:
            self.lines = [line for line in self.lines if line.split()[1] == mountpoint]
            self._write()

        def _write(self) -> None:
            with open("/etc/fstab", "w", encoding="utf-8") as f:
                f.write(saved + "".join(line + "\n" for line in self.lines))

    yield Fstab()
    with open("/etc/fstab", "w", encoding="utf-8") as f:
        f.write(saved)


def test_fstab_line_mounts_and_umount_flushes_and_disconnects(testbed, root, fstab):
    good, bad = f"{root}/x", f"{root}/bad"
    os.makedirs(good, exist_ok=True)
    os.makedirs(bad, exist_ok=True)
    log = f"{root}/x.log"
    uri = f"nvme+rdma://{testbed.rdma_addr}:{testbed.port}/{testbed.nqn}"
    fstab(f"nvme+rdma://{testbed.rdma_addr}/nqn.2026-11.io.no:such  {bad}  {FSTYPE}  "
          "_netdev,nofail,ctrl_loss_tmo=0  0 0",
          f"{uri}  {good}  {FSTYPE}  _netdev,nofail,ctrl_loss_tmo=-1,nr_io_queues=2,"
          f"log_file={log},x-systemd.automount  0 0")
    # as systemd would run it: the default PATH, where install-helper put nvmeof-fuse
    print(ok("nvmeof-fuse", "install-helper"))
    systemd_env = {**os.environ, "PATH": SYSTEMD_PATH}
    baseline = rc_qps()

    # mount -a, as at boot: the failing nofail line first says why in one line; ours mounts
    out = run("mount", "-a", "-t", FSTYPE, env=systemd_env)
    said = [line for line in out.stderr.splitlines() if line.startswith("nvmeof-fuse:")]
    assert len(said) == 1 and said[0].startswith("nvmeof-fuse: error:"), out.stderr
    assert "nqn.2026-11.io.no:such" in said[0] and "Traceback" not in out.stderr, out.stderr
    assert mount_of(bad) is None
    m = mount_of(good)
    assert m is not None and (m.fstype, m.source) == (FSTYPE, uri), out.stderr
    assert sorted(os.listdir(good)) == [".nvmeof", "n1", "n2"]
    for name, lba in (("n1", 512), ("n2", 4096)):
        st = os.stat(f"{good}/{name}")
        assert st.st_size == 256 << 20 and st.st_blksize == lba
    assert f"{good}/n2" in ok("nvmeof-fuse", "list")  # every mount, like `nvme list`
    assert rc_qps() > baseline
    fstab.keep_only(good)
    out = run("mount", "-a", "-t", FSTYPE)  # ours is known to be mounted: not tried again
    assert out.returncode == 0 and not out.stderr, out.stderr

    pattern = os.urandom(1 << 20)
    with open(f"{good}/n1", "r+b") as f:
        f.seek(77 << 20)
        f.write(pattern)  # left in the page cache: umount must write it back and flush
    unmount_and_wait(good, baseline)
    assert wait_for(lambda: "disconnected from" in open(log).read(), TIMEOUT)
    text = open(log).read()
    # the close flushed n1 (a final flush, if the kernel wrote pages back at unmount, is of
    # n1 alone: n2 was never written), and nothing failed
    final = [line for line in text.splitlines() if "flushed" in line]
    assert all("n2" not in line for line in final), text
    assert "final flush" not in text and "Traceback" not in text, text

    ok("mount", good, env=systemd_env)  # by its mountpoint alone, as systemd does
    with open(f"{good}/n1", "rb") as f:
        f.seek(77 << 20)
        assert f.read(len(pattern)) == pattern
    unmount_and_wait(good, baseline)


@pytest.mark.slow
def test_mount_t_with_a_uri_ending_in_an_nsid_mounts_that_namespace(testbed, root):
    ok("nvmeof-fuse", "install-helper")  # mount(8) finds nvmeof-fuse on its default PATH
    point = f"{root}/n2only"
    os.makedirs(point, exist_ok=True)
    baseline = rc_qps()
    uri = f"nvme+rdma://{testbed.rdma_addr}/{testbed.nqn}/2"
    ok("mount", "-t", FSTYPE, uri, point, "-o", "ctrl_loss_tmo=5,read_only")
    assert sorted(os.listdir(point)) == [".nvmeof", "n2"]
    assert os.stat(f"{point}/n2").st_blksize == 4096
    with pytest.raises(OSError):
        open(f"{point}/n2", "r+b").close()  # read_only
    unmount_and_wait(point, baseline)
    bad_nsid = run("mount", "-t", FSTYPE, uri[:-1] + "9", point)
    one_error_line(bad_nsid, "namespace 9 is not active on the controller (active: 1, 2)")
    one_error_line(run("mount", "-t", FSTYPE, uri[:-1] + "x", point), "NSID 'x'")


@contextmanager
def second_subsystem(testbed):
    """One more subsystem (a 64 MiB null_blk namespace) on the rdma port, removed afterwards."""
    with null_blk("adminsecond", 64, 512) as dev, subsystem(SECOND_NQN, dev):
        yield SECOND_NQN


@pytest.mark.slow
def test_mount_all_mounts_each_subsystem_once(testbed, root):
    top = f"{root}/all"
    baseline = rc_qps()
    cmd = ["nvmeof-fuse", "mount-all", "-t", "rdma", "-a", testbed.rdma_addr,
           "-s", str(testbed.port), "-O", "ctrl_loss_tmo=5", "-o", "json", top]
    rows = json.loads(ok(*cmd))
    assert [(r["subnqn"], r["status"]) for r in rows] == [(testbed.nqn, "mounted")], rows
    assert sorted(os.listdir(f"{top}/{testbed.nqn}")) == [".nvmeof", "n1", "n2"]
    rows = json.loads(ok(*cmd))
    assert [(r["subnqn"], r["status"]) for r in rows] == [(testbed.nqn, "already mounted")]
    with second_subsystem(testbed) as second:
        try:
            table = ok(*cmd[:-3], top)  # the usual table this time
            assert f"{top}/{second}" in table and "mounted" in table, table
            assert "already mounted" in table, table
            assert sorted(os.listdir(f"{top}/{second}")) == [".nvmeof", "n1"]
            assert os.stat(f"{top}/{second}/n1").st_size == 64 << 20
            listed = ok("nvmeof-fuse", "list")
            assert f"{top}/{testbed.nqn}/n1" in listed and f"{top}/{second}/n1" in listed
        finally:
            for nqn in (second, testbed.nqn):
                if mount_of(f"{top}/{nqn}") is not None:
                    run("umount", f"{top}/{nqn}")
            assert wait_for(lambda: rc_qps() == baseline, TIMEOUT), "queue pairs left behind"
