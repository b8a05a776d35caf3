"""scripts/benches/bench_host.py: its table from canned figures, its fio parsing, its errors."""

from __future__ import annotations

import bench_host
import pytest

CANNED = {
    "figures": {"loop": {"randread16": 200000.0, "read1m": 5000.0},
                "qemu": {"randread16": 40000.0, "read1m": 1400.0, "write1m": 900.0},
                "ours": {"randread16": 20000.0, "read1m": 4200.0},
                "pyfuse3": {"randread16": 8000.0, "read1m": 2100.0}},
    "cpu_us": {"qemu": {"randread16": 25.0}, "ours": {"randread16": 61.4},
               "pyfuse3": {"randread16": 150.2}},
    "errors": {"ours": {"write1m": "fio error 5"}},
    "notes": ["load average 1.00 before, 1.50 after (2 CPUs)"],
}


def test_host_table_shows_every_server_its_cpu_and_the_ratios():
    text = bench_host.table(CANNED)
    head, rule, *rows = text.splitlines()
    assert all(title in head for title in bench_host.COLUMNS.values())
    assert "ours/qemu" in head and "ours/loop" in head and "ours/pyfuse3" in head
    row = next(r for r in rows if r.startswith("4 KiB randread QD16, IOPS"))
    assert "200,000" in row and "40,000 (25 us)" in row and "20,000 (61 us)" in row
    assert "8,000 (150 us)" in row  # pyfuse3 beside ours: the reason ours is the default
    assert row.split()[-3:] == ["0.50x", "0.10x", "2.50x"]
    big = next(r for r in rows if r.startswith("1 MiB read QD16, MB/s"))
    assert big.split()[-3:] == ["3.00x", "0.84x", "2.00x"]
    write = next(r for r in rows if r.startswith("1 MiB write QD16"))
    assert write.split()[-3:] == ["n/a", "n/a", "n/a"] and "900" in write
    assert "n/a our FUSE over RAM, write1m: fio error 5" in text
    assert "note: load average 1.00 before" in text
    assert len([r for r in rows if "QD" in r]) == len(bench_host.JOBS)


def test_host_table_as_markdown():
    md = bench_host.markdown(CANNED).splitlines()
    assert md[0].startswith("| job | kernel loop device |") and md[1].startswith("|---|")
    assert md[0].endswith("| the same on pyfuse3 | ours/qemu | ours/loop | ours/pyfuse3 |")
    assert md[2] == ("| 4 KiB randread QD16, IOPS | 200,000 | 40,000 (25 us) | 20,000 (61 us) "
                     "| 8,000 (150 us) | 0.50x | 0.10x | 2.50x |")


def test_host_bench_reads_fio_json():
    job = next(j for j in bench_host.JOBS if j.key == "write1m")
    data = {"jobs": [{"jobname": "write1m", "error": 0, "read": {"iops": 0, "bw_bytes": 0},
                      "write": {"iops": 900.0, "bw_bytes": 943718400}}]}
    assert bench_host.fio_figure(job, data) == pytest.approx(943.7184)
    data["jobs"][0]["error"] = 5
    with pytest.raises(RuntimeError, match="fio error 5"):
        bench_host.fio_figure(job, data)


def test_host_bench_bad_input_is_one_line(capsys):
    assert bench_host.main(["--seconds", "0"]) == 2
    assert capsys.readouterr().err == "bench host: --seconds and --size-mib must be positive\n"
    with pytest.raises(SystemExit):
        bench_host.main(["--only", "loop,nfs"])
    assert "unknown server nfs (have loop, qemu, ours, pyfuse3)" in capsys.readouterr().err
