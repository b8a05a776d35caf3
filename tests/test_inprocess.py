"""nvmeof_fuse.mount on the host's FUSE, with a controller that places data at addresses."""

from __future__ import annotations

import os
import subprocess
import time
from contextlib import asynccontextmanager

import numpy as np
import pytest
from companion_fakes import AddressController

import nvmeof_fuse
from nvmeof_fuse.errors import NVMeoFError

NQN = "nqn.2014-08.org.example:fake"


@pytest.fixture
def mounted(tmp_path):
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse")
    ctrl = AddressController()

    @asynccontextmanager
    async def connect(_options):
        yield ctrl

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with nvmeof_fuse.mount(str(mnt), traddr="192.0.2.1", nqn=NQN, connect=connect) as m:
        yield ctrl, m
    assert not os.path.ismount(mnt)


def test_registered_memory_is_read_in_place_and_the_file_agrees(mounted):
    ctrl, m = mounted
    disk = ctrl.disks[1]
    assert os.path.getsize(m.path(1)) == len(disk)
    arr = np.zeros(10_000, dtype=np.uint8)  # ordinary memory: in-process it registers as is
    with m.register(arr), m.open(1) as f:
        assert f.read(arr, file_offset=333) == 10_000
    assert bytes(arr) == disk[333:10_333]
    with open(m.path(1), "rb") as fh:  # the FUSE view shows the same bytes
        fh.seek(333)
        assert fh.read(10_000) == bytes(arr)
    stats = m.stats()
    assert stats["direct_read_bytes"] == 10_240 - 512 and stats["staged_read_bytes"] == 1024


def test_unregistered_memory_is_registered_per_call(mounted):
    ctrl, m = mounted
    data = np.frombuffer(os.urandom(4096), dtype=np.uint8).copy()
    with m.open(2) as f:
        assert f.write(data, file_offset=8192) == 4096
        out = np.zeros(4096, dtype=np.uint8)
        assert f.read(out, file_offset=8192) == 4096
    assert bytes(out) == bytes(data) == ctrl.disks[2][8192:12288]
    stats = m.stats()
    assert stats["direct_write_bytes"] == stats["direct_read_bytes"] == 4096
    assert stats["staged_read_bytes"] == stats["daemon_copied_bytes"] == 0


def test_bad_arguments_are_named(mounted):
    ctrl, m = mounted
    with pytest.raises(NVMeoFError, match="namespace 9 is not on the mount"):
        m.path(9)
    with pytest.raises(NVMeoFError, match="cannot register a str"):
        m.register("text")


def test_mount_options_are_checked(tmp_path):
    with pytest.raises(NVMeoFError, match="--trsvcid 0 is not a port number"):
        nvmeof_fuse.mount(str(tmp_path), traddr="192.0.2.1", nqn=NQN, trsvcid=0)
    with pytest.raises(NVMeoFError, match="unexpected keyword argument 'colour'"):
        nvmeof_fuse.mount(str(tmp_path), traddr="192.0.2.1", nqn=NQN, colour=1)


def test_an_unmount_from_outside_ends_the_mount_by_name(mounted):
    _ctrl, m = mounted
    mnt = m.mountpoint
    subprocess.run(["fusermount3", "-u", mnt], check=True, timeout=30)
    deadline = time.monotonic() + 30
    while os.path.ismount(mnt) and time.monotonic() < deadline:  # a condition, bounded
        time.sleep(0.05)
    with pytest.raises(NVMeoFError, match=f"the mount at {mnt} was unmounted"):
        for _ in range(600):  # the loop ends just after the kernel lets go of the mount
            m.stats()
            time.sleep(0.05)


def test_an_in_process_file_is_bound_to_the_namespace_it_opened(mounted):
    """The in-process mount has one companion session for all its files: each file's
    channel binds it to the namespace it opened, so once another one took the NSID its
    reads fail (EIO), while a file opened now reads the new one."""
    from types import SimpleNamespace

    from nvmeof_fuse.host.namespace import Namespace

    ctrl, m = mounted
    out = np.zeros(4096, dtype=np.uint8)
    with m.open(2) as f:
        assert f.read(out, file_offset=0) == 4096
        old = ctrl.namespaces[2]

        def replace() -> None:
            old.replace("namespace n2 was replaced by another namespace (NGUID x != y)")
            ctrl.namespaces[2] = Namespace(ctrl, 2, SimpleNamespace(lba_size=4096, nsze=512),
                                           1)

        m.run_sync(replace)
        with pytest.raises(NVMeoFError, match="replaced by another namespace") as failed:
            f.read(out, file_offset=0)
        assert failed.value.errno == 5  # EIO
    with m.open(2) as f:
        assert f.read(out, file_offset=0) == 4096
    assert bytes(out) == bytes(ctrl.disks[2][:4096])
