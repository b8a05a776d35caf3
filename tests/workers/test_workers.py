"""FUSE workers on the host: ``nvmeof-fuse mount --workers N`` over the fake NVMe/TCP target.

Each test mounts through the kernel (fusermount3, /dev/fuse) in a child process and talks to
it with real tools; every wait is bounded.  The parts are tested without FUSE beside their
modules (test_supervisor.py, test_worker.py, test_fs.py; shared handles in
tests/fs/test_operations.py, stats summed over workers in tests/fs/test_info.py).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tcp_target import NQN

from nvmeof_fuse.fs.mount import read_mountinfo

ROOT = Path(__file__).resolve().parents[2]
STEP = 60.0  # s: bound on any one wait (a loaded host)
SIZE_MIB = 16

# --- without FUSE ----------------------------------------------------------------------------


# --- through the kernel --------------------------------------------------------------------

needs_fuse = pytest.mark.skipif(
    not os.access("/dev/fuse", os.R_OK | os.W_OK) or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3")


def wait_for(cond, what: str, timeout: float = STEP, detail=lambda: ""):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {detail()}")
        time.sleep(0.05)


def is_mounted(path: Path) -> bool:
    return any(m.mountpoint == str(path) for m in read_mountinfo())


@pytest.fixture
def target():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "tcp_target.py"),
                             str(SIZE_MIB)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = {}
        reader = threading.Thread(target=lambda: port.setdefault("p", proc.stdout.readline()))
        reader.start()
        reader.join(STEP)
        assert port.get("p", "").strip().isdigit(), "the fake target did not start"
        yield int(port["p"])
    finally:
        proc.kill()
        proc.wait(STEP)


class WorkerMount:
    """``nvmeof-fuse mount --workers N`` in the foreground, in a child process."""

    def __init__(self, path: Path, port: int, workers: int, log: Path, *extra: str) -> None:
        self.path, self.log, self.workers = path, log, workers
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nvmeof_fuse.cli", "mount", "-t", "tcp", "-a", "127.0.0.1",
             "-s", str(port), "-n", NQN, "-k", "0", "--workers", str(workers), *extra,
             str(path)], stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
        wait_for(lambda: is_mounted(path) or self.proc.poll() is not None, "the mount")
        assert self.proc.poll() is None, self.text()
        if workers > 1:
            wait_for(lambda: len(self.serving()) >= workers - 1, "the workers to serve")
            wait_for(lambda: len(self.stats().get("workers", [])) >= workers,
                     "the workers' first reports")

    def text(self) -> str:
        return self.log.read_text()

    def serving(self) -> list[str]:
        return [line for line in self.text().splitlines() if " serves on queues " in line]

    def stats(self) -> dict:
        return json.loads((self.path / ".nvmeof" / "stats.json").read_bytes())

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.stats().get("workers", [])[1:]]

    def unmount(self) -> int:
        subprocess.run(["fusermount3", "-u", str(self.path)], timeout=STEP, check=False)
        return self.proc.wait(STEP)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STEP)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STEP)
        if is_mounted(self.path):
            subprocess.run(["fusermount3", "-uz", str(self.path)], timeout=STEP, check=False)


@pytest.fixture
def mounted(tmp_path, target):
    made = []

    def mount(workers: int, *extra: str) -> WorkerMount:
        path = tmp_path / f"mnt{len(made)}"
        path.mkdir()
        m = WorkerMount(path, target, workers, tmp_path / f"mount{len(made)}.log", *extra)
        made.append(m)
        return m

    yield mount
    for m in made:
        m.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _hammer(path: Path, seed: int, seconds: float, errors: list) -> None:
    """O_DIRECT 4 KiB reads and writes of our own pattern at our own LBAs, checked."""
    import mmap

    rng = random.Random(seed)
    buf = mmap.mmap(-1, 4096)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            lba = rng.randrange(SIZE_MIB * 256 // 16) * 16 + seed  # ours alone (seed < 16)
            pattern = bytes([seed]) * 8 + lba.to_bytes(8, "little")
            buf[:] = pattern * 256
            try:
                os.pwrite(fd, buf, lba * 4096)
                buf[:] = bytes(4096)
                os.preadv(fd, [buf], lba * 4096)
                if buf[:16] != pattern:
                    errors.append(f"LBA {lba}: read back {bytes(buf[:16]).hex()}")
            except OSError as exc:
                errors.append(exc)
    finally:
        os.close(fd)


@needs_fuse
def test_one_worker_starts_no_process_and_reports_none(mounted):
    m = mounted(1)
    assert (m.path / "n1").stat().st_size == SIZE_MIB << 20
    assert "workers" not in m.stats()
    serving = m.stats()["serving"]
    assert {k: serving[k] for k in ("processes", "chosen")} == {"processes": 1,
                                                               "chosen": "--workers"}
    assert serving["main"]["requests"] > 0 and serving["main"]["parks"] > 0
    assert "FUSE worker" not in m.text()
    assert m.unmount() == 0


@needs_fuse
def test_two_workers_serve_reads_and_writes_byte_exact_and_stats_show_each(mounted):
    m = mounted(2)
    errors: list = []
    threads = [threading.Thread(target=_hammer, args=(m.path / "n1", seed, 3.0, errors))
               for seed in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STEP)
    assert errors == []
    stats = m.stats()
    assert [w["index"] for w in stats["workers"]] == [0, 1]
    assert (stats["serving"]["processes"], stats["serving"]["chosen"]) == (2, "--workers")
    per = [w["namespaces"]["n1"]["ops"] for w in stats["workers"]]
    assert all(p.get("write", {}).get("ops", 0) > 0 for p in per), per  # both served
    total = sum(p["write"]["ops"] for p in per)
    assert stats["n1"]["ops"]["write"]["ops"] >= total - 100  # (a report a second behind)
    assert stats["workers"][1]["qids"]
    pids = m.worker_pids()
    assert m.unmount() == 0
    assert not any(_alive(p) for p in pids)  # drained and gone with the mount
    text = m.text()  # each writer's close flushed n1 (a worker's last unlock may come after)
    assert "disconnected from" in text and "final flush" not in text, text


def _reads_and_writes(path: Path, seed: int, count: int) -> None:
    """``count`` O_DIRECT 4 KiB writes, each read back, at LBAs of our own."""
    import mmap

    buf = mmap.mmap(-1, 4096)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        for i in range(count):
            offset = ((i * 16 + seed) % (SIZE_MIB * 256)) * 4096
            buf[:8] = i.to_bytes(8, "little")
            os.pwrite(fd, buf, offset)
            os.preadv(fd, [buf], offset)
    finally:
        os.close(fd)


@needs_fuse
def test_a_workers_reads_and_writes_send_the_main_process_nothing(mounted):
    """Issue #60: the messages a worker sends the main process (its report counts them by
    kind) do not grow with its READs and WRITEs: 2,000 of them across the workers add no
    forwarded WRITE and only the opens and closes of the files (and of stats.json, which
    the main process serves) as forwarded requests."""
    m = mounted(2)
    before = m.stats()["workers"][1]
    threads = [threading.Thread(target=_reads_and_writes, args=(m.path / "n1", seed, 250))
               for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STEP)

    def reported_after() -> bool:  # a report made after the I/O (one each second)
        time.sleep(1.0)  # (each look reads stats.json: a few forwarded requests)
        return m.stats()["workers"][1]["to_main"]["report"] >= before["to_main"]["report"] + 3

    wait_for(reported_after, "the worker's report after the I/O")
    after = m.stats()["workers"][1]
    sent = {kind: after["to_main"].get(kind, 0) - before["to_main"].get(kind, 0)
            for kind in ("meta", "read", "write")}
    assert after["requests"] - before["requests"] > 0  # it served its share
    assert sent["write"] == 0, after
    # 4 writers' LOOKUP, OPEN, GETATTR, FLUSH, RELEASE, and at most 10 reads of stats.json
    # with theirs (a worker counted 7 per fio job, whatever its length): no lock or
    # anything else per request, which would be over 500 here
    assert sent["meta"] + sent["read"] <= 4 * 5 + 10 * 8, after


@needs_fuse
def test_a_worker_killed_under_load_is_replaced_and_its_queues_come_back(mounted):
    m = mounted(2)
    first = m.stats()["workers"][1]
    errors: list = []
    threads = [threading.Thread(target=_hammer, args=(m.path / "n1", seed, 4.0, errors))
               for seed in range(1, 5)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    os.kill(first["pid"], signal.SIGKILL)
    for t in threads:
        t.join(STEP)
    assert not any(t.is_alive() for t in threads)  # nothing hung
    # The requests the dead worker held failed (the kernel ends them), and nothing else.
    assert all(isinstance(e, OSError) and e.errno == errno.ECONNABORTED for e in errors), errors
    wait_for(lambda: len(m.serving()) >= 2, "a replacement worker", detail=m.text)
    assert "killed by signal 9" in m.text()
    wait_for(lambda: [w["pid"] for w in m.stats().get("workers", [])[1:]]
             not in ([], [first["pid"]]),
             "the replacement's report")
    second = m.stats()["workers"][1]
    assert second["qids"] == first["qids"]  # its queue IDs came back and were leased again
    errors.clear()
    # The LBAs it wrote (and held locks of as it died) are free for every process: writes
    # to them succeed, none waits out the mount's timeout (ETIMEDOUT).
    threads = [threading.Thread(target=_hammer, args=(m.path / "n1", seed, 1.0, errors))
               for seed in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STEP)
    assert errors == []
    assert m.unmount() == 0


@needs_fuse
def test_writes_racing_across_workers_and_a_companion_client_never_tear(mounted):
    """Writers own byte stripes that share LBAs: a read-modify-write that another process's
    write slipped into would lose bytes.  Model: every byte is its owner's.  1,500 writes,
    over the main process and two workers (each taking the range locks itself) and a
    companion client (through the main process)."""
    import numpy as np

    from nvmeof_fuse import File, empty

    m = mounted(3)
    stripe, stripes, writers = 700, 1500, 5  # four FUSE writers and a companion client
    span = stripe * stripes

    def expected(i: int) -> bytes:
        return bytes([(i * 7 + 1) % 251 + 1]) * stripe

    def fuse_writer(w: int) -> None:
        # O_DIRECT: each 700-byte write reaches the mount as it is (buffered ones would
        # come as whole pages), read-modify-writing the LBAs it shares with its neighbours
        fd = os.open(m.path / "n1", os.O_WRONLY | os.O_DIRECT)
        try:
            order = [i for i in range(stripes) if i % writers == w]
            random.Random(w).shuffle(order)
            for i in order:
                os.pwrite(fd, expected(i), i * stripe)
        finally:
            os.close(fd)

    def companion_writer(w: int) -> None:
        buf = empty(stripe, dtype=np.uint8)  # shared memory: placed, never staged
        with File(str(m.path / "n1")) as f:
            order = [i for i in range(stripes) if i % writers == w]
            random.Random(w).shuffle(order)
            for i in order:
                buf[:] = np.frombuffer(expected(i), dtype=np.uint8)
                f.write(buf, file_offset=i * stripe)

    fd = os.open(m.path / "n1", os.O_WRONLY)
    os.pwrite(fd, bytes(span), 0)
    os.close(fd)
    threads = [*(threading.Thread(target=fuse_writer, args=(w,)) for w in range(writers - 1)),
               threading.Thread(target=companion_writer, args=(writers - 1,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STEP * 2)
    assert not any(t.is_alive() for t in threads)
    fd = os.open(m.path / "n1", os.O_RDONLY | os.O_DIRECT)
    try:
        import mmap

        buf = mmap.mmap(-1, (span + 4095) // 4096 * 4096)
        os.preadv(fd, [buf], 0)
    finally:
        os.close(fd)
    mismatches = [i for i in range(stripes) if buf[i * stripe:(i + 1) * stripe] != expected(i)]
    assert mismatches == []

    def workers_wrote() -> bool:  # (their reports come each second)
        return all(w["namespaces"]["n1"]["ops"].get("write", {}).get("ops", 0) > 0
                   for w in m.stats()["workers"][1:])

    wait_for(workers_wrote, "the workers' reports of their writes", timeout=10)
    assert m.unmount() == 0


@needs_fuse
def test_sigterm_drains_the_workers_too(mounted):
    m = mounted(3)
    pids = m.worker_pids()
    assert len(pids) == 2
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(STEP) == 0
    wait_for(lambda: not any(_alive(p) for p in pids), "the workers to exit")
    assert not is_mounted(m.path)


@needs_fuse
def test_cached_pages_are_dropped_after_a_companion_write_with_workers(mounted):
    import numpy as np

    from nvmeof_fuse import File, empty

    m = mounted(2)
    path = m.path / "n1"
    fd = os.open(path, os.O_RDWR)  # open across the companion write: its pages stay cached
    try:
        os.pwrite(fd, b"old!" * 1024, 1 << 20)
        assert os.pread(fd, 4096, 1 << 20) == b"old!" * 1024
        buf = empty(4096, dtype=np.uint8)
        buf[:] = np.frombuffer(b"new!" * 1024, dtype=np.uint8)
        with File(str(path)) as cf:
            cf.write(buf, file_offset=1 << 20)
        assert os.pread(fd, 4096, 1 << 20) == b"new!" * 1024
    finally:
        os.close(fd)
    assert m.unmount() == 0
