"""The companion API against the real target: another process reads and writes directly.

One mount (RDMA, ``-o allow_other`` so that another uid can even try) serves the
whole module; the cross-process data tests also run on a mount over NVMe/TCP, where
clients connect NVMe/TCP queues of their own with the mount's controller ID, as over
RDMA (CUDA memory staged by the client itself).  The second process is a real one
(``companion_child.py``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from fabrics import make_fabric
from kernel_initiator import connected, pread_direct
from vm import NVMET_PORTS, rdma_objects, sh, target_away, wait_for

from nvmeof_fuse.companion.client.channel import SocketChannel
from nvmeof_fuse.companion.client.own_queues import POLLED_MAX_BYTES
from nvmeof_fuse.companion.protocol import CompanionError
from nvmeof_fuse.procstat import process_tree

MNT = "/tmp/nvmeof-companion"
TCP_MNT = "/tmp/nvmeof-companion-tcp"
CHILD = os.path.join(os.path.dirname(__file__), "companion_child.py")
SIZE = 64 << 20  # per process and namespace over RDMA (issue #10's acceptance)
TCP_SIZE = 16 << 20  # over TCP the same paths at a quarter of the size: TCG moves TCP slowly
OFFSET = (8 << 20) + 12_345  # unaligned for both LBA sizes
TIMEOUT = 600


def daemon_stats(mnt: str = MNT) -> dict:
    with open(f"{mnt}/.nvmeof/stats.json") as f:
        return json.load(f)["companion"]


def connection() -> dict:
    with open(f"{MNT}/.nvmeof/stats.json") as f:
        return json.load(f)["connection"]


@pytest.fixture(scope="module")
def cmnt(testbed):
    os.makedirs(MNT, exist_ok=True)
    sh("nvmeof-fuse", "mount", "-t", "rdma", "-a", testbed.rdma_addr, "-s", str(testbed.port),
       "-n", testbed.nqn, "-o", "allow_other", "--mode", "0666", "--daemon",
       "--log-file", os.path.join(testbed.out, "companion-daemon.log"), MNT)
    yield MNT
    subprocess.run(["fusermount3", "-u", MNT], capture_output=True, timeout=120)


@pytest.fixture(scope="module", params=["rdma", "tcp"])
def fmnt(request, testbed):
    """``(fabric, mountpoint)``: the RDMA mount above, then one over NVMe/TCP."""
    fabric = make_fabric(testbed, request.param)
    if fabric.transport == "rdma":
        yield fabric, request.getfixturevalue("cmnt")
        return
    os.makedirs(TCP_MNT, exist_ok=True)
    sh("nvmeof-fuse", "mount", "-t", "tcp", "-a", fabric.addr, "-s", str(fabric.port),
       "-n", fabric.nqn, "--daemon",
       "--log-file", os.path.join(testbed.out, "companion-daemon-tcp.log"), TCP_MNT)
    yield fabric, TCP_MNT
    subprocess.run(["fusermount3", "-u", TCP_MNT], capture_output=True, timeout=120)


def _check_against_file_and_kernel(fabric, cmnt: str,
                                   written: dict[tuple[int, int], list]) -> None:
    """What each client wrote at ``(nsid, offset)``, as the FUSE file and the kernel
    initiator show it: the client's ``(start, length, sha256)`` windows of it."""
    for (nsid, offset), windows in written.items():
        with open(f"{cmnt}/n{nsid}", "rb") as f:
            for start, length, sha256 in windows:
                f.seek(offset + start)
                assert hashlib.sha256(f.read(length)).hexdigest() == sha256, \
                    ("file", nsid, offset, start)
    with connected(fabric.transport, fabric.addr, fabric.port, fabric.nqn) as kernel:
        for (nsid, offset), windows in written.items():
            for start, length, sha256 in windows:
                at = offset + start
                aligned = at // 4096 * 4096
                span = (at + length - aligned + 4095) // 4096 * 4096  # whole 4 KiB blocks
                raw = pread_direct(kernel[nsid], aligned, span)
                assert hashlib.sha256(raw[at - aligned:at - aligned + length]).hexdigest() \
                    == sha256, ("kernel", nsid, offset, start)


def test_two_processes_move_64mib_on_their_own_queues_while_fio_runs(fmnt):
    """Acceptance 1: both namespaces, empty arrays and plain numpy arrays, fio beside.

    fio runs at a bounded rate: it is there to share the mount and its controller with
    the clients, not to starve them of the VM's two CPUs.

    Over RDMA and over NVMe/TCP the clients use queues of their own: nothing moves
    through the daemon.
    """
    fabric, cmnt = fmnt
    size = SIZE if fabric.transport == "rdma" else TCP_SIZE
    before = daemon_stats(cmnt)
    fio = subprocess.Popen(
        ["fio", "--name=bg", f"--filename={cmnt}/n2", "--rw=randread", "--bs=4k",
         "--iodepth=4", "--rate_iops=100", "--ioengine=libaio", "--direct=1", "--size=64M",
         "--time_based",
         "--runtime=900"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    offsets = {"empty": OFFSET, "numpy": OFFSET + size + 4097}  # apart, unaligned
    try:
        children = {kind: subprocess.Popen(
            [sys.executable, CHILD, "both", cmnt, str(offset), str(size), kind],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for kind, offset in offsets.items()}
        outputs = {kind: child.communicate(timeout=TIMEOUT) for kind, child in children.items()}
    finally:
        fio.send_signal(signal.SIGINT)
        fio_out = fio.communicate(timeout=120)[0]
    # fio ends on our SIGINT (status 0 or 128); what matters is that it ran without errors
    assert re.search(r"err= 0:", fio_out) and re.search(r"read: IOPS=\d", fio_out), fio_out
    written = {}  # (nsid, offset) -> windows of what a client wrote there
    for kind, (out, err) in outputs.items():
        assert children[kind].returncode == 0, err
        results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(results) == 2, out
        for nsid, result in zip((1, 2), results, strict=True):
            assert result["equal"], (kind, nsid)
            assert result["own_queues"], f"{kind} client used no queues of its own: {err}"
            written[nsid, offsets[kind]] = result["windows"]
    _check_against_file_and_kernel(fabric, cmnt, written)
    after = daemon_stats(cmnt)
    delta = {name: after[name] - before[name] for name in after if name.endswith("_bytes")}
    moved = 2 * 2 * size  # two processes, two namespaces, each way
    assert delta["client_queue_read_bytes"] >= moved
    assert delta["client_queue_write_bytes"] >= moved
    for counter in ("direct_read_bytes", "direct_write_bytes", "staged_read_bytes",
                    "staged_write_bytes", "daemon_copied_bytes"):  # nothing via the daemon
        assert delta[counter] == 0, counter


def test_a_companion_write_reaches_a_reader_holding_cached_pages(cmnt):
    """A buffered (not O_DIRECT) reader of the FUSE file does not keep stale pages."""
    import nvmeof_fuse

    offset, size = (3 << 20) + 100, 10_000
    with open(f"{cmnt}/n2", "rb", buffering=0) as cached:
        old = os.pread(cached.fileno(), size, offset)  # now in the kernel's page cache
        new = nvmeof_fuse.empty(size)
        new[:] = [(b + 1) % 256 for b in old]  # differs from the old data in every byte
        with nvmeof_fuse.File(f"{cmnt}/n2") as f:
            assert f.write(new, file_offset=offset) == size
        assert os.pread(cached.fileno(), size, offset) == new.tobytes()


def _resident_pages(fd: int, offset: int, length: int) -> list[bool]:
    """Which pages of these bytes of the file are in the kernel's page cache (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    start = offset // page * page
    span = offset + length - start
    addr = libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        vec = ctypes.create_string_buffer((span + page - 1) // page)
        assert libc.mincore(addr, span, vec) == 0, os.strerror(ctypes.get_errno())
        return [bool(b & 1) for b in vec.raw]
    finally:
        libc.munmap(addr, span)


def test_a_companion_write_drops_only_the_cached_pages_of_its_range(cmnt):
    """A buffered reader keeps its cached pages of what the write did not touch."""
    import nvmeof_fuse

    written, kept, size = (5 << 20) + 100, 12 << 20, 64 << 10
    with open(f"{cmnt}/n2", "rb", buffering=0) as cached:
        fd = cached.fileno()
        old = os.pread(fd, size, written)
        os.pread(fd, size, kept)
        assert all(_resident_pages(fd, written, size))
        assert all(_resident_pages(fd, kept, size))
        new = nvmeof_fuse.empty(size)
        new[:] = [(b + 1) % 256 for b in old]
        with nvmeof_fuse.File(f"{cmnt}/n2") as f:  # the file is open: a range lock
            assert f.write(new, file_offset=written) == size
        assert not any(_resident_pages(fd, written, size))  # the pages it wrote, dropped
        assert all(_resident_pages(fd, kept, size))  # the rest still cached
        assert os.pread(fd, size, written) == new.tobytes()


def test_a_delegated_writer_hands_the_namespace_back_to_a_file_that_opens(cmnt, testbed):
    """With no file of n1 open, a client's writes go under a delegation (no round trip to
    the daemon each); an open of the file recalls it, and the reader sees every write,
    those made before its open and, under range locks, those made while it is open."""
    import nvmeof_fuse

    base, size, count = (20 << 20) + 7, 100_000, 12
    before = daemon_stats()
    buf = nvmeof_fuse.empty(size)
    with nvmeof_fuse.File(f"{cmnt}/n1") as f:
        for i in range(count):
            buf[:] = i + 1
            assert f.write(buf, file_offset=base + i * size) == size
        during = daemon_stats()
        assert during["delegations_granted"] == before["delegations_granted"] + 1
        with open(f"{cmnt}/n1", "rb", buffering=0) as reader:  # the open recalls it
            assert daemon_stats()["delegations_recalled"] == before["delegations_recalled"] + 1
            for i in range(count):
                assert os.pread(reader.fileno(), size, base + i * size) == bytes([i + 1]) * size
            buf[:] = 0xAB  # a write while the file is open: cached pages are dropped
            assert f.write(buf, file_offset=base) == size
            assert os.pread(reader.fileno(), size, base) == b"\xab" * size
        assert daemon_stats()["delegations_granted"] == during["delegations_granted"]
    fabric = make_fabric(testbed, "rdma")
    expected = {(1, base): [(0, size, hashlib.sha256(b"\xab" * size).hexdigest()),
                            (size, size, hashlib.sha256(bytes([2]) * size).hexdigest())]}
    _check_against_file_and_kernel(fabric, cmnt, expected)


@pytest.mark.parametrize("queues, export", [
    (4, "memfd"), (0, "udmabuf"), pytest.param(0, "memfd", marks=pytest.mark.slow)],
    ids=["own-queues", "real-dmabuf", "daemon-queues"])
def test_a_cuda_allocation_is_registered_once_and_released_on_close(fmnt, queues, export,
                                                                     testbed):
    """Issue #40's acceptance 3, with a fake CUDA driver whose "device memory" is shared
    host memory.

    Over RDMA, a thousand reads into views of one allocation export and register it
    once (its memfd, which Soft-RoCE registers through its mapping) in the client's own
    protection domains or the daemon's, the target places the data, and closing the file
    releases the memory regions.  Exported as a real dma-buf (udmabuf), which Soft-RoCE cannot
    take, it is asked for once, counted as refused (not an error), and staged.  Over TCP
    GPU memory is staged, nothing exported: by the client on its own queues, or by the
    daemon's queues without them.
    """
    fabric, cmnt = fmnt
    if fabric.transport == "tcp" and export != "memfd":
        pytest.skip("over TCP no dma-buf is asked for, whatever the memory")
    transfers = 1000 if queues else 200  # TCG: the daemon's path costs more per transfer
    child = subprocess.run([sys.executable, CHILD, "cuda", f"{cmnt}/n2",
                            str(OFFSET - OFFSET % 4096), str(transfers), str(queues), export],
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout.splitlines()[-1])
    name = f"cuda-{fabric.transport}-{queues}-{export}.json"
    with open(os.path.join(testbed.out, name), "w") as f:
        json.dump(result, f, indent=1)  # the whole of it, for a failure's reader
    assert result["same"] and result["errors"] == 0, result
    counts, file_stats, cuda = result["mrs"], result["file"], result["placement"]["cuda"]
    if fabric.transport == "tcp":
        assert result["exports"] == 0 and file_stats["dmabuf_registered"] == 0, result
        assert result["refused"] == 0, result
        if queues:  # staged by the client itself: the reads' bytes over its own queues
            assert result["own"], "the client got no queues of its own"
            assert cuda.startswith("staged: by this process over its own queues"), result
            assert result["direct"] >= transfers * (16 << 10), result
        else:
            assert cuda.startswith("staged: NVMe/TCP receives data"), result
        return
    if export == "udmabuf":  # a dma-buf Soft-RoCE refuses: asked once, then staged
        assert result["exports"] == 1, result  # the write's source, refused: never again
        assert file_stats["dmabuf_registered"] == 0 and result["refused"] == 1, result
        assert cuda.startswith("staged: cannot register"), result
        assert counts["closed"][1] <= counts["start"][1], counts
        return
    assert result["refused"] == 0, result
    # Two allocations (the write's source, and the one read into), each exported and
    # registered once: every read after the first reuses the registration.
    assert result["exports"] == 2 and file_stats["dmabuf_registered"] == 2, result
    assert file_stats["dmabuf_hits"] == transfers - 1, result
    assert result["direct"] >= transfers * (16 << 10), result  # placed, not staged
    owner = 0 if queues else 1  # whose protection domains hold the registration
    if queues:
        assert result["own"], "the client got no queues of its own"
        assert cuda.endswith("this process's own queues"), result
    else:
        assert cuda.endswith("with the mount daemon"), result
    grown = counts["after"][owner] - counts["start"][owner]
    assert 2 <= grown <= 16, counts  # an MR per allocation and PD, not per transfer
    assert counts["closed"][1] <= counts["start"][1], counts  # released on close
    assert counts["closed"][0] == 0, counts  # the client holds none once closed


def _as_nobody(fn) -> str:
    """Run ``fn()`` in a forked child as uid/gid 65534; its returned text comes back."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            text = fn()
        except BaseException as exc:
            text = f"{type(exc).__name__}: {exc}"
        os.write(w, text.encode())
        os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            return f.read().decode()
    finally:
        os.waitpid(pid, 0)


def test_another_uid_is_refused(cmnt):
    with open(f"{cmnt}/.nvmeof/companion.json") as f:
        socket_name = json.load(f)["socket"]
    refused_before = daemon_stats()["refused"]

    def try_file() -> str:
        import nvmeof_fuse

        try:
            nvmeof_fuse.File(f"{cmnt}/n1")
        except CompanionError as exc:
            return str(exc)
        return "not refused"

    def try_socket() -> str:
        try:
            SocketChannel("\0" + socket_name[1:], 30).hello()
        except CompanionError as exc:
            return str(exc)
        return "not refused"

    assert re.fullmatch(r"uid 65534 may not use this mount: it belongs to uid 0 \(only that "
                        r"user and root may\)", _as_nobody(try_file))
    assert "uid 65534 may not use this mount" in _as_nobody(try_socket)
    assert daemon_stats()["refused"] == refused_before + 2


def test_a_client_write_and_a_fuse_read_modify_write_never_mix(cmnt):
    """A client overwrites whole LBAs while FUSE writes 100 bytes inside each of them
    (O_DIRECT, so the daemon read-modify-writes): each LBA ends as one serial order."""
    path, lba, lbas, rounds = f"{cmnt}/n2", 4096, 4, 40
    base, inside = 30 << 20, slice(1000, 1100)
    child = subprocess.Popen([sys.executable, CHILD, "overwrite", path, str(base),
                              str(lbas * lba), str(rounds)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing", child.stderr.read()
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        fuse_writes = 0
        while child.poll() is None:
            for k in range(lbas):
                os.pwrite(fd, b"\xee" * 100, base + k * lba + inside.start)
                fuse_writes += 1
        out, err = child.communicate(timeout=TIMEOUT)
        assert child.returncode == 0, err
        last = int(out.split()[-1])
        final = os.pread(fd, lbas * lba, base)
    finally:
        os.close(fd)
    assert fuse_writes > lbas  # they did overlap in time
    for k in range(lbas):
        block = final[k * lba:(k + 1) * lba]
        outside = block[:inside.start] + block[inside.stop:]
        assert outside == bytes([last]) * len(outside), f"LBA {k}: a mix of two writes"
        assert block[inside] in (bytes([last]) * 100, b"\xee" * 100), f"LBA {k}"


class Churn:
    """A client process writing, reading back and comparing in a loop (companion_child churn).

    Its lines are read by a thread of their own into a queue, each wait bounded: reading
    them with ``readline`` and the rest with ``communicate`` lost what the text wrapper had
    buffered (a JSON error on half a line, once in a full run)."""

    def __init__(self, path: str, offset: int, size: int, tmp_path) -> None:
        self.stop = str(tmp_path / f"stop-{offset}")
        self.stderr = open(tmp_path / f"churn-{offset}.err", "w+")  # noqa: SIM115 (closed in finish)
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, "churn", path, str(offset), str(size), self.stop],
            stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self._out: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.lines: list[dict] = []
        self.own_queues = json.loads(self._next())["own_queues"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._out.put(line)
        self._out.put("")  # the end

    def _next(self) -> str:
        try:
            line = self._out.get(timeout=TIMEOUT)
        except queue.Empty:
            line = ""
        assert line, self._errors()
        return line

    def _errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def rounds(self, n: int) -> list[dict]:
        """Read until ``n`` more rounds are done; those rounds."""
        start = len(self.lines)
        while len(self.lines) < start + n:
            self.lines.append(json.loads(self._next()))
        return self.lines[start:]

    def finish(self) -> list[dict]:
        with open(self.stop, "w"):
            pass
        self.proc.wait(timeout=TIMEOUT)
        self._reader.join(timeout=TIMEOUT)
        assert self.proc.returncode == 0, self._errors()
        while (line := self._out.get(timeout=TIMEOUT)) != "":
            self.lines.append(json.loads(line))
        self.stderr.close()
        return self.lines


def test_a_killed_client_leaves_the_mount_and_the_other_client_working(cmnt, tmp_path):
    """Acceptance 3: SIGKILL in the middle of transfers; at most one reconnect."""
    mrs_before = rdma_objects("mr")
    reconnects_before = connection()["reconnects"]
    other = Churn(f"{cmnt}/n1", 40 << 20, (1 << 20) + 777, tmp_path)
    child = subprocess.Popen([sys.executable, CHILD, "loop", f"{cmnt}/n2", str(16 << 20)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "reading"
        assert wait_for(lambda: daemon_stats()["clients"] == 2)
        other.rounds(2)  # both clients busy: the kill lands in the middle of transfers
    finally:
        child.kill()
        child.wait(60)
    assert wait_for(lambda: daemon_stats()["clients"] == 1)
    after = other.rounds(3)  # the other client goes on, after a reconnect if the target dropped
    lines = other.finish()
    assert all(r.get("equal") for r in after), after
    errors = [r for r in lines if "error" in r]
    assert not errors, errors
    assert other.own_queues
    with open(f"{cmnt}/n2", "rb") as f:  # the mount still serves
        assert len(f.read(4096)) == 4096
    assert connection()["reconnects"] <= reconnects_before + 1
    assert wait_for(lambda: daemon_stats()["clients"] == 0 and daemon_stats()["regions"] == 0)
    assert wait_for(lambda: rdma_objects("mr") <= mrs_before)


@pytest.mark.slow
def test_in_process_mount_places_reads_in_registered_memory(testbed, tmp_path):
    import numpy as np

    import nvmeof_fuse

    mnt = tmp_path / "inproc"
    mnt.mkdir()
    with nvmeof_fuse.mount(str(mnt), traddr=testbed.rdma_addr, trsvcid=testbed.port,
                           nqn=testbed.nqn) as m:
        arr = np.zeros(4 << 20, dtype=np.uint8)  # ordinary memory, registered as it is
        data = np.frombuffer(os.urandom(len(arr)), dtype=np.uint8)
        with m.register(arr), m.open(2) as f:
            arr[:] = data
            assert f.write(arr, file_offset=(3 << 20) + 100) == len(arr)
            arr[:] = 0
            assert f.read(arr, file_offset=(3 << 20) + 100) == len(arr)
        assert bytes(arr) == data.tobytes()
        with open(m.path(2), "rb") as fh:  # ls, cat and friends see it through FUSE
            fh.seek((3 << 20) + 100)
            assert fh.read(len(arr)) == data.tobytes()
        stats = m.stats()
        assert stats["direct_read_bytes"] >= len(arr) - 4096
        assert stats["staged_read_bytes"] <= 2 * 4096
    assert not os.path.ismount(mnt)


@pytest.mark.parametrize("transport, loss_tmo", [
    # by default over RDMA: test_reconnect's test_fio_and_companion_clients_ride_out_an_
    # outage[rdma] (a client on its own RDMA queues re-reading through the outage)
    pytest.param("rdma", "120", marks=pytest.mark.slow),
    pytest.param("rdma", "3", marks=pytest.mark.slow), ("tcp", "120")])
def test_a_client_on_its_own_queues_rides_out_a_target_outage(testbed, tmp_path, transport,
                                                              loss_tmo):
    """Acceptance 2: the port is gone ~8 s while a client writes and reads in a loop.

    With a long --ctrl-loss-tmo every request completes with the right data after the
    reconnect; with 3 s, requests in the outage fail with a clear EIO and the rest are right.
    Over NVMe/TCP too: the lease is revoked with the lost controller and granted again.
    """
    fabric = make_fabric(testbed, transport)
    mnt, log = str(tmp_path / "mnt"), str(tmp_path / "daemon.log")
    os.makedirs(mnt)
    ours: set[int] = set()  # this test's processes: the mount's daemon (and its), the clients

    def held(kind: str) -> int:
        """RDMA objects our processes hold (not the module's mounts': after the RDMA
        outage before, that one may still be reconnecting while this test runs)."""
        return rdma_objects(kind, pids=ours)

    sh("nvmeof-fuse", "mount", "-t", transport, "-a", fabric.addr, "-s", str(fabric.port),
       "-n", testbed.nqn, "-k", "2", "-c", "2", "-l", loss_tmo, "--daemon", "--log-file", log,
       mnt)
    try:
        churn = Churn(f"{mnt}/n2", (20 << 20) + 5, (1 << 20) + 9, tmp_path)
        # whole LBAs, read back small and large: the polled queues, from the client's thread
        aligned = Churn(f"{mnt}/n1", 4 << 20, 5 * POLLED_MAX_BYTES // 2, tmp_path)
        assert churn.own_queues and aligned.own_queues
        with open(f"{mnt}/.nvmeof/companion.json") as f:
            ours |= process_tree(json.load(f)["pid"])
        ours |= {churn.proc.pid, aligned.proc.pid}
        if transport == "rdma":  # the count sees our processes' queue pairs
            assert held("qp") > 0, sh("rdma", "resource", "show", "qp")
        churn.rounds(2)
        aligned.rounds(2)
        with target_away(testbed.nqn, NVMET_PORTS[transport]):
            assert wait_for(lambda: "lost the connection" in open(log).read(), 60)
            time.sleep(8)  # the outage itself
        if loss_tmo == "3":
            assert wait_for(lambda: "gave up after" in open(log).read(), 120)
        else:
            assert wait_for(lambda: "reconnected to" in open(log).read(), 120)
            after = churn.rounds(2) + aligned.rounds(2)
            assert all(r.get("equal") for r in after), after
        lines = churn.finish() + aligned.finish()
    finally:
        subprocess.run(["fusermount3", "-u", mnt], capture_output=True, timeout=120)
    errors = [r for r in lines if "error" in r]
    assert all(r.get("equal") for r in lines if "error" not in r), lines
    if loss_tmo == "3":
        assert errors and all(r["errno"] == errno.EIO for r in errors), errors
        assert any("--ctrl-loss-tmo 3" in r["error"] for r in errors), errors
    else:
        assert not errors, errors
    assert wait_for(lambda: held("qp") == 0 and held("mr") == 0), \
        (sorted(ours), sh("rdma", "resource", "show", "qp"), sh("rdma", "resource", "show", "mr"))


def test_a_batch_of_small_reads_lands_in_place_from_the_callers_thread(cmnt):
    """pread_batch posts its whole-LBA reads together on the client's polled queue; each
    lands where it belongs, and the bytes count as moved over the client's own queues."""
    import nvmeof_fuse

    count, size = 24, 8192
    offsets = [(i * 7919 % 2048) * 4096 for i in range(count)]
    with open(f"{cmnt}/n2", "rb", buffering=0) as plain:
        expected = [os.pread(plain.fileno(), size, off) for off in offsets]
    bufs = nvmeof_fuse.empty((count, size))
    bufs[:] = 0xEE
    with nvmeof_fuse.File(f"{cmnt}/n2") as f:
        assert f.own_queues
        before = f.stats()["client_queue_read_bytes"]
        futures = f.pread_batch([(bufs[i], size, off) for i, off in enumerate(offsets)])
        assert [fut.get() for fut in futures] == [size] * count
        moved = f.stats()["client_queue_read_bytes"] - before
    assert [bufs[i].tobytes() for i in range(count)] == expected
    assert moved >= count * size


def test_reads_kept_16_deep_from_one_thread_each_land_in_place(cmnt):
    """One thread keeps 16 small reads in flight on its polled queue, collecting the oldest
    and submitting the next (the bench's pattern): every one of them lands in place."""
    import nvmeof_fuse

    depth, count, size = 16, 400, 4096
    offsets = [(i * 7919 % 4096) * 4096 for i in range(count)]
    with open(f"{cmnt}/n2", "rb", buffering=0) as plain:
        expected = [os.pread(plain.fileno(), size, off) for off in offsets]
    bufs = nvmeof_fuse.empty((depth, size))
    bufs[:] = 0xEE
    with nvmeof_fuse.File(f"{cmnt}/n2") as f:
        assert f.own_queues
        pending = [(i, f.pread(bufs[i % depth], size, offsets[i])) for i in range(depth)]
        landed = []
        while pending:
            i, future = pending.pop(0)
            assert future.get(60) == size
            landed.append(bufs[i % depth].tobytes() == expected[i])
            if i + depth < count:
                pending.append((i + depth, f.pread(bufs[i % depth], size, offsets[i + depth])))
    assert all(landed), [i for i, ok in enumerate(landed) if not ok]
