"""FUSE workers against the real target: writes racing across processes, a worker killed.

A mount with ``--workers 2`` (the main process and one worker process, each on queues of its
own) over RDMA, then NVMe/TCP.  Writers in both (O_DIRECT, 1,500 writes in all), and a
companion client beside them, write byte stripes that share LBAs: every one of them must
hold the same range lock, or a read-modify-write torn by another process loses bytes; the
model is that each byte is its owner's.  Then a worker killed with SIGKILL under load: the
requests it held fail (the kernel ends them), nothing hangs, another takes its place on the
same queue IDs.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import signal
import threading
import time

import numpy as np
import pytest
from kernel_initiator import connected, pread_direct
from test_fs import TIMEOUT, mount_args, sh, wait_for_workers

MNT = "/tmp/nvmeof-test-workers"
STRIPE, STRIPES, BASE = 700, 1500, 60 << 20  # 700 B stripes from 60 MiB into n1 (512 B LBAs)


@pytest.fixture(scope="module")
def workers_mnt(fabric, testbed):
    os.makedirs(MNT, exist_ok=True)
    log = os.path.join(testbed.out, f"test_workers-{fabric.transport}.log")
    sh(*mount_args(fabric, "--daemon", "--log-file", log, "--workers", "2", MNT))
    try:
        wait_for_workers(log, 2)
        deadline = time.monotonic() + TIMEOUT  # and its first report (one a second)
        while len(stats(MNT).get("workers", [])) < 2:
            assert time.monotonic() < deadline, "no report from the worker"
            time.sleep(0.5)
        yield MNT, log
    finally:
        sh("fusermount3", "-u", MNT, check=False)


def stats(point: str) -> dict:
    with open(f"{point}/.nvmeof/stats.json") as f:
        return json.load(f)


def expected(i: int) -> bytes:
    return bytes([(i * 7 + 1) % 251 + 1]) * STRIPE


def test_writes_racing_across_workers_and_a_companion_client_never_tear(fabric, workers_mnt):
    from nvmeof_fuse.companion.client.file import File

    point, _ = workers_mnt
    path = f"{point}/n1"
    writers = 3
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, bytes(STRIPE * STRIPES), BASE)
    os.close(fd)
    errors: list = []

    def mine(w: int) -> list[int]:
        order = [i for i in range(STRIPES) if i % writers == w]
        random.Random(w).shuffle(order)
        return order

    def fuse_writer(w: int) -> None:
        try:  # O_DIRECT: 700-byte writes as they are (buffered ones come as whole pages)
            fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            try:
                for i in mine(w):
                    os.pwrite(fd, expected(i), BASE + i * STRIPE)
            finally:
                os.close(fd)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def companion_writer(w: int) -> None:
        try:
            with File(path) as f:
                for i in mine(w):
                    f.write(np.frombuffer(expected(i), dtype=np.uint8),
                            file_offset=BASE + i * STRIPE)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=fuse_writer, args=(0,)),
               threading.Thread(target=fuse_writer, args=(1,)),
               threading.Thread(target=companion_writer, args=(2,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT)
    assert not any(t.is_alive() for t in threads) and errors == []
    with connected(fabric.transport, fabric.addr, fabric.port, fabric.nqn) as kernel:
        got = pread_direct(kernel[1], BASE, -(-STRIPE * STRIPES // 4096) * 4096)
    mismatches = [i for i in range(STRIPES)
                  if got[i * STRIPE:(i + 1) * STRIPE] != expected(i)]
    assert mismatches == [], f"{len(mismatches)} torn stripes, first {mismatches[:5]}"
    deadline = time.monotonic() + 30  # the worker reports each second

    def per() -> list[int]:
        return [sum(op["ops"] for op in w["namespaces"]["n1"]["ops"].values())
                for w in stats(point)["workers"]]
    while not all(per()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(per()), per()  # the main process and the worker both served


def _load(path: str, seed: int, stop: threading.Event, errors: list, done: list) -> None:
    """O_DIRECT 4 KiB writes then reads of our own LBAs (n2), checked, until ``stop``."""
    rng = random.Random(seed)
    buf = mmap.mmap(-1, 4096)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        while not stop.is_set():
            lba = rng.randrange(1000) * 8 + seed + (100 << 8)
            pattern = bytes([seed]) * 8 + lba.to_bytes(8, "little")
            buf[:] = pattern * 256
            try:
                os.pwrite(fd, buf, lba * 4096)
                buf[:] = bytes(4096)
                os.preadv(fd, [buf], lba * 4096)
                if buf[:16] != pattern:
                    errors.append(f"LBA {lba}: read back {bytes(buf[:16]).hex()}")
                done.append(1)
            except OSError as exc:
                errors.append(exc)
    finally:
        os.close(fd)


def test_a_worker_killed_under_load_is_replaced_on_its_queue_ids(workers_mnt):
    point, log = workers_mnt
    first = stats(point)["workers"][1]
    stop, errors, done = threading.Event(), [], []
    threads = [threading.Thread(target=_load, args=(f"{point}/n2", seed, stop, errors, done))
               for seed in range(1, 5)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + TIMEOUT
    while len(done) < 50 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(first["pid"], signal.SIGKILL)
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads)  # nothing hung
    # Only the requests the dead worker held failed, as the kernel ends them; no bad data.
    assert all(isinstance(e, OSError) and e.errno == errno.ECONNABORTED for e in errors), errors
    wait_for_workers(log, 3)  # the replacement serves (the log's second such line)
    with open(log) as f:
        assert "killed by signal 9" in f.read()
    deadline = time.monotonic() + TIMEOUT
    # (no "workers" at all until the replacement's first report)
    while [w["pid"] for w in stats(point).get("workers", [])[1:]] in ([], [first["pid"]]):
        assert time.monotonic() < deadline, "no report from the replacement"
        time.sleep(0.5)
    assert stats(point)["workers"][1]["qids"] == first["qids"]
    errors.clear()
    stop.clear()
    threading.Timer(3.0, stop.set).start()
    _load(f"{point}/n2", 7, stop, errors, done)
    assert errors == []
