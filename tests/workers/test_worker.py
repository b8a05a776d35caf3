"""A FUSE worker process's side (workers/worker.py): its lease, its own queues under the
mount's range locks across processes, and the sizes of a rescan, over the real companion socket."""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import trio
import trio.testing
from companion_fakes import LeasingController, serving
from workers_fakes import worker_of, workers_role

from nvmeof_fuse.fs.mount_options import MountOptions
from nvmeof_fuse.fs.operations import pack_fh
from nvmeof_fuse.host.namespace.sharedranges import SharedRanges, share_range_locks
from nvmeof_fuse.workers.fs import WorkerFS
from nvmeof_fuse.workers.supervisor import FuseWorkers


def test_a_worker_takes_sizes_heard_before_its_filesystem_once_it_has_one():
    """It says it took them either way (the main process waits for that); a malformed
    event it drops, unsaid; sizes without a valid generation (a main process of another
    version) it takes, unsaid."""
    from nvmeof_fuse.workers.worker import TO_MAIN_KINDS, _Worker

    worker = _Worker.__new__(_Worker)  # its channel to the main process is not needed here
    worker.index, worker.fs, worker.shapes, worker.ctrl = 1, None, None, None
    worker.to_main = dict.fromkeys(TO_MAIN_KINDS, 0)
    said = []
    worker.channel = SimpleNamespace(call_future=lambda op, **fields: said.append((op, fields)))
    good = {"event": "namespaces", "namespaces": [[1, 512, 128]], "generation": 1}
    for bad in ("x", [[1, 0, 8]], [[1, 512]], [[1, 512, -1]], [["1", 512, 8]]):
        worker._on_event({**good, "namespaces": bad})
        assert worker.shapes is None, bad
    for bad in (None, 0, -1, "1", 1.0, True, 1 << 63):
        worker._on_event({**good, "generation": bad, "namespaces": [[1, 512, 64]]})
        assert worker.shapes == {1: (512, 64)}, bad
    worker._on_event({"event": "namespaces", "namespaces": [[1, 512, 96]]})
    assert worker.shapes == {1: (512, 96)}
    assert said == []
    worker._on_event(good)
    assert worker.shapes == {1: (512, 128)}
    followed = []
    worker.fs = SimpleNamespace(follow=followed.append)
    worker._on_event({**good, "namespaces": [[1, 512, 256]], "generation": 2})
    assert followed == [{1: (512, 256)}]
    assert said == [("fuse", {"kind": "namespaces", "index": 1, "pid": os.getpid(),
                              "generation": g}) for g in (1, 2)]
    assert worker.to_main["namespaces"] == 2  # counted as sent (the stats show it)


def test_a_worker_counts_each_message_to_the_main_process_by_kind_and_per_request():
    """Every message passes send(), which counts it by kind (a forwarded request also by
    its opcode); what a request caused is reported per request the worker read."""
    from nvmeof_fuse.fs import wire
    from nvmeof_fuse.workers.worker import TO_MAIN_KINDS, _Worker

    worker = _Worker.__new__(_Worker)
    worker.to_main, worker.meta_to_main = dict.fromkeys(TO_MAIN_KINDS, 0), {}
    sent = []
    worker.channel = SimpleNamespace(call_future=lambda op, **fields: sent.append(op))
    worker.session = SimpleNamespace(requests=400, parks=100, full_waits=3)
    worker.send("lease", want=1, worker=True)
    worker.send("report", worker={})
    for opcode in (wire.OPEN, wire.GETATTR, wire.GETATTR, wire.FLUSH):
        worker.send("fuse", payload=b"", kind="meta", opcode=opcode, unique=1, nodeid=2)
    worker.send("fuse", kind="read", fh=1, offset=0, size=4096)
    assert sent == ["lease", "report"] + ["fuse"] * 5
    counts = worker.counts()
    assert counts["requests"] == 400 and counts["to_main_per_request"] == 5 / 400
    assert (counts["parks"], counts["full_waits"]) == (100, 3)
    assert counts["to_main"] == {"lease": 1, "ready": 0, "namespaces": 0, "report": 1,
                                 "meta": 4, "read": 1, "write": 0, "meta GETATTR": 2,
                                 "meta OPEN": 1, "meta FLUSH": 1}




def test_a_worker_serves_reads_and_writes_on_its_leased_queues_under_the_shared_locks(tmp_path):
    """A worker's side over the fake fabric: its lease, its own queues and bounce pool of
    whole transfers, and each write under the mount's range locks across processes, taken
    without a message to the main process (none held after; the namespace marked
    written for the main process's flush)."""
    from companion_fakes import FakeFabric

    from nvmeof_fuse.companion.client.lease import lease_from, options_from
    from nvmeof_fuse.host.attached import attach

    ctrl = LeasingController(companion_queues=4)
    fabric = FakeFabric(ctrl)
    with serving(ctrl, tmp_path, roles=[workers_role()]) as (server, _):
        worker = worker_of(server)

        async def main():
            first = await worker.ask("lease", want=1, worker=True)
            options = options_from(first, 10.0)

            async def lease_source():
                return lease_from(first)

            async with attach(options, lease_source, fabric(options), bounce_buffers=4) as own:
                assert own.bounce.chunk >= own.max_transfer
                share_range_locks(own, ranges)
                fs = WorkerFS(own, MountOptions(), forward_read=None, forward_write=None)
                data = bytes(range(256)) * 40  # 10,240 bytes, unaligned at both ends
                assert await fs.write(pack_fh(1, 2, True), 1000, data) == len(data)
                assert bytes(await fs.read(pack_fh(2, 2, False), 1000, len(data))) == data
                assert bytes(await fs.read(pack_fh(3, 1, False), 0, 1 << 20)) == \
                    bytes(ctrl.disks[1][:1 << 20])

        ranges = SharedRanges.create(5.0)
        try:
            trio.run(main)
        finally:
            worker.channel.close()
        assert bytes(ctrl.disks[2][1000:1000 + 10240]) == bytes(range(256)) * 40
        assert set(fabric.connects) == {6} and {q for _, q in fabric.commands} == {6}
        assert server.stats.requests == 1  # the lease only: no lock asked for
        assert ranges.written(2) and not ranges.written(1)
        assert ranges.try_lock([(0, 1 << 63 - 1, True)]) is not None  # every lock let go


def test_past_the_bound_a_workers_lease_names_no_namespace_and_it_forwards_their_io(tmp_path):
    """The lease a worker asks for (all namespaces) names none on a mount of more than
    MAX_FOLLOWED_NAMESPACES: the worker connects its queues and forwards every READ and
    WRITE to the main process, as after a rescan past that bound."""
    from companion_fakes import FakeFabric

    from nvmeof_fuse.companion.client.lease import lease_from, options_from
    from nvmeof_fuse.host.attached import attach
    from nvmeof_fuse.workers.messages import MAX_FOLLOWED_NAMESPACES, WORKER_QUEUES

    count = MAX_FOLLOWED_NAMESPACES + 1
    ctrl = LeasingController(companion_queues=4, specs=[(n, 512, 8) for n in range(1, count + 1)])
    fabric = FakeFabric(ctrl)
    with serving(ctrl, tmp_path, roles=[workers_role()]) as (server, _):
        worker = worker_of(server)
        forwarded = []

        async def forward_read(fh, off, size):
            forwarded.append(("read", fh))
            return b"r" * size

        async def forward_write(fh, off, data):
            forwarded.append(("write", fh))
            return len(data)

        async def main():
            first = await worker.ask("lease", want=WORKER_QUEUES, worker=True)  # as it does
            assert first["namespaces"] == [] and first["namespace_count"] == count
            options = options_from(first, 10.0)

            async def lease_source():
                return lease_from(first)

            async with attach(options, lease_source, fabric(options), bounce_buffers=4) as own:
                assert own.namespaces == {}
                fs = WorkerFS(own, MountOptions(), forward_read=forward_read,
                              forward_write=forward_write)
                assert await fs.read(pack_fh(2, 7, False), 0, 512) == b"r" * 512
                assert await fs.write(pack_fh(3, count, True), 512, b"w" * 512) == 512
                assert forwarded == [("read", pack_fh(2, 7, False)),
                                     ("write", pack_fh(3, count, True))]

        try:
            trio.run(main)
        finally:
            worker.channel.close()
        assert set(fabric.connects) == {6} and fabric.commands == []  # connected, unused


def test_a_rescan_shows_a_new_size_only_after_the_worker_took_it(tmp_path, caplog):
    """A worker over the companion socket takes a rescan's sizes in its own time (here
    slowly); the listeners after the workers' (the files' new sizes) run only once it said
    it took them, so that no read it serves is cut at the old end."""
    import os
    from types import SimpleNamespace

    from nvmeof_fuse.host.attached import NamespaceShape

    ctrl = LeasingController(companion_queues=4)
    order: list[str] = []
    pool = FuseWorkers(2)
    with serving(ctrl, tmp_path, roles=[pool.role]) as (server, _):
        pool.companion = server  # as run() gives it
        worker = worker_of(server)

        def follow(shapes):
            time.sleep(0.3)  # slow: the main process must wait for it
            order.append(f"worker took n1 of {shapes[1][1]} LBAs")

        try:
            worker.fs = SimpleNamespace(follow=follow)
            worker.channel.on_event = worker._on_event  # (its own loop's task, in a worker)
            worker.channel.call("lease", want=1, worker=True)
            pool.ready[1] = os.getpid()
            pool.procs[1] = SimpleNamespace(pid=os.getpid(), returncode=None)
            ctrl.namespaces[1].resize(NamespaceShape(1, 512, 32768))

            async def rescan():  # host.events calls its listeners in order
                for listener in (pool.follow, files_follow):
                    await listener([])

            async def files_follow(changes):
                order.append("files show the new size")

            with caplog.at_level(logging.WARNING, logger="nvmeof-fuse"):
                trio.from_thread.run(rescan, trio_token=server.trio_token)
        finally:
            worker.channel.close()
        assert order == ["worker took n1 of 32768 LBAs", "files show the new size"]
        assert caplog.messages == []  # it said so, in time
