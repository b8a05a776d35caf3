"""TLS 1.3 record framing and traffic keys (no I/O), against RFC 8448's vectors."""

from __future__ import annotations

import pytest

from nvmeof_fuse.nvme import tls_record as rec

# RFC 8448 section 3 (Simple 1-RTT Handshake): the server's handshake traffic secret and the
# write key and IV derived from it.
RFC8448_SECRET = bytes.fromhex("b67b7d690cc16c4e75e54213cb2d37b4e9c912bcded9105d42befd59d391ad38")
RFC8448_KEY = bytes.fromhex("3fce516009c21727d0f2e4e86ee403bc")
RFC8448_IV = bytes.fromhex("5d313eb2671276ee13000b30")


def test_traffic_keys_match_rfc_8448():
    keys = rec.traffic_keys(RFC8448_SECRET, "TLS_AES_128_GCM_SHA256")
    assert (keys.key, keys.iv) == (RFC8448_KEY, RFC8448_IV)
    assert "3fce" not in repr(keys)  # no key material in a repr


def test_traffic_keys_of_the_sha384_suite():
    keys = rec.traffic_keys(bytes(48), "TLS_AES_256_GCM_SHA384")
    assert (len(keys.key), len(keys.iv)) == (32, 12)


@pytest.mark.parametrize(("secret", "suite", "message"), [
    (bytes(32), "TLS_CHACHA20_POLY1305_SHA256", "is not one NVMe/TCP uses"),
    (bytes(48), "TLS_AES_128_GCM_SHA256", "traffic secret is 32 bytes, not 48"),
])
def test_traffic_keys_refuse_what_nvme_tcp_does_not_use(secret, suite, message):
    with pytest.raises(ValueError, match=message):
        rec.traffic_keys(secret, suite)


def test_nonce_is_the_iv_xor_the_sequence():
    assert rec.nonce(RFC8448_IV, 0) == RFC8448_IV
    assert rec.nonce(bytes(12), 0x0102) == bytes(10) + b"\x01\x02"
    with pytest.raises(rec.RecordError, match="would wrap"):
        rec.nonce(bytes(12), 1 << 64)


def test_header_counts_the_type_byte_and_the_tag():
    assert rec.header(100) == b"\x17\x03\x03\x00\x75"
    assert rec.parse_header(rec.header(rec.MAX_PLAINTEXT)) == rec.MAX_PLAINTEXT + 17
    with pytest.raises(ValueError, match="at most 16384"):
        rec.header(rec.MAX_PLAINTEXT + 1)


@pytest.mark.parametrize(("head", "message"), [
    (b"\x15\x03\x03\x00\x02", r"unprotected TLS record \(an alert\)"),
    (b"\x16\x03\x03\x00\x40", r"unprotected TLS record \(a handshake message\)"),
    (b"\x17\x03\x01\x00\x40", "version 0x0301"),
    (b"\x17\x03\x03\x48\x01", "18433 bytes"),
    (b"\x17\x03\x03\x00\x10", "16 bytes"),
])
def test_parse_header_refuses_in_one_line(head, message):
    with pytest.raises(rec.RecordError, match=message):
        rec.parse_header(head)


def test_inner_content_strips_the_padding():
    assert rec.inner_content(b"abc\x17\x00\x00") == (23, 3)
    assert rec.inner_content(b"\x15") == (21, 0)
    with pytest.raises(rec.RecordError, match="padding only"):
        rec.inner_content(bytes(5))


@pytest.mark.parametrize(("kind", "content", "line"), [
    (21, b"\x01\x00", "a TLS alert (warning, close_notify)"),
    (21, b"\x02\x33", "a TLS alert (fatal, decrypt_error)"),
    (21, b"\x02", "a malformed TLS alert (1 bytes)"),
    (22, b"\x18\x00\x00\x01\x00", "a TLS KeyUpdate after the handshake"),
    (22, b"\x04\x00\x00\x00", "a TLS NewSessionTicket after the handshake"),
    (22, b"\x63", "a TLS handshake message type 99 after the handshake"),
    (20, b"\x01", "a TLS change_cipher_spec after the handshake"),
    (99, b"", "a TLS record of content type 99"),
])
def test_describe_names_what_is_not_application_data(kind, content, line):
    assert rec.describe(kind, content) == line
