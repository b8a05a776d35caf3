"""bench_tls_records (scripts/benches): the userspace record layer beside plain TCP and
``openssl speed``, every column filled in one short run; figures are printed, never checked."""

from __future__ import annotations

import bench_tls_records
import pytest


def test_a_short_run_prints_every_path_with_its_cpu(capsys):
    assert bench_tls_records.main(["--seconds", "0.2", "--suites", "128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["path", "MB/s", "CPU", "s", "per", "GB", "MB", "per", "CPU",
                                "s"]
    rows = {line.split("  ")[0].strip(): line for line in lines[3:]}
    assert set(rows) >= {"plain TCP (loopback)", "userspace records, TLS_AES_128_GCM_SHA256"}
    for name in ("plain TCP (loopback)", "userspace records, TLS_AES_128_GCM_SHA256"):
        mb_per_s, cpu, per_core = rows[name].split()[-3:]
        assert float(mb_per_s.replace(",", "")) > 0 and float(cpu) > 0
        assert float(per_core.replace(",", "")) > 0


def test_an_unknown_suite_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        bench_tls_records.main(["--suites", "512"])
    assert info.value.code == 2
    assert "--suites '512' is not 128 or 256" in capsys.readouterr().err
