"""How an attached controller shares its leased queues between callers' threads and its loop."""

import pytest

from nvmeof_fuse.host.attached import polled_share
from nvmeof_fuse.host.connect_options import QUEUES_PER_CLIENT


@pytest.mark.parametrize(("wanted", "leased", "share"), [
    (2, 4, 2),  # a full lease: two polled, two on the loop
    (2, 3, 1),  # the loop keeps two for writes
    (2, 2, 1),
    (2, 1, 0),  # one queue: the loop's
    (2, 0, 0),
    (0, 4, 0),  # polling off
    (3, 8, 3),
])
def test_the_loop_keeps_half_of_the_leased_queues_at_least(wanted, leased, share):
    assert polled_share(wanted, leased) == share


def test_a_full_lease_polls_as_many_queues_as_a_file_asks_for():
    from nvmeof_fuse.companion.client.own_queues import POLLED_QUEUES

    assert polled_share(POLLED_QUEUES, QUEUES_PER_CLIENT) == POLLED_QUEUES


def lease(generation: int):
    from nvmeof_fuse.host.attached import Lease, NamespaceShape

    return Lease(qids=(3, 4), cntlid=1, queue_size=32, in_capsule_bytes=0, max_transfer=4096,
                 namespaces=(NamespaceShape(1, 512, 64, generation),))


def run_attached(leases: list, test) -> None:
    """``test(ctrl, target)`` on queues attached to tests/fabric_fakes.py's target, leased
    from ``leases`` in turn (the last one again and again)."""
    import trio
    import trio.testing
    from fabric_fakes import FakeTarget, FakeTransport

    from nvmeof_fuse.host.attached import attach
    from nvmeof_fuse.host.controller import ConnectOptions

    async def source():
        return leases.pop(0) if len(leases) > 1 else leases[0]

    async def main() -> None:
        target = FakeTarget(512, 64)
        target.disk[:512] = b"A" * 512
        opts = ConnectOptions("192.0.2.1", "nqn.2014-08.org.example:t", keep_alive_tmo=0,
                              reconnect_delay=1, ctrl_loss_tmo=10, nr_io_queues=2,
                              companion_queues=0)
        async with attach(opts, source, FakeTransport(target)) as ctrl:
            await test(ctrl, target)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_namespace_the_renewed_lease_names_by_another_generation_refuses_io():
    """The owner replaced n1 while our queues were revoked: we learn it from the lease,
    before our queues connect again, and n1 (what a File opened) refuses I/O from then on,
    while the target would serve the new one's data."""
    from nvmeof_fuse.errors import NamespaceReplaced, TransportError

    async def test(ctrl, target) -> None:
        ns = ctrl.namespaces[1]
        assert await ns.read_lbas(0, 1) == b"A" * 512
        told = []
        ctrl.events.replaced_listeners.append(
            lambda nsid, old, new: told.append((nsid, list(ctrl.io_queues))))
        target.disk[:512] = b"B" * 512
        ctrl.connection_lost(ctrl.io_queues[0], TransportError("revoked"))
        with pytest.raises(NamespaceReplaced, match="namespace n1 was replaced by another"):
            await ns.read_lbas(0, 1)
        assert told == [(1, [])]  # told while none of our queues was connected
        assert ctrl.namespaces[1] is ns and ctrl.reconnects == 1

    run_attached([lease(0), lease(1)], test)


def test_a_namespace_a_first_lease_names_as_gone_refuses_io_at_once():
    from nvmeof_fuse.errors import NamespaceReplaced
    from nvmeof_fuse.host.attached import GONE

    async def test(ctrl, target) -> None:
        with pytest.raises(NamespaceReplaced):
            await ctrl.namespaces[1].read_lbas(0, 1)

    run_attached([lease(GONE)], test)
