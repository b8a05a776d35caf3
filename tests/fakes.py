"""In-memory stand-ins for an LBA device, a namespace and a controller."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import trio

from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.host.byterange import ByteRangeIO
from nvmeof_fuse.host.stats import IoStats


class FakeDevice:
    """A bytearray addressed in LBAs; yields to the scheduler inside every command.

    With ``shuffle`` set, each command yields a random number of times, so
    concurrent commands interleave in many orders (seeded, so reproducible).
    """

    def __init__(self, lba_size: int, nlb: int, *, seed: int | None = None) -> None:
        self.lba_size = lba_size
        self.nlb = nlb
        self.data = bytearray(lba_size * nlb)
        self.rng = random.Random(seed) if seed is not None else None
        self.reads: list[tuple[int, int]] = []
        self.writes: list[tuple[int, int]] = []
        self.fail: NVMeoFError | None = None
        self._lent: list[bytearray] = []

    def _scribble_lent(self) -> None:
        """Lent data is gone once its holder yields: any later command overwrites it."""
        for buf in self._lent:
            buf[:] = b"\xee" * len(buf)
        self._lent.clear()

    async def _yield(self) -> None:
        for _ in range(self.rng.randrange(4) if self.rng else 1):
            await trio.sleep(0)

    def _check(self, slba: int, nlb: int) -> None:
        self._scribble_lent()
        assert 0 <= slba and nlb > 0 and slba + nlb <= self.nlb, (slba, nlb)
        if self.fail is not None:
            raise self.fail

    async def read_lbas(self, slba: int, nlb: int) -> bytes:
        self._check(slba, nlb)
        self.reads.append((slba, nlb))
        await self._yield()
        ls = self.lba_size
        return bytes(self.data[slba * ls : (slba + nlb) * ls])

    async def lend_lbas(self, slba: int, nlb: int) -> memoryview:
        """read_lbas, lent like Namespace.lend_lbas: the next command overwrites it."""
        buf = bytearray(await self.read_lbas(slba, nlb))
        self._lent.append(buf)
        return memoryview(buf)

    async def write_lbas(self, slba: int, data: bytes | memoryview) -> None:
        ls = self.lba_size
        assert len(data) % ls == 0, len(data)
        self._check(slba, len(data) // ls)
        self.writes.append((slba, len(data) // ls))
        data = bytes(data)  # the caller may reuse its buffer once we return
        await self._yield()
        self.data[slba * ls : slba * ls + len(data)] = data


@dataclass
class FakeIdentify:
    fields: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.fields)


class FakeNamespace:
    """Namespace API of the real host layer, backed by a FakeDevice."""

    def __init__(self, nsid: int, lba_size: int, nlb: int) -> None:
        self.nsid = nsid
        self.lba_size = lba_size
        self.nlb = nlb
        self.size = lba_size * nlb
        self.device = FakeDevice(lba_size, nlb)
        self.stats = IoStats()
        self.io = ByteRangeIO(self.device, self.stats)
        self.flushes = 0
        self.identify = FakeIdentify(
            {"nsze": nlb, "ncap": nlb, "nuse": nlb, "lbaf": [{"ms": 0, "lbads": lba_size}]}
        )

    async def read(self, offset: int, length: int) -> bytes:
        return await self.io.read(offset, length)

    async def read_lent(self, offset: int, length: int) -> bytes | memoryview:
        return await self.io.read_lent(offset, length)

    async def write(self, offset: int, data: bytes | memoryview) -> int:
        return await self.io.write(offset, data)

    async def flush(self) -> None:
        self.flushes += 1
        await trio.sleep(0)


@dataclass
class FakeOptions:
    traddr: str = "192.0.2.1"
    nqn: str = "nqn.2014-08.org.example:fake"
    transport: str = "tcp"
    trsvcid: int = 4420


@dataclass
class FakeController:
    namespaces: dict[int, FakeNamespace] = field(default_factory=dict)
    options: FakeOptions = field(default_factory=FakeOptions)
    identify: FakeIdentify = field(
        default_factory=lambda: FakeIdentify(
            {
                "mn": "Fake NVMe Controller",
                "sn": "FAKE0001",
                "fr": "1.0",
                "subnqn": "nqn.2014-08.org.example:fake",
                "cntlid": 1,
            }
        )
    )

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


def make_controller(*specs: tuple[int, int, int]) -> FakeController:
    """A controller with namespaces given as (nsid, lba_size, nlb)."""
    return FakeController({nsid: FakeNamespace(nsid, ls, nlb) for nsid, ls, nlb in specs})
