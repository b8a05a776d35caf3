"""MB/s per core of the userspace TLS record layer beside plain TCP, on the host (no VM).

  .venv/bin/python tests/transport/tcp/bench_tls_records.py [--mib 512]

Over loopback, each way: this process sends (or receives) ``--mib`` MiB through a plain TCP
socket, then through :class:`~nvmeof_fuse.transport.tcp.tls_records.UserspaceRecords` after
a real PSK handshake.  The peer is a child process (it seals or just reads, on its own
CPU), so the CPU seconds counted (``os.times`` of this process: all its threads, user and
system) are our side's only.  Prints MB/s of wall time and MB/s per CPU second.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import time

from nvmeof_fuse.nvme import tls_record as rec
from nvmeof_fuse.transport.tcp import tls_handshake as th
from nvmeof_fuse.transport.tcp.libssl import Aead
from nvmeof_fuse.transport.tcp.tls_records import UserspaceRecords

IDENTITY = "NVMe0R01 bench host bench subsys"
SUITE = "TLS_AES_128_GCM_SHA256"
CHUNK = 1 << 20


def _peer(port: int, key: bytes, tls: bool, send: int) -> None:
    """The child: accept one connection (after a handshake when ``tls``), then read all it
    gets, or send ``send`` bytes (sealed into records when ``tls``)."""
    listener = socket.create_server(("127.0.0.1", port))
    conn, _ = listener.accept()
    secrets = None
    if tls:
        conn.setblocking(False)
        ssl = th.server(conn.fileno(), {IDENTITY: key}, SUITE)
        secrets = th.handshake_blocking(ssl, conn.fileno(), 10)
        ssl.close()
        conn.setblocking(True)
    if not send:
        buf = bytearray(CHUNK)
        while conn.recv_into(buf):
            pass
        return
    payload = os.urandom(CHUNK)
    if not tls:
        for _ in range(send // CHUNK):
            conn.sendall(payload)
        conn.close()
        return
    keys = rec.traffic_keys(secrets.server, SUITE)
    aead = Aead(keys.key, True)
    size = rec.MAX_PLAINTEXT
    out = bytearray((rec.HEADER_BYTES + size + 1 + rec.TAG_BYTES) * (CHUNK // size))
    view = memoryview(out)
    sequence = 0
    for _ in range(send // CHUNK):
        at = 0
        for i in range(CHUNK // size):
            head = rec.header(size)
            view[at:at + 5] = head
            view[at + 5:at + 5 + size] = payload[i * size:(i + 1) * size]
            out[at + 5 + size] = rec.APPLICATION_DATA
            aead.seal(rec.nonce(keys.iv, sequence), head, view[at + 5:at + 6 + size],
                      view[at + 5:at + 6 + size + 16])
            sequence += 1
            at += 5 + size + 1 + 16
        conn.sendall(view[:at])
    conn.close()


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def measure(total: int, tls: bool, sending: bool) -> tuple[float, float]:
    """(MB/s of wall time, MB/s per CPU second of this process)."""
    key = os.urandom(32)
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    child = multiprocessing.Process(target=_peer, args=(port, key, tls,
                                                         0 if sending else total))
    child.start()
    for _ in range(100):
        try:
            sock = socket.create_connection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    records = None
    if tls:
        sock.setblocking(False)
        ssl = th.client(sock.fileno(), IDENTITY, key, SUITE)
        secrets = th.handshake_blocking(ssl, sock.fileno(), 10)
        ssl.close()
        records = UserspaceRecords(sock, secrets)
        sock = records.start()
    payload = os.urandom(CHUNK)
    buf = bytearray(CHUNK)
    start, cpu = time.perf_counter(), _cpu()
    if sending:
        for _ in range(total // CHUNK):
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv_into(buf):
            pass
    else:
        got = 0
        while got < total:
            n = sock.recv_into(buf, 0, socket.MSG_WAITALL)
            if not n:
                break
            got += n
        assert got == total, got
    wall, used = time.perf_counter() - start, _cpu() - cpu
    sock.close()
    if records is not None:
        records.join(10)
    child.join(10)
    return total / wall / 1e6, total / used / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    args = parser.parse_args()
    total = args.mib * CHUNK
    print(f"{args.mib} MiB each way, {SUITE}, loopback; our process's CPU only")
    for sending in (True, False):
        for tls in (False, True):
            wall, per_core = measure(total, tls, sending)
            what = ("userspace TLS" if tls else "plain TCP").ljust(13)
            print(f"{'send' if sending else 'recv'} {what}: {wall:8.0f} MB/s wall, "
                  f"{per_core:8.0f} MB/s per CPU second")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
