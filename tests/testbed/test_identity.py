"""Another volume behind the same name (issue #56 item 1), against the real nvmet.

While the port is unlinked, the namespace's backing device and NGUID are swapped (nvmet lets
a namespace be disabled, its ``device_path`` and ``device_nguid`` changed, and enabled).
After the reconnect, a file open on the old namespace (and a companion ``File``) fails with
EIO and never returns the new volume's data; a fresh open reads the new volume, byte-exact
against the kernel initiator's O_DIRECT read of /dev/nvmeXnY.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import subprocess

import pytest
from kernel_initiator import connected, pread_direct, pwrite_direct
from nvmet import null_blk, subsystem, write
from test_fs import wait_for_workers
from vm import NVMET_PORTS, RDMA_PORT, TCP_PORT, sh, target_away, wait_for

NQN = "nqn.2026-12.io.nvmeof-fuse:identity"
MNT = "/tmp/nvmeof-identity"
SIZE = 1 << 20  # bytes compared
NGUID_A = "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf"
NGUID_B = "b0b1b2b3b4b5b6b7b8b9babbbcbdbebf"


def log_text(log: str) -> str:
    with open(log) as f:
        return f.read()


def read_direct(fd: int, size: int = SIZE) -> bytes:
    buf = mmap.mmap(-1, size)
    try:
        n = os.preadv(fd, [buf], 0)
        return bytes(buf[:n])
    finally:
        buf.close()


@contextlib.contextmanager
def mounted(testbed, transport: str, log: str, workers: int):
    os.makedirs(MNT, exist_ok=True)
    addr = testbed.rdma_addr if transport == "rdma" else testbed.tcp_addr
    extra = ("--workers", str(workers)) if workers > 1 else ()
    sh("nvmeof-fuse", "mount", "-t", transport, "-a", addr, "-s", str(testbed.port),
       "-n", NQN, "--daemon", "--log-file", log, "-k", "2", "-c", "2", "-l", "120", *extra,
       MNT)
    try:
        if workers > 1:
            wait_for_workers(log, workers)
        yield MNT
    finally:
        subprocess.run(["fusermount3", "-u", MNT], capture_output=True, timeout=120)
        wait_for(lambda: not any(f" {MNT} " in line for line in open("/proc/mounts")), 60)


def companion_refuses(file, buf, new: bytes) -> None:
    """A read of ``file`` (opened on the old namespace) fails with EIO and reads nothing."""
    from nvmeof_fuse.errors import NVMeoFError

    buf[:] = 0
    with pytest.raises((NVMeoFError, OSError)) as refused:
        file.read(buf, SIZE, 0)
        pytest.fail("the companion File read " + ("the new volume" if buf.tobytes() == new
                                                  else "something"))
    assert getattr(refused.value, "errno", None) == errno.EIO, refused.value
    assert not any(buf.tobytes()), "the companion File got data"


def swap_namespace(sub: str, device: str, nguid: str) -> None:
    """Namespace 1 of ``sub`` becomes ``device`` with ``nguid`` (nvmet takes both only
    while the namespace is disabled)."""
    ns = f"{sub}/namespaces/1"
    write(f"{ns}/enable", 0)
    write(f"{ns}/device_path", device)
    write(f"{ns}/device_nguid", nguid)
    write(f"{ns}/enable", 1)


@pytest.mark.parametrize(("transport", "workers"), [("rdma", 1), ("tcp", 1), ("rdma", 2)],
                         ids=["rdma", "tcp", "rdma-workers-2"])
def test_a_volume_swapped_behind_the_nsid_during_an_outage_is_never_served_to_old_handles(
        testbed, tmp_path, caplog, transport, workers):
    import nvmeof_fuse

    caplog.set_level(logging.INFO, logger="nvmeof_fuse")  # the File's queues say they are back
    log = str(tmp_path / "daemon.log")
    a, b = os.urandom(SIZE), os.urandom(SIZE)
    with null_blk("identa", 64, 512) as dev_a, null_blk("identb", 64, 512) as dev_b:
        pwrite_direct(dev_a, 0, a)
        pwrite_direct(dev_b, 0, b)
        with subsystem(NQN, dev_a, ports=(RDMA_PORT, TCP_PORT), nguid=NGUID_A) as sub, \
                mounted(testbed, transport, log, workers) as mnt:
            n1 = f"{mnt}/n1"
            old = os.open(n1, os.O_RDONLY | os.O_DIRECT)
            try:
                old_inode = os.fstat(old).st_ino
                assert read_direct(old) == a
                buf = nvmeof_fuse.empty(SIZE)
                with nvmeof_fuse.File(n1) as file:
                    assert file.read(buf, SIZE, 0) == SIZE and buf.tobytes() == a
                    with target_away(NQN, NVMET_PORTS[transport]):
                        assert wait_for(lambda: "lost the connection" in log_text(log), 90), \
                            log_text(log)
                        swap_namespace(sub, dev_b, NGUID_B)
                    assert wait_for(lambda: "is another namespace now" in log_text(log), 120), \
                        log_text(log)
                    for _ in range(2):  # from then on
                        with pytest.raises(OSError) as failed:
                            data = read_direct(old)
                            pytest.fail(f"the old file read {len(data)} bytes: "
                                        f"{'the new volume' if data == b[:len(data)] else ''}")
                        assert failed.value.errno == errno.EIO
                    companion_refuses(file, buf, b)  # while its own queues reconnect
                    assert wait_for(lambda: "connected again" in caplog.text, 60), caplog.text
                    companion_refuses(file, buf, b)  # on them: the polled hot path too
            finally:
                os.close(old)
            assert wait_for(lambda: os.stat(n1).st_ino != old_inode, 60)
            fresh = os.open(n1, os.O_RDONLY | os.O_DIRECT)
            try:
                ours = read_direct(fresh)
            finally:
                os.close(fresh)
            with nvmeof_fuse.File(n1) as file:
                buf = nvmeof_fuse.empty(SIZE)
                assert file.read(buf, SIZE, 0) == SIZE
                companion = buf.tobytes()
            addr = testbed.rdma_addr if transport == "rdma" else testbed.tcp_addr
            with connected(transport, addr, testbed.port, NQN, namespaces=1) as kernel:
                theirs = pread_direct(kernel[1], 0, SIZE)
            text = log_text(log)
            lines = [line for line in text.splitlines() if "is another namespace now" in line]
            assert len(lines) == 1 and NGUID_A in lines[0] and NGUID_B in lines[0], text
            assert "Traceback" not in text, text
    assert theirs == b, "the kernel initiator does not read the new volume"
    assert ours == theirs and companion == theirs
