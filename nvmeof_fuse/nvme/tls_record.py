"""TLS 1.3 records after the handshake, as NVMe/TCP uses them (no I/O, no cipher).

What both record layers need besides AES-GCM itself: the traffic keys and IVs of a
traffic secret (RFC 8446 section 7.3, HKDF-Expand-Label), each record's nonce (section
5.3), its header (section 5.2: outer type application_data, version 0x0303, length, which
is also the AEAD's additional data), and what an opened record holds (TLSInnerPlaintext: the
content, its real type, zero padding).  NVMe/TCP carries only application data after the
handshake: anything else (an alert, a KeyUpdate, a late NewSessionTicket) ends the
connection, and :func:`describe` names it in the one line that says why (the kernel's
nvme-tcp host does the same with ``tls_get_record_type``).

Every length from the wire is checked against RFC 8446's bounds before it is used.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from .tls_psk import hkdf_expand, hkdf_label

CHANGE_CIPHER_SPEC, ALERT, HANDSHAKE, APPLICATION_DATA = 20, 21, 22, 23
LEGACY_VERSION = 0x0303
"""Every TLS 1.3 record's header says TLS 1.2 (RFC 8446 section 5.1)."""
TLS13_VERSION = 0x0304
HEADER_BYTES = 5
TAG_BYTES = 16
MAX_PLAINTEXT = 1 << 14
"""A record carries at most 2^14 bytes of content (section 5.1)."""
MAX_CIPHERTEXT = MAX_PLAINTEXT + 256
"""A protected record's length is at most 2^14 + 256 (section 5.2)."""
NONCE_BYTES = 12
SEQUENCE_LIMIT = 1 << 64
"""A sequence number never wraps (section 5.3): a connection that got there must end."""

SUITES = {
    "TLS_AES_128_GCM_SHA256": ("sha256", 16),
    "TLS_AES_256_GCM_SHA384": ("sha384", 32),
}
"""The two suites NVMe/TCP allows: (hash of the key schedule, AES key bytes)."""

HANDSHAKE_TYPES = {1: "ClientHello", 2: "ServerHello", 4: "NewSessionTicket",
                   5: "EndOfEarlyData", 8: "EncryptedExtensions", 11: "Certificate",
                   13: "CertificateRequest", 15: "CertificateVerify", 20: "Finished",
                   24: "KeyUpdate", 254: "message_hash"}
ALERTS = {0: "close_notify", 10: "unexpected_message", 20: "bad_record_mac",
          22: "record_overflow", 40: "handshake_failure", 42: "bad_certificate",
          47: "illegal_parameter", 50: "decode_error", 51: "decrypt_error",
          70: "protocol_version", 71: "insufficient_security", 80: "internal_error",
          86: "inappropriate_fallback", 90: "user_canceled", 109: "missing_extension",
          110: "unsupported_extension", 115: "unknown_psk_identity",
          116: "certificate_required", 120: "no_application_protocol"}


class RecordError(ValueError):
    """A record that breaks TLS 1.3 or is not application data; the message names it."""


@dataclass(frozen=True)
class TrafficKeys:
    """One direction's AEAD key and IV (``write_key``, ``write_iv`` of RFC 8446)."""

    suite: str
    key: bytes = field(repr=False)
    iv: bytes = field(repr=False)


def hkdf_expand_label(secret: bytes, label: str, context: bytes, length: int,
                      hash_name: str) -> bytes:
    """HKDF-Expand-Label(Secret, Label, Context, Length) of RFC 8446 section 7.1 (the same
    HkdfLabel and HKDF-Expand as the PSK derivation's)."""
    return hkdf_expand(secret, hkdf_label(length, label, context), length, hash_name)


def traffic_keys(secret: bytes, suite: str) -> TrafficKeys:
    """The key and IV of a traffic secret: HKDF-Expand-Label(secret, "key"/"iv", "", n)."""
    if suite not in SUITES:
        raise ValueError(f"cipher suite {suite} is not one NVMe/TCP uses "
                         f"({', '.join(SUITES)})")
    hash_name, key_bytes = SUITES[suite]
    if len(secret) != (32 if hash_name == "sha256" else 48):
        raise ValueError(f"a {suite} traffic secret is {32 if hash_name == 'sha256' else 48} "
                         f"bytes, not {len(secret)}")
    return TrafficKeys(suite, hkdf_expand_label(secret, "key", b"", key_bytes, hash_name),
                       hkdf_expand_label(secret, "iv", b"", NONCE_BYTES, hash_name))


def nonce(iv: bytes, sequence: int) -> bytes:
    """The per-record nonce: the IV XOR the 64-bit sequence number, left-padded."""
    if not 0 <= sequence < SEQUENCE_LIMIT:
        raise RecordError("the TLS record sequence number would wrap")
    padded = sequence.to_bytes(NONCE_BYTES, "big")
    return bytes(a ^ b for a, b in zip(iv, padded, strict=True))


_HEADER = struct.Struct(">BHH")


def header(content_bytes: int) -> bytes:
    """The header of a protected record carrying ``content_bytes`` of content (its inner
    type byte and the tag added): also the record's additional data."""
    if not 0 <= content_bytes <= MAX_PLAINTEXT:
        raise ValueError(f"a TLS record carries at most {MAX_PLAINTEXT} bytes, "
                         f"not {content_bytes}")
    return _HEADER.pack(APPLICATION_DATA, LEGACY_VERSION, content_bytes + 1 + TAG_BYTES)


def parse_header(data) -> int:
    """The length of the protected record whose header ``data`` begins with; RecordError
    for one that no TLS 1.3 peer sends after its handshake."""
    kind, version, length = _HEADER.unpack_from(data)
    if kind != APPLICATION_DATA:
        what = "an alert" if kind == ALERT else "a handshake message" if kind == HANDSHAKE \
            else f"content type {kind}"
        raise RecordError(f"an unprotected TLS record ({what}) after the handshake")
    if version != LEGACY_VERSION:
        raise RecordError(f"a TLS record with version {version:#06x}, not 0x0303")
    if not TAG_BYTES + 1 <= length <= MAX_CIPHERTEXT:
        raise RecordError(f"a TLS record of {length} bytes (a protected record is "
                          f"{TAG_BYTES + 1} to {MAX_CIPHERTEXT})")
    return length


def inner_content(plaintext) -> tuple[int, int]:
    """An opened record's (content type, content length): the last non-zero byte is the
    type, the zeros after it padding (section 5.2)."""
    end = len(plaintext)
    while end and plaintext[end - 1] == 0:
        end -= 1
    if not end:
        raise RecordError("a TLS record of padding only (no content type)")
    if end - 1 > MAX_PLAINTEXT:
        raise RecordError(f"a TLS record with {end - 1} bytes of content (at most "
                          f"{MAX_PLAINTEXT})")
    return plaintext[end - 1], end - 1


def describe(content_type: int, content: bytes) -> str:
    """Names a record that is not application data, for the one line that ends the
    connection: ``a TLS alert (fatal, decrypt_error)``, ``a TLS KeyUpdate``..."""
    if content_type == ALERT:
        if len(content) != 2:
            return f"a malformed TLS alert ({len(content)} bytes)"
        level = {1: "warning", 2: "fatal"}.get(content[0], f"level {content[0]}")
        name = ALERTS.get(content[1], f"alert {content[1]}")
        return f"a TLS alert ({level}, {name})"
    if content_type == HANDSHAKE:
        if not content:
            return "an empty TLS handshake record"
        name = HANDSHAKE_TYPES.get(content[0], f"handshake message type {content[0]}")
        return f"a TLS {name} after the handshake"
    if content_type == CHANGE_CIPHER_SPEC:
        return "a TLS change_cipher_spec after the handshake"
    return f"a TLS record of content type {content_type}"
