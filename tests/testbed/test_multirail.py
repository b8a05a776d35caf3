"""Several NICs (issue #59): one mount with a path through each of the testbed's two
Soft-RoCE devices, and a companion client whose memory sits near the second.

The testbed has rxe0 (on rxenet0, nvmet port 1) and rxe1 (on rxenet1, port 3).  Neither
has a PCI function, so the daemon reads a fake sysfs (``NVMEOF_FUSE_SYSFS``, built here
with ``tests/sysfs_fakes.py``) in which rxenet0 is a NIC on socket 0 and rxenet1 a NIC on
socket 1, in one PCIe switch with a GPU: the client says its memory is on that GPU (by its
PCI address, as a CUDA buffer would through the driver).  What is real: RDMA-CM's choice of
device for each path, the queues of the client's own on each device, the port going away
and coming back, and the bytes.  What the fake decides: only which device is near.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from sysfs_fakes import FakeSysfs, two_socket_server
from test_multipath import cli, log_text, mounted, one_line_refusal, paths, record, rounds_done
from vm import RAIL_PORT, target_away, wait_for

MNT = "/tmp/nvmeof-multirail"
CHILD = os.path.join(os.path.dirname(__file__), "companion_child.py")
OUTAGE = 8  # seconds the second rail's port stays unlinked


def uri(testbed, addr: str) -> str:
    return f"nvme+rdma://{addr}:{testbed.port}/{testbed.nqn}"


@pytest.fixture(scope="module")
def topology(tmp_path_factory) -> dict[str, str]:
    """A fake sysfs where rxe0's netdev is mlx5_0's NIC (socket 0) and rxe1's is mlx5_7's
    (socket 1), beside the GPU PIX to mlx5_7: its root, and that GPU's address."""
    root = tmp_path_factory.mktemp("sysfs")
    fs = FakeSysfs(root)
    gpu_of = {nic: gpu for gpu, nic in two_socket_server(fs).items()}
    for rxe, netdev, nic in (("rxe0", "rxenet0", "mlx5_0"), ("rxe1", "rxenet1", "mlx5_7")):
        address = os.path.basename(os.path.realpath(root / "class/infiniband" / nic / "device"))
        fs.net(netdev, address)
        fs.rdma(rxe, netdev=netdev)
    return {"root": str(root), "gpu": gpu_of["mlx5_7"],
            "nic": os.path.basename(os.path.realpath(root / "class/net/rxenet1/device"))}


@pytest.fixture(scope="module")
def rails(testbed, topology, tmp_path_factory):
    """Path 0 through rxe0, path 1 through rxe1 (each naming its device), the daemon on the
    fake topology."""
    assert testbed.rail_addr, "TESTBED_RAIL_ADDR not set: an old testbed-guest"
    log = str(tmp_path_factory.mktemp("rails") / "daemon.log")
    os.environ["NVMEOF_FUSE_SYSFS"] = topology["root"]  # the daemon's (sh inherits it)
    try:
        with mounted(MNT, log, uri(testbed, testbed.rdma_addr), "--host-iface", "rxe0",
                     "--path", uri(testbed, testbed.rail_addr) + "?host_iface=rxe1",
                     "-c", "1", "-l", "120"):
            yield MNT, log
    finally:
        del os.environ["NVMEOF_FUSE_SYSFS"]
    text = log_text(log)
    assert "Traceback" not in text, text


def lines(out: str) -> list[dict]:
    with open(out) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def last_path(out: str) -> str:
    rounds = [line for line in lines(out) if "path" in line]
    return rounds[-1]["path"] if rounds else ""


def stats(mnt: str) -> dict:
    with open(f"{mnt}/.nvmeof/stats.json") as f:
        return json.load(f)["companion"]


def test_each_path_shows_the_device_rdma_cm_bound_it_to(rails, testbed, topology):
    mnt, _ = rails
    listed = paths(mnt)
    assert [(p["traddr"], p["device"], p["host_iface"]) for p in listed] == [
        (testbed.rdma_addr, "rxe0", "rxe0"), (testbed.rail_addr, "rxe1", "rxe1")], listed
    assert (listed[1]["device_pci"], listed[1]["device_numa_node"]) == (topology["nic"], 1)
    assert listed[0]["device_numa_node"] == 0, listed


def test_a_client_near_the_second_rail_leases_there_moves_on_its_loss_and_comes_back(
        rails, testbed, topology, tmp_path):
    mnt, log = rails
    gpu = topology["gpu"]
    out, stop = str(tmp_path / "near.out"), str(tmp_path / "stop")
    reader = subprocess.Popen([sys.executable, CHILD, "near", f"{mnt}/n2", str(4 << 20),
                               str(1 << 20), stop, gpu],
                              stdout=open(out, "w"), stderr=open(f"{out}.err", "w"))
    near_line = f"direct via path 1 (rxe1, PIX to GPU {gpu})"
    timeline: list[str] = []
    started = time.monotonic()

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - started:7.2f} {what}: {last_path(out)!r}")

    try:
        assert wait_for(lambda: rounds_done(out) > 0, 180), open(f"{out}.err").read()
        assert last_path(out) == near_line, lines(out)[-3:]
        mark("reading")
        with target_away(testbed.nqn, RAIL_PORT):
            assert wait_for(lambda: paths(mnt)[1]["state"] != "live", 90), paths(mnt)
            mark("path 1 lost")
            assert wait_for(lambda: last_path(out).startswith("direct via path 0 (rxe0, SYS"),
                            120), (timeline, lines(out)[-3:])
            mark("on path 0")
            rounds = rounds_done(out)
            assert wait_for(lambda: rounds_done(out) > rounds + 2, 120)
            time.sleep(OUTAGE)  # the outage itself, not a wait for a condition
        mark("port 3 linked again")
        assert wait_for(lambda: paths(mnt)[1]["state"] == "live", 180), paths(mnt)
        mark("path 1 live")
        assert wait_for(lambda: last_path(out) == near_line, 120), (timeline, lines(out)[-3:])
        mark("back on path 1")
        rounds = rounds_done(out)
        assert wait_for(lambda: rounds_done(out) > rounds + 2, 120)
        by_path = stats(mnt).get("client_queue_bytes_by_path", {})
    finally:
        open(stop, "w").close()
        try:
            reader.wait(120)
        except subprocess.TimeoutExpired:
            reader.kill()
    record("multirail: client path over an outage of its rail", timeline)
    assert reader.returncode == 0, open(f"{out}.err").read()
    summary = lines(out)[-1]
    assert summary["errors"] == [] and summary["mismatches"] == 0, (summary, timeline)
    assert by_path["0"]["client_queue_read_bytes"] > 0, by_path
    assert by_path["1"]["client_queue_read_bytes"] > 0, by_path
    assert "is back, nearer" in log_text(log) or "moves to path 1" in log_text(log)


def test_a_path_that_names_a_device_rdma_cm_did_not_bind_is_refused_in_one_line(testbed):
    mnt = f"{MNT}-refused"
    os.makedirs(mnt, exist_ok=True)
    line = one_line_refusal(cli("mount", uri(testbed, testbed.rdma_addr), mnt,
                                "--host-iface", "rxe1", "--daemon"))
    record("multirail: refusal", line)
    assert "rxe0" in line and "rxe1" in line and "host_iface" in line, line
    assert not os.path.ismount(mnt)
