"""A FUSE mount over NVMe/TCP with TLS 1.3 against the real nvmet (issue #58's acceptance).

nvmet hands TLS handshakes to tlshd, which cannot be had on Debian 12 (docs: TESTBED.md), so
the TLS port is a front of OpenSSL's own server side and record layer (tests/tls_front.py),
run in this test process in front of nvmet's plain NVMe/TCP port, with NQNs it takes, as the
issue allows.  The daemon's records go through the guest kernel (kTLS); the kernel
initiator, connected plainly to the same subsystem, is the second opinion on the data.

One front and one daemon mount serve the module (a mount costs about 10 s under TCG); the
fstab line (``tls``, ``tls_key_file``, ``workers=2``) makes its own.  Not here: ``mount-all``
from a discovery log that requires TLS (nvmet lists its own ports, and a port of its with
TSAS tls1.3 needs tlshd).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from dataclasses import dataclass

import pytest
from kernel_initiator import connected, pread_direct, pwrite_direct
from tls_front import TlsFront
from vm import TCP_PORT, sh, target_away, wait_for

from nvmeof_fuse.nvme import tls_psk

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000715b"
MNT = "/tmp/nvmeof-tls"
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
FSTYPE = "fuse.nvmeof-fuse"
MIB = 1 << 20
OUTAGE = 5  # s the subsystem stays off nvmet's TCP port
BOUND = 300  # s: a hang check, never a performance bound (Python runs ~10x slower in TCG)


@dataclass
class Tls:
    front: TlsFront
    psk: tls_psk.TlsPsk
    key_file: str


@dataclass
class Mount:
    path: str
    log: str


@pytest.fixture(scope="module")
def tls(testbed, tmp_path_factory):
    """The TLS front before nvmet's NVMe/TCP port, holding the PSK a SHA-256 key gives for
    our host NQN and the testbed's subsystem, and that key in a file (mode 0600)."""
    sh("modprobe", "tls")  # the daemon's records go to the kernel
    key = os.urandom(32)
    configured = tls_psk.ConfiguredPsk(key, tls_psk.PskHash.SHA256)
    psk = tls_psk.derive(configured, HOSTNQN, testbed.nqn)
    discovery = tls_psk.derive(configured, HOSTNQN, DISCOVERY_NQN)  # `discover` offers it
    key_file = tmp_path_factory.mktemp("tls") / "tls.key"
    key_file.write_text(tls_psk.format_interchange(key, tls_psk.PskHash.SHA256) + "\n")
    key_file.chmod(0o600)
    with TlsFront(testbed.port, {psk.identity: psk.key, discovery.identity: discovery.key},
                  psk.suite, backend_host=testbed.tcp_addr) as front:
        yield Tls(front, psk, str(key_file))


def mount_args(testbed, tls: Tls, point: str, log: str, *extra: str,
               key_file: str | None = None) -> list[str]:
    return ["nvmeof-fuse", "mount", "-t", "tcp", "-a", "127.0.0.1", "-s", str(tls.front.port),
            "-n", testbed.nqn, "-q", HOSTNQN, "--tls", "--tls-key", key_file or tls.key_file,
            "--daemon", "--log-file", log, *extra, point]


def unmount(point: str, log: str) -> None:
    """Unmount, and wait until the daemon has flushed and disconnected: the front must
    outlive it (closed earlier, it cut the daemon's orderly shutdown short)."""
    subprocess.run(["fusermount3", "-u", point], capture_output=True, timeout=120)
    wait_for(lambda: not any(f" {point} " in line for line in open("/proc/mounts")), 60)
    assert wait_for(lambda: "disconnected from" in log_text(log), 120), log_text(log)
    text = log_text(log)
    assert "no final flush" not in text and "no orderly shutdown" not in text, text


@pytest.fixture(scope="module")
def mnt(testbed, tls):
    """The module's daemon mount through the front (a short reconnect delay, the default
    --ctrl-loss-tmo of 600 s); its log comes back in TESTBED_OUT."""
    os.makedirs(MNT, exist_ok=True)
    log = os.path.join(testbed.out, "test_tls_mount.log")
    sh(*mount_args(testbed, tls, MNT, log, "-c", "1"))
    try:
        yield Mount(MNT, log)
    finally:
        unmount(MNT, log)


def ok(*cmd: str, env: dict | None = None) -> str:
    """Run ``cmd``; its stdout (a non-zero exit fails with what it said)."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=BOUND, env=env)
    assert out.returncode == 0, f"{cmd}: rc {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def stats(point: str) -> dict:
    with open(f"{point}/.nvmeof/stats.json") as f:
        return json.load(f)


def controller(point: str) -> dict:
    with open(f"{point}/.nvmeof/controller.json") as f:
        return json.load(f)["controller"]


def log_text(log: str) -> str:
    with open(log) as f:
        return f.read()


def written(point: str, name: str) -> int:
    return sum(op["bytes"] for op in stats(point)[name]["ops"].values())


def fio_verify(path: str, offset_mib: int, size_mib: int, *extra: str) -> list[str]:
    return ["fio", "--name=tls", f"--filename={path}", "--rw=randwrite",
            "--bssplit=4k/50:64k/50", "--iodepth=8", "--ioengine=libaio", "--direct=1",
            f"--offset={offset_mib}M", f"--size={size_mib}M", "--verify=crc32c",
            "--do_verify=1", "--verify_fatal=1", "--output-format=terse", *extra]


def test_dd_through_the_tls_mount_agrees_with_the_kernel_initiator(testbed, tls, mnt,
                                                                  tmp_path):
    """dd O_DIRECT through the mount (records in the kernel, through the front to nvmet) and
    the kernel initiator's O_DIRECT read of the same namespace, plainly: byte-exact both
    ways; stats.json and controller.json say where the records go and the suite."""
    rng = random.Random(58)
    ours, theirs = rng.randbytes(4 * MIB), rng.randbytes(4 * MIB)
    skip = 220  # MiB into n1, away from the other modules' ranges
    data = tmp_path / "ours.bin"
    data.write_bytes(ours)
    sh("dd", f"if={data}", f"of={mnt.path}/n1", "bs=1M", f"seek={skip}", "count=4",
       "oflag=direct", "conv=notrunc", "status=none")
    with connected("tcp", testbed.tcp_addr, testbed.port, testbed.nqn) as kernel:
        assert pread_direct(kernel[1], skip * MIB, 4 * MIB) == ours, "the kernel reads otherwise"
        pwrite_direct(kernel[1], skip * MIB, theirs)
    back = tmp_path / "back.bin"
    sh("dd", f"if={mnt.path}/n1", f"of={back}", "bs=1M", f"skip={skip}", "count=4",
       "iflag=direct", "status=none")
    assert back.read_bytes() == theirs, "the mount reads otherwise than the kernel wrote"
    layer = f"kernel ({tls.psk.suite})"
    assert stats(mnt.path)["connection"]["tls"] == layer
    assert controller(mnt.path)["tls"] == layer
    assert tls.front.handshakes >= 2 and tls.front.failures == []  # admin and I/O queues


def test_fio_crc32c_verify_through_the_tls_mount(tls, mnt):
    before = tls.front.handshakes
    out = subprocess.run(fio_verify(f"{mnt.path}/n2", 200, 4), capture_output=True, text=True,
                         timeout=BOUND)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    connection = stats(mnt.path)["connection"]
    assert connection["losses"] == 0 and tls.front.handshakes == before, connection


def test_a_companion_file_is_byte_exact_on_its_own_tls_queues(testbed, tls, mnt):
    """A File in this process (another than the daemon) leases queues of its own: each
    connection shakes hands with the front itself, and its records go through the kernel."""
    import numpy as np

    import nvmeof_fuse

    offset, size = 224 * MIB + 4096, MIB
    data = np.frombuffer(os.urandom(size), np.uint8).copy()
    out = np.zeros(size, np.uint8)
    before = tls.front.handshakes
    with nvmeof_fuse.File(f"{mnt.path}/n1") as f:
        assert f.own_queues, f.placement
        assert f.write(data, file_offset=offset) == size
        assert f.read(out, file_offset=offset) == size
        placement = f.placement["host"]
        queues = len(f.own_queues)
    assert out.tobytes() == data.tobytes()
    assert placement == ("direct: received and sent by this process's own NVMe/TCP queues "
                         f"(tls: kernel ({tls.psk.suite}))")
    assert tls.front.handshakes >= before + queues  # its own handshakes
    with connected("tcp", testbed.tcp_addr, testbed.port, testbed.nqn) as kernel:
        assert pread_direct(kernel[1], offset, size) == data.tobytes()
    assert tls.front.failures == []


def test_fio_verify_rides_out_an_outage_with_fresh_handshakes(testbed, tls, mnt):
    """The subsystem leaves nvmet's TCP port for OUTAGE s under fio's verified writes: nvmet
    drops the controller, so the front closes our connections; each reconnect try shakes
    hands anew (the front then finds the port away and closes), and once the port is back
    the controller is connected again through a fresh handshake: fio sees no error."""
    lost = log_text(mnt.log).count("lost the connection")
    reconnected = log_text(mnt.log).count("reconnected to")
    before = stats(mnt.path)["connection"]
    start = written(mnt.path, "n2")
    # rate-limited, so the writes are still going when the port goes away
    fio = subprocess.Popen(fio_verify(f"{mnt.path}/n2", 208, 6, "--rate=1m"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: written(mnt.path, "n2") > start + MIB // 2, BOUND), \
            "fio wrote nothing"
        with target_away(testbed.nqn, TCP_PORT):
            assert wait_for(lambda: log_text(mnt.log).count("lost the connection") > lost,
                            60), log_text(mnt.log)
            handshakes = tls.front.handshakes
            time.sleep(OUTAGE)  # the outage itself, not a wait for a condition
        assert wait_for(lambda: log_text(mnt.log).count("reconnected to") > reconnected,
                        BOUND), log_text(mnt.log)
        out, err = fio.communicate(timeout=BOUND)
    finally:
        if fio.poll() is None:
            fio.kill()
    assert fio.returncode == 0, out[-2000:] + err[-2000:] + log_text(mnt.log)
    text = log_text(mnt.log)
    assert "Traceback" not in text, text
    connection = stats(mnt.path)["connection"]
    assert connection["state"] == "live", connection
    assert connection["reconnects"] > before["reconnects"], connection
    assert connection["tls"] == f"kernel ({tls.psk.suite})"
    assert tls.front.handshakes >= handshakes + 2  # admin and I/O queues, anew
    assert all(f.startswith("backend ") for f in tls.front.failures), tls.front.failures


def test_a_wrong_key_is_refused_in_one_line(testbed, tls, tmp_path):
    """The target (the front) refuses the PSK: the mount fails at once in one line that says
    so and names the identity, no traceback, nothing mounted."""
    wrong = tmp_path / "wrong.key"
    wrong.write_text(tls_psk.format_interchange(os.urandom(32), tls_psk.PskHash.SHA256))
    wrong.chmod(0o600)
    point = tmp_path / "mnt"
    point.mkdir()
    failures = len(tls.front.failures)
    proc = subprocess.run(mount_args(testbed, tls, str(point), str(tmp_path / "wrong.log"),
                                     key_file=str(wrong)),
                          capture_output=True, text=True, timeout=BOUND)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("nvmeof-fuse: error:"), proc.stderr
    assert "the target refused the PSK" in lines[0] and tls.psk.identity in lines[0], lines[0]
    assert not any(f" {point} " in line for line in open("/proc/mounts"))
    assert len(tls.front.failures) > failures


def test_an_fstab_line_with_tls_and_two_workers_mounts_through_mount8(testbed, tls):
    """``tls,tls_key_file=FILE,workers=2`` in /etc/fstab, mounted by its mountpoint as
    systemd does: the worker process connects its own queues through the front, each with
    a handshake of its own and its records in the kernel, and serves fio's verified writes
    beside the main process; umount flushes and disconnects."""
    from test_fs import wait_for_workers, worker_ops

    from nvmeof_fuse.cli.mounthelper import SYSTEMD_PATH

    point = f"{MNT}-fstab"
    os.makedirs(point, exist_ok=True)
    log = os.path.join(testbed.out, "test_tls_mount-fstab.log")
    with open("/etc/fstab", encoding="utf-8") as f:
        saved = f.read()
    line = (f"nvme+tcp://127.0.0.1:{tls.front.port}/{testbed.nqn}  {point}  {FSTYPE}  "
            f"_netdev,nofail,tls,tls_key_file={tls.key_file},hostnqn={HOSTNQN},workers=2,"
            f"log_file={log}  0 0\n")
    before = tls.front.handshakes
    try:
        with open("/etc/fstab", "a", encoding="utf-8") as f:
            f.write(line)
        ok("nvmeof-fuse", "install-helper")
        ok("mount", point, env={**os.environ, "PATH": SYSTEMD_PATH})
        wait_for_workers(log, 2)
        io_queues = controller(point)["io_queues"]
        # the main process's admin and I/O queues, and at least one of the worker's
        assert tls.front.handshakes >= before + 1 + io_queues + 1, log_text(log)
        out = subprocess.run(fio_verify(f"{point}/n2", 232, 4, "--numjobs=2",
                                        "--offset_increment=4M"),
                             capture_output=True, text=True, timeout=BOUND)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert all(worker_ops(point)), worker_ops(point)
        layer = f"kernel ({tls.psk.suite})"
        assert stats(point)["connection"]["tls"] == layer
        # the worker's own queues' records, as it reports them
        assert wait_for(lambda: stats(point)["workers"][1].get("tls") == layer, 60), \
            stats(point)["workers"]
        ok("umount", point)
        assert wait_for(lambda: "disconnected from" in log_text(log), 120), log_text(log)
        text = log_text(log)
        assert "Traceback" not in text and "final flush" not in text, text
    finally:
        subprocess.run(["umount", point], capture_output=True, timeout=120)
        with open("/etc/fstab", "w", encoding="utf-8") as f:
            f.write(saved)


def test_discover_over_tls_through_the_front_lists_the_subsystem(testbed, tls):
    """``discover --tls --tls-key``: nvmet's discovery controller through the front, the
    handshake offering the discovery NQN's identity, as nvme-cli's discover does."""
    before = tls.front.handshakes
    out = ok("nvmeof-fuse", "discover", "-t", "tcp", "-a", "127.0.0.1", "-s",
             str(tls.front.port), "-q", HOSTNQN, "--tls", "--tls-key", tls.key_file)
    assert "Discovery Log Number of Records" in out and testbed.nqn in out, out
    assert tls.front.handshakes > before
