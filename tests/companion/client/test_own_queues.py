"""A File on queues of its own (companion/direct.py), over a fake fabric on the fake disks."""

from __future__ import annotations

import concurrent.futures
import errno
import gc
import logging
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import trio
from companion_fakes import FakeFabric, LeasingController, serving, wait_for

import nvmeof_fuse
from nvmeof_fuse.companion.client import locked_writes
from nvmeof_fuse.companion.client import own_queues as direct
from nvmeof_fuse.companion.client.channel import SocketChannel
from nvmeof_fuse.companion.client.file import QUEUES_PER_CLIENT, File
from nvmeof_fuse.companion.protocol import CompanionError
from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.host.multipath.nearest import MemoryPlace
from nvmeof_fuse.host.namespace.byterange import NoSpace

OPC_WRITE, OPC_READ = 0x01, 0x02
OWN = tuple(range(3, 3 + QUEUES_PER_CLIENT))  # the queue IDs a File leases here


@pytest.fixture
def served(tmp_path, monkeypatch):
    ctrl = LeasingController(companion_queues=4)
    fabric = FakeFabric(ctrl)
    monkeypatch.setattr(direct, "make_transport", fabric)
    with serving(ctrl, tmp_path) as (server, mnt):
        yield ctrl, fabric, server, mnt


@pytest.mark.parametrize("kind", ["empty", "numpy"])
@pytest.mark.parametrize("nsid", [1, 2])
def test_reads_and_writes_go_over_the_files_own_queues(served, kind, nsid):
    ctrl, fabric, server, mnt = served
    make = nvmeof_fuse.empty if kind == "empty" else (lambda n: np.zeros(n, dtype=np.uint8))
    size, offset = 100_000, 12_345  # unaligned at both ends for both LBA sizes
    data = make(size)
    data[:] = np.random.default_rng(nsid).integers(0, 256, size, dtype=np.uint8)
    with File(str(mnt / f"n{nsid}")) as f:
        assert f.own_queues == OWN
        assert f.write(data, file_offset=offset) == size
        out = make(size)
        assert f.read(out, file_offset=offset) == size
        stats = f.stats()
    assert bytes(out) == bytes(data) == bytes(ctrl.disks[nsid][offset:offset + size])
    assert sorted(fabric.connects) == list(OWN)
    assert {qid for _, qid in fabric.commands} <= set(OWN)  # no command on the daemon's queues
    assert stats["client_queue_read_bytes"] == stats["client_queue_write_bytes"] == size
    for counter in ("direct_read_bytes", "direct_write_bytes", "staged_read_bytes",
                    "staged_write_bytes", "daemon_copied_bytes"):
        assert stats[counter] == 0, counter
    assert stats["sessions"][0]["qids"] == list(OWN)


def test_sixteen_futures_from_one_thread_and_a_batch(served):
    ctrl, fabric, server, mnt = served
    bufs = nvmeof_fuse.empty((16, 4096))
    with File(str(mnt / "n2")) as f:
        futures = [f.pread(bufs[i], 4096, file_offset=i * 8192) for i in range(16)]
        assert [fut.get(10) for fut in futures] == [4096] * 16
        sizes = f.read_batch([(bufs[i], 4096, (i + 1) * 4096) for i in range(16)])
    assert sizes == [4096] * 16
    for i in range(16):
        at = (i + 1) * 4096
        assert bytes(bufs[i]) == bytes(ctrl.disks[2][at:at + 4096])


def test_a_lost_queue_renews_the_lease_and_the_request_completes(served, monkeypatch):
    ctrl, fabric, server, mnt = served
    asked, lease = [], server.lease

    async def leasing(session, want, role=None, nsids=None, **wish):
        asked.append((nsids, wish))
        return await lease(session, want, role=role, nsids=nsids, **wish)

    monkeypatch.setattr(server, "lease", leasing)
    out = nvmeof_fuse.empty(8192)
    with File(str(mnt / "n2")) as f:
        fabric.fail_next = 1
        assert f.read(out, file_offset=4096) == 8192
    assert bytes(out) == bytes(ctrl.disks[2][4096:4096 + 8192])
    assert fabric.connects.count(3) == 2  # connected again after the loss
    # the renewal, too, names the file's namespace alone, and says where its memory is
    assert [nsids for nsids, _ in asked] == [[2], [2]] and asked[0][1] == asked[1][1]


def test_a_qid_still_held_on_the_target_is_tried_again(served, monkeypatch):
    ctrl, fabric, server, mnt = served
    monkeypatch.setattr("nvmeof_fuse.host.attached.QID_BUSY_DELAY", 0.01)
    fabric.connect_status = [0x0C]  # Command Sequence Error: the QID's old queue lingers
    with File(str(mnt / "n1")) as f:
        assert f.own_queues == OWN
    assert fabric.connects[:3] == [3, 3, 4]


def test_when_every_queue_is_leased_the_file_uses_the_daemons_and_says_so(
        tmp_path, monkeypatch, caplog):
    ctrl = LeasingController(companion_queues=2)
    monkeypatch.setattr(direct, "make_transport", FakeFabric(ctrl))
    with serving(ctrl, tmp_path) as (server, mnt):
        arr = nvmeof_fuse.empty(4096)
        with File(str(mnt / "n1")) as first, caplog.at_level(logging.WARNING):
            assert first.own_queues == (3, 4)
            with File(str(mnt / "n1")) as second:
                assert second.own_queues == ()
                assert second.read(arr, file_offset=0) == 4096
            with File(str(mnt / "n1")) as third:  # said once, not again
                assert third.own_queues == ()
        said = [r.getMessage() for r in caplog.records if "companion queues" in r.getMessage()]
        assert said == ["nvmeof_fuse: all 2 companion queues of this mount are leased "
                        "(--companion-queues); moving data over the mount daemon's queues "
                        "instead (slower; counted as direct_* or staged_*)"]
        assert bytes(arr) == bytes(ctrl.disks[1][:4096])
        assert server.snapshot()["direct_read_bytes"] == 4096


def test_bad_input_is_one_line(served):
    ctrl, fabric, server, mnt = served
    arr = nvmeof_fuse.empty(4096)
    f = File(str(mnt / "n2"))
    with pytest.raises(InvalidArgument, match=r"^size 8192 at buf_offset 0 overruns the "
                                              r"4096-byte buffer$"):
        f.read(arr, 8192)
    with pytest.raises(NoSpace, match=r"extends past the end of .*n2 \(2097152 bytes\)"):
        f.write(arr, file_offset=(2 << 20) - 100)
    assert f.read(arr, file_offset=2 << 20) == 0  # at the end: nothing, like pread
    f.close()
    with pytest.raises(CompanionError) as closed:
        f.pread(arr)
    assert str(closed.value) == f"{mnt / 'n2'} is closed" and closed.value.errno == errno.EBADF


def test_a_cuda_tensor_is_registered_as_a_dmabuf_in_the_clients_own_pd(served, cuda):
    """Once per allocation, in the tensor's own context, from threads that never touched
    CUDA; released when the file closes."""
    ctrl, fabric, server, mnt = served
    tensor = cuda.tensor(3 * 4096, device=1)
    tensor.bytes[:] = 7
    device1 = cuda.contexts[1]
    with File(str(mnt / "n2")) as f, concurrent.futures.ThreadPoolExecutor(1) as fresh:
        assert fresh.submit(f.write, tensor, file_offset=1000).result(30) == tensor.nbytes
        assert cuda.calls[:2] == [("export", device1), ("synchronize", device1)]
        tensor.bytes[:] = 0
        for _ in range(20):
            assert fresh.submit(f.read, tensor, file_offset=1000).result(30) == tensor.nbytes
        assert cuda.calls[-1] == ("flush", device1)  # target writes visible before return
        assert "to_device" in cuda.names()  # the partial LBAs, put from the caller's thread
        assert len(ctrl.transport.dmabufs) == 1
        stats = f.stats()
    assert cuda.names().count("export") == 1
    assert stats["file"]["dmabuf_registered"] == 1 and stats["file"]["dmabuf_hits"] == 20
    assert bytes(tensor.bytes) == bytes([7]) * tensor.nbytes
    assert bytes(ctrl.disks[2][1000:1000 + tensor.nbytes]) == bytes([7]) * tensor.nbytes
    assert stats["client_queue_read_bytes"] == 20 * tensor.nbytes
    assert stats["staged_read_bytes"] == stats["direct_read_bytes"] == 0
    assert stats["errors"] == 0
    assert wait_for(lambda: not ctrl.transport.dmabufs)  # let go with the file


def test_memory_is_registered_once_per_owning_array_and_let_go_with_it(served):
    ctrl, fabric, server, mnt = served
    arr = np.zeros(1 << 20, dtype=np.uint8)
    with File(str(mnt / "n1")) as f:
        live = ctrl.transport.live  # the file's own buffers
        for i in range(4):  # views of one array share one registration
            assert f.read(arr[i * 4096:(i + 1) * 4096], file_offset=i * 512) == 4096
        assert ctrl.transport.live == live + 1
        del arr  # freed: its registration goes with it, never to serve another allocation
        assert wait_for(lambda: ctrl.transport.live == live)
        buf = bytearray(5000)  # no owner to watch: registered for the one call
        assert f.read(buf, file_offset=100) == 5000
        assert ctrl.transport.live == live
    assert bytes(buf) == bytes(ctrl.disks[1][100:5100])


def test_an_array_registered_by_its_identity_cannot_move_under_its_registration(served):
    """Registrations are kept per owning array, by identity, and watched with a weakref.

    Only ndarray.resize could move a live array's memory, and numpy refuses it for an
    array that has weak references: this fails loudly if numpy ever allows it."""
    ctrl, fabric, server, mnt = served
    arr = np.zeros(1 << 16, dtype=np.uint8)
    with File(str(mnt / "n1")) as f:
        assert f.read(arr, 4096, file_offset=0) == 4096
        with pytest.raises(ValueError, match="referenced"):
            arr.resize(1 << 24, refcheck=False)


def test_a_lost_controller_revokes_the_clients_queues_at_once(served):
    """Without a keep-alive of its own, a client learns of the loss from the daemon."""
    ctrl, fabric, server, mnt = served
    out = nvmeof_fuse.empty(4096)
    with File(str(mnt / "n1")) as f:
        assert fabric.connects == list(OWN)

        def lose() -> None:
            ctrl.state = "connecting"
            ctrl.state_changed.set()

        trio.from_thread.run_sync(lose, trio_token=server.trio_token)
        # asked again, connected again
        assert wait_for(lambda: fabric.connects == [*OWN, *OWN])
        assert f.read(out, file_offset=512) == 4096
    assert bytes(out) == bytes(ctrl.disks[1][512:512 + 4096])


def test_one_loss_is_told_once_however_many_states_it_passes(served):
    ctrl, fabric, server, mnt = served
    told: list[str] = []
    with File(str(mnt / "n1")) as f:
        session = next(s for s in server.sessions if s.qids)
        notify = session.notify

        async def counting(event: dict) -> None:
            told.append(event["state"])
            await notify(event)

        def move(state: str) -> None:
            ctrl.state = state
            ctrl.state_changed.set()

        session.notify = counting
        for state in ("resetting", "connecting"):  # one loss, two states
            trio.from_thread.run_sync(move, state, trio_token=server.trio_token)
            assert wait_for(lambda: not ctrl.state_changed.is_set())  # the server looked
        assert wait_for(lambda: fabric.connects == [*OWN, *OWN])
        trio.from_thread.run_sync(move, "live", trio_token=server.trio_token)
        assert wait_for(lambda: not ctrl.state_changed.is_set())
        trio.from_thread.run_sync(move, "connecting", trio_token=server.trio_token)  # a new loss
        assert wait_for(lambda: len(told) == 2)
        out = nvmeof_fuse.empty(4096)
        assert f.read(out, file_offset=0) == 4096
    assert told == ["resetting", "connecting"]


def test_a_pwrite_keeps_the_callers_buffer_until_the_write_is_done(served):
    """The caller may drop its buffer once pwrite returned: the NIC must not read freed
    memory through a registration its finalizer already closed."""
    ctrl, fabric, server, mnt = served
    alive: list[bool] = []
    with File(str(mnt / "n2")) as f:
        buf = np.full(8192, 7, dtype=np.uint8)
        watched = weakref.ref(buf)
        ctrl.on_command = lambda opcode: (alive.append(watched() is not None)
                                          if opcode == OPC_WRITE else None)
        future = f.pwrite(buf, file_offset=4096)
        del buf
        assert future.get(10) == 8192
    assert alive and all(alive)
    assert bytes(ctrl.disks[2][4096:4096 + 8192]) == bytes([7]) * 8192
    assert watched() is None  # and let go once written


def test_a_file_dropped_unclosed_gives_its_queues_back(served):
    ctrl, fabric, server, mnt = served
    f = File(str(mnt / "n1"))
    assert f.read(np.zeros(4096, dtype=np.uint8)) == 4096
    assert server.snapshot()["leases"] == 1
    del f
    gc.collect()
    assert wait_for(lambda: server.snapshot()["clients"] == 0, 30)
    assert server.snapshot()["leases"] == 0
    with File(str(mnt / "n1")) as g:  # the queues are free for the next client
        assert g.own_queues == OWN


def test_a_write_lock_not_granted_in_time_is_a_named_timeout_and_given_back_later(served):
    """A lock the daemon grants after the client gave up must not hold the range."""
    ctrl, fabric, server, mnt = served
    ns = ctrl.namespaces[2]

    released = threading.Event()

    async def hold_the_range() -> None:  # a FUSE write, say, on the daemon's loop
        async with ns.write_locked(1, 10):  # a partial LBA: held exclusively
            await trio.sleep(6.0)  # far past the file's timeout, however loaded the host
        released.set()

    data = nvmeof_fuse.empty(4096)
    data[:] = 9
    with File(str(mnt / "n2"), timeout=2.0) as f:
        trio.from_thread.run_sync(trio.lowlevel.spawn_system_task, hold_the_range,
                                  trio_token=server.trio_token)
        with pytest.raises(CompanionError, match=r"did not answer lock within") as exc:
            f.write(data, file_offset=0)
        assert exc.value.errno == errno.ETIMEDOUT
        assert released.wait(30)  # now the daemon grants the lock nobody waits for
        assert wait_for(lambda: not any(s.write_locks for s in server.sessions), 30)
        assert f.write(data, file_offset=0) == 4096  # the late grant was given back
    assert bytes(ctrl.disks[2][:4096]) == bytes([9]) * 4096


def test_threads_reading_into_one_new_array_register_it_once(served):
    ctrl, fabric, server, mnt = served
    plain_register = ctrl.transport.register

    def slow_register(addr, length, owner):  # as ibv_reg_mr is: the GIL released meanwhile
        time.sleep(0.05)
        return plain_register(addr, length, owner)

    with File(str(mnt / "n1")) as f:
        live = ctrl.transport.live
        ctrl.transport.register = slow_register
        arr = np.zeros(4 * 4096, dtype=np.uint8)
        start = threading.Barrier(4)

        def read(view: np.ndarray, file_offset: int) -> None:
            start.wait()
            f.read(view, file_offset=file_offset)

        threads = [threading.Thread(target=read, args=(arr[i * 4096:(i + 1) * 4096], i * 4096))
                   for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert ctrl.transport.live == live + 1
        assert bytes(arr) == bytes(ctrl.disks[1][:4 * 4096])
        del arr  # and no registration outlives it
        assert wait_for(lambda: ctrl.transport.live == live)


def test_numpy_integer_sizes_and_offsets_on_the_files_own_queues(served):
    """Neither the transfer nor the byte counts it reports (JSON) may choke on them."""
    ctrl, fabric, server, mnt = served
    arr = nvmeof_fuse.empty(8192)
    with File(str(mnt / "n2")) as f:
        assert f.read(arr, np.int64(4096), file_offset=np.int64(4096)) == 4096
        assert f.read_batch([(arr, np.int64(4096), np.uint32(8192))]) == [4096]
        assert f.write(arr, np.int64(100), file_offset=np.int64(12)) == 100
        assert f.stats()["client_queue_read_bytes"] == 8192
    assert bytes(arr[:4096]) == bytes(ctrl.disks[2][8192:12288])


class CpuTensor:
    """What buffer_address reads of a torch CPU tensor, over a numpy array."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.zeros(nbytes, dtype=np.uint8)

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return self.array.__array_interface__["data"][0]

    def numel(self) -> int:
        return self.array.size

    def element_size(self) -> int:
        return 1


def test_a_cpu_tensor_is_read_into_part_by_part(served):
    """Its registration covers the tensor, not the part the first transfer used."""
    ctrl, fabric, server, mnt = served
    tensor = CpuTensor(3 * 4096)
    with File(str(mnt / "n2")) as f:
        for part in range(3):
            at = part * 4096
            assert f.read(tensor, 4096, file_offset=at, buf_offset=at) == 4096
    assert bytes(tensor.array) == bytes(ctrl.disks[2][:3 * 4096])


def test_a_write_from_read_only_memory_goes_out_on_the_files_own_queues(served):
    ctrl, fabric, server, mnt = served
    data = bytes(range(256)) * 32
    with File(str(mnt / "n2")) as f:
        assert f.write(data, file_offset=4096) == 8192
        assert f.stats()["client_queue_write_bytes"] == 8192
    assert bytes(ctrl.disks[2][4096:4096 + 8192]) == data


def test_writes_under_a_delegation_ask_the_daemon_once_and_a_recall_is_answered(
        served, monkeypatch):
    ctrl, fabric, server, mnt = served
    asked = _count_lock_asks(server, monkeypatch)
    ns = ctrl.namespaces[2]
    bufs = nvmeof_fuse.empty((16, 10_000))
    for i in range(16):
        bufs[i][:] = i + 1
    fuse_written = threading.Event()

    async def fuse_write() -> None:  # a FUSE write of another range, on the daemon's loop
        await ns.write(5, b"FUS")
        fuse_written.set()

    with File(str(mnt / "n2")) as f:
        for i in range(8):  # unaligned: the client read-modify-writes the end LBAs itself
            assert f.write(bufs[i], file_offset=100 + i * 10_000) == 10_000
        assert asked == [True]  # one request to the daemon: the delegation
        futures = [f.pwrite(bufs[i], 10_000, 100 + i * 10_000) for i in range(16)]
        trio.from_thread.run_sync(trio.lowlevel.spawn_system_task, fuse_write,
                                  trio_token=server.trio_token)
        assert [fut.get(10) for fut in futures] == [10_000] * 16
        assert fuse_written.wait(10)  # recalled, and handed back once its writes were done
        assert f.write(bufs[0], file_offset=100) == 10_000  # a range lock now
        assert asked[-1] is False  # not asked again right after a recall
        stats = f.stats()
    assert stats["delegations_granted"] == 1 and stats["delegations_recalled"] == 1
    assert stats["client_queue_write_bytes"] == 25 * 10_000
    disk = ctrl.disks[2]
    assert bytes(disk[5:8]) == b"FUS"
    for i in range(16):
        at = 100 + i * 10_000
        assert bytes(disk[at:at + 10_000]) == bytes(bufs[i]), i


def test_a_recall_heard_while_the_file_closes_starts_nothing_on_its_ended_loop(
        served, monkeypatch):
    """A recall reaches the loop as the File's tasks end (CI, 2026-12-06: handed back on a
    nursery closed meanwhile, it raised in a callback and trio's run ended in
    TrioInternalError).  The last task to end hears one; trio runs that callback before or
    after the File's loop resumes, at random: several closes try both orders."""
    ctrl, fabric, server, mnt = served

    async def reporting_then_recalled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            for nsid, held in list(self.writes.delegated.items()):
                self._channel.on_event({"event": "recall", "nsid": nsid,
                                        "token": held.token})

    monkeypatch.setattr(direct.DirectQueues, "_report_now_and_then", reporting_then_recalled)
    buf = nvmeof_fuse.empty(10_000)
    for round_ in range(6):
        buf[:] = round_
        with File(str(mnt / "n2")) as f:
            assert f.write(buf, file_offset=100) == 10_000
            assert f.stats()["delegations_granted"] == round_ + 1  # (the daemon's count)
        assert bytes(ctrl.disks[2][100:10_100]) == bytes(buf)


def _count_lock_asks(server, monkeypatch) -> list:
    asked: list = []
    lock = server.lock

    async def counted(*args, **kwargs):
        asked.append(kwargs.get("delegate"))
        return await lock(*args, **kwargs)

    monkeypatch.setattr(server, "lock", counted)
    return asked


def test_a_burst_of_writes_asks_for_the_delegation_once_and_recalls_nothing(
        served, monkeypatch):
    ctrl, fabric, server, mnt = served
    asked = _count_lock_asks(server, monkeypatch)
    bufs = nvmeof_fuse.empty((16, 10_000))
    with File(str(mnt / "n2")) as f:
        futures = [f.pwrite(bufs[i], 10_000, 100 + i * 10_000) for i in range(16)]
        assert [fut.get(10) for fut in futures] == [10_000] * 16
        stats = f.stats()
    assert asked == [True]  # the others waited for its answer
    assert (stats["delegations_granted"], stats["delegations_recalled"]) == (1, 0)


def test_a_refused_delegation_is_not_asked_for_again_by_each_write(served, monkeypatch):
    ctrl, fabric, server, mnt = served
    asked = _count_lock_asks(server, monkeypatch)
    server.delegations.files_open = lambda nsid: True  # FUSE has the file open
    bufs = nvmeof_fuse.empty((16, 10_000))
    with File(str(mnt / "n2")) as f:
        futures = [f.pwrite(bufs[i], 10_000, 100 + i * 10_000) for i in range(16)]
        assert [fut.get(10) for fut in futures] == [10_000] * 16
        assert f.write(bufs[0], file_offset=0) == 10_000
        stats = f.stats()
    assert asked == [True] + [False] * 16  # range locks, until the back-off runs out
    assert stats["delegations_granted"] == 0
    assert bytes(ctrl.disks[2][:10_000]) == bytes(bufs[0])


def test_a_recall_that_never_arrives_is_caught_by_the_renewal(served, monkeypatch):
    ctrl, fabric, server, mnt = served
    monkeypatch.setattr(direct, "REPORT_INTERVAL", 0.05)
    asked = _count_lock_asks(server, monkeypatch)
    ns = ctrl.namespaces[2]
    buf = nvmeof_fuse.empty(10_000)
    buf[:] = 7
    fuse_written = threading.Event()

    async def fuse_write() -> None:  # waits on the delegation, which recalls it
        await ns.write(5, b"FUS")
        fuse_written.set()

    with File(str(mnt / "n2")) as f:
        assert f.write(buf, file_offset=100) == 10_000  # delegated
        (session,) = server.sessions
        notify = session.notify

        async def lossy(event):  # the client never hears of the recall
            if event.get("event") != "recall":
                await notify(event)

        session.notify = lossy
        trio.from_thread.run_sync(trio.lowlevel.spawn_system_task, fuse_write,
                                  trio_token=server.trio_token)
        assert fuse_written.wait(10)  # a report's reply no longer listed it: handed back
        assert f.write(buf, file_offset=20_000) == 10_000
        stats = f.stats()
    assert asked == [True, False]  # the second under a range lock: not ours any more
    assert (stats["delegations_granted"], stats["delegations_recalled"]) == (1, 1)
    assert bytes(ctrl.disks[2][5:8]) == b"FUS"
    assert bytes(ctrl.disks[2][20_000:30_000]) == bytes(buf)


def test_a_delegation_whose_term_ran_out_is_confirmed_before_the_next_write(
        served, monkeypatch):
    ctrl, fabric, server, mnt = served
    monkeypatch.setattr(locked_writes, "DELEGATION_TERM", 0.2)
    monkeypatch.setattr(direct, "REPORT_INTERVAL", 3600.0)  # no renewals
    asked = _count_lock_asks(server, monkeypatch)
    buf = nvmeof_fuse.empty(10_000)
    with File(str(mnt / "n2")) as f:
        assert f.write(buf, file_offset=0) == 10_000
        assert f.write(buf, file_offset=10_000) == 10_000  # within its term: not asked
        time.sleep(0.3)
        assert f.write(buf, file_offset=20_000) == 10_000
        stats = f.stats()
    assert asked == [True, True]  # the second ask confirmed the same delegation
    assert (stats["delegations_granted"], stats["delegations_recalled"]) == (1, 0)


def test_while_its_queues_wait_for_a_lease_reads_go_through_the_daemon(served, monkeypatch):
    """A multipath mount's lost path: the client's queues wait for a lease again, and reads
    meanwhile take the daemon's paths rather than wait (writes wait: a delegation of ours
    may cover them)."""
    ctrl, fabric, server, mnt = served
    out = np.zeros(8192, dtype=np.uint8)
    with File(str(mnt / "n1")) as f:
        monkeypatch.setattr(direct.DirectQueues, "live", property(lambda self: False))
        before = len(fabric.commands)
        assert f.read(out, file_offset=4096) == 8192
        assert f.read_batch([(out, 4096, 0)]) == [4096]
        assert len(fabric.commands) == before  # none on the client's own queues
        assert f.stats()["staged_read_bytes"] == 8192 + 4096
    assert bytes(out[:4096]) == bytes(ctrl.disks[1][:4096])


def test_a_file_opens_and_moves_data_on_a_mount_of_more_namespaces_than_a_reply_names(
        tmp_path, monkeypatch):
    """Its hello and lease name its own namespace alone: all 5000 would not fit a message."""
    ctrl = LeasingController(companion_queues=4,
                             specs=[(n, 512, 8) for n in range(1, 5001)])
    fabric = FakeFabric(ctrl)
    monkeypatch.setattr(direct, "make_transport", fabric)
    with serving(ctrl, tmp_path) as (server, mnt):
        assert server.hello()["namespaces"] == {}  # asking for all: too many
        with File(str(mnt / "n4321")) as f:
            assert f.own_queues == OWN and f.nbytes == 8 * 512
            assert list(f._direct._bridge.controller.namespaces) == [4321]  # as leased
            data = np.arange(1000, dtype=np.uint8)
            assert f.write(data, file_offset=100) == 1000
            out = np.zeros(1000, dtype=np.uint8)
            assert f.read(out, file_offset=100) == 1000
    assert bytes(out) == bytes(data) == bytes(ctrl.disks[4321][100:1100])
    assert {qid for _, qid in fabric.commands} <= set(OWN)


# -- the path nearest the file's memory (issue #59) ------------------------------------------

class NearController(LeasingController):
    """Leases as a multipath head does, on itself: records what each lease asked, names
    path ``index`` in its reply, and has a nearer path ``back`` when a test says so."""

    def __init__(self) -> None:
        super().__init__(companion_queues=4)
        self.wishes: list[tuple] = []
        self.index = 1
        self.back: SimpleNamespace | None = None
        self.changed = trio.Event()

    async def lease_controller(self, prefer=None, any_transport=False, *, near=None,
                               path=None, load=None):
        self.wishes.append((near, path))
        return self

    def nearness(self, ctrl, near):
        return {"index": self.index, "device": f"mlx5_{self.index}",
                "distance": "PIX" if near is not None else None,
                "memory": str(near) if near is not None else None}

    async def wait_changed(self) -> None:
        await self.changed.wait()
        self.changed = trio.Event()

    def nearer_path(self, ctrl, near=None, index=None):
        back, self.back = self.back, None
        return back


@pytest.fixture
def near_served(tmp_path, monkeypatch):
    ctrl = NearController()
    fabric = FakeFabric(ctrl)
    monkeypatch.setattr(direct, "make_transport", fabric)
    with serving(ctrl, tmp_path) as (server, mnt):
        yield ctrl, fabric, server, mnt


def test_a_file_leases_near_its_gpu_and_says_which_path(near_served, cuda):
    ctrl, fabric, server, mnt = near_served
    cuda.bus_ids = {1: "00000000:9A:00.0"}
    with File(str(mnt / "n1"), near="cuda:1") as f:
        assert ctrl.wishes == [(MemoryPlace(gpu="0000:9a:00.0"), None)]
        line = "direct via path 1 (mlx5_1, PIX to GPU 0000:9a:00.0)"
        assert f.placement["path"] == line
        assert wait_for(lambda: server.snapshot()["sessions"][0]["placement"].get("path")
                        == line)
    with File(str(mnt / "n1"), near=MemoryPlace(numa_node=0), path_index=0):
        assert ctrl.wishes[-1] == (MemoryPlace(numa_node=0), 0)


def test_a_file_whose_nearer_path_is_back_moves_there_and_says_so(near_served, cuda):
    ctrl, fabric, server, mnt = near_served
    out = nvmeof_fuse.empty(4096)
    with File(str(mnt / "n1"), near=0) as f:
        assert f.placement["path"].startswith("direct via path 1 (mlx5_1, PIX to GPU ")

        def nearer_back() -> None:
            ctrl.index, ctrl.back = 0, SimpleNamespace(name="path 0 (rdma 10.0.0.1:4420)")
            ctrl.changed.set()

        trio.from_thread.run_sync(nearer_back, trio_token=server.trio_token)
        assert wait_for(lambda: f.placement["path"].startswith("direct via path 0 (mlx5_0, "))
        assert ctrl.wishes[0] == ctrl.wishes[1]  # the lease again says where the memory is
        assert f.read(out, file_offset=512) == 4096
    assert bytes(out) == bytes(ctrl.disks[1][512:512 + 4096])


def test_stats_count_the_bytes_of_the_clients_own_queues_by_path(near_served, cuda):
    ctrl, fabric, server, mnt = near_served
    out = nvmeof_fuse.empty(8192)
    with File(str(mnt / "n1"), near=0) as f:
        assert f.read(out, size=4096) == 4096
        stats = f.stats()
        assert stats["client_queue_bytes_by_path"] == {
            "1": {"client_queue_read_bytes": 4096, "client_queue_write_bytes": 0}}
        assert stats["sessions"][0]["lease_path"] == 1

        def nearer_back() -> None:
            ctrl.index, ctrl.back = 0, SimpleNamespace(name="path 0 (rdma 10.0.0.1:4420)")
            ctrl.changed.set()

        trio.from_thread.run_sync(nearer_back, trio_token=server.trio_token)
        assert wait_for(lambda: f.placement["path"].startswith("direct via path 0 "))
        assert f.read(out) == 8192
        stats = f.stats()
        assert stats["client_queue_bytes_by_path"]["0"]["client_queue_read_bytes"] == 8192
        assert stats["sessions"][0]["lease_path"] == 0
        assert stats["sessions"][0]["client_queue_read_bytes"] == 4096 + 8192


def test_placement_names_the_new_path_once_the_queues_serve_there(near_served, cuda,
                                                                   monkeypatch):
    """While the queues connect on the nearer path, reads go through the daemon: placement
    names the new path only once they serve there, so its bytes count on that path."""
    ctrl, fabric, server, mnt = near_served
    connecting, let_go = threading.Event(), threading.Event()
    connect_queue, calls = fabric.connect_queue, []

    async def held_on_reconnect(*args, **kwargs):
        calls.append(args)
        if len(calls) > len(OWN):  # leased on the new path: connecting there
            connecting.set()
            with trio.fail_after(30):
                while not let_go.is_set():
                    await trio.sleep(0.01)
        return await connect_queue(*args, **kwargs)

    monkeypatch.setattr(fabric, "connect_queue", held_on_reconnect)
    out = np.zeros(8192, dtype=np.uint8)
    with File(str(mnt / "n1"), near=0) as f:

        def nearer_back() -> None:
            ctrl.index, ctrl.back = 0, SimpleNamespace(name="path 0 (rdma 10.0.0.1:4420)")
            ctrl.changed.set()

        trio.from_thread.run_sync(nearer_back, trio_token=server.trio_token)
        assert connecting.wait(30)
        assert f.placement["path"] == direct.RECONNECTING  # not serving on 0 yet
        assert f.read(out) == 8192  # through the daemon meanwhile
        let_go.set()
        assert wait_for(lambda: f.placement["path"].startswith("direct via path 0 "))
        assert f.read(out) == 8192
        stats = f.stats()
    assert stats["client_queue_bytes_by_path"] == {
        "0": {"client_queue_read_bytes": 8192, "client_queue_write_bytes": 0}}
    assert stats["staged_read_bytes"] == 8192
    assert bytes(out) == bytes(ctrl.disks[1][:8192])


def test_bytes_not_yet_reported_when_the_queues_move_count_on_the_path_they_moved_on(
        near_served, cuda, monkeypatch):
    """The client reports its counts each second: those of its last second on the old
    path go with its next lease request, before the daemon counts on the new one."""
    ctrl, fabric, server, mnt = near_served
    monkeypatch.setattr(direct, "REPORT_INTERVAL", 3600.0)  # no report but the lease's
    out = np.zeros(4096, dtype=np.uint8)
    with File(str(mnt / "n1"), near=0) as f:
        assert f.read(out) == 4096  # on path 1, not reported yet

        def nearer_back() -> None:
            ctrl.index, ctrl.back = 0, SimpleNamespace(name="path 0 (rdma 10.0.0.1:4420)")
            ctrl.changed.set()

        trio.from_thread.run_sync(nearer_back, trio_token=server.trio_token)
        assert wait_for(lambda: f.placement["path"].startswith("direct via path 0 "))
        assert f.read(out, 2048) == 2048
        stats = f.stats()
    assert stats["client_queue_bytes_by_path"] == {
        "0": {"client_queue_read_bytes": 2048, "client_queue_write_bytes": 0},
        "1": {"client_queue_read_bytes": 4096, "client_queue_write_bytes": 0}}


@pytest.mark.parametrize("options, message", [
    ({"near": "gpu0"}, "near='gpu0' is not a place"),
    ({"near": 9}, r"near=9: no CUDA device 9 \(cuDeviceGet failed"),
    ({"path_index": -1}, r"path_index must be a path's index \(nvmeof-fuse list\), got -1"),
    ({"path_index": "1"}, "path_index must be a path's index"),
])
def test_a_bad_place_or_path_is_one_line_and_leaves_nothing_open(near_served, cuda, options,
                                                                 message):
    ctrl, fabric, server, mnt = near_served
    with pytest.raises(InvalidArgument, match=message):
        File(str(mnt / "n1"), **options)
    assert wait_for(lambda: server.snapshot()["clients"] == 0)


@pytest.mark.parametrize("memory, why", [
    ({"gpu": 5}, "memory's gpu 5 is not a PCI address"),
    ({"gpu": "0000:9a:00.0", "x": 1}, "is not {'gpu': PCI address} or {'numa_node': N}"),
    ({"numa_node": True}, "memory's numa_node True is not 0-4095"),
    ({"numa_node": 1 << 40}, "memory's numa_node 1099511627776 is not 0-4095"),
    ([1], r"memory \[1\] is not"),
    ({"gpu": "z" * 5000}, r"memory's gpu 'z{56}\.\.\. is not a PCI address"),
])
def test_a_malformed_place_from_a_client_is_one_line(near_served, memory, why):
    ctrl, fabric, server, mnt = near_served
    ch = SocketChannel("\0" + server.info()["socket"][1:], 10)
    try:
        with pytest.raises(CompanionError, match=why) as caught:
            ch.call("lease", want=1, memory=memory)
        assert "\n" not in str(caught.value) and len(str(caught.value)) < 200
        assert ch.call("lease", want=1, memory={"numa_node": 1})["path"]["index"] == 1
    finally:
        ch.close()


def test_a_lease_with_malformed_counts_is_one_line(near_served):
    ctrl, fabric, server, mnt = near_served
    ch = SocketChannel("\0" + server.info()["socket"][1:], 10)
    try:
        with pytest.raises(CompanionError, match=r"^companion field 'moved' must be an "
                                                 r"object, got 'x'$"):
            ch.call("lease", want=1, moved="x")
    finally:
        ch.close()


def test_a_tls_psk_the_mount_resolved_reaches_the_clients_options():
    """A mount whose PSK is in its keyring hands the client the PSK (it may not read that
    keyring); a malformed one is one line that never holds it."""
    from nvmeof_fuse.companion.client.lease import given_psk
    from nvmeof_fuse.errors import InvalidArgument

    psk = given_psk({"identity": "NVMe0R01 h s", "key": "ab" * 32})
    assert psk.key == b"\xab" * 32 and psk.suite == "TLS_AES_128_GCM_SHA256"
    assert given_psk(None) is None
    for bad in ({"identity": "NVMe0R02 h s", "key": "ab" * 32}, {"key": "ab"}, "x",
                {"identity": "NVMe0R01 h s", "key": "zz"}):
        with pytest.raises(InvalidArgument, match=r"^the mount's lease reply holds a malformed "
                           r"TLS PSK \((ValueError|KeyError|TypeError)\)$"):
            given_psk(bad)
