"""scripts/gpu/gpu_scale.py on the CPU: its parts run end to end on small sizes (the GPU
machine runs the same code with CUDA memory and more processes)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "gpu_scale.py"
STEP = 300  # s: bound on one run of the script (mounts, client processes, fio)

needs_fuse = pytest.mark.skipif(
    not os.access("/dev/fuse", os.R_OK | os.W_OK) or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3")


def scale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=STEP)


@needs_fuse
def test_companion_processes_read_over_tcp_on_queues_of_their_own():
    run = scale("--parts", "companion", "--processes", "2", "--seconds", "0.5",
                "--size-mib", "64", "--into", "host")
    assert run.returncode == 0, run.stderr[-2000:]
    for count in (1, 2):
        line = re.search(rf"^ +{count} process\(es\): +([\d.]+) GB/s .* per request$",
                         run.stdout, re.M)
        assert line and float(line.group(1)) > 0, run.stdout
    assert "own NVMe/TCP queues" in run.stdout  # placement: not through the daemon
    assert re.search(r"2 processes / 1: [\d.]+x \(goal 3x from 4: n/a\)", run.stdout)


@needs_fuse
@pytest.mark.skipif(shutil.which("fio") is None and shutil.which("gcc") is None,
                    reason="needs fio, or gcc to build the load generator")
def test_the_workers_part_prints_one_against_n_over_ram():
    run = scale("--parts", "workers", "--workers", "2", "--backends", "ram",
                "--seconds", "0.5")
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"^\| ram \| 4 KiB randread QD32 \| 2 \| .* \| [\d.]+x \|$", run.stdout,
                     re.M), run.stdout


def test_gpu_memory_asked_for_without_cuda_is_one_line():
    pytest.importorskip("numpy")
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    except ImportError:
        pass
    run = scale("--parts", "companion", "--into", "gpu")
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "no CUDA device" in run.stderr


# --- the fake target's mount failing: nothing left behind ------------------------------------


@pytest.fixture
def gpu_scale(tmp_path, monkeypatch):
    """The script as a module, its folder under ``tmp_path``, and the processes it started
    (``started``: the target first)."""
    pytest.importorskip("nvmeof_fuse.procstat")
    spec = importlib.util.spec_from_file_location("gpu_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.started = []
    popen = subprocess.Popen

    def recording(*args, **kwargs):
        proc = popen(*args, **kwargs)
        module.started.append(proc)
        return proc

    monkeypatch.setattr(module.subprocess, "Popen", recording)
    monkeypatch.setattr(module.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "scale"))
    (tmp_path / "scale").mkdir()
    return module


def _target(tmp_path: Path, says: str) -> Path:
    script = tmp_path / "target.py"
    script.write_text(f"import sys, time\nsys.stdout.write({says!r})\nsys.stdout.flush()\n"
                      "time.sleep(600)\n")
    return script


def _left_nothing(module, tmp_path: Path) -> None:
    assert module.started[0].args[1] == str(module.TARGET)
    assert all(proc.poll() is not None for proc in module.started)  # the target and the mount
    assert not (tmp_path / "scale").exists()


def test_a_target_that_never_says_its_port_is_bounded_and_stopped(gpu_scale, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(gpu_scale, "TARGET", _target(tmp_path, "40"))  # no newline
    monkeypatch.setattr(gpu_scale, "TARGET_TIMEOUT", 0.5)
    with pytest.raises(gpu_scale.MountFailed, match=r"did not say its port within 0.5 s "
                                                    r"\(it said '40'\)"):
        gpu_scale.TcpMount(64)
    _left_nothing(gpu_scale, tmp_path)


def test_a_failed_mount_ends_the_part_with_one_line(gpu_scale, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_scale, "TARGET", _target(tmp_path, "4420\n"))
    monkeypatch.setattr(gpu_scale, "MOUNT", [sys.executable, "-c",
                                             "import sys; sys.exit('mount: cannot connect')"])
    assert gpu_scale.companion_part(2, 0.5, 1, "host", 64) is False
    err = capsys.readouterr().err
    assert err == ("gpu-check --scale: companion part: nvmeof-fuse mount over the fake target "
                   "failed: mount: cannot connect\n")
    _left_nothing(gpu_scale, tmp_path)


def test_a_mount_that_does_not_finish_is_bounded(gpu_scale, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_scale, "TARGET", _target(tmp_path, "4420\n"))
    monkeypatch.setattr(gpu_scale, "MOUNT", [sys.executable, "-c", "import time; time.sleep(600)"])
    monkeypatch.setattr(gpu_scale, "MOUNT_TIMEOUT", 0.5)
    with pytest.raises(gpu_scale.MountFailed, match="did not finish within 0.5 s"):
        gpu_scale.TcpMount(64)
    _left_nothing(gpu_scale, tmp_path)
