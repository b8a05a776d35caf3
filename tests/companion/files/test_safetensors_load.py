"""load_safetensors and its header checks (companion/safetensors_header.py, safetensors_load.py),
against safetensors.numpy, over the real companion socket and a fake controller."""

from __future__ import annotations

import json
import struct
import sys
import types

import numpy as np
import pytest
from companion_fakes import AddressController, serving
from safetensors.numpy import load_file, save

import nvmeof_fuse
from nvmeof_fuse.companion.client import file as client
from nvmeof_fuse.companion.files import fsmap, safetensors_load
from nvmeof_fuse.companion.files import safetensors_header as sth
from nvmeof_fuse.companion.files.fiemap import LAST, Extent
from nvmeof_fuse.companion.protocol import CompanionError
from nvmeof_fuse.errors import InvalidArgument

BASE = 1 << 20


@pytest.fixture(autouse=True)
def _warnings_stay_ours():
    """What these tests log once is logged again for the tests after them."""
    before = set(client._warned)
    yield
    client._warned.intersection_update(before)


def tensors(seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"embed.weight": rng.standard_normal((61, 33)).astype(np.float32),
            "layer.0.bias": rng.integers(-9, 9, 17, dtype=np.int64),
            "half": rng.standard_normal((5, 7, 3)).astype(np.float16),
            "mask": rng.integers(0, 2, 9).astype(bool),
            "scalar": np.array(2.5, dtype=np.float64),
            "empty": np.zeros((0, 4), dtype=np.float32),
            "u8": rng.integers(0, 255, 4097, dtype=np.uint8)}


@pytest.fixture
def served(tmp_path):
    ctrl = AddressController()
    with serving(ctrl, tmp_path) as (server, mnt):
        yield ctrl, server, mnt


def same(got: dict, want: dict) -> None:
    assert list(got) == sorted(want)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, name
        assert got[name].tobytes() == arr.tobytes(), name


def test_a_namespace_file_loads_equal_to_safetensors_numpy(served, tmp_path):
    ctrl, server, mnt = served
    data = save(tensors(), metadata={"format": "np"})
    ctrl.disks[1][:len(data)] = data
    (tmp_path / "ref.safetensors").write_bytes(data)
    got = nvmeof_fuse.load_safetensors(str(mnt / "n1"))
    same(got, load_file(str(tmp_path / "ref.safetensors")))


def test_a_file_on_a_filesystem_loads_equal_to_safetensors_numpy(served, tmp_path, monkeypatch):
    ctrl, server, mnt = served
    data = save(tensors(5))
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    length = -(-len(data) // 4096) * 4096
    ctrl.disks[1][BASE:BASE + len(data)] = data  # one extent, at 1 MiB
    monkeypatch.setattr(fsmap, "resolve", lambda p, st=None: fsmap.Chain(
        str(p), "xfs", "loop0", "loop0", str(mnt / "n1"), 0, 0, 512, True))
    monkeypatch.setattr(fsmap, "fiemap", lambda fd, start, n, flags=1: [
        Extent(0, BASE, length, LAST)])
    got = nvmeof_fuse.load_safetensors(str(path))
    same(got, load_file(str(path)))


class FakeTensor:
    """Host memory with what File reads a torch CPU tensor by (data_ptr, element_size)."""

    def __init__(self, shape, dtype: str, device) -> None:
        self.array = np.empty(shape, dtype=np.dtype(dtype))
        self.device = device

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def element_size(self) -> int:
        return self.array.itemsize

    def numel(self) -> int:
        return self.array.size

    def is_contiguous(self) -> bool:
        return True


def test_the_torch_branch_makes_tensors_on_the_device_asked(served, tmp_path, monkeypatch):
    """torch is imported only for a torch device; a fake one stands in where it is absent."""
    ctrl, server, mnt = served
    data = save(tensors(7))
    ctrl.disks[1][:len(data)] = data
    fake = types.ModuleType("torch")
    fake.device = lambda d: f"device({d})"
    for name in set(sth.TORCH.values()):
        setattr(fake, name, {"bool": "bool", "bfloat16": "u2"}.get(name, name))
    fake.empty = lambda shape, dtype, device: FakeTensor(shape, dtype, device)
    monkeypatch.setitem(sys.modules, "torch", fake)
    got = nvmeof_fuse.load_safetensors(str(mnt / "n1"), device="cpu")
    want = tensors(7)
    for name, arr in want.items():
        assert got[name].device == "device(cpu)"
        assert got[name].array.tobytes() == arr.tobytes(), name


def test_no_torch_is_named(served, monkeypatch):
    ctrl, server, mnt = served
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(InvalidArgument, match="device='cuda' needs torch"):
        nvmeof_fuse.load_safetensors(str(mnt / "n1"), device="cuda")


def header_file(header: object, data: bytes = b"", raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


T = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(("content", "error"), [
    (b"\x01\x02", "too short for a safetensors header"),
    (struct.pack("<Q", 200_000_000) + b"{}", "header length 200000000 exceeds the limit"),
    (struct.pack("<Q", 64) + b"{}", "header length 64 runs past the end"),
    (header_file(None, raw=b"{not json"), "header is not valid JSON"),
    (header_file(None, raw=b"\xff\xfe"), "header is not valid JSON"),
    (header_file([1, 2]), "header is a JSON list, not an object"),
    (header_file({"t": 5}), "tensor 't': entry is not an object"),
    (header_file({"t": {**T, "dtype": "F128"}}, bytes(8)), "unknown dtype 'F128'"),
    (header_file({"t": {**T, "shape": [2, -1]}}, bytes(8)), "shape [2, -1] is not a list"),
    (header_file({"t": {**T, "shape": "2"}}, bytes(8)), "shape '2' is not a list"),
    (header_file({"t": {**T, "shape": [0] * 65, "data_offsets": [0, 0]}}),
     "shape has 65 dimensions, more than 64"),
    (header_file({"t": {**T, "shape": [0, 1 << 40, 1 << 40], "data_offsets": [0, 0]}}),
     "shape [0, 1099511627776, 1099511627776] of F32 is too large for an array"),
    (header_file({"t": {**T, "data_offsets": [0]}}, bytes(8)), "is not two non-negative"),
    (header_file({"t": {**T, "data_offsets": [8, 0]}}, bytes(8)), "end before they begin"),
    (header_file({"t": T}, bytes(4)), "run past the end of the file (4 data bytes)"),
    (header_file({"t": {**T, "shape": [3]}}, bytes(8)), "hold 8 bytes, shape [3] of F32 needs 12"),
    (header_file({"a": T, "b": {**T, "data_offsets": [4, 12]}}, bytes(12)),
     "tensor 'b' at data offset 4 overlaps tensor 'a'"),
    (header_file({"__metadata__": {"k": 1}, "t": T}, bytes(8)), "__metadata__ must map strings"),
])
def test_a_malformed_header_gets_one_line_naming_what_is_wrong(tmp_path, content, error,
                                                               monkeypatch, served):
    ctrl, server, mnt = served
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    length = max(4096, -(-len(content) // 4096) * 4096)
    ctrl.disks[1][BASE:BASE + len(content)] = content
    monkeypatch.setattr(fsmap, "resolve", lambda p, st=None: fsmap.Chain(
        str(p), "ext4", "loop0", "loop0", str(mnt / "n1"), 0, 0, 512, True))
    monkeypatch.setattr(fsmap, "fiemap", lambda fd, start, n, flags=1: [
        Extent(0, BASE, length, LAST)])
    with pytest.raises(InvalidArgument) as info:
        nvmeof_fuse.load_safetensors(str(path))
    message = str(info.value)
    assert error in message and "\n" not in message and message.startswith(str(path))


def test_a_dtype_numpy_lacks_is_named():
    tensors_, _ = sth.parse_header(json.dumps({"w": {"dtype": "BF16", "shape": [2],
                                                     "data_offsets": [0, 4]}}).encode(), 100)
    assert tensors_[0].dtype == "BF16"
    from nvmeof_fuse.companion.files.safetensors_load import _numpy_maker

    with pytest.raises(InvalidArgument, match="dtype BF16 has no numpy type"):
        _numpy_maker()(tensors_[0])


class ShortFile:
    """A :class:`~.client.File` stand-in of ``content`` whose reads past ``cut`` come back
    short, as after the file shrank under the load."""

    def __init__(self, content: bytes, cut: int) -> None:
        self.content, self.cut, self.nbytes = content, cut, len(content)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def read(self, buf, size, offset):
        data = self.content[offset:min(offset + size, self.cut)]
        memoryview(buf).cast("B")[:len(data)] = data
        return len(data)

    def read_batch(self, requests):
        return [self.read(arr.reshape(-1).view(np.uint8), n, at) for arr, n, at in requests]


def test_a_header_cut_short_is_named(monkeypatch):
    content = header_file({"t": T}, bytes(8))
    monkeypatch.setattr(safetensors_load, "File", lambda path: ShortFile(content, 20))
    with pytest.raises(InvalidArgument, match=r"^x: header of \d+ bytes is cut short at 12$"):
        nvmeof_fuse.load_safetensors("x")


def test_tensor_bytes_cut_short_are_named(monkeypatch):
    content = header_file({"t": T}, bytes(8))
    monkeypatch.setattr(safetensors_load, "File",
                        lambda path: ShortFile(content, len(content) - 3))
    with pytest.raises(CompanionError, match=r"^x: read 5 of 8 bytes at \d+ \(the file shrank"):
        nvmeof_fuse.load_safetensors("x")


def test_a_bad_torch_device_and_a_dtype_torch_lacks_are_named(monkeypatch):
    content = header_file({"t": {**T, "dtype": "F8_E4M3", "shape": [8]}}, bytes(8))
    monkeypatch.setattr(safetensors_load, "File", lambda path: ShortFile(content, len(content)))
    fake = types.ModuleType("torch")

    def device(d):
        if d == "tpu":
            raise RuntimeError("Expected one of cpu, cuda device type at start of device string")
        return d

    fake.device = device
    monkeypatch.setitem(sys.modules, "torch", fake)
    with pytest.raises(InvalidArgument, match="^device 'tpu': Expected one of cpu, cuda"):
        nvmeof_fuse.load_safetensors("x", device="tpu")
    with pytest.raises(InvalidArgument,
                       match="^tensor 't': dtype F8_E4M3 is not in this torch$"):
        nvmeof_fuse.load_safetensors("x", device="cpu")
