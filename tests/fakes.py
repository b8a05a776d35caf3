"""In-memory stand-ins for an LBA device, a namespace and a controller (over ramdisk.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import trio
from ramdisk import (
    RamController,
    RamDevice,
    RamIdentify,
    RamNamespace,
    RamOptions,
)

from nvmeof_fuse.errors import NVMeoFError

FakeIdentify = RamIdentify


class FakeDevice(RamDevice):
    """A RamDevice that records commands, can fail, and yields at least once inside each.

    With ``shuffle`` set, each command yields a random number of times, so
    concurrent commands interleave in many orders (seeded, so reproducible).
    """

    def __init__(self, lba_size: int, nlb: int, *, seed: int | None = None) -> None:
        super().__init__(lba_size, nlb)
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


class FakeNamespace(RamNamespace):
    """Namespace API of the real host layer, backed by a FakeDevice."""

    def __init__(self, nsid: int, lba_size: int, nlb: int) -> None:
        super().__init__(nsid, FakeDevice(lba_size, nlb))
        self.device: FakeDevice


@dataclass
class FakeController(RamController):
    options: RamOptions = field(default_factory=lambda: RamOptions(
        traddr="192.0.2.1", nqn="nqn.2014-08.org.example:fake", transport="tcp", trsvcid=4420))
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


def make_controller(*specs: tuple[int, int, int]) -> FakeController:
    """A controller with namespaces given as (nsid, lba_size, nlb)."""
    return FakeController({nsid: FakeNamespace(nsid, ls, nlb) for nsid, ls, nlb in specs})


class CommandEnds(list):
    """What a queue's ``start()`` callbacks tell: called with each finished request, it
    keeps them in order; :meth:`wait_for` waits, on the callbacks themselves, for a count."""

    def __init__(self) -> None:
        super().__init__()
        self._grew = trio.Event()

    def __call__(self, request: object) -> None:
        self.append(request)
        self._grew.set()

    async def wait_for(self, count: int) -> None:
        while len(self) < count:
            self._grew = trio.Event()
            await self._grew.wait()
