"""tests/fs/loadgen.c, bench_workers' stand-in for fio: built with gcc, run on a plain file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("loadgen.c")
STEP = 60  # s: bound on any single command or wait

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture(scope="module")
def loadgen(tmp_path_factory: pytest.TempPathFactory) -> str:
    binary = tmp_path_factory.mktemp("loadgen") / "loadgen"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-pthread", "-o", str(binary),
                    str(SOURCE)], check=True, timeout=STEP)
    return str(binary)


@pytest.fixture
def data(tmp_path: Path) -> tuple[str, list[str]]:
    """A 4 MiB file of the offset pattern ``--verify`` checks (the byte at offset O is O mod 256),
    and ``--buffered`` where its filesystem has no O_DIRECT."""
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * (4 << 12))
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:  # EINVAL: no O_DIRECT on this filesystem
        return str(path), ["--buffered"]
    return str(path), []


def _fails(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP)
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("loadgen: ")
    return lines[0]


@pytest.mark.parametrize(("rw", "bs", "size", "qd", "jobs"), [
    ("randread", "4k", 4096, 32, 1), ("randread", "4k", 4096, 32, 2),
    ("read", "1m", 1 << 20, 8, 1), ("read", "1m", 1 << 20, 8, 2)])
def test_reads_whole_blocks_of_the_right_data_and_prints_fios_fields(loadgen, data, rw, bs, size,
                                                                     qd, jobs):
    path, flags = data
    out = subprocess.run([loadgen, *flags, "--verify", path, rw, bs, str(qd), str(jobs), "1"],
                         capture_output=True, text=True, timeout=STEP, check=True)
    assert out.stderr == "" and len(out.stdout.splitlines()) == 1
    got = json.loads(out.stdout)
    assert got["total_ios"] > 0 and got["io_bytes"] == got["total_ios"] * size
    assert got["bw_bytes"] > 0 and got["bs"] == size and got["numjobs"] == jobs
    assert got["direct"] == (0 if flags else 1)


def test_a_block_that_is_not_the_pattern_fails_verify(loadgen, data):
    path, flags = data
    with open(path, "r+b") as f:
        f.seek(3 << 20 | 5)
        f.write(b"\xff")
    assert "data at 3145733: 255, the pattern wants 5" in _fails(
        [loadgen, *flags, "--verify", path, "read", "1m", "1", "1", "30"])


def test_a_file_that_shrinks_under_it_is_a_short_read_and_fails(loadgen, data):
    path, flags = data
    proc = subprocess.Popen([loadgen, *flags, path, "randread", "4k", "8", "2", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # its jobs start after it has read the size
        task, deadline = Path(f"/proc/{proc.pid}/task"), time.monotonic() + STEP
        while proc.poll() is None and len(list(task.iterdir())) < 3:
            assert time.monotonic() < deadline, "loadgen's jobs did not start"
            time.sleep(0.01)
        os.truncate(path, 0)
        stdout, stderr = proc.communicate(timeout=STEP)
    finally:
        proc.kill()
        proc.wait(STEP)
    assert proc.returncode == 1 and stdout == ""
    assert len(stderr.splitlines()) == 1 and "short read at " in stderr


@pytest.mark.parametrize(("args", "says"), [
    (["randread", "8m", "1", "1", "1"], "less than one block"),
    (["write", "4k", "1", "1", "1"], "want randread or read"),
    (["read", "4x", "1", "1", "1"], "block size 4x"),
    (["read", "4k", "0", "1", "1"], "iodepth 0"),
    (["read", "4k", "1", "1", "-1"], "seconds -1"),
    (["read", "4k", "1", "1", "inf"], "seconds inf: want a positive finite number"),
    (["read", "4k", "1", "1", "nan"], "seconds nan"),
    (["read", "4k", "1", "1", "1e400"], "seconds 1e400"),
    (["read", "18014398509481984k", "1", "1", "1"], "block size 18014398509481984k: too large"),
    (["read", "17592186044416m", "1", "1", "1"], "block size 17592186044416m: too large"),
    (["read", "99999999999999999999", "1", "1", "1"], "too large"),
    (["read", "-4k", "1", "1", "1"], "block size -4k"),
    (["read", "4k"], "usage:")])
def test_bad_arguments_are_one_line_and_exit_1(loadgen, data, args, says):
    path, flags = data
    assert says in _fails([loadgen, *flags, path, *args])


@pytest.mark.parametrize("bs", ["100", "4095", "1000"])
def test_o_direct_wants_a_block_size_in_whole_sectors(loadgen, data, bs):
    path, _ = data  # checked among the arguments, before the file is opened
    assert f"block size {bs}: O_DIRECT wants a multiple of 512" in _fails(
        [loadgen, path, "read", bs, "1", "1", "1"])


def test_buffered_takes_any_block_size(loadgen, data):
    path, _ = data
    out = subprocess.run([loadgen, "--buffered", "--verify", path, "randread", "100", "4", "1",
                          "0.2"], capture_output=True, text=True, timeout=STEP, check=True)
    assert json.loads(out.stdout)["bs"] == 100


def test_an_unknown_option_is_one_line_and_exit_1(loadgen, data):
    path, _ = data
    assert "option --bogus" in _fails([loadgen, "--bogus", path, "read", "4k", "1", "1", "1"])


def test_a_missing_file_is_one_line_and_exit_1(loadgen, tmp_path):
    assert "No such file" in _fails([loadgen, str(tmp_path / "none"), "read", "4k", "1", "1",
                                     "1"])
