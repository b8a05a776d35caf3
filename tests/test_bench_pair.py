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


class FakePeer:
    """A peer whose slices read the library-style namespace (blocking calls)."""

    key = "nvmeof"

    def __init__(self, ns: FakeNamespace, order: list[str]) -> None:
        self.ns, self.order = ns, order

    def cursor(self, job):
        return bench.Cursor(job, self.ns.lba_size, self.ns.info.size_lbas)

    def run(self, job, cur, seconds):
        self.order.append(self.key)
        return bench.library_slice(None, self.ns, None, job, cur, seconds)


def test_each_side_runs_every_slice_and_the_order_flips():
    ours, theirs = FakeNamespace(), FakeNamespace()
    order = []
    real_core = bench_pair.core_slice

    async def core_slice(*args):
        order.append("core")
        return await real_core(*args)

    region = SimpleNamespace(ref=lambda offset, length: (offset, length))
    args = SimpleNamespace(slices=3, slice_seconds=0.02)
    job = next(j for j in bench.JOBS if j.key == "rand_read_qd1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_pair, "core_slice", core_slice)
        result = trio.run(bench_pair._alternate, job, ours, region, FakePeer(theirs, order), args)
    assert order == ["core", "nvmeof", "nvmeof", "core", "core", "nvmeof"]
    assert ours.reads and theirs.reads
    assert [len(result["slices"][side]) for side in ("core", "nvmeof")] == [3, 3]
    assert result["median"]["core"] > 0 and result["median"]["nvmeof"] > 0
    assert 0 <= result["ahead"] <= 3


class FakeFuture:
    def __init__(self, done: list, at: int) -> None:
        self.done, self.at = done, at

    def get(self) -> int:
        self.done.append(self.at)
        return 4096


def test_a_companion_slice_keeps_qd_futures_in_flight_from_one_thread():
    done, started = [], []
    file = SimpleNamespace(lba_size=4096, nbytes=1024 * 4096)

    def pread(buf, size, offset):
        started.append((buf, size, offset))
        return FakeFuture(done, offset)

    file.pread = pread
    job = next(j for j in bench.JOBS if j.key == "rand_read_qd16")
    cur = bench.Cursor(job, file.lba_size, file.nbytes // file.lba_size)
    count, elapsed = bench.companion_slice(file, list(range(16)), job, cur, 0.02)
    assert count == len(done) == len(started) and count >= 16 and elapsed > 0
    assert [buf for buf, _, _ in started[:16]] == list(range(16))  # each future its own memory
    assert all(size == 4096 and offset % 4096 == 0 for _, size, offset in started)


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
    assert "against the nvmeof library" in text  # results from before the peer was named


def test_the_companion_table_names_its_peer():
    results = {"peer": "companion", "slices": 8, "slice_seconds": 1.5, "errors": {},
               "jobs": {"seq_read": {"median": {"core": 55.0, "companion": 50.0},
                                     "ratio": 1.1, "ahead": 6,
                                     "cpu_us_per_io": {"core": 3480, "companion": 4400}}}}
    text = bench_pair.render(results)
    assert "our core against the companion API, 8 alternating slices" in text
    assert "core/companion" in text.splitlines()[1]
    row = next(line for line in text.splitlines() if line.startswith("1 MiB seq read"))
    assert "55.0" in row and "50.0" in row and "1.10" in row and "3480 / 4400" in row


@pytest.mark.parametrize(("argv", "says"), [
    (["--slices", "0"], "must be positive"), (["--slice-seconds", "0"], "must be positive"),
    (["--nsid", "0"], "must be positive"), (["-s", "70000"], "must be positive"),
    (["--peer", "companion"], "--file names the mounted namespace file"),
    (["--file", "/mnt/n2"], "with --peer companion only"),
])
def test_bad_input_is_one_line(argv, says, capsys):
    assert bench_pair.main(["-a", "10.0.0.1", "-n", "nqn.x", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
