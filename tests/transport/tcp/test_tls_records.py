"""The record layers: kTLS's crypto_info, and the userspace layer against OpenSSL's own
record layer (SSL_read/SSL_write on the far side), byte-exact, and how records end it."""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest

from nvmeof_fuse.nvme import tls_record as rec
from nvmeof_fuse.transport.tcp import tls_handshake as th
from nvmeof_fuse.transport.tcp import tls_records as tr
from nvmeof_fuse.transport.tcp.libssl import Aead

IDENTITY = "NVMe0R01 nqn.host nqn.subsys"
SUITES = [("TLS_AES_128_GCM_SHA256", 32), ("TLS_AES_256_GCM_SHA384", 48)]


def test_crypto_info_is_the_kernels_struct_for_tls_1_3():
    keys = rec.TrafficKeys("TLS_AES_128_GCM_SHA256", bytes(range(16)), bytes(range(100, 112)))
    info = tr.crypto_info(keys)
    assert len(info) == 40  # sizeof(struct tls12_crypto_info_aes_gcm_128)
    assert struct.unpack_from("=HH", info) == (0x0304, 51)
    assert info[4:12] == bytes(range(104, 112))  # iv: the IV's last 8 bytes
    assert info[12:28] == bytes(range(16))  # key
    assert info[28:32] == bytes(range(100, 104))  # salt: its first 4
    assert info[32:] == bytes(8)  # rec_seq
    big = tr.crypto_info(rec.TrafficKeys("TLS_AES_256_GCM_SHA384", bytes(32), bytes(12)))
    assert len(big) == 56 and struct.unpack_from("=HH", big) == (0x0304, 52)


def test_without_ktls_the_socket_is_left_plain():
    if os.path.exists("/sys/module/tls"):
        pytest.skip("this kernel has kTLS (the VM's tests cover it)")
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    secrets = th.Secrets("TLS_AES_128_GCM_SHA256", bytes(32), bytes(32))
    assert tr.install_kernel_tls(a, secrets) is False
    a.sendall(b"plain")
    assert b.recv(5) == b"plain"
    for s in (a, b, listener):
        s.close()


def tls_pair(suite="TLS_AES_128_GCM_SHA256", key_bytes=32):
    """A connected TCP pair after a PSK handshake: (host socket, secrets, target socket,
    the target's OpenSSL connection, still open)."""
    listener = socket.create_server(("127.0.0.1", 0))
    key = os.urandom(key_bytes)
    host = socket.create_connection(listener.getsockname())
    target, _ = listener.accept()
    listener.close()
    host.setblocking(False)
    target.setblocking(False)
    out: dict = {}

    def serve():
        out["conn"] = th.server(target.fileno(), {IDENTITY: key}, suite)
        out["secrets"] = th.handshake_blocking(out["conn"], target.fileno(), 5)

    thread = threading.Thread(target=serve)
    thread.start()
    conn = th.client(host.fileno(), IDENTITY, key, suite)
    secrets = th.handshake_blocking(conn, host.fileno(), 5)
    conn.close()
    thread.join(5)
    target.setblocking(True)
    return host, secrets, target, out["conn"]


def echo_by_openssl(target, conn):
    def run():
        buf = bytearray(1 << 16)
        try:
            while (n := conn.read_into(buf)) > 0:
                conn.write(bytes(buf[:n]))
        finally:
            conn.close()
            target.close()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def receive(sock, count):
    got = bytearray()
    while len(got) < count:
        chunk = sock.recv(count - len(got))
        if not chunk:
            break
        got += chunk
    return bytes(got)


@pytest.mark.parametrize(("suite", "key_bytes"), SUITES)
def test_userspace_records_against_openssls_own(suite, key_bytes):
    host, secrets, target, conn = tls_pair(suite, key_bytes)
    echo_by_openssl(target, conn)
    records = tr.UserspaceRecords(host, secrets)
    local = records.start()
    assert records.layer.describe() == f"tls: userspace ({suite})"
    data = os.urandom(3 << 20)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(receive(local, len(data))))
    reader.start()
    for at in range(0, len(data), 100_000):  # record boundaries apart from the writes'
        local.sendall(data[at:at + 100_000])
    reader.join(30)
    assert got == [data]
    local.close()
    assert records.join(5)
    assert records.problem is None


def sealed(secrets, kind, content, sequence=0):
    """A record the target seals itself (as OpenSSL would after the handshake)."""
    keys = rec.traffic_keys(secrets.server, secrets.suite)
    body = bytearray(content + bytes([kind]) + bytes(rec.TAG_BYTES))
    view = memoryview(body)
    head = rec.header(len(content))
    Aead(keys.key, True).seal(rec.nonce(keys.iv, sequence), head, view[:len(content) + 1], view)
    return head + bytes(body)


@pytest.mark.parametrize(("kind", "content", "line"), [
    (rec.ALERT, b"\x02\x50", "a TLS alert (fatal, internal_error)"),
    (rec.ALERT, b"\x01\x00", "a TLS alert (warning, close_notify)"),
    (rec.HANDSHAKE, b"\x18\x00\x00\x01\x00", "a TLS KeyUpdate after the handshake"),
    (rec.HANDSHAKE, b"\x04\x00\x00\x04" + bytes(4), "a TLS NewSessionTicket after the handshake"),
])
def test_a_record_that_is_not_application_data_ends_the_connection_naming_it(kind, content,
                                                                             line):
    host, secrets, target, conn = tls_pair()
    conn.close()
    records = tr.UserspaceRecords(host, secrets)
    local = records.start()
    target.sendall(sealed(secrets, rec.APPLICATION_DATA, b"before") + sealed(secrets, kind,
                                                                              content, 1))
    assert receive(local, 100) == b"before"  # what came first still arrives, then the end
    assert records.join(5)
    assert records.problem == line
    local.close()
    target.close()


@pytest.mark.parametrize(("wire", "line"), [
    (lambda s: sealed(s, rec.APPLICATION_DATA, b"x", sequence=5),
     "a TLS record failed its authentication (bad_record_mac: another key, or corrupted)"),
    (lambda s: sealed(s, rec.APPLICATION_DATA, b"xyz")[:12],
     "the target closed the connection in the middle of a TLS record"),
    (lambda s: b"\x15\x03\x03\x00\x02\x02\x28",
     "an unprotected TLS record (an alert) after the handshake"),
])
def test_a_broken_stream_ends_the_connection_in_one_line(wire, line):
    host, secrets, target, conn = tls_pair()
    conn.close()
    records = tr.UserspaceRecords(host, secrets)
    local = records.start()
    target.sendall(wire(secrets))
    target.shutdown(socket.SHUT_WR)
    assert receive(local, 10) == b""
    assert records.join(5)
    assert records.problem == line
    local.close()
    target.close()


def test_the_threads_end_when_the_queue_closes_its_end():
    host, secrets, target, conn = tls_pair()
    conn.close()
    records = tr.UserspaceRecords(host, secrets)
    records.start().close()
    assert records.join(5)
    assert records.problem is None
    assert target.recv(10) == b""  # the TCP connection is closed too
    target.close()


def test_a_target_that_stops_reading_holds_no_thread_once_the_queue_closes(monkeypatch):
    monkeypatch.setattr(tr, "SEND_POLL", 0.2)
    host, secrets, target, conn = tls_pair()
    conn.close()
    records = tr.UserspaceRecords(host, secrets)
    local = records.start()
    local.setblocking(False)
    sent = 0
    try:  # fill every buffer on the way: the target never reads
        while sent < 256 << 20:
            sent += local.send(bytes(1 << 20))
    except BlockingIOError:
        pass
    local.close()
    assert records.join(10)
    assert records.problem is None
    target.close()
