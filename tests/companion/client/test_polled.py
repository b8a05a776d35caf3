"""PolledRead: a read waited for in the caller's thread, and its fallback to the loop's path."""

from __future__ import annotations

import concurrent.futures
import errno
import threading
import time
from types import SimpleNamespace

import pytest

from nvmeof_fuse.companion.client.future import IOFuture
from nvmeof_fuse.companion.client.polled import PolledRead, PolledReads
from nvmeof_fuse.companion.protocol import CompanionError
from nvmeof_fuse.errors import CommandTimeout, TransportError
from nvmeof_fuse.nvme import Completion, NVMeStatusError


def completion(status: int = 0) -> Completion:
    return Completion(result=0, sq_head=0, sq_id=1, command_id=3, status=status, phase=True)


class Reads:
    """What a PolledRead tells its PolledReads, recorded."""

    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self.counted: list[int] = []
        self.lost: list[BaseException] = []

    def done(self, size: int) -> None:
        self.counted.append(size)

    def failed(self, queue, exc: BaseException) -> None:
        self.lost.append(exc)

    def read_on_loop(self, result: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(result)
        return future


class Queue:
    def __init__(self, outcome) -> None:
        self.outcome = outcome

    def wait(self, request, until: float) -> Completion:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def progress(self) -> None:
        pass


def request(finished: bool = False) -> SimpleNamespace:
    return SimpleNamespace(deadline=time.perf_counter(), finished=finished)


def loop_path(result: int) -> tuple:
    """A PolledRead's fallback: what the fake loop's path answers."""
    return (result,)


def test_a_completed_read_counts_its_bytes():
    direct = Reads()
    read = PolledRead(direct, Queue(completion()), [request(), request()], 8192, None,
                      loop_path(-1))
    assert read.result(5) == 8192
    assert read.result(5) == 8192 and read.done()  # asked again: counted once
    assert direct.counted == [8192] and not direct.lost


def test_a_polled_read_is_the_future_pread_returns():
    """No wrapper around it: get() bounds the wait by its limit and names a timeout."""
    read = PolledRead(Reads(), Queue(completion()), [request()], 4096, 7.0, loop_path(-1))
    assert isinstance(read, IOFuture) and read.get() == 4096
    slow = PolledRead(Reads(), Queue(CommandTimeout("no completion")), [request()], 4096,
                      0.01, loop_path(-1))
    with pytest.raises(CompanionError, match="did not finish within 0.01 s") as caught:
        slow.get()
    assert caught.value.errno == errno.ETIMEDOUT


def test_a_lost_queue_reports_the_loss_and_runs_the_read_on_the_loop():
    direct = Reads()
    lost = TransportError("I/O queue 4: work request failed: retry exceeded")
    read = PolledRead(direct, Queue(lost), [request()], 4096, None, loop_path(4096))
    assert read.result(5) == 4096
    assert direct.lost == [lost] and not direct.counted
    assert read.done()  # the loop's future, from now on


def test_a_command_timeout_goes_to_the_loop_but_a_callers_timeout_does_not():
    direct = Reads(timeout=30)
    read = PolledRead(direct, Queue(CommandTimeout("no completion")), [request()], 4096, None,
                      loop_path(4096))
    with pytest.raises(concurrent.futures.TimeoutError):
        read.result(0.01)  # the caller's bound: the read stays on its queue
    assert not direct.lost
    direct.timeout = 0  # past the command's own timeout
    assert read.result(5) == 4096
    assert len(direct.lost) == 1


def test_an_error_status_is_raised_as_it_is():
    direct = Reads()
    read = PolledRead(direct, Queue(completion(status=0x2 << 1)), [request()], 4096, None,
                      loop_path(-1))
    with pytest.raises(NVMeStatusError):
        read.result(5)
    assert not direct.lost and not direct.counted


# -- DirectQueues' polled reads over a PolledQueue on the fake verbs ----------------------------

@pytest.fixture
def polled_direct(monkeypatch):
    """A DirectQueues with one polled queue over fake verbs (8 slots), 4 KiB LBAs."""
    from transport.rdma.test_transport_queue import fake_rdma_queue

    from nvmeof_fuse.companion.client import own_queues as direct_mod
    from nvmeof_fuse.host.attached import NamespaceShape
    from nvmeof_fuse.transport.rdma.polled import PolledQueue
    from nvmeof_fuse.transport.region import host_buffer

    for rdma_queue in fake_rdma_queue(monkeypatch):
        queue = PolledQueue(rdma_queue)
        d = object.__new__(direct_mod.DirectQueues)
        d._ctrl = SimpleNamespace(polled_queues=[queue], live=True)
        d.polled = PolledReads({1: NamespaceShape(1, 4096, 1024)}, {1: 8},  # 32 KiB a command
                               30.0, d.read_on_loop, lambda queue, exc: None)
        d.polled.ctrl = d._ctrl
        d._timeout = 30.0
        memory = host_buffer(lambda addr, length, owner: SimpleNamespace(
            keys=lambda pd: SimpleNamespace(lkey=1, rkey=2), close=lambda: None), 1 << 20)
        yield d, queue, rdma_queue.qp, memory
        memory.close()


def answer_all(qp) -> None:
    for cid in list(qp.sent):
        qp.send_done(cid)
        qp.respond(cid)
    qp.sent.clear()


def test_a_batch_of_polled_reads_goes_out_in_one_post(polled_direct):
    d, queue, qp, memory = polled_direct
    reads = [d.polled.read(1, memory, i * 4096, 4096, i * 4096, None, None, post=False)
             for i in range(3)]
    reads.append(d.polled.read(1, memory, 65536, 65536, 65536, None, None, post=False))
    assert all(isinstance(r, PolledRead) for r in reads)
    assert qp.posts == []
    d.polled.post()
    assert qp.posts == [5]  # three reads of one command, one of two commands
    answer_all(qp)
    assert [r.result(5) for r in reads] == [4096, 4096, 4096, 65536]
    assert d.polled.read_bytes == 3 * 4096 + 65536
    assert [r.result(5) for r in reads] == [4096, 4096, 4096, 65536]  # counted once
    assert d.polled.read_bytes == 3 * 4096 + 65536


def test_a_single_polled_read_is_posted_at_once(polled_direct):
    d, queue, qp, memory = polled_direct
    read = d.polled.read(1, memory, 0, 8192, 4096, None, None)
    assert qp.posts == [1]
    answer_all(qp)
    assert read.done() and read.result(5) == 8192


def test_small_reads_keep_to_the_first_polled_queue_and_large_ones_spread(polled_direct,
                                                                         monkeypatch):
    """4 KiB readers poll one completion queue; large reads go to the less loaded queue,
    ties to the first, so that the target moves two transfers at once."""
    from transport.rdma.test_transport_queue import fake_rdma_queue

    from nvmeof_fuse.transport.rdma.polled import PolledQueue

    d, queue, qp, memory = polled_direct
    other_queue = fake_rdma_queue(monkeypatch)
    other = PolledQueue(next(other_queue))
    d._ctrl.polled_queues = [queue, other]
    small = [d.polled.read(1, memory, i * 4096, 4096, i * 4096, None, None) for i in range(2)]
    assert [read._queue for read in small] == [queue, queue]
    large = 160 * 1024  # five commands of 32 KiB
    spread = d.polled.read(1, memory, 65536, large, 65536, None, None)
    assert spread._queue is other  # the first has two commands unanswered
    answer_all(qp)
    assert [read.result(5) for read in small] == [4096, 4096]
    again = d.polled.read(1, memory, 262144, large, 262144, None, None)
    assert again._queue is queue  # its reads were answered; the other still waits
    answer_all(qp)
    assert again.result(5) == large
    next(other_queue, None)  # closes the other queue


def test_large_reads_take_the_loop_when_one_queue_is_polled(polled_direct):
    """One polled queue held 1 MiB reads to 0.75x of the loop's two: they go there."""
    d, queue, qp, memory = polled_direct
    assert d.polled.queues(128 * 1024) == [queue]
    assert d.polled.queues(132 * 1024) == []
    assert d.polled.read(1, memory, 0, 256 * 1024, 0, None, None) is None
    assert not qp.sent


def test_the_polled_read_micro_benchmark_still_runs(monkeypatch):
    """tests/companion/bench_polled_read.py builds a File around the daemon: keep it working."""
    import bench
    from companion.bench_polled_read import LBA, NLB_TOTAL, polled_file

    import nvmeof_fuse
    from nvmeof_fuse.transport.rdma import transport as rdma

    monkeypatch.setattr(rdma, "_ibverbs", rdma._ibverbs)  # the fake verbs it installs go after
    f = polled_file()
    bufs = nvmeof_fuse.empty((4, LBA))
    job = bench.Job("rand_read_qd4", LBA, 4, False)
    ios, _ = bench.companion_slice(f, bufs, job, bench.Cursor(job, LBA, NLB_TOTAL), 0.05)
    queue = f._direct._ctrl.polled_queues[0]
    assert ios >= 4 and queue.pending == 0 and queue.failed is None
    assert f._direct.polled.read_bytes == ios * LBA  # every read went to the polled queue
    queue.queue.close()


# -- File.pread's hot path: an array's whole LBAs straight to the polled queue --------------------

@pytest.fixture
def polled_file(polled_direct, monkeypatch):
    """A File (built around the daemon) on ``polled_direct``; its general path recorded."""
    from nvmeof_fuse.companion.client import file as client
    from nvmeof_fuse.companion.client.registrations import Registrations

    d, queue, qp, memory = polled_direct
    registered: list[tuple[int, int]] = []

    def register(addr, length, owner):
        registered.append((addr, length))
        return SimpleNamespace(keys=lambda pd: SimpleNamespace(lkey=1, rkey=2),
                               close=lambda: None)

    d._registrations = Registrations(register)
    d.renew_timeout = 60.0
    f = object.__new__(client.File)
    f.path, f.nsid, f.lba_size, f.nbytes = "fake/n1", 1, 4096, 1024 * 4096
    f.timeout, f.compat_mode = 30.0, False
    f._closed, f._stale, f._direct = False, [], d
    general: list[tuple] = []
    monkeypatch.setattr(client.File, "_start", lambda self, *args, **kw: general.append(args))
    yield f, qp, registered, general
    d._registrations.close()


def test_rows_of_one_allocation_go_to_the_polled_queue_registered_once(polled_file):
    import nvmeof_fuse

    f, qp, registered, general = polled_file
    rows = nvmeof_fuse.empty((4, 8192))
    reads = [f.pread(rows[i], 4096, file_offset=i * 4096) for i in range(4)]
    reads += [f.pread(rows[0], file_offset=8192)]  # the whole row: 8 KiB
    assert all(isinstance(r, PolledRead) for r in reads) and not general
    assert len(registered) == 1  # the allocation, once, though each row is a new view
    base = registered[0][0]
    for read, row in zip(reads, [0, 1, 2, 3, 0], strict=True):  # each command addresses its own row
        assert read._requests[0].data.addr == base + row * 8192
    answer_all(qp)
    assert [r.get(5) for r in reads] == [4096] * 4 + [8192]


def test_what_the_hot_path_does_not_cover_takes_the_general_path(polled_file):
    import numpy as np

    import nvmeof_fuse

    f, qp, registered, general = polled_file
    arr = nvmeof_fuse.empty(16384)
    read_only = nvmeof_fuse.empty(4096)
    read_only.flags.writeable = False
    objects = np.empty(512, dtype=object)
    large = nvmeof_fuse.empty(1 << 20)
    for args in [(bytearray(4096), 4096, 0),  # not an array
                 (large, 1 << 20, 0),  # too large to poll for: nothing resolved twice
                 (np.frombuffer(bytearray(4096), np.uint8), 4096, 0),  # registered per call
                 (arr[::2], 4096, 0),  # not contiguous
                 (read_only, 4096, 0),
                 (objects, 4096, 0),
                 (arr, 4096, 100),  # part of an LBA
                 (arr, 100, 0),
                 (arr, 0, 0),
                 (arr, 16384 + 4096, 0),  # more than the array holds
                 (arr, 4096, 1024 * 4096),  # past the end of the namespace
                 (arr, 4096, -4096),
                 (arr, 4096, np.int64(4096))]:  # numpy integers: converted there
        f.pread(*args)
    f.pread(arr, 4096, 0, buf_offset=4096)
    f._closed = True
    f.pread(arr, 4096, 0)
    assert len(general) == 15 and not qp.sent and not registered


def test_a_freed_arrays_remembered_region_serves_no_later_array(polled_file):
    import gc

    import numpy as np

    f, qp, registered, general = polled_file
    for round_ in range(3):  # a new array may well get the old one's id and address
        arr = np.zeros(8192, dtype=np.uint8)
        read = f.pread(arr, 4096, file_offset=4096)
        answer_all(qp)
        assert read.get(5) == 4096
        assert len(registered) == round_ + 1 and not general
        del arr, read
        gc.collect()


def test_a_namespace_replaced_since_the_open_is_never_read_on_a_polled_queue(polled_file):
    """Once the loop heard that another namespace answers behind the NSID (its replaced
    listener forgets the shape, before the queues of the new connection are handed out),
    neither the hot path nor a polled read posts anything: the general path refuses them.
    The hot path once skipped that check, and a File read the new volume (issue #56)."""
    import nvmeof_fuse

    f, qp, registered, general = polled_file
    arr = nvmeof_fuse.empty(8192)
    polled = f._direct.polled
    queues = polled.queues(4096)  # taken before the replacement: the check comes after
    polled.shapes.pop(1)  # what DirectQueues' replaced listener does
    f.pread(arr, 4096, file_offset=4096)
    assert polled.read(1, None, 0, 4096, 0, None, None) is None
    assert polled.read_lbas(queues, 1, None, 0, 4096, 0, 0, 1, None, 5.0, True) is None
    assert len(general) == 1 and not qp.sent and not qp.posts


def test_a_blocking_read_takes_the_hot_path_too(polled_file):
    import nvmeof_fuse

    f, qp, registered, general = polled_file
    arr = nvmeof_fuse.empty(8192)
    done: list[int] = []
    reader = threading.Thread(target=lambda: done.append(f.read(arr, file_offset=4096)))
    reader.start()
    deadline = time.monotonic() + 10
    while reader.is_alive() and time.monotonic() < deadline:
        answer_all(qp)
        reader.join(0.01)
    assert done == [8192] and not general and len(registered) == 1
