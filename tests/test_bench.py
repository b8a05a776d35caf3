"""The bench's companion runner (against the fake daemon) and its side-by-side table."""

from __future__ import annotations

import json
from types import SimpleNamespace

from companion_fakes import AddressController, serving

from nvmeof_fuse import bench


def test_companion_runner_measures_every_job(tmp_path):
    ctrl = AddressController(specs=((2, 4096, 8192),))
    with serving(ctrl, tmp_path) as (server, mnt):
        results = bench.run_companion(SimpleNamespace(file=str(mnt / "n2"), seconds=0.2))
    assert set(results["metrics"]) == {"seq_read", "seq_write", "rand_read_qd1",
                                       "rand_read_qd16"}, results["errors"]
    assert all(v > 0 for v in results["metrics"].values())
    assert results["notes"]["staged_read_bytes"] == results["notes"]["daemon_copied_bytes"] == 0


def test_table_has_a_companion_column_and_ratio(tmp_path):
    files = {}
    for column, value in (("kernel", 80.0), ("companion", 60.0)):
        path = tmp_path / f"{column}.json"
        path.write_text(json.dumps({"metrics": {"seq_read": value}, "errors": {}}))
        files[column] = str(path)
    text, data = bench.table(files)
    assert "companion API" in text and "companion/kernel" in text
    assert "0.75" in text.splitlines()[2]
    assert data["figures"]["companion"] == {"seq_read": 60.0}
