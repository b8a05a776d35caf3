"""The tree follows namespaces added, removed and resized on the target (host.events)."""

from __future__ import annotations

import errno

import pytest
import trio
from fakes import FakeNamespace, make_controller

from nvmeof_fuse.fs.operations import NamespaceFS
from nvmeof_fuse.fs.wire import ROOT_INODE, FUSEError
from nvmeof_fuse.host.events import NamespaceChange


class FakeKernel(list):
    """What the filesystem asks the kernel to forget."""

    async def invalidate_entry(self, parent, name):
        self.append(("entry", parent, name))

    async def invalidate_inode(self, inode, attr_only=False, offset=0, length=0):
        self.append(("inode", inode, attr_only) + ((offset, length) if length else ()))


@pytest.fixture
def kernel():
    return FakeKernel()


def lookup(fs, *names) -> int:
    inode = ROOT_INODE
    for name in names:
        inode = trio.run(fs.lookup, inode, name.encode(), None).st_ino
    return inode


def test_an_added_namespace_gets_its_file_and_reports(kernel):
    ctrl = make_controller((1, 512, 64))
    fs = NamespaceFS(ctrl)
    fs.kernel = kernel
    ctrl.namespaces[3] = FakeNamespace(3, 4096, 16)
    trio.run(fs.apply_changes, [NamespaceChange("added", 3, 0, 16 * 4096)])
    assert trio.run(fs.getattr, lookup(fs, "n3")).st_size == 16 * 4096
    lookup(fs, ".nvmeof", "n3.json")
    assert len({lookup(fs, "n1"), lookup(fs, "n3")}) == 2


def test_a_removed_namespace_leaves_the_tree_and_the_kernel_forgets_it(kernel):
    ctrl = make_controller((1, 512, 64), (2, 512, 64))
    fs = NamespaceFS(ctrl)
    fs.kernel = kernel
    n2, info = lookup(fs, "n2"), lookup(fs, ".nvmeof")
    lookup(fs, ".nvmeof", "n2.json")  # the kernel knows one report of n2, not the other
    fh = trio.run(fs.open, n2, 0, None).fh
    del ctrl.namespaces[2]
    trio.run(fs.apply_changes, [NamespaceChange("removed", 2, 64 * 512, 0)])
    with pytest.raises(FUSEError) as gone:
        lookup(fs, "n2")
    assert gone.value.errno == errno.ENOENT
    with pytest.raises(FUSEError) as gone:
        lookup(fs, ".nvmeof", "n2")  # its reports went with it, looked up or not
    assert gone.value.errno == errno.ENOENT
    assert ("entry", ROOT_INODE, b"n2") in kernel
    assert ("entry", info, b"n2.json") in kernel
    assert fh in fs.handles  # an open handle keeps its node: its I/O fails in the namespace


def test_a_resized_namespace_shows_its_size_and_the_kernel_drops_its_attributes(kernel):
    ctrl = make_controller((1, 512, 64))
    fs = NamespaceFS(ctrl)
    fs.kernel = kernel
    ns = ctrl.namespaces[1]
    ns.size = 128 * 512
    trio.run(fs.apply_changes, [NamespaceChange("resized", 1, 64 * 512, 128 * 512)])
    n1 = lookup(fs, "n1")
    assert trio.run(fs.getattr, n1).st_size == 128 * 512
    assert ("inode", n1, True) in kernel


def test_a_replaced_namespace_is_a_new_file_and_the_old_inode_stays_with_its_handles(kernel):
    """Another namespace behind n1: the name leads to a new inode (its reports too), the
    kernel forgets the name and the old inode's pages; an open handle keeps the old node
    (whose namespace refuses I/O), and opening the old inode now is ESTALE."""
    ctrl = make_controller((1, 512, 64))
    fs = NamespaceFS(ctrl)
    fs.kernel = kernel
    old_inode = lookup(fs, "n1")
    old = ctrl.namespaces[1]
    fh = trio.run(fs.open, old_inode, 0, None).fh
    new = ctrl.namespaces[1] = FakeNamespace(1, 512, 32)
    new.generation = 1
    trio.run(fs.apply_changes, [NamespaceChange("replaced", 1, 64 * 512, 32 * 512, "...")])
    new_inode = lookup(fs, "n1")
    assert new_inode != old_inode
    assert trio.run(fs.getattr, new_inode).st_size == 32 * 512
    assert fs.handles[fh].node.ns is old
    assert ("entry", ROOT_INODE, b"n1") in kernel and ("inode", old_inode, False) in kernel
    with pytest.raises(FUSEError) as stale:
        trio.run(fs.open, old_inode, 0, None)
    assert stale.value.errno == errno.ESTALE
    assert fs.handles[trio.run(fs.open, new_inode, 0, None).fh].node.ns is new
