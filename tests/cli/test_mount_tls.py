"""``nvmeof-fuse mount --daemon --tls-key KEY``: a real daemon, given the key inline (so over
its secrets pipe, never in its argv), mounts the fake target through a TLS front of OpenSSL's
(tests/tls_front.py) and reads and writes byte-exact through FUSE; unmounted cleanly."""

from __future__ import annotations

import mmap
import os
import subprocess
import time

import pytest
from tcp_target import NQN, served_in_thread
from tls_front import TlsFront

from nvmeof_fuse.cli import entry
from nvmeof_fuse.nvme import tls_psk

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse")
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:5c1d0e2f-3a4b-4c5d-8e6f-7a8b9c0d1e2f"
BOUND = 30  # s


def test_a_daemon_mounts_over_tls_with_an_inline_key_and_is_byte_exact(tmp_path, capsys):
    key = os.urandom(32)
    psk = tls_psk.derive(tls_psk.ConfiguredPsk(key, 1), HOSTNQN, NQN)
    inline = tls_psk.format_interchange(key, 1)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    data = os.urandom(1 << 20)
    with served_in_thread(size=4 << 20) as (target, _), \
            TlsFront(target.port, {psk.identity: psk.key}, psk.suite) as front:
        argv = ["mount", "-t", "tcp", "-a", "127.0.0.1", "-s", str(front.port), "-n", NQN,
                "-q", HOSTNQN, "--tls-key", inline, "-k", "0", "--daemon", str(mnt)]
        assert entry.main(argv) == 0, capsys.readouterr().err
        try:
            daemons = subprocess.run(["pgrep", "-f", f"nvmeof_fuse.cli mount .*{mnt}"],
                                     capture_output=True, text=True).stdout.split()
            assert daemons
            for pid in daemons:  # the key is in no daemon's argv or environment
                for what in ("cmdline", "environ"):
                    with open(f"/proc/{pid}/{what}", "rb") as f:
                        assert inline.split(":")[2].encode() not in f.read()
            fd = os.open(mnt / "n1", os.O_RDWR | os.O_DIRECT)
            try:
                buf = mmap.mmap(-1, len(data))
                buf[:] = data
                assert os.pwritev(fd, [buf], 1 << 20) == len(data)
                out = mmap.mmap(-1, len(data))
                assert os.preadv(fd, [out], 1 << 20) == len(data)
                assert out[:] == data
            finally:
                os.close(fd)
            assert bytes(target.data[1 << 20:2 << 20]) == data
            with open(mnt / ".nvmeof" / "stats") as report:
                assert f"userspace ({psk.suite})" in report.read()
            assert front.handshakes >= 2 and front.failures == []
        finally:
            subprocess.run(["fusermount3", "-u", str(mnt)], timeout=BOUND, check=False)
            deadline = time.monotonic() + BOUND
            while time.monotonic() < deadline and subprocess.run(
                    ["pgrep", "-f", f"nvmeof_fuse.cli mount .*{mnt}"],
                    capture_output=True).returncode == 0:
                time.sleep(0.1)
    assert time.monotonic() < deadline, "the daemon outlived its unmount"


def test_discover_over_tls_offers_the_discovery_nqns_identity(capsys):
    """``discover --tls-key``: the handshake offers the identity of the discovery NQN (the
    subsystem a discovery controller is), as nvme-cli's discover does."""
    key = os.urandom(32)
    psk = tls_psk.derive(tls_psk.ConfiguredPsk(key, 1), HOSTNQN,
                         "nqn.2014-08.org.nvmexpress.discovery")
    with served_in_thread() as (target, _), \
            TlsFront(target.port, {psk.identity: psk.key}, psk.suite) as front:
        assert entry.main(["discover", "-t", "tcp", "-a", "127.0.0.1", "-s", str(front.port),
                           "-q", HOSTNQN, "--tls-key", tls_psk.format_interchange(key, 1)]) == 0
        assert front.handshakes >= 1 and front.failures == []
    assert "Discovery Log Number of Records" in capsys.readouterr().out


def test_mount_all_reads_a_discovery_controller_that_requires_tls(monkeypatch, capsys):
    """``mount-all --tls-key``: its own discovery connection shakes hands (the key of the
    discovery NQN's identity), as ``nvme connect-all --tls`` does (the fake target's log
    lists no subsystem; ``-O`` options would go to the mounts)."""
    from nvmeof_fuse.cli import admin

    key = os.urandom(32)
    psk = tls_psk.derive(tls_psk.ConfiguredPsk(key, 1), HOSTNQN,
                         "nqn.2014-08.org.nvmexpress.discovery")
    monkeypatch.setattr(admin, "_mount_one", lambda o, log_file: None)
    with served_in_thread() as (target, _), \
            TlsFront(target.port, {psk.identity: psk.key}, psk.suite) as front:
        status = entry.main(["mount-all", "-t", "tcp", "-a", "127.0.0.1", "-s",
                             str(front.port), "-q", HOSTNQN, "--tls-key",
                             tls_psk.format_interchange(key, 1), "/tmp/nvmeof-fuse-all"])
        assert front.handshakes >= 1 and front.failures == []
    out = capsys.readouterr()
    assert status == 0, out.err
    assert out.out == "no NVMe subsystems in the discovery log page\n"  # read through TLS
