"""The topology in words (host/topology/report.py), as scripts/gpu-check prints it."""

from __future__ import annotations

from sysfs_fakes import FakeSysfs, two_socket_server

from nvmeof_fuse.host.topology.report import report
from nvmeof_fuse.host.topology.sysfs import Topology


def test_each_gpu_names_its_nearest_nic_in_nccls_words(tmp_path):
    pairs = two_socket_server(FakeSysfs(tmp_path))
    lines = report(Topology(str(tmp_path)))
    assert lines[0] == f"PCIe topology from {tmp_path}: 8 GPU(s), 8 RDMA device(s)"
    first = sorted(pairs)[0]
    assert f"  GPU {first} ({first}, NUMA 0)" in lines
    assert any(line.startswith("  RDMA mlx5_7 (") and line.endswith(", NUMA 1)")
               for line in lines), lines
    for gpu, nic in pairs.items():
        assert f"  GPU {gpu}: nearest {nic}, PIX" in lines


def test_cuda_spelling_a_gpu_sysfs_lacks_and_a_gpu_on_the_nicless_socket(tmp_path):
    fs = FakeSysfs(tmp_path)
    fs.node(0, "0-3")
    fs.node(1, "4-7")
    nic = fs.device("pci0000:00", "0000:00:01.0", "0000:01:00.0", numa_node=0)
    fs.rdma("mlx5_0", nic)
    far = fs.gpu("pci0000:80", "0000:80:01.0", "0000:81:00.0", numa_node=1)
    lines = report(Topology(str(tmp_path)), ["00000000:81:00.0", "00000000:EE:00.0"])
    assert f"  GPU {far}: nearest mlx5_0, SYS (across the sockets: reads lose up to 70%)" \
        in lines
    assert "  GPU 0000:ee:00.0 (0000:ee:00.0, not in sysfs)" in lines
    assert "  GPU 0000:ee:00.0: distance unknown to every RDMA device: leases go as " \
           "without a topology" in lines


def test_no_rdma_device_and_no_sysfs_each_say_so(tmp_path):
    fs = FakeSysfs(tmp_path / "sys")
    fs.gpu("pci0000:00", "0000:00:01.0", "0000:01:00.0", numa_node=0)
    lines = report(Topology(str(tmp_path / "sys")))
    assert lines[-1] == ("  no RDMA device: a lease goes to the first usable path, as "
                         "without a topology")
    assert report(Topology(str(tmp_path / "none"))) == [
        f"no PCIe topology: {tmp_path}/none/bus/pci/devices cannot be read (No such file or "
        "directory); paths are chosen as without one"]
