"""The real target over NVMe/TCP from the host, natively: no Python inside the VM.

``scripts/testbed up`` forwards the VM's nvmet TCP port to 127.0.0.1:$TESTBED_HOST_PORT;
``scripts/test`` then runs this file with ``NVMEOF_FORWARDED_TCP=127.0.0.1:PORT``.  The host
has no kernel NVMe initiator, so the second opinion is our initiator core on its own
connection (a second controller), while the mount is a separate daemon process.
Elsewhere these tests are skipped.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import pytest
import trio

from nvmeof_fuse.host.controller import ConnectOptions, connect

NQN = os.environ.get("TESTBED_NQN", "nqn.2026-11.io.nvmeof-fuse:testbed")
TIMEOUT = 300


def sh(*cmd: str, check: bool = True, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def target() -> tuple[str, int]:
    where = os.environ.get("NVMEOF_FORWARDED_TCP")
    if not where:
        pytest.skip("needs NVMEOF_FORWARDED_TCP=HOST:PORT (scripts/testbed up; scripts/test)")
    host, port = where.rsplit(":", 1)
    return host, int(port)


@pytest.fixture(scope="module")
def mnt(target, tmp_path_factory):
    point = tmp_path_factory.mktemp("forwarded")
    log = point.parent / "daemon.log"
    host, port = target
    sh(sys.executable, "-m", "nvmeof_fuse.cli", "mount", "-t", "tcp", "-a", host, "-s", str(port),
       "-n", NQN, "--daemon", "--log-file", str(log), str(point))
    yield str(point)
    sh("fusermount3", "-u", str(point), check=False)


def core(target, fn):
    """Run ``fn(ctrl)`` on a controller of our own over the same forwarded port."""
    host, port = target

    async def main():
        with trio.fail_after(TIMEOUT):
            async with connect(ConnectOptions(host, NQN, transport="tcp", trsvcid=port)) as ctrl:
                return await fn(ctrl)

    return trio.run(main)


def test_the_namespaces_show_with_their_sizes(mnt):
    for name, blksize in (("n1", 512), ("n2", 4096)):
        st = os.stat(f"{mnt}/{name}")
        assert st.st_size == 256 << 20 and st.st_blksize == blksize


def test_unaligned_writes_agree_with_a_second_initiator(target, mnt):
    rng = random.Random(5)
    for nsid, lba in ((1, 512), (2, 4096)):
        path = f"{mnt}/n{nsid}"
        for _ in range(3):
            # through the file at an unaligned offset, read back by our core
            offset = rng.randrange(1 << 20, 100 << 20)
            data = rng.randbytes(rng.randrange(1, 3 * lba + 7))
            fd = os.open(path, os.O_WRONLY)
            try:
                assert os.pwrite(fd, data, offset) == len(data)
                os.fsync(fd)
            finally:
                os.close(fd)

            async def read_back(ctrl, nsid=nsid, offset=offset, data=data):
                return await ctrl.namespaces[nsid].read(offset, len(data))

            assert core(target, read_back) == data
            # written by our core, read through the file (O_DIRECT: past the page cache)
            block = rng.randbytes(4 * 4096)
            start = offset // 4096 * 4096

            async def write(ctrl, nsid=nsid, start=start, block=block):
                await ctrl.namespaces[nsid].write(start, block)

            core(target, write)
            with open(path, "rb", buffering=0) as f:
                fd = f.fileno()
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert os.pread(fd, 1000, start + 123) == block[123:1123]


@pytest.mark.parametrize("name", ["n1", "n2"])
def test_fio_verify_random_writes_mixed_sizes(mnt, name):
    out = sh("fio", "--name=verify", f"--filename={mnt}/{name}", "--rw=randwrite",
             "--bssplit=4k/50:16k/30:128k/20", "--iodepth=16", "--ioengine=libaio",
             "--direct=1", "--size=32M", "--verify=crc32c", "--do_verify=1",
             "--verify_fatal=1", "--verify_state_save=0", "--output-format=terse",
             check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_mkfs_ext4_on_a_loop_device(mnt, tmp_path):
    loop = sh("losetup", "-f", "--show", f"{mnt}/n2").stdout.strip()
    fsdir = tmp_path / "ext4"
    fsdir.mkdir()
    try:
        sh("mkfs.ext4", "-q", "-F", loop)
        sh("mount", loop, str(fsdir))
        sums = {}
        for i in range(5):
            data = os.urandom(random.Random(i).randrange(1, 3 << 20))
            (fsdir / f"f{i}").write_bytes(data)
            sums[f"f{i}"] = hashlib.sha256(data).hexdigest()
        sh("umount", str(fsdir))
        assert sh("e2fsck", "-fn", loop, check=False).returncode == 0
        sh("mount", loop, str(fsdir))
        assert {n: hashlib.sha256((fsdir / n).read_bytes()).hexdigest() for n in sums} == sums
        sh("umount", str(fsdir))
    finally:
        sh("umount", str(fsdir), check=False)
        sh("losetup", "-d", loop, check=False)
