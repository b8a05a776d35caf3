"""PCIe distances in nvidia-smi's words, from sysfs paths alone."""

from __future__ import annotations

import pytest

from nvmeof_fuse.host.topology.pcie import (
    Distance,
    PciDevice,
    bus_id,
    distance,
    distance_to_node,
    nearest,
    parse_device_path,
)


def device(path: str, node: int | None = 0) -> PciDevice:
    found = parse_device_path(path, numa_node=node)
    assert found is not None
    return found


GPU = "devices/pci0000:97/0000:97:01.0/0000:98:00.0/0000:99:01.0/0000:9a:00.0"
NIC_SAME_SWITCH = "devices/pci0000:97/0000:97:01.0/0000:98:00.0/0000:99:02.0/0000:9b:00.0"
NIC_OTHER_ROOT_PORT = "devices/pci0000:97/0000:97:02.0/0000:9c:00.0"


def test_addresses_as_sysfs_spells_them():
    assert bus_id("00000000:9A:00.0") == "0000:9a:00.0"
    assert bus_id(" 0000:9a:00.1\n") == "0000:9a:00.1"
    with pytest.raises(ValueError, match=r"'mlx5_0' is not a PCI address \(DOMAIN:BUS"):
        bus_id("mlx5_0")


def test_a_path_names_its_host_bridge_bridges_and_device():
    gpu = device(GPU, node=1)
    assert gpu.bus_id == "0000:9a:00.0" and gpu.host_bridge == "/devices/pci0000:97"
    assert gpu.bridges == ("0000:97:01.0", "0000:98:00.0", "0000:99:01.0")
    assert gpu.switches() == ("0000:98:00.0",)  # the switch by its upstream port
    assert gpu.numa_node == 1


def test_paths_that_are_no_pci_devices_below_a_host_bridge_are_none():
    assert parse_device_path("devices/virtual/net/dummy0") is None
    assert parse_device_path("devices/pci0000:00") is None
    assert parse_device_path("devices/pci0000:00/0000:00:01.0/usb1/1-1") is None


def test_numa_node_minus_one_is_unknown():
    assert parse_device_path(GPU, numa_node=-1).numa_node is None


def test_one_switch_is_pix_another_root_port_phb():
    gpu = device(GPU)
    assert distance(gpu, device(NIC_SAME_SWITCH)) == Distance.PIX
    assert distance(gpu, device(NIC_OTHER_ROOT_PORT)) == Distance.PHB
    assert distance(gpu, gpu) == Distance.PIX


def test_functions_of_one_parent_bridge_are_pix():
    a = device("devices/pci0000:00/0000:00:02.0/0000:03:00.0")
    b = device("devices/pci0000:00/0000:00:02.0/0000:03:00.1")
    assert distance(a, b) == Distance.PIX


def test_two_switches_without_the_host_bridge_are_pxb():
    top = "devices/pci0000:15/0000:15:01.0/0000:16:00.0"
    gpu = device(top + "/0000:17:00.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0")
    nic = device(top + "/0000:17:01.0/0000:1c:00.0/0000:1d:01.0/0000:1e:00.0")
    nic_on_the_top_switch = device(top + "/0000:17:02.0/0000:20:00.0")
    assert distance(gpu, nic) == Distance.PXB
    assert distance(gpu, nic_on_the_top_switch) == Distance.PXB
    assert distance(nic, gpu) == Distance.PXB


def test_other_host_bridges_are_node_on_one_socket_and_sys_across():
    gpu = device(GPU, node=1)
    assert distance(gpu, device("devices/pci0000:b8/0000:b8:01.0/0000:b9:00.0", 1)) \
        == Distance.NODE
    assert distance(gpu, device("devices/pci0000:15/0000:15:01.0/0000:16:00.0", 0)) \
        == Distance.SYS


def test_an_unknown_node_is_sys_unless_the_machine_has_one_node():
    gpu = device(GPU, node=None)
    other = device("devices/pci0000:b8/0000:b8:01.0/0000:b9:00.0", 1)
    assert distance(gpu, other) == Distance.SYS
    assert distance(gpu, other, single_node=True) == Distance.NODE
    assert distance(gpu, device(NIC_SAME_SWITCH, None)) == Distance.PIX  # no node needed


def test_memory_in_a_node():
    nic = device(NIC_SAME_SWITCH, node=1)
    assert distance_to_node(nic, 1) == Distance.NODE
    assert distance_to_node(nic, 0) == Distance.SYS
    assert distance_to_node(device(NIC_SAME_SWITCH, None), None) == Distance.SYS
    assert distance_to_node(device(NIC_SAME_SWITCH, None), 0, single_node=True) == Distance.NODE


def test_the_nearest_share_the_load():
    assert nearest({"a": Distance.NODE, "b": Distance.PIX, "c": Distance.PIX}) == ["b", "c"]
    assert nearest({}) == []
