"""A command the target takes but never answers: it times out against the real target.

The namespace sits on a device-mapper device that is suspended while the command is in flight,
so nvmet keeps the connection (and answers keep-alives) but not the read.  The command times
out, its queue is torn down before the caller gets its memory back (as Linux's
``nvme_rdma_timeout`` and ``nvme_tcp_timeout``), and the controller reconnects.  Once the
device resumes, the target finishes the old read, but its data can no longer reach the
caller's buffer, which by then may hold something else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess

import numpy as np
import pytest
import trio
from fabrics import make_fabric
from nvmet import null_blk, subsystem
from vm import NVMET_PORTS, run_guarded, sh

from nvmeof_fuse.errors import ControllerLost
from nvmeof_fuse.host.controller import PROBES_IN_FLIGHT, connect

STALL_NQN = "nqn.2026-11.io.nvmeof-fuse:stall"
STALL_MIB = 16
HANG_GUARD = 300  # seconds: a hang fails the test instead of stalling the suite
SLBA, NLB = 8, 8  # the read: 32 KiB on 4 KiB LBAs
TIMEOUT = 2.0  # the command timeout under test, in seconds
HOLD = 6.0  # seconds the target holds a read it will answer (a dozen probe intervals)


@dataclasses.dataclass
class Stall:
    """A device-mapper device over a memory-backed null_blk, exported as nsid 1 of STALL_NQN."""

    name: str

    def suspend(self) -> None:
        """From now on the device holds every new I/O until :meth:`resume`."""
        sh("dmsetup", "suspend", self.name)

    def resume(self) -> None:
        sh("dmsetup", "resume", self.name)


@contextlib.contextmanager
def stalling_subsystem():
    """STALL_NQN on the testbed's rdma and tcp ports; removed again afterwards."""
    sh("modprobe", "dm_mod")
    stall = Stall("nvmeof-stall")
    with null_blk("nvmeof-stall-disk", STALL_MIB, 4096) as disk:
        sh("dmsetup", "create", "--noudevsync", stall.name, "--table",
           f"0 {STALL_MIB << 11} linear {disk} 0")
        try:
            minor = sh("dmsetup", "info", "-c", "--noheadings", "-o", "minor", stall.name)
            with subsystem(STALL_NQN, f"/dev/dm-{minor.strip()}",
                           ports=tuple(NVMET_PORTS.values())):
                yield stall
        finally:
            subprocess.run(["dmsetup", "resume", stall.name], capture_output=True, timeout=60)
            subprocess.run(["dmsetup", "remove", "--noudevsync", stall.name],
                           capture_output=True, timeout=60)


def stall_options(fabric, **kw):
    return dataclasses.replace(fabric.options(timeout=TIMEOUT, reconnect_delay=1,
                                              connect_timeout=3, **kw), nqn=STALL_NQN)


def test_a_read_the_target_never_answers_times_out_and_lands_after_the_reconnect(testbed):
    """The retry is the controller's, the same on both fabrics: RDMA only, to save VM time."""
    fabric, data = make_fabric(testbed, "rdma"), os.urandom(NLB * 4096)

    async def main():
        async with connect(stall_options(fabric)) as ctrl:
            ns = ctrl.namespaces[1]
            await ns.write_lbas(SLBA, data)
            dest = np.zeros(len(data), dtype=np.uint8)
            region = ctrl.register(dest)
            stall.suspend()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ns.read_into, SLBA, NLB, region.ref(0, len(data)))
                while not ctrl.losses:  # until the timeout takes the queue down
                    await ctrl.wait_changed()
                await trio.to_thread.run_sync(stall.resume)
            return ctrl.losses, ctrl.reconnects, dest.tobytes()

    with stalling_subsystem() as stall:
        losses, reconnects, got = run_guarded(main, hang_guard=HANG_GUARD)
    assert got == data
    assert losses >= 1 and reconnects >= 1


def test_a_command_the_target_holds_is_probed_and_not_taken_for_a_lost_connection(testbed):
    """Issue #49, item 5, slow is not dead: a read the target holds for HOLD s (its device
    suspended) has Keep Alives sent as probes while it waits; nvmet answers them, so the
    connection stays (no loss), and the read completes once the device resumes.  No more
    than PROBES_IN_FLIGHT are unanswered at once."""
    fabric, data = make_fabric(testbed, "rdma"), os.urandom(NLB * 4096)
    probes: list[str] = []
    in_flight = [0, 0]  # now, most

    async def main():
        options = dataclasses.replace(stall_options(fabric), timeout=120)
        async with connect(options) as ctrl:
            send_keep_alive = ctrl._send_keep_alive

            async def counted(timeout: float, why: str) -> None:
                probes.append(why)
                probe = why.startswith("probe")
                in_flight[0] += probe
                in_flight[1] = max(in_flight)
                try:
                    await send_keep_alive(timeout, why)
                finally:
                    in_flight[0] -= probe

            ctrl._send_keep_alive = counted
            ns = ctrl.namespaces[1]
            await ns.write_lbas(SLBA, data)
            stall.suspend()
            async with trio.open_nursery() as nursery:
                got: list[bytes] = []

                async def read() -> None:
                    got.append(await ns.read_lbas(SLBA, NLB))

                nursery.start_soon(read)
                await trio.sleep(HOLD)  # the hold itself, not a wait for a condition
                held = ctrl.losses
                await trio.to_thread.run_sync(stall.resume)
            return held, ctrl.losses, got[0]

    with stalling_subsystem() as stall:
        held, losses, got = run_guarded(main, hang_guard=HANG_GUARD)
    assert held == 0 and losses == 0, (held, losses, probes)
    assert any(why.startswith("probe") for why in probes), probes
    assert in_flight[1] <= PROBES_IN_FLIGHT, in_flight
    assert got == data


def test_a_timed_out_read_that_failed_never_writes_into_the_buffer_later(fabric, caplog):
    """With --fast-io-fail-tmo 0 the caller gets EIO at once and reuses its buffer; the
    target's late data for the old read must not land there."""
    data, mine = os.urandom(NLB * 4096), os.urandom(NLB * 4096)
    caplog.set_level(logging.INFO, logger="nvmeof_fuse")

    async def main():
        async with connect(stall_options(fabric, fast_io_fail_tmo=0)) as ctrl:
            ns = ctrl.namespaces[1]
            await ns.write_lbas(SLBA, data)
            dest = np.zeros(len(data), dtype=np.uint8)
            region = ctrl.register(dest)
            stall.suspend()
            with pytest.raises(ControllerLost, match="fast-io-fail-tmo"):
                await ns.read_into(SLBA, NLB, region.ref(0, len(data)))
            dest[:] = np.frombuffer(mine, dtype=np.uint8)  # the buffer is the caller's again
            await trio.to_thread.run_sync(stall.resume)
            # nvmet tears the old queues down only once the held read finished, and
            # the reconnect has to wait for that (on rdma the admin Connect flushes it)
            await ctrl.wait_connected()
            assert await ns.read_lbas(SLBA, NLB) == data
            return dest.tobytes()

    with stalling_subsystem() as stall:
        got = run_guarded(main, hang_guard=HANG_GUARD)
    assert got == mine
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert f"got no completion within {TIMEOUT:g} s" in messages, messages
