"""Where a client's memory is, as a lease request says it, and the nearest path to it."""

from __future__ import annotations

import pytest

from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.host.multipath.nearest import MemoryPlace, lease_wish, nearest
from nvmeof_fuse.host.topology.pcie import Distance


def test_memory_from_a_lease_request():
    assert MemoryPlace.from_field(None) is None
    gpu = MemoryPlace.from_field({"gpu": "00000000:9A:00.0"})
    assert gpu == MemoryPlace(gpu="0000:9a:00.0") and str(gpu) == "GPU 0000:9a:00.0"
    node = MemoryPlace.from_field({"numa_node": 1})
    assert str(node) == "NUMA node 1" and node.to_field() == {"numa_node": 1}
    assert MemoryPlace.from_field(gpu.to_field()) == gpu


@pytest.mark.parametrize("field, message", [
    ("gpu0", "memory 'gpu0' is not {'gpu': PCI address} or {'numa_node': N}"),
    ({}, "memory {} is not"),
    ({"socket": 1}, "memory {'socket': 1} is not"),
    ({"gpu": "GPU-1"}, "memory's gpu 'GPU-1' is not a PCI address"),
    ({"gpu": 7}, "memory's gpu 7 is not a PCI address"),
    ({"numa_node": -1}, "memory's numa_node -1 is not 0-4095"),
    ({"numa_node": True}, "memory's numa_node True is not 0-4095"),
])
def test_bad_memory_is_one_line(field, message):
    with pytest.raises(InvalidArgument) as info:
        MemoryPlace.from_field(field)
    assert str(info.value).startswith(message)


def test_the_nearest_then_the_least_loaded_then_the_first():
    distances = {"a": Distance.NODE, "b": Distance.PIX, "c": Distance.PIX, "d": None}
    loads = {"a": 0, "b": 2, "c": 1, "d": 0}
    assert nearest(list(distances), distances.get, loads.get) == "c"
    loads["c"] = 2
    assert nearest(list(distances), distances.get, loads.get) == "b"


def test_unknown_distances_choose_as_without_a_topology():
    assert nearest(["a", "b"], lambda p: None, {"a": 5, "b": 0}.get) == "a"
    assert nearest(["a", "b"], {"a": None, "b": Distance.SYS}.get, lambda p: 0) == "b"


def test_a_lease_request_asks_only_what_it_says():
    assert lease_wish({"want": 2}) == {}
    assert lease_wish({"path": 1, "memory": {"numa_node": 0}}) == \
        {"path": 1, "near": MemoryPlace(numa_node=0)}
    with pytest.raises(InvalidArgument, match="lease's path -1 is not a path index"):
        lease_wish({"path": -1})
