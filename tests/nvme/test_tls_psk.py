"""TLS PSKs for NVMe/TCP against libnvme's vectors and libnvme's own code.

- The interchange format and the version 1 identities (the digest over the retained PSK, so
  also the retained PSK, normal and ``--compat``): libnvme's ``test/psk.c`` (commit
  03297d8bf6f7, the same in nvme-cli 3.0's ``libnvme/tests/psk.c``).
- The retained and TLS PSKs of every combination (hash 00/01/02, identity version 0/1,
  normal and compat), for which no published vectors exist: libnvme's own
  ``derive_nvme_keys`` and the functions it calls, taken unchanged from ``src/nvme/linux.c``
  at commit 03297d8bf6f7, built against OpenSSL 3.0.19 on Debian 12 and run with the NQNs of
  the NVMe/TCP specification's example (the harness checked itself against ``test/psk.c``'s
  identities first).  The version 1 TLS PSK is also the kernel's ``nvme_auth_derive_tls_psk``
  (context "0h <digest>"), by reading.
- HKDF itself: RFC 5869 test case 3 (SHA-256, zero-length salt and info).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import zlib

import pytest

from nvmeof_fuse.nvme import tls_psk
from nvmeof_fuse.nvme.tls_psk import ConfiguredPsk, PskHash

# libnvme test/psk.c
PSK32 = bytes.fromhex("5512DBB6737D0106F65975B773DFB011FFC344BCF442E2DD6D8BC4870B5D5B03")
PSK48 = PSK32 + bytes.fromhex("FFC344BCF442E2DD6D8BC4870B5D5B03")
EXPORTED = [
    (PSK32, PskHash.NONE, "NVMeTLSkey-1:00:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"),
    (PSK32, PskHash.SHA256, "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"),
    (PSK48, PskHash.SHA384, "NVMeTLSkey-1:02:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwP/w0S89ELi"
                            "3W2LxIcLXVsDn8kXZQ==:"),
]
TEST_HOST, TEST_SUBSYS = "nqn.psk-test-host", "nqn.psk-test-subsys"
IDENTITIES = [  # (key, hash, compat, identity)
    (PSK32, PskHash.SHA256, False, "NVMe1R01 nqn.psk-test-host nqn.psk-test-subsys "
                                   "iSbjiStwJ/1TrTvDlt2fjFmzvsytOJelidNnA+X5lEU="),
    (PSK48, PskHash.SHA384, False, "NVMe1R02 nqn.psk-test-host nqn.psk-test-subsys "
                                   "QhW2+Rp6RzHlNtCslyRxMnwJ11tKKhz8JCAQpQ+XUD8f9td1VeH5h53yz2wKJG1a"),
    (PSK32, PskHash.SHA256, True, "NVMe1R01 nqn.psk-test-host nqn.psk-test-subsys "
                                  "66GuqV08TsAGII39teWUfwQwizjv06Jy8jOcX3NAAzM="),
    (PSK48, PskHash.SHA384, True, "NVMe1R02 nqn.psk-test-host nqn.psk-test-subsys "
                                  "RsKmYJ3nAn1ApjjMloJFbAkLPivONDAX/xW327YBUsn2eGShXSjCZvBaOxscLqmz"),
]

# libnvme's derive_nvme_keys, built here (see the docstring), with the specification's NQNs
SPEC_HOST = "nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6"
SPEC_SUBSYS = "nqn.2014-08.org.nvmexpress:uuid:36ebf5a9-1df9-47b3-a6d0-e9ba32e428a2"
LIBNVME_DERIVED = [  # (key length, hash, identity version, compat, digest, retained, TLS PSK)
    (32, 0, 0, False, None,
     "5512dbb6737d0106f65975b773dfb011ffc344bcf442e2dd6d8bc4870b5d5b03",
     "464d9438c6d8b3c9f0a426b780872e3fc456bf43410e9d3f2de4c95684e0e48b"),
    (32, 0, 0, True, None,
     "5512dbb6737d0106f65975b773dfb011ffc344bcf442e2dd6d8bc4870b5d5b03",
     "20fdf2adc72954248703a82ebda5655882c3f907b5028a3c5a4ad161cee6bf8a"),
    (32, 0, 1, False, 'RpiNKd8UlCSBGTzGFVEBu9IiqBKf/JTSITbYKb4VBIc=',
     "5512dbb6737d0106f65975b773dfb011ffc344bcf442e2dd6d8bc4870b5d5b03",
     "ded362bde1576f3914a5f0291a703e67eb8fd11e52b20cdf03b40c48a8a55d33"),
    (32, 0, 1, True, 'RpiNKd8UlCSBGTzGFVEBu9IiqBKf/JTSITbYKb4VBIc=',
     "5512dbb6737d0106f65975b773dfb011ffc344bcf442e2dd6d8bc4870b5d5b03",
     "83c2537a348e54d5f41a309ece38ed9d3a2ed2752d95a3c256d71f8a02fc12ee"),
    (32, 1, 0, False, None,
     "f0af1bc718d4f23bdd7c1683a3d79bd953ea789d106a0f5207bb574bbe5446ce",
     "8e981666c96a88ef69f6e6a0460ff77ba9039e3d38cbdeee264c4de09d75d246"),
    (32, 1, 0, True, None,
     "c8304c516f121bc4cd37c9d434635c70ed18c8809004448c3d7ff17b8265ac5e",
     "be4ef89f73206dc2b64f95a33f73318a0064758aa0dab40f38f269c336b359c5"),
    (32, 1, 1, False, 'E7SfPmB1H5RQCPDO/jPElNLoNkv7agzvJauAf6yCO9E=',
     "f0af1bc718d4f23bdd7c1683a3d79bd953ea789d106a0f5207bb574bbe5446ce",
     "5a21fd02f19a9eaec7b166edabff907304b7625b7927d7398f9d654dff4087f7"),
    (32, 1, 1, True, '784yr0+Smfy2PtrzNKX2MKuuRLLE5iehfelFUZozXoM=',
     "c8304c516f121bc4cd37c9d434635c70ed18c8809004448c3d7ff17b8265ac5e",
     "c730c74e327cc78140397f570a5613d8437bbec49a56e4b9cd9e889325b65f0c"),
    (48, 0, 0, False, None,
     "5512dbb6737d0106f65975b773dfb011ffc344bcf442e2dd6d8bc4870b5d5b03ffc344bcf442e2dd6d8bc4870b5d5b03",
     "a733bf4dcd1546fb5b9ae22ac74d265f4cb763764cc53f4902f3a95b7c731a4b968ba9afbbef494b96ffa2bb9d3ac7fc"),
    (48, 0, 0, True, None,
     "5512dbb6737d0106f65975b773dfb011ffc344bcf442e2dd6d8bc4870b5d5b03ffc344bcf442e2dd6d8bc4870b5d5b03",
     "1d9facf0af3d5f9b90f0f86a7aa1345b416dec3c103f5e28fc90b21ad900fbbd281b078b6dab1301f7761ca6d44a8104"),
    (48, 0, 1, False, 'gTKj5y4Iy5q9JuElvj/WzV+tVoGdDv5fOJSio6M6esLoPmt0QFNgvHzcj4Yc+l/P',
     "5512dbb6737d0106f65975b773dfb011ffc344bcf442e2dd6d8bc4870b5d5b03ffc344bcf442e2dd6d8bc4870b5d5b03",
     "297b6a650eb8ab662c588c0a6a38ea35cfffe6ef4911d916b8f1a6845947b3d2ea12ec220611c3f12bb17f1799c64588"),
    (48, 0, 1, True, 'gTKj5y4Iy5q9JuElvj/WzV+tVoGdDv5fOJSio6M6esLoPmt0QFNgvHzcj4Yc+l/P',
     "5512dbb6737d0106f65975b773dfb011ffc344bcf442e2dd6d8bc4870b5d5b03ffc344bcf442e2dd6d8bc4870b5d5b03",
     "3c4148eaad860ec42521dcdaaee2927bc38597ceb5c7c4f22087b332055d935c840b6e5eac53349f25aa8f40689475b8"),
    (48, 2, 0, False, None,
     "e42f24faf45337718cfd5068c928d40d4d22b7a915a47bc50280933f9530c5d64980ecfefb890b0b59016a3781c6b93e",
     "051e9924174204ffcd2c29216827b8714da37a8734e483aff6ba9d821371a91f4c1536cf74514848c7a19d478a627af1"),
    (48, 2, 0, True, None,
     "09f7fc62e97110b0e54749daac3c7a7923623bb7c9ad5f4dcb3ba5a5f541dd80c95f42eb3240601b3db14121761b5f34",
     "1d893f1708d9ae897cf9c6a525a037f4e9bebfdd8b49e50ddd5f236bb2cd432fb626ce7e585a79c17ac3581a051fa7f6"),
    (48, 2, 1, False, 'VBVoKmkv4uYslaZD4DgAzhaFB3IRHvt+41ckH4rG0i3lgYK4XjkIjIED+k5sCf9u',
     "e42f24faf45337718cfd5068c928d40d4d22b7a915a47bc50280933f9530c5d64980ecfefb890b0b59016a3781c6b93e",
     "c93e6ca8ea4b0ec73d66f852fb33c6ba40543dc5bae088408968ffcca01e1eb763d32c3325aaa76747ec1fef8f85d4d9"),
    (48, 2, 1, True, 'bzy8LaZWQ5y/SB0yDkTqdOG0TkI8FS9BtYEJv6vItoqZ27VBHJLjI4C2IohWRnuv',
     "09f7fc62e97110b0e54749daac3c7a7923623bb7c9ad5f4dcb3ba5a5f541dd80c95f42eb3240601b3db14121761b5f34",
     "6ed253fdbaee15d85a5535fadeecb9057d6626af6e1525fa60319596b6df1864d3ae9d7b7c824cd5dcd088c68491c8f4"),
]


def key_of(length: int) -> bytes:
    return PSK32 if length == 32 else PSK48


# --- the interchange format ----------------------------------------------------------------


@pytest.mark.parametrize("key, hash_id, text", EXPORTED)
def test_export_and_import_match_libnvme(key, hash_id, text):
    assert tls_psk.format_interchange(key, hash_id) == text
    parsed = tls_psk.parse_interchange(text)
    assert parsed == ConfiguredPsk(key, hash_id) and parsed.hash_id is hash_id
    assert tls_psk.parse_interchange(f"  {text}\n") == parsed  # as read from a file


def test_a_key_with_no_transform_may_be_48_bytes_and_picks_its_cipher_by_length():
    text = tls_psk.format_interchange(PSK48, PskHash.NONE)
    assert text.startswith("NVMeTLSkey-1:00:") and len(text) == 89
    parsed = tls_psk.parse_interchange(text)
    assert parsed.cipher is PskHash.SHA384
    assert ConfiguredPsk(PSK32, 0).cipher is PskHash.SHA256


def test_the_crc_is_zlibs_crc32_little_endian():
    raw = base64.b64decode(EXPORTED[1][2].split(":")[2])
    assert raw[32:] == zlib.crc32(PSK32).to_bytes(4, "little")


def test_neither_repr_nor_str_shows_the_key():
    configured = tls_psk.parse_interchange(EXPORTED[1][2])
    derived = tls_psk.derive(configured, TEST_HOST, TEST_SUBSYS, version=1)
    for shown in (repr(configured), str(configured), repr(derived)):
        assert PSK32.hex() not in shown and "key=" not in shown and derived.key.hex() not in shown


GOOD = EXPORTED[1][2]
BAD_KEYS = [
    ("", "is not a TLS PSK in the interchange format NVMeTLSkey-1:hh:<base64>:"),
    (GOOD.replace("NVMeTLSkey-", "NVMeTLSKey-"), "is not a TLS PSK in the interchange format"),
    ("DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
     "is a DH-HMAC-CHAP secret (DHHC-1:...), not a TLS PSK"),
    (GOOD.replace("NVMeTLSkey-1:", "NVMeTLSkey-2:"),
     "has version 2; only version 1 (NVMeTLSkey-1:) is defined"),
    (GOOD.replace("NVMeTLSkey-1:", "NVMeTLSkey-x:"), "has an unknown version; only version 1"),
    (GOOD[:-1], "is not of the form NVMeTLSkey-1:hh:<base64>:"),
    (GOOD + "x", "is not of the form NVMeTLSkey-1:hh:<base64>:"),
    (GOOD + "x:", "is not of the form NVMeTLSkey-1:hh:<base64>:"),
    (GOOD.replace(":01:", ":1:"), "has no two-digit hash after NVMeTLSkey-1:"),
    (GOOD.replace(":01:", ":0g:"), "has no two-digit hash after NVMeTLSkey-1:"),
    (GOOD.replace(":01:", ":03:"), "names hash 03; 00 (none), 01 (SHA-256) and 02 (SHA-384)"),
    (GOOD.replace("VRLb", "VR?b"), "is not valid base64 after NVMeTLSkey-1:01:"),
    (GOOD.replace("VRLb", "VRLbA"), "is not valid base64 after NVMeTLSkey-1:01:"),
    ("NVMeTLSkey-1:01:" + base64.b64encode(bytes(35)).decode() + ":",
     "holds 35 bytes; a key of 32 (SHA-256) or 48 (SHA-384) bytes and its CRC-32 (36 or 52)"),
    (tls_psk.format_interchange(PSK48, 0).replace(":00:", ":01:"),
     "holds a 48-byte key, but hash 01 (SHA256) takes 32 bytes"),
    (GOOD.replace(":01:", ":02:"), "holds a 32-byte key, but hash 02 (SHA384) takes 48 bytes"),
    (GOOD.replace("Nf9LrZ", "Nf9LrA"), "fails its CRC-32 check (mistyped or truncated)"),
]


@pytest.mark.parametrize("text, message", BAD_KEYS)
def test_each_refusal_names_its_problem_and_never_the_key(text, message):
    with pytest.raises(ValueError) as e:
        tls_psk.parse_interchange(text)
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    body = text.split(":")[2] if text.count(":") >= 2 else text
    assert not body or body[:8] not in str(e.value)


@pytest.mark.parametrize("key, hash_id, message", [
    (PSK48, PskHash.SHA256, "a key for hash 01 is 32 bytes, not 48"),
    (PSK32, PskHash.SHA384, "a key for hash 02 is 48 bytes, not 32"),
    (PSK32[:16], PskHash.NONE, "a key for hash 00 is 32 or 48 bytes, not 16"),
    (PSK32, 3, "hash 3 is not 0 (none), 1 (SHA-256) or 2 (SHA-384)"),
])
def test_export_refuses_a_key_that_does_not_fit_its_hash(key, hash_id, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tls_psk.format_interchange(key, hash_id)
    with pytest.raises(ValueError):
        ConfiguredPsk(key, hash_id)


# --- the derivations -----------------------------------------------------------------------


def test_hkdf_is_rfc_5869_test_case_3():
    okm = tls_psk._hkdf(PskHash.SHA256, bytes([0x0B] * 22), b"", 42)
    assert okm.hex() == ("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"
                         "9d201395faa4b61a96c8")


@pytest.mark.parametrize("key, hash_id, compat, identity", IDENTITIES)
def test_version_1_identities_match_libnvme(key, hash_id, compat, identity):
    derived = tls_psk.derive(ConfiguredPsk(key, hash_id), TEST_HOST, TEST_SUBSYS, version=1,
                             compat=compat)
    assert derived.identity == identity
    assert derived.cipher is hash_id and len(derived.key) == len(key)


@pytest.mark.parametrize("length, hash_id, version, compat, digest, retained, psk",
                         LIBNVME_DERIVED)
def test_retained_and_tls_psks_match_libnvmes_own_code(length, hash_id, version, compat,
                                                       digest, retained, psk):
    configured = ConfiguredPsk(key_of(length), hash_id)
    assert tls_psk.retained_psk(configured, SPEC_HOST, compat=compat).hex() == retained
    derived = tls_psk.derive(configured, SPEC_HOST, SPEC_SUBSYS, version=version,
                             compat=compat)
    cipher = 1 if length == 32 else 2
    expected = f"NVMe{version}R0{cipher} {SPEC_HOST} {SPEC_SUBSYS}" + \
        (f" {digest}" if version == 1 else "")
    assert derived.identity == expected
    assert derived.key.hex() == psk
    assert derived.suite == ("TLS_AES_128_GCM_SHA256" if cipher == 1 else
                             "TLS_AES_256_GCM_SHA384")


def test_the_pieces_compose_as_derive_does():
    configured = ConfiguredPsk(PSK32, PskHash.SHA256)
    retained = tls_psk.retained_psk(configured, TEST_HOST)
    digest = tls_psk.psk_digest(retained, PskHash.SHA256, TEST_HOST, TEST_SUBSYS)
    assert digest == IDENTITIES[0][3].split()[-1]
    expected_digest = hmac.new(retained, f"{TEST_HOST} {TEST_SUBSYS} NVMe-over-Fabrics".encode(),
                               hashlib.sha256).digest()
    assert base64.b64decode(digest) == expected_digest  # the kernel's nvme_auth_generate_digest
    assert tls_psk.psk_identity(1, PskHash.SHA256, TEST_HOST, TEST_SUBSYS, digest) == \
        IDENTITIES[0][3]
    key = tls_psk.tls_psk(retained, PskHash.SHA256, 1, digest)
    assert key == tls_psk.derive(configured, TEST_HOST, TEST_SUBSYS, version=1).key


def test_a_retained_psk_with_no_transform_is_the_configured_psk():
    configured = ConfiguredPsk(PSK48, PskHash.NONE)
    assert tls_psk.retained_psk(configured, TEST_HOST) == PSK48
    assert tls_psk.retained_psk(configured, TEST_HOST, compat=True) == PSK48


def _subsystem_of_identity_length(length: int) -> str:
    """A subsystem NQN that makes SPEC_HOST's version 0 identity ``length`` bytes long."""
    return "nqn." + "x" * (length - len("NVMe0R01  ") - len(SPEC_HOST) - 4)


@pytest.mark.parametrize("length, compat, fits", [
    (255, False, True), (256, False, False), (256, True, True), (257, True, False)])
def test_version_0_identities_fit_the_hkdf_context_as_in_libnvme(length, compat, fits):
    """libnvme refuses the same lengths (its harness: 255 and, compat, 256 bytes derive)."""
    configured = ConfiguredPsk(PSK32, PskHash.SHA256)
    subsys = _subsystem_of_identity_length(length)
    if fits:
        assert len(tls_psk.derive(configured, SPEC_HOST, subsys, compat=compat).identity) == \
            length
        return
    limit = 256 if compat else 255
    with pytest.raises(ValueError, match=f"the PSK identity is {length} bytes; version 0's TLS "
                                         f"PSK takes it as an HKDF context of at most {limit}"):
        tls_psk.derive(configured, SPEC_HOST, subsys, compat=compat)
    assert tls_psk.derive(configured, SPEC_HOST, subsys, version=1, compat=compat)


@pytest.mark.parametrize("hostnqn, subnqn, version, message", [
    ("", SPEC_SUBSYS, 0, "the host NQN is empty or holds a NUL"),
    ("nqn.a\0b", SPEC_SUBSYS, 0, "the host NQN is empty or holds a NUL"),
    (SPEC_HOST, "", 1, "the subsystem NQN is empty or holds a NUL"),
    ("nqn." + "h" * 220, SPEC_SUBSYS, 0, "the host NQN is 224 bytes; an NQN is at most 223"),
    (SPEC_HOST, "nqn." + "s" * 220, 1, "the subsystem NQN is 224 bytes; an NQN is at most 223"),
    (SPEC_HOST, SPEC_SUBSYS, 2, "PSK identity version 2 is not 0 or 1"),
])
def test_derive_refuses_bad_nqns_and_versions(hostnqn, subnqn, version, message):
    with pytest.raises(ValueError) as e:
        tls_psk.derive(ConfiguredPsk(PSK32, PskHash.SHA256), hostnqn, subnqn, version=version)
    assert message in str(e.value)


def test_the_lower_level_calls_refuse_what_derive_never_passes():
    with pytest.raises(ValueError, match="PSK identity version 1 needs the PSK digest"):
        tls_psk.psk_identity(1, PskHash.SHA256, TEST_HOST, TEST_SUBSYS)
    with pytest.raises(ValueError, match="PSK identity version 2 is not 0 or 1"):
        tls_psk.psk_identity(2, PskHash.SHA256, TEST_HOST, TEST_SUBSYS, "digest")
    with pytest.raises(ValueError, match="PSK identity version 3 is not 0 or 1"):
        tls_psk.tls_psk(PSK32, PskHash.SHA256, 3, "x")


# --- PSKs in the kernel keyring ---------------------------------------------------------


def test_default_identities_follow_the_kernels_order():
    assert tls_psk.default_identities("nqn.h", "nqn.s") == [
        "NVMe0R02 nqn.h nqn.s", "NVMe0R01 nqn.h nqn.s",
        "NVMe0G02 nqn.h nqn.s", "NVMe0G01 nqn.h nqn.s"]


@pytest.mark.parametrize(("identity", "cipher"), [
    ("NVMe0R01 nqn.h nqn.s", PskHash.SHA256), ("NVMe1R02 nqn.h nqn.s digest=", PskHash.SHA384),
    ("NVMe0G01 nqn.h nqn.s", PskHash.SHA256),
])
def test_a_keyring_psk_takes_its_suite_from_its_identity(identity, cipher):
    psk = tls_psk.keyring_psk(identity, bytes(tls_psk.HASH_LENGTHS[cipher]))
    assert (psk.identity, psk.cipher) == (identity, cipher)


@pytest.mark.parametrize(("identity", "key", "message"), [
    ("NVMe2R01 h s", bytes(32), "is not an NVMe/TCP PSK identity (NVMe0R01 <hostnqn> "
     "<subnqn>, NVMe1R02 ... <digest>): it begins 'NVMe2R01'"),
    ("NVMe0R03 h s", bytes(32), "it begins 'NVMe0R03'"),
    ("NVMe0X01 h s", bytes(32), "it begins 'NVMe0X01'"),
    ("nvme", bytes(32), "it begins 'nvme'"),
    ("NVMe0R02 h s", bytes(32), "holds 32 bytes, but its identity names SHA384 (48 bytes)"),
])
def test_a_keyring_psk_that_does_not_fit_its_identity_is_refused(identity, key, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tls_psk.keyring_psk(identity, key)
