"""The TLS 1.3 handshake with an external PSK, by OpenSSL, both sides, and how it fails."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import trio

from nvmeof_fuse.transport.tcp import tls_handshake as th

IDENTITY = "NVMe0R01 nqn.2014-08.org.nvmexpress:uuid:host nqn.2026-12.io.test:subsys"
SUITES = [("TLS_AES_128_GCM_SHA256", 32), ("TLS_AES_256_GCM_SHA384", 48)]


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def serve_in_thread(sock, keys, suite, results):
    def run():
        conn = th.server(sock.fileno(), keys, suite)
        try:
            results["server"] = th.handshake_blocking(conn, sock.fileno(), 5)
        except th.HandshakeError as exc:
            results["server"] = exc
        finally:
            conn.close()
            sock.close()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(("suite", "key_bytes"), SUITES)
def test_both_sides_agree_on_the_traffic_secrets(suite, key_bytes):
    key = os.urandom(key_bytes)
    a, b = pair()
    results: dict = {}
    thread = serve_in_thread(b, {IDENTITY: key}, suite, results)
    conn = th.client(a.fileno(), IDENTITY, key, suite)
    try:
        secrets = th.handshake_blocking(conn, a.fileno(), 5)
    finally:
        conn.close()
    thread.join(5)
    assert secrets == results["server"]
    assert secrets.suite == suite and len(secrets.client) == key_bytes
    assert secrets.client != secrets.server
    assert key.hex()[:16] not in repr(secrets)


def test_the_handshake_runs_on_trio_under_the_callers_deadline():
    key = os.urandom(32)
    a, b = pair()
    results: dict = {}
    thread = serve_in_thread(b, {IDENTITY: key}, "TLS_AES_128_GCM_SHA256", results)

    async def main():
        sock = trio.socket.from_stdlib_socket(a)
        with trio.fail_after(5):
            return await th.handshake(th.client(sock.fileno(), IDENTITY, key,
                                                "TLS_AES_128_GCM_SHA256"), sock)

    secrets = trio.run(main)
    thread.join(5)
    assert secrets == results["server"]


def client_error(server_keys, client_key, suite="TLS_AES_128_GCM_SHA256"):
    a, b = pair()
    results: dict = {}
    thread = serve_in_thread(b, server_keys, suite, results)
    conn = th.client(a.fileno(), IDENTITY, client_key, suite)
    with pytest.raises(th.HandshakeError) as info:
        try:
            th.handshake_blocking(conn, a.fileno(), 5)
        finally:
            conn.close()
            a.close()
    thread.join(5)
    assert "\n" not in str(info.value)
    return str(info.value), results["server"]


def test_a_wrong_key_is_refused():
    line, server = client_error({IDENTITY: os.urandom(32)}, os.urandom(32))
    assert line == "the TLS handshake failed: sslv3 alert illegal parameter"  # a bad binder
    assert isinstance(server, th.HandshakeError)


def test_an_identity_the_target_lacks_is_refused():
    key = os.urandom(32)
    line, _ = client_error({"NVMe0R01 another identity": key}, key)
    assert line == "the TLS handshake failed: sslv3 alert handshake failure"


def test_a_peer_that_does_not_speak_tls():
    a, b = pair()
    conn = th.client(a.fileno(), IDENTITY, bytes(32), "TLS_AES_128_GCM_SHA256")
    b.setblocking(True)
    b.send(b"\x01\x00\x80\x00\x80\x00\x00\x00" + bytes(120))  # an ICResp
    with pytest.raises(th.HandshakeError, match="wrong version number|packet length"):
        th.handshake_blocking(conn, a.fileno(), 5)
    conn.close()


def test_a_peer_that_closes():
    a, b = pair()
    conn = th.client(a.fileno(), IDENTITY, bytes(32), "TLS_AES_128_GCM_SHA256")
    b.close()
    with pytest.raises(th.HandshakeError, match="closed the connection during the TLS "
                                                "handshake"):
        th.handshake_blocking(conn, a.fileno(), 5)
    conn.close()


def test_a_peer_that_reads_the_client_hello_and_closes():
    """nvmet's way to refuse a PSK (tlshd's handshake fails, the kernel closes the socket,
    no alert): OpenSSL 3 calls it an unexpected EOF; the line says the peer closed."""
    a, b = pair()
    conn = th.client(a.fileno(), IDENTITY, bytes(32), "TLS_AES_128_GCM_SHA256")

    def peer():
        b.setblocking(True)
        b.recv(1 << 16)
        b.close()

    thread = threading.Thread(target=peer)
    thread.start()
    with pytest.raises(th.HandshakeError) as info:
        th.handshake_blocking(conn, a.fileno(), 5)
    thread.join()
    assert str(info.value) == "the peer closed the connection during the TLS handshake"
    conn.close()


def test_a_stalled_handshake_is_bounded():
    a, b = pair()
    conn = th.client(a.fileno(), IDENTITY, bytes(32), "TLS_AES_128_GCM_SHA256")
    with pytest.raises(th.HandshakeError, match="no TLS handshake within 0.2 s"):
        th.handshake_blocking(conn, a.fileno(), 0.2)
    conn.close()
    b.close()


def test_a_server_that_answers_without_the_psk_is_refused(monkeypatch):
    """Only the PSK authenticates the target: a handshake it finished without taking it
    (a certificate, which no client here trusts) is refused, as is another version."""
    conn = th.client(-1, IDENTITY, bytes(32), "TLS_AES_128_GCM_SHA256")
    lib = conn._ssl_lib

    class Lib:
        def __getattr__(self, name):
            return getattr(lib, name)

        @staticmethod
        def SSL_version(ssl):  # noqa: N802 - OpenSSL's name
            return 0x0304

        @staticmethod
        def SSL_session_reused(ssl):  # noqa: N802
            return 0

    conn._ssl_lib = Lib()
    with pytest.raises(th.HandshakeError, match="the peer did not take the PSK"):
        conn.secrets()
    conn._ssl_lib = lib
    conn.close()
