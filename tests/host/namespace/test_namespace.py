"""Namespace I/O over a fake controller: splitting, range checks and bounce-buffered round trips."""

import os
import random
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from nvmeof_fuse.errors import CommandTimeout, InvalidArgument, TransportError
from nvmeof_fuse.host.memory import BouncePool, DataRef, host_buffer
from nvmeof_fuse.host.namespace import Namespace
from nvmeof_fuse.nvme import command as cmd

OPC_FLUSH, OPC_WRITE, OPC_READ, OPC_WRITE_ZEROES = 0x00, 0x01, 0x02, 0x08


class FakeRegistration:
    lkey = rkey = 1

    def close(self) -> None:
        pass


def fake_register(addr: int, length: int, owner: object) -> FakeRegistration:
    return FakeRegistration()


class FakeController:
    """Just what Namespace needs: ``max_transfer``, ``bounce`` and ``io_command``.

    ``io_command`` decodes the SQE and copies between ``disk`` and the DataRef's
    region view, yielding first so concurrent chunks interleave.
    """

    def __init__(self, lba_size: int, nlb: int, max_transfer: int, buffers: int = 4) -> None:
        self.lba_size = lba_size
        self.max_transfer = max_transfer
        self.bounce = BouncePool(fake_register, max_transfer, buffers)
        size = lba_size * nlb
        self.disk = bytearray(random.Random(1).randbytes(size) if size <= 1 << 20 else size)
        self.commands: list[tuple[int, int, int]] = []  # opcode, slba, nlb
        self.fail: Exception | None = None
        self.started: list = []  # (sqe, data, done) of commands start_io took
        self.take_started = True  # what start_io answers
        self.failed_on: list = []  # (queue, error) of each io_failed

    live = True  # commands run now (Namespace asks before it takes a bounce buffer)

    async def wait_live(self) -> None:
        pass

    def start_io(self, sqe: bytearray, data: DataRef | None, done, *,
                 to_controller: bool = False) -> object | None:
        """The queue that took the command (``"queue"``), or None."""
        assert to_controller == (sqe[0] == OPC_WRITE)
        if not self.take_started:
            return None
        self.started.append((sqe, data, done))
        return "queue"

    def io_failed(self, queue: object, exc: BaseException) -> None:
        self.failed_on.append((queue, exc))

    def end_started(self, status: int = 0, error: Exception | None = None) -> None:
        """The target answers the commands start_io took (from and to ``disk``)."""
        started, self.started = self.started, []
        for sqe, data, done in started:
            slba = int.from_bytes(sqe[40:48], "little")
            if error is None and not status:
                at = slba * self.lba_size
                view = data.region.view[data.offset:data.offset + data.length]
                if sqe[0] == OPC_WRITE:
                    self.disk[at:at + data.length] = view
                else:
                    view[:] = self.disk[at:at + data.length]
            completion = None if error else SimpleNamespace(ok=not status)
            done(SimpleNamespace(completion=completion, error=error))

    async def io_command(self, sqe: bytearray, data: DataRef | None = None, *,
                         to_controller: bool = False) -> None:
        opcode = sqe[0]
        assert int.from_bytes(sqe[4:8], "little") == 1  # nsid
        slba = int.from_bytes(sqe[40:48], "little")
        nlb = int.from_bytes(sqe[48:50], "little") + 1
        self.commands.append((opcode, slba, nlb))
        await trio.sleep(0)
        if self.fail is not None:
            raise self.fail
        if opcode not in (OPC_READ, OPC_WRITE):
            assert data is None
            return
        assert to_controller == (opcode == OPC_WRITE)
        length = nlb * self.lba_size
        assert data is not None and data.length == length
        assert length <= self.max_transfer
        at = slba * self.lba_size
        view = data.region.view[data.offset:data.offset + length]
        if opcode == OPC_READ:
            view[:] = self.disk[at:at + length]
        else:
            self.disk[at:at + length] = view


def namespace(lba_size: int = 512, nlb: int = 64, max_transfer: int = 2048,
              buffers: int = 4) -> Namespace:
    controller = FakeController(lba_size, nlb, max_transfer, buffers)
    return Namespace(controller, 1, SimpleNamespace(lba_size=lba_size, nsze=nlb))


# --- splitting and checks -------------------------------------------------------------------------


def test_chunks_split_at_max_transfer():
    ns = namespace(max_transfer=4096)
    assert list(ns.lbas._chunks(10, 20)) == [(10, 8, 0), (18, 8, 4096), (26, 4, 8192)]


def test_chunks_single_piece():
    ns = namespace(max_transfer=4096)
    assert list(ns.lbas._chunks(0, 8)) == [(0, 8, 0)]
    assert list(ns.lbas._chunks(3, 1)) == [(3, 1, 0)]


def test_chunks_round_max_transfer_down_to_whole_lbas():
    ns = namespace(max_transfer=4096 + 100)
    assert [n for _, n, _ in ns.lbas._chunks(0, 17)] == [8, 8, 1]


def test_chunks_split_at_max_nlb():
    ns = namespace(lba_size=512, nlb=4 * cmd.MAX_NLB, max_transfer=512)
    ns.controller.max_transfer = 1 << 40
    nlb = 2 * cmd.MAX_NLB + 5
    assert list(ns.lbas._chunks(7, nlb)) == [
        (7, cmd.MAX_NLB, 0),
        (7 + cmd.MAX_NLB, cmd.MAX_NLB, cmd.MAX_NLB * 512),
        (7 + 2 * cmd.MAX_NLB, 5, 2 * cmd.MAX_NLB * 512),
    ]


def test_chunks_at_least_one_lba():
    ns = namespace(lba_size=4096, max_transfer=4096)
    ns.controller.max_transfer = 512
    assert list(ns.lbas._chunks(0, 2)) == [(0, 1, 0), (1, 1, 4096)]


def test_check_range_accepts_the_whole_namespace():
    ns = namespace(nlb=64)
    ns.check_range(0, 64)
    ns.check_range(63, 1)


@pytest.mark.parametrize(("slba", "nlb", "shown"),
                         [(-1, 1, "-1..-1"), (0, 65, "0..64"), (63, 2, "63..64"),
                          (64, 1, "64..64")])
def test_check_range_message(slba, nlb, shown):
    with pytest.raises(InvalidArgument,
                       match=rf"^LBA range {shown} is outside namespace 1 \(LBAs 0\.\.63\)$"):
        namespace(nlb=64).check_range(slba, nlb)


@pytest.mark.parametrize("nlb", [0, -3])
def test_check_range_needs_an_lba(nlb):
    with pytest.raises(InvalidArgument, match=rf"^an I/O needs at least one LBA, got {nlb}$"):
        namespace(nlb=64).check_range(5, nlb)


def test_repr():
    assert repr(namespace(nlb=64)) == "<Namespace 1: 64 x 512 B>"


# --- bounce-buffered I/O --------------------------------------------------------------------------


def test_read_lbas_splits_and_returns_disk_contents():
    ns = namespace(max_transfer=2048)
    disk = ns.controller.disk

    data = trio.run(ns.read_lbas, 3, 13)
    assert data == bytes(disk[3 * 512:16 * 512])
    assert sorted(ns.controller.commands) == [(OPC_READ, 3, 4), (OPC_READ, 7, 4),
                                              (OPC_READ, 11, 4), (OPC_READ, 15, 1)]


def test_lend_lbas_hands_out_the_bounce_buffer_and_gives_it_back():
    ns = namespace(max_transfer=2048, buffers=2)
    disk = ns.controller.disk
    pool = ns.controller.bounce

    async def main():
        lent = await ns.lend_lbas(5, 4)
        assert lent == disk[5 * 512:9 * 512]
        assert lent.obj is pool._all[0].view.obj or lent.obj is pool._all[1].view.obj
        assert pool.available == 2
        longer = await ns.lend_lbas(1, 9)  # two commands: gathered into memory of its own
        assert longer == disk[512:10 * 512] and pool.available == 2
        assert all(longer.obj is not r.view.obj for r in pool._all)

    trio.run(main)


def test_lend_lbas_gives_the_buffer_back_whatever_became_of_its_command():
    """The controller's io_command ends only once the target can no longer reach the
    buffer, also when it failed with the connection."""
    ns = namespace(max_transfer=2048, buffers=2)
    for error in (CommandTimeout("I/O queue 1: command 3 got no completion"),
                  TransportError("I/O queue 1: stopped"), InvalidArgument("any other error")):
        ns.controller.fail = error
        with pytest.raises(type(error)):
            trio.run(ns.lend_lbas, 0, 4)
        assert ns.controller.bounce.available == 2


def test_bounced_io_waits_for_the_reconnect_before_it_takes_a_buffer():
    ns = namespace(max_transfer=2048, buffers=2)
    ctrl, pool = ns.controller, ns.controller.bounce
    reconnected = trio.Event()

    async def wait_live() -> None:
        await reconnected.wait()
        ctrl.live = True

    async def main():
        ctrl.live, ctrl.wait_live = False, wait_live
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ns.read_lbas, 0, 4)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.available == 2 and not ctrl.commands  # no buffer taken meanwhile
            reconnected.set()
        assert ctrl.commands == [(OPC_READ, 0, 4)] and pool.available == 2

    trio.run(main)


def test_write_then_read_round_trip_with_more_chunks_than_buffers():
    ns = namespace(nlb=64, max_transfer=1024, buffers=2)
    payload = random.Random(2).randbytes(40 * 512)
    before = bytes(ns.controller.disk)

    async def main():
        await ns.write_lbas(10, payload)
        return await ns.read_lbas(10, 40)

    assert trio.run(main) == payload
    disk = ns.controller.disk
    assert disk[:10 * 512] == before[:10 * 512] and disk[50 * 512:] == before[50 * 512:]
    writes = [c for c in ns.controller.commands if c[0] == OPC_WRITE]
    assert sorted(writes) == [(OPC_WRITE, lba, 2) for lba in range(10, 50, 2)]


def test_write_lbas_accepts_a_memoryview():
    ns = namespace()
    payload = bytearray(range(256)) * 4
    trio.run(ns.write_lbas, 0, memoryview(payload))
    assert ns.controller.disk[:1024] == payload


def test_write_lbas_needs_whole_lbas():
    with pytest.raises(InvalidArgument, match="write of 513 bytes is not a whole number of "
                                              "512-byte LBAs"):
        trio.run(namespace().write_lbas, 0, bytes(513))


def test_lba_io_checks_the_range_before_any_command():
    ns = namespace(nlb=64)
    with pytest.raises(InvalidArgument, match="LBA range 60..67"):
        trio.run(ns.read_lbas, 60, 8)
    with pytest.raises(InvalidArgument, match="LBA range 63..64"):
        trio.run(ns.write_lbas, 63, bytes(1024))
    assert ns.controller.commands == []


def test_command_error_surfaces_as_itself():
    ns = namespace(max_transfer=1024)
    ns.controller.fail = CommandTimeout("I/O queue 1: command 3 got no completion")
    with pytest.raises(CommandTimeout, match="command 3 got no completion"):
        trio.run(ns.read_lbas, 0, 8)


# --- zero-copy and byte-addressed I/O -------------------------------------------------------------


def test_read_into_and_write_from_registered_memory():
    ns = namespace(max_transfer=1024)
    region = host_buffer(fake_register, 8192)
    region.view[100:100 + 3 * 512] = b"\xab" * (3 * 512)

    async def main():
        await ns.write_from(20, 3, region.ref(100, 3 * 512))
        await ns.read_into(19, 5, region.ref(4096, 5 * 512))

    trio.run(main)
    assert ns.controller.disk[20 * 512:23 * 512] == b"\xab" * (3 * 512)
    assert region.view[4096:4096 + 5 * 512] == ns.controller.disk[19 * 512:24 * 512]


def test_transfer_length_must_match():
    ns = namespace()
    region = host_buffer(fake_register, 4096)
    with pytest.raises(InvalidArgument,
                       match="buffer of 1000 bytes does not hold 2 LBAs of 512 bytes"):
        trio.run(ns.read_into, 0, 2, region.ref(0, 1000))


def test_read_lent_matches_read_at_any_offset():
    ns = namespace(nlb=64, max_transfer=2048)
    disk = bytes(ns.controller.disk)
    rng = random.Random(5)

    async def main():
        for _ in range(50):
            offset = rng.randrange(len(disk) + 10)
            length = rng.randrange(3000)
            want = disk[offset:offset + length]
            assert await ns.read(offset, length) == want
            assert bytes(await ns.read_lent(offset, length)) == want

    trio.run(main)


def test_read_placed_lands_whole_lbas_in_place_and_puts_the_edges():
    """A companion client's read at any offset: the middle straight into its registered
    memory, each partial LBA's bytes handed to ``put``; one read in the statistics."""
    ns = namespace(nlb=64, max_transfer=1024)
    disk = bytes(ns.controller.disk)
    region = host_buffer(fake_register, 8192)

    async def main():
        for offset, length in ((700, 3000), (1024, 2048), (100, 50), (512, 700), (10, 502)):
            region.view[:] = bytes(8192)
            put: dict[int, bytes] = {}
            assert await ns.read_placed(offset, length, region.ref(64, length),
                                        lambda at, data, put=put: put.setdefault(at, bytes(data))
                                        ) == length
            got = bytearray(region.view[64:64 + length])
            for at, data in put.items():
                got[at:at + len(data)] = data
            assert got == disk[offset:offset + length], (offset, length)
            assert all(region.view[64 + at:64 + at + len(data)] == bytes(len(data))
                       for at, data in put.items())  # edges only through put

    trio.run(main)
    read = ns.stats.ops["read"]
    assert (read.ops, read.bytes, read.errors) == (5, 3000 + 2048 + 50 + 700 + 502, 0)


def test_byte_read_and_write_at_any_offset():
    ns = namespace(nlb=16, max_transfer=1024)

    async def main():
        assert await ns.write(700, b"hello, nvme") == 11
        return await ns.read(695, 20)

    expected = bytes(ns.controller.disk[695:700]) + b"hello, nvme"
    got = trio.run(main)
    assert got[:16] == expected and got[16:] == ns.controller.disk[711:715]


def test_flush_and_write_zeroes_commands():
    ns = namespace(nlb=3 * cmd.MAX_NLB)

    async def main():
        await ns.flush()
        await ns.write_zeroes(1, cmd.MAX_NLB + 2)

    trio.run(main)
    commands = ns.controller.commands
    assert commands[0] == (OPC_FLUSH, 0, 1)
    assert sorted(commands[1:]) == [(OPC_WRITE_ZEROES, 1, cmd.MAX_NLB),
                                    (OPC_WRITE_ZEROES, 1 + cmd.MAX_NLB, 2)]


# --- reads with a callback (start_read_lent) ---------------------------------------------


def test_start_read_lent_calls_back_with_the_bytes_and_gives_the_buffer_back():
    ns = namespace()
    pool = ns.controller.bounce
    got: list = []
    assert ns.start_read_lent(700, 1000, lambda data: got.append(bytes(data)))
    assert pool.available == 3 and not got  # taken until the target answered
    ns.controller.end_started()
    assert got == [bytes(ns.controller.disk[700:1700])]
    assert pool.available == 4
    assert ns.stats.snapshot()["ops"]["read"]["bytes"] == 1000
    assert ns.stats.counters == {"callback_reads": 1}


def test_start_read_lent_stops_at_the_end_of_the_namespace():
    ns = namespace(nlb=8)
    got: list = []
    assert ns.start_read_lent(4000, 4096, lambda data: got.append(bytes(data)))
    ns.controller.end_started()
    assert got == [bytes(ns.controller.disk[4000:4096])]


def test_a_failed_started_read_says_none_and_holds_its_buffer_until_the_teardown():
    ns = namespace()
    pool = ns.controller.bounce
    got: list = []
    assert ns.start_read_lent(0, 512, got.append)
    lost = TransportError("I/O queue 1: stopped")
    ns.controller.end_started(error=lost)
    assert got == [None] and pool.available == 3 and pool.counts()["held"] == 1
    assert ns.controller.failed_on == [("queue", lost)]  # the loss is known at once
    pool.reclaim()  # the queues are torn down: the buffer is safe again
    assert pool.available == 4 and pool.counts()["held"] == 0
    assert ns.start_read_lent(0, 512, got.append)
    ns.controller.end_started(status=0x281)  # an error status: the buffer is safe at once
    assert got == [None, None] and pool.available == 4
    # nothing counted: read_lent, run again, counts the read
    assert "read" not in ns.stats.snapshot()["ops"] and not ns.stats.counters


@pytest.mark.parametrize("offset, length, why", [
    (0, 4096, "two commands"), (32768, 512, "at the end"), (-512, 512, "negative"),
    (0, 0, "empty")])
def test_start_read_lent_sends_nothing_for_reads_one_command_does_not_cover(offset, length, why):
    ns = namespace()
    assert not ns.start_read_lent(offset, length, lambda data: None), why
    assert not ns.controller.started and ns.controller.bounce.available == 4


def test_start_read_lent_sends_nothing_without_a_free_buffer_or_a_queue_to_take_it():
    ns = namespace(buffers=1)
    assert ns.start_read_lent(0, 512, lambda data: None)
    assert not ns.start_read_lent(512, 512, lambda data: None)  # the one buffer is taken
    ns.controller.end_started()
    ns.controller.take_started = False
    assert not ns.start_read_lent(512, 512, lambda data: None)
    assert ns.controller.bounce.available == 1  # given back


# --- writes with a callback (start_write) ---------------------------------------------


def test_start_write_copies_at_once_and_holds_its_lbas_until_the_target_has_them():
    ns = namespace()
    pool, lock = ns.controller.bounce, ns.write_lock
    data = bytearray(b"\x5a" * 1024)
    ends: list = []
    assert ns.start_write(1024, memoryview(data), ends.append)
    data[:] = bytes(1024)  # copied already: the caller may reuse its buffer
    assert pool.available == 3 and len(lock) == 1
    assert lock.try_acquire([(2, 3, True)]) is None  # a read-modify-write of LBA 2 waits
    ns.controller.end_started()
    assert ends == [True] and pool.available == 4 and len(lock) == 0
    assert bytes(ns.controller.disk[1024:2048]) == b"\x5a" * 1024
    assert ns.stats.snapshot()["ops"]["write"]["bytes"] == 1024
    assert ns.stats.counters == {"callback_writes": 1}


def test_a_failed_started_write_says_false_and_lets_its_lock_go():
    ns = namespace()
    ends: list = []
    assert ns.start_write(0, memoryview(bytes(512)), ends.append)
    ns.controller.end_started(error=TransportError("I/O queue 1: stopped"))
    assert ends == [False] and len(ns.write_lock) == 0
    pool = ns.controller.bounce
    assert pool.available == 3 and pool.counts()["held"] == 1  # the target may still read it
    pool.reclaim()
    assert pool.available == 4


@pytest.mark.parametrize("offset, length, why", [
    (100, 512, "unaligned"), (0, 700, "a partial LBA"), (0, 4096, "two commands"),
    (32256, 1024, "past the end"), (0, 0, "empty")])
def test_start_write_sends_nothing_for_writes_one_whole_command_does_not_cover(offset, length,
                                                                               why):
    ns = namespace()
    assert not ns.start_write(offset, memoryview(bytes(length)), lambda landed: None), why
    assert not ns.controller.started and len(ns.write_lock) == 0


def test_start_write_sends_nothing_while_its_lbas_are_locked_or_refused():
    ns = namespace()
    held = ns.write_lock.try_acquire([(1, 2, True)])  # a read-modify-write of LBA 1
    assert not ns.start_write(512, memoryview(bytes(512)), lambda landed: None)
    ns.write_lock.release(held)
    ns.controller.take_started = False
    assert not ns.start_write(512, memoryview(bytes(512)), lambda landed: None)
    assert len(ns.write_lock) == 0 and ns.controller.bounce.available == 4


# --- Identify values we cannot serve ----------------------------------------------------------


def test_a_namespace_we_cannot_serve_is_unavailable_with_no_lbas_until_it_is_fixed():
    from nvmeof_fuse.errors import NamespaceUnavailable

    bad = SimpleNamespace(lba_size=1 << 63, nsze=2**64 - 1,
                          unusable="its LBA size 2^63 bytes (LBADS 63) is outside 512 B to 64 KiB")
    controller = FakeController(512, 64, 2048, 4)
    ns = Namespace(controller, 1, bad)
    assert ns.unavailable == bad.unusable and (ns.size, ns.nlb, ns.lba_size) == (0, 0, 512)
    with pytest.raises(NamespaceUnavailable, match="namespace n1 is unavailable: its LBA size"):
        ns.check_range(0, 1)
    with pytest.raises(NamespaceUnavailable):
        trio.run(ns.read_lbas, 0, 1)
    # no LBAs, so the started (callback) paths send nothing either
    assert not ns.start_read_lent(0, 512, lambda view: None)
    assert not ns.start_write(0, memoryview(bytes(512)), lambda landed: None)
    assert controller.bounce.available == 4
    assert ns.resize(SimpleNamespace(lba_size=512, nsze=64, unusable="")) == 0
    assert not ns.unavailable and ns.size == 64 * 512
    assert trio.run(ns.read_lbas, 0, 1) == controller.disk[:512]


def test_a_removed_namespace_stays_removed_whatever_identify_says_next():
    from nvmeof_fuse.errors import NamespaceRemoved

    controller = FakeController(512, 64, 2048, 4)
    ns = Namespace(controller, 1, SimpleNamespace(lba_size=512, nsze=64, unusable=""))
    ns.remove("namespace n1 was removed from nqn")
    assert ns.removed
    ns.resize(SimpleNamespace(lba_size=512, nsze=128, unusable=""))
    for io in (lambda: ns.read_lbas(0, 1), ns.flush):
        with pytest.raises(NamespaceRemoved, match="n1 was removed"):
            trio.run(io)
    assert not ns.start_read_lent(0, 512, lambda view: None)
    assert controller.bounce.available == 4


# --- the I/O stack built at first use, and what was written since the last flush ----------


def test_a_namespace_builds_no_io_until_its_first_use_and_reports_build_none():
    ns = namespace()
    assert ns.io_stats is None and not ns.written and ns.size == 64 * 512
    ns.resize(SimpleNamespace(lba_size=512, nsze=128))
    ns.remove("namespace n1 was removed from nqn")
    assert ns.io_stats is None  # neither a resize nor a removal builds it
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        ns.nothing  # noqa: B018 (only the I/O stack is built on demand)
    ns = namespace()
    assert trio.run(ns.read, 0, 512) == ns.controller.disk[:512]
    assert ns.io_stats is ns.stats and ns.stats.snapshot()["ops"]["read"]["ops"] == 1


def test_a_namespace_built_after_a_resize_or_removal_has_its_size_and_refusal():
    from nvmeof_fuse.errors import NamespaceRemoved

    ns = namespace()
    ns.resize(SimpleNamespace(lba_size=512, nsze=32))
    assert ns.lbas.nlb == 32 and ns.lbas.refusal is None
    ns = namespace()
    ns.remove("namespace n1 was removed from nqn")
    with pytest.raises(NamespaceRemoved):
        trio.run(ns.read_lbas, 0, 1)


@pytest.mark.parametrize("write", [
    lambda ns: ns.write(100, b"x" * 1000),  # read-modify-write edges and an aligned middle
    lambda ns: ns.write(512, b"x" * 512),  # aligned: one command under the shared lock
    lambda ns: ns.write_lbas(2, b"x" * 512),  # no lock: the namespace marks it
    lambda ns: ns.write_zeroes(0, 4),
])
def test_each_kind_of_write_marks_the_namespace_written_and_a_flush_clears_it(write):
    ns = namespace()

    async def main():
        await ns.read(0, 4096)
        assert not ns.written  # reads do not count
        await write(ns)
        assert ns.written
        await ns.flush()
        assert not ns.written

    trio.run(main)


def test_a_started_write_marks_the_namespace_when_its_lock_is_let_go():
    ns = namespace()
    assert ns.start_write(1024, memoryview(bytearray(512)), lambda ok: None)
    ns.controller.end_started()
    assert ns.written


def test_a_writer_of_another_process_under_the_range_lock_marks_it_when_it_lets_go():
    """A FUSE worker's or companion client's write holds the namespace's range lock while it
    moves its data on queues of its own."""
    ns = namespace()

    async def main():
        async with ns.write_locked(0, 4096):
            await ns.flush()  # a flush while the other process writes
        assert ns.written  # its write ended after the flush went out

    trio.run(main)


def test_a_write_that_ends_while_the_flush_is_in_flight_keeps_the_namespace_written():
    ns = namespace()
    controller = ns.controller
    plain = controller.io_command
    flushing = trio.Event()
    wrote = trio.Event()

    async def io_command(sqe, data=None, *, to_controller=False):
        if sqe[0] == OPC_FLUSH:
            flushing.set()
            await wrote.wait()  # the write lands after the Flush went out
        return await plain(sqe, data, to_controller=to_controller)

    controller.io_command = io_command

    async def main():
        await ns.write(0, b"y" * 512)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ns.flush)
            await flushing.wait()
            await ns.write(512, b"z" * 512)
            wrote.set()
        assert ns.written

    trio.run(main)


def test_a_failed_flush_leaves_the_namespace_written():
    ns = namespace()
    trio.run(ns.write, 0, b"x" * 512)
    ns.controller.fail = TransportError("gone")
    with pytest.raises(TransportError):
        trio.run(ns.flush)
    assert ns.written


def test_with_the_mounts_shared_ranges_a_write_in_another_process_marks_it_written():
    """A namespace another process of the mount wrote counts as written here (built or not:
    the final flush flushes it); its flush clears that for every process, and a failed
    flush sets it again."""
    from nvmeof_fuse.host.namespace.sharedranges import SharedRanges, share_range_locks

    ns = namespace()
    ranges = SharedRanges.create(5.0)
    other = SharedRanges(os.open(f"/proc/self/fd/{ranges.fd}", os.O_RDWR), 5.0)
    try:
        ns.controller.namespaces = {1: ns}
        share_range_locks(ns.controller, ranges)
        assert not ns.written
        other.mark_written(1)  # a worker's write of n1 ended
        assert ns.written and ns.io_stats is None
        trio.run(ns.flush)
        assert not ns.written and not other.written(1)
        trio.run(ns.write, 100, b"x" * 10)  # built after sharing: takes the shared locks
        assert ns.write_lock.shared is not None and other.written(1)
    finally:
        other.close()
        ranges.close()
