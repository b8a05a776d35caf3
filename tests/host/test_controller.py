"""Controller: losing the connection, reconnecting, giving up (queues and bring-up faked).

The bring-up itself is exercised against the real target (tests/testbed); here the
admin and I/O queue connects are stand-ins, and trio's clock jumps over the delays.
"""

from __future__ import annotations

import errno
import logging
import math
import struct
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from nvmeof_fuse import nvme
from nvmeof_fuse.errors import (
    CommandTimeout,
    ConnectError,
    ControllerLost,
    NVMeoFError,
    TargetProtocolError,
    TransportError,
)
from nvmeof_fuse.host.controller import (
    IO_RETRIES,
    LOG_PAGE_MAX,
    RETRY_DELAY_MAX,
    SHUTDOWN_TIMEOUT_CAP,
    ConnectOptions,
    Controller,
    give_up_time,
    shutdown_wait,
    try_deadline,
)
from nvmeof_fuse.host.memory import BouncePool
from nvmeof_fuse.host.state import CONNECTING, DEAD, LIVE, RESETTING
from nvmeof_fuse.nvme import Completion, NVMeStatusError
from nvmeof_fuse.nvme import command as cmd
from nvmeof_fuse.transport.parking import unsent

OK = Completion(0, 0, 1, 0, 0, True)


class FakeQueue:
    """Answers every command, or fails each with ``error``; counts what it ran."""

    def __init__(self, qid: int, error: Exception | None = None) -> None:
        self.qid = qid
        self.size = 32
        self.available = 31
        self.connect_cattr = 0
        self.error = error
        self.ran = 0

    async def execute(self, sqe, data=None, *, to_controller=False, timeout):
        await trio.sleep(0.01)
        self.ran += 1
        if self.error is not None:
            raise self.error
        return OK

    def cut_timeouts(self, deadline: float) -> None:
        pass  # (its commands take 10 ms)


class FakeTransport:
    address = "rdma 192.0.2.1:4420"

    def __init__(self) -> None:
        self.drops = 0

    async def drop_queues(self) -> None:
        self.drops += 1


class Target:
    """Where reconnects land: refused ``refusals`` times, then new working queues."""

    def __init__(self, refusals: int = 0) -> None:
        self.refusals = refusals
        self.connects = 0

    def attach(self, ctrl: Controller) -> None:
        async def connect_admin() -> None:
            self.connects += 1
            if self.connects <= self.refusals:
                raise TransportError("connect refused")
            ctrl.admin = FakeQueue(0)

        async def connect_io_queues() -> None:
            ctrl.io_queues = [FakeQueue(1), FakeQueue(2)]

        ctrl._connect_admin = connect_admin
        ctrl._connect_io_queues = connect_io_queues


def run(test, **options) -> None:
    async def main() -> None:
        opts = ConnectOptions("192.0.2.1", "nqn.2014-08.org.example:t",
                              **{"keep_alive_tmo": 0, "reconnect_delay": 10, **options})
        async with trio.open_nursery() as nursery:
            ctrl = Controller(opts, FakeTransport(), nursery)
            ctrl.admin = FakeQueue(0)
            ctrl.io_queues = [FakeQueue(1, TransportError("work request failed: retry "
                                                          "counter exceeded"))]
            assert ctrl._change_state(CONNECTING) and ctrl._change_state(LIVE)
            await nursery.start(ctrl.supervise)
            await test(ctrl)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_io_waits_for_the_reconnect_and_runs_on_the_new_queues():
    async def test(ctrl: Controller) -> None:
        lost = ctrl.io_queues[0]
        target = Target(refusals=2)
        target.attach(ctrl)
        start = trio.current_time()
        completion = await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        assert completion.ok and ctrl.state is LIVE
        assert lost.ran == 1 and target.connects == 3  # two refused, the third took
        assert trio.current_time() - start == pytest.approx(30, abs=1)  # three delays
        assert sum(q.ran for q in ctrl.io_queues) == 1 and ctrl.transport.drops == 3
        assert ctrl.connection_snapshot() == {"state": "live", "cntlid": 0, "losses": 1,
                                              "reconnects": 1}

    run(test)


def test_the_snapshot_shows_the_bounce_pool():
    async def test(ctrl: Controller) -> None:
        ctrl.bounce = BouncePool(lambda addr, length, owner: None, 4096, 3)
        region = await ctrl.bounce.take()
        snapshot = ctrl.connection_snapshot()
        assert {k: v for k, v in snapshot.items() if k.startswith("bounce_")} == \
            {"bounce_free": 2, "bounce_lent": 1, "bounce_held": 0, "bounce_waiters": 0}
        ctrl.bounce.give(region)

    run(test)


def test_a_timeout_reconnects_too_and_new_io_waits_meanwhile():
    async def test(ctrl: Controller) -> None:
        ctrl.io_queues = [FakeQueue(1, CommandTimeout("I/O queue 1: command 3 got no "
                                                      "completion within 30 s"))]
        Target().attach(ctrl)
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(ctrl.io_command, cmd.read(1, 0, 1, bytes(16)))
            await trio.sleep(1)
            assert ctrl.state is not LIVE
            await ctrl.io_command(cmd.flush(1))  # a new command waits too
        assert ctrl.state is LIVE and ctrl.transport.drops == 1  # one reconnect for all

    run(test)


# -- commands that fail with a status: run again as the kernel's nvme_decide_disposition ----------

INTERNAL_ERROR = 0x06  # generic status, no DNR
DNR = 1 << 14


class AnswerThenFail(FakeQueue):
    """Answers its first command with ``status``; then its connection is gone (every
    command fails).  With ``noticed``, the loss is known before the answer is read (a
    keep-alive or another queue reported it meanwhile)."""

    def __init__(self, qid: int, status: int, ctrl: Controller | None = None) -> None:
        super().__init__(qid)
        self.status = status
        self.ctrl = ctrl

    async def execute(self, sqe, data=None, *, to_controller=False, timeout):
        await trio.sleep(0.01)
        self.ran += 1
        if self.ran > 1:
            raise TransportError("I/O queue 1: work request failed: retry counter exceeded")
        if self.ctrl is not None:
            self.ctrl.connection_lost(self, TransportError("keep-alive: no answer"))
        return Completion(0, 0, 1, 0, self.status, True)


@pytest.mark.parametrize("noticed", [False, True], ids=["loss-after", "loss-known"])
def test_an_error_status_on_a_failing_connection_runs_again_after_the_reconnect(noticed):
    async def test(ctrl: Controller) -> None:
        failing = AnswerThenFail(1, INTERNAL_ERROR, ctrl if noticed else None)
        ctrl.io_queues = [failing]
        Target().attach(ctrl)
        completion = await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        assert completion.ok and ctrl.state is LIVE
        assert ctrl.reconnects == 1 and sum(q.ran for q in ctrl.io_queues) == 1
        assert failing.ran == (1 if noticed else 2)  # not run there again once known lost

    run(test)


def test_a_dnr_status_reaches_the_caller_at_once():
    async def test(ctrl: Controller) -> None:
        failing = AnswerThenFail(1, DNR | INTERNAL_ERROR, ctrl)
        ctrl.io_queues = [failing]
        Target().attach(ctrl)
        start = trio.current_time()
        with pytest.raises(NVMeStatusError, match=r"Internal Error \(sct 0x0, sc 0x06, dnr\)"):
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        assert failing.ran == 1 and trio.current_time() - start < 1  # no retry, no wait

    run(test)


class Statuses(FakeQueue):
    """Answers with these statuses in turn, then successfully."""

    def __init__(self, qid: int, *statuses: int) -> None:
        super().__init__(qid)
        self.statuses = list(statuses)
        self.times: list[float] = []

    async def execute(self, sqe, data=None, *, to_controller=False, timeout):
        self.times.append(trio.current_time())
        self.ran += 1
        status = self.statuses.pop(0) if self.statuses else 0
        return Completion(0, 0, 1, 0, status, True)


def test_a_command_retry_delay_is_ignored_since_we_never_enable_acre():
    """A status's CRD counts only once the host set ACRE (Host Behavior Support), which we
    never do: the command runs again at once, whatever CRDT1 says."""
    async def test(ctrl: Controller) -> None:
        ctrl.identify = SimpleNamespace(crdt=(0xFFFF, 0, 0))  # CRDT1: 109 minutes
        queue = Statuses(1, 1 << 11 | INTERNAL_ERROR, INTERNAL_ERROR)  # CRD 1, then CRD 0
        ctrl.io_queues = [queue]
        assert not ctrl.acre
        assert (await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))).ok
        assert queue.ran == 3 and ctrl.state is LIVE and ctrl.losses == 0
        t = queue.times
        assert [t[1] - t[0], t[2] - t[1]] == [0, 0]

    run(test)


def test_a_command_retry_delay_would_be_capped_with_acre():
    async def test(ctrl: Controller) -> None:
        ctrl.identify = SimpleNamespace(crdt=(3, 0xFFFF, 0))  # CRDT1 300 ms, CRDT2 109 min
        ctrl.acre = True
        assert ctrl.retry_delay(1) == pytest.approx(0.3)
        assert ctrl.retry_delay(2) == RETRY_DELAY_MAX
        assert ctrl.retry_delay(0) == ctrl.retry_delay(3) == 0

    run(test)


def test_an_error_status_gives_up_after_nvme_max_retries():
    async def test(ctrl: Controller) -> None:
        queue = Statuses(1, *[INTERNAL_ERROR] * 10)
        ctrl.io_queues = [queue]
        with pytest.raises(NVMeStatusError, match="Internal Error"):
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        assert queue.ran == IO_RETRIES

    run(test)


def test_a_path_related_status_waits_for_the_path_before_it_runs_again():
    async def test(ctrl: Controller) -> None:
        queue = Statuses(1, 3 << 8 | 0x02)  # Asymmetric Access Inaccessible
        ctrl.io_queues = [queue]
        assert (await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))).ok
        assert queue.times[1] - queue.times[0] == pytest.approx(10)  # --reconnect-delay

    run(test)


def test_a_command_whose_connection_keeps_failing_gives_up_after_nvme_max_retries(caplog):
    """A lost connection counts a try, as the kernel counts a command aborted with its
    connection: a command that breaks the connection each time it goes out (a target's
    protocol violation) ends in EIO, logged once with the target's fault."""
    async def test(ctrl: Controller) -> None:
        lost = TransportError("I/O queue 1: C2HData for command 125 names bytes 4096+4096, "
                              "past its 4096-byte buffer")
        ran = []

        async def connect_io_queues() -> None:
            ctrl.io_queues = [FakeQueue(1, lost)]
            ran.append(ctrl.io_queues[0])

        Target().attach(ctrl)
        ctrl._connect_io_queues = connect_io_queues
        with pytest.raises(TransportError) as info:
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        assert info.value.errno == errno.EIO
        assert str(info.value) == (
            f"Read failed: its connection failed under each of its {IO_RETRIES} tries (the "
            f"last: {lost})")
        assert sum(q.ran for q in ran) == IO_RETRIES - 1  # and once on the first queue
        assert [r.message for r in caplog.records if "Read failed" in r.message] == [
            str(info.value)]
        assert await ctrl.wait_connected()  # the mount goes on

    run(test)


def test_a_command_that_never_went_out_costs_no_try():
    async def test(ctrl: Controller) -> None:
        rounds = []

        async def connect_io_queues() -> None:
            rounds.append(len(rounds))
            fail = len(rounds) <= IO_RETRIES + 1
            ctrl.io_queues = [FakeQueue(1, unsent(TransportError("I/O queue 1 is closed"))
                                        if fail else None)]

        Target().attach(ctrl)
        ctrl.io_queues = [FakeQueue(1, unsent(TransportError("I/O queue 1 is closed")))]
        ctrl._connect_io_queues = connect_io_queues
        assert (await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))).ok
        assert ctrl.reconnects == IO_RETRIES + 2

    run(test)


def test_a_connection_that_keeps_failing_right_after_each_reconnect_is_one_outage():
    """Each good reconnect restarted --ctrl-loss-tmo, so a target that broke the connection
    again each time was reconnected to for ever: the outage's whole length counts."""
    async def test(ctrl: Controller) -> None:
        lost = TransportError("I/O queue 1: the controller ended the connection with a "
                              "C2HTermReq")

        async def connect_io_queues() -> None:
            ctrl.io_queues = [FakeQueue(1, lost)]

        Target().attach(ctrl)
        ctrl._connect_io_queues = connect_io_queues
        start = trio.current_time()
        with pytest.raises(ControllerLost, match=r"gave up after .* \(--ctrl-loss-tmo 25\)"):
            for _ in range(10):  # commands of several callers, one after another
                with pytest.raises(TransportError):
                    await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        assert ctrl.state is DEAD
        assert trio.current_time() - start < 25 + 2 * 10  # its last reconnect delay at most

    run(test, ctrl_loss_tmo=25)


def test_a_connection_that_held_starts_a_new_outage():
    async def test(ctrl: Controller) -> None:
        for _ in range(4):  # 4 losses, 10 s each, 60 s apart: more than --ctrl-loss-tmo 25
            Target().attach(ctrl)
            ctrl.io_queues = [FakeQueue(1, TransportError("gone"))]
            assert (await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))).ok
            await trio.sleep(60)
        assert ctrl.state is LIVE and ctrl.reconnects == 4

    run(test, ctrl_loss_tmo=25)


def test_a_command_that_keeps_timing_out_gives_up_after_nvme_max_retries():
    async def test(ctrl: Controller) -> None:
        late = CommandTimeout("I/O queue 1: command 3 got no completion within 30 s")
        ran = []

        async def connect_io_queues() -> None:
            ctrl.io_queues = [FakeQueue(1, late)]
            ran.append(ctrl.io_queues[0])

        ctrl.io_queues = [FakeQueue(1, late)]
        Target().attach(ctrl)
        ctrl._connect_io_queues = connect_io_queues
        with pytest.raises(CommandTimeout):
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        assert sum(q.ran for q in ran) == IO_RETRIES - 1  # and once on the first queue

    run(test)


def test_io_fails_by_name_once_ctrl_loss_tmo_has_passed():
    async def test(ctrl: Controller) -> None:
        Target(refusals=100).attach(ctrl)
        with pytest.raises(ControllerLost) as info:
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        assert ctrl.state is DEAD
        message = str(info.value)
        assert message.startswith("the connection to nqn.2014-08.org.example:t at rdma "
                                  "192.0.2.1:4420 was lost (")
        # tries at 10, 20 and 25 s: the last at the end of --ctrl-loss-tmo, not past it
        assert "gave up after 3 reconnects in 25 s (--ctrl-loss-tmo 25)" in message
        with pytest.raises(ControllerLost):  # and at once from now on
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))

    run(test, ctrl_loss_tmo=25)


def test_ctrl_loss_tmo_0_fails_io_without_reconnecting():
    async def test(ctrl: Controller) -> None:
        target = Target()
        target.attach(ctrl)
        with pytest.raises(ControllerLost, match=r"reconnecting is off \(--ctrl-loss-tmo 0\)"):
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        assert target.connects == 0

    run(test, ctrl_loss_tmo=0)


def test_fast_io_fail_tmo_fails_io_while_reconnecting_goes_on():
    async def test(ctrl: Controller) -> None:
        Target(refusals=3).attach(ctrl)
        start = trio.current_time()
        with pytest.raises(ControllerLost,
                           match=r"failing I/O while reconnecting \(--fast-io-fail-tmo 5\)"):
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        assert trio.current_time() - start == pytest.approx(5, abs=1)
        with pytest.raises(ControllerLost):  # new I/O fails at once
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        while ctrl.state is not LIVE:  # the fourth reconnect takes
            await trio.sleep(1)
        assert (await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))).ok

    run(test, fast_io_fail_tmo=5)


def test_admin_commands_while_reconnecting_fail_by_name():
    async def test(ctrl: Controller) -> None:
        ctrl.admin = None
        assert ctrl._change_state(RESETTING) and ctrl._change_state(CONNECTING)
        with pytest.raises(TransportError, match="the admin queue to nqn.2014-08.org.example:t "
                                                 r"is not connected \(the controller is "
                                                 r"connecting\)"):
            await ctrl.admin_command(cmd.flush(1))

    run(test)


def test_closing_wakes_waiters_with_the_reason():
    async def test(ctrl: Controller) -> None:
        Target(refusals=100).attach(ctrl)

        async def close_soon() -> None:
            await trio.sleep(15)
            ctrl.close_state("the controller of nqn.2014-08.org.example:t is closed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_soon)
            with pytest.raises(ControllerLost, match="is closed"):
                await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))

    run(test)


class RefusingTransport:
    """A target that answers the admin queue's Connect with Connect Invalid Host, DNR set."""

    address = "rdma 192.0.2.1:4420"
    name = "rdma"

    def __init__(self) -> None:
        self.queues: list[FakeQueue] = []

    def register(self, addr, length, owner):
        return FakeRegistration()

    async def connect_queue(self, nursery, qid, size, in_capsule_bytes=0, cntlid=0):
        queue = RefusingQueue(qid)
        self.queues.append(queue)
        return queue

    async def drop_queues(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeRegistration:
    lkey = rkey = 1

    def keys(self, domain):
        return self

    def close(self) -> None:
        pass


class RefusingQueue(FakeQueue):
    async def execute(self, sqe, data=None, *, to_controller=False, timeout):
        self.ran += 1
        dnr_invalid_host = 1 << 14 | 1 << 8 | 0x84  # DNR, SCT 1 (command specific), SC 0x84
        return Completion(0, 0, 0, 0, dnr_invalid_host, True)


def test_a_connect_refused_with_dnr_fails_at_once_by_name(monkeypatch):
    from nvmeof_fuse.errors import ConnectError
    from nvmeof_fuse.host import controller

    transport = RefusingTransport()
    monkeypatch.setattr(controller, "make_transport", lambda options: transport)

    async def main() -> None:
        start = trio.current_time()
        opts = ConnectOptions("192.0.2.1", "nqn.2014-08.org.example:t")
        with pytest.raises(ConnectError, match=r"nqn.2014-08.org.example:t\) failed: Connect "
                                               r"failed: Connect Invalid Host .*dnr"):
            async with controller.connect(opts):
                pass
        assert trio.current_time() == start  # no delay, no retry
        assert [q.ran for q in transport.queues] == [1]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -- when reconnecting stops early (host/reconnect_policy.py decides; see its tests) -----------


def connect_failed(status: int) -> ConnectError:
    """A Connect answered with ``status``, as _fabrics_connect raises it."""
    from nvmeof_fuse.nvme import NVMeStatusError

    try:
        raise ConnectError("connect to rdma 192.0.2.1:4420 failed: "
                           f"{NVMeStatusError(status, 'Connect', fabrics=True)}") \
            from NVMeStatusError(status, "Connect", fabrics=True)
    except ConnectError as exc:
        return exc


def run_reconnects(failure: Exception, **options):
    """Lose the connection; every reconnect fails with ``failure``; how it ended."""
    outcome = {}

    async def test(ctrl) -> None:
        target = Target()
        target.attach(ctrl)

        async def refused() -> None:
            target.connects += 1
            raise failure

        ctrl._connect_admin = refused
        with pytest.raises(ControllerLost) as info:
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        outcome.update(message=str(info.value), connects=target.connects, state=ctrl.state)

    run(test, **options)
    return outcome


def test_a_connect_refused_with_dnr_stops_reconnecting_by_name():
    outcome = run_reconnects(connect_failed(DNR | 1 << 8 | 0x84), ctrl_loss_tmo=600)
    assert outcome["connects"] == 1 and outcome["state"] is DEAD
    assert outcome["message"].endswith(
        "; stopped reconnecting: connect to rdma 192.0.2.1:4420 failed: Connect failed: "
        "Connect Invalid Host (sct 0x1, sc 0x84, dnr)")


def test_a_rejected_secret_stops_reconnecting_by_name():
    from nvmeof_fuse.host.auth import AuthenticationError

    rejected = AuthenticationError("rdma 192.0.2.1:4420 (sub): authentication of queue 0 "
                                   "failed: Authentication failed (0x01)", final=True)
    outcome = run_reconnects(rejected, ctrl_loss_tmo=600)
    assert outcome["connects"] == 1
    assert "stopped reconnecting: rdma 192.0.2.1:4420 (sub): authentication of queue 0 " \
           "failed: Authentication failed (0x01)" in outcome["message"]


def test_a_subsystem_off_the_port_is_retried_until_ctrl_loss_tmo():
    outcome = run_reconnects(connect_failed(DNR | 1 << 8 | 0x82), ctrl_loss_tmo=25)
    assert outcome["connects"] == 3 and "gave up after 3 reconnects" in outcome["message"]


def test_small_commands_share_the_first_queue_with_room_and_large_ones_spread():
    """One reaper takes a burst of small completions in one pass; large transfers go to
    several queues, so that the target moves their data at once."""
    from nvmeof_fuse.host.controller import SPREAD_BYTES

    ctrl = object.__new__(Controller)
    ctrl.io_queues = [FakeQueue(1), FakeQueue(2), FakeQueue(3)]
    ctrl._next_queue = 0
    assert {ctrl.pick_queue(4096).qid for _ in range(8)} == {1}
    assert ctrl.pick_queue().qid == 1  # no data: an I/O command like Flush
    ctrl.io_queues[0].available = 0  # full: the next one with a free slot
    assert ctrl.pick_queue(4096).qid == 2
    ctrl.io_queues[0].available = 31
    assert [ctrl.pick_queue(SPREAD_BYTES).qid for _ in range(3)] == [2, 3, 1]  # round-robin
    ctrl.io_queues[2].available = 40
    assert ctrl.pick_queue(1 << 20).qid == 3  # the most free slots


def test_secret_files_are_read_again_at_each_connect(tmp_path):
    """A key rotated in its file is used from the next (re)connect on; a file made readable
    by others since is refused then, by name, and reconnecting goes on (not final)."""
    from nvmeof_fuse.errors import InvalidArgument
    from nvmeof_fuse.host.reconnect_policy import final_failure
    from nvmeof_fuse.nvme import auth

    key = tmp_path / "key"
    key.write_text(auth.format_secret(bytes(32), 1))
    key.chmod(0o600)

    class Unreachable(FakeTransport):
        async def connect_queue(self, nursery, qid, size):
            raise TransportError("connect refused")

    async def main() -> None:
        opts = ConnectOptions("192.0.2.1", "nqn.2014-08.org.example:t", dhchap_secret=str(key))
        async with trio.open_nursery() as nursery:
            ctrl = Controller(opts, Unreachable(), nursery)
            first = ctrl.dhchap._host_key
            key.write_text(auth.format_secret(bytes(range(32)), 1))
            with pytest.raises(TransportError):
                await ctrl._connect_admin()
            assert ctrl.dhchap._host_key != first
            key.chmod(0o644)
            with pytest.raises(InvalidArgument, match=f"file {key}: permissions 0644") as info:
                await ctrl._connect_admin()
            assert not final_failure(info.value)

    trio.run(main)


def test_once_the_mount_stops_a_command_waiting_for_a_reconnect_fails_at_once():
    """SIGTERM waited 62 s on a command caught retrying: wind_down ends its wait."""
    async def test(ctrl: Controller) -> None:
        Target(refusals=100).attach(ctrl)  # each reconnect fails: the command would wait
        failed = []

        async def reader() -> None:
            try:
                await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
            except ControllerLost as exc:
                failed.append((trio.current_time(), str(exc)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(25)
            assert not failed and ctrl.state is CONNECTING
            stopped = trio.current_time()
            ctrl.wind_down("/mnt is being unmounted", stopped + 9)
        assert failed == [(stopped, "/mnt is being unmounted (the connection was lost: "
                                    "work request failed: retry counter exceeded)")]

    run(test)


class SilentIo(FakeQueue):
    """An I/O queue whose target never answers: each command times out, by its timeout or
    by a cut (cut_timeouts), whichever comes first."""

    def __init__(self, qid: int) -> None:
        super().__init__(qid)
        self.waits: list[tuple[float, trio.CancelScope]] = []  # (its timeout, its wait)
        self.cuts: list[float] = []

    async def execute(self, sqe, data=None, *, to_controller=False, timeout):
        with trio.CancelScope(deadline=trio.current_time() + timeout, shield=True) as scope:
            self.waits.append((timeout, scope))
            await trio.sleep_forever()
        raise CommandTimeout(f"I/O queue {self.qid}: command 1 got no completion within "
                             f"{timeout:g} s")

    def cut_timeouts(self, deadline: float) -> None:
        self.cuts.append(deadline)
        for _, scope in self.waits:
            scope.deadline = min(scope.deadline, deadline)


def test_winding_down_cuts_the_io_commands_in_flight_and_sent_after_to_its_deadline():
    """Issue #56: SIGTERM waited 30 s for a final Flush the target never answered, the
    command timeout.  From wind_down on, every I/O command ends by the mount's deadline:
    those in flight (the queue cuts them) and those sent after (their timeouts are cut, as a
    reconnect try's are); each then fails at once, not waiting for a reconnect."""
    async def test(ctrl: Controller) -> None:
        ctrl.io_queues = [queue := SilentIo(1)]
        ended = []

        async def command() -> None:
            try:
                await ctrl.io_command(cmd.flush(1))
            except (CommandTimeout, ControllerLost) as exc:
                ended.append((trio.current_time(), type(exc).__name__))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(command)  # in flight when the mount stops: 30 s ahead of it
            await trio.sleep(2)
            ctrl.wind_down("/mnt is being unmounted", 11)
            assert queue.cuts == [11]
            await trio.sleep(1)
            nursery.start_soon(command)  # sent after: 8 s left
        assert [timeout for timeout, _ in queue.waits] == [30, 8]
        assert ended == [(pytest.approx(11), "ControllerLost")] * 2
        assert ctrl.state is not LIVE  # the timeout cost the connection, as any timeout

    run(test)


def test_the_shutdown_after_winding_down_keeps_its_own_timeout():
    """The mount's deadline cuts what comes before the orderly shutdown, not the shutdown:
    it waits its whole shutdown timeout after, and then the mount's deadline holds again."""
    async def test(ctrl: Controller) -> None:
        ctrl.admin = ShutdownQueue("never")
        ctrl.cap = SimpleNamespace(timeout_ms=127_500)
        ctrl.identify = SimpleNamespace(rtd3e=0)
        ctrl.wind_down("/mnt is being unmounted", 9)
        assert ctrl.command_timeout() == 9
        await trio.sleep(9)
        await ctrl.shutdown("unmounting")
        assert trio.current_time() == pytest.approx(14, abs=0.1)
        assert ctrl.shutdown_note == "shutdown not confirmed within 5 s (CSTS.SHST not set)"
        assert ctrl.command_timeout() == pytest.approx(0.01)  # the mount's, long passed

    run(test)


class LogQueue(FakeQueue):
    """Answers Get Log Page with bytes counting up from each command's offset."""

    def __init__(self) -> None:
        super().__init__(0)
        self.asked: list[tuple[int, int]] = []

    async def execute(self, sqe, data=None, *, to_controller=False, timeout):
        numd = struct.unpack_from("<H", sqe, 42)[0] | struct.unpack_from("<H", sqe, 44)[0] << 16
        offset, length = struct.unpack_from("<Q", sqe, 48)[0], (numd + 1) * 4
        self.asked.append((offset, length))
        assert data.length == length
        data.region.view[data.offset:data.offset + length] = bytes(
            (offset + i) % 251 for i in range(length))
        return OK


def test_a_log_page_past_mdts_is_read_in_pieces_and_one_past_the_cap_is_refused():
    async def test(ctrl: Controller) -> None:
        ctrl.transport.register = lambda addr, length, owner: None
        ctrl.admin = queue = LogQueue()
        ctrl.max_transfer = 4096
        page = await ctrl.get_log_page(0x70, 10240)
        assert queue.asked == [(0, 4096), (4096, 4096), (8192, 2048)]
        assert page == bytes(i % 251 for i in range(10240))
        with pytest.raises(TargetProtocolError, match=r"log page 0x70 of \d+ bytes is refused"):
            await ctrl.get_log_page(0x70, LOG_PAGE_MAX + 4)
        assert len(queue.asked) == 3

    run(test)


@pytest.mark.parametrize("entries, maxcmd, said", [(1, 128, "CAP.MQES 0, MAXCMD 128"),
                                                    (128, 1, "CAP.MQES 127, MAXCMD 1")])
def test_queues_of_one_entry_are_refused_in_one_line(entries, maxcmd, said):
    async def test(ctrl: Controller) -> None:
        ctrl.cap = SimpleNamespace(max_queue_entries=entries)
        ctrl.identify = SimpleNamespace(maxcmd=maxcmd)
        with pytest.raises(ConnectError) as refused:
            ctrl.io_queue_size()
        assert str(refused.value) == (f"rdma 192.0.2.1:4420: the controller allows I/O queues "
                                      f"of 1 entry ({said}); at least 2 are needed")

    run(test)


# -- giving up within --ctrl-loss-tmo (issue #56 item 7) ----------------------------------------


def test_the_give_up_time_and_each_tries_deadline():
    assert give_up_time(100.0, 5) == 105.0
    assert give_up_time(100.0, -1) == math.inf and give_up_time(100.0, 0) == 100.0
    assert try_deadline(101.0, 105.0, 10) == 111.0  # a try has one connect timeout at least
    assert try_deadline(101.0, 600.0, 10) == 600.0  # and what is left, if more
    assert try_deadline(105.0, 105.0, 10) == 115.0  # the last one: within tmo + one


class HangingTarget:
    """Accepts reconnects and then never answers: ``how`` is "transport" (a wait trio can
    cancel, as TCP's ICResp or RDMA-CM's) or "command" (a fabrics command, which cannot
    be cancelled and ends by its timeout only, as a queue's watchdog ends it)."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.tries = 0
        self.waited: list[float] = []

    def attach(self, ctrl: Controller) -> None:
        async def connect_admin() -> None:
            self.tries += 1
            start = trio.current_time()
            try:
                if self.how == "transport":
                    await trio.sleep(ctrl.options.connect_timeout)
                    raise ConnectError("no ICResp within 10 s")
                timeout = ctrl.command_timeout()
                with trio.CancelScope(shield=True):
                    await trio.sleep(timeout)
                raise CommandTimeout(f"admin queue: command 1 got no completion within "
                                     f"{timeout:g} s")
            finally:
                self.waited.append(trio.current_time() - start)

        ctrl._connect_admin = connect_admin


@pytest.mark.parametrize(("how", "ctrl_loss_tmo", "delay", "tries", "gave_up"), [
    ("transport", 5, 1, 1, 11), ("command", 5, 1, 1, 11),  # the issue's -l 5 -c 1
    ("transport", 60, 10, 3, 60), ("command", 60, 10, 2, 60),  # a command waits 30 s
    ("transport", 45, 10, 3, 55), ("command", 45, 10, 2, 55),  # the last try at 45 s
])
def test_a_target_that_never_answers_is_given_up_on_within_ctrl_loss_tmo_and_one_connect(
        how, ctrl_loss_tmo, delay, tries, gave_up):
    """Issue #56: -l 5 took 55 s (five tries, each waiting 10 s for an ICResp).  Each try's
    waits now end at the give-up time, or one connect timeout after the try began where
    that is later: the last ends within --ctrl-loss-tmo plus one connect timeout."""
    async def test(ctrl: Controller) -> None:
        target = HangingTarget(how)
        target.attach(ctrl)
        start = trio.current_time()
        with pytest.raises(ControllerLost, match=f"gave up after {tries} reconnects in "
                                                 f"{gave_up} s"):
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        took = trio.current_time() - start
        assert took == pytest.approx(gave_up, abs=0.1)
        assert took <= ctrl_loss_tmo + ctrl.options.connect_timeout + 0.1  # (+ the loss)
        assert target.tries == tries

    run(test, ctrl_loss_tmo=ctrl_loss_tmo, reconnect_delay=delay, connect_timeout=10)


def test_quick_refusals_are_tried_until_ctrl_loss_tmo_ends_the_last_at_its_end():
    async def test(ctrl: Controller) -> None:
        target = Target(refusals=100)
        target.attach(ctrl)
        start = trio.current_time()
        with pytest.raises(ControllerLost, match="gave up after 5 reconnects in 5 s"):
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))
        assert trio.current_time() - start == pytest.approx(5, abs=0.1)
        assert target.connects == 5  # at 1, 2, 3, 4 and 5 s, as Linux's ceil(5 / 1)

    run(test, ctrl_loss_tmo=5, reconnect_delay=1)


def test_a_try_cut_short_by_the_give_up_time_says_so(caplog):
    async def test(ctrl: Controller) -> None:
        async def connect_admin() -> None:
            await trio.sleep_forever()  # a wait of the transport's own, longer than left

        ctrl._connect_admin = connect_admin
        with pytest.raises(ControllerLost):
            await ctrl.io_command(cmd.read(1, 0, 1, bytes(16)))

    run(test, ctrl_loss_tmo=5, reconnect_delay=1, connect_timeout=10)
    assert ("reconnect 1 to nqn.2014-08.org.example:t failed: no answer within the 10.0 s "
            "this try had (--ctrl-loss-tmo 5)") in caplog.text


# -- an orderly shutdown within a bound (issue #56 item 3) --------------------------------------


def test_the_shutdown_wait_is_the_option_raised_by_rtd3e_up_to_a_cap():
    assert shutdown_wait(5, 0) == 5  # no RTD3E: the option
    assert shutdown_wait(5, 2_000_000) == 5  # a shorter RTD3E does not lower it (Linux)
    assert shutdown_wait(5, 8_000_000) == 8
    assert shutdown_wait(5, 60_000_000) == SHUTDOWN_TIMEOUT_CAP  # capped: 15 s to exit
    assert shutdown_wait(30, 60_000_000) == 30  # the user's own choice stands


class ShutdownQueue(FakeQueue):
    """An admin queue whose controller shuts down as ``how`` says: "done" (SHST complete),
    "never" (SHST never set), "silent" (the Property Set of CC.SHN is never answered),
    "refused" (it is answered with an error status)."""

    def __init__(self, how: str) -> None:
        super().__init__(0)
        self.how = how
        self.csts_reads = 0

    async def execute(self, sqe, data=None, *, to_controller=False, timeout):
        fctype = sqe[4]
        if fctype == 0x00 and self.how == "silent":  # Property Set
            await trio.sleep(timeout)  # (not cancellable: a command is waited for)
            raise CommandTimeout(f"admin queue: command 1 got no completion within "
                                 f"{timeout:g} s")
        await trio.sleep(0.01)
        if fctype == 0x00 and self.how == "refused":
            return Completion(0, 0, 0, 0, 0x02, True)  # Invalid Field in Command
        if fctype == 0x04:  # Property Get of CSTS
            self.csts_reads += 1
            return Completion(1 | (2 << 2 if self.how == "done" else 0), 0, 0, 0, 0, True)
        return OK


@pytest.mark.parametrize(("how", "rtd3e_us", "waited", "note"), [
    ("done", 0, 0, ""),
    ("never", 0, 5, "shutdown not confirmed within 5 s (CSTS.SHST not set)"),
    ("never", 8_000_000, 8, "shutdown not confirmed within 8 s (CSTS.SHST not set)"),
    ("never", 60_000_000, 10, "shutdown not confirmed within 10 s (CSTS.SHST not set)"),
    ("silent", 0, 5, "shutdown not confirmed within 5 s (CC.SHN unanswered)"),
    ("refused", 0, 0, "orderly shutdown failed: Property Set failed: Invalid Field in Command "
                      "(sct 0x0, sc 0x02)"),
], ids=["confirmed", "never", "rtd3e 8 s", "rtd3e 60 s", "cc.shn unanswered", "refused"])
def test_the_orderly_shutdown_waits_a_shutdown_timeout_at_most(how, rtd3e_us, waited, note,
                                                               caplog):
    """Issue #56: a controller that never reported SHST held the unmount for CAP.TO
    (127.5 s)."""
    async def test(ctrl: Controller) -> None:
        ctrl.admin = ShutdownQueue(how)
        ctrl.cap = SimpleNamespace(timeout_ms=127_500)  # CAP.TO at its largest
        ctrl.identify = SimpleNamespace(rtd3e=rtd3e_us)
        start = trio.current_time()
        await ctrl.shutdown("unmounting")
        assert trio.current_time() - start == pytest.approx(waited, abs=0.1)
        assert ctrl.shutdown_note == note

    run(test)
    if note:
        assert f"{note}; disconnecting" in caplog.text
# -- identity after a reconnect (over tests/fabric_fakes.py's target, which answers Identify) --

NGUID_B = bytes(range(0xB0, 0xC0))


def run_identified(test, **options) -> None:
    """``test(ctrl, target)`` with a live controller of n1 identified as the real bring-up
    identifies it (Identify Controller, the namespace and its identity)."""
    from fabric_fakes import FakeTarget
    from fabric_fakes import FakeTransport as FabricTransport
    from multipath_fakes import controller_page

    from nvmeof_fuse.host.memory import host_buffer
    from nvmeof_fuse.nvme import IdentifyController

    async def main() -> None:
        target = FakeTarget(512, 64)
        target.controller_page = controller_page("nqn.2014-08.org.example:t", 1, "SERIAL-A")
        opts = ConnectOptions("192.0.2.1", "nqn.2014-08.org.example:t", keep_alive_tmo=0,
                              reconnect_delay=1, ctrl_loss_tmo=10, **options)
        async with trio.open_nursery() as nursery:
            transport = FabricTransport(target)
            ctrl = Controller(opts, transport, nursery)

            async def connect_admin() -> None:
                ctrl.admin = await transport.connect_queue(nursery, 0, 32)

            async def connect_io_queues() -> None:
                ctrl.io_queues = [await transport.connect_queue(nursery, 1, 32)]

            ctrl._connect_admin, ctrl._connect_io_queues = connect_admin, connect_io_queues
            ctrl._scratch = host_buffer(transport.register, 8192)
            await connect_admin()
            await connect_io_queues()
            ctrl.identify = IdentifyController.from_bytes(target.controller_page)
            ctrl.max_transfer = 4096
            ctrl.bounce = ctrl.new_bounce_pool(4096, 4)
            await ctrl._identify_namespaces()
            assert ctrl._change_state(CONNECTING) and ctrl._change_state(LIVE)
            await nursery.start(ctrl.supervise)
            await test(ctrl, target)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_reconnect_to_a_controller_of_another_subsystem_fails_until_ctrl_loss_tmo(caplog):
    from multipath_fakes import controller_page

    async def test(ctrl: Controller, target) -> None:
        target.controller_page = controller_page("nqn.2014-08.org.example:t", 2, "SERIAL-B")
        target.fail_queues()
        with pytest.raises(ControllerLost, match="gave up after 10 reconnects"):
            await ctrl.namespaces[1].read_lbas(0, 1)

    with caplog.at_level(logging.WARNING, logger="nvmeof_fuse.host.controller"):
        run_identified(test)
    refused = [m for m in caplog.messages if m.startswith("reconnect ")]
    # (the 10 failures are logged when they start, then ever more rarely: ratelimit.py)
    assert 1 <= len(refused) < 10 and refused[0] == (
        "reconnect 1 to nqn.2014-08.org.example:t failed: the controller reached at rdma "
        "192.0.2.1:4420 is not the controller we mounted: its serial number 'SERIAL-A' != "
        "'SERIAL-B'; refused")


def test_io_that_waited_for_a_reconnect_never_runs_on_the_namespace_found_instead():
    """Three commands of n1 wait for the reconnect: one in flight when the connection went
    (run again: _run_again), one sent to the controller meanwhile (io_command), one through
    the namespace (its LbaIO).  The target comes back with another namespace behind n1:
    each fails with NamespaceReplaced, and the target never saw them; the new n1 serves,
    and its own commands that wait through a later outage run."""
    from nvmeof_fuse.errors import NamespaceReplaced
    from nvmeof_fuse.nvme import NamespaceIds

    async def test(ctrl: Controller, target) -> None:
        old = ctrl.namespaces[1]
        buf = ctrl.allocate(512)
        outcomes: dict[str, object] = {}

        async def attempt(name, fn, *args) -> None:
            try:
                outcomes[name] = await fn(*args)
            except NVMeoFError as exc:
                outcomes[name] = exc

        async with trio.open_nursery() as nursery:
            target.go_away()  # the first one's answer never comes
            nursery.start_soon(attempt, "in flight", ctrl.io_command,
                               cmd.read(1, 0, 1, nvme.NULL_SGL), buf.ref(0, 512))
            await trio.sleep(0.1)
            target.fail_queues()
            await trio.sleep(0.1)
            assert ctrl.state is not LIVE
            nursery.start_soon(attempt, "waiting", ctrl.io_command,
                               cmd.read(1, 0, 1, nvme.NULL_SGL), buf.ref(0, 512))
            nursery.start_soon(attempt, "namespace", old.read_lbas, 0, 1)
            await trio.sleep(0.1)
            target.ns_ids = NamespaceIds(nguid=NGUID_B)
            target.disk[:512] = b"B" * 512
            ios = target.io_count
            target.come_back()
        assert all(isinstance(v, NamespaceReplaced) for v in outcomes.values()), outcomes
        assert target.io_count == ios  # none of them reached the new namespace
        new = ctrl.namespaces[1]
        assert new is not old and new.generation == old.generation + 1
        assert await new.read_lbas(0, 1) == b"B" * 512
        async with trio.open_nursery() as nursery:  # a later outage: no change
            target.go_away()
            target.fail_queues()
            await trio.sleep(0.1)
            nursery.start_soon(attempt, "later", new.read_lbas, 0, 1)
            await trio.sleep(0.1)
            target.come_back()
        assert outcomes["later"] == b"B" * 512

    run_identified(test)
