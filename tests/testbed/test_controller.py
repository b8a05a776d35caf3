"""Initiator core against Linux nvmet over Soft-RoCE and NVMe/TCP, cross-checked by the kernel
initiator over the same transport."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess

import pytest
import trio
from fabrics import make_fabric
from kernel_initiator import connected, pread_direct, pwrite_direct
from vm import run_guarded

from nvmeof_fuse import nvme
from nvmeof_fuse.errors import ConnectError, InvalidArgument
from nvmeof_fuse.host.controller import ConnectOptions, connect
from nvmeof_fuse.nvme import NVMeStatusError
from nvmeof_fuse.nvme import command as cmd

HANG_GUARD = 120  # seconds: a hang fails the test instead of stalling the suite


def run(fn, *args):
    return run_guarded(fn, *args, hang_guard=HANG_GUARD)


def options(testbed, **kw) -> ConnectOptions:
    return ConnectOptions(traddr=testbed.rdma_addr, nqn=testbed.nqn, trsvcid=testbed.port, **kw)


def verbs_resources() -> str:
    out = subprocess.run(["rdma", "resource", "show"], capture_output=True, text=True,
                         timeout=30).stdout
    return " ".join(out.split())


def test_identify_reports_both_namespaces(fabric):
    async def main():
        async with connect(fabric.options()) as ctrl:
            return ctrl.describe(), {n: (ns.lba_size, ns.size) for n, ns in
                                     ctrl.namespaces.items()}

    desc, geometry = run(main)
    assert geometry == {1: (512, 256 << 20), 2: (4096, 256 << 20)}
    assert desc["subnqn"] == fabric.nqn and desc["io_queues"] >= 1
    assert desc["transport"] == fabric.transport
    assert desc["model"] == "Linux" and desc["max_transfer_bytes"] >= 4096


def test_random_ranges_agree_with_the_kernel_initiator(fabric):
    check_against_the_kernel_initiator(fabric)


def test_random_ranges_agree_with_the_kernel_initiator_with_tcp_digests(testbed):
    check_against_the_kernel_initiator(make_fabric(testbed, "tcp-digests"))


def check_against_the_kernel_initiator(fabric):
    rng = random.Random(7)
    with connected(fabric.transport, fabric.addr, fabric.port, fabric.nqn) as kernel:
        async def main():
            async with connect(fabric.options()) as ctrl:
                for nsid, ns in ctrl.namespaces.items():
                    mdts_lbas = ctrl.max_transfer // ns.lba_size
                    for nlb in (1, 3, mdts_lbas - 1, mdts_lbas + 1, 4 * mdts_lbas):
                        slba = rng.randrange(0, ns.nlb - nlb)
                        # ours writes, the kernel reads back
                        data = rng.randbytes(nlb * ns.lba_size)
                        await ns.write_lbas(slba, data)
                        got = await trio.to_thread.run_sync(
                            pread_direct, kernel[nsid], slba * ns.lba_size, len(data))
                        assert got == data, f"ns {nsid}: kernel read differs at {slba}+{nlb}"
                        # the kernel writes, ours reads back
                        data = rng.randbytes(nlb * ns.lba_size)
                        await trio.to_thread.run_sync(
                            pwrite_direct, kernel[nsid], slba * ns.lba_size, data)
                        assert await ns.read_lbas(slba, nlb) == data, f"ns {nsid}: {slba}+{nlb}"

        run(main)


def test_a_thousand_concurrent_reads_each_get_their_own_block(fabric):
    count = 1000

    def block(i: int) -> bytes:
        return i.to_bytes(4, "little") * 1024

    async def main():
        async with connect(fabric.options()) as ctrl:
            ns = ctrl.namespaces[2]
            await ns.write_lbas(0, b"".join(block(i) for i in range(count)))
            wrong = []

            async def read_one(i: int) -> None:
                if await ns.read_lbas(i, 1) != block(i):
                    wrong.append(i)

            async with trio.open_nursery() as nursery:
                for i in random.Random(1).sample(range(count), count):
                    nursery.start_soon(read_one, i)
            return wrong, ns.stats.snapshot()

    wrong, _ = run(main)
    assert wrong == []


def test_command_ids_carry_generations_under_load_and_every_read_gets_its_own_data(fabric):
    """Issue #49 item 2 against nvmet: command IDs carry their slot's generation in the bits
    above it (the kernel's nvme_cid).  Thousands of reads at a queue depth of hundreds reuse
    every slot many times; each must land its own block, and the IDs the queues used must
    have gone through several generations (nvmet echoes them; a mismatch would fail the
    queue, and a read would come back from the wrong block)."""
    count = 3000

    def block(i: int) -> bytes:
        return (i * 2654435761 & 0xFFFFFFFF).to_bytes(4, "little") * 1024

    async def main():
        async with connect(fabric.options()) as ctrl:
            ns = ctrl.namespaces[2]
            await ns.write_lbas(0, b"".join(block(i) for i in range(count)))
            wrong = []

            async def read_one(i: int) -> None:
                if await ns.read_lbas(i, 1) != block(i):
                    wrong.append(i)

            for _ in range(2):
                async with trio.open_nursery() as nursery:
                    for i in random.Random(2).sample(range(count), count):
                        nursery.start_soon(read_one, i)
            generations = []
            for queue in ctrl.io_queues:
                ids = getattr(queue, "_ids", None) or queue._slots  # TCP, RDMA
                generations.append(max(cid // (ids.mask + 1) for cid in ids.last))
            return wrong, generations, ctrl.losses

    wrong, generations, losses = run(main)
    assert wrong == [] and losses == 0
    assert max(generations) >= 3, generations


def test_keep_alive_holds_an_idle_controller(fabric):
    async def main():
        async with connect(fabric.options(keep_alive_tmo=2)) as ctrl:
            await trio.sleep(7)  # well past KATO: without keep-alives nvmet drops us
            ns = ctrl.namespaces[1]
            await ns.write(100, b"still here")
            return await ns.read(100, 10)

    assert run(main) == b"still here"


def test_wrong_nqn_is_named(fabric):
    async def main():
        async with connect(dataclasses.replace(fabric.options(), nqn="nqn.2026-11.io.no:such")):
            pass

    with pytest.raises(ConnectError, match=r"nqn.2026-11.io.no:such.*Connect Invalid Param"):
        run(main)


@pytest.mark.parametrize("addr,port,reason", [
    ("192.0.2.1", 4420, {"rdma": "cannot reach 192.0.2.1:4420",
                         "tcp": "connect to 192.0.2.1:4420 (failed|timed out)"}),
    ("10.233.0.1", 4421, {"rdma": "refused", "tcp": "refused"}),
])
def test_unreachable_address_is_named(fabric, addr, port, reason):
    async def main():
        async with connect(dataclasses.replace(fabric.options(), traddr=addr, trsvcid=port,
                                               connect_timeout=10)):
            pass

    with pytest.raises(ConnectError, match=reason[fabric.transport]):
        run(main)


def test_out_of_range_lba_and_target_status_errors(fabric):
    async def main():
        async with connect(fabric.options()) as ctrl:
            ns = ctrl.namespaces[1]
            with pytest.raises(InvalidArgument, match=r"LBA range 524288..524288 is outside"):
                await ns.read_lbas(ns.nlb, 1)
            buf = ctrl.allocate(4096)
            # bypass our own check: the target answers with a named status (Linux nvmet's
            # bdev backend reports a read past the end as Internal Error)
            with pytest.raises(NVMeStatusError,
                               match=r"Read failed: (LBA Out of Range|Internal Error) \(sct"
                               ) as info:
                await ctrl.io_command(cmd.read(1, ns.nlb, 1, nvme.NULL_SGL), buf.ref(0, 512))
            assert info.value.errno != 0
            with pytest.raises(NVMeStatusError, match="Invalid Namespace or Format"):
                await ctrl.io_command(cmd.read(99, 0, 1, nvme.NULL_SGL), buf.ref(0, 512))
            # the controller still works after errors
            await ns.write(0, b"ok")
            return await ns.read(0, 2)

    assert run(main) == b"ok"


def test_no_verbs_resources_left_behind(testbed):
    baseline = verbs_resources()

    async def main():
        async with connect(options(testbed)) as ctrl:
            await ctrl.namespaces[1].read(0, 4096)
        for bad in (ConnectOptions(traddr=testbed.rdma_addr, nqn="nqn.2026-11.io.no:such"),
                    ConnectOptions(traddr=testbed.rdma_addr, trsvcid=4421, nqn=testbed.nqn)):
            with pytest.raises(ConnectError):
                async with connect(bad):
                    pass
        # the target releases its side of our connections asynchronously
        for _ in range(100):
            if verbs_resources() == baseline:
                return
            await trio.sleep(0.1)

    run(main)
    assert verbs_resources() == baseline, os.linesep.join([baseline, verbs_resources()])
