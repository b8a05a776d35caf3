"""Our core against the nvmeof library in alternating slices: the slicing and the table
(over fakes; the real run is part of scripts/bench)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from nvmeof_fuse import bench, bench_pair


class FakeNamespace:
    """Both sides' namespace: ours awaits, the library's blocks; each records its reads."""

    lba_size = 4096
    nlb = 1024
    info = SimpleNamespace(size_lbas=1024)

    def __init__(self) -> None:
        self.reads: list[int] = []

    async def read_into(self, slba: int, nlb: int, ref) -> None:
        await trio.sleep(0)
        self.reads.append(slba)

    def read(self, buf, slba: int, nlb: int) -> None:
        self.reads.append(slba)


def test_each_side_runs_every_slice_and_the_order_flips():
    ours, theirs = FakeNamespace(), FakeNamespace()
    order = []
    real_core, real_library = bench_pair.core_slice, bench_pair.library_slice

    async def core_slice(*args):
        order.append("core")
        return await real_core(*args)

    def library_slice(*args):
        order.append("nvmeof")
        return real_library(*args)

    region = SimpleNamespace(ref=lambda offset, length: (offset, length))
    args = SimpleNamespace(slices=3, slice_seconds=0.02)
    job = next(j for j in bench.JOBS if j.key == "rand_read_qd1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_pair, "core_slice", core_slice)
        mp.setattr(bench_pair, "library_slice", library_slice)
        result = trio.run(bench_pair._alternate, job, ours, region, None, theirs, None, args)
    assert order == ["core", "nvmeof", "nvmeof", "core", "core", "nvmeof"]
    assert ours.reads and theirs.reads
    assert [len(result["slices"][side]) for side in bench_pair.SIDES] == [3, 3]
    assert result["median"]["core"] > 0 and result["median"]["nvmeof"] > 0
    assert 0 <= result["ahead"] <= 3


def test_the_table_shows_both_medians_the_ratio_and_the_slices_ahead():
    results = {"slices": 8, "slice_seconds": 1.5, "errors": {"seq_write": "target gone"},
               "jobs": {"rand_read_qd1": {"median": {"core": 946.0, "nvmeof": 765.0},
                                          "ratio": 946 / 765, "ahead": 8,
                                          "cpu_us_per_io": {"core": 967, "nvmeof": 1287}}}}
    text = bench_pair.render(results)
    assert "8 alternating slices of 1.5 s" in text
    row = next(line for line in text.splitlines() if line.startswith("4 KiB randread QD1"))
    assert row.split()[5:10] == ["946", "765", "1.24", "8", "of"]
    assert "967 / 1287" in row
    assert "1 MiB seq write QD16" in text and "n/a (target gone)" in text


@pytest.mark.parametrize("argv", [["--slices", "0"], ["--slice-seconds", "0"],
                                  ["--nsid", "0"], ["-s", "70000"]])
def test_bad_input_is_one_line(argv, capsys):
    assert bench_pair.main(["-a", "10.0.0.1", "-n", "nqn.x", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must be positive" in err
