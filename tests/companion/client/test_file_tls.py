"""A mount over NVMe/TCP with TLS 1.3 (a real mount in this process) of the fake target
behind a TLS front of OpenSSL's (tests/tls_front.py): the FUSE file and a File on its own
leased queues, byte-exact, each connection with its own handshake, and what the mount
reports of its records."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from tcp_target import NQN, served_in_thread
from tls_front import TlsFront

import nvmeof_fuse
from nvmeof_fuse.companion.client import file as client
from nvmeof_fuse.companion.client.file import File
from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.nvme import tls_psk

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse")
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:0f8a3c1e-5b2d-4e7a-9c6b-2d1e0f3a4b5c"
HOSTID = "0f8a3c1e-5b2d-4e7a-9c6b-2d1e0f3a4b5c"


def key_file(tmp_path, key: bytes, hash_id=tls_psk.PskHash.SHA256):
    path = tmp_path / "tls.key"
    path.write_text(tls_psk.format_interchange(key, hash_id) + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize("hash_id", [tls_psk.PskHash.SHA256, tls_psk.PskHash.SHA384],
                         ids=["sha256", "sha384"])
def test_a_tls_mount_is_byte_exact_through_fuse_and_a_files_own_queues(tmp_path, monkeypatch,
                                                                       hash_id):
    monkeypatch.setattr(client, "served_here", lambda socket: None)  # lease its own queues
    key = os.urandom(32 if hash_id == tls_psk.PskHash.SHA256 else 48)
    psk = tls_psk.derive(tls_psk.ConfiguredPsk(key, hash_id), HOSTNQN, NQN)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with served_in_thread(io_queues=32, size=4 << 20) as (target, _), \
            TlsFront(target.port, {psk.identity: psk.key}, psk.suite) as front, \
            nvmeof_fuse.mount(str(mnt), traddr="127.0.0.1", nqn=NQN, transport="tcp",
                              trsvcid=front.port, hostnqn=HOSTNQN, hostid=HOSTID,
                              tls_key=key_file(tmp_path, key, hash_id), keep_alive_tmo=0,
                              nr_io_queues=2) as m:
        data = os.urandom(300_000)
        fd = os.open(m.path(1), os.O_RDWR)
        try:
            assert os.pwrite(fd, data, 4096) == len(data)
            os.fsync(fd)
            assert os.pread(fd, len(data), 4096) == data
        finally:
            os.close(fd)
        assert bytes(target.data[4096:4096 + len(data)]) == data
        before = front.handshakes
        theirs = np.frombuffer(os.urandom(65536), np.uint8).copy()
        out = np.zeros(65536, np.uint8)
        with File(m.path(1)) as f:
            assert len(f.own_queues) > 0
            assert f.write(theirs, file_offset=1 << 20) == 65536
            assert f.read(out, file_offset=1 << 20) == 65536
            assert f.placement["host"] == ("direct: received and sent by this process's own "
                                           f"NVMe/TCP queues (tls: userspace ({psk.suite}))")
        assert out.tobytes() == theirs.tobytes() == bytes(target.data[1 << 20:(1 << 20) + 65536])
        assert front.handshakes > before  # the File's own queues shook hands themselves
        with open(mnt / ".nvmeof" / "stats") as report:
            text = report.read()
        with open(mnt / ".nvmeof" / "controller") as report:
            controller = report.read()
    assert re.search(rf"\n  tls +: userspace \({psk.suite}\)\n", text)
    assert re.search(rf"\ntls +: userspace \({psk.suite}\)\n", controller)
    assert front.failures == []


def test_a_mount_with_a_wrong_key_fails_in_one_line(tmp_path):
    psk = tls_psk.derive(tls_psk.ConfiguredPsk(os.urandom(32), 1), HOSTNQN, NQN)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with served_in_thread() as (target, _), \
            TlsFront(target.port, {psk.identity: psk.key}, psk.suite) as front:
        with pytest.raises(NVMeoFError) as info:
            with nvmeof_fuse.mount(str(mnt), traddr="127.0.0.1", nqn=NQN, transport="tcp",
                                   trsvcid=front.port, hostnqn=HOSTNQN, hostid=HOSTID,
                                   tls_key=key_file(tmp_path, os.urandom(32)),
                                   ctrl_loss_tmo=0, keep_alive_tmo=0):
                pass
    line = str(info.value)
    assert "\n" not in line
    assert "the TLS handshake failed" in line and "the target refused the PSK" in line
    assert not target.icreqs


def test_a_reconnect_shakes_hands_anew_and_io_goes_on(tmp_path):
    key = os.urandom(32)
    psk = tls_psk.derive(tls_psk.ConfiguredPsk(key, 1), HOSTNQN, NQN)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    data = os.urandom(8192)
    with served_in_thread() as (target, _), \
            TlsFront(target.port, {psk.identity: psk.key}, psk.suite) as front, \
            nvmeof_fuse.mount(str(mnt), traddr="127.0.0.1", nqn=NQN, transport="tcp",
                              trsvcid=front.port, hostnqn=HOSTNQN, hostid=HOSTID,
                              tls_key=key_file(tmp_path, key), keep_alive_tmo=0,
                              reconnect_delay=1, nr_io_queues=1, companion_queues=0) as m:
        before = front.handshakes
        front.cut_all()
        fd = os.open(m.path(1), os.O_RDWR)
        try:
            assert os.pwrite(fd, data, 0) == len(data)  # waits out the reconnect
            os.fsync(fd)
        finally:
            os.close(fd)
        assert bytes(target.data[:len(data)]) == data
        assert front.handshakes >= before + 2  # the admin queue and the I/O queue, anew
        with open(mnt / ".nvmeof" / "stats") as report:
            text = report.read()
    assert re.search(r"\n  reconnects +: [1-9]", text), text


def test_a_mount_takes_its_psk_from_the_keyring_and_hands_it_to_a_files_own_queues(
        tmp_path, monkeypatch, own_keyring):
    """``--tls`` without a key, as ``nvme connect --tls``: the keyring's PSK under the
    kernel's default identity (``user`` keys stand for ``psk`` ones on this host).  The
    File's own queues get the PSK the mount resolved, not the keyring's name."""
    from nvmeof_fuse.host import keyring

    monkeypatch.setattr(keyring, "PSK_KEY_TYPE", "user")
    monkeypatch.setattr(client, "served_here", lambda socket: None)  # lease its own queues
    name, serial = own_keyring
    psk = tls_psk.derive(tls_psk.ConfiguredPsk(os.urandom(32), 1), HOSTNQN, NQN)
    keyring.add(serial, psk.identity, psk.key)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with served_in_thread(io_queues=32, size=4 << 20) as (target, _), \
            TlsFront(target.port, {psk.identity: psk.key}, psk.suite) as front, \
            nvmeof_fuse.mount(str(mnt), traddr="127.0.0.1", nqn=NQN, transport="tcp",
                              trsvcid=front.port, hostnqn=HOSTNQN, hostid=HOSTID, tls=True,
                              keyring=name, keep_alive_tmo=0, nr_io_queues=2) as m:
        data = os.urandom(65536)
        before = front.handshakes
        with File(m.path(1)) as f:
            assert len(f.own_queues) > 0
            assert f.write(np.frombuffer(data, np.uint8).copy(), file_offset=8192) == 65536
        assert bytes(target.data[8192:8192 + 65536]) == data
        assert front.handshakes > before  # the File's own queues shook hands with the PSK
        with open(mnt / ".nvmeof" / "controller") as report:
            controller = report.read()
    assert re.search(rf"\ntls_key_source +: keyring {name}\n", controller), controller
    assert re.search(rf"\ntls_identity +: {re.escape(psk.identity)}\n", controller)
    assert psk.key.hex() not in controller
    assert front.failures == []
