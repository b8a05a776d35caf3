"""A second process using nvmeof_fuse.File (run by test_companion.py inside the VM).

    python companion_child.py roundtrip PATH OFFSET SIZE [KIND]  write random data, read it back
    python companion_child.py both MOUNT OFFSET SIZE KIND  roundtrip on n1, then on n2
    python companion_child.py churn PATH OFFSET SIZE STOP  write, read, compare until STOP exists
    python companion_child.py overwrite PATH OFFSET SIZE N  write bytes of value 1..N, print N
    python companion_child.py loop PATH SIZE               read forever (to be killed)
    python companion_child.py cuda PATH OFFSET N QUEUES EXPORT  N reads into a fake CUDA
                                    allocation exported as its memfd or a real dma-buf (udmabuf)
    python companion_child.py reread PATH OFFSET SIZE STOP write a pattern, then read it back
                                                           and compare until STOP exists
    python companion_child.py pwrites PATH OFFSET SIZE STOP write new data with pwrite, read
                                                           it back and compare, until STOP
    python companion_child.py near PATH OFFSET SIZE STOP NEAR  reread, with the File's memory
                                    said to be NEAR (File's near=); each round names its path

``roundtrip`` prints one JSON line: the SHA-256 of what it wrote (and of a few windows of
it: :func:`windows`), whether the read matched, the queue IDs the file used on its own,
the daemon's companion counters before and after the read, and what ``nvmeof_fuse``
logged in this process so far.
KIND is ``empty`` (``nvmeof_fuse.empty``, the default) or ``numpy`` (a plain array).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import struct
import subprocess
import sys
import time

import numpy as np

import nvmeof_fuse

LOGGED: list[str] = []  # nvmeof_fuse's log messages in this process (fallbacks say why)


def _capture_log() -> None:
    handler = logging.Handler()
    handler.emit = lambda record: LOGGED.append(record.getMessage())
    logging.getLogger("nvmeof_fuse").addHandler(handler)


def _array(size: int, kind: str) -> np.ndarray:
    """``empty``: shared memory the daemon could map; ``numpy``: plain process memory."""
    return nvmeof_fuse.empty(size) if kind == "empty" else np.zeros(size, dtype=np.uint8)


WINDOW = 1 << 20


def windows(data: np.ndarray) -> list[tuple[int, int, str]]:
    """``(start, length, sha256)`` of the first, a middle and the last MiB of ``data``: a
    second initiator checks these, where a misplaced or torn transfer shows, instead of
    reading everything again."""
    size = len(data)
    starts = sorted({0, size // 2 // 4096 * 4096, max(0, size - WINDOW)})
    return [(s, min(WINDOW, size - s), hashlib.sha256(data[s:s + WINDOW]).hexdigest())
            for s in starts]


def roundtrip(path: str, offset: int, size: int, kind: str = "empty") -> None:
    data = _array(size, kind)
    data[:] = np.frombuffer(os.urandom(size), dtype=np.uint8)
    out = _array(size, kind)
    with nvmeof_fuse.File(path) as f:
        assert f.pwrite(data, file_offset=offset).get(600) == size
        before = f.stats()
        assert f.read(out, file_offset=offset) == size
        after = f.stats()
        own = list(f.own_queues)
    print(json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "windows": windows(data),
                      "own_queues": own,
                      "equal": bool((out == data).all()), "before": before, "after": after,
                      "log": LOGGED}), flush=True)


def churn(path: str, offset: int, size: int, stop: str) -> None:
    """Write, read back and compare until the file ``stop`` exists; print a line per round.

    It reads back in two requests, a small one first (whole LBAs of it: the polled
    queue of small reads; over 128 KiB after it: the polled queues' large reads).
    A request that fails prints its error instead: the caller decides what is right.
    """
    from nvmeof_fuse.companion.client.own_queues import POLLED_MAX_BYTES

    data, out = nvmeof_fuse.empty(size), np.zeros(size, dtype=np.uint8)
    small = min(size, POLLED_MAX_BYTES // 2)
    with nvmeof_fuse.File(path) as f:
        print(json.dumps({"own_queues": list(f.own_queues)}), flush=True)
        rounds = 0
        while not os.path.exists(stop):
            rounds += 1
            data[:] = np.frombuffer(os.urandom(size), dtype=np.uint8)
            try:
                f.write(data, file_offset=offset)
                f.read(out[:small], file_offset=offset)
                if size > small:
                    f.read(out[small:], file_offset=offset + small)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                print(json.dumps({"round": rounds, "error": str(exc),
                                  "errno": getattr(exc, "errno", None)}), flush=True)
                continue
            print(json.dumps({"round": rounds, "equal": bool((out == data).all())}),
                  flush=True)


def overwrite(path: str, offset: int, size: int, rounds: int) -> None:
    """Write ``size`` bytes of value r at ``offset`` for r = 1..rounds; print the last r."""
    data = np.zeros(size, dtype=np.uint8)
    with nvmeof_fuse.File(path) as f:
        assert f.own_queues, "no queues of its own"
        print("writing", flush=True)
        for r in range(1, rounds + 1):
            data[:] = r
            f.write(data, file_offset=offset)
    print(rounds, flush=True)


def loop(path: str, size: int) -> None:
    out = nvmeof_fuse.empty(size)
    with nvmeof_fuse.File(path) as f:
        f.read(out, file_offset=511)
        print("reading", flush=True)
        while True:
            f.read(out, file_offset=511)


def _until_stopped(path: str, stop: str, step, near: str | None = None) -> None:
    """Run ``step(f, round)`` (True: the data was right) until the file ``stop`` exists.

    Prints ``{"round": n}`` after each (a caller counts them; with ``near``, the path the
    file's queues are on too), ``{"round": n, "error": ...}`` for one that raised, then a
    summary: the rounds, mismatches, errors, slowest round in seconds and the queue IDs
    used on the file's own.
    """
    rounds = mismatches = 0
    errors: list[str] = []
    slowest = 0.0
    with nvmeof_fuse.File(path, **({"near": near} if near else {})) as f:
        while not os.path.exists(stop):
            rounds += 1
            started = time.monotonic()
            try:
                right = step(f, rounds)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                errors.append(f"{type(exc).__name__}: {exc}")
                print(json.dumps({"round": rounds, "error": errors[-1]}), flush=True)
                continue
            slowest = max(slowest, time.monotonic() - started)
            mismatches += not right
            print(json.dumps({"round": rounds, "equal": right,
                              **({"path": f.placement.get("path")} if near else {})}),
                  flush=True)
        own = list(f.own_queues)
    print(json.dumps({"rounds": rounds, "mismatches": mismatches, "errors": errors,
                      "slowest_s": round(slowest, 3), "own_queues": own}), flush=True)


def reread(path: str, offset: int, size: int, stop: str, near: str | None = None) -> None:
    """Write a random pattern once, then read it back into an ``empty`` array and compare,
    until ``stop`` exists (:func:`_until_stopped` prints the rounds and the summary)."""
    pattern = nvmeof_fuse.empty(size)
    pattern[:] = np.frombuffer(os.urandom(size), dtype=np.uint8)
    out = nvmeof_fuse.empty(size)
    with nvmeof_fuse.File(path) as f:
        assert f.write(pattern, file_offset=offset) == size

    def step(f, _round: int) -> bool:
        out[:] = 0
        return f.read(out, file_offset=offset) == size and bool((out == pattern).all())

    _until_stopped(path, stop, step, near)


def pwrites(path: str, offset: int, size: int, stop: str) -> None:
    """Write new random data with ``pwrite`` each round, read it back and compare."""
    data, out = nvmeof_fuse.empty(size), nvmeof_fuse.empty(size)

    def step(f, _round: int) -> bool:
        data[:] = np.frombuffer(os.urandom(size), dtype=np.uint8)
        if f.pwrite(data, size, offset).get() != size:
            return False
        return f.read(out, file_offset=offset) == size and bool((out == data).all())

    _until_stopped(path, stop, step)


UDMABUF_CREATE = (1 << 30) | (24 << 16) | (ord("u") << 8) | 0x42  # _IOW('u', 0x42, 24)


def udmabuf_export(base: int, length: int) -> int:
    """A real dma-buf of shared memory (/dev/udmabuf), as the fake driver's export."""
    from nvmeof_fuse.companion.client import shm

    mem, offset = shm.find(base, length)
    request = bytearray(struct.pack("IIQQ", mem.fd, 1, offset, length))  # CLOEXEC
    with open("/dev/udmabuf", "rb") as dev:  # a mutable request: ioctl returns the new fd
        return fcntl.ioctl(dev.fileno(), UDMABUF_CREATE, request, True)


def mrs(pid: int) -> int:
    """Memory regions process ``pid`` holds (``rdma resource show mr``)."""
    out = subprocess.run(["rdma", "resource", "show", "mr"], capture_output=True, text=True,
                         timeout=60).stdout
    return sum(1 for line in out.splitlines() if f" pid {pid} " in f"{line} ")


def cuda(path: str, offset: int, transfers: int, queues: int, export: str) -> None:
    """``transfers`` reads into views of one fake CUDA allocation, whose export is its
    shared memory (``memfd``) or a real dma-buf of it (``udmabuf``), from a thread that
    never pushed a context; the counts around them."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fake_cuda import FakeDriver, install

    driver, _ = install(FakeDriver(devices=1))
    if export == "udmabuf":
        driver.export = udmabuf_export
    _capture_log()
    with open(os.path.join(os.path.dirname(path), ".nvmeof", "companion.json")) as f:
        daemon = json.load(f)["pid"]
    chunk = 16 << 10
    allocation = driver.tensor(1 << 20)
    views = [allocation.view(i * chunk, chunk) for i in range(4)]
    source = driver.tensor(4 * chunk)
    source.bytes[:] = np.frombuffer(os.urandom(4 * chunk), np.uint8)
    with nvmeof_fuse.File(path, queues=queues) as f:
        counts = {"start": (mrs(os.getpid()), mrs(daemon))}
        refused = f.stats()["dmabuf_refused"]
        assert f.write(source, file_offset=offset) == 4 * chunk
        for i in range(transfers):
            assert f.read(views[i % 4], file_offset=offset + i % 4 * chunk) == chunk
        counts["after"] = (mrs(os.getpid()), mrs(daemon))
        stats = f.stats()
        placement = f.placement
    deadline = time.monotonic() + 60  # the daemon lets go of them as the client goes
    while mrs(daemon) > counts["start"][1] and time.monotonic() < deadline:
        time.sleep(0.2)
    counts["closed"] = (mrs(os.getpid()), mrs(daemon))
    print(json.dumps({"exports": driver.names().count("export"), "file": stats["file"],
                      "errors": stats["errors"], "refused": stats["dmabuf_refused"] - refused,
                      "direct": stats["direct_read_bytes"] + stats["client_queue_read_bytes"],
                      "mrs": counts, "placement": placement, "own": f.own_queues,
                      "same": bytes(allocation.bytes[:4 * chunk]) == bytes(source.bytes),
                      "log": LOGGED}))


if __name__ == "__main__":
    mode, path, *numbers = sys.argv[1:]
    if mode in ("roundtrip", "both"):
        _capture_log()
    if mode == "roundtrip":
        roundtrip(path, int(numbers[0]), int(numbers[1]), *sys.argv[5:6])
    elif mode == "both":  # PATH is the mountpoint: n1, then n2
        for nsid in (1, 2):
            roundtrip(f"{path}/n{nsid}", int(numbers[0]), int(numbers[1]), sys.argv[5])
    elif mode == "cuda":
        cuda(path, int(numbers[0]), int(numbers[1]), int(numbers[2]), sys.argv[6])
    elif mode == "overwrite":
        overwrite(path, int(numbers[0]), int(numbers[1]), int(numbers[2]))
    elif mode == "churn":
        churn(path, int(numbers[0]), int(numbers[1]), sys.argv[5])
    elif mode == "reread":
        reread(path, int(numbers[0]), int(numbers[1]), sys.argv[5])
    elif mode == "near":
        reread(path, int(numbers[0]), int(numbers[1]), sys.argv[5], sys.argv[6])
    elif mode == "pwrites":
        pwrites(path, int(numbers[0]), int(numbers[1]), sys.argv[5])
    else:
        loop(path, int(numbers[0]))
