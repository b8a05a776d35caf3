"""A controller whose namespaces live in RAM: the FUSE layer with no NVMe behind it.

``scripts/benches/bench.py fuse-ram MOUNTPOINT`` mounts one, so that ``scripts/bench`` can
show, in the same run as the real target, how fast the FUSE file can be at best: the cost of
the kernel's FUSE, our FUSE session and our file layer alone.  The tests' fakes build on it.
It serves only the benches and the tests, so it lives here, out of the installed package.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Any

import trio

from nvmeof_fuse.host.namespace.byterange import ByteRangeIO
from nvmeof_fuse.host.namespace.sharedranges import NamespaceRanges, SharedRanges
from nvmeof_fuse.host.namespace.stats import IoStats


class RamDevice:
    """A bytearray addressed in LBAs; each command is one trio checkpoint, like a real one.

    ``data`` may be any writable buffer of ``lba_size * nlb`` bytes instead (an ``mmap`` of
    an image file, so that other servers can serve the same bytes).
    """

    def __init__(self, lba_size: int, nlb: int, data: bytearray | mmap.mmap | None = None) -> None:
        self.lba_size = lba_size
        self.nlb = nlb
        self.data = bytearray(lba_size * nlb) if data is None else data
        if len(self.data) != lba_size * nlb:
            raise ValueError(f"a RAM device of {nlb} LBAs of {lba_size} B needs "
                             f"{lba_size * nlb} bytes, got {len(self.data)}")

    async def read_lbas(self, slba: int, nlb: int) -> bytes:
        await trio.lowlevel.checkpoint()
        ls = self.lba_size
        return bytes(self.data[slba * ls : (slba + nlb) * ls])

    async def lend_lbas(self, slba: int, nlb: int) -> memoryview:
        """The LBAs without a copy (valid until the caller yields, as from a bounce buffer)."""
        await trio.lowlevel.checkpoint()
        ls = self.lba_size
        return memoryview(self.data)[slba * ls : (slba + nlb) * ls]

    async def write_lbas(self, slba: int, data: bytes | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        start = slba * self.lba_size
        self.data[start : start + len(data)] = data


@dataclass
class RamIdentify:
    """Identify data as a dict, read as attributes like the parsed structures."""

    fields: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.fields)


class RamNamespace:
    """The namespace API of the host layer (byte offsets, ranges locked), over ``device``."""

    def __init__(self, nsid: int, device: RamDevice) -> None:
        self.nsid = nsid
        self.lba_size = device.lba_size
        self.nlb = device.nlb
        self.size = device.lba_size * device.nlb
        self.device = device
        self.stats = IoStats()
        self.io = ByteRangeIO(device, self.stats)
        self.flushes = 0
        self.unavailable = ""  # as host.namespace.Namespace's: a RAM disk is always servable
        self.generation = 0  # as host.namespace.Namespace's: never replaced
        self.identify = RamIdentify(
            {"nsze": self.nlb, "ncap": self.nlb, "nuse": self.nlb,
             "lbaf": [{"ms": 0, "lbads": self.lba_size}]}
        )

    @property
    def io_stats(self) -> IoStats:
        return self.stats

    def share_locks(self, ranges: SharedRanges) -> None:
        """As host.namespace.Namespace's: writes take the mount's locks across processes."""
        self.io.lock.shared = NamespaceRanges(ranges, self.nsid, lambda: self.device.nlb)

    async def read(self, offset: int, length: int) -> bytes:
        return await self.io.read(offset, length)

    async def read_lent(self, offset: int, length: int) -> bytes | memoryview:
        return await self.io.read_lent(offset, length)

    def start_read_lent(self, offset: int, length: int, done: object) -> bool:
        return False  # RAM I/O answers in its task, after one checkpoint, like a device's

    def start_write(self, offset: int, data: memoryview, done: object) -> bool:
        return False

    async def write(self, offset: int, data: bytes | memoryview) -> int:
        return await self.io.write(offset, data)

    async def flush(self) -> None:
        self.flushes += 1
        await trio.lowlevel.checkpoint()


@dataclass
class RamOptions:
    traddr: str = "ram"
    nqn: str = "nqn.2014-08.org.nvmeof-fuse:ram"
    transport: str = "ram"
    trsvcid: int = 0
    companion_queues: int = 0  # nothing to lease: the namespaces are in this process's RAM


def _ram_identify() -> RamIdentify:
    return RamIdentify({"mn": "nvmeof-fuse RAM controller", "sn": "RAM0001", "fr": "1.0",
                        "subnqn": RamOptions.nqn, "cntlid": 1})


@dataclass
class RamController:
    """The controller API the FUSE layer uses: namespaces, options, identify, describe()."""

    namespaces: dict[int, RamNamespace] = field(default_factory=dict)
    options: RamOptions = field(default_factory=RamOptions)
    identify: RamIdentify = field(default_factory=_ram_identify)
    starts_io: bool = False  # RAM I/O answers in its task (RamNamespace.start_read_lent)

    def describe(self) -> dict[str, Any]:
        return {
            "transport": self.options.transport,
            "traddr": self.options.traddr,
            "trsvcid": self.options.trsvcid,
            "subnqn": self.identify.subnqn,
            "cntlid": self.identify.cntlid,
            "queues": 1,
            "queue_size": 32,
        }


def ram_controller(*specs: tuple[int, int, int]) -> RamController:
    """A controller with RAM namespaces given as (nsid, lba_size, nlb)."""
    return RamController({nsid: RamNamespace(nsid, RamDevice(ls, nlb)) for nsid, ls, nlb in specs})
