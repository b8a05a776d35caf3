"""Target objects a VM test adds beside the testbed's own and removes again: memory-backed
null_blk disks and nvmet subsystems with one namespace on the testbed's ports."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from vm import NVMET, RDMA_PORT, wait_for

CONFIGFS = "/sys/kernel/config"


def write(path: str, value: str | int) -> None:
    with open(path, "w") as f:
        f.write(str(value))


@contextlib.contextmanager
def null_blk(name: str, mib: int, blocksize: int) -> Iterator[str]:
    """A memory-backed null_blk disk that keeps its data; its ``/dev`` path."""
    nullb = f"{CONFIGFS}/nullb/{name}"
    os.mkdir(nullb)
    try:
        for attr, value in (("size", mib), ("blocksize", blocksize), ("memory_backed", 1),
                            ("power", 1)):
            write(f"{nullb}/{attr}", value)
        dev = f"/dev/{name}"  # since 6.x the disk is named after its configfs directory
        assert wait_for(lambda: os.path.exists(dev), 30), f"{dev} did not appear"
        yield dev
    finally:
        write(f"{nullb}/power", 0)
        os.rmdir(nullb)


@contextlib.contextmanager
def subsystem(nqn: str, device: str | None, *, ports: tuple[int, ...] = (RDMA_PORT,),
              allow_any_host: bool = True) -> Iterator[str]:
    """Subsystem ``nqn`` with ``device`` (if any) as namespace 1, on ``ports``; its configfs
    path."""
    sub = f"{NVMET}/subsystems/{nqn}"
    links = [f"{NVMET}/ports/{port}/subsystems/{nqn}" for port in ports]
    os.mkdir(sub)
    try:
        write(f"{sub}/attr_allow_any_host", int(allow_any_host))
        if device is not None:
            os.mkdir(f"{sub}/namespaces/1")
            write(f"{sub}/namespaces/1/device_path", device)
            write(f"{sub}/namespaces/1/enable", 1)
        for link in links:
            os.symlink(sub, link)
        yield sub
    finally:
        for link in links:
            if os.path.lexists(link):
                os.unlink(link)
        if os.path.isdir(f"{sub}/namespaces/1"):
            write(f"{sub}/namespaces/1/enable", 0)
            os.rmdir(f"{sub}/namespaces/1")
        os.rmdir(sub)
