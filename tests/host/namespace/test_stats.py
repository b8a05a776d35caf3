import json

import pytest

from nvmeof_fuse.host.namespace.stats import IoStats, LatencyHistogram


def test_counters_per_op():
    st = IoStats()
    st.record("read", 4096, 0.001, ok=True)
    st.record("read", 8192, 0.002, ok=True)
    st.record("read", 4096, 0.5, ok=False)
    st.record("write", 512, 0.0001)
    snap = st.snapshot()
    assert snap["ops"]["read"]["ops"] == 3
    assert snap["ops"]["read"]["bytes"] == 12288  # failed ops move no bytes
    assert snap["ops"]["read"]["errors"] == 1
    assert snap["ops"]["write"] == snap["ops"]["write"] | {"ops": 1, "bytes": 512, "errors": 0}


def test_named_counters():
    st = IoStats()
    st.add("direct_bytes", 4096)
    st.add("direct_bytes", 4096)
    st.add("staged_bytes")
    assert st.snapshot()["counters"] == {"direct_bytes": 8192, "staged_bytes": 1}


@pytest.mark.parametrize("scale", [1e-6, 1e-4, 1e-2, 1.0])
def test_percentiles_within_a_few_percent(scale):
    h = LatencyHistogram()
    samples = [scale * (1 + i / 1000) for i in range(10_000)]  # uniform in [s, 11 s)
    for s in reversed(samples):
        h.add(s)
    for q in (0.5, 0.9, 0.99, 0.999):
        true_ns = samples[int(q * len(samples)) - 1] * 1e9
        assert abs(h.percentile(q) - true_ns) <= 0.04 * true_ns + 1
    assert h.max_ns == int(samples[-1] * 1e9)
    assert h.count == 10_000


def test_histogram_stays_bounded():
    h = LatencyHistogram()
    for i in range(200_000):
        h.add(i * 1e-6)
    assert len(h.buckets) < 300


def test_empty_and_single_sample():
    h = LatencyHistogram()
    assert h.percentile(0.99) == 0
    h.add(0.000123)
    assert h.percentile(0.5) <= h.max_ns == 123_000


def test_snapshot_is_json_and_text_is_a_table():
    st = IoStats()
    st.record("read", 1 << 20, 0.00025)
    st.record("flush", 0, 0.001)
    st.add("rmw_lbas", 3)
    snap = json.loads(json.dumps(st.snapshot()))
    lat = snap["ops"]["read"]["latency_us"]
    assert set(lat) == {"p50", "p90", "p99", "p99.9", "max", "mean"}
    assert lat["max"] == pytest.approx(250.0)
    text = st.format_text()
    lines = text.splitlines()
    assert "p99.9" in lines[1] and "op" in lines[1]
    assert any(line.split()[0] == "read" and "1.0 MiB" in line for line in lines)
    assert "rmw_lbas: 3" in text and text.endswith("\n")
