"""NVMe/TCP transport (NVMe/TCP Transport Specification).

So far only the connection handshake: the ICReq/ICResp PDUs and a probe that
checks a target answers.  Queues over TCP are the next transport to land here.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from ..errors import ConnectError

PDU_ICREQ = 0x00
PDU_ICRESP = 0x01
IC_PDU_LENGTH = 128
_COMMON_HEADER = struct.Struct("<BBBBI")  # pdu-type, flags, hlen, pdo, plen


def icreq_pdu(*, hpda: int = 0, header_digest: bool = False, data_digest: bool = False,
              maxr2t: int = 0) -> bytes:
    """Initialize Connection Request PDU (NVMe/TCP spec, ICReq): 128 bytes."""
    digests = (1 if header_digest else 0) | (2 if data_digest else 0)
    head = _COMMON_HEADER.pack(PDU_ICREQ, 0, IC_PDU_LENGTH, 0, IC_PDU_LENGTH)
    body = struct.pack("<HBBI", 0, hpda, digests, maxr2t)  # PFV 0, HPDA, DGST, MAXR2T
    return (head + body).ljust(IC_PDU_LENGTH, b"\0")


@dataclass(frozen=True, slots=True)
class ICResp:
    """Initialize Connection Response: what the controller agreed to."""

    pfv: int
    cpda: int
    header_digest: bool
    data_digest: bool
    maxh2cdata: int


def parse_icresp(pdu: bytes) -> ICResp:
    """Parse a 128-byte ICResp PDU; raise ValueError naming what is wrong."""
    if len(pdu) != IC_PDU_LENGTH:
        raise ValueError(f"ICResp must be {IC_PDU_LENGTH} bytes, got {len(pdu)}")
    pdu_type, _flags, hlen, _pdo, plen = _COMMON_HEADER.unpack_from(pdu)
    if pdu_type != PDU_ICRESP or hlen != IC_PDU_LENGTH or plen != IC_PDU_LENGTH:
        raise ValueError(f"not an ICResp PDU (type {pdu_type:#x}, hlen {hlen}, plen {plen})")
    pfv, cpda, dgst, maxh2cdata = struct.unpack_from("<HBBI", pdu, 8)
    return ICResp(pfv, cpda, bool(dgst & 1), bool(dgst & 2), maxh2cdata)


def probe(host: str, port: int, timeout: float = 10.0) -> ICResp:
    """Open a TCP connection, send an ICReq and return the target's ICResp."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(icreq_pdu())
            reply = b""
            while len(reply) < IC_PDU_LENGTH:
                chunk = sock.recv(IC_PDU_LENGTH - len(reply))
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
