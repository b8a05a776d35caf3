"""What the filesystem asks the kernel for (fsname, subtype) and the namespace check."""

import sys
from pathlib import Path

import pytest

from nvmeof_fuse.fs.mount import MountError, check_nsid, fuse_options
from nvmeof_fuse.fs.mount_options import MountOptions

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
