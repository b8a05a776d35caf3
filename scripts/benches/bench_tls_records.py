"""The userspace TLS record layer on this host: MB/s, and MB per CPU second, beside plain TCP
and OpenSSL's own AES-GCM in the same run.

  python scripts/benches/bench_tls_records.py [--seconds 3] [--suites 128,256]

Where the kernel has no kTLS (the development hosts), each NVMe/TCP connection over TLS seals
and opens its records in userspace (``UserspaceRecords``: two threads per connection,
libcrypto's AES-GCM).  Here both ends of one loopback connection live in this process: our
handshake (OpenSSL's), then the client's record layer seals what a writer thread pours into
its queue socket (1 MiB writes) and the server's opens it for a reader thread.  So the CPU
figure is one seal and one open of every byte, plus the moving.  Peers in the same run: the
same writer and reader over plain loopback TCP (no records), and ``openssl speed -evp
aes-N-gcm`` on one core (16 KiB blocks: the cipher's own ceiling, sealing only).  Figures are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import MIB, text_grid  # noqa: E402

from nvmeof_fuse.procstat import cpu_seconds  # noqa: E402
from nvmeof_fuse.transport.tcp import tls_handshake as th  # noqa: E402
from nvmeof_fuse.transport.tcp.tls_records import UserspaceRecords  # noqa: E402

SUITES = {"128": "TLS_AES_128_GCM_SHA256", "256": "TLS_AES_256_GCM_SHA384"}
CHUNK = MIB
HANDSHAKE_TIMEOUT = 30.0


@dataclass
class Figure:
    name: str
    mb_per_s: float
    cpu_per_gb: float | None
    """Seconds of CPU (the whole process) per GB moved; None for openssl speed."""

    def row(self) -> list[str]:
        per_core = 1000 / self.cpu_per_gb if self.cpu_per_gb else self.mb_per_s
        cpu = f"{self.cpu_per_gb:.2f}" if self.cpu_per_gb is not None else "n/a (1 core)"
        return [self.name, f"{self.mb_per_s:,.0f}", cpu, f"{per_core:,.0f}"]


def loopback_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def pump(sender: socket.socket, receiver: socket.socket, seconds: float) -> tuple[int, float]:
    """Bytes moved from ``sender`` to ``receiver`` in about ``seconds``, and the wall time."""
    payload = os.urandom(CHUNK)
    received = [0]
    stop = threading.Event()

    def read() -> None:
        buf = bytearray(CHUNK)
        while (n := receiver.recv_into(buf)) > 0:
            received[0] += n

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    start = time.monotonic()
    sent = 0
    while time.monotonic() - start < seconds and not stop.is_set():
        sender.sendall(payload)
        sent += CHUNK
    sender.shutdown(socket.SHUT_WR)
    reader.join(seconds + 60)
    return received[0], time.monotonic() - start


def measure(name: str, sender: socket.socket, receiver: socket.socket,
            seconds: float) -> Figure:
    before = cpu_seconds(os.getpid())
    moved, wall = pump(sender, receiver, seconds)
    cpu = cpu_seconds(os.getpid()) - before
    return Figure(name, moved / wall / 1e6, cpu / (moved / 1e9))


def plain(seconds: float) -> Figure:
    client, server = loopback_pair()
    try:
        return measure("plain TCP (loopback)", client, server, seconds)
    finally:
        client.close()
        server.close()


def userspace_tls(suite: str, seconds: float) -> Figure:
    key, identity = os.urandom(32 if "128" in suite else 48), "NVMe0R01 bench-host bench-sub"
    client, server = loopback_pair()
    for end in (client, server):
        end.setblocking(False)
    theirs = th.server(server.fileno(), {identity: key}, suite)
    done: list[th.Secrets] = []
    shaker = threading.Thread(target=lambda: done.append(
        th.handshake_blocking(theirs, server.fileno(), HANDSHAKE_TIMEOUT)), daemon=True)
    shaker.start()
    ours = th.client(client.fileno(), identity, key, suite)
    secrets = th.handshake_blocking(ours, client.fileno(), HANDSHAKE_TIMEOUT)
    shaker.join(HANDSHAKE_TIMEOUT)
    if not done:
        raise SystemExit("the server side's handshake did not finish")
    sealing = UserspaceRecords(client, secrets, client=True)
    opening = UserspaceRecords(server, done[0], client=False)
    sender, receiver = sealing.start(), opening.start()
    try:
        return measure(f"userspace records, {suite}", sender, receiver, seconds)
    finally:
        sender.close()
        receiver.close()
        sealing.join(10)
        opening.join(10)


def openssl_speed(suite: str, seconds: float) -> Figure | None:
    cipher = "aes-128-gcm" if "128" in suite else "aes-256-gcm"
    try:
        out = subprocess.run(["openssl", "speed", "-evp", cipher, "-bytes", "16384",
                              "-seconds", str(max(1, round(seconds)))],
                             capture_output=True, text=True, timeout=seconds + 60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^\S+\s+([\d.]+)k\s*$", out.stdout, re.MULTILINE)
    if out.returncode != 0 or match is None:
        return None
    return Figure(f"openssl speed -evp {cipher} (16 KiB)", float(match.group(1)) * 1000 / 1e6,
                  None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--suites", default="128,256",
                        help="AES key sizes to run: 128 (TLS_AES_128_GCM_SHA256), 256")
    args = parser.parse_args(argv)
    sizes = args.suites.split(",")
    for size in sizes:
        if size not in SUITES:
            parser.error(f"--suites {size!r} is not 128 or 256")
    figures = [plain(args.seconds)]
    for size in sizes:
        figures.append(userspace_tls(SUITES[size], args.seconds))
        speed = openssl_speed(SUITES[size], args.seconds)
        if speed is not None:
            figures.append(speed)
    print(f"{os.cpu_count()} CPUs, {args.seconds:g} s each, 1 MiB writes, one loopback "
          "connection; CPU is this whole process's (seal + open + moving)")
    for line in text_grid(["path", "MB/s", "CPU s per GB", "MB per CPU s"],
                          [f.row() for f in figures]):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
