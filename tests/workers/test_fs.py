"""A FUSE worker's filesystem (workers/fs.py): its writes under the mount's range locks
across processes, what it forwards (reports, namespaces it does not know, all I/O while its
queues are not live), and the sizes of a rescan; over RAM, without FUSE."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from ramdisk import ram_controller

from nvmeof_fuse.fs.mount_options import MountOptions
from nvmeof_fuse.fs.operations import GENERATION_MAX, pack_fh
from nvmeof_fuse.fs.wire import FUSEError
from nvmeof_fuse.host.namespace.sharedranges import NSID_SHIFT, SharedRanges, share_range_locks
from nvmeof_fuse.workers.fs import WorkerFS
from nvmeof_fuse.workers.messages import FORWARD_CHUNK


def _worker_fs(ctrl, locks, forwarded):
    async def forward_read(fh, off, size):
        forwarded.append(("read", fh, off, size))
        return b"r" * size

    async def forward_write(fh, off, data):
        forwarded.append(("write", fh, off, len(data)))
        return len(data)

    class Recording(SharedRanges):
        def try_lock(self, units):
            locks.append(units)
            return super().try_lock(units)

    share_range_locks(ctrl, Recording.create(5.0))
    return WorkerFS(ctrl, MountOptions(), forward_read=forward_read,
                    forward_write=forward_write)


def test_a_worker_writes_under_the_mounts_range_locks_across_processes():
    ctrl = ram_controller((1, 512, 64))
    locks, forwarded = [], []
    fs = _worker_fs(ctrl, locks, forwarded)

    async def main():
        fh = pack_fh(1, 1, True)
        assert await fs.write(fh, 100, b"a" * 1000) == 1000
        base = 1 << NSID_SHIFT  # n1's LBAs 0 and 2 read-modify-written, LBA 1 whole
        assert locks == [[(base, base + 1, True), (base + 1, base + 2, False),
                          (base + 2, base + 3, True)]]
        assert bytes(await fs.read(fh, 100, 1000)) == b"a" * 1000
        assert await fs.write(fh, 64 * 512 - 10, b"b" * 100) == 10  # cut at the end
        with pytest.raises(FUSEError) as read_only:
            await fs.write(pack_fh(2, 1, False), 0, b"c")
        assert read_only.value.errno == errno.EBADF
        assert forwarded == []

    trio.run(main)


def test_a_worker_never_serves_a_handle_of_a_replaced_namespace_with_the_new_one():
    """Handles carry the generation they were opened on: a worker serves those of the
    namespace it holds, and forwards the others to the main process (which knows each
    handle it opened: it refuses the old one's, and serves the new one's)."""
    from nvmeof_fuse.errors import NamespaceReplaced
    from nvmeof_fuse.host.attached import NamespaceShape
    from nvmeof_fuse.host.namespace import Namespace

    ctrl = SimpleNamespace(live=True, namespaces={
        1: Namespace(SimpleNamespace(), 1, NamespaceShape(1, 512, 64), 0)})
    old = ctrl.namespaces[1]
    locks, forwarded = [], []
    fs = _worker_fs(ctrl, locks, forwarded)
    old_fh, new_fh = pack_fh(1, 1, False, 0), pack_fh(2, 1, False, 1)
    assert fs.handles[old_fh].node.ns is old
    assert fs.handles.get(new_fh) is None  # opened on a namespace this worker does not hold
    fs.follow({1: (512, 32, 1)})  # the main process replaced n1
    new = ctrl.namespaces[1]
    assert new is not old and new.generation == 1 and new.nlb == 32
    assert fs.handles[new_fh].node.ns is new
    assert fs.handles.get(old_fh) is None
    with pytest.raises(NamespaceReplaced):
        trio.run(old.read_lbas, 0, 1)

    async def main():
        assert await fs.read(old_fh, 0, 512) == b"r" * 512  # the main process's answer
        assert forwarded == [("read", old_fh, 0, 512)]

    trio.run(main)
    fs.follow({1: (512, 32, GENERATION_MAX)})  # past what handles name: none served here
    assert fs.handles.get(pack_fh(3, 1, False, GENERATION_MAX)) is None


def test_a_worker_forwards_reports_and_namespaces_it_does_not_know():
    ctrl = ram_controller((1, 512, 64))
    locks, forwarded = [], []
    fs = _worker_fs(ctrl, locks, forwarded)

    async def main():
        size = FORWARD_CHUNK * 2 + 5
        assert await fs.read(pack_fh(1, 0, False), 0, size) == b"r" * size
        assert [f[3] for f in forwarded] == [FORWARD_CHUNK, FORWARD_CHUNK, 5]
        forwarded.clear()
        assert await fs.write(pack_fh(1, 9, True), 4096, b"w" * size) == size
        assert [f[2:] for f in forwarded] == [(4096, FORWARD_CHUNK),
                                             (4096 + FORWARD_CHUNK, FORWARD_CHUNK),
                                             (4096 + 2 * FORWARD_CHUNK, 5)]
        assert locks == []

    trio.run(main)


def test_while_its_queues_are_not_live_a_worker_forwards_its_io():
    ctrl = ram_controller((1, 512, 64))
    locks, forwarded = [], []
    fs = _worker_fs(ctrl, locks, forwarded)

    async def main():
        fh = pack_fh(1, 1, True)
        ctrl.live = False  # lost with its path: waiting for a lease on its own fabric
        assert not fs.start_read(fh, 0, 512, lambda data: None)
        assert await fs.read(fh, 0, 512) == b"r" * 512
        assert await fs.write(fh, 512, b"w" * 512) == 512
        assert [f[0] for f in forwarded] == ["read", "write"] and locks == []
        ctrl.live = True
        forwarded.clear()
        assert bytes(await fs.read(fh, 0, 512)) == bytes(512)
        assert forwarded == [] and fs.forwarded == 2

    trio.run(main)


def test_a_worker_takes_the_sizes_of_a_rescan_and_forwards_a_namespace_gone():
    from nvmeof_fuse.host.attached import NamespaceShape
    from nvmeof_fuse.host.namespace import Namespace

    issuer = SimpleNamespace()  # no I/O here: sizes only
    ctrl = SimpleNamespace(live=True, namespaces={
        n: Namespace(issuer, n, NamespaceShape(n, 512, 64)) for n in (1, 2)})
    kept = ctrl.namespaces[1]
    locks, forwarded = [], []
    fs = _worker_fs(ctrl, locks, forwarded)
    fs.follow({1: (512, 128), 3: (4096, 8)})  # n1 grew, n2 is gone, n3 is new
    assert ctrl.namespaces == {1: kept} and (kept.nlb, kept.size) == (128, 128 * 512)
    assert fs.handles[pack_fh(1, 1, False)].node.ns is kept  # open handles see the new size
    assert sorted(fs.ns_inodes) == [1]

    async def main():
        for nsid in (2, 3):  # the main process's to serve (or refuse)
            assert await fs.read(pack_fh(1, nsid, False), 0, 512) == b"r" * 512
        assert [f[1] for f in forwarded] == [pack_fh(1, 2, False), pack_fh(1, 3, False)]

    trio.run(main)
    fs.follow({1: (512, 32)})  # and shrank
    assert kept.size == 32 * 512
