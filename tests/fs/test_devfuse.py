"""/dev/fuse and fusermount3 (fs/devfuse.py): the mount helper's one-line errors, and the
clone ioctl a FUSE worker's descriptor comes from."""

from __future__ import annotations

import os
import shutil

import pytest

from nvmeof_fuse.fs.devfuse import FUSE_DEV_IOC_CLONE, FuseMountError, mount_fd

needs_fuse = pytest.mark.skipif(
    not os.access("/dev/fuse", os.R_OK | os.W_OK) or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3")


@needs_fuse
def test_fusermount3_errors_are_one_line(tmp_path):
    with pytest.raises(FuseMountError, match=r"^unknown option 'bogus'$"):
        mount_fd(str(tmp_path), ["bogus"])
    with pytest.raises(FuseMountError, match=r"^failed to access mountpoint .*/nowhere: "):
        mount_fd(str(tmp_path / "nowhere"), ["fsname=x"])


def test_the_clone_ioctl_is_linux_ior_229_0_uint32():
    ior = 2 << 30 | 4 << 16 | 229 << 8 | 0  # _IOR(type, nr, size): dir, size, type, nr
    assert FUSE_DEV_IOC_CLONE == ior
