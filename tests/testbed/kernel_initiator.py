"""The Linux kernel initiator (nvme-cli) as a second opinion inside the testbed VM."""

from __future__ import annotations

import contextlib
import glob
import os
import subprocess
import time
from collections.abc import Iterator

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000cafe"


def nvme(*args: str, timeout: float = 60, program: str = "nvme") -> str:
    return subprocess.run([program, *args], check=True, capture_output=True, text=True,
                          timeout=timeout).stdout


def _controllers(nqn: str, transport: str) -> set[str]:
    found = set()
    for ctrl in glob.glob("/sys/class/nvme/nvme*"):
        try:
            with open(f"{ctrl}/subsysnqn") as f, open(f"{ctrl}/transport") as t:
                if f.read().strip() == nqn and t.read().strip() == transport:
                    found.add(os.path.basename(ctrl))
        except OSError:
            continue
    return found


@contextlib.contextmanager
def connected(transport: str, addr: str, port: int, nqn: str, *, namespaces: int = 2,
              hostnqn: str = HOSTNQN, extra: tuple[str, ...] = (),
              program: str = "nvme") -> Iterator[dict[int, str]]:
    """``nvme connect`` with ``extra`` options (by ``program``: another nvme-cli, such as
    the testbed's for ``--tls``); yields {nsid: /dev/nvmeXnY}; disconnects on exit."""
    before = _controllers(nqn, transport)
    nvme("connect", "-t", transport, "-a", addr, "-s", str(port), "-n", nqn, "-q", hostnqn,
         *extra, program=program)
    try:
        deadline = time.monotonic() + 30
        while True:
            new = _controllers(nqn, transport) - before
            devices = {}
            for ctrl in new:
                for ns in glob.glob(f"/sys/class/nvme/{ctrl}/nvme*n*/nsid"):
                    with open(ns) as f:
                        devices[int(f.read())] = "/dev/" + os.path.basename(os.path.dirname(ns))
            if len(devices) >= namespaces and all(map(os.path.exists, devices.values())):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"kernel initiator over {transport}: no namespaces appeared")
            time.sleep(0.2)
        yield devices
    finally:
        for ctrl in _controllers(nqn, transport) - before:
            subprocess.run(["nvme", "disconnect", "-d", ctrl], capture_output=True, timeout=60)


def pread_direct(dev: str, offset: int, length: int, align: int = 4096) -> bytes:
    """O_DIRECT read of ``length`` bytes at ``offset`` (both multiples of the LBA size)."""
    import mmap

    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, max(length, align))
        n = os.preadv(fd, [memoryview(buf)[:length]], offset)
        assert n == length, f"short O_DIRECT read from {dev}: {n} of {length}"
        return bytes(buf[:length])
    finally:
        os.close(fd)


def pwrite_direct(dev: str, offset: int, data: bytes, align: int = 4096) -> None:
    """O_DIRECT write of ``data`` at ``offset`` (length and offset LBA multiples)."""
    import mmap

    fd = os.open(dev, os.O_WRONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, max(len(data), align))
        buf[: len(data)] = data
        n = os.pwritev(fd, [memoryview(buf)[: len(data)]], offset)
        assert n == len(data), f"short O_DIRECT write to {dev}: {n} of {len(data)}"
    finally:
        os.close(fd)
