"""NVMe/TCP over TLS with the records in the kernel (kTLS), in the VM (its 6.12 kernel has
CONFIG_TLS=m; the development hosts have no kTLS at all).

The target is our fake NVMe/TCP target behind a TLS front of OpenSSL's own server side and
record layer (tests/tls_front.py), run inside the VM: so what this proves is our kTLS setup
(the crypto_info we hand the kernel, sequence numbers, what the kernel does with a record that
is not application data) against OpenSSL, and the faults nvmet cannot be made to commit;
nvmet's own TLS port (tlshd) is test_tls_mount.py's.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading

import pytest
import trio
from tcp_target import LBA, NQN, FakeTcpTarget
from tls_front import TlsFront

from nvmeof_fuse.errors import TransportError
from nvmeof_fuse.host.memory import host_buffer
from nvmeof_fuse.nvme import command as cmd
from nvmeof_fuse.nvme import tls_psk
from nvmeof_fuse.nvme.sgl import NULL_SGL
from nvmeof_fuse.transport.tcp import tls_handshake as th
from nvmeof_fuse.transport.tcp import tls_records as tr
from nvmeof_fuse.transport.tcp.transport import TcpTransport

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000715a"
HANG_GUARD = 240  # s: TCG runs Python about 10x slower than the host


@pytest.fixture(scope="module", autouse=True)
def ktls():
    subprocess.run(["modprobe", "tls"], check=True, timeout=60)
    assert os.path.exists("/sys/module/tls")


@pytest.mark.parametrize("hash_id", [1, 2], ids=["sha256", "sha384"])
def test_ktls_sockets_talk_to_openssls_record_layer(hash_id):
    """The kernel seals and opens with the keys we hand it: an echo through OpenSSL's
    SSL_read/SSL_write comes back byte-exact over plain send/recv on the kTLS socket."""
    suite = tls_psk.CIPHER_SUITES[tls_psk.PskHash(hash_id)]
    key, identity = os.urandom(32 if hash_id == 1 else 48), f"NVMe0R0{hash_id} h s"
    listener = socket.create_server(("127.0.0.1", 0))
    host = socket.create_connection(listener.getsockname())
    target, _ = listener.accept()
    host.setblocking(False)
    target.setblocking(False)
    server = th.server(target.fileno(), {identity: key}, suite)
    done = threading.Event()

    def echo():
        th.handshake_blocking(server, target.fileno(), 60)
        target.setblocking(True)
        buf = bytearray(1 << 16)
        while (n := server.read_into(buf)) > 0:
            server.write(bytes(buf[:n]))
        done.set()

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    conn = th.client(host.fileno(), identity, key, suite)
    secrets = th.handshake_blocking(conn, host.fileno(), 60)
    conn.close()
    host.setblocking(True)
    assert tr.install_kernel_tls(host, secrets)
    data = os.urandom(1 << 20)
    got = bytearray()
    reader = threading.Thread(target=lambda: got.extend(_receive(host, len(data))))
    reader.start()
    host.sendall(data)
    reader.join(HANG_GUARD)
    assert bytes(got) == data
    host.close()
    assert done.wait(60)


def _receive(sock, count):
    out = bytearray()
    while len(out) < count:
        chunk = sock.recv(min(1 << 20, count - len(out)))
        if not chunk:
            break
        out += chunk
    return out


def run(test, psk):
    async def main():
        target = FakeTcpTarget(size=4 << 20, maxh2cdata=1 << 20, mdts=0)
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(target.serve)
                with TlsFront(port, {psk.identity: psk.key}, psk.suite) as front:
                    transport = TcpTransport("127.0.0.1", front.port, connect_timeout=60,
                                             tls=psk, kernel_tls=True)
                    try:
                        await test(target, front, transport, nursery)
                    finally:
                        await transport.drop_queues()
                        transport.close()
                        nursery.cancel_scope.cancel()

    trio.run(main)


async def write(queue, transport, slba, data):
    buf = host_buffer(transport.register, len(data))
    buf.view[:] = data
    return await queue.execute(cmd.write(1, slba, len(data) // LBA, NULL_SGL), buf.ref(),
                               to_controller=True, timeout=60)


async def read(queue, transport, slba, length):
    buf = host_buffer(transport.register, length)
    completion = await queue.execute(cmd.read(1, slba, length // LBA, NULL_SGL), buf.ref(),
                                     timeout=60)
    return bytes(buf.view), completion


@pytest.mark.parametrize("hash_id", [1, 2], ids=["sha256", "sha384"])
def test_a_queue_over_ktls_is_byte_exact(hash_id):
    configured = tls_psk.ConfiguredPsk(os.urandom(32 if hash_id == 1 else 48), hash_id)
    psk = tls_psk.derive(configured, HOSTNQN, NQN)
    rng = random.Random(5)

    async def test(target, front, transport, nursery):
        queue = await transport.connect_queue(nursery, 1, 32, in_capsule_bytes=4096)
        assert transport.record_layer.describe() == f"tls: kernel ({psk.suite})"
        small, large = rng.randbytes(4096), rng.randbytes(1 << 20)
        assert (await write(queue, transport, 0, small)).ok
        assert (await write(queue, transport, 64, large)).ok
        assert target.data[:4096] == small and target.data[64 * LBA:][:1 << 20] == large
        got, completion = await read(queue, transport, 64, 1 << 20)
        assert completion.ok and got == large
        results = {}
        async with trio.open_nursery() as many:
            async def one(i):
                results[i] = await read(queue, transport, 64 + i * 8, 4096)

            for i in range(8):
                many.start_soon(one, i)
        assert all(results[i][0] == large[i * 4096:(i + 1) * 4096] for i in range(8))

    run(test, psk)


def test_an_alert_over_ktls_fails_the_queue_naming_it():
    psk = tls_psk.derive(tls_psk.ConfiguredPsk(os.urandom(32), 1), HOSTNQN, NQN)

    async def test(target, front, transport, nursery):
        queue = await transport.connect_queue(nursery, 1, 32)
        assert (await read(queue, transport, 0, 4096))[1].ok
        front.close_notify_all()
        with pytest.raises(TransportError) as info:
            with trio.fail_after(120):
                while True:
                    await read(queue, transport, 0, 4096)
                    await trio.sleep(0.05)
        assert str(info.value).endswith("ended: a TLS alert (warning, close_notify)"), \
            str(info.value)

    run(test, psk)


def test_the_real_target_through_a_tls_front_agrees_with_the_kernel_initiator(testbed,
                                                                              tmp_path):
    """Our initiator with the records in the kernel, through a TLS front (OpenSSL's) to
    nvmet's plain NVMe/TCP port (OpenSSL's record layer, not tlshd's): what it
    writes the kernel initiator (plain NVMe/TCP) reads back, and the other way."""
    from kernel_initiator import connected, pread_direct, pwrite_direct

    from nvmeof_fuse.host.controller import ConnectOptions, connect

    key = os.urandom(48)
    psk = tls_psk.derive(tls_psk.ConfiguredPsk(key, 2), HOSTNQN, testbed.nqn)
    key_path = tmp_path / "tls.key"
    key_path.write_text(tls_psk.format_interchange(key, 2))
    key_path.chmod(0o600)
    rng = random.Random(11)
    with TlsFront(testbed.port, {psk.identity: psk.key}, psk.suite,
                  backend_host=testbed.tcp_addr) as front, \
            connected("tcp", testbed.tcp_addr, testbed.port, testbed.nqn) as kernel:
        options = ConnectOptions(traddr="127.0.0.1", nqn=testbed.nqn, transport="tcp",
                                 trsvcid=front.port, hostnqn=HOSTNQN, tls_key=str(key_path),
                                 keep_alive_tmo=0, nr_io_queues=1, companion_queues=0)

        async def main():
            with trio.fail_after(HANG_GUARD):
                async with connect(options) as ctrl:
                    assert ctrl.connection_snapshot()["tls"] == f"kernel ({psk.suite})"
                    ns = ctrl.namespaces[1]
                    for nlb in (1, 2048):
                        slba = rng.randrange(0, ns.nlb - nlb)
                        data = rng.randbytes(nlb * ns.lba_size)
                        await ns.write_lbas(slba, data)
                        got = await trio.to_thread.run_sync(
                            pread_direct, kernel[1], slba * ns.lba_size, len(data))
                        assert got == data, f"the kernel read differs at {slba}+{nlb}"
                        data = rng.randbytes(nlb * ns.lba_size)
                        await trio.to_thread.run_sync(
                            pwrite_direct, kernel[1], slba * ns.lba_size, data)
                        assert await ns.read_lbas(slba, nlb) == data, f"{slba}+{nlb}"

        trio.run(main)
        assert front.handshakes >= 2 and front.failures == []


@pytest.mark.parametrize("version", [0, 1])
def test_a_psk_we_insert_into_the_kernels_keyring_is_what_tls_takes_from_it(version):
    """``check-tls-key --insert`` loads a ``psk`` key into nvme-keyring.ko's ``.nvme``; a
    connection with ``--tls`` and no key finds it there (under the kernel's default identity,
    or ``--tls-key-identity`` for version 1) and shakes hands with it over kTLS."""
    from nvmeof_fuse.host.controller import ConnectOptions

    subprocess.run(["modprobe", "nvme-keyring"], check=True, timeout=60)
    key = tls_psk.format_interchange(os.urandom(32), 1)
    derived = tls_psk.derive(tls_psk.parse_interchange(key), HOSTNQN, NQN, version=version)
    out = subprocess.run([sys.executable, "-m", "nvmeof_fuse.cli", "check-tls-key", "-d", key,
                          "-n", HOSTNQN, "-c", NQN, "-I", str(version), "-i"],
                         capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0, out.stderr
    serial = out.stdout.splitlines()[1].removeprefix("Inserted TLS key ")
    with open("/proc/keys") as f:
        line = next(li for li in f if li.startswith(serial))
    assert f" psk       {derived.identity}: 32" in line
    options = ConnectOptions(traddr="127.0.0.1", nqn=NQN, transport="tcp", tls=True,
                             hostnqn=HOSTNQN, tls_key_identity=derived.identity if version
                             else None)
    options.validate()
    psk = options.tls_psk(HOSTNQN)
    assert psk == derived

    async def test(target, front, transport, nursery):
        queue = await transport.connect_queue(nursery, 1, 32, in_capsule_bytes=4096)
        data = os.urandom(8192)
        assert (await write(queue, transport, 8, data)).ok
        got, completion = await read(queue, transport, 8, 8192)
        assert completion.ok and got == data

    run(test, psk)
