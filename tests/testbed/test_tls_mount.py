"""A FUSE mount over NVMe/TCP with TLS 1.3 against the real nvmet TLS port (issue #58's
acceptance).

nvmet's port 4 (``TESTBED_TLS_PORT``) requires TLS 1.3 and hands each handshake to tlshd
(ktls-utils, GnuTLS); the PSKs are in the kernel's ``.nvme`` keyring under their identities
(trixie's tlshd and nvme-cli: docs/testbed.md).  The kernel initiator's, for ``nvme connect
--tls``, is put there by nvme-cli's own ``gen-tls-key --insert``; ours, which the daemon
derives from its ``--tls-key`` as libnvme 1.16 does, by add_key (nvmeof_fuse.host.keyring).
libnvme before 1.16 (trixie's 1.13 among them) derives the TLS PSK the older way (our
``--compat``), so nvme-cli 2.13's key is checked against that, and ``mount-all --tls`` takes
one such key from the keyring.  The kernel initiator (its handshake by tlshd too) is the
second opinion on the data, over TLS both ways.
The daemon's records go through the guest kernel (kTLS).

The module's daemon mount is made by ``mount-all`` from the TLS port's discovery log (its
records say TSAS tls1.3, TREQ required), one mount for the module (a mount costs about 10 s
under TCG); the fstab line (``tls``, ``tls_key_file``, ``workers=2``) makes its own.  The faults
nvmet cannot be made to commit (a stalled handshake, an alert or a cut mid-record) are
tests/testbed/test_tls.py's and tests/hostile/test_tls.py's, behind a TLS front.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from dataclasses import dataclass

import pytest
from kernel_initiator import HOSTNQN as KERNEL_HOSTNQN
from kernel_initiator import connected, pread_direct, pwrite_direct
from nvmet import on_port
from vm import TLS_PORT, sh, target_away, wait_for

from nvmeof_fuse.host import keyring
from nvmeof_fuse.nvme import tls_psk

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000715b"
COMPAT_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000715c"
"""A host whose only PSK (the discovery NQN's) nvme-cli 2.13 loaded: the older derivation."""
ROOT = "/tmp/nvmeof-tls"  # mount-all's root: the module's mount is ROOT/<subnqn>
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
FSTYPE = "fuse.nvmeof-fuse"
MIB = 1 << 20
OUTAGE = 5  # s the subsystem stays off nvmet's TLS port
BOUND = 300  # s: a hang check, never a performance bound (Python runs ~10x slower in TCG)


@dataclass
class Tls:
    addr: str
    port: int
    psk: tls_psk.TlsPsk
    key_file: str
    nvme: str
    """trixie's nvme-cli, for the kernel initiator's ``connect --tls``."""
    tlshd_log: str

    def handshakes(self) -> int:
        """tlshd's successful handshakes so far, both sides (nvmet's and the kernel
        initiator's).  tlshd logs one after handing the socket back: wait for a count."""
        return self._count("was successful")

    def failures(self) -> int:
        return self._count("failed")

    def _count(self, what: str) -> int:
        with open(self.tlshd_log) as f:
            return sum(1 for line in f if "Handshake with" in line and what in line)


@dataclass
class Mount:
    path: str
    log: str


def insert_psk(nvme: str, key: bytes, hostnqn: str, subnqn: str) -> str:
    """nvme-cli puts the TLS PSK that ``key`` (SHA-256) gives ``hostnqn`` for ``subnqn`` into
    the ``.nvme`` keyring under its identity (version 0, as the 6.12 kernel looks keys up);
    the interchange key it prints."""
    out = sh(nvme, "gen-tls-key", "--hmac=1", "--identity=0", f"--hostnqn={hostnqn}",
             f"--subsysnqn={subnqn}", f"--secret={key.hex()}", "--insert")
    return out.splitlines()[0]


@pytest.fixture(scope="module")
def tls(testbed, tmp_path_factory):
    """nvmet's TLS port with the testbed's subsystem on it, the PSKs our host NQN and the
    kernel initiator's take in ``.nvme`` (the discovery NQN's too: ``discover`` and
    ``mount-all`` offer it), and the key in a file (mode 0600)."""
    if not testbed.tls_port:
        pytest.skip(f"no TLS target in this testbed: {testbed.tls_unavailable}")
    sh("modprobe", "tls")  # the daemon's records go to the kernel
    key = os.urandom(32)
    ours = tls_psk.format_interchange(key, tls_psk.PskHash.SHA256)
    configured = tls_psk.parse_interchange(ours)
    # the kernel initiator's PSK by libnvme 1.13, and its interchange form by nvme-cli
    assert insert_psk(testbed.nvme_tls, key, KERNEL_HOSTNQN, testbed.nqn) == ours
    assert insert_psk(testbed.nvme_tls, key, COMPAT_HOSTNQN, DISCOVERY_NQN) == ours
    nvme_keyring = keyring.find_keyring(keyring.DEFAULT_KEYRING)
    theirs = tls_psk.derive(configured, KERNEL_HOSTNQN, testbed.nqn, compat=True)
    loaded = keyring.search(nvme_keyring, theirs.identity)
    assert loaded and keyring.read(loaded) == theirs.key, "libnvme derives otherwise"
    for subnqn in (testbed.nqn, DISCOVERY_NQN):
        mine = tls_psk.derive(configured, HOSTNQN, subnqn)
        keyring.add(nvme_keyring, mine.identity, mine.key)
    psk = tls_psk.derive(configured, HOSTNQN, testbed.nqn)
    key_file = tmp_path_factory.mktemp("tls") / "tls.key"
    key_file.write_text(ours + "\n")
    key_file.chmod(0o600)
    with on_port(testbed.nqn, TLS_PORT):
        yield Tls(testbed.tcp_addr, testbed.tls_port, psk, str(key_file), testbed.nvme_tls,
                  os.path.join(testbed.out, "tlshd.log"))


def ok(*cmd: str, env: dict | None = None) -> str:
    """Run ``cmd``; its stdout (a non-zero exit fails with what it said)."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=BOUND, env=env)
    assert out.returncode == 0, f"{cmd}: rc {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def discovery_args(tls: Tls) -> list[str]:
    return ["-t", "tcp", "-a", tls.addr, "-s", str(tls.port), "-q", HOSTNQN, "--tls",
            "--tls-key", tls.key_file]


def unmount(point: str, log: str) -> None:
    """Unmount, and wait until the daemon has flushed and disconnected."""
    subprocess.run(["fusermount3", "-u", point], capture_output=True, timeout=120)
    wait_for(lambda: not any(f" {point} " in line for line in open("/proc/mounts")), 60)
    assert wait_for(lambda: "disconnected from" in log_text(log), 120), log_text(log)
    text = log_text(log)
    assert "no final flush" not in text and "no orderly shutdown" not in text, text


@pytest.fixture(scope="module")
def mnt(testbed, tls):
    """The module's daemon mount, made by ``mount-all`` from the TLS port's discovery log
    (the key for the mount as ``-O tls_key_file=``, a short reconnect delay, the default
    --ctrl-loss-tmo of 600 s); its log comes back in TESTBED_OUT."""
    log = os.path.join(testbed.out, "test_tls_mount.log")
    point = os.path.join(ROOT, testbed.nqn)
    out = ok("nvmeof-fuse", "mount-all", *discovery_args(tls), "-O",
             f"tls_key_file={tls.key_file},reconnect_delay=1,log_file={log}", "-o", "json",
             ROOT)
    rows = [r for r in json.loads(out) if r["subnqn"] == testbed.nqn]
    assert [(r["status"], r["trsvcid"]) for r in rows] == [("mounted", str(tls.port))], out
    assert wait_for(lambda: os.path.exists(f"{point}/n1"), BOUND), log_text(log)
    try:
        yield Mount(point, log)
    finally:
        unmount(point, log)


def stats(point: str) -> dict:
    with open(f"{point}/.nvmeof/stats.json") as f:
        return json.load(f)


def controller(point: str) -> dict:
    with open(f"{point}/.nvmeof/controller.json") as f:
        return json.load(f)["controller"]


def log_text(log: str) -> str:
    try:
        with open(log) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def written(point: str, name: str) -> int:
    return sum(op["bytes"] for op in stats(point)[name]["ops"].values())


def fio_verify(path: str, offset_mib: int, size_mib: int, *extra: str) -> list[str]:
    """fio's verified writes to ``path``; its colons (mount-all's mountpoint is named after
    the NQN) escaped, since fio takes a colon in --filename for a list of files."""
    path = path.replace(":", "\\:")
    return ["fio", "--name=tls", f"--filename={path}", "--rw=randwrite",
            "--bssplit=4k/50:64k/50", "--iodepth=8", "--ioengine=libaio", "--direct=1",
            f"--offset={offset_mib}M", f"--size={size_mib}M", "--verify=crc32c",
            "--do_verify=1", "--verify_fatal=1", "--output-format=terse", *extra]


def kernel_over_tls(testbed, tls: Tls):
    """The kernel initiator connected to nvmet's TLS port with ``nvme connect --tls`` (its
    PSK looked up in ``.nvme`` by identity, its handshake by tlshd)."""
    return connected("tcp", tls.addr, tls.port, testbed.nqn, extra=("--tls",),
                     program=tls.nvme)


def kernel_tls_key(device: str) -> str:
    """The TLS key (its serial in hex) of the kernel controller that ``device`` is on."""
    name = os.path.basename(device)
    [ctrl] = [c for c in os.listdir("/sys/class/nvme")
              if os.path.exists(f"/sys/class/nvme/{c}/{name}")]
    with open(f"/sys/class/nvme/{ctrl}/tls_key") as f:
        return f.read().strip()


def test_discover_over_tls_lists_the_port_as_requiring_tls(testbed, tls):
    """``discover --tls --tls-key``: nvmet's discovery controller on its TLS port, the
    handshake offering the discovery NQN's identity, as nvme-cli's discover does; the log
    lists the subsystem with TSAS tls1.3 and TREQ required."""
    before = tls.handshakes()
    page = json.loads(ok("nvmeof-fuse", "discover", *discovery_args(tls), "-o", "json"))
    [record] = [r for r in page["records"] if r.get("subnqn") == testbed.nqn]
    assert record["trsvcid"] == str(tls.port) and record["tcp_sectype"] == "tls13", record
    assert record["treq"].startswith("required"), record
    assert wait_for(lambda: tls.handshakes() > before, 30)


def test_mount_all_from_the_keyring_refuses_a_record_whose_psk_it_lacks(testbed, tls,
                                                                         tmp_path):
    """``mount-all --tls`` with no key: its discovery connection takes from ``.nvme`` the PSK
    nvme-cli 2.13 loaded (libnvme's older derivation, which our ``--tls-key`` would not
    give), and the log's record, whose PSK the keyring lacks for this host, is refused in
    one row naming the identity: nothing mounted, exit status 1."""
    root = tmp_path / "root"
    before = tls.handshakes()
    out = subprocess.run(["nvmeof-fuse", "mount-all", "-t", "tcp", "-a", tls.addr, "-s",
                          str(tls.port), "-q", COMPAT_HOSTNQN, "--tls", "-o", "json",
                          str(root)], capture_output=True, text=True, timeout=BOUND)
    assert out.returncode == 1, out.stdout + out.stderr
    [row] = [r for r in json.loads(out.stdout) if r["subnqn"] == testbed.nqn]
    assert row["status"] == "failed" and row["reason"].startswith(
        "the port requires TLS 1.3 (its TSAS) and the keyring holds no 'NVMe0R0"), row
    assert f"{COMPAT_HOSTNQN} {testbed.nqn}'" in row["reason"], row
    assert wait_for(lambda: tls.handshakes() > before, 30)
    assert not any(str(root) in line for line in open("/proc/mounts"))


def test_tls_compat_offers_the_psk_an_older_nvme_cli_loaded(testbed, tls):
    """``--tls-key KEY --tls-compat``: the PSK that nvme-cli 2.13 loaded for the same key
    (libnvme's older derivation) is the one offered, so nvmet's tlshd takes it; without
    ``--tls-compat`` the same key offers the current derivation's, which it refuses."""
    args = ["-t", "tcp", "-a", tls.addr, "-s", str(tls.port), "-q", COMPAT_HOSTNQN,
            "--tls-key", tls.key_file]
    before = tls.handshakes()
    page = json.loads(ok("nvmeof-fuse", "discover", *args, "--tls-compat", "-o", "json"))
    assert any(r.get("subnqn") == testbed.nqn for r in page["records"]), page
    assert wait_for(lambda: tls.handshakes() > before, 30)
    out = subprocess.run(["nvmeof-fuse", "discover", *args], capture_output=True, text=True,
                         timeout=BOUND)
    assert out.returncode != 0 and out.stderr.count("\n") == 1, out.stderr
    assert "the peer closed the connection during the TLS handshake" in out.stderr, out.stderr


def test_dd_through_the_tls_mount_agrees_with_the_kernel_initiator_over_tls(testbed, tls, mnt,
                                                                           tmp_path):
    """dd O_DIRECT through the mount (records in the kernel, handshakes with tlshd) and the
    kernel initiator's O_DIRECT I/O through ``nvme connect --tls`` to the same port:
    byte-exact both ways; stats.json and controller.json say where the records go and the
    suite."""
    rng = random.Random(58)
    ours, theirs = rng.randbytes(4 * MIB), rng.randbytes(4 * MIB)
    skip = 220  # MiB into n1, away from the other modules' ranges
    data = tmp_path / "ours.bin"
    data.write_bytes(ours)
    sh("dd", f"if={data}", f"of={mnt.path}/n1", "bs=1M", f"seek={skip}", "count=4",
       "oflag=direct", "conv=notrunc", "status=none")
    with kernel_over_tls(testbed, tls) as kernel:
        assert kernel_tls_key(kernel[1]), "the kernel initiator's controller holds no TLS key"
        assert pread_direct(kernel[1], skip * MIB, 4 * MIB) == ours, "the kernel reads otherwise"
        pwrite_direct(kernel[1], skip * MIB, theirs)
    back = tmp_path / "back.bin"
    sh("dd", f"if={mnt.path}/n1", f"of={back}", "bs=1M", f"skip={skip}", "count=4",
       "iflag=direct", "status=none")
    assert back.read_bytes() == theirs, "the mount reads otherwise than the kernel wrote"
    layer = f"kernel ({tls.psk.suite})"
    assert stats(mnt.path)["connection"]["tls"] == layer
    assert controller(mnt.path)["tls"] == layer


def test_fio_crc32c_verify_through_the_tls_mount(tls, mnt):
    before = tls.handshakes()
    out = subprocess.run(fio_verify(f"{mnt.path}/n2", 200, 4), capture_output=True, text=True,
                         timeout=BOUND)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    connection = stats(mnt.path)["connection"]
    assert connection["losses"] == 0 and tls.handshakes() == before, connection


def test_a_companion_file_is_byte_exact_on_its_own_tls_queues(testbed, tls, mnt):
    """A File in this process (another than the daemon) leases queues of its own: each
    connection shakes hands with nvmet (tlshd) itself, and its records go through the
    kernel; the kernel initiator over TLS reads what it wrote."""
    import numpy as np

    import nvmeof_fuse

    offset, size = 224 * MIB + 4096, MIB
    data = np.frombuffer(os.urandom(size), np.uint8).copy()
    out = np.zeros(size, np.uint8)
    before = tls.handshakes()
    with nvmeof_fuse.File(f"{mnt.path}/n1") as f:
        assert f.own_queues, f.placement
        assert f.write(data, file_offset=offset) == size
        assert f.read(out, file_offset=offset) == size
        placement = f.placement["host"]
        queues = len(f.own_queues)
    assert out.tobytes() == data.tobytes()
    assert placement == ("direct: received and sent by this process's own NVMe/TCP queues "
                         f"(tls: kernel ({tls.psk.suite}))")
    assert wait_for(lambda: tls.handshakes() >= before + queues, 30)  # its own handshakes
    with kernel_over_tls(testbed, tls) as kernel:
        assert pread_direct(kernel[1], offset, size) == data.tobytes()


def test_fio_verify_rides_out_an_outage_with_fresh_handshakes(testbed, tls, mnt):
    """The subsystem leaves nvmet's TLS port for OUTAGE s under fio's verified writes: nvmet
    drops the controller and, with no subsystem left, closes the port; once it is back the
    controller is connected again through fresh handshakes: fio sees no error."""
    lost = log_text(mnt.log).count("lost the connection")
    reconnected = log_text(mnt.log).count("reconnected to")
    before = stats(mnt.path)["connection"]
    start = written(mnt.path, "n2")
    # rate-limited, so the writes are still going when the port goes away
    fio = subprocess.Popen(fio_verify(f"{mnt.path}/n2", 208, 6, "--rate=1m"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: fio.poll() is not None
                        or written(mnt.path, "n2") > start + MIB // 2, BOUND), "fio wrote nothing"
        assert fio.poll() is None, fio.communicate()
        with target_away(testbed.nqn, TLS_PORT):
            assert wait_for(lambda: log_text(mnt.log).count("lost the connection") > lost,
                            60), log_text(mnt.log)
            handshakes = tls.handshakes()
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
    assert wait_for(lambda: tls.handshakes() >= handshakes + 2, 30)  # admin and I/O, anew


def test_a_wrong_key_is_refused_in_one_line(testbed, tls, tmp_path):
    """nvmet (tlshd) does not take the PSK and closes the connection without an alert: the
    mount fails at once in one line that says so and names the identity, no traceback,
    nothing mounted."""
    wrong = tmp_path / "wrong.key"
    wrong.write_text(tls_psk.format_interchange(os.urandom(32), tls_psk.PskHash.SHA256))
    wrong.chmod(0o600)
    point = tmp_path / "mnt"
    point.mkdir()
    failures = tls.failures()
    proc = subprocess.run(["nvmeof-fuse", "mount", "-t", "tcp", "-a", tls.addr, "-s",
                           str(tls.port), "-n", testbed.nqn, "-q", HOSTNQN, "--tls-key",
                           str(wrong), "--daemon", "--log-file", str(tmp_path / "wrong.log"),
                           str(point)], capture_output=True, text=True, timeout=BOUND)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("nvmeof-fuse: error:"), proc.stderr
    assert "closed the connection during the TLS handshake" in lines[0], lines[0]
    assert tls.psk.identity in lines[0], lines[0]
    assert not any(f" {point} " in line for line in open("/proc/mounts"))
    assert wait_for(lambda: tls.failures() > failures, 30)


def test_an_fstab_line_with_tls_and_two_workers_mounts_through_mount8(testbed, tls):
    """``tls,tls_key_file=FILE,workers=2`` in /etc/fstab, mounted by its mountpoint as
    systemd does: the worker process connects its own queues to the TLS port, each with a
    handshake of its own and its records in the kernel, and serves fio's verified writes
    beside the main process; umount flushes and disconnects."""
    from test_fs import wait_for_workers, worker_ops

    from nvmeof_fuse.cli.mounthelper import SYSTEMD_PATH

    point = f"{ROOT}-fstab"
    os.makedirs(point, exist_ok=True)
    log = os.path.join(testbed.out, "test_tls_mount-fstab.log")
    with open("/etc/fstab", encoding="utf-8") as f:
        saved = f.read()
    line = (f"nvme+tcp://{tls.addr}:{tls.port}/{testbed.nqn}  {point}  {FSTYPE}  "
            f"_netdev,nofail,tls,tls_key_file={tls.key_file},hostnqn={HOSTNQN},workers=2,"
            f"log_file={log}  0 0\n")
    before = tls.handshakes()
    try:
        with open("/etc/fstab", "a", encoding="utf-8") as f:
            f.write(line)
        ok("nvmeof-fuse", "install-helper")
        ok("mount", point, env={**os.environ, "PATH": SYSTEMD_PATH})
        wait_for_workers(log, 2)
        io_queues = controller(point)["io_queues"]
        # the main process's admin and I/O queues, and at least one of the worker's
        assert wait_for(lambda: tls.handshakes() >= before + 1 + io_queues + 1, 30), \
            log_text(log)
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
