"""DH-HMAC-CHAP maths and messages against independent vectors.

Secrets and transformed keys come from nvme-cli 2.3 (``nvme gen-dhchap-key -s HEX -m N -n NQN``,
which stores HMAC(secret, NQN || "NVMe-over-Fabrics"), the kernel's transformation); the
RFC 7919 primes are checked against OpenSSL 3.0's built-in groups (SHA-256 of p, big-endian);
message layouts against Linux ``include/linux/nvme.h``.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import pytest

from nvmeof_fuse.nvme import auth
from nvmeof_fuse.nvme import command as cmd
from nvmeof_fuse.nvme.sgl import NULL_SGL

NQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000cafe"
SUBNQN = "nqn.2026-11.io.nvmeof-fuse:auth"
RAW64 = bytes(range(64))

# nvme gen-dhchap-key -s 000102...1f -m 0
CLI_00 = "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"
# ... -m 1 -n NQN; -s 00..2f -l 48 -m 2 -n NQN; -s 00..3f -l 64 -m 3 -n NQN
CLI_TRANSFORMED = {
    1: (32, "DHHC-1:01:IboX+GBC4+QvRUld/pN2klcu87mtkIPeyhJHLzljJHLgM8nt:"),
    2: (48, "DHHC-1:02:PA8UB3mhYwrUiUW1yCIPtWrHZjYLPicilf+mHSUBu3joguDDopPfID6Gau5PkoIZIZoIow==:"),
    3: (64, "DHHC-1:03:GUE3Mc4oObVlkzP2NGb7RStcKrSc5DDm8jD2KjmizHdRmPLpSBYxjtE8OLOQXeTiNonaqx+Jiz/"
            "f2mLBDd3thvSPzGA=:"),
}
OPENSSL_PRIME_SHA256 = {
    auth.DhGroup.FFDHE2048: "9cd3b7f336872f46c09428d1bbc19877a4d440512cda8d1c1cf0cd6e33698966",
    auth.DhGroup.FFDHE3072: "0eaf67db3a839156d5013494a5318a772b5697d270d721f37f092efc69ea5a17",
    auth.DhGroup.FFDHE4096: "4648414224ac881b3d0dc59b466f96d06a558278776807797ecf1f66ff397b3e",
    auth.DhGroup.FFDHE6144: "227ac9066b3ddd9e193670cda2388fa884f65ba0cf98b742d1fe77a6687c79c7",
    auth.DhGroup.FFDHE8192: "770b14efaf6f049929c523113b3fa99a8d11dab1b18af3609590122075d19833",
}


def test_parse_secret_reads_nvme_cli_output():
    secret = auth.parse_secret(CLI_00)
    assert secret.key == RAW64[:32] and secret.transform == 0
    assert auth.format_secret(RAW64[:32]) == CLI_00
    assert auth.transform_key(secret, NQN) == RAW64[:32]  # 00: used as is


@pytest.mark.parametrize("transform", [1, 2, 3])
def test_transform_key_matches_nvme_cli(transform):
    length, text = CLI_TRANSFORMED[transform]
    expected = auth.parse_secret(text)
    assert expected.transform == transform
    assert auth.transform_key(auth.Secret(RAW64[:length], transform), NQN) == expected.key


@pytest.mark.parametrize("text, message", [
    ("DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaS:", "CRC-32"),
    ("DHHC-1:04:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:", "unknown key transf"),
    ("DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwd:", "holds 30 bytes"),
    ("DHHC-1:00:not base64!:", "not valid base64"),
    ("hunter2", "not a DH-HMAC-CHAP secret"),
    ("DHHC-2:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:", "DHHC-1:0N"),
])
def test_bad_secrets_are_named_without_showing_them(text, message):
    with pytest.raises(ValueError, match=message) as info:
        auth.parse_secret(text)
    assert text not in str(info.value)
    assert all(part not in str(info.value) for part in text.split(":")[2:] if len(part) > 4)


def test_secret_repr_hides_the_key():
    assert "AAEC" not in repr(auth.parse_secret(CLI_00))
    assert RAW64[:32].hex() not in repr(auth.parse_secret(CLI_00))
    assert "\\x00\\x01" not in repr(auth.parse_secret(CLI_00))


@pytest.mark.parametrize("group", list(OPENSSL_PRIME_SHA256))
def test_ffdhe_primes_match_openssl(group):
    p = auth.ffdhe_prime(group)
    assert hashlib.sha256(p.to_bytes(auth.group_bytes(group), "big")).hexdigest() == \
        OPENSSL_PRIME_SHA256[group]


def test_ffdhe2048_is_a_safe_prime_by_fermat():
    p = auth.ffdhe_prime(auth.DhGroup.FFDHE2048)
    assert pow(2, p - 1, p) == 1 and pow(3, (p - 1) // 2 - 1, (p - 1) // 2) == 1


def test_dh_both_sides_get_the_same_session_key():
    g = auth.DhGroup.FFDHE2048
    a, b = auth.dh_private_key(g), auth.dh_private_key(g)
    pa, pb = auth.dh_public_value(g, a), auth.dh_public_value(g, b)
    assert len(pa) == 256 and auth.dh_session_key(g, a, pb) == auth.dh_session_key(g, b, pa)
    assert a.bit_length() == 225


@pytest.mark.parametrize("peer, message", [
    (b"\x01" * 255, "is 255 bytes, ffdhe2048 needs 256"),
    (bytes(255) + b"\x01", "out of range"),
])
def test_dh_rejects_bad_controller_values(peer, message):
    with pytest.raises(auth.AuthFailure, match=message) as info:
        auth.dh_session_key(auth.DhGroup.FFDHE2048, 12345, peer)
    assert info.value.code == auth.FailureReason.INCORRECT_PAYLOAD


def test_responses_hash_the_fields_in_the_kernels_order():
    key, c1 = b"k" * 32, bytes(range(32))
    spelled = (c1 + (0x01020304).to_bytes(4, "little") + (7).to_bytes(2, "little") + b"\0"
               + b"HostHost" + NQN.encode() + b"\0" + SUBNQN.encode())
    assert auth.host_response(auth.HashId.SHA256, key, c1, 0x01020304, 7, NQN, SUBNQN) == \
        hmac.new(key, spelled, "sha256").digest()
    spelled = (c1 + (9).to_bytes(4, "little") + (7).to_bytes(2, "little") + b"\0"
               + b"Controller" + SUBNQN.encode() + b"\0" + NQN.encode())
    assert auth.controller_response(auth.HashId.SHA512, key, c1, 9, 7, NQN, SUBNQN) == \
        hmac.new(key, spelled, "sha512").digest()


def test_augmented_challenge_is_hmac_keyed_with_the_hashed_session_key():
    skey, c = b"s" * 256, b"c" * 48
    assert auth.augmented_challenge(auth.HashId.SHA384, skey, c) == \
        hmac.new(hashlib.sha384(skey).digest(), c, "sha384").digest()


def test_negotiate_offers_every_hash_and_group():
    msg = auth.negotiate(0x1234)
    assert len(msg) == 72  # nvmf_auth_dhchap_negotiate_data + one protocol descriptor
    assert msg[:8] == bytes([0, 0, 0, 0, 0x34, 0x12, 0, 1])  # COMMON, NEGOTIATE, T_ID, SC_C, NAPD
    assert msg[8:12] == bytes([1, 0, 3, 6])  # AUTHID DH-HMAC-CHAP, HALEN 3, DHLEN 6
    assert msg[12:15] == bytes([1, 2, 3]) and msg[42:48] == bytes([0, 1, 2, 3, 4, 5])


def _challenge(tid=5, hl=32, hash_id=1, group=0, dh=b"", seq=77, c1=None):
    c1 = bytes(range(hl)) if c1 is None else c1
    return struct.pack("<BBxxHBxBBHI", 1, 1, tid, hl, hash_id, group, len(dh), seq) + c1 + dh


def test_parse_challenge():
    ch = auth.parse_challenge(_challenge() + bytes(100), 5)  # the receive buffer is larger
    assert (ch.hash_id, ch.dh_group, ch.seqnum, ch.challenge, ch.dh_value) == \
        (1, 0, 77, bytes(range(32)), b"")
    ch = auth.parse_challenge(_challenge(hl=64, hash_id=3, group=1, dh=b"\x05" * 256), 5)
    assert ch.dh_group == 1 and ch.dh_value == b"\x05" * 256


@pytest.mark.parametrize("data, code, message", [
    (auth.failure1(5, 1), 1, "Authentication failed \\(0x01\\): the controller refused"),
    (auth.failure1(5, 5), 5, "DH group not usable"),
    (_challenge(tid=6), 7, "transaction ID 6"),
    (_challenge(hl=48), 4, "hash length 48"),
    (_challenge(hash_id=9), 4, "unknown hash ID"),
    (_challenge(group=9, dh=b"x"), 5, "unknown DH group"),
    (_challenge(group=1), 6, "DH value of 0 bytes"),
    (_challenge()[:20], 6, "truncated"),
    (auth.success2(5), 7, "expected CHALLENGE"),
])
def test_parse_challenge_failures_name_the_reason(data, code, message):
    with pytest.raises(auth.AuthFailure, match=message) as info:
        auth.parse_challenge(data, 5)
    assert info.value.code == code
    assert info.value.by_controller == (data[1] == auth.MessageId.FAILURE1)


def test_reply_layout():
    r1, c2 = b"r" * 32, b"c" * 32
    msg = auth.reply(5, r1, c2, 0xAABBCCDD, b"d" * 256)
    assert msg[:16] == struct.pack("<BBxxHBxBxHI", 1, 2, 5, 32, 1, 256, 0xAABBCCDD)
    assert msg[16:] == r1 + c2 + b"d" * 256
    msg = auth.reply(5, r1, None, 0xAABBCCDD)  # unidirectional: no C2, S2 = 0
    assert msg == struct.pack("<BBxxHBxBxHI", 1, 2, 5, 32, 0, 0, 0) + r1 + bytes(32)


def test_success1_success2_failure2():
    s1 = struct.pack("<BBxxHBxB7x", 1, 3, 5, 32, 1) + b"R" * 32
    assert auth.parse_success1(s1, 5, auth.HashId.SHA256).response == b"R" * 32
    s1 = struct.pack("<BBxxHBxB7x", 1, 3, 5, 32, 0) + bytes(32)
    assert auth.parse_success1(s1, 5, auth.HashId.SHA256).response is None
    with pytest.raises(auth.AuthFailure, match="Authentication failed"):
        auth.parse_success1(auth.failure1(5, 1), 5, auth.HashId.SHA256)
    assert auth.success2(5) == bytes([1, 4, 0, 0, 5, 0]) + bytes(10)
    assert auth.failure2(5, 1) == bytes([0, 0xF0, 0, 0, 5, 0, 1, 1])


def test_auth_send_and_receive_commands():
    sqe = cmd.auth_send(72, sgl=NULL_SGL)
    assert sqe[0] == 0x7F and sqe[4] == 0x05
    assert sqe[40:48] == bytes([0, 1, 1, 0xE9]) + (72).to_bytes(4, "little")
    sqe = cmd.auth_receive(4096, sgl=NULL_SGL)
    assert sqe[4] == 0x06 and sqe[41:48] == bytes([1, 1, 0xE9]) + (4096).to_bytes(4, "little")
    assert cmd.command_name(sqe, admin=True) == "Auth Receive"
    with pytest.raises(ValueError, match="authentication data length"):
        cmd.auth_send(0, sgl=NULL_SGL)
