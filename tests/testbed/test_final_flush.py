"""The final flush against nvmet (issue #56 item 6): unmount flushes only the namespaces written
since their last flush, and what was written is there for the kernel initiator afterwards.

Each namespace is a null_blk disk with a volatile write cache, so that nvmet passes each Flush
on to it and the disk's block statistics count them (nvmet itself counts nothing)."""

from __future__ import annotations

import contextlib
import mmap
import os
import subprocess

import pytest
from kernel_initiator import connected, pread_direct
from nvmet import flushes, namespaces, null_blk, subsystem
from vm import RDMA_PORT, TCP_PORT, wait_for

from nvmeof_fuse import File

NQN = "nqn.2026-11.io.nvmeof-fuse:final-flush"
MNT = "/tmp/nvmeof-final-flush"
COUNT = 4
TIMEOUT = 120  # s: a hang bound (the VM is slow), never a measure


@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_unmount_flushes_just_the_namespaces_written_and_their_data_stays(testbed, tmp_path,
                                                                          transport):
    """Over either transport (the exit's deadline cuts the timeouts of the final Flush on
    each queue kind: on a healthy target it changes nothing)."""
    log = str(tmp_path / "daemon.log")
    addr = testbed.rdma_addr if transport == "rdma" else testbed.tcp_addr
    data = os.urandom(64 << 10)
    with contextlib.ExitStack() as stack:
        disks = [stack.enter_context(null_blk(f"flush{n}", 16, 512, cache_mib=4))
                 for n in range(1, COUNT + 1)]
        sub = stack.enter_context(subsystem(NQN, None, ports=(RDMA_PORT, TCP_PORT)))
        stack.enter_context(namespaces(sub, disks))
        os.makedirs(MNT, exist_ok=True)
        started = subprocess.run(
            ["nvmeof-fuse", "mount", "-t", transport, "-a", addr, "-s",
             str(testbed.port), "-n", NQN, "--daemon", "--log-file", log, MNT],
            capture_output=True, text=True, timeout=TIMEOUT)
        assert started.returncode == 0, started.stderr + open(log).read()
        try:
            assert sorted(n for n in os.listdir(MNT) if n[0] == "n") == ["n1", "n2", "n3", "n4"]
            with File(f"{MNT}/n2") as f:  # a companion write: nothing flushes it but unmount
                assert f.write(data, file_offset=1 << 20) == len(data)
            fd = os.open(f"{MNT}/n3", os.O_RDWR | os.O_DIRECT)
            try:  # a FUSE write: its close flushes n3
                buf = mmap.mmap(-1, 4096)
                buf[:] = b"\x33" * 4096
                assert os.pwrite(fd, buf, 0) == 4096
            finally:
                os.close(fd)
            before = [flushes(disk) for disk in disks]
        finally:
            subprocess.run(["fusermount3", "-u", MNT], capture_output=True, timeout=TIMEOUT)
            assert wait_for(lambda: "disconnected from" in open(log).read(), TIMEOUT), \
                open(log).read()
        after = [flushes(disk) for disk in disks]
        text = open(log).read()
        assert [a - b for a, b in zip(after, before, strict=True)] == [0, 1, 0, 0], \
            (before, after, text)
        assert "flushed n2 (the 1 of 4 namespaces written since their last flush)" in text, text
        assert "failed" not in text and "Traceback" not in text and "not confirmed" not in text
        last = text.strip().splitlines()[-1]
        assert last == f"nvmeof-fuse: disconnected from {NQN}", text  # nothing skipped
        with connected("tcp", testbed.tcp_addr, testbed.port, NQN, namespaces=COUNT) as kernel:
            assert pread_direct(kernel[2], 1 << 20, len(data)) == data
            assert pread_direct(kernel[3], 0, 4096) == b"\x33" * 4096
