"""The FUSE mount over RDMA and NVMe/TCP against the real target, cross-checked by the kernel
initiator over the same transport.

The core of it (the mount, the standard tools, fio verify and the kernel cross-check) runs on
both FUSE servers and with FUSE workers (``served``): our own session, pyfuse3 (``-o
fuse=pyfuse3``, a second mount of the same target beside the first), and our session with
``--workers 2`` (a third: the main process and a worker process on queues of its own, each
taking requests as the kernel hands them out).  The rest runs on our session only.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import threading

import pytest
from kernel_initiator import connected, pread_direct, pwrite_direct

from nvmeof_fuse.cli.mount import read_line
from nvmeof_fuse.fs.mount import read_mountinfo

MNT = "/tmp/nvmeof-test"
TIMEOUT = 120
FUSE_SERVERS = ("builtin", "pyfuse3", "workers2")
WORKERS_READY = 300  # s for a worker process to import, lease and connect (Python under TCG)


def sh(*cmd: str, check: bool = True, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check)


def mount_args(fabric, *extra: str, nqn: str | None = None, addr: str | None = None,
               port: int | None = None):
    return ["nvmeof-fuse", "mount", "-t", fabric.transport, "-a", addr or fabric.addr,
            "-s", str(port or fabric.port), "-n", nqn or fabric.nqn, *fabric.digest_flags(), *extra]


def wait_for_workers(log: str, workers: int, timeout: float = WORKERS_READY) -> None:
    """Until the mount's log says each worker process serves on its own queues."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        with open(log) as f:
            text = f.read()
        if text.count(" serves on queues ") >= workers - 1:
            return
        assert time.monotonic() < deadline, f"workers not serving after {timeout} s: {text}"
        time.sleep(0.5)


def worker_ops(point: str) -> list[int]:
    """Requests each serving process (main first) has run on n1 and n2, from stats.json."""
    with open(f"{point}/.nvmeof/stats.json") as f:
        stats = json.load(f)
    return [sum(op["ops"] for ns in w["namespaces"].values() for op in ns["ops"].values())
            for w in stats["workers"]]


def mounted(fabric, testbed, fuse: str):
    """A daemon mount of the target, served by FUSE server ``fuse`` (``workers2``: ours with
    two workers); unmounted after."""
    ours = fuse == "builtin"  # the default: no option
    point = MNT if ours else f"{MNT}-{fuse}"
    os.makedirs(point, exist_ok=True)
    name = fabric.transport if ours else f"{fabric.transport}-{fuse}"
    log = os.path.join(testbed.out, f"test_fs-{name}.log")  # kept for post-mortems
    option = {"builtin": [], "workers2": ["--workers", "2"]}.get(fuse, ["-o", f"fuse={fuse}"])
    sh(*mount_args(fabric, "--daemon", "--log-file", log, *option, point))
    if fuse == "workers2":
        wait_for_workers(log, 2)
    elif not ours:  # really served by it
        with open(log) as f:
            assert f"(FUSE server: {fuse})" in f.read()
    yield point
    sh("fusermount3", "-u", point, check=False)


@pytest.fixture(scope="module")
def mnt(fabric, testbed):
    """The mount with our own FUSE session (the default)."""
    yield from mounted(fabric, testbed, "builtin")


@pytest.fixture(scope="module")
def mnt_pyfuse3(fabric, testbed):
    yield from mounted(fabric, testbed, "pyfuse3")


@pytest.fixture(scope="module")
def mnt_workers2(fabric, testbed):
    yield from mounted(fabric, testbed, "workers2")


@pytest.fixture(params=FUSE_SERVERS)
def served(request, fabric) -> str:
    """The mount on each FUSE server in turn (one mount per server and transport; ``fabric``
    named here so that pytest parametrizes the tests that take this over it)."""
    return request.getfixturevalue("mnt" if request.param == "builtin" else
                                   f"mnt_{request.param}")


@pytest.fixture(params=["builtin", "workers2"])
def ours(request, fabric) -> str:
    """Our session's mount, alone and with two workers."""
    return request.getfixturevalue("mnt" if request.param == "builtin" else
                                   f"mnt_{request.param}")


def test_ls_and_stat_show_the_namespaces(served):
    mnt = served
    listing = sh("ls", "-l", mnt).stdout
    assert " n1" in listing and " n2" in listing
    for name, blksize in (("n1", 512), ("n2", 4096)):
        st = os.stat(f"{mnt}/{name}")
        assert st.st_size == 256 << 20 and st.st_blksize == blksize
    info = json.loads(open(f"{mnt}/.nvmeof/n2.json").read())
    assert "4096" in json.dumps(info)


def test_discover_and_list_name_the_transport(fabric, mnt):
    out = sh("nvmeof-fuse", "discover", "-t", fabric.transport, "-a", fabric.addr,
             "-s", str(fabric.port)).stdout
    assert fabric.nqn in out and fabric.transport in out, out
    listing = sh("nvmeof-fuse", "list", mnt).stdout
    assert f"{fabric.transport} {fabric.addr}:{fabric.port} {fabric.nqn}" in listing, listing


def test_standard_tools_round_trip(served, tmp_path):
    """dd in and out (buffered and O_DIRECT), cmp and hexdump, as a user would."""
    data = tmp_path / "data.bin"
    data.write_bytes(random.Random(5).randbytes(1 << 20))
    n2, skip = f"{served}/n2", 150  # MiB into n2, away from the other tests' ranges
    sh("dd", f"if={data}", f"of={n2}", "bs=64k", f"seek={skip * 16}", "conv=notrunc,fsync",
       "status=none")
    back = tmp_path / "back.bin"
    sh("dd", f"if={n2}", f"of={back}", "bs=1M", f"skip={skip}", "count=1", "iflag=direct",
       "status=none")
    sh("cmp", str(data), str(back))
    sh("cmp", "-i", f"0:{skip << 20}", "-n", str(1 << 20), str(data), n2)
    pattern = tmp_path / "pattern.bin"
    pattern.write_bytes(bytes(range(256)) * 16)
    sh("dd", f"if={pattern}", f"of={n2}", "bs=4096", f"seek={(skip + 1) * 256}", "conv=notrunc",
       "oflag=direct", "status=none")
    dump = sh("hexdump", "-C", "-s", str((skip + 1) << 20), "-n", "32", n2).stdout
    assert "00 01 02 03 04 05 06 07  08 09 0a 0b 0c 0d 0e 0f" in dump.splitlines()[0], dump


def test_unaligned_writes_agree_with_the_kernel_initiator(fabric, served):
    mnt = served
    rng = random.Random(3)
    with connected(fabric.transport, fabric.addr, fabric.port, fabric.nqn) as kernel:
        for nsid, lba in ((1, 512), (2, 4096)):
            path = f"{mnt}/n{nsid}"
            for _ in range(3):
                # through the file at an unaligned offset, read back by the kernel
                offset = rng.randrange(1 << 20, 100 << 20)
                data = rng.randbytes(rng.randrange(1, 3 * lba + 7))
                fd = os.open(path, os.O_WRONLY)
                try:
                    assert os.pwrite(fd, data, offset) == len(data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                start = offset // lba * lba
                span = -(-(offset + len(data)) // lba) * lba - start
                got = pread_direct(kernel[nsid], start, span)
                assert got[offset - start:offset - start + len(data)] == data
                # written by the kernel, read through the file at an unaligned offset
                block = rng.randbytes(4 * 4096)
                pwrite_direct(kernel[nsid], start, block)
                with open(path, "rb") as f:
                    f.seek(start + 123)
                    assert f.read(1000) == block[123:1123]


@pytest.mark.parametrize("name", ["n1", "n2"])
def test_fio_verify_random_writes_mixed_sizes(served, name):
    out = sh("fio", "--name=verify", f"--filename={served}/{name}", "--rw=randwrite",
             "--bssplit=4k/50:16k/30:128k/20", "--iodepth=16", "--ioengine=libaio",
             "--direct=1", "--size=16M", "--verify=crc32c", "--do_verify=1",
             "--verify_fatal=1", "--output-format=terse", timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    if served.endswith("workers2"):  # both processes took part
        assert all(worker_ops(served)), worker_ops(served)


def test_concurrent_writers_sharing_lbas_lose_nothing(ours):
    path = f"{ours}/n1"
    base, piece, writers = 5 << 20, 100, 40  # 40 x 100 B ranges across ~8 shared 512 B LBAs
    chunks = [bytes([i + 1]) * piece for i in range(writers)]
    barrier = threading.Barrier(writers)

    def write(i: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        try:
            barrier.wait(timeout=30)
            assert os.pwrite(fd, chunks[i], base + i * piece) == piece
        finally:
            os.close(fd)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    with open(path, "rb") as f:
        f.seek(base)
        assert f.read(writers * piece) == b"".join(chunks)


def test_mkfs_ext4_on_a_loop_device(mnt, tmp_path):
    loop = sh("losetup", "-f", "--show", f"{mnt}/n2").stdout.strip()
    fsdir = tmp_path / "ext4"
    fsdir.mkdir()
    try:
        sh("mkfs.ext4", "-q", "-F", loop, timeout=600)
        sh("mount", loop, str(fsdir))
        sums = {}
        for i in range(5):
            data = os.urandom(random.Random(i).randrange(1, 3 << 20))
            (fsdir / f"f{i}").write_bytes(data)
            sums[f"f{i}"] = hashlib.sha256(data).hexdigest()
        sh("umount", str(fsdir))
        assert sh("e2fsck", "-fn", loop, check=False, timeout=600).returncode == 0
        sh("mount", loop, str(fsdir))
        assert {n: hashlib.sha256((fsdir / n).read_bytes()).hexdigest() for n in sums} == sums
        sh("umount", str(fsdir))
    finally:
        sh("umount", str(fsdir), check=False)
        sh("losetup", "-d", loop, check=False)
        sh("sync", timeout=600)  # write back n2's page cache here, not during the next tests


BAD_MOUNTS = {"wrong nqn": {"nqn": "nqn.2026-11.io.no:such"}, "unreachable": {"addr": "192.0.2.1"},
              "refused": {"port": 4421}, "missing mountpoint": {}, "in use": {}}


def test_bad_mounts_fail_in_one_line(fabric, mnt, tmp_path):
    """Each bad mount side by side (one wait for all the imports and the unreachable
    address's connect timeout), each failing with one line."""
    mounts = {}
    for case, kw in BAD_MOUNTS.items():
        target = {"missing mountpoint": str(tmp_path / "absent"), "in use": mnt}.get(
            case, str(tmp_path))
        mounts[case] = subprocess.Popen(mount_args(fabric, "--daemon", target, **kw),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
    for case, proc in mounts.items():
        err = proc.communicate(timeout=2 * TIMEOUT)[1]  # five daemons share the VM's CPUs
        assert proc.returncode != 0 and "Traceback" not in err, (case, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("nvmeof-fuse: error:"), (case, err)


def connections(fabric) -> list[str]:
    """Our side's queue connections: RC queue pairs (rdma; the rxe link's GSI QP is always
    there) or TCP connections to the target's port."""
    if fabric.transport == "rdma":
        out = sh("rdma", "resource", "show", "qp").stdout
        return [line for line in out.splitlines() if " type RC " in line]
    out = sh("ss", "-Htn", "state", "established", f"( dport = :{fabric.port} )").stdout
    return [line for line in out.splitlines() if line.strip()]


def test_sigint_sigterm_and_fusermount_each_flush_unmount_and_disconnect(fabric, tmp_path):
    """Three daemons side by side (one wait for all the imports), each stopped another way."""
    baseline = connections(fabric)
    stops = ["SIGINT", "SIGTERM", "fusermount3 -u"]
    daemons = []
    try:
        for i, stop in enumerate(stops):
            point = tmp_path / f"m{i}"
            point.mkdir()
            rfd, wfd = os.pipe()
            proc = subprocess.Popen([*mount_args(fabric, "--ready-fd", str(wfd), str(point))],
                                    pass_fds=(wfd,), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            os.close(wfd)
            daemons.append((stop, point, proc, rfd))
        for _, _, proc, rfd in daemons:
            status = read_line(rfd, TIMEOUT)
            os.close(rfd)
            if status is None:  # no word within TIMEOUT: show what it logged so far
                proc.kill()
            assert status == "ready", proc.stderr.read() if not status else status
        assert len(connections(fabric)) > len(baseline)
        for i, (stop, point, proc, _) in enumerate(daemons):
            fd = os.open(f"{point}/n1", os.O_RDWR)  # some I/O and an open file to drain
            try:
                os.pwrite(fd, bytes([i + 1]) * 4096, (200 << 20) + i * 4096)
                assert os.pread(fd, 4096, (200 << 20) + i * 4096) == bytes([i + 1]) * 4096
            finally:
                os.close(fd)
            if stop.startswith("SIG"):
                proc.send_signal(getattr(signal, stop))
            else:
                sh("fusermount3", "-u", str(point))
        for stop, point, proc, _ in daemons:
            err = proc.communicate(timeout=TIMEOUT)[1]
            assert proc.returncode == 0, f"{stop}: {err}"
            assert "disconnected from" in err, f"{stop}: {err}"
            flushed = [line for line in err.splitlines() if "flushed" in line]
            assert all("n2" not in line for line in flushed), f"{stop}: {err}"  # not written
            assert "failed" not in err and "timed out" not in err, f"{stop}: {err}"
            assert not any(m.mountpoint == str(point) for m in read_mountinfo()), stop
        assert len(connections(fabric)) == len(baseline)
    finally:
        for _, point, proc, _ in daemons:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=TIMEOUT)
            sh("fusermount3", "-uz", str(point), check=False)
