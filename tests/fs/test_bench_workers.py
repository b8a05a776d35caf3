"""tests/fs/bench_workers.py's choice of load generator and libfuse peer."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
try:
    from bench_workers import Generator, build_peer, load_generator
finally:
    sys.path.remove(str(Path(__file__).parent))


def _on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *names: str) -> Path:
    """PATH set to a folder holding only ``names``, as executables."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in names:
        (folder / name).write_text("#!/bin/sh\n")
        (folder / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    return folder


def test_fio_where_it_is_on_path_unless_loadgen_is_asked_for(tmp_path, monkeypatch):
    folder = _on_path(tmp_path, monkeypatch, "fio", "loadgen")
    assert load_generator(None, str(tmp_path)) == Generator("fio", str(folder / "fio"))
    assert load_generator("loadgen", str(tmp_path)) == Generator("loadgen",
                                                                  str(folder / "loadgen"))


def test_the_prebuilt_loadgen_without_fio(tmp_path, monkeypatch):
    folder = _on_path(tmp_path, monkeypatch, "loadgen")
    assert load_generator(None, str(tmp_path)) == Generator("loadgen", str(folder / "loadgen"))


def test_fio_asked_for_but_missing_is_one_line(tmp_path, monkeypatch):
    _on_path(tmp_path, monkeypatch, "loadgen")
    with pytest.raises(SystemExit, match="no fio on PATH"):
        load_generator("fio", str(tmp_path))


def test_nothing_to_run_and_no_gcc_is_one_line(tmp_path, monkeypatch):
    _on_path(tmp_path, monkeypatch)
    with pytest.raises(SystemExit, match="no load generator: .* loadgen.c does not build"):
        load_generator(None, str(tmp_path))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_without_fio_or_loadgen_it_builds_loadgen(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", os.path.dirname(shutil.which("gcc")))
    gen = load_generator("loadgen", str(tmp_path))
    assert gen == Generator("loadgen", str(tmp_path / "loadgen"))
    assert os.access(gen.binary, os.X_OK)


def test_a_prebuilt_peer_on_path_is_used(tmp_path, monkeypatch):
    folder = _on_path(tmp_path, monkeypatch, "peer_fuse_ram")
    assert build_peer(str(tmp_path)) == str(folder / "peer_fuse_ram")
