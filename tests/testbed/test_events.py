"""Namespaces added, removed and resized on the target while mounted: the mount follows.

nvmet raises a Namespace Attribute Changed event when a namespace is enabled, disabled
or its size revalidated; the daemon keeps an Asynchronous Event Request outstanding,
reads the Changed Namespace List and rescans, and the FUSE tree follows.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import subprocess
import threading
import time

import pytest
from kernel_initiator import connected, pwrite_direct
from vm import sh, wait_for

MNT = "/tmp/nvmeof-events"
FILES = "/tmp/nvmeof-events-files"  # a tmpfs for file-backed namespaces
NVMET = "/sys/kernel/config/nvmet"
MIB = 1 << 20


def write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@contextlib.contextmanager
def file_namespace(nqn: str, nsid: int, size: int):
    """Namespace ``nsid`` backed by a file of ``size`` bytes (not yet enabled)."""
    os.makedirs(FILES, exist_ok=True)
    if not os.path.ismount(FILES):
        sh("mount", "-t", "tmpfs", "-o", "size=512m", "none", FILES)
    backing = f"{FILES}/ns{nsid}.img"
    with open(backing, "wb") as f:
        f.truncate(size)
    ns = f"{NVMET}/subsystems/{nqn}/namespaces/{nsid}"
    os.mkdir(ns)
    try:
        write(f"{ns}/device_path", backing)
        write(f"{ns}/buffered_io", "1")
        yield ns, backing
    finally:
        with contextlib.suppress(OSError):
            write(f"{ns}/enable", "0")
        os.rmdir(ns)
        os.unlink(backing)


@contextlib.contextmanager
def mounted(testbed, log: str, *extra: str):
    os.makedirs(MNT, exist_ok=True)
    started = subprocess.run(
        ["nvmeof-fuse", "mount", "-t", "rdma", "-a", testbed.rdma_addr, "-s", str(testbed.port),
         "-n", testbed.nqn, "--daemon", "--log-file", log, "-k", "2", *extra, MNT],
        capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, started.stderr + open(log).read()
    try:
        yield MNT
    finally:
        subprocess.run(["fusermount3", "-u", MNT], capture_output=True, timeout=120)
        wait_for(lambda: not os.path.ismount(MNT), 60)


def log_has(log: str, text: str) -> bool:
    with open(log) as f:
        return text in f.read()


def size_of(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def test_a_namespace_added_then_removed_on_the_target_appears_then_fails_by_name(testbed,
                                                                                   tmp_path):
    log = str(tmp_path / "daemon.log")
    data = os.urandom(64 * 1024)
    with mounted(testbed, log) as mnt, file_namespace(testbed.nqn, 3, 64 * MIB) as (ns, _):
        write(f"{ns}/enable", "1")
        assert wait_for(lambda: size_of(f"{mnt}/n3") == 64 * MIB, 60), \
            (os.listdir(mnt), open(log).read())
        assert os.path.exists(f"{mnt}/.nvmeof/n3.json")
        assert log_has(log, f"namespace n3 added ({64 * MIB} bytes)"), open(log).read()
        with connected("rdma", testbed.rdma_addr, testbed.port, testbed.nqn,
                       namespaces=3) as kernel:
            pwrite_direct(kernel[3], 4096, data)
        fd = os.open(f"{mnt}/n3", os.O_RDONLY)
        try:
            assert os.pread(fd, len(data), 4096) == data
            write(f"{ns}/enable", "0")
            assert wait_for(lambda: "n3" not in os.listdir(mnt), 60), open(log).read()
            assert not os.path.exists(f"{mnt}/.nvmeof/n3")
            with pytest.raises(OSError) as info:
                os.pread(fd, 4096, 1 << 20)  # not cached: goes to the daemon
            assert info.value.errno in (errno.ENODEV, errno.EIO), info.value
        finally:
            os.close(fd)
        text = open(log).read()
        assert "namespace n3 removed" in text and "Traceback" not in text, text
        assert sorted(n for n in os.listdir(mnt) if not n.startswith(".")) == ["n1", "n2"]


def test_a_namespace_grown_on_the_target_shows_its_new_size(testbed, tmp_path):
    log = str(tmp_path / "daemon.log")
    with mounted(testbed, log) as mnt, file_namespace(testbed.nqn, 4, 32 * MIB) as (ns, backing):
        write(f"{ns}/enable", "1")
        assert wait_for(lambda: size_of(f"{mnt}/n4") == 32 * MIB, 60), open(log).read()
        with open(backing, "r+b") as f:
            f.truncate(48 * MIB)
        write(f"{ns}/revalidate_size", "1")
        assert wait_for(lambda: size_of(f"{mnt}/n4") == 48 * MIB, 60), open(log).read()
        assert log_has(log, f"namespace n4 resized from {32 * MIB} to {48 * MIB} bytes")
        with open(f"{mnt}/n4", "rb") as f:
            f.seek(40 * MIB)
            assert f.read(4096) == bytes(4096)  # the new space reads back


def test_a_namespace_grown_while_fuse_workers_serve_is_read_whole_by_each(testbed, tmp_path):
    """The main process shows a new size only once its workers took it: a worker's read
    past the old end, issued the moment stat shows the new size, returns the new space's
    data, not a short read at the old end.  n5 is there before the mount, so that the
    worker serves it (one added later it forwards to the main process)."""
    from test_fs import wait_for_workers

    log = str(tmp_path / "daemon.log")
    data = os.urandom(MIB)
    with file_namespace(testbed.nqn, 5, 32 * MIB) as (ns, backing):
        write(f"{ns}/enable", "1")
        with mounted(testbed, log, "--workers", "2") as mnt:
            wait_for_workers(log, 2)
            assert size_of(f"{mnt}/n5") == 32 * MIB, open(log).read()
            grow_and_read_through_the_worker(mnt, log, ns, backing, data)
            # the rescan went on because each worker said it took the sizes, not on a timeout
            assert not log_has(log, "did not say it took"), open(log).read()


def grow_and_read_through_the_worker(mnt: str, log: str, ns: str, backing: str,
                                     data: bytes) -> None:
    """Grow n5 from 32 to 48 MiB with ``data`` at 40 MiB; read it back from several threads,
    the first time as soon as stat shows the new size, then until the worker served some of
    the reads (the kernel picks who serves which)."""
    def worker_reads() -> int:
        with open(f"{mnt}/.nvmeof/stats.json") as f:
            workers = json.load(f).get("workers", [])
        return sum(w.get("namespaces", {}).get("n5", {}).get("ops", {}).get("read", {})
                   .get("ops", 0) for w in workers if w.get("index"))

    bad: list = []
    shown = threading.Event()  # stat shows the new size

    def reader(t: int) -> None:
        fd = os.open(f"{mnt}/n5", os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, 64 * 1024)
        try:
            shown.wait(600)
            for i in range(16):
                at = ((t * 16 + i) % 16) * 64 * 1024
                got = os.preadv(fd, [buf], 40 * MIB + at)
                if got != len(buf) or buf[:] != data[at:at + len(buf)]:
                    bad.append((t, i, got))
        finally:
            os.close(fd)

    def read_in_threads(grow=lambda: None) -> None:
        threads = [threading.Thread(target=reader, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        grow()
        shown.set()
        for thread in threads:
            thread.join(600)
        assert not bad, bad

    def grow() -> None:  # the readers wait, their files open
        with open(backing, "r+b") as f:
            f.truncate(48 * MIB)
            f.seek(40 * MIB)
            f.write(data)
        write(f"{ns}/revalidate_size", "1")
        deadline = time.monotonic() + 60
        while size_of(f"{mnt}/n5") != 48 * MIB:  # no wait between the size and the reads
            assert time.monotonic() < deadline, open(log).read()
            time.sleep(0.002)

    read_in_threads(grow)
    for _ in range(20):  # until the worker served some of them (the kernel picks)
        if wait_for(lambda: worker_reads() > 0, 3):
            break
        read_in_threads()
    assert worker_reads() > 0, open(log).read()
    assert "Traceback" not in open(log).read()
