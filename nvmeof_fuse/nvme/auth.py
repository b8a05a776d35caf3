"""In-band authentication, DH-HMAC-CHAP: secrets, key maths and messages (no I/O).

NVMe Base 2.0, "In-band authentication" (first TP 8006): after the Fabrics Connect
of each queue the host sends AUTH_Negotiate, receives DH-HMAC-CHAP_Challenge,
sends _Reply, receives _Success1 (or AUTH_Failure1) and, when it challenged the
controller too, sends _Success2 (or AUTH_Failure2).  Layouts and hashing order
follow the Linux host (``drivers/nvme/host/auth.c``, ``drivers/nvme/common/auth.c``,
``include/linux/nvme.h``), so that Linux nvmet and this host agree byte for byte.

Secrets are never part of an exception message or a ``repr``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import secrets
import struct
import zlib
from dataclasses import dataclass, field
from enum import IntEnum

from ._fields import BytesLike

AUTH_ID_DHCHAP = 0x01
RECEIVE_BUFFER = 4096
"""AL of each Authentication Receive (CHAP_BUF_SIZE in Linux: enough for ffdhe8192)."""


class AuthType(IntEnum):
    COMMON = 0x00
    DHCHAP = 0x01


class MessageId(IntEnum):
    NEGOTIATE = 0x00
    CHALLENGE = 0x01
    REPLY = 0x02
    SUCCESS1 = 0x03
    SUCCESS2 = 0x04
    FAILURE2 = 0xF0
    FAILURE1 = 0xF1


class HashId(IntEnum):
    SHA256 = 0x01
    SHA384 = 0x02
    SHA512 = 0x03


class DhGroup(IntEnum):
    NULL = 0x00
    FFDHE2048 = 0x01
    FFDHE3072 = 0x02
    FFDHE4096 = 0x03
    FFDHE6144 = 0x04
    FFDHE8192 = 0x05


class FailureReason(IntEnum):
    """AUTH_Failure reason code explanations (NVMe Base 2.0)."""

    FAILED = 0x01
    PROTOCOL_NOT_USABLE = 0x02
    CONCAT_MISMATCH = 0x03
    HASH_NOT_USABLE = 0x04
    DHGROUP_NOT_USABLE = 0x05
    INCORRECT_PAYLOAD = 0x06
    INCORRECT_MESSAGE = 0x07


REASON_FAILED = 0x01
"""AUTH_Failure reason code: Authentication failure (the explanation says more)."""

FAILURE_NAMES = {
    FailureReason.FAILED: "Authentication failed",
    FailureReason.PROTOCOL_NOT_USABLE: "Authentication protocol not usable",
    FailureReason.CONCAT_MISMATCH: "Secure channel concatenation mismatch",
    FailureReason.HASH_NOT_USABLE: "Hash function not usable",
    FailureReason.DHGROUP_NOT_USABLE: "DH group not usable",
    FailureReason.INCORRECT_PAYLOAD: "Incorrect payload",
    FailureReason.INCORRECT_MESSAGE: "Incorrect protocol message",
}

_HASHES = {HashId.SHA256: "sha256", HashId.SHA384: "sha384", HashId.SHA512: "sha512"}
_HASH_LEN = {HashId.SHA256: 32, HashId.SHA384: 48, HashId.SHA512: 64}


def failure_name(code: int) -> str:
    """The spec's name of an AUTH_Failure reason code explanation, with the code."""
    try:
        return f"{FAILURE_NAMES[FailureReason(code)]} ({code:#04x})"
    except ValueError:
        return f"reason code explanation {code:#04x}"


class AuthFailure(ValueError):
    """The exchange failed with AUTH_Failure reason code explanation ``code``.

    ``by_controller``: the controller sent AUTH_Failure1; otherwise the host
    found the problem (and owes the controller an AUTH_Failure2).
    """

    def __init__(self, code: int, detail: str, *, by_controller: bool = False) -> None:
        self.code = code
        self.by_controller = by_controller
        super().__init__(f"{failure_name(code)}: {detail}")


def hash_name(hash_id: int) -> str:
    return _HASHES[HashId(hash_id)]


def hash_length(hash_id: int) -> int:
    return _HASH_LEN[HashId(hash_id)]


# --- secrets: DHHC-1:0N:<base64 of key || CRC-32>: -----------------------------------------


@dataclass(frozen=True)
class Secret:
    """A parsed DH-HMAC-CHAP secret; ``transform`` says which hash turns it into a key."""

    key: bytes = field(repr=False)
    transform: int
    """0: used as is; 1/2/3: HMAC-SHA-256/384/512 with the NQN (NVMe Base 2.0)."""


def parse_secret(text: str) -> Secret:
    """Parse ``DHHC-1:0N:<base64>:`` as nvme-cli writes it; checks length and CRC-32.

    Raises ValueError with a message that never contains the secret.
    """
    text = text.strip()
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] != "DHHC-1" or (len(parts) == 4 and parts[3]):
        raise ValueError("is not a DH-HMAC-CHAP secret of the form DHHC-1:0N:<base64>:")
    if parts[1] not in ("00", "01", "02", "03"):
        raise ValueError("names an unknown key transformation (DHHC-1:00..03: are defined)")
    try:
        raw = base64.b64decode(parts[2], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("is not valid base64 after DHHC-1:0N:") from None
    if len(raw) not in (36, 52, 68):
        raise ValueError(f"holds {len(raw)} bytes; a key of 32, 48 or 64 bytes and its "
                         "CRC-32 (36, 52 or 68) are expected")
    key, crc = raw[:-4], raw[-4:]
    if zlib.crc32(key).to_bytes(4, "little") != crc:
        raise ValueError("fails its CRC-32 check (mistyped or truncated)")
    return Secret(key, int(parts[1]))


def format_secret(key: bytes, transform: int = 0) -> str:
    """The ``DHHC-1:0N:...:`` text of ``key`` (as ``nvme gen-dhchap-key`` prints it)."""
    if len(key) not in (32, 48, 64) or transform not in (0, 1, 2, 3):
        raise ValueError("a key is 32, 48 or 64 bytes; transformations are 0..3")
    blob = key + zlib.crc32(key).to_bytes(4, "little")
    return f"DHHC-1:{transform:02d}:{base64.b64encode(blob).decode()}:"


def transform_key(secret: Secret, nqn: str) -> bytes:
    """The key the responses are keyed with: HMAC(secret, NQN || "NVMe-over-Fabrics").

    NQN is the host's for the host's secret and the subsystem's for the controller's.
    """
    if secret.transform == 0:
        return secret.key
    return hmac.new(secret.key, nqn.encode() + b"NVMe-over-Fabrics",
                    hash_name(secret.transform)).digest()


# --- Diffie-Hellman over the RFC 7919 groups -----------------------------------------------

# RFC 7919 appendix A: p = 2^b - 2^(b-64) + {[2^(b-130) e] + X} * 2^64 - 1, g = 2.
_FFDHE = {
    DhGroup.FFDHE2048: (2048, 560316, 225),
    DhGroup.FFDHE3072: (3072, 2625351, 275),
    DhGroup.FFDHE4096: (4096, 5736041, 325),
    DhGroup.FFDHE6144: (6144, 15705020, 375),
    DhGroup.FFDHE8192: (8192, 10965728, 400),
}
"""Bits, X, and exponent bits (RFC 7919 section 5.2's estimate of the group's strength x 2)."""


def _e_fixed_point(bits: int) -> int:
    """floor(e * 2**bits), from the series sum 1/k!."""
    guard = 64
    term, total, k = 1 << (bits + guard), 0, 0
    while term:
        total += term
        k += 1
        term //= k
    return total >> guard


@functools.cache
def ffdhe_prime(group: int) -> int:
    """The safe prime p of RFC 7919 group ``group`` (generator 2)."""
    bits, x, _ = _FFDHE[DhGroup(group)]
    return 2**bits - 2**(bits - 64) + (_e_fixed_point(bits - 130) + x) * 2**64 - 1


def group_bytes(group: int) -> int:
    return _FFDHE[DhGroup(group)][0] // 8


def dh_private_key(group: int) -> int:
    """A random exponent of the size RFC 7919 suggests for the group."""
    return secrets.randbits(_FFDHE[DhGroup(group)][2]) | 1 << (_FFDHE[DhGroup(group)][2] - 1)


def dh_public_value(group: int, private: int) -> bytes:
    """g^x mod p, big-endian, as long as p."""
    return pow(2, private, ffdhe_prime(group)).to_bytes(group_bytes(group), "big")


def dh_session_key(group: int, private: int, peer: BytesLike) -> bytes:
    """The shared secret (peer^x mod p, as long as p); rejects a public value out of range."""
    p = ffdhe_prime(group)
    if len(peer) != group_bytes(group):
        raise AuthFailure(FailureReason.INCORRECT_PAYLOAD,
                          f"the controller's DH value is {len(peer)} bytes, "
                          f"{DhGroup(group).name.lower()} needs {group_bytes(group)}")
    y = int.from_bytes(peer, "big")
    if not 1 < y < p - 1:
        raise AuthFailure(FailureReason.INCORRECT_PAYLOAD,
                          "the controller's DH value is out of range")
    return pow(y, private, p).to_bytes(group_bytes(group), "big")


# --- responses ---------------------------------------------------------------------------


def augmented_challenge(hash_id: int, session_key: bytes, challenge: bytes) -> bytes:
    """Ca = HMAC(H(session key), C) when a DH group is used."""
    name = hash_name(hash_id)
    return hmac.new(hashlib.new(name, session_key).digest(), challenge, name).digest()


def _response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, tid: int,
              role: bytes, first_nqn: str, second_nqn: str) -> bytes:
    msg = (challenge + struct.pack("<IHB", seqnum, tid, 0) + role
           + first_nqn.encode() + b"\0" + second_nqn.encode())
    return hmac.new(key, msg, hash_name(hash_id)).digest()


def host_response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, tid: int,
                  hostnqn: str, subnqn: str) -> bytes:
    """R1 = HMAC(Kh, C1 || S1 || T_ID || SC_C || "HostHost" || NQNh || 0 || NQNc)."""
    return _response(hash_id, key, challenge, seqnum, tid, b"HostHost", hostnqn, subnqn)


def controller_response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, tid: int,
                        hostnqn: str, subnqn: str) -> bytes:
    """R2 = HMAC(Kc, C2 || S2 || T_ID || SC_C || "Controller" || NQNc || 0 || NQNh)."""
    return _response(hash_id, key, challenge, seqnum, tid, b"Controller", subnqn, hostnqn)


# --- messages ----------------------------------------------------------------------------


def negotiate(tid: int) -> bytes:
    """AUTH_Negotiate: DH-HMAC-CHAP with every hash and DH group this host knows.

    Header (8 bytes): AUTH_TYPE, AUTH_ID, reserved, T_ID, SC_C (0: no secure channel),
    NAPD (1); then one 64-byte protocol descriptor: AUTHID, reserved, HALEN, DHLEN,
    and the ID list (hash IDs from byte 0, DH group IDs from byte 30).
    """
    hashes, groups = list(HashId), list(DhGroup)
    idlist = bytearray(60)
    idlist[: len(hashes)] = bytes(hashes)
    idlist[30 : 30 + len(groups)] = bytes(groups)
    return (struct.pack("<BBxxHBB", AuthType.COMMON, MessageId.NEGOTIATE, tid, 0, 1)
            + struct.pack("<BxBB", AUTH_ID_DHCHAP, len(hashes), len(groups)) + bytes(idlist))


_HEADER = struct.Struct("<BBxxH")  # AUTH_TYPE, AUTH_ID, reserved, T_ID


def _expect(data: BytesLike, tid: int, message: MessageId) -> memoryview:
    """Check the header: ``message`` for transaction ``tid``, or raise (AUTH_Failure1 too)."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise AuthFailure(FailureReason.INCORRECT_MESSAGE, f"a {len(view)}-byte message")
    auth_type, auth_id, t_id = _HEADER.unpack_from(view)
    if auth_type == AuthType.COMMON and auth_id == MessageId.FAILURE1:
        raise AuthFailure(view[7], f"the controller refused (AUTH_Failure1 for {message.name})",
                          by_controller=True)
    if auth_type != AuthType.DHCHAP or auth_id != message:
        raise AuthFailure(FailureReason.INCORRECT_MESSAGE,
                          f"expected {message.name}, got message {auth_type:#04x}/{auth_id:#04x}")
    if t_id != tid:
        raise AuthFailure(FailureReason.INCORRECT_MESSAGE,
                          f"transaction ID {t_id} in {message.name}, expected {tid}")
    return view


@dataclass(frozen=True)
class Challenge:
    """DH-HMAC-CHAP_Challenge: the hash and DH group the controller chose, C1, S1, its DH value."""

    hash_id: int
    dh_group: int
    seqnum: int
    challenge: bytes
    dh_value: bytes


def parse_challenge(data: BytesLike, tid: int) -> Challenge:
    """Check and decode a DH-HMAC-CHAP_Challenge (or raise on AUTH_Failure1).

    Layout (Linux ``nvmf_auth_dhchap_challenge_data``): 0 AUTH_TYPE, 1 AUTH_ID,
    4..5 T_ID, 6 HL, 8 HASHID, 9 DHGID, 10..11 DHVLEN, 12..15 SEQNUM, 16.. C1 (HL
    bytes) then the DH value (DHVLEN bytes).
    """
    view = _expect(data, tid, MessageId.CHALLENGE)
    if len(view) < 16:
        raise AuthFailure(FailureReason.INCORRECT_PAYLOAD, "a truncated challenge")
    hl, hash_id, dh_group, dhvlen, seqnum = struct.unpack_from("<BxBBHI", view, 6)
    if hash_id not in _HASHES:
        raise AuthFailure(FailureReason.HASH_NOT_USABLE, f"unknown hash ID {hash_id:#04x}")
    if hl != hash_length(hash_id):
        raise AuthFailure(FailureReason.HASH_NOT_USABLE,
                          f"hash length {hl} does not fit {hash_name(hash_id)}")
    if dh_group not in DhGroup.__members__.values():
        raise AuthFailure(FailureReason.DHGROUP_NOT_USABLE, f"unknown DH group {dh_group:#04x}")
    if (dh_group == DhGroup.NULL) != (dhvlen == 0):
        raise AuthFailure(FailureReason.INCORRECT_PAYLOAD,
                          f"DH value of {dhvlen} bytes with group {DhGroup(dh_group).name}")
    if len(view) < 16 + hl + dhvlen:
        raise AuthFailure(FailureReason.INCORRECT_PAYLOAD, "a truncated challenge")
    return Challenge(hash_id, dh_group, seqnum, bytes(view[16 : 16 + hl]),
                     bytes(view[16 + hl : 16 + hl + dhvlen]))


def reply(tid: int, response: bytes, controller_challenge: bytes | None, seqnum: int,
          dh_value: bytes = b"") -> bytes:
    """DH-HMAC-CHAP_Reply: 0 AUTH_TYPE, 1 AUTH_ID, 4..5 T_ID, 6 HL, 8 CVALID, 10..11 DHVLEN,
    12..15 SEQNUM (S2; 0 unless the host challenges the controller), 16.. R1, C2 (zeros when
    not challenging), DH value."""
    hl = len(response)
    c2 = controller_challenge if controller_challenge is not None else bytes(hl)
    if len(c2) != hl:
        raise ValueError("the controller challenge must be as long as the response")
    return (struct.pack("<BBxxHBxBxHI", AuthType.DHCHAP, MessageId.REPLY, tid, hl,
                        int(controller_challenge is not None), len(dh_value),
                        seqnum if controller_challenge is not None else 0)
            + response + c2 + dh_value)


@dataclass(frozen=True)
class Success1:
    """DH-HMAC-CHAP_Success1: R2, the controller's response, when RVALID is set."""

    response: bytes | None


def parse_success1(data: BytesLike, tid: int, hash_id: int) -> Success1:
    """0 AUTH_TYPE, 1 AUTH_ID, 4..5 T_ID, 6 HL, 8 RVALID, 16.. R2 (HL bytes)."""
    view = _expect(data, tid, MessageId.SUCCESS1)
    if len(view) < 16:
        raise AuthFailure(FailureReason.INCORRECT_PAYLOAD, "a truncated Success1")
    hl, rvalid = view[6], view[8]
    if hl != hash_length(hash_id):
        raise AuthFailure(FailureReason.HASH_NOT_USABLE,
                          f"hash length {hl} in Success1, expected {hash_length(hash_id)}")
    if not rvalid & 1:
        return Success1(None)
    if len(view) < 16 + hl:
        raise AuthFailure(FailureReason.INCORRECT_PAYLOAD, "a truncated Success1")
    return Success1(bytes(view[16 : 16 + hl]))


def success2(tid: int) -> bytes:
    """DH-HMAC-CHAP_Success2: the host accepts the controller's response (16 bytes)."""
    return struct.pack("<BBxxH10x", AuthType.DHCHAP, MessageId.SUCCESS2, tid)


def failure2(tid: int, code: int) -> bytes:
    """AUTH_Failure2: the host ends the transaction; ``code`` is the reason explanation."""
    return struct.pack("<BBxxHBB", AuthType.COMMON, MessageId.FAILURE2, tid, REASON_FAILED,
                       code)


def failure1(tid: int, code: int) -> bytes:
    """AUTH_Failure1 as a controller sends it (for tests and fakes)."""
    return struct.pack("<BBxxHBB", AuthType.COMMON, MessageId.FAILURE1, tid, REASON_FAILED, code)
