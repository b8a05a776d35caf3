"""The checks behind scripts/gpu-check: what of the companion API's CUDA side runs without RDMA."""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

RESULTS: list[tuple[str, str, str]] = []  # (check, PASS/FAIL/SKIP, detail)


class Skip(Exception):
    pass


def check(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def wrap(fn: Callable[[], str]) -> Callable[[], str]:
        try:
            RESULTS.append((name, "PASS", fn() or ""))
        except Skip as exc:
            RESULTS.append((name, "SKIP", str(exc)))
        except Exception as exc:  # noqa: BLE001 - every failure is one line of the summary
            detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            RESULTS.append((name, "FAIL", detail))
            if os.environ.get("GPU_CHECK_DEBUG"):
                traceback.print_exc()
        return fn
    return wrap


def torch_cuda():
    try:
        import torch
    except ImportError as exc:
        raise Skip(f"torch is not importable ({exc})") from None
    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    return torch


def main() -> int:
    @check("libcuda and the device")
    def _device() -> str:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise Skip(f"libcuda.so.1 not found ({exc})") from None
        assert lib.cuInit(0) == 0, "cuInit failed"
        count = ctypes.c_int()
        assert lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0, "no device"
        dev = ctypes.c_int()
        lib.cuDeviceGet(ctypes.byref(dev), 0)
        name = ctypes.create_string_buffer(128)
        lib.cuDeviceGetName(name, 128, dev)
        dmabuf = ctypes.c_int()
        lib.cuDeviceGetAttribute(ctypes.byref(dmabuf), 124, dev)  # DMA_BUF_SUPPORTED
        return f"{count.value} device(s), {name.value.decode()}, dma-buf supported: " \
               f"{bool(dmabuf.value)}"

    @check("dma-buf export of a CUDA tensor (companion CUDA seam, ibverbs.cuda)")
    def _export() -> str:
        torch = torch_cuda()
        from nvmeof_fuse.companion import gpu

        cuda = gpu.ops()
        t = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        assert cuda.is_cuda(t)
        ptr, nbytes = cuda.span(t)
        base, offset, length = gpu.page_span(ptr, nbytes)
        fd = cuda.export_dmabuf(base, length)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        assert "dmabuf" in target, f"fd points at {target!r}, not a dma-buf"
        return f"{nbytes} bytes at {ptr:#x} -> fd ({target}), offset {offset}"

    @check("ordering helpers: synchronize before writes, GPUDirect flush after reads")
    def _ordering() -> str:
        torch = torch_cuda()
        from nvmeof_fuse.companion import gpu

        torch.ones(1, device="cuda")  # make the primary context current on this thread
        cuda = gpu.ops()
        cuda.synchronize()
        cuda.flush_gpudirect_writes()
        return "cuCtxSynchronize and cuFlushGPUDirectRDMAWrites returned success"

    def staged_round_trip(compat: bool) -> str:
        torch = torch_cuda()
        import numpy as np
        from companion_fakes import AddressController, serving

        from nvmeof_fuse.companion.client import File

        ctrl = AddressController()  # stands in for the target: there is no RDMA here
        ctrl.transport.dmabuf_error = OSError(95, "no RDMA device on this machine")
        with tempfile.TemporaryDirectory() as tmp, serving(ctrl, Path(tmp)) as (server, mnt):
            t = torch.zeros(3 << 20, dtype=torch.uint8, device="cuda")
            with File(str(mnt / "n1"), compat_mode=compat) as f:
                assert f.read(t, (2 << 20) + 7, file_offset=12_345, buf_offset=11) == (2 << 20) + 7
                got = t[11:11 + (2 << 20) + 7].cpu().numpy().tobytes()
                assert got == bytes(ctrl.disks[1][12_345:12_345 + (2 << 20) + 7]), "read differs"
                src = torch.from_numpy(np.frombuffer(os.urandom(1 << 20), np.uint8).copy()).cuda()
                assert f.write(src, file_offset=777) == 1 << 20
                assert bytes(ctrl.disks[1][777:777 + (1 << 20)]) == src.cpu().numpy().tobytes()
            snap = server.snapshot()
        assert snap["direct_read_bytes"] == 0, "a fake target cannot place into GPU memory"
        return f"staged read {snap['staged_read_bytes']} B, write {snap['staged_write_bytes']} B"

    @check("staged path into and out of a CUDA tensor (dma-buf refused -> fallback)")
    def _fallback() -> str:
        return staged_round_trip(compat=False)

    @check("staged path with compat_mode=True")
    def _compat() -> str:
        return staged_round_trip(compat=True)

    @check("a File's own queues with a CUDA tensor (dma-buf in the client's PD, else fallback)")
    def _own_queues() -> str:
        torch = torch_cuda()
        from companion_fakes import FakeFabric, LeasingController, serving

        from nvmeof_fuse.companion import direct
        from nvmeof_fuse.companion.client import File

        ctrl = LeasingController()  # the fabric is faked: there is no RDMA NIC here
        real_make_transport, direct.make_transport = direct.make_transport, FakeFabric(ctrl)
        try:
            with tempfile.TemporaryDirectory() as tmp, \
                    serving(ctrl, Path(tmp)) as (server, mnt):
                t = torch.full((3 << 20,), 5, dtype=torch.uint8, device="cuda")
                with File(str(mnt / "n2")) as f:
                    assert f.own_queues, "no queues of its own"
                    assert f.write(t, (1 << 20) + 3, file_offset=999) == (1 << 20) + 3
                    t.zero_()
                    assert f.read(t, (1 << 20) + 3, file_offset=999) == (1 << 20) + 3
                    assert int((t[:(1 << 20) + 3] == 5).sum()) == (1 << 20) + 3, "read differs"
                    snap = f.stats()
        finally:
            direct.make_transport = real_make_transport
        return ", ".join(f"{k} {snap[k]}" for k in (
            "client_queue_read_bytes", "direct_read_bytes", "staged_read_bytes"))

    width = max(len(name) for name, _, _ in RESULTS)
    print("nvmeof-fuse gpu-check")
    for name, verdict, detail in RESULTS:
        print(f"  {verdict:4}  {name.ljust(width)}  {detail}")
    counts = {v: sum(1 for _, x, _ in RESULTS if x == v) for v in ("PASS", "FAIL", "SKIP")}
    print(f"summary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
