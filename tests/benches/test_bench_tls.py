"""bench_tls (scripts/benches): our core direct, through the plain relay and through the kTLS
relay, against the fake NVMe/TCP target; the host has no kTLS, so that column is n/a with the
reason (the real run, in the VM, is scripts/bench's part "tls")."""

from __future__ import annotations

import bench_tls
import pytest
from tcp_target import NQN, served_in_thread


def test_a_run_fills_the_plain_columns_and_names_why_ktls_is_not_there(tmp_path):
    with served_in_thread(size=32 << 20, mdts=0, maxh2cdata=1 << 20) as (target, _):
        args = bench_tls.parser().parse_args(
            ["-a", "127.0.0.1", "-s", str(target.port), "-n", NQN, "--nsid", "1",
             "--seconds", "0.2", "--jobs", "seq_read,rand_read_qd1"])
        results = bench_tls.run(args)
    for column in ("direct", "relay"):
        got = results["columns"][column]
        assert got["errors"] == {} and set(got["metrics"]) == {"seq_read", "rand_read_qd1"}
        assert got["tls"] == "off" and set(got["cpu_us_per_io"]) == set(got["metrics"])
    assert set(results["columns"]["relay"]["front_us_per_io"]) == {"seq_read", "rand_read_qd1"}
    ktls = results["columns"].get("ktls")
    if ktls is None:  # no kTLS here: the front refused the connection, in one line
        assert results["errors"]["ktls"].endswith(
            "(the front's failures: ['this kernel has no kTLS (modprobe tls)'])")
    text = bench_tls.render(results)
    assert "core plain relay" in text and "kernel --tls" in text
    assert "n/a kernel --tls: n/a: no nvmet TLS port here" in text
    assert "goal, our core over kTLS at 1 MiB >= 0.8x over plain TCP" in text
    for line in text.splitlines():
        if line.startswith("1 MiB seq read QD16 (MB/s)"):
            assert line.split()[6] == "n/a"  # kernel --tls


def test_a_run_without_a_target_says_what_it_needs(capsys):
    assert bench_tls.main(["--seconds", "1"]) == 2
    assert capsys.readouterr().err == "bench tls: -a and -n are needed\n"


def test_a_front_that_does_not_start_is_named_with_its_last_line(tmp_path):
    with pytest.raises(RuntimeError) as info:
        bench_tls.Front("plain", "127.0.0.1:port", None, tmp_path / "front.log")
    assert str(info.value) == ("the plain front did not start: ValueError: invalid literal "
                               "for int() with base 10: 'port'")
