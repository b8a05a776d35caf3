"""Where a File's memory is, as its lease request says it (companion/client/memory_place.py):
CUDA devices by their PCI address through the fake driver, host memory by NUMA node from a
fake sysfs, and bad places refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from fake_cuda import FakeDriver
from sysfs_fakes import FakeSysfs

from nvmeof_fuse.companion.client import memory_place as where
from nvmeof_fuse.companion.client.memory_place import memory_place, thread_numa_node
from nvmeof_fuse.companion.cuda import gpu
from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.host.multipath.nearest import MemoryPlace
from nvmeof_fuse.host.topology.sysfs import Topology


@pytest.fixture
def cuda():
    driver = FakeDriver(devices=2)
    driver.bus_ids = {0: "00000000:1A:00.0", 1: "00000000:9A:00.0"}
    return driver, gpu.Cuda(driver)


@pytest.fixture
def two_nodes(tmp_path) -> Topology:
    fs = FakeSysfs(tmp_path)
    fs.node(0, "0-3")
    fs.node(1, "4-7")
    return Topology(str(tmp_path))


class TorchDevice:  # what a torch.device shows
    def __init__(self, index: int | None) -> None:
        self.type, self.index = "cuda", index


@pytest.mark.parametrize("near", [1, "cuda:1", " CUDA:1", TorchDevice(1), "0000:9a:00.0",
                                  "00000000:9A:00.0"])
def test_a_cuda_device_is_said_by_its_pci_address(cuda, near):
    _, seam = cuda
    assert memory_place(near, seam) == MemoryPlace(gpu="0000:9a:00.0")


def test_a_cuda_buffer_is_said_by_its_devices_pci_address(cuda):
    driver, seam = cuda
    assert memory_place(driver.tensor(4096, device=1), seam) == MemoryPlace(gpu="0000:9a:00.0")
    assert memory_place(TorchDevice(None), seam) == MemoryPlace(gpu="0000:1a:00.0")


def test_a_numa_node_is_said_as_it_is_named(cuda):
    _, seam = cuda
    assert memory_place("numa:1", seam) == MemoryPlace(numa_node=1)
    assert memory_place(MemoryPlace(numa_node=3), seam) == MemoryPlace(numa_node=3)


def test_the_calling_threads_node_holds_all_its_cpus(two_nodes, monkeypatch, cuda):
    monkeypatch.setattr(where.os, "sched_getaffinity", lambda pid: {5, 6})
    assert thread_numa_node(two_nodes) == 1
    assert memory_place(None, cuda[1], two_nodes) == MemoryPlace(numa_node=1)


def test_a_thread_free_to_run_on_both_nodes_says_the_one_it_runs_on(two_nodes, monkeypatch):
    monkeypatch.setattr(where.os, "sched_getaffinity", lambda pid: {0, 5})
    node = thread_numa_node(two_nodes)
    assert node in (0, 1) or node is None  # this machine's CPU: not one of the fake's


def test_without_numa_nodes_nothing_is_said(tmp_path, cuda):
    empty = Topology(str(tmp_path / "none"))
    assert thread_numa_node(empty) is None
    assert memory_place(None, cuda[1], empty) is None


def test_host_memory_is_said_by_the_node_of_its_pages(cuda, monkeypatch, two_nodes):
    touched = np.ones(1 << 16, dtype=np.uint8)
    assert where.pages_numa_node(touched.ctypes.data) in (None, *range(4096))
    monkeypatch.setattr(where, "pages_numa_node", lambda addr: 1)
    assert memory_place(touched, cuda[1], two_nodes) == MemoryPlace(numa_node=1)
    monkeypatch.setattr(where, "pages_numa_node", lambda addr: None)  # not touched yet
    monkeypatch.setattr(where.os, "sched_getaffinity", lambda pid: {0})
    assert memory_place(touched, cuda[1], two_nodes) == MemoryPlace(numa_node=0)


@pytest.mark.parametrize("near, message", [
    (True, r"near=True is not a place \(a CUDA device, 'numa:N', a buffer\)"),
    (-1, "near=-1 is not a CUDA device ordinal"),
    (5, r"near=5: no CUDA device 5 \(cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE \(101\)\)"),
    ("cuda:7", r"near='cuda:7': no CUDA device 7"),
    ("numa:9999", "near='numa:9999': NUMA nodes go to 4095"),
    ("gpu0", r"near='gpu0' is not a place: a CUDA device \(0, 'cuda:0'\), 'numa:N', a GPU's "
             r"PCI address, or a buffer"),
    ("x" * 100, r"near='x{56}\.\.\. is not a place"),
    (object(), "near=<object object at 0x[0-9a-f]+> is not a place"),
])
def test_a_bad_place_is_one_line(cuda, near, message):
    with pytest.raises(InvalidArgument, match=f"^{message}") as caught:
        memory_place(near, cuda[1])
    assert "\n" not in str(caught.value)
