"""CUDA memory through the companion API, with a fake CUDA driver on the CPU.

The fake driver (tests/fake_cuda.py) refuses every context-bound call on a
thread with no context pushed, as libcuda does; so every call here runs from
threads that never touched CUDA.  A fake "device" allocation lives in a memfd;
its "dma-buf" is that memfd, which the fake transport maps.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os

import numpy as np
import pytest
from companion_fakes import AddressController, serving, wait_for
from tcp_target import NQN, served_in_thread

import nvmeof_fuse
from nvmeof_fuse.companion.client.file import File
from nvmeof_fuse.companion.cuda import gpu
from nvmeof_fuse.companion.cuda.driver import CudaError
from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.transport.tcp.transport import TcpTransport


@pytest.fixture
def served(tmp_path):
    ctrl = AddressController()
    with serving(ctrl, tmp_path) as (server, mnt):
        yield ctrl, server, mnt


@pytest.fixture
def over_tcp(served):
    """The daemon's transport is NVMe/TCP: it says so in its hello, and refuses dma-bufs."""
    ctrl, server, mnt = served
    tcp = TcpTransport("192.0.2.1")
    ctrl.transport.dmabuf_refusal = tcp.dmabuf_refusal
    ctrl.transport.register_dmabuf = tcp.register_dmabuf
    return served


def on_fresh_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a thread that never touched CUDA; its result."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result(60)


def random_bytes(n: int) -> np.ndarray:
    return np.frombuffer(os.urandom(n), np.uint8)


def unmappable(base: int, length: int) -> int:
    """An export the CPU cannot map, as a GPU's dma-buf (a pipe: mmap fails, ENODEV)."""
    read_end, write_end = os.pipe()
    os.close(write_end)
    return read_end


def test_a_read_from_a_fresh_thread_goes_through_the_dmabuf_in_the_tensors_context(
        cuda, served):
    ctrl, server, mnt = served
    tensor = cuda.tensor(1 << 20, device=1)
    with File(str(mnt / "n2")) as f:
        assert on_fresh_thread(f.read, tensor, 300_000, file_offset=5000, buf_offset=3) \
            == 300_000
        assert f.placement["cuda"] == "direct: dma-buf registered with the mount daemon"
    assert tensor.bytes[3:300_003].tobytes() == ctrl.disks[2][5000:305_000]
    device1 = cuda.contexts[1]
    assert ("export", device1) in cuda.calls
    assert cuda.calls[-1] == ("flush", device1)  # after the data landed, on its device
    snap = server.snapshot()
    assert snap["direct_read_bytes"] > 290_000 and snap["errors"] == 0
    assert wait_for(lambda: server.snapshot()["regions"] == 0)  # released with the file


def test_a_write_from_a_fresh_thread_synchronizes_the_tensors_device_first(cuda, served):
    ctrl, server, mnt = served
    tensor = cuda.tensor(8192, device=1)
    tensor.bytes[:] = random_bytes(8192)
    ctrl.on_command = lambda opcode: cuda.calls.append((f"opcode {opcode}", 0))
    with File(str(mnt / "n1")) as f:
        assert on_fresh_thread(f.write, tensor, file_offset=100) == 8192
    assert ctrl.disks[1][100:8292] == tensor.bytes.tobytes()
    names = cuda.names()
    assert names.index("synchronize") < names.index("opcode 1")  # before the NIC reads
    assert ("synchronize", cuda.contexts[1]) in cuda.calls  # the tensor's device, not 0
    assert server.snapshot()["direct_write_bytes"] == 7680  # whole LBAs; edges in the message


def test_memory_of_no_context_uses_its_devices_primary_context(tmp_path):
    """VMM memory (expandable segments) belongs to no context: the device's primary one."""
    from fake_cuda import FakeDriver, install

    driver, _ = install(FakeDriver(vmm=True))
    try:
        ctrl = AddressController()
        with serving(ctrl, tmp_path) as (server, mnt), File(str(mnt / "n1")) as f:
            tensor = driver.tensor(4096, device=1)
            assert on_fresh_thread(f.read, tensor, file_offset=512) == 4096
            assert tensor.bytes.tobytes() == ctrl.disks[1][512:4608]
        assert ("export", driver.contexts[1]) in driver.calls
    finally:
        gpu.use(None)


def test_one_dmabuf_registration_per_allocation_across_a_thousand_transfers(cuda, served):
    ctrl, server, mnt = served
    allocation = cuda.tensor(1 << 20)
    views = [allocation.view(i * 8192, 8192) for i in range(8)]  # tensors of one allocation
    with File(str(mnt / "n2")) as f, concurrent.futures.ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda i: f.read(views[i % 8], file_offset=i % 500 * 4096),
                             range(1000)))
        assert done == [8192] * 1000
        file_stats = f.stats()["file"]
        assert server.snapshot()["regions"] == 2  # staging and the one allocation
    assert cuda.names().count("export") == 1
    assert file_stats["dmabuf_registered"] == 1 and file_stats["dmabuf_hits"] == 999
    assert views[7].bytes.tobytes() == ctrl.disks[2][499 * 4096:499 * 4096 + 8192]
    assert wait_for(lambda: server.snapshot()["regions"] == 0)  # released on close
    assert not ctrl.transport.dmabufs


def test_an_allocation_freed_and_reused_at_the_same_address_is_registered_anew(cuda, served):
    ctrl, server, mnt = served
    tensor = cuda.tensor(8192)
    with File(str(mnt / "n2")) as f:
        f.read(tensor)
        cuda.free(tensor)
        cuda.allocate(tensor)  # a new allocation at the same address: a new buffer ID
        tensor.bytes[:] = 0
        f.read(tensor, file_offset=4096)
        counts = f.stats()["file"]
        assert tensor.bytes.tobytes() == ctrl.disks[2][4096:12288]
    assert cuda.names().count("export") == 2
    assert counts["dmabuf_reused_after_free"] == 1 and counts["dmabuf_registered"] == 2
    assert counts["dmabuf_released"] == 1  # the stale one, never used again


def test_the_registration_cache_is_bounded(cuda, served, monkeypatch):
    from nvmeof_fuse.companion.client import file as client

    ctrl, server, mnt = served
    original = client.DmabufCache.__init__
    monkeypatch.setattr(client.DmabufCache, "__init__",
                        lambda self, *a, **k: original(self, *a, **k, limit=3))
    tensors = [cuda.tensor(4096) for _ in range(5)]
    with File(str(mnt / "n2")) as f:
        for tensor in tensors:
            f.read(tensor)
        counts = f.stats()["file"]
        assert counts["dmabuf_live"] == 3 and counts["dmabuf_released"] == 2
        assert server.snapshot()["regions"] == 1 + 3


def test_over_tcp_gpu_memory_is_staged_without_asking_and_without_errors(cuda, over_tcp,
                                                                         caplog):
    """The hello says NVMe/TCP cannot place into GPU memory: the client never exports or
    asks, the daemon counts nothing as an error, and the reason is said once."""
    ctrl, server, mnt = over_tcp
    tensor = cuda.tensor(70_000)
    data = random_bytes(70_000)
    tensor.bytes[:] = data
    with File(str(mnt / "n1")) as f:
        for _ in range(3):
            assert on_fresh_thread(f.write, tensor, file_offset=4096) == 70_000
        tensor.bytes[:] = 0
        assert on_fresh_thread(f.read, tensor, file_offset=4096) == 70_000
        placement = f.placement["cuda"]
        stats = f.stats()
    assert tensor.bytes.tobytes() == data.tobytes() == ctrl.disks[1][4096:74_096]
    assert "export" not in cuda.names() and "flush" not in cuda.names()
    assert placement.startswith("staged: NVMe/TCP receives data into host memory only")
    said = [r.getMessage() for r in caplog.records if "CUDA memory is staged" in r.getMessage()]
    assert len(said) <= 1  # once per process (an earlier test may have said it)
    assert stats["errors"] == stats["dmabuf_refused"] == 0
    assert stats["staged_read_bytes"] >= 70_000 and stats["staged_write_bytes"] >= 3 * 69_632
    session = stats["sessions"][0]
    assert session["placement"]["cuda"] == placement  # the daemon shows it per client


def test_a_refused_dmabuf_is_asked_once_counted_as_refused_and_staged(cuda, served, caplog):
    """The transport refuses dma-bufs and the CPU cannot map this one (as a GPU's): one
    ask per file, counted as refused (not an error), then staged, with the reason."""
    ctrl, server, mnt = served
    ctrl.transport.dmabuf_error = OSError(95, "Operation not supported")
    cuda.export = unmappable
    tensor = cuda.tensor(70_000)
    with caplog.at_level(logging.WARNING), File(str(mnt / "n1")) as f:
        for _ in range(5):
            assert on_fresh_thread(f.read, tensor, file_offset=999) == 70_000
        placement = f.placement["cuda"]
        stats = f.stats()
    assert tensor.bytes.tobytes() == ctrl.disks[1][999:70_999]
    assert cuda.names().count("export") == 1
    assert stats["dmabuf_refused"] == 1 and stats["errors"] == 0
    assert placement.startswith("staged: cannot register the dma-buf: ")
    assert "Operation not supported" in placement and "nor can the CPU map it" in placement
    assert "Operation not supported" in caplog.text


def test_a_dmabuf_the_transport_refuses_but_the_cpu_maps_is_placed_through_its_mapping(
        cuda, served):
    """udmabuf and other host-memory exporters on a NIC without dma-buf MRs (Soft-RoCE)."""
    ctrl, server, mnt = served
    ctrl.transport.dmabuf_error = OSError(95, "Operation not supported")
    tensor = cuda.tensor(1 << 16)
    with File(str(mnt / "n2")) as f:
        assert f.read(tensor, file_offset=8192) == 1 << 16
        stats = f.stats()
    assert tensor.bytes.tobytes() == ctrl.disks[2][8192:8192 + (1 << 16)]
    assert stats["direct_read_bytes"] == 1 << 16 and stats["dmabuf_refused"] == 0


def test_a_gpu_without_dmabuf_support_is_staged_and_named(cuda, served):
    ctrl, server, mnt = served
    cuda.dmabuf_devices.discard(0)
    tensor = cuda.tensor(10_000)
    with File(str(mnt / "n1")) as f:
        assert on_fresh_thread(f.read, tensor, file_offset=1) == 10_000
        assert f.placement["cuda"] == "staged: GPU 0 has no dma-buf support"
    assert tensor.bytes.tobytes() == ctrl.disks[1][1:10_001]
    assert "export" not in cuda.names()


def test_staged_transfers_are_pipelined_through_pinned_memory_from_fresh_threads(
        cuda, over_tcp):
    """Unaligned offsets and sizes, many futures in flight from threads that never touched
    CUDA: byte-exact, through staging memory page-locked once, on per-thread streams."""
    ctrl, server, mnt = over_tcp
    size = len(ctrl.disks[1])
    tensor = cuda.tensor(size)
    data = random_bytes(size)
    tensor.bytes[:] = data
    with File(str(mnt / "n1"), task_size=1 << 20, staging_bytes=4 << 20, workers=2) as f:
        pieces = [(offset, min(1_000_003, size - offset))
                  for offset in range(7, size, 1_000_003)]
        futures = on_fresh_thread(lambda: [f.pwrite(tensor, n, file_offset=o, buf_offset=o)
                                           for o, n in pieces])
        assert [future.get(60) for future in futures] == [n for _, n in pieces]
        assert bytes(ctrl.disks[1][7:]) == data[7:].tobytes()
        tensor.bytes[:] = 0
        assert on_fresh_thread(f.read, tensor, size - 7, file_offset=7, buf_offset=7) \
            == size - 7
        staging = f.stats()["file"]
        assert len(cuda.pinned) == 1 and staging["staging_pinned"]
    assert tensor.bytes[7:].tobytes() == data[7:].tobytes()
    assert not cuda.pinned  # unpinned on close
    assert cuda.names().count("host_register") == 1
    assert staging["staging_bytes"] == staging["staging_free_bytes"] == 4 << 20
    streams = {handle for name, handle in cuda.calls if name == "on_stream"}
    assert 1 <= len(streams) <= 2  # one per worker thread
    assert "synchronize" in cuda.names()  # before the first write: what produced it is done


def test_stream_orders_the_copies_on_the_callers_stream_instead_of_the_device(cuda,
                                                                             over_tcp):
    ctrl, server, mnt = over_tcp
    tensor = cuda.tensor(20_000)
    tensor.bytes[:] = random_bytes(20_000)

    class Stream:  # as torch.cuda.Stream
        cuda_stream = 0xABC

    with File(str(mnt / "n1")) as f:
        assert on_fresh_thread(f.write, tensor, file_offset=3, stream=Stream()) == 20_000
        assert on_fresh_thread(f.read, tensor, file_offset=3, stream=0xABC) == 20_000
        with pytest.raises(InvalidArgument, match=r"stream must be a CUDA stream .* got 'x'"):
            f.read(tensor, stream="x")
    assert "synchronize" not in cuda.names()  # the stream orders it, not the device
    on = [handle for name, handle in cuda.calls if name == "on_stream"]
    assert on and set(on) == {0xABC}
    assert ("event_record", 0xABC) in cuda.calls  # waits for its own copy only
    assert bytes(ctrl.disks[1][3:20_003]) == tensor.bytes.tobytes()


def test_a_page_lock_refusal_still_moves_the_data_and_says_so_once(cuda, over_tcp, caplog):
    ctrl, server, mnt = over_tcp
    cuda.pin_error = CudaError("cuMemHostRegister", 2, "CUDA_ERROR_OUT_OF_MEMORY")
    tensor = cuda.tensor(5000)
    with caplog.at_level(logging.WARNING), File(str(mnt / "n1")) as f:
        for _ in range(3):
            assert f.read(tensor, file_offset=10) == 5000
        assert "CUDA_ERROR_OUT_OF_MEMORY" in f.stats()["file"]["staging_pin_failure"]
    assert tensor.bytes.tobytes() == ctrl.disks[1][10:5010]
    assert caplog.text.count("cannot page-lock the staging memory") == 1


def test_compat_mode_stages_on_request(cuda, served):
    ctrl, server, mnt = served
    tensor = cuda.tensor(4096)
    with File(str(mnt / "n1"), compat_mode=True) as f:
        f.read(tensor)
        f.write(tensor, file_offset=4096)
        assert f.placement["cuda"] == "staged: compat mode is on"
    assert "export" not in cuda.names() and "to_host" in cuda.names()
    assert ctrl.disks[1][4096:8192] == ctrl.disks[1][:4096]


def test_a_failed_copy_reaches_the_caller_and_frees_its_slot(cuda, over_tcp):
    ctrl, server, mnt = over_tcp
    tensor = cuda.tensor(4096)
    with File(str(mnt / "n1"), staging_bytes=1 << 20, task_size=1 << 20) as f:
        cuda.free(tensor)  # the caller freed it under the transfer
        with pytest.raises(Exception, match="not memory the CUDA driver knows"):
            f.read(tensor)
        cuda.allocate(tensor)
        original = cuda.copy_to_device

        def failing(*args):
            raise CudaError("cuMemcpyHtoDAsync", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")

        cuda.copy_to_device = failing
        with pytest.raises(CudaError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            f.read(tensor)
        cuda.copy_to_device = original
        assert f.read(tensor) == 4096  # the one slot came back
        assert f.stats()["errors"] == 0


def test_page_span():
    page = gpu.PAGE
    assert gpu.page_span(page * 3 + 10, 20) == (page * 3, 10, page)
    assert gpu.page_span(page * 3, page) == (page * 3, 0, page)
    assert gpu.page_span(page - 1, 2) == (0, page - 1, 2 * page)


def test_without_a_pushed_context_the_fake_driver_refuses_as_libcuda_does(cuda):
    """The fake is as strict as the real driver: this is what the seam guards against."""
    tensor = cuda.tensor(4096)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_CONTEXT") as exc:
        cuda.synchronize()
    assert exc.value.code == 201
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_CONTEXT"):
        cuda.export_dmabuf(tensor.addr, 4096)
    seam = gpu.ops()
    mem = seam.memory(tensor)
    seam.synchronize(mem)  # pushed around the call
    fd = seam.export_dmabuf(mem, mem.base, 4096)
    os.close(fd)


def test_a_cuda_array_must_be_contiguous_and_stream_handles_are_checked(cuda):
    seam = gpu.ops()

    class Strided:
        __cuda_array_interface__ = {"shape": (4, 4), "typestr": "<f4", "data": (4096, False),
                                    "strides": (32, 4), "version": 3}

    with pytest.raises(Exception, match="must be C-contiguous"):
        seam.span(Strided())
    Strided.__cuda_array_interface__ = {**Strided.__cuda_array_interface__,
                                        "strides": (16, 4)}
    assert seam.span(Strided()) == (4096, 64)
    assert gpu.stream_handle(None) is None and gpu.stream_handle(7) == 7

    class CupyStream:
        ptr = 99

    assert gpu.stream_handle(CupyStream()) == 99


def test_in_process_over_tcp_a_cuda_tensor_is_staged_not_received_in_place(cuda, tmp_path):
    """The mount's own process: a device address must never reach ``recv_into``."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    data = random_bytes(20_000)
    cuda.export = unmappable
    with served_in_thread() as (target, _), nvmeof_fuse.mount(
            str(mnt), traddr="127.0.0.1", nqn=NQN, transport="tcp", trsvcid=target.port,
            keep_alive_tmo=0) as m:
        tensor = cuda.tensor(20_000)
        with pytest.raises(nvmeof_fuse.CompanionError,
                           match=r"cannot register the CUDA tensor: dma-buf: cannot register "
                           r"the dma-buf: NVMe/TCP receives data into host memory only.*"
                           r"; peer memory: cannot register GPU memory: NVMe/TCP"):
            m.register(tensor)
        tensor.bytes[:] = data
        with m.open(1) as f:
            assert on_fresh_thread(f.write, tensor, file_offset=1000) == 20_000
            tensor.bytes[:] = 0
            assert on_fresh_thread(f.read, tensor, file_offset=1000) == 20_000
            placement = f.placement["cuda"]
        stats = m.stats()
        assert bytes(target.data[1000:21_000]) == data.tobytes()
    assert tensor.bytes.tobytes() == data.tobytes()
    assert cuda.names().count("export") == 1 and "flush" not in cuda.names()  # register's
    assert placement.startswith("staged: NVMe/TCP receives data into host memory only")
    assert stats["direct_read_bytes"] == stats["direct_write_bytes"] == 0
    assert stats["staged_read_bytes"] >= 20_000 and stats["staged_write_bytes"] >= 19_456
    assert stats["errors"] == 0
