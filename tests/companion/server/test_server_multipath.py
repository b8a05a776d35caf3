"""The companion server on a multipath head: leases live on a path, are revoked when it goes,
and come back on another; paths change on request (what add-path/remove-path send)."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from multipath_fakes import NQN, Port, options
from sysfs_fakes import FakeSysfs, two_socket_server

from nvmeof_fuse.companion.server.server import CompanionServer
from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.host.multipath import head as multipath
from nvmeof_fuse.host.multipath.nearest import lease_wish
from nvmeof_fuse.host.multipath.path import PathRefused
from nvmeof_fuse.host.topology.sysfs import Topology
from nvmeof_fuse.transport.base import LocalDevice


def run(test, port: Port, paths: int = 2, topology: Topology | None = None):
    async def main() -> None:
        opts = [options(addr, companion_queues=4) for addr in list(port.targets)[:paths]]
        async with multipath.connect(opts, connect_path=port.connect,
                                     topology=topology or Topology("/nonexistent")) as head:
            async with trio.open_nursery() as nursery:
                server = CompanionServer(head)
                nursery.start_soon(server._revoke_leases_on_loss)
                await test(head, server)
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_lease_lives_on_a_path_and_moves_when_that_path_goes():
    port = Port()

    async def test(head, server) -> None:
        def leasable(ctrl):
            ctrl.lease_qids, ctrl.io_queue_size = [3, 4, 5, 6], lambda: 32
        for path in head.paths:
            leasable(path.ctrl)
        session = server.new_session("pid 2 uid 0")
        events = []

        async def notify(event):
            events.append(event)
        session.notify = notify
        first = await server.lease(session, 2)
        assert (first["traddr"], first["cntlid"], first["qids"]) == ("192.0.2.1", 1, [3, 4])
        port[0].go_away()
        port[0].fail_queues()
        for _ in range(2):  # a command on each path notices (no keep-alive here)
            await head.namespaces[1].read(0, 512)
        await trio.sleep(0.1)
        port.on_connect = leasable  # path 0's next controller
        assert [e["event"] for e in events] == ["revoked"]
        again = await server.lease(session, 2)
        assert (again["traddr"], again["cntlid"], again["qids"]) == ("192.0.2.2", 2, [3, 4])
        port[0].come_back()
        await trio.sleep(3)
        assert len(events) == 1  # path 0 is back, but the lease stays where it is

    run(test, port)


def test_paths_change_on_request_and_refusals_are_errors():
    port = Port()

    async def test(head, server) -> None:
        uri = f"nvme+rdma://192.0.2.2/{NQN}"
        assert await server.change_path("add_path", uri) == {"index": 1,
                                                              "uri": uri.replace("2/", "2:4420/")}
        with pytest.raises(PathRefused, match="already path 1"):
            await server.change_path("add_path", uri)
        assert (await server.change_path("remove_path", "1"))["index"] == 1
        assert [p.index for p in head.paths] == [0]

    run(test, port, paths=1)


def test_a_lease_moves_only_to_a_path_of_its_own_transport():
    """A client's queues keep the transport they were connected with: on a mount over RDMA
    and NVMe/TCP paths, a lease on the lost RDMA path waits for an RDMA path."""
    port = Port()

    async def main() -> None:
        opts = [options(addr, companion_queues=4, ctrl_loss_tmo=-1)
                for addr in list(port.targets)[:2]]
        opts[1].transport = "tcp"
        async with multipath.connect(opts, connect_path=port.connect) as head:
            for path in head.paths:
                path.ctrl.lease_qids, path.ctrl.io_queue_size = [3, 4], lambda: 32
            server = CompanionServer(head)
            session = server.new_session("pid 2 uid 0")
            first = await server.lease(session, 2)
            assert first["traddr"] == "192.0.2.1" and first["transport"] == "rdma"
            port[0].go_away()
            port[0].fail_queues()
            for _ in range(2):
                await head.namespaces[1].read(0, 512)
            with trio.move_on_after(30) as waited:
                await server.lease(session, 2)
            assert waited.cancelled_caught  # not moved to the TCP path

            def leasable(ctrl):
                ctrl.lease_qids, ctrl.io_queue_size = [3, 4], lambda: 32
            port.on_connect = leasable
            port[0].come_back()
            again = await server.lease(session, 2)
            assert again["traddr"] == "192.0.2.1" and again["transport"] == "rdma"

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_lease_names_the_path_nearest_the_clients_memory_and_how_near(tmp_path):
    pairs = two_socket_server(FakeSysfs(tmp_path))
    gpu_of = {nic: gpu for gpu, nic in pairs.items()}
    port = Port()
    port.devices = {"192.0.2.1": LocalDevice("infiniband", "mlx5_0"),
                    "192.0.2.2": LocalDevice("infiniband", "mlx5_7")}

    async def test(head, server) -> None:
        for path in head.paths:
            path.ctrl.lease_qids, path.ctrl.io_queue_size = [3, 4, 5, 6], lambda: 32
        near = server.new_session("pid 2 uid 0")
        reply = await server.lease(near, 1, **lease_wish({"memory": {"gpu": gpu_of["mlx5_7"]}}))
        assert reply["traddr"] == "192.0.2.2"
        assert reply["path"] == {"index": 1, "device": "mlx5_7", "distance": "PIX",
                                 "memory": f"GPU {gpu_of['mlx5_7']}"}
        told = server.new_session("pid 3 uid 0")
        reply = await server.lease(told, 1, **lease_wish(
            {"memory": {"gpu": gpu_of["mlx5_7"].upper()}, "path": 0}))
        assert reply["path"] == {"index": 0, "device": "mlx5_0", "distance": "SYS",
                                 "memory": f"GPU {gpu_of['mlx5_7']}"}
        with pytest.raises(InvalidArgument, match="lease's path 'x' is not a path index"):
            lease_wish({"path": "x"})

    run(test, port, topology=Topology(str(tmp_path)))
