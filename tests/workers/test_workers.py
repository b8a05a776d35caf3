"""FUSE workers on the host: ``nvmeof-fuse mount --workers N`` over the fake NVMe/TCP target.

Each test mounts through the kernel (fusermount3, /dev/fuse) in a child process and talks to
it with real tools; every wait is bounded.  The pure parts (handles that say what they
opened, stats summed over workers, WorkerFS's locks and forwarding) are tested without FUSE.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from ramdisk import ram_controller
from tcp_target import NQN

from nvmeof_fuse.fs import info
from nvmeof_fuse.fs.devfuse import FUSE_DEV_IOC_CLONE
from nvmeof_fuse.fs.mount import read_mountinfo
from nvmeof_fuse.fs.mount_options import MountOptions
from nvmeof_fuse.fs.operations import NamespaceFS, pack_fh, unpack_fh
from nvmeof_fuse.fs.wire import FUSEError
from nvmeof_fuse.workers.fs import WorkerFS
from nvmeof_fuse.workers.messages import FORWARD_CHUNK

ROOT = Path(__file__).resolve().parents[2]
STEP = 60.0  # s: bound on any one wait (a loaded host)
SIZE_MIB = 16

# --- without FUSE ----------------------------------------------------------------------------


def test_the_clone_ioctl_is_linux_ior_229_0_uint32():
    ior = 2 << 30 | 4 << 16 | 229 << 8 | 0  # _IOR(type, nr, size): dir, size, type, nr
    assert FUSE_DEV_IOC_CLONE == ior


@pytest.mark.parametrize("nsid,writable", [(1, True), (7, False), (0xFFFFFFFE, True), (0, False)])
def test_a_shared_handle_says_what_it_opened(nsid, writable):
    assert unpack_fh(pack_fh(12345, nsid, writable)) == (nsid, writable)


def test_any_process_reads_a_namespace_handle_it_did_not_open():
    ctrl = ram_controller((1, 512, 64), (2, 4096, 16))
    opener = NamespaceFS(ctrl, shared_handles=True)
    other = NamespaceFS(ctrl, shared_handles=True)

    async def main():
        fi = await opener.open(opener.ns_inodes[2], os.O_RDWR, None)
        assert fi.fh >> 1 & 0xFFFFFFFF == 2
        h = other.handles[fi.fh]  # never opened here
        assert h.node.ns.nsid == 2 and h.writable
        report = await opener.open(opener.nodes[opener._root.entries[b".nvmeof"]]
                                   .entries[b"stats.json"], os.O_RDONLY, None)
        with pytest.raises(KeyError):
            other.handles[report.fh]  # a report: only its opener can read it
        assert other.handles.get(report.fh) is None

    trio.run(main)


def test_without_workers_handles_stay_plain_counters():
    fs = NamespaceFS(ram_controller((1, 512, 64)))

    async def main():
        a = await fs.open(fs.ns_inodes[1], os.O_RDWR, None)
        b = await fs.open(fs.ns_inodes[1], os.O_RDONLY, None)
        assert (a.fh, b.fh) == (1, 2)

    trio.run(main)


def test_stats_sum_every_worker_and_show_each():
    op = {"ops": 10, "bytes": 40960, "errors": 1,
          "latency_us": {"p50": 5.0, "p99": 9.0, "max": 12.0, "mean": 6.0}}
    main = {"n1": {"uptime_s": 1.0, "ops": {"read": op}, "counters": {"x": 1}}}
    worker = {"index": 1, "pid": 99, "namespaces": {"n1": {
        "ops": {"read": {**op, "ops": 30, "latency_us": {"p50": 4.0, "p99": 20.0,
                                                        "max": 30.0, "mean": 2.0}},
                "write": op}, "counters": {"x": 2}}}}

    class Companion:
        def snapshot(self):
            return {}

        def own_reports(self):
            return [worker]

    class Ctrl:
        namespaces = {1: type("Ns", (), {"stats": type("S", (), {
            "snapshot": staticmethod(lambda: main["n1"])})})()}

    doc = info.stats_dict(Ctrl(), Companion())
    read = doc["n1"]["ops"]["read"]
    assert (read["ops"], read["bytes"], read["errors"]) == (40, 40960 * 2, 2)
    assert read["latency_us"]["max"] == 30.0 and read["latency_us"]["mean"] == 3.0
    assert doc["n1"]["ops"]["write"]["ops"] == 10 and doc["n1"]["counters"] == {"x": 3}
    assert [w["index"] for w in doc["workers"]] == [0, 1]
    assert doc["workers"][0]["namespaces"]["n1"]["ops"]["read"]["ops"] == 10  # main's own


def _worker_fs(ctrl, locks, forwarded):
    async def forward_read(fh, off, size):
        forwarded.append(("read", fh, off, size))
        return b"r" * size

    async def forward_write(fh, off, data):
        forwarded.append(("write", fh, off, len(data)))
        return len(data)

    @contextlib.asynccontextmanager
    async def write_lock(nsid, off, length):
        locks.append((nsid, off, length))
        yield

    return WorkerFS(ctrl, MountOptions(), forward_read=forward_read,
                    forward_write=forward_write, write_lock=write_lock)


def test_a_worker_writes_under_the_main_processes_range_lock():
    ctrl = ram_controller((1, 512, 64))
    locks, forwarded = [], []
    fs = _worker_fs(ctrl, locks, forwarded)

    async def main():
        fh = pack_fh(1, 1, True)
        assert not fs.start_write(fh, 0, memoryview(b"x" * 512), lambda ok: None)
        assert await fs.write(fh, 100, b"a" * 1000) == 1000
        assert locks == [(1, 100, 1000)]
        assert bytes(await fs.read(fh, 100, 1000)) == b"a" * 1000
        assert await fs.write(fh, 64 * 512 - 10, b"b" * 100) == 10  # cut at the end
        with pytest.raises(FUSEError) as read_only:
            await fs.write(pack_fh(2, 1, False), 0, b"c")
        assert read_only.value.errno == errno.EBADF
        assert forwarded == []

    trio.run(main)


def test_a_worker_forwards_reports_and_namespaces_it_does_not_know():
    ctrl = ram_controller((1, 512, 64))
    locks, forwarded = [], []
    fs = _worker_fs(ctrl, locks, forwarded)

    async def main():
        size = FORWARD_CHUNK * 2 + 5
        assert await fs.read(pack_fh(1, 0, False), 0, size) == b"r" * size
        assert [f[3] for f in forwarded] == [FORWARD_CHUNK, FORWARD_CHUNK, 5]
        forwarded.clear()
        assert await fs.write(pack_fh(1, 9, True), 4096, b"w" * size) == size
        assert [f[2:] for f in forwarded] == [(4096, FORWARD_CHUNK),
                                             (4096 + FORWARD_CHUNK, FORWARD_CHUNK),
                                             (4096 + 2 * FORWARD_CHUNK, 5)]
        assert locks == []

    trio.run(main)


def test_while_its_queues_are_not_live_a_worker_forwards_its_io():
    ctrl = ram_controller((1, 512, 64))
    locks, forwarded = [], []
    fs = _worker_fs(ctrl, locks, forwarded)

    async def main():
        fh = pack_fh(1, 1, True)
        ctrl.live = False  # lost with its path: waiting for a lease on its own fabric
        assert not fs.start_read(fh, 0, 512, lambda data: None)
        assert await fs.read(fh, 0, 512) == b"r" * 512
        assert await fs.write(fh, 512, b"w" * 512) == 512
        assert [f[0] for f in forwarded] == ["read", "write"] and locks == []
        ctrl.live = True
        forwarded.clear()
        assert bytes(await fs.read(fh, 0, 512)) == bytes(512)
        assert forwarded == [] and fs.forwarded == 2

    trio.run(main)


def test_a_worker_takes_the_sizes_of_a_rescan_and_forwards_a_namespace_gone():
    from nvmeof_fuse.host.attached import NamespaceShape
    from nvmeof_fuse.host.namespace.namespace import Namespace

    issuer = SimpleNamespace()  # no I/O here: sizes only
    ctrl = SimpleNamespace(live=True, namespaces={
        n: Namespace(issuer, n, NamespaceShape(n, 512, 64)) for n in (1, 2)})
    kept = ctrl.namespaces[1]
    locks, forwarded = [], []
    fs = _worker_fs(ctrl, locks, forwarded)
    fs.follow({1: (512, 128), 3: (4096, 8)})  # n1 grew, n2 is gone, n3 is new
    assert ctrl.namespaces == {1: kept} and (kept.nlb, kept.size) == (128, 128 * 512)
    assert fs.handles[pack_fh(1, 1, False)].node.ns is kept  # open handles see the new size
    assert sorted(fs.ns_inodes) == [1]

    async def main():
        for nsid in (2, 3):  # the main process's to serve (or refuse)
            assert await fs.read(pack_fh(1, nsid, False), 0, 512) == b"r" * 512
        assert [f[1] for f in forwarded] == [pack_fh(1, 2, False), pack_fh(1, 3, False)]

    trio.run(main)
    fs.follow({1: (512, 32)})  # and shrank
    assert kept.size == 32 * 512


def _pool_on(ctrl, count: int, **options):
    """FuseWorkers of ``count`` processes, their role registered with a companion server of
    ``ctrl``, and that server given to them as run() gives it (no process started)."""
    from nvmeof_fuse.companion.server.server import CompanionServer
    from nvmeof_fuse.workers.supervisor import FuseWorkers

    pool = FuseWorkers(count, **options)
    pool.companion = CompanionServer(ctrl, roles=[pool.role])
    return pool


def test_the_main_process_sends_every_worker_and_only_workers_the_new_sizes():
    ctrl = ram_controller((1, 512, 64), (2, 4096, 16))
    pool = _pool_on(ctrl, 2)
    server = pool.companion
    told: dict[str, list] = {}
    for peer, worker in (("worker", True), ("client", False)):
        session = server.new_session(peer)
        session.role = pool.role if worker else None

        async def notify(event, peer=peer):
            told.setdefault(peer, []).append(event)
            return True

        session.notify = notify
    trio.run(pool.follow, [])
    assert told == {"worker": [{"event": "namespaces", "generation": 1,
                                "namespaces": [[1, 512, 64], [2, 4096, 16]]}]}


def test_past_the_namespaces_one_message_holds_workers_are_sent_none_and_told_once(caplog):
    """More namespaces than fit the companion socket's 64 KiB: a worker's lease names none
    and a rescan sends none (the workers drop theirs and forward their I/O), and the main
    process says why once (it used to die on the send)."""
    from nvmeof_fuse.companion import protocol
    from nvmeof_fuse.workers.messages import MAX_FOLLOWED_NAMESPACES

    biggest = [[0xFFFFFFFE, 4096, (1 << 64) - 1]] * MAX_FOLLOWED_NAMESPACES
    assert len(protocol.encode({"id": 0, "ok": True, "event": "namespaces",
                                "namespaces": biggest})) < protocol.MAX_MESSAGE
    ctrl = ram_controller(*((nsid, 512, 8) for nsid in range(1, MAX_FOLLOWED_NAMESPACES + 2)))
    pool = _pool_on(ctrl, 2)
    session = pool.companion.new_session("worker", 42)
    session.role = pool.role
    told: list = []

    async def notify(event):
        told.append(event)
        return True

    session.notify = notify
    ready = {"kind": "ready", "index": 1, "pid": 42, "qids": [6]}
    with caplog.at_level(logging.WARNING, logger="nvmeof-fuse"):
        assert trio.run(pool.on_fuse, session, ready, b"") == {}  # its lease named none: once
        trio.run(pool.follow, [])
        trio.run(pool.follow, [])
    assert told == [{"event": "namespaces", "namespaces": [], "generation": g} for g in (1, 2)]
    assert caplog.messages == [f"FUSE workers: {MAX_FOLLOWED_NAMESPACES + 1} namespaces are more "
                               f"than the {MAX_FOLLOWED_NAMESPACES} whose sizes they are sent; "
                               "they forward their I/O to the main process"]


def test_a_worker_takes_sizes_heard_before_its_filesystem_once_it_has_one():
    """It says it took them either way (the main process waits for that); a malformed
    event it drops, unsaid; sizes without a valid generation (a main process of another
    version) it takes, unsaid."""
    from nvmeof_fuse.workers.worker import _Worker

    worker = _Worker.__new__(_Worker)  # its channel to the main process is not needed here
    worker.index, worker.fs, worker.shapes, worker.ctrl = 1, None, None, None
    said = []
    worker.channel = SimpleNamespace(call_future=lambda op, **fields: said.append((op, fields)))
    good = {"event": "namespaces", "namespaces": [[1, 512, 128]], "generation": 1}
    for bad in ("x", [[1, 0, 8]], [[1, 512]], [[1, 512, -1]], [["1", 512, 8]]):
        worker._on_event({**good, "namespaces": bad})
        assert worker.shapes is None, bad
    for bad in (None, 0, -1, "1", 1.0, True, 1 << 63):
        worker._on_event({**good, "generation": bad, "namespaces": [[1, 512, 64]]})
        assert worker.shapes == {1: (512, 64)}, bad
    worker._on_event({"event": "namespaces", "namespaces": [[1, 512, 96]]})
    assert worker.shapes == {1: (512, 96)}
    assert said == []
    worker._on_event(good)
    assert worker.shapes == {1: (512, 128)}
    followed = []
    worker.fs = SimpleNamespace(follow=followed.append)
    worker._on_event({**good, "namespaces": [[1, 512, 256]], "generation": 2})
    assert followed == [{1: (512, 256)}]
    assert said == [("fuse", {"kind": "namespaces", "index": 1, "pid": os.getpid(),
                              "generation": g}) for g in (1, 2)]


class _Proc:
    """A worker process to the main process: its pid, and its exit when told to die."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode, self.died = pid, None, trio.Event()

    async def wait(self) -> int:
        await self.died.wait()
        self.returncode = -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        self.died.set()


def _serving_pool(count: int, on_notify, timeout: float = 30.0):
    """FuseWorkers with ``count - 1`` serving workers (pid 100 + index), each with a
    companion session whose events go to ``on_notify(pool, index, event)`` (sent unless it
    returns False)."""
    pool = _pool_on(ram_controller((1, 512, 64)), count, timeout=timeout)
    for index in range(1, count):
        session = pool.companion.new_session(f"pid {100 + index} uid 0", 100 + index)
        session.role = pool.role

        async def notify(event, index=index):
            return await on_notify(pool, index, event) is not False

        session.notify = notify
    return pool


@contextlib.asynccontextmanager
async def _running(pool):
    """The pool's supervisors over fake processes, each serving; yields them by index
    (a replacement takes pid 200 + index)."""
    procs: dict = {}

    async def spawn(index):
        procs[index] = _Proc((200 if index in procs else 100) + index)
        return procs[index]

    pool._spawn = spawn
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run, None, None, pool.companion)
        await trio.testing.wait_all_tasks_blocked()
        for index, proc in procs.items():
            await pool.on_fuse(SimpleNamespace(pid=proc.pid),
                               {"kind": "ready", "index": index, "pid": proc.pid, "qids": []},
                               b"")
        yield procs
        nursery.cancel_scope.cancel()


async def _ack(pool, index, event):
    await pool.on_fuse(SimpleNamespace(pid=100 + index),
                       {"kind": "namespaces", "index": index, "pid": 100 + index,
                        "generation": event["generation"]}, b"")


def test_a_rescan_goes_on_once_every_serving_worker_took_the_new_sizes():
    """The files show a new size only after each worker took it (the mount's listener runs
    after this one): a worker takes an event in its own time."""
    order = []

    async def main():
        async def on_notify(pool, index, event):
            async def later():
                await trio.sleep(index / 2)  # a while; worker 2 last
                order.append(f"worker {index} took generation {event['generation']}")
                await _ack(pool, index, event)

            nursery.start_soon(later)

        pool = _serving_pool(3, on_notify)
        async with trio.open_nursery() as nursery, _running(pool):
            for generation in (1, 2):
                await pool.follow([])
                order.append(f"files show generation {generation}")

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert order == ["worker 1 took generation 1", "worker 2 took generation 1",
                     "files show generation 1", "worker 1 took generation 2",
                     "worker 2 took generation 2", "files show generation 2"]


@pytest.mark.parametrize(("timeout", "bound"), [(30.0, 10.0), (3.0, 3.0)])
def test_a_worker_that_never_says_it_took_the_sizes_holds_a_rescan_only_so_long(
        caplog, timeout, bound):
    """As long as the mount's command timeout, at most :data:`SIZES_TIMEOUT`."""
    from nvmeof_fuse.workers.supervisor import SIZES_TIMEOUT

    assert bound == min(timeout, SIZES_TIMEOUT)

    async def on_notify(pool, index, event):
        if index == 1:
            await _ack(pool, index, event)

    async def main():
        pool = _serving_pool(3, on_notify, timeout)
        async with _running(pool):
            began = trio.current_time()
            with caplog.at_level(logging.WARNING, logger="nvmeof-fuse"):
                await pool.follow([])
            return trio.current_time() - began

    waited = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert waited == bound
    assert caplog.messages == [
        f"FUSE worker 2 (pid 102) did not say it took the namespaces' new sizes within "
        f"{bound:g} s; it may serve by the old ones until it takes them"]


def test_a_worker_that_dies_or_does_not_serve_yet_holds_no_rescan(caplog):
    """Its replacement (or the worker itself, once it serves) takes the sizes with its
    lease, or keeps them until its filesystem is up."""
    from nvmeof_fuse.workers.supervisor import SIZES_TIMEOUT

    procs: dict = {}

    async def on_notify(pool, index, event):
        if index == 2:
            procs[2].kill()  # killed before it took them
        elif index == 1:
            await _ack(pool, index, event)

    async def main():
        pool = _serving_pool(4, on_notify)
        async with _running(pool) as running:
            procs.update(running)
            del pool.ready[3]  # connecting its queues still: it says nothing
            with caplog.at_level(logging.WARNING, logger="nvmeof-fuse"):
                await pool.follow([])
            return trio.current_time()

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) < SIZES_TIMEOUT
    assert [m for m in caplog.messages if "did not say" in m] == []


def test_a_rescan_waits_for_no_worker_it_did_not_send_the_sizes(caplog):
    """One that leased after the sending passed it (its lease had the new sizes), or whose
    send failed, would never answer: the rescan goes on without it, unwarned."""
    sessions = {}

    async def on_notify(pool, index, event):
        if index == 1:
            await _ack(pool, index, event)
        return index != 3  # worker 3's send failed

    async def main():
        pool = _serving_pool(4, on_notify)
        for session in pool.companion.sessions:
            sessions[session.pid] = session
        sessions[102].role = None  # leases once the sending passed it
        async with _running(pool):
            with caplog.at_level(logging.WARNING, logger="nvmeof-fuse"):
                await pool.follow([])
            return trio.current_time()

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == 0
    assert [m for m in caplog.messages if "did not say" in m] == []


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
    per = [w["namespaces"]["n1"]["ops"] for w in stats["workers"]]
    assert all(p.get("write", {}).get("ops", 0) > 0 for p in per), per  # both served
    total = sum(p["write"]["ops"] for p in per)
    assert stats["n1"]["ops"]["write"]["ops"] >= total - 100  # (a report a second behind)
    assert stats["workers"][1]["qids"]
    pids = m.worker_pids()
    assert m.unmount() == 0
    assert not any(_alive(p) for p in pids)  # drained and gone with the mount
    assert "flushed n1" in m.text()


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
    _hammer(m.path / "n1", 9, 1.0, errors)
    assert errors == []
    assert m.unmount() == 0


@needs_fuse
def test_writes_racing_across_workers_and_a_companion_client_never_tear(mounted):
    """Writers own byte stripes that share LBAs: a read-modify-write that another process's
    write slipped into would lose bytes.  Model: every byte is its owner's."""
    import numpy as np

    from nvmeof_fuse import File, empty

    m = mounted(2)
    stripe, stripes, writers = 700, 600, 3
    span = stripe * stripes

    def expected(i: int) -> bytes:
        return bytes([(i * 7 + 1) % 251 + 1]) * stripe

    def fuse_writer(w: int) -> None:
        fd = os.open(m.path / "n1", os.O_WRONLY)
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
    threads = [threading.Thread(target=fuse_writer, args=(0,)),
               threading.Thread(target=fuse_writer, args=(1,)),
               threading.Thread(target=companion_writer, args=(2,))]
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

    def worker_wrote() -> bool:  # (its reports come each second)
        return m.stats()["workers"][1]["namespaces"]["n1"]["ops"].get("write", {}).get(
            "ops", 0) > 0

    wait_for(worker_wrote, "the worker's report of its writes", timeout=10)
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
