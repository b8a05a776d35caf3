"""scripts/benches/bench.py: the companion runner (against the fake daemon), the side-by-side
table and the RAM namespace it mounts."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import bench
import pytest
from companion_fakes import AddressController, serving

BENCH = Path(bench.__file__)


def test_companion_runner_measures_every_job(tmp_path):
    ctrl = AddressController(specs=((2, 4096, 8192),))
    with serving(ctrl, tmp_path) as (server, mnt):
        results = bench.run_companion(SimpleNamespace(file=str(mnt / "n2"), seconds=0.2,
                                                      processes=1, jobs=None, start_at=0.0))
    assert set(results["metrics"]) == {"seq_read", "seq_write", "rand_read_qd1",
                                       "rand_read_qd16"}, results["errors"]
    assert all(v > 0 for v in results["metrics"].values())
    assert results["notes"]["staged_read_bytes"] == results["notes"]["daemon_copied_bytes"] == 0


def saved_results(tmp_path, metric: str, **values: float) -> dict[str, str]:
    """One result file per column holding ``metric``; column -> path, for bench.table."""
    files = {}
    for column, value in values.items():
        path = tmp_path / f"{column}.json"
        path.write_text(json.dumps({"metrics": {metric: value}, "errors": {}}))
        files[column] = str(path)
    return files


def test_table_has_a_companion_column_and_ratio(tmp_path):
    text, data = bench.table(saved_results(tmp_path, "seq_read", kernel=80.0, companion=60.0))
    assert "companion API" in text and "companion/kernel" in text
    assert "0.75" in text.splitlines()[2]
    assert data["figures"]["companion"] == {"seq_read": 60.0}


def test_table_sets_two_companion_processes_against_one(tmp_path):
    text, data = bench.table(saved_results(tmp_path, "rand_read_qd16", core=2000.0,
                                           companion=1800.0, companion2=2700.0))
    assert "companion, 2 processes" in text and "companion2/companion" in text
    row = text.splitlines()[6]
    assert "0.90" in row and "1.50" in row, row


def test_table_shows_fuse_over_ram_against_the_kernel(tmp_path):
    text, data = bench.table(saved_results(tmp_path, "rand_read_qd16", kernel=4000.0,
                                           fuse_ram=1000.0))
    assert "FUSE over RAM (fio)" in text and "fuse_ram/kernel" in text
    row = next(line for line in text.splitlines() if line.startswith("4 KiB randread QD16"))
    assert row.rstrip().endswith("0.25")
    assert bench.parser().parse_args(["table", "--fuse-ram", "F"]).fuse_ram == "F"


@pytest.mark.skipif(not os.access("/dev/fuse", os.W_OK) or not shutil.which("fusermount3"),
                    reason="needs /dev/fuse and fusermount3")
@pytest.mark.parametrize("fuse", ["builtin", "pyfuse3"])  # the host bench's two columns
def test_fuse_ram_mounts_a_ram_namespace_until_unmounted(tmp_path, fuse):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, str(BENCH), "fuse-ram", str(mnt),
                             "--size-mib", "2", "--fuse", fuse], stdout=subprocess.PIPE,
                            text=True)
    try:
        ready = selectors.DefaultSelector()
        ready.register(proc.stdout, selectors.EVENT_READ)
        assert ready.select(timeout=20), "fuse-ram did not mount within 20 s"
        assert proc.stdout.readline().strip() == f"READY {mnt}/n1"
        n1 = mnt / "n1"
        assert n1.stat().st_size == 2 << 20
        with open(n1, "r+b") as f:
            f.seek(12345)
            f.write(b"ram" * 1000)
            f.flush()
            f.seek(12345)
            assert f.read(3000) == b"ram" * 1000
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False, timeout=20)
        assert proc.wait(timeout=20) == 0


def test_fuse_ram_bad_input_is_one_line(tmp_path, capsys):
    assert bench.main(["fuse-ram", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("bench fuse-ram: ") and "does not exist" in err and err.count("\n") == 1
    assert bench.main(["fuse-ram", str(tmp_path), "--size-mib", "0"]) == 2
    assert capsys.readouterr().err == "bench: --size-mib must be positive\n"
    assert bench.main(["fuse-ram", str(tmp_path), "--fuse", "fusepy"]) == 1
    assert capsys.readouterr().err.startswith("bench fuse-ram: unknown FUSE server 'fusepy'")


def test_table_shows_the_tcp_columns_in_a_table_of_their_own(tmp_path):
    files = saved_results(tmp_path, "seq_write", kernel=30.0, kernel_tcp=200.0, core_tcp=160.0,
                          fuse_tcp=50.0)
    text, data = bench.table(files)
    assert "NVMe/TCP:" in text and "core_tcp/kernel_tcp" in text
    tcp = text.split("NVMe/TCP:")[1]
    row = next(line for line in tcp.splitlines() if line.startswith("1 MiB seq write QD16"))
    assert row.split()[-2:] == ["0.80", "0.25"]
    assert data["figures"]["core_tcp"] == {"seq_write": 160.0}
    assert "NVMe/TCP" not in bench.table(saved_results(tmp_path, "seq_read", kernel=1.0))[0]
    assert bench.parser().parse_args(["core", "-a", "x", "-n", "y", "-t", "tcp"]).transport == "tcp"


def test_table_shows_only_the_parts_that_ran(tmp_path):
    """BENCH_PARTS='kernel-tcp core-tcp fuse-tcp': no RDMA grid of n/a; a failed part shows."""
    files = saved_results(tmp_path, "seq_read", kernel_tcp=100.0, core_tcp=90.0)
    (tmp_path / "fuse_tcp.json.err").write_text("nvmeof-fuse mount -t tcp failed: refused\n")
    files.update(fuse_tcp=str(tmp_path / "fuse_tcp.json"), kernel=str(tmp_path / "kernel.json"),
                 core=str(tmp_path / "core.json"))  # not run: no file, no .err
    text, data = bench.table(files)
    assert text.startswith("NVMe/TCP:\n") and "kernel (fio)" not in text
    assert "n/a FUSE file over TCP (fio): nvmeof-fuse mount -t tcp failed: refused" in text
    assert "our core:" not in text and set(data["figures"]) == {"kernel_tcp", "core_tcp",
                                                                "fuse_tcp"}


def test_table_sets_the_host_figures_against_the_kernel_in_the_vm_with_the_caveat(tmp_path):
    files = saved_results(tmp_path, "rand_read_qd1", kernel_tcp=400.0, core_tcp_host=600.0,
                          fuse_tcp_host=200.0)
    text, data = bench.table(files)
    assert text.startswith("NVMe/TCP from the host:\n") and "our core over TCP" not in text
    row = next(line for line in text.splitlines() if line.startswith("4 KiB randread QD1 "))
    assert row.split()[-2:] == ["1.50", "0.50"], row
    assert "QEMU user networking is part of their figures" in text
    assert "measured inside the VM" in text
    args = bench.parser().parse_args(["table", "--core-tcp-host", "A", "--fuse-tcp-host", "B"])
    assert (args.core_tcp_host, args.fuse_tcp_host) == ("A", "B")


@pytest.mark.skipif(not os.access("/dev/fuse", os.W_OK) or not shutil.which("fusermount3"),
                    reason="needs /dev/fuse and fusermount3")
def test_fuse_ram_serves_an_image_file(tmp_path):
    image = tmp_path / "ram.img"
    image.write_bytes(bytes(range(256)) * (4 << 10))  # 1 MiB
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, str(BENCH), "fuse-ram", str(mnt),
                             "--image", str(image)], stdout=subprocess.PIPE, text=True)
    try:
        ready = selectors.DefaultSelector()
        ready.register(proc.stdout, selectors.EVENT_READ)
        assert ready.select(timeout=20), "fuse-ram did not mount within 20 s"
        assert proc.stdout.readline().strip() == f"READY {mnt}/n1"
        with open(mnt / "n1", "r+b") as f:
            assert f.read(512) == bytes(range(256)) * 2
            f.seek(4096)
            f.write(b"image" * 100)
            f.flush()
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False, timeout=20)
        assert proc.wait(timeout=20) == 0
    assert image.read_bytes()[4096:4596] == b"image" * 100  # the image's own bytes changed


def test_fuse_ram_refuses_an_image_of_a_partial_lba(tmp_path, capsys):
    image = tmp_path / "odd.img"
    image.write_bytes(b"x" * 5000)
    assert bench.main(["fuse-ram", str(tmp_path), "--image", str(image)]) == 1
    assert capsys.readouterr().err == (f"bench fuse-ram: {image} is 5000 bytes, not a positive "
                                       "multiple of the 4096 B LBA size\n")
    assert bench.main(["fuse-ram", str(tmp_path), "--image", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("bench fuse-ram: cannot map ") and err.count("\n") == 1


def test_no_bench_is_in_the_installed_package():
    """The benches and the RAM namespace live under scripts/ and tests/, out of the wheel."""
    import importlib.util
    import pkgutil

    import nvmeof_fuse

    modules = [m.name for m in pkgutil.walk_packages(nvmeof_fuse.__path__, "nvmeof_fuse.")]
    assert "nvmeof_fuse.fs.mount" in modules
    assert [m for m in modules if "bench" in m or "ramdisk" in m] == []
    assert importlib.util.find_spec("nvmeof_fuse.bench") is None
    assert BENCH.parent.name == "benches" and BENCH.parent.parent.name == "scripts"
