"""A command overdue on an I/O queue has a Keep Alive sent at once (issue #49, item 5).

Over RDMA the target's disconnect does not reach us: the commands it dropped wait with
their SENDs acknowledged, and only a SEND that goes unacknowledged fails the queue (the
QP's retry limit).  The probe brings such a SEND long before the next keep-alive; a target
that is merely slow answers it, and nothing fails over.  The controller is the real one; the
transport is tests/fabric_fakes.py's, with a dead connection that fails a SEND posted on it
after ``RETRY_S``, and trio's clock jumps over the waits.
"""

from __future__ import annotations

from types import SimpleNamespace

import trio
import trio.testing
from fabric_fakes import FakeQueue, FakeTarget, FakeTransport

from nvmeof_fuse.errors import TransportError
from nvmeof_fuse.host.controller import PROBES_IN_FLIGHT, ConnectOptions, Controller
from nvmeof_fuse.host.namespace import Namespace
from nvmeof_fuse.host.state import CONNECTING, LIVE

NQN = "nqn.2014-08.org.example:probe"
LBA = 512
PROBE_AFTER = 0.5
RETRY_S = 0.8  # a SEND on a dead connection fails this long after it was posted
KEEP_ALIVE = 0x18


class RcQueue(FakeQueue):
    """A queue as an RC QP sees it: while the target is away, nothing is answered and a
    SEND posted then fails the queue after RETRY_S (retry-exceeded); a slow target answers
    each command ``delay`` s late."""

    def _post(self, sqe, data, done=None):
        if not self.qid:
            self.target.admin_opcodes.append(sqe[0])  # as sent, answered or not
        return super()._post(sqe, data, done)

    def oldest_command(self):
        for request in self.pending.values():
            return request
        return None

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with trio.open_nursery() as answering:  # each command in its own time
            async for request in self._receive:
                if not self.target.up:
                    await trio.sleep(RETRY_S)
                    self.fail(TransportError(f"{self.name}: work request failed: transport "
                                             "retry counter exceeded"))
                    continue
                answering.start_soon(self._answer, request)

    async def _answer(self, request) -> None:
        await trio.sleep(self.target.delay)
        if self.failed is None and self.target.up:  # else acknowledged, never answered
            request.completion = self.target.run(request.sqe, request.data, admin=not self.qid)
            self._finish(request)


class RcTarget(FakeTarget):
    def __init__(self) -> None:
        super().__init__(LBA, 4096)
        self.delay = 0.001
        self.admin_opcodes: list[int] = []  # sent on the admin queue


class RcTransport(FakeTransport):
    probe_after = PROBE_AFTER

    async def connect_queue(self, nursery, qid, size, in_capsule_bytes=0, cntlid=0):
        await trio.sleep(0.001)
        queue = RcQueue(self.target, self, qid, size)
        self.queues.append(queue)
        await nursery.start(queue.serve)
        return queue


async def live_controller(nursery: trio.Nursery, target: RcTarget, kato: float) -> Controller:
    """A live controller with one I/O queue and n1, its keep-alive (if ``kato``) and its
    probe running, as Controller.start leaves them."""
    transport = RcTransport(target)
    ctrl = Controller(ConnectOptions("192.0.2.1", NQN, keep_alive_tmo=kato, reconnect_delay=60,
                                     ctrl_loss_tmo=600), transport, nursery)
    ctrl.admin = await transport.connect_queue(nursery, 0, 32)
    ctrl.io_queues = [await transport.connect_queue(nursery, 1, 32)]
    ctrl.max_transfer = 16384
    ctrl.bounce = ctrl.new_bounce_pool(16384, 4)
    ctrl.namespaces[1] = Namespace(ctrl, 1, SimpleNamespace(lba_size=LBA, nsze=target.nlb))
    assert ctrl._change_state(CONNECTING) and ctrl._change_state(LIVE)
    await nursery.start(ctrl.supervise)
    if kato:
        nursery.start_soon(ctrl._keep_alive, kato)
    nursery.start_soon(ctrl._probe_when_overdue, transport.probe_after)
    return ctrl


def run(main) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_connection_lost_under_a_waiting_command_is_noticed_before_the_next_keep_alive():
    target = RcTarget()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ctrl = await live_controller(nursery, target, kato=5.0)
            target.delay = 0.2
            nursery.start_soon(ctrl.namespaces[1].read, 0, 4096)
            await trio.sleep(0.1)
            start = trio.current_time()
            target.go_away()  # the read was acknowledged and is never answered
            while not ctrl.losses:
                await ctrl.wait_changed()
            noticed = trio.current_time() - start
            # probe_after (and a look's lag), then the probe's SEND fails: long before the
            # first keep-alive (kato / 2) would even have gone out
            assert noticed < PROBE_AFTER * 1.25 + RETRY_S + 0.1 < 5.0 / 2, noticed
            assert "probe after a command waited 0.5 s" in ctrl._lost_reason
            assert "retry counter exceeded" in ctrl._lost_reason
            nursery.cancel_scope.cancel()

    run(main)


def test_a_slow_target_answers_the_probes_and_nothing_is_lost():
    target = RcTarget()
    target.delay = 3.0  # every command waits past probe_after, the probes too

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ctrl = await live_controller(nursery, target, kato=5.0)
            data = await ctrl.namespaces[1].read(0, 4096)
            assert len(data) == 4096
            assert ctrl.losses == 0 and ctrl.state is LIVE
            probes = target.admin_opcodes.count(KEEP_ALIVE)
            assert probes >= 1, target.admin_opcodes
            # one per probe_after at most while the read waited (about 3 s)
            assert probes <= 3.5 / PROBE_AFTER, probes
            target.delay = 0.001
            await trio.sleep(5)  # the last probes are answered too
            assert ctrl.losses == 0
            nursery.cancel_scope.cancel()

    run(main)


def test_an_idle_controller_sends_no_probe():
    target = RcTarget()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ctrl = await live_controller(nursery, target, kato=0)
            await ctrl.namespaces[1].read(0, 4096)
            await trio.sleep(30)
            assert target.admin_opcodes.count(KEEP_ALIVE) == 0
            assert ctrl.losses == 0
            nursery.cancel_scope.cancel()

    run(main)


def test_a_slow_target_holds_at_most_probes_in_flight_and_more_than_one():
    target = RcTarget()
    target.delay = 10.0  # each probe waits as long as the read: without a cap ~20 would pile up

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ctrl = await live_controller(nursery, target, kato=0)  # only probes send Keep Alive
            most = 0

            async def watch_admin() -> None:
                nonlocal most
                while True:
                    waiting = sum(1 for request in ctrl.admin.pending.values()
                                  if request.sqe[0] == KEEP_ALIVE)
                    most = max(most, waiting)
                    await trio.sleep(0.05)

            nursery.start_soon(watch_admin)
            data = await ctrl.namespaces[1].read(0, 4096)
            assert len(data) == 4096
            assert most == PROBES_IN_FLIGHT > 1, most
            assert target.admin_opcodes.count(KEEP_ALIVE) == PROBES_IN_FLIGHT
            target.delay = 0.001
            await trio.sleep(15)  # the probes are answered, and no more go out when idle
            assert ctrl.losses == 0 and ctrl.state is LIVE
            assert not any(request.sqe[0] == KEEP_ALIVE for request in ctrl.admin.pending.values())
            nursery.cancel_scope.cancel()

    run(main)
