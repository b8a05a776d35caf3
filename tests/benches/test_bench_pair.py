"""Our core against the nvmeof library in alternating slices: the slicing and the table
(over fakes; the real run is part of scripts/bench)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import bench
import bench_pair
import pytest
import trio


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

    def __init__(self, ns: FakeNamespace, order: list[str], key: str = "nvmeof") -> None:
        self.ns, self.order, self.key = ns, order, key

    async def run(self, job, seconds):
        self.order.append(self.key)
        cur = bench.Cursor(job, self.ns.lba_size, self.ns.info.size_lbas)
        count, elapsed = bench.library_slice(None, self.ns, None, job, cur, seconds)
        return count, elapsed, count * 100e-6  # 100 us of CPU per I/O


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
    assert result["ratio"] == result["median"]["core"] / result["median"]["nvmeof"]


def test_against_the_companion_the_ratio_is_the_companions_over_the_cores():
    region = SimpleNamespace(ref=lambda offset, length: (offset, length))
    job = next(j for j in bench.JOBS if j.key == "rand_read_qd1")
    peer = FakePeer(FakeNamespace(), [], key="companion")
    result = trio.run(bench_pair._alternate, job, FakeNamespace(), region, peer,
                      SimpleNamespace(slices=2, slice_seconds=0.02))
    assert result["ratio"] == result["median"]["companion"] / result["median"]["core"]
    assert result["cpu_us_per_io"]["companion"] == 100  # the peer's own figure


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


def results_of(job: str, medians: dict, cpu: dict, *, ratio: float, ahead: int,
               slices: int = 8, peer: str | None = None, errors: dict | None = None) -> dict:
    """What _pair returns for one job (no "peer" key: results from before peers)."""
    results = {"slices": slices, "slice_seconds": 1.5, "errors": errors or {},
               "jobs": {job: {"median": medians, "ratio": ratio, "ahead": ahead,
                              "cpu_us_per_io": cpu}}}
    if peer:
        results["peer"] = peer
    return results


def test_the_table_shows_both_medians_the_ratio_and_the_slices_ahead():
    results = results_of("rand_read_qd1", {"core": 946.0, "nvmeof": 765.0},
                         {"core": 967, "nvmeof": 1287}, ratio=946 / 765, ahead=8,
                         errors={"seq_write": "target gone"})
    text = bench_pair.render(results)
    assert "8 alternating slices of 1.5 s" in text
    row = next(line for line in text.splitlines() if line.startswith("4 KiB randread QD1"))
    assert row.split()[5:10] == ["946", "765", "1.24", "8", "of"]
    assert "967 / 1287" in row
    assert "1 MiB seq write QD16" in text and "n/a (target gone)" in text
    assert "against the nvmeof library" in text  # results from before the peer was named


def test_the_companion_table_names_its_peer():
    results = results_of("seq_read", {"core": 55.0, "companion": 50.0},
                         {"core": 3480, "companion": 4400}, ratio=1.1, ahead=6,
                         peer="companion")
    text = bench_pair.render(results)
    assert "our core against the companion API, 8 alternating slices" in text
    assert "companion ahead in how many" in text and "companion/core" in text.splitlines()[1]
    row = next(line for line in text.splitlines() if line.startswith("1 MiB seq read"))
    assert "55.0" in row and "50.0" in row and "1.10" in row and "3480 / 4400" in row


class FakeFile:
    nsid, lba_size, nbytes = 2, 4096, 1024 * 4096

    def __init__(self, path: str) -> None:
        self.closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.closed = True

    def pread(self, buf, size, offset):
        return SimpleNamespace(get=lambda: size)


def test_the_companion_worker_runs_the_slices_asked_for_and_answers_each(monkeypatch):
    import io
    import json

    import nvmeof_fuse

    monkeypatch.setattr(nvmeof_fuse, "File", FakeFile)
    monkeypatch.setattr(nvmeof_fuse, "empty", lambda shape: list(range(shape[0])))
    asks = io.StringIO("".join(json.dumps({"job": key, "seconds": 0.01}) + "\n"
                               for key in ("rand_read_qd1", "rand_read_qd16")))
    out = io.StringIO()
    assert bench_pair.companion_worker("/mnt/n2", 2, asks, out) == 0
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replies[0] == {"ready": True}
    assert [set(r) for r in replies[1:]] == [{"count", "elapsed", "cpu"}] * 2
    assert all(r["count"] >= 1 for r in replies[1:])


def test_a_companion_worker_on_another_namespace_says_so_in_one_line(monkeypatch):
    import io
    import json

    import nvmeof_fuse

    monkeypatch.setattr(nvmeof_fuse, "File", FakeFile)
    out = io.StringIO()
    assert bench_pair.companion_worker("/mnt/n2", 1, io.StringIO(), out) == 1
    [reply] = [json.loads(line) for line in out.getvalue().splitlines()]
    assert reply == {"error": "/mnt/n2 is namespace 2, and our core reads namespace 1 "
                              "(--nsid)"}


@pytest.mark.parametrize(("argv", "says"), [
    (["--slices", "0"], "must be positive"), (["--slice-seconds", "0"], "must be positive"),
    (["--nsid", "0"], "must be positive"), (["-s", "70000"], "must be positive"),
    (["--peer", "companion"], "--file names the mounted namespace file"),
    (["--file", "/mnt/n2"], "with --peer companion only"),
    (["--peer", "kernel"], "--device names the kernel's block device"),
    (["--device", "/dev/nvme0n2"], "with --peer kernel only"),
    (["-t", "tcp"], "the nvmeof library speaks RDMA only"),
])
def test_bad_input_is_one_line(argv, says, capsys):
    assert bench_pair.main(["-a", "10.0.0.1", "-n", "nqn.x", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


def test_the_null_test_names_itself_and_its_ratio():
    results = results_of("rand_read_qd1", {"core": 666.0, "self": 696.0},
                         {"core": 1282, "self": 1332}, ratio=696 / 666, ahead=4, slices=6,
                         peer="self")
    text = bench_pair.render(results)
    assert "against itself in a worker process (a null test: the ratio should be 1)" in text
    row = next(line for line in text.splitlines() if line.startswith("4 KiB randread QD1"))
    assert "1.05" in row and "4 of 6" in row and "1282 / 1332" in row


class FakeWorkerOutput:
    """A worker's stdout, as the parent reads it: these chunks, then its end."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    async def receive_some(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


@pytest.mark.parametrize(("chunks", "message"), [
    ((b'{"error": "Compan', b'ionError: /mnt is not a mount"}\n'),
     r"^companion worker: CompanionError: /mnt is not a mount$"),
    ((b'{"rea',), r"^the companion worker ended \(its error is above\)$"),
], ids=["its error", "its end"])
def test_a_workers_error_or_end_reaches_the_parent_as_one_line(chunks, message):
    peer = bench_pair.WorkerPeer("companion", SimpleNamespace(stdout=FakeWorkerOutput(*chunks)),
                                 timeout=5.0)
    with pytest.raises(RuntimeError, match=message):
        trio.run(peer._reply, 5.0)


def test_a_worker_answers_line_by_line_however_its_output_is_cut():
    out = FakeWorkerOutput(b'{"ready": true}\n{"count": 3, "ela', b'psed": 1.5, "cpu": 0.1}\n')
    peer = bench_pair.WorkerPeer("self", SimpleNamespace(stdout=out), timeout=5.0)
    assert trio.run(peer._reply, 5.0) == {"ready": True}
    assert trio.run(peer._reply, 5.0) == {"count": 3, "elapsed": 1.5, "cpu": 0.1}


def test_the_core_worker_names_a_namespace_that_is_not_there(monkeypatch, capsys):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def own_core(args, prog, **options):
        raise bench.NoNamespace(prog, "namespace 9 not found (have [1, 2])")
        yield  # pragma: no cover

    monkeypatch.setattr(bench_pair, "own_core", own_core)
    assert trio.run(bench_pair.core_worker, SimpleNamespace(transport="rdma")) == 1
    assert capsys.readouterr().out == '{"error": "namespace 9 not found (have [1, 2])"}\n'


def fio_output(job: str, rw: str, total_ios: int, runtime_ms: int, error: int = 0) -> str:
    side = {"total_ios": total_ios, "runtime": runtime_ms}
    return "note: a notice fio printed first\n" + json.dumps(
        {"jobs": [{"jobname": job, "error": error, rw: side}]})


@pytest.mark.parametrize(("key", "rw", "bs", "qd"), [
    ("seq_read", "read", 1 << 20, 16), ("seq_write", "write", 1 << 20, 16),
    ("rand_read_qd1", "randread", 4096, 1), ("rand_read_qd16", "randread", 4096, 16)])
def test_a_kernel_slice_runs_fio_with_the_jobs_own_size_depth_and_pattern(key, rw, bs, qd):
    job = bench_pair.JOB_BY_KEY[key]
    command = bench_pair.fio_slice_command(job, "/dev/nvme1n2", 1.5)
    assert command[0] == "fio"
    for option in ("--filename=/dev/nvme1n2", "--direct=1", "--ioengine=libaio",
                   "--runtime=1500ms", "--time_based", f"--rw={rw}", f"--bs={bs}",
                   f"--iodepth={qd}"):
        assert option in command


def test_a_kernel_slice_counts_the_ios_and_the_runtime_fio_measured():
    job = bench_pair.JOB_BY_KEY["seq_write"]
    assert bench_pair.fio_slice_result(job, fio_output("slice", "write", 300, 1500)) == (300, 1.5)


@pytest.mark.parametrize(("output", "says"), [
    ("fio: no JSON at all", r"^fio printed no result \(ValueError"),
    ('{"jobs": []}', r"^fio printed no result \(IndexError"),
    (fio_output("slice", "read", 0, 1500, error=5), r"^fio's job failed \(error 5\)$"),
])
def test_a_kernel_slice_without_a_result_says_so_in_one_line(output, says):
    with pytest.raises(RuntimeError, match=says):
        bench_pair.fio_slice_result(bench_pair.JOB_BY_KEY["seq_read"], output)


def test_a_kernel_slice_runs_fio_once_and_shows_no_cpu_figure(monkeypatch):
    ran = []

    async def run_process(command, **kwargs):
        ran.append(command)
        return SimpleNamespace(returncode=0, stderr=b"",
                               stdout=fio_output("slice", "read", 12, 1500).encode())

    monkeypatch.setattr(trio, "run_process", run_process)
    peer = bench_pair.KernelPeer("/dev/nvme1n2")
    job = bench_pair.JOB_BY_KEY["rand_read_qd16"]
    assert trio.run(peer.run, job, 1.5) == (12, 1.5, None)
    assert len(ran) == 1 and "--filename=/dev/nvme1n2" in ran[0]


def test_a_failed_fio_names_the_device_and_its_last_line(monkeypatch):
    async def run_process(command, **kwargs):
        return SimpleNamespace(returncode=1, stdout=b"",
                               stderr=b"fio: pid=1, err=5/file:io_u.c, error=Input/output error\n")

    monkeypatch.setattr(trio, "run_process", run_process)
    peer = bench_pair.KernelPeer("/dev/nvme1n2")
    with pytest.raises(RuntimeError, match=r"^fio on /dev/nvme1n2 failed \(rc 1\): fio: pid=1"):
        trio.run(peer.run, bench_pair.JOB_BY_KEY["seq_read"], 1.5)


@pytest.mark.parametrize(("device", "says"), [
    ("/nonexistent/nvme9n1", r"^--device /nonexistent/nvme9n1: No such file or directory$"),
    (__file__, r"is not a block device$")])
def test_a_kernel_peer_on_no_block_device_says_so_in_one_line(device, says):
    args = SimpleNamespace(device=device, connect_timeout=5.0)
    with pytest.raises(RuntimeError, match=says):
        trio.run(bench_pair.KernelPeer.open, args)


def test_against_the_kernel_the_ratio_is_the_cores_and_the_kernel_cpu_is_not_shown():
    region = SimpleNamespace(ref=lambda offset, length: (offset, length))
    job = bench_pair.JOB_BY_KEY["rand_read_qd1"]

    class NoCpuPeer(FakePeer):
        async def run(self, job, seconds):
            count, elapsed, _ = await super().run(job, seconds)
            return count, elapsed, None

    peer = NoCpuPeer(FakeNamespace(), [], key="kernel")
    result = trio.run(bench_pair._alternate, job, FakeNamespace(), region, peer,
                      SimpleNamespace(slices=2, slice_seconds=0.02))
    assert result["ratio"] == result["median"]["core"] / result["median"]["kernel"]
    assert result["cpu_us_per_io"]["kernel"] is None
    results = results_of("seq_read", {"core": 180.0, "kernel": 200.0},
                         {"core": 9000, "kernel": None}, ratio=0.9, ahead=2, peer="kernel")
    results["transport"] = "tcp"
    text = bench_pair.render(results)
    assert text.startswith("our core over tcp against the kernel initiator (fio on its block")
    row = next(line for line in text.splitlines() if line.startswith("1 MiB seq read QD16"))
    assert "0.90" in row and "2 of 8" in row and "9000 / n/a" in row
