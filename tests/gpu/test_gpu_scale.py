"""scripts/gpu/gpu_scale.py on the CPU: its parts run end to end on small sizes (the GPU
machine runs the same code with CUDA memory and more processes)."""

from __future__ import annotations

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
@pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio")
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
