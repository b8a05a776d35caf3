"""NVMe/TCP connection handshake: ICReq/ICResp layouts and the probe."""

import socket
import struct
import threading

import pytest

from nvmeof_fuse.errors import ConnectError
from nvmeof_fuse.transport.tcp import ICResp, icreq_pdu, parse_icresp, probe

TIMEOUT = 10.0


def icresp(*, pfv=0, cpda=0, dgst=0, maxh2cdata=0x20000, pdu_type=1, hlen=128, plen=128):
    head = struct.pack("<BBBBI", pdu_type, 0, hlen, 0, plen)
    return (head + struct.pack("<HBBI", pfv, cpda, dgst, maxh2cdata)).ljust(128, b"\0")


# --- ICReq ----------------------------------------------------------------------------------------


def test_icreq_layout():
    pdu = icreq_pdu()
    assert len(pdu) == 128
    assert struct.unpack_from("<BBBBI", pdu) == (0, 0, 128, 0, 128)
    assert struct.unpack_from("<HBBI", pdu, 8) == (0, 0, 0, 0)  # PFV, HPDA, DGST, MAXR2T
    assert pdu[16:] == bytes(112)


@pytest.mark.parametrize(("header", "data", "dgst"),
                         [(False, False, 0), (True, False, 1), (False, True, 2), (True, True, 3)])
def test_icreq_digests(header, data, dgst):
    assert icreq_pdu(header_digest=header, data_digest=data)[11] == dgst


def test_icreq_hpda_and_maxr2t():
    pdu = icreq_pdu(hpda=2, maxr2t=7)
    assert pdu[10] == 2 and struct.unpack_from("<I", pdu, 12) == (7,)


# --- ICResp ---------------------------------------------------------------------------------------


def test_parse_icresp():
    resp = parse_icresp(icresp(cpda=1, dgst=3, maxh2cdata=131072))
    assert resp == ICResp(pfv=0, cpda=1, header_digest=True, data_digest=True,
                          maxh2cdata=131072)


def test_parse_icresp_data_digest_only():
    resp = parse_icresp(icresp(dgst=2))
    assert not resp.header_digest and resp.data_digest


@pytest.mark.parametrize("length", [0, 8, 127, 129])
def test_parse_icresp_wrong_length(length):
    with pytest.raises(ValueError, match=f"ICResp must be 128 bytes, got {length}"):
        parse_icresp(bytes(length))


@pytest.mark.parametrize("fields", [{"pdu_type": 0}, {"hlen": 24}, {"plen": 256}])
def test_parse_icresp_not_an_icresp(fields):
    with pytest.raises(ValueError, match="not an ICResp PDU"):
        parse_icresp(icresp(**fields))


# --- probe ----------------------------------------------------------------------------------------


class OneShotServer:
    """A listener on 127.0.0.1 that reads one ICReq and answers with ``reply`` (then closes)."""

    def __init__(self, reply: bytes, chunks: int = 1) -> None:
        self.reply = reply
        self.chunks = chunks
        self.received = b""
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(TIMEOUT)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(TIMEOUT)
            while len(self.received) < 128:
                chunk = conn.recv(128 - len(self.received))
                if not chunk:
                    break
                self.received += chunk
            step = -(-len(self.reply) // self.chunks) if self.reply else 1
            for at in range(0, len(self.reply), step):
                conn.sendall(self.reply[at:at + step])

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.thread.join(TIMEOUT)
        self.sock.close()
        assert not self.thread.is_alive()


def test_probe_gets_icresp():
    with OneShotServer(icresp(cpda=2, maxh2cdata=65536)) as server:
        resp = probe("127.0.0.1", server.port, timeout=TIMEOUT)
    assert resp.cpda == 2 and resp.maxh2cdata == 65536
    assert server.received == icreq_pdu()


def test_probe_reassembles_a_split_icresp():
    with OneShotServer(icresp(maxh2cdata=4096), chunks=4) as server:
        assert probe("127.0.0.1", server.port, timeout=TIMEOUT).maxh2cdata == 4096


def test_probe_peer_closes_early():
    with OneShotServer(icresp()[:40]) as server:
        with pytest.raises(ConnectError, match="closed the connection before its ICResp"):
            probe("127.0.0.1", server.port, timeout=TIMEOUT)


def test_probe_closed_port():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    with pytest.raises(ConnectError, match=f"NVMe/TCP probe of 127.0.0.1:{port} failed"):
        probe("127.0.0.1", port, timeout=TIMEOUT)
