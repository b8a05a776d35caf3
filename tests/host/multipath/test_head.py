"""The multipath head over real Controllers on tests/fabric_fakes.py's targets: one target
per port of one subsystem (they share the disk), each with its ANA state; trio's clock jumps
over the waits."""

from __future__ import annotations

import logging
import os
import re

import pytest
import trio
import trio.testing
from multipath_fakes import LBA, NQN, Port, options
from sysfs_fakes import FakeSysfs, two_socket_server

from nvmeof_fuse.errors import ConnectError, ControllerLost, InvalidArgument, TransportError
from nvmeof_fuse.fs import info
from nvmeof_fuse.host.controller import ConnectOptions
from nvmeof_fuse.host.multipath import head as multipath
from nvmeof_fuse.host.multipath.head import MultipathController
from nvmeof_fuse.host.multipath.nearest import MemoryPlace
from nvmeof_fuse.host.multipath.path import PathRefused, path_options
from nvmeof_fuse.host.multipath.pathmemory import PathsRegistration
from nvmeof_fuse.host.state import LIVE
from nvmeof_fuse.host.topology.sysfs import Topology
from nvmeof_fuse.nvme import NamespaceIds
from nvmeof_fuse.nvme.ana import AnaState
from nvmeof_fuse.nvme.events import AsyncEvent
from nvmeof_fuse.transport.base import LocalDevice

NO_SYSFS = Topology("/nonexistent-sysfs")


def run(test, port: Port, policy: str = "round-robin", paths: int = 2,
        topology: Topology = NO_SYSFS, **kw):
    async def main() -> None:
        opts = [options(addr, **kw) for addr in list(port.targets)[:paths]]
        async with multipath.connect(opts, policy=policy, connect_path=port.connect,
                                     topology=topology) as head:
            await test(head)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_round_robin_spreads_io_and_both_paths_move_the_same_data():
    port = Port()

    async def test(head: MultipathController) -> None:
        ns = head.namespaces[1]
        assert [p.index for p in head.paths] == [0, 1]
        data = os.urandom(8 * LBA)
        await ns.write(100 * LBA, data)
        for _ in range(6):
            assert await ns.read(100 * LBA, 8 * LBA) == data
        assert [p.ios for p in head.paths] == [4, 3]
        assert port[0].io_count + port[1].io_count == 7 and port[0].io_count >= 3

    run(test, port)


def test_one_path_hands_commands_straight_to_its_controller():
    port = Port(1)

    async def test(head: MultipathController) -> None:
        ctrl = head.paths[0].ctrl
        assert head.io_command == ctrl.io_command and head.start_io == ctrl.start_io
        registration = head.bounce._all[0].registration
        assert isinstance(registration, PathsRegistration)
        assert registration.keys == registration._subs[ctrl.transport].keys  # no lookup
        data = await head.namespaces[1].read(0, 4 * LBA)
        assert data == bytes(port[0].disk[:4 * LBA])

    run(test, port, paths=1)


def test_a_lost_path_fails_over_at_once_with_no_error_and_comes_back():
    port = Port()

    async def test(head: MultipathController) -> None:
        ns = head.namespaces[1]
        errors = []

        async def reader() -> None:
            for i in range(200):
                try:
                    at = (i % 100) * 8 * LBA
                    assert await ns.read(at, 8 * LBA) == bytes(port[0].disk[at:at + 8 * LBA])
                except Exception as exc:  # noqa: BLE001 - collected
                    errors.append(exc)
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(0.3)
            started = trio.current_time()
            port[0].go_away()
            port[0].fail_queues()
            await trio.sleep(0.05)
            assert head.paths[0].ctrl.state != LIVE
            assert trio.current_time() - started < 0.2  # nothing waited for the reconnect
            ios = head.paths[1].ios
            await trio.sleep(0.5)
            assert head.paths[1].ios > ios  # path 1 carries it now
            port[0].come_back()
            await trio.sleep(3)
            assert head.paths[0].ctrl.state == LIVE
        assert errors == []
        assert head.paths[0].failovers >= 1
        assert (head.paths[0].losses, head.paths[0].reconnects) == (1, 1)  # its controller's
        snapshot = head.connection_snapshot()
        assert (snapshot["losses"], snapshot["reconnects"]) == (1, 1)

    run(test, port)


def test_an_ana_inaccessible_port_is_left_within_a_command_and_used_again_when_optimized():
    port = Port()

    async def test(head: MultipathController) -> None:
        ns = head.namespaces[1]
        await ns.read(0, LBA)
        port[0].set_ana(AnaState.INACCESSIBLE)  # no notice: the 302h status says it
        for _ in range(4):
            await ns.read(0, LBA)
        path0 = head.paths[0]
        assert path0.failovers == 1 and path0.ana.state(1) is AnaState.INACCESSIBLE
        before = path0.ios
        for _ in range(4):
            await ns.read(0, LBA)
        assert path0.ios == before
        port[0].set_ana(AnaState.OPTIMIZED)
        path0.kick()  # the ANA-change notice
        await trio.sleep(0.1)
        for _ in range(4):
            await ns.read(0, LBA)
        assert path0.ios > before

    run(test, port)


def test_non_optimized_serves_only_when_no_optimized_path_is_usable():
    port = Port()
    port[0].set_ana(AnaState.NON_OPTIMIZED)

    async def test(head: MultipathController) -> None:
        ns = head.namespaces[1]
        for _ in range(4):
            await ns.read(0, LBA)
        assert [p.ios for p in head.paths] == [0, 4]
        port[1].set_ana(AnaState.INACCESSIBLE)
        head.paths[1].kick()
        await trio.sleep(0.1)
        await ns.read(0, LBA)
        assert head.paths[0].ios == 1

    run(test, port, policy="queue-depth")


def test_failover_policy_keeps_to_one_path():
    port = Port()

    async def test(head: MultipathController) -> None:
        for _ in range(5):
            await head.namespaces[1].read(0, LBA)
        assert sorted(p.ios for p in head.paths) == [0, 5]

    run(test, port, policy="failover")


def test_all_paths_gone_past_ctrl_loss_tmo_is_an_error_then_the_mount_works_again(caplog):
    port = Port()

    async def test(head: MultipathController) -> None:
        ns = head.namespaces[1]
        for target in port.targets.values():
            target.go_away()
            target.fail_queues()
        with pytest.raises(ControllerLost, match="no path to .* can serve"):
            with trio.fail_after(60):
                await ns.read(0, LBA)
        for target in port.targets.values():
            target.come_back()
        await trio.sleep(5)
        assert await ns.read(0, LBA) == bytes(port[0].disk[:LBA])
        assert all(p.reconnects == 1 for p in head.paths)

    with caplog.at_level(logging.INFO):
        run(test, port, ctrl_loss_tmo=3)
    assert ("path 0 (rdma 192.0.2.1:4420): its controller gave up; connecting anew every 1 s"
            in caplog.text)
    assert re.search(r"path 0 \(rdma 192.0.2.1:4420\): connected as controller \d+ after "
                     r"\d+ failures? in \d+ s", caplog.text), caplog.text


def test_a_path_to_another_subsystem_or_namespace_is_refused_in_one_line():
    port = Port(3)
    port.subnqn["192.0.2.2"] = "nqn.2014-08.org.example:other"
    port[2].ns_ids = NamespaceIds(nguid=bytes(range(1, 17)))

    async def test(head: MultipathController) -> None:
        with pytest.raises(PathRefused) as refused:
            await head.add_path(options("192.0.2.2"))
        assert str(refused.value) == (
            "path nvme+rdma://192.0.2.2:4420/nqn.2014-08.org.example:mp refused: it reaches "
            "subsystem nqn.2014-08.org.example:other, not this mount's subsystem "
            f"{NQN}")
        with pytest.raises(PathRefused, match=r"namespace 1 differs there \(its NGUID "
                           r"0102.*10 != the mount's 0001.*0f\)"):
            await head.add_path(options("192.0.2.3"))
        with pytest.raises(PathRefused, match="already path 0"):
            await head.add_path(options("192.0.2.1"))
        other = ConnectOptions("192.0.2.3", "nqn.2014-08.org.example:else", keep_alive_tmo=0)
        with pytest.raises(PathRefused, match="it names subsystem nqn.2014-08.org.example:else"
                                              f", not this mount's subsystem {NQN}"):
            await head.add_path(other)  # refused before connecting
        assert [p.index for p in head.paths] == [0]
        assert head.io_command == head.paths[0].ctrl.io_command

    run(test, port, paths=1)


def test_add_and_remove_a_path_on_a_live_head():
    port = Port()

    async def test(head: MultipathController) -> None:
        ns = head.namespaces[1]
        path = await head.add_path(options("192.0.2.2"))
        assert head.io_command == head._io_multipath
        for _ in range(4):
            await ns.read(0, LBA)
        assert path.ios == 2
        await head.remove_path(path.uri)
        assert head.io_command == head.paths[0].ctrl.io_command
        await trio.sleep(0.1)
        assert path.ctrl is None  # disconnected
        with pytest.raises(PathRefused, match="last path"):
            await head.remove_path("0")

    run(test, port, paths=1)


def test_a_path_status_without_ana_is_tried_on_the_other_path_and_dnr_is_final():
    port = Port()

    async def test(head: MultipathController) -> None:
        ns = head.namespaces[1]
        port[0].statuses = [0x370]  # Host Pathing Error
        port[1].statuses = [0x370]
        await ns.read(0, LBA)  # both fail once, then one succeeds
        port[0].statuses = [0x4000 | 0x302] * 2  # with DNR: not failed over
        port[1].statuses = [0x4000 | 0x302] * 2
        from nvmeof_fuse.nvme import NVMeStatusError

        with pytest.raises(NVMeStatusError, match="Asymmetric Access Inaccessible.*dnr"):
            await ns.read(0, LBA)

    run(test, port)


def test_an_ana_change_notice_has_the_log_read_and_a_long_change_resets_the_path():
    port = Port()

    async def test(head: MultipathController) -> None:
        path0 = head.paths[0]
        ctrl = path0.ctrl
        port[0].set_ana(AnaState.CHANGE)
        await ctrl.events._handle(AsyncEvent.from_dw0(0x0C << 16 | 0x03 << 8 | 0x2))
        await trio.sleep(0.1)
        assert path0.ana.state(1) is AnaState.CHANGE and path0.usable_state(1) is None
        assert ctrl.losses == 0
        await trio.sleep(5)  # past twice ANATT (2 s): the kernel resets the controller
        assert ctrl.losses >= 1
        port[0].set_ana(AnaState.OPTIMIZED)
        await trio.sleep(3)
        assert path0.usable_state(1) is AnaState.OPTIMIZED

    run(test, port)


class DomainRegistration:
    def __init__(self, domains):
        self.domains = domains
        self.closed = False

    def keys(self, domain):
        if domain not in self.domains:
            raise KeyError(domain)
        return (id(self), domain)

    def close(self):
        self.closed = True


class DomainTransport:
    def __init__(self, *domains):
        self.domains = domains

    def register(self, addr, length, owner):
        return DomainRegistration(self.domains)


def test_memory_of_the_head_has_the_keys_of_whichever_path_asks():
    a, b = DomainTransport("pd-a1", "pd-a2"), DomainTransport("pd-b")
    registration = PathsRegistration(0x1000, 4096, None, [a])
    assert registration.keys("pd-a2")[1] == "pd-a2"
    registration.add(b)
    assert registration.keys("pd-b")[1] == "pd-b" and registration.keys("pd-a1")[1] == "pd-a1"
    with pytest.raises(KeyError):
        registration.keys("pd-c")
    sub = registration._subs[b]
    registration.drop(b)
    assert sub.closed and registration.keys == registration._subs[a].keys


def test_further_paths_take_the_first_paths_options_with_the_uris_place():
    base = ConnectOptions("10.0.0.1", NQN, transport="tcp", hdr_digest=True, ctrl_loss_tmo=7,
                          hostnqn="nqn.2014-08.org.example:host")
    rdma = path_options(base, f"nvme+rdma://10.0.1.1/{NQN}")
    assert (rdma.transport, rdma.traddr, rdma.trsvcid, rdma.nqn) == ("rdma", "10.0.1.1", 4420,
                                                                     NQN)
    assert (rdma.ctrl_loss_tmo, rdma.hostnqn, rdma.hdr_digest) == (7, base.hostnqn, False)
    tcp = path_options(base, f"nvme+tcp://10.0.1.2:4421/{NQN}")
    assert (tcp.trsvcid, tcp.hdr_digest) == (4421, True)
    with pytest.raises(InvalidArgument, match="names no namespace"):
        path_options(base, f"nvme+tcp://10.0.1.2/{NQN}/1")


def test_paths_json_and_table_show_each_path(tmp_path):
    two_socket_server(FakeSysfs(tmp_path))
    port = Port()
    port.devices = {"192.0.2.1": LocalDevice("infiniband", "mlx5_0"),
                    "192.0.2.2": LocalDevice("net", "eth9")}

    async def test(head: MultipathController) -> None:
        await head.namespaces[1].read(0, 4 * LBA)
        port[1].set_ana(AnaState.INACCESSIBLE)
        head.paths[1].kick()
        await trio.sleep(0.1)
        paths = info.paths_list(head)
        assert paths[0] == {
            "index": 0, "uri": f"nvme+rdma://192.0.2.1:4420/{NQN}", "transport": "rdma",
            "traddr": "192.0.2.1", "trsvcid": 4420, "cntlid": 1, "ana_group": 1,
            "ana_state": "optimized", "state": "live", "usable": True, "outstanding": 0,
            "ios": 1, "bytes": 4 * LBA, "losses": 0, "reconnects": 0, "failovers": 0,
            "device": "mlx5_0", "device_pci": "0000:1b:00.0", "device_numa_node": 0,
            "host_iface": None}
        assert (paths[1]["ana_state"], paths[1]["usable"]) == ("inaccessible", False)
        assert (paths[1]["device"], paths[1]["device_pci"]) == ("eth9", None)  # not in sysfs
        table = info.paths_text(head).decode().splitlines()
        assert table[0] == "iopolicy: queue-depth"
        assert table[1].split()[:4] == ["path", "transport", "address", "cntlid"]
        assert table[3].split()[:8] == ["1", "rdma", "192.0.2.2:4420", "2", "1",
                                        "inaccessible", "live", "false"]
        assert table[1].split()[-2:] == ["device", "numa"]
        assert table[2].split()[-2:] == ["mlx5_0", "0"] and table[3].split()[-2:] == ["eth9", "-"]

    run(test, port, policy="queue-depth", topology=Topology(str(tmp_path)))


def test_further_paths_name_their_own_local_device():
    base = ConnectOptions("10.0.0.1", NQN, host_iface="mlx5_0", host_traddr="10.0.0.9")
    second = path_options(base, f"nvme+rdma://10.0.1.1/{NQN}?host_iface=mlx5_1")
    assert (second.host_iface, second.host_traddr) == ("mlx5_1", "10.0.0.9")
    third = path_options(base, f"nvme+rdma://10.0.2.1/{NQN}?host_traddr=10.0.2.9")
    assert (third.host_iface, third.host_traddr) == (None, "10.0.2.9")  # a device is one rail's
    with pytest.raises(InvalidArgument, match=r"unknown key 'iface' after 'nvme\+rdma://10.0.1.1/"):
        path_options(base, f"nvme+rdma://10.0.1.1/{NQN}?iface=mlx5_1")


def test_one_paths_counters_come_from_its_namespaces():
    port = Port(1)

    async def test(head: MultipathController) -> None:
        await head.namespaces[1].read(0, 2 * LBA)
        await head.namespaces[1].write(0, bytes(2 * LBA))
        (path,) = info.paths_list(head)
        assert (path["ios"], path["bytes"], path["usable"]) == (2, 4 * LBA, True)

    run(test, port, paths=1)


def test_a_further_path_down_at_mount_joins_and_connects_when_it_can():
    port = Port()
    port[1].go_away()

    async def test(head: MultipathController) -> None:
        assert [p.state for p in head.paths] == ["live", "connecting"]
        assert head.io_command == head._io_multipath
        await head.namespaces[1].read(0, LBA)
        assert head.paths[0].ios == 1
        port[1].come_back()
        await trio.sleep(2)
        assert head.paths[1].state == "live" and head.paths[1].reconnects == 0
        for _ in range(2):
            await head.namespaces[1].read(0, LBA)
        assert head.paths[1].ios == 1

    run(test, port)


def test_the_first_path_must_connect():
    port = Port()
    port[0].go_away()

    async def test(head: MultipathController) -> None:
        raise AssertionError("connected")

    with pytest.raises(ConnectError, match="192.0.2.1 refused"):
        run(test, port)


def test_a_command_that_breaks_every_path_it_goes_on_counts_its_tries_across_paths():
    """A poison command (a target's protocol violation on every port) must not take every
    path down in turn for ever: its tries are counted across paths, and it ends in EIO."""
    from nvmeof_fuse.errors import TransportError
    from nvmeof_fuse.host.controller import IO_RETRIES

    port = Port()
    poison_lba = 7 * LBA // 512  # the fake disk's LBAs are 512 bytes
    sent = []
    for target in port.targets.values():
        good_run = target.run

        def poisoned(sqe, data, admin=False, target=target, good_run=good_run):
            if not admin and sqe[0] == 0x02 and int.from_bytes(sqe[40:48], "little") == \
                    poison_lba:
                sent.append(target)
                target.fail_queues()  # as a protocol violation closes the connection
            return good_run(sqe, data, admin)

        target.run = poisoned

    async def test(head: MultipathController) -> None:
        ns = head.namespaces[1]
        with pytest.raises(TransportError, match=f"failed under each of its {IO_RETRIES} "
                                                 "tries"):
            await ns.read(7 * LBA, LBA)
        assert len(sent) == IO_RETRIES
        assert {id(t) for t in sent} == {id(t) for t in port.targets.values()}  # both paths
        await head.wait_live()
        assert await ns.read(0, LBA) == bytes(port[0].disk[:LBA])  # the mount goes on

    run(test, port, ctrl_loss_tmo=60)


# -- another namespace behind an NSID on a path (host/identity.py) ------------------------------

NGUID_B = bytes(range(0xB0, 0xC0))


def test_a_path_that_finds_another_namespace_serves_it_no_more_until_no_path_serves_ours(caplog):
    """Path 0 reconnects to another namespace behind n1: it is out for n1 (the head's reads
    go to path 1, which still has the mount's), said in one line.  Once path 1 reconnects
    to the other one too, the head's n1 is replaced: its I/O fails, the new n1 serves, and
    the listeners hear of it."""
    from nvmeof_fuse.errors import NamespaceReplaced

    port = Port()
    ours = bytes(port[0].disk)
    other = bytearray(os.urandom(len(ours)))

    async def test(head: MultipathController) -> None:
        told = []

        async def listener(changes):
            told.extend(changes)

        head.events.listeners.append(listener)
        ns = head.namespaces[1]

        async def swap(i: int) -> None:
            port[i].disk, port[i].ns_ids = other, NamespaceIds(nguid=NGUID_B)
            ctrl = head.paths[i].ctrl
            ctrl.connection_lost(ctrl.admin, TransportError("cut"))
            while head.paths[i].ctrl.state != LIVE or not head.paths[i].ctrl.reconnects:
                await trio.sleep(0.1)

        await swap(0)
        assert head.paths[0].stale == {1} and head.namespaces[1] is ns
        for _ in range(8):
            assert await ns.read(0, 8 * LBA) == ours[:8 * LBA]
        assert head.paths[0].usable_state(1) is None and told == []
        await swap(1)
        await trio.sleep(0.1)
        new = head.namespaces[1]
        assert new is not ns and new.generation == ns.generation + 1
        with pytest.raises(NamespaceReplaced, match="namespace n1 of .* was replaced by "
                                                    "another namespace \\(NGUID 0001"):
            await ns.read(0, LBA)
        assert await new.read(0, 8 * LBA) == bytes(other[:8 * LBA])
        assert [p.stale for p in head.paths] == [set(), set()]
        assert [(c.kind, c.nsid) for c in told] == [("replaced", 1)]
        assert NGUID_B.hex() in told[0].detail

    with caplog.at_level(logging.WARNING):
        run(test, port)
    stale = [r.getMessage() for r in caplog.records if "serves n1 no more" in r.getMessage()]
    assert len(stale) == 1 and stale[0].startswith("path 0 (rdma 192.0.2.1:4420): namespace "
                                                   "n1 there is not the one this mount serves")


def test_one_path_that_finds_another_namespace_replaces_the_heads_before_io_resumes():
    from nvmeof_fuse.errors import NamespaceReplaced

    port = Port(1)

    async def test(head: MultipathController) -> None:
        ns = head.namespaces[1]
        other = bytearray(os.urandom(len(port[0].disk)))
        port[0].disk, port[0].ns_ids = other, NamespaceIds(nguid=NGUID_B)
        port[0].fail_queues()
        with pytest.raises(NamespaceReplaced):  # it waited for the reconnect
            await ns.read(0, LBA)
        assert await head.namespaces[1].read(0, LBA) == bytes(other[:LBA])
        assert head.ids[1].ids.nguid == NGUID_B

    run(test, port, paths=1)


def test_a_path_whose_controller_reports_another_serial_is_refused_in_one_line():
    port = Port(2)
    port.serial["192.0.2.2"] = "other-serial"

    async def test(head: MultipathController) -> None:
        with pytest.raises(PathRefused) as refused:
            await head.add_path(options("192.0.2.2"))
        assert str(refused.value) == (
            "path nvme+rdma://192.0.2.2:4420/nqn.2014-08.org.example:mp refused: its "
            "controller is not of this mount's subsystem: its serial number 'fake-serial' != "
            "'other-serial'")

    run(test, port, paths=1)


def test_a_machine_without_sysfs_says_why_once_and_serves_as_before(monkeypatch, tmp_path,
                                                                    caplog):
    monkeypatch.setenv("NVMEOF_FUSE_SYSFS", str(tmp_path / "none"))
    port = Port()
    port.devices = {"192.0.2.1": LocalDevice("infiniband", "mlx5_0")}

    async def test(head: MultipathController) -> None:
        assert await head.namespaces[1].read(0, LBA) == bytes(port[0].disk[:LBA])
        assert info.paths_list(head)[0]["device"] == "mlx5_0"
        assert info.paths_list(head)[0]["device_pci"] is None

    with caplog.at_level(logging.INFO, logger="nvmeof_fuse.host.multipath.head"):
        run(test, port, topology=None)
    lines = [r.getMessage() for r in caplog.records if "PCIe topology" in r.getMessage()]
    assert lines == [f"no PCIe topology: {tmp_path}/none/bus/pci/devices cannot be read "
                     "(No such file or directory); paths are chosen as without one"]


def near_port(tmp_path) -> tuple[Port, Topology, dict[str, str]]:
    """Two paths, through mlx5_0 (socket 0) and mlx5_7 (socket 1) of the two-socket server."""
    pairs = two_socket_server(FakeSysfs(tmp_path))
    port = Port()
    port.devices = {"192.0.2.1": LocalDevice("infiniband", "mlx5_0"),
                    "192.0.2.2": LocalDevice("infiniband", "mlx5_7")}
    return port, Topology(str(tmp_path)), {nic: gpu for gpu, nic in pairs.items()}


def test_a_lease_goes_to_the_path_nearest_the_clients_memory(tmp_path):
    port, topology, gpu_of = near_port(tmp_path)

    async def test(head: MultipathController) -> None:
        near_second = MemoryPlace(gpu=gpu_of["mlx5_7"])
        ctrl = await head.lease_controller(near=near_second)
        assert ctrl is head.paths[1].ctrl
        assert head.nearness(ctrl, near_second) == {
            "index": 1, "device": "mlx5_7", "distance": "PIX",
            "memory": f"GPU {gpu_of['mlx5_7']}"}
        assert await head.lease_controller(near=MemoryPlace(gpu=gpu_of["mlx5_1"])) \
            is head.paths[0].ctrl  # PXB beats SYS
        assert await head.lease_controller(near=MemoryPlace(numa_node=1)) is head.paths[1].ctrl
        assert await head.lease_controller(near=near_second, path=0) is head.paths[0].ctrl
        assert await head.lease_controller() is head.paths[0].ctrl  # nothing said: the first
        # a GPU sysfs does not show: as without a topology
        assert await head.lease_controller(near=MemoryPlace(gpu="0000:ee:00.0")) \
            is head.paths[0].ctrl

    run(test, port, topology=topology)


def test_paths_at_one_distance_share_the_leases(tmp_path):
    port, topology, gpu_of = near_port(tmp_path)
    port.devices["192.0.2.2"] = LocalDevice("infiniband", "mlx5_1")  # both on socket 0

    async def test(head: MultipathController) -> None:
        leases = {id(p.ctrl): 0 for p in head.paths}
        for _ in range(4):
            ctrl = await head.lease_controller(near=MemoryPlace(numa_node=0),
                                               load=lambda c: leases[id(c)])
            leases[id(ctrl)] += 1
        assert sorted(leases.values()) == [2, 2]

    run(test, port, topology=topology)


def test_a_lease_moves_to_the_next_nearest_path_while_its_own_is_down(tmp_path, caplog):
    port, topology, gpu_of = near_port(tmp_path)
    caplog.set_level(logging.WARNING, logger="nvmeof_fuse.host.multipath.head")

    async def test(head: MultipathController) -> None:
        near = MemoryPlace(gpu=gpu_of["mlx5_7"])
        port[1].set_ana(AnaState.INACCESSIBLE)
        head.paths[1].kick()
        await trio.sleep(0.1)
        assert await head.lease_controller(near=near) is head.paths[0].ctrl
        port[1].set_ana(AnaState.OPTIMIZED)
        head.paths[1].kick()
        await trio.sleep(0.1)
        assert await head.lease_controller(near=near) is head.paths[1].ctrl

    run(test, port, topology=topology)
    # SYS meanwhile, but a nearer path is only away: no advice to add one
    assert not [r for r in caplog.records if "SYS" in r.getMessage()]


def test_a_nearer_path_back_is_where_the_lease_belongs_and_where_it_goes(tmp_path):
    port, topology, gpu_of = near_port(tmp_path)

    async def test(head: MultipathController) -> None:
        near = MemoryPlace(gpu=gpu_of["mlx5_7"])
        first, second = head.paths[0], head.paths[1]
        where_it_was = ("rdma", "192.0.2.1", 4420)
        assert await head.lease_controller(where_it_was) is first.ctrl  # nothing said: stays
        assert await head.lease_controller(where_it_was, near=near) is second.ctrl
        assert head.nearer_path(first.ctrl, near) is second
        assert head.nearer_path(second.ctrl, near) is None  # already there
        assert head.nearer_path(first.ctrl) is None  # nothing said of its memory
        assert head.nearer_path(second.ctrl, index=0) is first  # a path named: that one
        port[1].set_ana(AnaState.INACCESSIBLE)
        second.kick()
        await trio.sleep(0.1)
        assert head.nearer_path(first.ctrl, near) is None  # ANA does not let it serve
        port[1].set_ana(AnaState.OPTIMIZED)
        second.kick()
        await trio.sleep(0.1)
        assert head.nearer_path(first.ctrl, near) is second
        # memory on socket 0: the first path is the nearest already
        assert head.nearer_path(first.ctrl, MemoryPlace(numa_node=0)) is None

    run(test, port, topology=topology)


def test_a_gpu_whose_nearest_path_is_sys_is_told_once(tmp_path, caplog):
    port, topology, gpu_of = near_port(tmp_path)
    port.devices["192.0.2.2"] = LocalDevice("infiniband", "mlx5_1")  # both on socket 0
    far = MemoryPlace(gpu=gpu_of["mlx5_6"])

    async def test(head: MultipathController) -> None:
        for _ in range(3):
            await head.lease_controller(near=far)
        await head.lease_controller(near=MemoryPlace(gpu=gpu_of["mlx5_0"]))

    with caplog.at_level(logging.WARNING, logger="nvmeof_fuse.host.multipath.head"):
        run(test, port, topology=topology)
    lines = [r.getMessage() for r in caplog.records if "SYS" in r.getMessage()]
    assert lines == [f"GPU {gpu_of['mlx5_6']}: its nearest path, path 0 (rdma 192.0.2.1:4420) "
                     "via mlx5_0, is SYS to it (across the sockets), where reads lose up to "
                     "70%: add a path through a NIC on its socket (--path "
                     "URI?host_iface=DEVICE)"]


# -- the mount's last seconds (issue #56 item 3) ----------------------------------------------


def test_winding_down_ends_every_paths_commands_by_the_mounts_deadline_and_the_head_with_them():
    """Issue #56: a final Flush the target never answered held SIGTERM for the command
    timeout (30 s), and the paths' teardown would have waited for it once more.  From
    wind_down on, a command in flight on a path times out by the mount's deadline, fails
    at once instead of going to the other path, and the head closes right after."""
    port = Port()
    ended = []

    async def main() -> None:
        opts = [options(addr) for addr in port.targets]
        async with multipath.connect(opts, connect_path=port.connect) as head:
            for target in port.targets.values():
                target.go_away()  # nothing is answered from now on

            async def flush() -> None:
                try:
                    await head.namespaces[1].flush()
                except ControllerLost as exc:
                    ended.append((trio.current_time(), str(exc)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(flush)
                await trio.sleep(1)
                head.wind_down("/mnt is being unmounted", 10)
        ended.append((trio.current_time(), "closed"))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    (flushed_at, why), (closed_at, _) = ended
    assert flushed_at == pytest.approx(10, abs=0.1)
    assert why.startswith("/mnt is being unmounted (I/O queue 1: "), why
    assert closed_at == pytest.approx(10, abs=0.1)


def test_a_path_connected_while_the_mount_winds_down_winds_down_with_it():
    port = Port()
    port[1].go_away()

    async def test(head: MultipathController) -> None:
        head.wind_down("/mnt is being unmounted", trio.current_time() + 9)
        port[1].come_back()
        await trio.sleep(2)
        assert head.paths[1].state == "live"
        assert head.paths[1].ctrl.command_timeout() == pytest.approx(7, abs=0.1)

    run(test, port)


def test_the_heads_shutdown_timeout_is_its_longest_paths():
    port = Port()

    async def main() -> None:
        addrs = list(port.targets)
        opts = [options(addrs[0], shutdown_timeout=5), options(addrs[1], shutdown_timeout=7)]
        async with multipath.connect(opts, connect_path=port.connect) as head:
            assert head.shutdown_timeout() == 7

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
