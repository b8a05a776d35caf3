"""Target objects a VM test adds beside the testbed's own and removes again (memory-backed
null_blk disks, nvmet subsystems with one namespace on the testbed's ports), and the target's
knobs a test turns: a port's ANA state and a namespace's NGUID."""

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
def null_blk(name: str, mib: int, blocksize: int, *, cache_mib: int = 0) -> Iterator[str]:
    """A memory-backed null_blk disk that keeps its data; its ``/dev`` path.  With
    ``cache_mib`` it has a volatile write cache of that size: nvmet then passes each Flush on
    to it, and its ``/sys/block`` statistics count them (:func:`flushes`)."""
    nullb = f"{CONFIGFS}/nullb/{name}"
    os.mkdir(nullb)
    try:
        cache = (("cache_size", cache_mib),) if cache_mib else ()
        for attr, value in (("size", mib), ("blocksize", blocksize), ("memory_backed", 1),
                            *cache, ("power", 1)):
            write(f"{nullb}/{attr}", value)
        dev = f"/dev/{name}"  # since 6.x the disk is named after its configfs directory
        assert wait_for(lambda: os.path.exists(dev), 30), f"{dev} did not appear"
        yield dev
    finally:
        write(f"{nullb}/power", 0)
        os.rmdir(nullb)


@contextlib.contextmanager
def subsystem(nqn: str, device: str | None, *, ports: tuple[int, ...] = (RDMA_PORT,),
              allow_any_host: bool = True, nguid: str | None = None) -> Iterator[str]:
    """Subsystem ``nqn`` with ``device`` (if any) as namespace 1 (with ``nguid``, 32 hex
    digits, if given), on ``ports``; its configfs path."""
    sub = f"{NVMET}/subsystems/{nqn}"
    links = [f"{NVMET}/ports/{port}/subsystems/{nqn}" for port in ports]
    os.mkdir(sub)
    try:
        write(f"{sub}/attr_allow_any_host", int(allow_any_host))
        if device is not None:
            os.mkdir(f"{sub}/namespaces/1")
            write(f"{sub}/namespaces/1/device_path", device)
            if nguid is not None:
                write(f"{sub}/namespaces/1/device_nguid", nguid)
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


def flushes(device: str) -> int:
    """Flush requests ``device`` (a ``/dev`` path) completed: field 16 of its
    ``/sys/block/NAME/stat`` (Documentation/block/stat.rst)."""
    with open(f"/sys/block/{os.path.basename(device)}/stat") as f:
        fields = f.read().split()
    assert len(fields) >= 17, f"{device}: this kernel's block statistics count no flushes"
    return int(fields[15])


@contextlib.contextmanager
def namespaces(subsystem_path: str, devices: list[str]) -> Iterator[None]:
    """``devices`` as namespaces 1, 2, ... of the subsystem at ``subsystem_path`` (made with
    no device), enabled while inside."""
    made = []
    try:
        for nsid, device in enumerate(devices, 1):
            ns = f"{subsystem_path}/namespaces/{nsid}"
            os.mkdir(ns)
            made.append(ns)
            write(f"{ns}/device_path", device)
            write(f"{ns}/enable", 1)
        yield
    finally:
        for ns in reversed(made):
            write(f"{ns}/enable", 0)
            os.rmdir(ns)


# --- ANA and namespace identifiers --------------------------------------------------------

ANA_STATES = ("optimized", "non-optimized", "inaccessible", "persistent-loss", "change")
ANA_GROUP = 1  # nvmet's default group: every namespace is in it unless its ana_grpid says not


def ana_state_file(port: int, group: int = ANA_GROUP) -> str:
    return f"{NVMET}/ports/{port}/ana_groups/{group}/ana_state"


def ana_state(port: int, group: int = ANA_GROUP) -> str:
    """The ANA state ``port`` reports for ``group`` (one of :data:`ANA_STATES`)."""
    with open(ana_state_file(port, group)) as f:
        return f.read().strip()


def set_ana_state(port: int, state: str, group: int = ANA_GROUP) -> None:
    """Make ``port`` report ``state`` for ``group``; nvmet sends an ANA Change event to every
    controller connected through the port."""
    assert state in ANA_STATES, state
    write(ana_state_file(port, group), state)


@contextlib.contextmanager
def ana(port: int, state: str, group: int = ANA_GROUP) -> Iterator[None]:
    """``port`` reports ``state`` for ``group`` while inside; the state before comes back."""
    before = ana_state(port, group)
    set_ana_state(port, state, group)
    try:
        yield
    finally:
        set_ana_state(port, before, group)


def set_nguid(subsystem_path: str, nsid: int, nguid: str) -> None:
    """Give namespace ``nsid`` the NGUID ``nguid`` (32 hex digits).  nvmet takes a new one
    only while the namespace is disabled: hosts see it go and come back."""
    ns = f"{subsystem_path}/namespaces/{nsid}"
    write(f"{ns}/enable", 0)
    try:
        write(f"{ns}/device_nguid", nguid)
    finally:
        write(f"{ns}/enable", 1)


def nguid_text(nguid: str) -> str:
    """``nguid`` (32 hex digits) as the kernel shows it in sysfs and as nvme-cli prints a
    UUID: 8-4-4-4-12 lower-case hex digits."""
    h = nguid.lower()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@contextlib.contextmanager
def on_port(nqn: str, port: int) -> Iterator[None]:
    """Subsystem ``nqn`` (already made) is on nvmet port ``port`` while inside: nvmet
    enables a port with its first subsystem and disables it with its last."""
    link = f"{NVMET}/ports/{port}/subsystems/{nqn}"
    os.symlink(f"{NVMET}/subsystems/{nqn}", link)
    try:
        yield
    finally:
        if os.path.lexists(link):
            os.unlink(link)
