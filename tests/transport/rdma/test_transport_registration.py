"""RdmaTransport's memory over fake verbs: one PD per queue, every region in every PD.

The ``ibverbs`` API ties a QP's protection domain to its RDMA-CM endpoint, so each
queue has its own PD; a registration holds one MR per PD, follows reconnects, and is
deregistered from a PD before that PD (and its endpoint) closes.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import trio

from nvmeof_fuse.errors import TransportError
from nvmeof_fuse.transport.rdma import transport as rdma

FAKE_VERBS = SimpleNamespace(
    AccessFlags=SimpleNamespace(LOCAL_WRITE=1, REMOTE_WRITE=2, REMOTE_READ=4))


class MR:
    def __init__(self, pd: PD, what: tuple) -> None:
        self.pd, self.what = pd, what
        self.lkey = self.rkey = len(pd.mrs) + 100 * pd.number
        pd.mrs.append(self)

    def close(self) -> None:
        self.pd.mrs.remove(self)


class PD:
    count = 0

    def __init__(self, fail: bool = False) -> None:
        PD.count += 1
        self.number, self.mrs, self.closed, self.fail = PD.count, [], False, fail

    def reg_mr(self, addr: int, length: int, access: int) -> MR:
        if self.fail:
            raise OSError(12, "Cannot allocate memory")
        return MR(self, ("mr", addr, length, access))

    def reg_dmabuf_mr(self, offset: int, length: int, iova: int, fd: int, access: int) -> MR:
        return MR(self, ("dmabuf", offset, length, iova, fd))

    def close(self) -> None:
        assert not self.mrs, "a PD closes only once its MRs are gone"
        self.closed = True


class CM:
    def __init__(self, fail_pd: bool = False) -> None:
        self.pd: PD | None = None
        self.closed = False
        self.context = SimpleNamespace(alloc_pd=self._alloc_pd)
        self._fail_pd = fail_pd

    def _alloc_pd(self) -> PD:
        self.pd = PD(self._fail_pd)
        return self.pd

    def close(self) -> None:
        assert self.pd is None or self.pd.closed, "an endpoint closes after its PD"
        self.closed = True


class Queue:
    """Stands in for RdmaQueue: records its endpoint and PD."""

    def __init__(self, transport, cm, pd, qid, size, in_capsule_bytes) -> None:
        self.cm, self.pd, self.qid, self.closed = cm, pd, qid, False

    async def connect(self, cntlid: int) -> None:
        pass

    async def reap(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def stop(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def transport(monkeypatch):
    monkeypatch.setattr(rdma, "_ibverbs", FAKE_VERBS)
    monkeypatch.setattr(rdma, "RdmaQueue", Queue)
    t = rdma.RdmaTransport("10.0.0.1")
    t.cms = []
    t.fail_pd = False

    async def resolve():
        cm = CM(t.fail_pd)
        t.cms.append(cm)
        return cm

    t._resolve = resolve
    return t


def run_with_queues(transport, body, qids=(0, 1, 2)):
    async def main():
        async with trio.open_nursery() as nursery:
            queues = [await transport.connect_queue(nursery, qid, 32) for qid in qids]
            await body(queues)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_region_is_registered_in_every_queue_pd_and_each_queue_gets_its_own_keys(transport):
    async def body(queues):
        reg = transport.register(0x1000, 8192, owner="buffer")
        pds = [q.pd for q in queues]
        assert len({id(pd) for pd in pds}) == 3
        assert [reg.keys(pd).pd for pd in pds] == pds
        assert len({reg.keys(pd).rkey for pd in pds}) == 3
        reg.close()
        assert all(not pd.mrs for pd in pds)

    run_with_queues(transport, body)


def test_earlier_registrations_join_new_queues_and_survive_a_reconnect(transport):
    reg = transport.register(0x2000, 4096, owner=None)  # before any queue exists

    async def body(queues):
        assert [reg.keys(q.pd).what for q in queues] == [("mr", 0x2000, 4096, 7)] * 2
        old = [q.pd for q in queues]
        await transport.drop_queues()
        assert all(pd.closed and not pd.mrs for pd in old)
        assert all(cm.closed for cm in transport.cms) and all(q.closed for q in queues)
        async with trio.open_nursery() as nursery:
            again = await transport.connect_queue(nursery, 0, 32)
            assert reg.keys(again.pd).pd is again.pd
            nursery.cancel_scope.cancel()

    run_with_queues(transport, body, qids=(0, 1))
    transport.close()
    assert not transport._registrations


def test_close_leaves_no_mr_pd_or_endpoint(transport):
    async def body(queues):
        transport.register(0x1000, 4096, owner=None)
        transport.close()
        assert all(pd.closed and not pd.mrs for pd in (q.pd for q in queues))
        assert all(cm.closed for cm in transport.cms)

    run_with_queues(transport, body)


def test_a_dma_buf_is_registered_through_a_duplicate_of_its_fd(transport):
    rfd, wfd = os.pipe()

    async def body(queues):
        reg = transport.register_dmabuf(rfd, 64, 4096, 0x7000)
        os.close(rfd)  # the caller may close its fd: new queues register the duplicate
        async with trio.open_nursery() as nursery:
            extra = await transport.connect_queue(nursery, 3, 32)
            kind, offset, length, iova, fd = reg.keys(extra.pd).what
            assert (kind, offset, length, iova) == ("dmabuf", 64, 4096, 0x7000)
            os.fstat(fd)  # still open
            reg.close()
            with pytest.raises(OSError):
                os.fstat(fd)
            nursery.cancel_scope.cancel()

    run_with_queues(transport, body, qids=(0,))
    os.close(wfd)


def test_a_registration_failure_is_named_and_leaves_nothing(transport):
    transport.register(0x1000, 4096, owner=None)
    transport.fail_pd = True

    async def main():
        async with trio.open_nursery() as nursery:
            with pytest.raises(TransportError, match="cannot register 4096 bytes of memory for "
                                                     "RDMA: Cannot allocate memory"):
                await transport.connect_queue(nursery, 0, 32)

    trio.run(main)
    (cm,) = transport.cms
    assert cm.closed and cm.pd.closed and not cm.pd.mrs and not transport._queues


def test_the_ibverbs_api_we_rely_on_is_there():
    """Public calls only; pyproject.toml pins the range tested.  Fails loudly on a change."""
    import ibverbs
    for cls, names in ((ibverbs.CMID, ("resolve", "create_qp", "connect", "disconnect", "close",
                                       "context")),
                       (ibverbs.Context, ("alloc_pd", "create_comp_channel", "create_cq",
                                          "query_device")),
                       (ibverbs.PD, ("reg_mr", "reg_dmabuf_mr", "close")),
                       (ibverbs.MR, ("lkey", "rkey", "close")),
                       (ibverbs.QP, ("query", "modify"))):
        missing = [name for name in names if not hasattr(cls, name)]
        assert not missing, f"ibverbs.{cls.__name__} lacks {missing}"
    assert "PD pd" in ibverbs.CMID.create_qp.__doc__
    assert "retry_count" in ibverbs.CMID.connect.__doc__  # the short retry limit (issue #49)
    assert hasattr(ibverbs.QPAttrMask, "TIMEOUT")
