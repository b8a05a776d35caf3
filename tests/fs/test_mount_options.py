"""What the filesystem asks the kernel for (fsname, subtype) and the namespace check."""

import sys
from pathlib import Path

import pytest

from nvmeof_fuse.fs.mount import MountError, check_nsid, fuse_options
from nvmeof_fuse.fs.mount_options import (
    MAX_AUTO_WORKERS,
    MountOptions,
    auto_workers,
    usable_cores,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fakes import make_controller  # noqa: E402


def test_fstype_is_the_fstab_type_and_fsname_the_source():
    opts = fuse_options(MountOptions())
    assert "subtype=nvmeof-fuse" in opts and "fsname=nvmeof-fuse" in opts  # fuse.nvmeof-fuse
    uri = "nvme+rdma://10.0.0.1/nqn.2014-08.org.example:a,b"
    assert r"fsname=nvme+rdma://10.0.0.1/nqn.2014-08.org.example:a\,b" in fuse_options(
        MountOptions(source=uri))


def test_check_nsid():
    ctrl = make_controller((1, 512, 8), (2, 4096, 8))
    check_nsid(ctrl, None)
    check_nsid(ctrl, 2)
    with pytest.raises(MountError, match=r"^namespace 3 is not active on the controller "
                                         r"\(active: 1, 2\)$"):
        check_nsid(ctrl, 3)


@pytest.mark.parametrize(("cores", "workers"), [
    (1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (8, 4), (16, 8), (32, 16), (64, 16), (256, 16)])
def test_auto_workers_keep_one_on_two_cores_and_half_above_up_to_the_cap(cores, workers):
    """One process up to 2 usable cores (measured fastest there); above, half the cores,
    capped (unmeasured: the rule of the design)."""
    assert auto_workers(cores) == workers <= MAX_AUTO_WORKERS


def test_usable_cores_are_the_affinity_masks_not_the_machines():
    assert usable_cores(lambda pid: {0, 1, 2, 3}) == 4
    assert usable_cores(lambda pid: {7}) == 1  # taskset -c 7 on a bigger machine
    assert usable_cores(lambda pid: set()) == 1  # (never empty; at least one anyway)


def test_usable_cores_fall_back_to_the_online_count(monkeypatch):
    def refused(pid):
        raise OSError("no affinity here")

    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert usable_cores(refused) == 6
    monkeypatch.setattr("os.cpu_count", lambda: None)
    assert usable_cores(refused) == 1
