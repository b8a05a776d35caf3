"""Raising the kernel's FUSE max_background through fusectl (faked in a directory)."""

from __future__ import annotations

import pytest

from nvmeof_fuse.fs import mount
from nvmeof_fuse.fs.mount import MountInfo, raise_max_background


@pytest.fixture
def fusectl(tmp_path, monkeypatch):
    conn = tmp_path / "77"
    conn.mkdir()
    mounted = MountInfo("/mnt/x", "fuse.nvmeof", "nvmeof-fuse", "0:77")
    monkeypatch.setattr(mount, "_find_mount", lambda path: mounted if path == "/mnt/x" else None)
    return tmp_path, conn / "max_background"


def test_raises_the_default_limit(fusectl):
    root, knob = fusectl
    knob.write_text("12\n")
    assert raise_max_background("/mnt/x", 32, str(root)) == 32
    assert knob.read_text().strip() == "32"


def test_never_lowers_a_higher_limit(fusectl):
    root, knob = fusectl
    knob.write_text("64\n")
    assert raise_max_background("/mnt/x", 32, str(root)) == 64
    assert knob.read_text() == "64\n"


def test_without_fusectl_or_the_mount_it_keeps_the_default(fusectl):
    root, knob = fusectl
    assert raise_max_background("/mnt/x", 32, str(root)) is None  # fusectl not mounted
    assert not knob.exists()
    assert raise_max_background("/mnt/elsewhere", 32, str(root)) is None
