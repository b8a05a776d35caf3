"""The topology read from fake sysfs trees: each GPU's nearest NIC as nvidia-smi topo -m
would call it, one NIC, no NIC on a GPU's socket, numa_node -1, VFs, Soft-RoCE, no sysfs."""

from __future__ import annotations

import pytest
from sysfs_fakes import FakeSysfs, two_socket_server

from nvmeof_fuse.host.topology.pcie import Distance, nearest
from nvmeof_fuse.host.topology.sysfs import ROOT_VARIABLE, Topology, default_root, parse_cpulist


def nic_distances(topology: Topology, gpu: str) -> dict[str, Distance]:
    here = topology.pci_device(gpu)
    return {name: topology.distance(here, topology.rdma_device(name))
            for name in topology.rdma_devices()}


def test_the_root_is_sys_unless_replaced(monkeypatch):
    monkeypatch.delenv(ROOT_VARIABLE, raising=False)
    assert default_root() == "/sys"
    monkeypatch.setenv(ROOT_VARIABLE, "/tmp/fake")
    assert default_root() == "/tmp/fake"


def test_each_of_8_gpus_gets_the_nic_on_its_switch(tmp_path):
    pairs = two_socket_server(FakeSysfs(tmp_path))
    topology = Topology(str(tmp_path))
    assert topology.unavailable is None
    assert topology.gpus() == sorted(pairs)
    for gpu, nic in pairs.items():
        assert nearest(nic_distances(topology, gpu)) == [nic]
    # the row of the first GPU, as nvidia-smi topo -m prints it
    first = topology.gpus()[0]
    assert [w.name for w in nic_distances(topology, first).values()] == \
        ["PIX", "PXB", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]


def test_devices_carry_their_numa_node(tmp_path):
    pairs = two_socket_server(FakeSysfs(tmp_path))
    topology = Topology(str(tmp_path))
    assert [topology.pci_device(g).numa_node for g in sorted(pairs)] == [0] * 4 + [1] * 4
    assert topology.rdma_device("mlx5_7").numa_node == 1
    assert topology.net_device("ibp31s0").bus_id == topology.rdma_device("mlx5_1").bus_id
    assert topology.node_of_cpus({16, 17}) == 1
    assert topology.node_of_cpus({1, 17}) is None
    assert not topology.single_node


def test_one_nic_serves_all_gpus_at_their_distances(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, "0-7")
    fs.node(1, "8-15")
    near = ("0000:15:01.0", "0000:16:00.0")
    gpu = fs.gpu("pci0000:15", *near, "0000:17:00.0", numa_node=0)
    far = fs.gpu("pci0000:97", "0000:97:01.0", "0000:98:00.0", numa_node=1)
    fs.rdma("mlx5_0", fs.device("pci0000:15", "0000:15:02.0", "0000:18:00.0", numa_node=0))
    topology = Topology(str(tmp_path))
    assert nic_distances(topology, gpu) == {"mlx5_0": Distance.PHB}
    assert nic_distances(topology, far) == {"mlx5_0": Distance.SYS}


def test_gpus_with_no_nic_on_their_socket_share_the_far_ones(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, "0-7")
    fs.node(1, "8-15")
    fs.rdma("mlx5_0", fs.device("pci0000:15", "0000:15:01.0", "0000:16:00.0", numa_node=0))
    fs.rdma("mlx5_1", fs.device("pci0000:37", "0000:37:01.0", "0000:38:00.0", numa_node=0))
    gpu = fs.gpu("pci0000:97", "0000:97:01.0", "0000:98:00.0", numa_node=1)
    distances = nic_distances(Topology(str(tmp_path)), gpu)
    assert distances == {"mlx5_0": Distance.SYS, "mlx5_1": Distance.SYS}
    assert nearest(distances) == ["mlx5_0", "mlx5_1"]


def test_numa_node_minus_one(tmp_path):
    fs = FakeSysfs(tmp_path)
    gpu = fs.gpu("pci0000:00", "0000:00:01.0", "0000:01:00.0")  # numa_node -1
    fs.rdma("mlx5_0", fs.device("pci0000:40", "0000:40:01.0", "0000:41:00.0"))
    fs.rdma("mlx5_1", fs.device("pci0000:00", "0000:00:02.0", "0000:02:00.0"))
    fs.node(0, "0-3")
    topology = Topology(str(tmp_path))
    assert topology.pci_device(gpu).numa_node is None
    # one node: the unknown node is that one
    assert nic_distances(topology, gpu) == {"mlx5_0": Distance.NODE, "mlx5_1": Distance.PHB}
    fs.node(1, "4-7")  # two nodes: an unknown node may be the other socket
    assert nic_distances(Topology(str(tmp_path)), gpu) == \
        {"mlx5_0": Distance.SYS, "mlx5_1": Distance.PHB}


def test_a_virtual_function_sits_where_its_physical_one_does(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, "0-3")
    below = ("0000:97:01.0", "0000:98:00.0")
    gpu = fs.gpu("pci0000:97", *below, "0000:99:00.0", "0000:9a:00.0", numa_node=0)
    pf = fs.device("pci0000:97", *below, "0000:99:01.0", "0000:9b:00.0", numa_node=0)
    fs.rdma("mlx5_4", fs.virtual_function(pf, "0000:9b:00.2"))
    topology = Topology(str(tmp_path))
    vf = topology.rdma_device("mlx5_4")
    assert (vf.bus_id, vf.physfn, vf.numa_node) == ("0000:9b:00.2", "0000:9b:00.0", 0)
    assert topology.pci_device(pf).physfn is None
    assert nic_distances(topology, gpu) == {"mlx5_4": Distance.PIX}


def test_soft_roce_sits_where_its_netdev_does(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.net("eth0", fs.device("pci0000:00", "0000:00:03.0", "0000:05:00.0", numa_node=0))
    fs.net("rxenet0")  # a dummy: virtual
    fs.rdma("rxe0", netdev="eth0")
    fs.rdma("rxe1", netdev="rxenet0")
    topology = Topology(str(tmp_path))
    assert topology.rdma_device("rxe0").bus_id == "0000:05:00.0"
    assert topology.rdma_device("rxe1") is None
    assert topology.rdma_device("absent") is None
    assert topology.rdma_device("../net") is None


def test_a_gpu_sysfs_does_not_show_is_none(tmp_path):
    two_socket_server(FakeSysfs(tmp_path))
    topology = Topology(str(tmp_path))
    assert topology.pci_device("0000:ee:00.0") is None
    assert topology.pci_device("GPU-1234") is None


def test_a_missing_sysfs_says_why_in_one_line(tmp_path):
    topology = Topology(str(tmp_path / "none"))
    assert topology.unavailable == (
        f"no PCIe topology: {tmp_path}/none/bus/pci/devices cannot be read "
        "(No such file or directory); paths are chosen as without one")
    assert topology.gpus() == [] and topology.rdma_devices() == []
    assert topology.pci_device("0000:9a:00.0") is None
    assert topology.single_node


@pytest.mark.parametrize(("text", "cpus"), [("0-3,8", {0, 1, 2, 3, 8}), ("5", {5}),
                                            ("", set()), ("3-1", set()), ("x", set())])
def test_cpu_lists(text, cpus):
    assert parse_cpulist(text) == cpus
