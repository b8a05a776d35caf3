"""CUDA tensors through the companion API, with the CUDA seam faked on the CPU.

A fake "device" tensor lives in a memfd; its "dma-buf" is that memfd, which the
fake transport maps.  What is checked: the dma-buf path places data directly,
ordering calls come at the right moments, and failures fall back to staging.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import pytest
import trio
from companion_fakes import AddressController, FakeTensor, serving, wait_for
from tcp_target import NQN, FakeTcpTarget

import nvmeof_fuse
from nvmeof_fuse.companion import gpu
from nvmeof_fuse.companion.client import File
from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.transport.tcp import TcpTransport


@pytest.fixture
def served(tmp_path):
    ctrl = AddressController()
    with serving(ctrl, tmp_path) as (server, mnt):
        yield ctrl, server, mnt


def test_read_into_a_cuda_tensor_goes_through_its_dmabuf(cuda, served):
    ctrl, server, mnt = served
    tensor = FakeTensor(1 << 20)
    with File(str(mnt / "n2")) as f:
        assert f.read(tensor, 300_000, file_offset=5000, buf_offset=3) == 300_000
    assert tensor.bytes[3:300_003].tobytes() == ctrl.disks[2][5000:305_000]
    assert cuda.calls[0] == "export" and cuda.calls[-1] == "flush"  # flush after the RDMA
    assert server.snapshot()["direct_read_bytes"] > 290_000
    assert wait_for(lambda: server.snapshot()["regions"] == 0)  # released with the file


def test_write_from_a_cuda_tensor_synchronizes_first(cuda, served):
    ctrl, server, mnt = served
    tensor = FakeTensor(8192)
    tensor.bytes[:] = np.frombuffer(os.urandom(8192), np.uint8)
    ctrl.on_command = lambda opcode: cuda.calls.append(f"opcode {opcode}")
    with File(str(mnt / "n1")) as f:
        assert f.write(tensor, file_offset=100) == 8192
    assert ctrl.disks[1][100:8292] == tensor.bytes.tobytes()
    assert cuda.calls.index("synchronize") < cuda.calls.index("opcode 1")  # before the NIC reads
    assert server.snapshot()["direct_write_bytes"] == 7680  # whole LBAs; edges in the message


def test_no_dmabuf_falls_back_to_staging(cuda, served, caplog):
    ctrl, server, mnt = served
    ctrl.transport.dmabuf_error = OSError(95, "Operation not supported")
    tensor = FakeTensor(70_000)
    with File(str(mnt / "n1")) as f:
        assert f.read(tensor, file_offset=999) == 70_000
    assert tensor.bytes.tobytes() == ctrl.disks[1][999:70_999]
    assert "to_device" in cuda.calls and "flush" not in cuda.calls
    assert "cannot place data in GPU memory directly" in caplog.text
    assert "Operation not supported" in caplog.text
    snap = server.snapshot()
    assert snap["direct_read_bytes"] == 0 and snap["staged_read_bytes"] >= 70_000


def test_compat_mode_stages_on_request(cuda, served):
    ctrl, server, mnt = served
    tensor = FakeTensor(4096)
    with File(str(mnt / "n1"), compat_mode=True) as f:
        f.read(tensor)
        f.write(tensor, file_offset=4096)
    assert "export" not in cuda.calls and "to_host" in cuda.calls
    assert ctrl.disks[1][4096:8192] == ctrl.disks[1][:4096]


def test_page_span():
    page = gpu.PAGE
    assert gpu.page_span(page * 3 + 10, 20) == (page * 3, 10, page)
    assert gpu.page_span(page * 3, page) == (page * 3, 0, page)
    assert gpu.page_span(page - 1, 2) == (0, page - 1, 2 * page)


def test_over_tcp_a_dmabuf_is_refused_by_name_and_the_tensor_staged(cuda, served, caplog):
    """A mount over NVMe/TCP: the socket reaches host memory only, so GPU data is staged
    (received into host memory, then copied to the device), like kvikio's compat mode."""
    ctrl, server, mnt = served
    ctrl.transport.register_dmabuf = TcpTransport("192.0.2.1").register_dmabuf
    tensor = FakeTensor(70_000)
    tensor.bytes[:] = np.frombuffer(os.urandom(70_000), np.uint8)
    with File(str(mnt / "n1")) as f:
        assert f.write(tensor, file_offset=4096) == 70_000
        tensor.bytes[:] = 0
        assert f.read(tensor, file_offset=4096) == 70_000
    assert tensor.bytes.tobytes() == ctrl.disks[1][4096:74_096]
    assert "to_host" in cuda.calls and "to_device" in cuda.calls and "flush" not in cuda.calls
    said = [r.getMessage() for r in caplog.records if "GPU memory" in r.getMessage()]
    assert len(said) == 1, said  # once, naming the reason; no AttributeError
    assert "NVMe/TCP receives data into host memory only" in said[0], said
    assert "attribute" not in caplog.text
    snap = server.snapshot()
    assert snap["direct_read_bytes"] == snap["direct_write_bytes"] == 0
    assert snap["staged_read_bytes"] >= 70_000 and snap["staged_write_bytes"] >= 69_632
    assert wait_for(lambda: server.snapshot()["regions"] == 0)


@contextlib.contextmanager
def tcp_target():
    """The fake NVMe/TCP target on 127.0.0.1, served from a thread of its own."""
    target, state, ready = FakeTcpTarget(), {}, threading.Event()

    async def main() -> None:
        state["token"] = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as state["scope"]:
            async with trio.open_nursery() as nursery:
                await nursery.start(target.serve)
                ready.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert ready.wait(10), "the fake target did not start"
    try:
        yield target
    finally:
        trio.from_thread.run_sync(state["scope"].cancel, trio_token=state["token"])
        thread.join(10)


def test_in_process_over_tcp_a_cuda_tensor_is_staged_not_received_in_place(cuda, tmp_path,
                                                                            caplog):
    """The mount's own process: a device address must never reach ``recv_into``."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    data = np.frombuffer(os.urandom(20_000), np.uint8)
    with tcp_target() as target, nvmeof_fuse.mount(
            str(mnt), traddr="127.0.0.1", nqn=NQN, transport="tcp", trsvcid=target.port,
            keep_alive_tmo=0) as m:
        tensor = FakeTensor(20_000)
        with pytest.raises(NVMeoFError, match=r"cannot register the CUDA tensor: dma-buf: "
                           r"cannot register the dma-buf: NVMe/TCP receives data into host "
                           r"memory only.*; peer memory: cannot register GPU memory: NVMe/TCP"):
            m.register(tensor)
        tensor.bytes[:] = data
        with m.open(1) as f:
            assert f.write(tensor, file_offset=1000) == 20_000
            tensor.bytes[:] = 0
            assert f.read(tensor, file_offset=1000) == 20_000
        stats = m.stats()
        assert bytes(target.data[1000:21_000]) == data.tobytes()
    assert tensor.bytes.tobytes() == data.tobytes()
    assert "to_host" in cuda.calls and "to_device" in cuda.calls and "flush" not in cuda.calls
    assert "NVMe/TCP receives data into host memory only" in caplog.text
    assert stats["direct_read_bytes"] == stats["direct_write_bytes"] == 0
    assert stats["staged_read_bytes"] >= 20_000 and stats["staged_write_bytes"] >= 19_456
