"""NVMe/TCP host transport (NVMe/TCP Transport Specification) on trio.

The PDUs are built and parsed in :mod:`nvmeof_fuse.nvme.tcp_pdu`.  This module opens the
connections: one TCP connection per NVMe queue, opened with ICReq/ICResp (honouring the
target's CPDA, MAXH2CDATA and digests), then handed to a :class:`~.queue.TcpQueue`,
which moves capsules and data, and reads what comes back with its
:class:`~.reader.PduReader`.  Data moves once, received into and sent from the
caller's memory (:mod:`.data`), which needs no registration: :meth:`TcpTransport.register`
hands back a trivial one, and refuses GPU memory by name.

With a TLS PSK (``tls``), each connection is secured before its ICReq, as nvme-cli's
``--tls`` does: the handshake by OpenSSL (:mod:`.tls_handshake`), a fresh one per
connection (reconnects included), then the records in the kernel where it has kTLS, else
in userspace (:mod:`.tls_records`); the queue's code is the same over either.

``python -m nvmeof_fuse.transport.tcp HOST PORT`` probes a port: it prints the ICResp.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Callable

import trio

from ...errors import ConnectError, KeyRejected, NVMeoFError, TransportError
from ...nvme import tcp_pdu as pdu
from ...nvme.tcp_pdu import ICResp, icreq_pdu, parse_icresp  # noqa: F401 - re-exported
from ...nvme.tls_psk import TlsPsk
from .. import registry
from ..base import LocalDevice
from .data import HOST_MEMORY_ONLY, TcpRegistration, is_device_memory
from .queue import TcpQueue
from .tls_handshake import NOT_TLS, REFUSED_KEY, HandshakeError, client, handshake
from .tls_records import RecordLayer, UserspaceRecords, install_kernel_tls

ADMIN_IN_CAPSULE_BYTES = 8192  # NVME_TCP_ADMIN_CCSZ: the admin queue's in-capsule data
_SIOCGIFADDR = 0x8915
_IFNAMSIZ = 16


def interface_of(local_address: str) -> str | None:
    """The netdev that holds ``local_address`` (a socket's own address: the one its route
    left through, as far as one can tell without netlink), or None."""
    try:
        wanted = ipaddress.ip_address(local_address.split("%")[0])
    except ValueError:
        return None
    if isinstance(wanted, ipaddress.IPv6Address) and wanted.ipv4_mapped is not None:
        wanted = wanted.ipv4_mapped
    if isinstance(wanted, ipaddress.IPv6Address):
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:  # address, index, prefix, scope, flags, name
                    fields = line.split()
                    if len(fields) == 6 and int(fields[0], 16) == int(wanted):
                        return fields[5]
        except (OSError, ValueError):
            pass
        return None
    packed = wanted.packed
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:_IFNAMSIZ - 1]))
            except OSError:  # no IPv4 address there
                continue
            if got[20:24] == packed:  # struct ifreq: the name, then a sockaddr_in
                return name
    return None


class TcpTransport:
    """The TCP side of one controller: a connection per queue, nothing shared but options."""

    name = "tcp"
    needs_keyed_sgls = False
    places_in_other_processes = True
    """A companion client connects queues of its own (a connection each, with the mount's
    controller ID) and receives into its own host memory: the daemon leaves the data path."""
    counts_read_data = True  # a read succeeds only with all its C2HData (reader.py)
    dmabuf_refusal = HOST_MEMORY_ONLY
    """Why dma-bufs (GPU memory) are not registered here."""

    def __init__(self, traddr: str, trsvcid: int = 4420, host_traddr: str | None = None,
                 connect_timeout: float = 10.0, *, header_digest: bool = False,
                 data_digest: bool = False, splice: bool = False,
                 host_iface: str | None = None,
                 tls: TlsPsk | Callable[[], TlsPsk] | None = None,
                 kernel_tls: bool | None = None) -> None:
        self.traddr = traddr
        self.host_iface = host_iface
        """The netdev every connection is bound to (SO_BINDTODEVICE, as nvme-cli's
        ``host_iface``), or None: where the route goes."""
        self.local_device: LocalDevice | None = None
        """The netdev the last connection went through: ``host_iface``, else the one that
        holds the socket's own address."""
        self.tls = tls
        """The PSK identity and TLS PSK each connection's handshake offers, or what gives
        them anew for each connection (a key file read again: a key rotated in its file is
        used from the next reconnect on); None: no TLS."""
        self.kernel_tls = kernel_tls
        """None: the kernel's record layer where it has one; False: always ours; True: the
        kernel's or a refusal."""
        self.record_layer: RecordLayer | None = None
        self.psk_identity: str | None = None
        """The PSK identity the last handshake offered, for ``.nvmeof`` (not a secret)."""
        """Where the last connection's records went (``.nvmeof/stats``)."""
        # Large write data by vmsplice/splice (see .splice) instead of a copy into the
        # socket.  Off by default: the copy was faster in the testbed's A/B
        # (docs/performance-history.md); kept for a measurement on a real NIC.
        self.splice = splice
        self.trsvcid = trsvcid
        self.host_traddr = host_traddr
        self.connect_timeout = connect_timeout
        self.header_digest = header_digest
        self.data_digest = data_digest
        self._queues: list[TcpQueue] = []

    @property
    def address(self) -> str:
        return f"tcp {self.traddr}:{self.trsvcid}"

    def register(self, addr: int, length: int, owner: object) -> TcpRegistration:
        """A trivial registration of host memory; GPU memory is refused by name."""
        if is_device_memory(owner):
            raise TransportError(f"cannot register GPU memory: {HOST_MEMORY_ONLY}")
        return TcpRegistration(addr, length, owner)

    def register_dmabuf(self, fd: int, offset: int, length: int, iova: int) -> TcpRegistration:
        """Refused: a socket cannot receive into a dma-buf (the caller stages instead)."""
        raise TransportError(f"cannot register the dma-buf: {HOST_MEMORY_ONLY}")

    async def _open(self, what: str) -> trio.socket.SocketType:
        where = f"{self.traddr}:{self.trsvcid}"
        sock = None
        try:
            with trio.fail_after(self.connect_timeout):
                infos = await trio.socket.getaddrinfo(self.traddr, self.trsvcid,
                                                      type=socket.SOCK_STREAM)
                family, kind, proto, _, addr = infos[0]
                sock = trio.socket.socket(family, kind, proto)
                if self.host_iface:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE,
                                    self.host_iface.encode())
                if self.host_traddr:
                    await sock.bind((self.host_traddr, 0))
                await sock.connect(addr)
        except trio.TooSlowError:
            reason = f"timed out after {self.connect_timeout:g} s"
        except socket.gaierror as exc:
            reason = f"failed: cannot resolve the address ({exc.strerror})"
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET):
                reason = "refused: is an NVMe/TCP port listening there?"
            elif self.host_traddr and exc.errno == errno.EADDRNOTAVAIL:
                reason = f"failed: --host-traddr {self.host_traddr} is not a local address"
            elif self.host_iface and exc.errno == errno.ENODEV:
                reason = f"failed: host_iface {self.host_iface} is no network interface here"
            elif self.host_iface and exc.errno == errno.EPERM:
                reason = (f"failed: binding to host_iface {self.host_iface} needs "
                          "CAP_NET_RAW")
            else:
                reason = f"failed: {exc.strerror or exc}"
        except BaseException:  # cancelled (a reconnect try cut short): no socket left open
            if sock is not None:
                sock.close()
            raise
        else:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Close with a reset, dropping what is still queued (as Linux nvme_tcp_alloc_queue,
            # sock_no_linger): spliced H2CData in the send queue would refer to the caller's
            # pages, which a failed command's caller gets back once the socket is closed.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            device = self.host_iface or interface_of(sock.getsockname()[0])
            self.local_device = LocalDevice("net", device) if device else None
            return sock
        if sock is not None:
            sock.close()
        raise ConnectError(f"NVMe/TCP {what} connect to {where} {reason}")

    async def connect_queue(self, nursery: trio.Nursery, qid: int, size: int,
                            in_capsule_bytes: int = 0, cntlid: int = 0) -> TcpQueue:
        """Open queue ``qid``'s connection, exchange ICReq/ICResp, start its receive task."""
        what = "admin queue" if qid == 0 else f"I/O queue {qid}"
        sock = await self._open(what)
        records = None
        try:
            if self.tls is not None:
                sock, records = await self._secure(sock, what)
            resp = await self._initialize(sock, what)
        except BaseException:
            sock.close()
            raise
        if qid == 0:
            in_capsule_bytes = max(in_capsule_bytes, ADMIN_IN_CAPSULE_BYTES)
        queue = TcpQueue(self, sock, qid, size, in_capsule_bytes, resp, records=records,
                         kernel_tls=records is None and self.tls is not None)
        self._queues.append(queue)
        await nursery.start(queue.receive)
        return queue

    async def _secure(self, sock, what: str):
        """TLS on ``sock``: the handshake within the connect timeout, then the records in
        the kernel or in userspace.  The socket the queue uses, and the userspace layer
        (None in the kernel)."""
        assert self.tls is not None
        where = f"{self.traddr}:{self.trsvcid}"
        try:
            psk = self.tls() if callable(self.tls) else self.tls
        except NVMeoFError as exc:  # the key file, unreadable or changed for the worse
            raise ConnectError(f"NVMe/TCP {what}: {exc}") from None
        self.psk_identity = psk.identity
        try:
            with trio.fail_after(self.connect_timeout):
                secrets = await handshake(client(sock.fileno(), psk.identity, psk.key,
                                                 psk.suite), sock)
        except trio.TooSlowError:
            raise ConnectError(f"NVMe/TCP {what}: no TLS handshake with {where} within "
                               f"{self.connect_timeout:g} s (is it a TLS port?)") from None
        except HandshakeError as exc:
            error = KeyRejected if _refused_key(str(exc)) else ConnectError
            raise error(f"NVMe/TCP {what}: {exc} with {where}"
                        f"{_handshake_hint(str(exc), psk.identity)}") from None
        plain = socket.socket(fileno=sock.detach())
        try:
            if self.kernel_tls is not False and install_kernel_tls(plain, secrets):
                self.record_layer = RecordLayer("kernel", secrets.suite)
                return trio.socket.from_stdlib_socket(plain), None
            if self.kernel_tls:
                raise ConnectError(f"NVMe/TCP {what}: kernel TLS was asked for, but this "
                                   "kernel has none (modprobe tls)")
            records = UserspaceRecords(plain, secrets)
        except BaseException:
            plain.close()
            raise
        self.record_layer = records.layer
        return trio.socket.from_stdlib_socket(records.start()), records

    async def _initialize(self, sock, what: str) -> ICResp:
        where = f"{self.traddr}:{self.trsvcid}"
        buf = bytearray(pdu.IC_PDU_LENGTH)
        got = 0
        try:
            with trio.fail_after(self.connect_timeout):
                await sock.send(icreq_pdu(header_digest=self.header_digest,
                                          data_digest=self.data_digest))
                while got < len(buf):
                    n = await sock.recv_into(memoryview(buf)[got:])
                    if n == 0:
                        raise ConnectError(f"NVMe/TCP {what}: {where} closed the connection "
                                           f"before its ICResp{self._plain_hint(buf, got)}")
                    got += n
        except trio.TooSlowError:
            raise ConnectError(f"NVMe/TCP {what}: no ICResp from {where} within "
                               f"{self.connect_timeout:g} s") from None
        except OSError as exc:
            hint = self._plain_hint(buf, got) if exc.errno == errno.ECONNRESET else ""
            raise ConnectError(f"NVMe/TCP {what}: {where} failed during ICReq/ICResp: "
                               f"{exc.strerror or exc}{hint}") from None
        try:
            resp = parse_icresp(bytes(buf))
            pdu.check_icresp(resp, header_digest=self.header_digest,
                             data_digest=self.data_digest)
        except ValueError as exc:
            raise ConnectError(f"NVMe/TCP {what}: {where} answered with {exc}") from None
        return resp

    def _plain_hint(self, buf: bytearray, got: int) -> str:
        """Why a port may close before its ICResp: it wants TLS (it sent a TLS alert, or
        nothing: nvmet closes a TLS-only port's plain connections so)."""
        if self.tls is not None:
            return ""
        if got >= 3 and buf[0] == 0x15 and buf[1] == 0x03:
            return " (it answered with a TLS alert: the port requires TLS, --tls --tls-key)"
        return " (a port that requires TLS closes so: --tls --tls-key)"

    async def drop_queues(self) -> None:
        """Stop and close every queue (waiting commands fail with TransportError)."""
        queues, self._queues = self._queues, []
        for queue in reversed(queues):
            await queue.stop()
            queue.close()

    def close(self) -> None:
        for queue in reversed(self._queues):
            queue.close()
        self._queues.clear()


def _refused_key(reason: str) -> bool:
    """Whether a failed handshake's ``reason`` is the target's alert refusing our PSK."""
    return "closed the connection" not in reason and any(text in reason for text in REFUSED_KEY)


def _handshake_hint(reason: str, identity: str) -> str:
    if "closed the connection" in reason:
        return f" (does the port take TLS, and a PSK for identity '{identity}'?)"
    if _refused_key(reason):
        return (f" (the target refused the PSK: does it hold the same PSK for identity "
                f"'{identity}'?)")
    if any(text in reason for text in NOT_TLS):
        return " (the port does not speak TLS: leave out --tls)"
    return ""


def _create(traddr: str, trsvcid: int, host_traddr: str | None = None, *,
            connect_timeout: float, hdr_digest: bool = False,
            data_digest: bool = False, host_iface: str | None = None,
            tls: TlsPsk | Callable[[], TlsPsk] | None = None) -> TcpTransport:
    return TcpTransport(traddr, trsvcid, host_traddr, connect_timeout=connect_timeout,
                        header_digest=hdr_digest, data_digest=data_digest,
                        host_iface=host_iface, tls=tls)


registry.register("tcp", _create)


def probe(host: str, port: int, timeout: float = 10.0) -> ICResp:
    """Open a TCP connection, send an ICReq and return the target's ICResp."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(icreq_pdu())
            reply = b""
            while len(reply) < pdu.IC_PDU_LENGTH:
                chunk = sock.recv(pdu.IC_PDU_LENGTH - len(reply))
                if not chunk:
                    raise ConnectError(f"{host}:{port} closed the connection before its ICResp")
                reply += chunk
    except OSError as exc:
        raise ConnectError(f"NVMe/TCP probe of {host}:{port} failed: {exc}") from exc
    try:
        return parse_icresp(reply)
    except ValueError as exc:
        raise ConnectError(f"{host}:{port} answered with {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """``python -m nvmeof_fuse.transport.tcp HOST PORT``: print the ICResp or the error."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m nvmeof_fuse.transport.tcp HOST PORT", file=sys.stderr)
        return 2
    try:
        resp = probe(args[0], int(args[1]))
    except (ConnectError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"ICResp from {args[0]}:{args[1]}: pfv={resp.pfv} cpda={resp.cpda} "
          f"maxh2cdata={resp.maxh2cdata}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
