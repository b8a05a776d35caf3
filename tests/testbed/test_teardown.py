"""Teardown as the kernel does it: after an unmount or a closed controller the target has no
controller of ours at once (not only once its keep-alive timer ran out), and the RDMA device
holds no QP, MR or PD of ours."""

from __future__ import annotations

import glob
import os
import subprocess

import trio
from vm import sh, wait_for

from nvmeof_fuse.host.controller import ConnectOptions, connect

MNT = "/tmp/nvmeof-teardown"
KATO = 120  # s: far longer than the waits below, so only a disconnect can end a controller


def target_controllers(nqn: str) -> list[str]:
    """The target's controllers of ``nqn`` in nvmet's debugfs; on kernels without it, the
    target's connected queue pairs (kernel-owned RC QPs: each queue of a controller has one,
    and nvmet destroys them with the controller)."""
    if not os.path.ismount("/sys/kernel/debug"):
        subprocess.run(["mount", "-t", "debugfs", "none", "/sys/kernel/debug"],
                       capture_output=True, timeout=30)
    if os.path.isdir("/sys/kernel/debug/nvmet"):
        return glob.glob(f"/sys/kernel/debug/nvmet/{nqn}/ctrl*")
    return [line for line in sh("rdma", "resource", "show", "qp").splitlines()
            if " type RC " in f"{line} " and " pid " not in f"{line} "]


def ours(pid: int) -> list[str]:
    """RDMA resources (QP, MR, PD) that process ``pid`` holds."""
    return [line for kind in ("qp", "mr", "pd")
            for line in sh("rdma", "resource", "show", kind).splitlines()
            if f" pid {pid} " in f"{line} "]


def test_after_an_unmount_the_target_has_no_controller_of_ours(testbed, tmp_path):
    assert wait_for(lambda: not target_controllers(testbed.nqn), 60)  # earlier tests' gone
    os.makedirs(MNT, exist_ok=True)
    log = str(tmp_path / "daemon.log")
    sh("nvmeof-fuse", "mount", "-t", "rdma", "-a", testbed.rdma_addr, "-n", testbed.nqn,
       "-k", str(KATO), "--daemon", "--log-file", log, MNT, timeout=600)
    try:
        assert target_controllers(testbed.nqn), sh("rdma", "resource", "show", "qp")
    finally:
        sh("fusermount3", "-u", MNT)
    assert wait_for(lambda: not target_controllers(testbed.nqn), KATO / 4), \
        (target_controllers(testbed.nqn), open(log).read())


def test_a_closed_controller_leaves_nothing_on_the_device_or_the_target(testbed):
    async def main():
        async with connect(ConnectOptions(traddr=testbed.rdma_addr, nqn=testbed.nqn,
                                          keep_alive_tmo=KATO)) as ctrl:
            await ctrl.namespaces[1].read(0, 4096)
            ctrl.register(bytearray(1 << 20))
            assert ours(os.getpid())

    trio.run(main)
    assert ours(os.getpid()) == []
    assert wait_for(lambda: not target_controllers(testbed.nqn), KATO / 4), \
        target_controllers(testbed.nqn)
