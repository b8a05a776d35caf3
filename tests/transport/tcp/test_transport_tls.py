"""NVMe/TCP over TLS 1.3 against the fake target behind a TLS front of its own (OpenSSL's
server side and record layer: tests/tls_front.py): byte-exact I/O over our userspace
record layer, and each way it fails, in one line within a bound."""

from __future__ import annotations

import os
import random
import re
import socket

import pytest
import trio
from tcp_target import LBA, FakeTcpTarget
from tls_front import TlsFront

from nvmeof_fuse.errors import ConnectError, InvalidArgument, KeyRejected, TransportError
from nvmeof_fuse.nvme import tls_psk
from nvmeof_fuse.transport.tcp.transport import TcpTransport

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
SUBNQN = "nqn.2026-11.io.nvmeof-fuse:fake-tcp"
HANG_GUARD = 30
SUITES = {tls_psk.PskHash.SHA256: 32, tls_psk.PskHash.SHA384: 48}


def psk(hash_id=tls_psk.PskHash.SHA256, key=None):
    configured = tls_psk.ConfiguredPsk(key or os.urandom(SUITES[hash_id]), hash_id)
    return tls_psk.derive(configured, HOSTNQN, SUBNQN)


def run(test, *, host_psk, front_psk=None, stall=False, front=True, connect_timeout=5.0,
        kernel_tls=None, **target_kw):
    """``test(target, front, transport, nursery)`` with the fake target behind a TLS front
    that holds ``front_psk`` (the host's unless told)."""
    front_psk = front_psk or host_psk

    async def main():
        target = FakeTcpTarget(**target_kw)
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(target.serve)
                with TlsFront(port, {front_psk.identity: front_psk.key}, front_psk.suite,
                              stall=stall) as tls_front:
                    transport = TcpTransport("127.0.0.1", tls_front.port if front else port,
                                             connect_timeout=connect_timeout, tls=host_psk,
                                             kernel_tls=kernel_tls)
                    try:
                        await test(target, tls_front, transport, nursery)
                    finally:
                        await transport.drop_queues()
                        transport.close()
                        nursery.cancel_scope.cancel()

    trio.run(main)


async def write(queue, transport, slba, data):
    from nvmeof_fuse.host.memory import host_buffer
    from nvmeof_fuse.nvme import command as cmd
    from nvmeof_fuse.nvme.sgl import NULL_SGL
    buf = host_buffer(transport.register, len(data))
    buf.view[:] = data
    return await queue.execute(cmd.write(1, slba, len(data) // LBA, NULL_SGL), buf.ref(),
                               to_controller=True, timeout=10)


async def read(queue, transport, slba, length):
    from nvmeof_fuse.host.memory import host_buffer
    from nvmeof_fuse.nvme import command as cmd
    from nvmeof_fuse.nvme.sgl import NULL_SGL
    buf = host_buffer(transport.register, length)
    completion = await queue.execute(cmd.read(1, slba, length // LBA, NULL_SGL), buf.ref(),
                                     timeout=10)
    return bytes(buf.view), completion


@pytest.mark.parametrize("hash_id", list(SUITES), ids=["sha256", "sha384"])
def test_reads_and_writes_over_tls_are_byte_exact(hash_id):
    rng = random.Random(7)
    host_psk = psk(hash_id)

    async def test(target, front, transport, nursery):
        queue = await transport.connect_queue(nursery, 1, 32, in_capsule_bytes=4096)
        assert transport.record_layer.describe() == f"tls: userspace ({host_psk.suite})"
        small, large = rng.randbytes(4096), rng.randbytes(1 << 20)
        assert (await write(queue, transport, 0, small)).ok
        assert (await write(queue, transport, 64, large)).ok  # R2T, bulk H2CData
        assert target.data[:4096] == small and target.data[64 * LBA:][:1 << 20] == large
        got, completion = await read(queue, transport, 64, 1 << 20)  # bulk C2HData
        assert completion.ok and got == large
        async with trio.open_nursery() as many:  # pipelined, through the one connection
            results = {}

            async def one(i):
                results[i] = await read(queue, transport, 64 + i * 8, 4096)

            for i in range(16):
                many.start_soon(one, i)
        assert all(results[i][0] == large[i * 4096:(i + 1) * 4096] for i in range(16))
        assert front.handshakes == 1 and target.icreqs  # the ICReq came through TLS

    run(test, host_psk=host_psk, size=4 << 20, maxh2cdata=1 << 20, mdts=0)


def one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_wrong_key_is_refused_in_one_line():
    host_psk = psk()
    front_psk = tls_psk.TlsPsk(host_psk.identity, os.urandom(32), host_psk.cipher)

    async def test(target, front, transport, nursery):
        with pytest.raises(KeyRejected) as info:  # final: reconnecting stops on it
            await transport.connect_queue(nursery, 0, 32)
        assert one_line(info) == (
            f"NVMe/TCP admin queue: the TLS handshake failed: sslv3 alert illegal parameter "
            f"with 127.0.0.1:{front.port} (the target refused the PSK: does it hold "
            f"the same PSK for identity '{host_psk.identity}'?)")
        assert not target.icreqs

    run(test, host_psk=host_psk, front_psk=front_psk)


def test_an_identity_the_target_lacks_is_refused_in_one_line():
    host_psk = psk()
    other = tls_psk.derive(tls_psk.ConfiguredPsk(os.urandom(32), 1), HOSTNQN, "nqn.other")

    async def test(target, front, transport, nursery):
        with pytest.raises(KeyRejected, match=r"sslv3 alert handshake failure with .* "
                                              r"\(the target refused the PSK") as info:
            await transport.connect_queue(nursery, 0, 32)
        one_line(info)

    run(test, host_psk=host_psk, front_psk=other)


def test_a_target_without_tls_asked_for_tls():
    async def test(target, front, transport, nursery):
        with pytest.raises(ConnectError) as info:
            await transport.connect_queue(nursery, 0, 32)
        assert not isinstance(info.value, KeyRejected)  # not the key's fault: tried again
        # The fake target answers the ClientHello's first bytes with an ICResp, or closes
        # first: either way one line that says the port may not take TLS.
        assert re.fullmatch(r"NVMe/TCP admin queue: (the peer closed the connection during the "
                            r"TLS handshake with 127.0.0.1:\d+ \(does the port take TLS, and a "
                            r"PSK for identity '.*'\?\)|the TLS handshake failed: wrong version "
                            r"number with 127.0.0.1:\d+ \(the port does not speak TLS: leave out "
                            r"--tls\))", one_line(info))

    run(test, host_psk=psk(), front=False)


def test_a_tls_only_target_asked_without_tls():
    async def test(target, front, transport, nursery):
        transport.tls = None
        with pytest.raises(ConnectError) as info:
            await transport.connect_queue(nursery, 0, 32)
        # Its alert, or a reset (OpenSSL closes with our ICReq unread): one line either way.
        assert re.fullmatch(
            r"NVMe/TCP admin queue: 127.0.0.1:\d+ (closed the connection before its ICResp|"
            r"failed during ICReq/ICResp: Connection reset by peer) \((it answered with a TLS "
            r"alert: the port requires TLS|a port that requires TLS closes so): --tls "
            r"--tls-key\)", one_line(info))
        with trio.fail_after(5):  # the front's thread notes it as it closes
            while not front.failures:
                await trio.sleep(0.01)
        assert front.failures == ["the TLS handshake failed: wrong version number"]

    run(test, host_psk=psk())


def test_a_stalled_handshake_is_bounded():
    async def test(target, front, transport, nursery):
        with pytest.raises(ConnectError) as info:
            await transport.connect_queue(nursery, 0, 32)
        assert one_line(info) == (f"NVMe/TCP admin queue: no TLS handshake with "
                                  f"127.0.0.1:{front.port} within 0.5 s (is it a TLS port?)")

    run(test, host_psk=psk(), stall=True, connect_timeout=0.5)


def test_an_alert_mid_stream_fails_the_queue_naming_it():
    async def test(target, front, transport, nursery):
        queue = await transport.connect_queue(nursery, 1, 32)
        assert (await read(queue, transport, 0, 4096))[1].ok
        front.close_notify_all()
        with pytest.raises(TransportError) as info:
            with trio.fail_after(10):
                while True:
                    await read(queue, transport, 0, 4096)
                    await trio.sleep(0.01)
        assert re.fullmatch(r"I/O queue 1: the TLS connection to 127.0.0.1:\d+ ended: a TLS "
                            r"alert \(warning, close_notify\)", one_line(info))

    run(test, host_psk=psk())


def test_kernel_tls_asked_for_where_the_kernel_has_none():
    if os.path.exists("/sys/module/tls"):
        pytest.skip("this kernel has kTLS")

    async def test(target, front, transport, nursery):
        with pytest.raises(ConnectError, match="kernel TLS was asked for, but this kernel "
                                               r"has none \(modprobe tls\)"):
            await transport.connect_queue(nursery, 0, 32)

    run(test, host_psk=psk(), kernel_tls=True)


def test_each_connection_has_its_own_handshake():
    async def test(target, front, transport, nursery):
        await transport.connect_queue(nursery, 0, 32)
        await transport.connect_queue(nursery, 1, 32)
        await transport.drop_queues()
        await transport.connect_queue(nursery, 1, 32)  # a reconnect: a fresh handshake
        assert front.handshakes == 3

    run(test, host_psk=psk())


def test_the_key_is_taken_anew_for_each_connection():
    """A key rotated in its file is used from the next connection (reconnect) on; one that
    cannot be read any more fails that connection in one line."""
    old, new = psk(), psk()
    given = [old, new]

    def current():
        if not given:
            raise InvalidArgument("--tls-key file /etc/nvme/tls.key: No such file or directory")
        return given.pop(0)

    async def test(target, front, transport, nursery):
        transport.tls = current
        with pytest.raises(ConnectError, match="refused the PSK"):
            await transport.connect_queue(nursery, 0, 32)  # the old key: the front has the new
        await transport.connect_queue(nursery, 0, 32)  # rotated: taken
        with pytest.raises(ConnectError) as info:
            await transport.connect_queue(nursery, 1, 32)
        assert one_line(info) == ("NVMe/TCP I/O queue 1: --tls-key file /etc/nvme/tls.key: No "
                                  "such file or directory")

    run(test, host_psk=old, front_psk=new)


def test_a_tls_port_whose_target_is_down_closes_after_the_handshake_in_one_line():
    """A TLS terminator in front of a target that is away (the VM's outage under a mount
    through the front): the handshake is taken, then the connection closes before its
    ICResp; the connect fails in one line and the next one shakes hands anew."""
    host_psk = psk()
    with socket.create_server(("127.0.0.1", 0)) as gone:
        down = gone.getsockname()[1]  # closed again: nothing listens there

    async def test():
        with TlsFront(down, {host_psk.identity: host_psk.key}, host_psk.suite) as front:
            transport = TcpTransport("127.0.0.1", front.port, connect_timeout=5, tls=host_psk)
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    with pytest.raises(ConnectError) as info:
                        await transport.connect_queue(nursery, 0, 32)
                    # a close, or a reset or broken pipe (our ICReq unread or not yet
                    # sent): one line either way
                    assert re.fullmatch(
                        rf"NVMe/TCP admin queue: 127.0.0.1:{front.port} (closed the connection "
                        r"before its ICResp|failed during ICReq/ICResp: (Connection reset by "
                        r"peer|Broken pipe))", one_line(info))
            assert front.handshakes == 2
            assert [f.split(": ")[0] for f in front.failures] == [f"backend 127.0.0.1:{down}"] * 2

    trio.run(_guarded, test)


async def _guarded(test):
    with trio.fail_after(HANG_GUARD):
        await test()
