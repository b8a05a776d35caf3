"""TLS PSKs for NVMe/TCP, as nvme-cli and libnvme make them (no I/O).

NVMe/TCP transport specification, "TLS PSK and PSK identity derivation": a configured PSK
travels in the PSK interchange format ``NVMeTLSkey-1:hh:<base64(key || CRC-32)>:`` (hh 00:
used as is, 01: SHA-256 with a 32-byte key, 02: SHA-384 with a 48-byte key); the host turns
it into a retained PSK with HKDF and its host NQN, and that, with a PSK identity, into the
TLS PSK the handshake uses.  The byte layouts follow libnvme's ``src/nvme/linux.c``
(``derive_retained_key``, ``derive_psk_digest``, ``derive_tls_key``, ``gen_tls_identity``)
and the kernel's ``nvme_auth_generate_digest``/``nvme_auth_derive_tls_psk``, so that a key
made by ``nvme gen-tls-key`` gives the identity and PSK the kernel and tlshd look up; the
``compat`` derivation is libnvme's older, non-RFC 8446 one (``nvme ... --compat``), kept
for targets provisioned with it.

Secrets never appear in an exception message or a ``repr``.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import zlib
from dataclasses import dataclass, field
from enum import IntEnum

INTERCHANGE_PREFIX = "NVMeTLSkey-"
INTERCHANGE_FORM = "NVMeTLSkey-1:hh:<base64>:"
MAX_NQN_BYTES = 223
"""The longest NQN (NVMe Base: 223 bytes of UTF-8)."""
MAX_HKDF_CONTEXT = 255
"""An HkdfLabel's context is at most 255 bytes (RFC 8446 section 7.1)."""
MAX_COMPAT_CONTEXT = 256
"""libnvme's older derivation writes the context without a length byte, up to 256 bytes."""


class PskHash(IntEnum):
    """The hash identifiers of the interchange format and of PSK identities."""

    NONE = 0
    SHA256 = 1
    SHA384 = 2


HASH_NAMES = {PskHash.SHA256: "sha256", PskHash.SHA384: "sha384"}
HASH_LENGTHS = {PskHash.SHA256: 32, PskHash.SHA384: 48}
CIPHER_SUITES = {PskHash.SHA256: "TLS_AES_128_GCM_SHA256",
                 PskHash.SHA384: "TLS_AES_256_GCM_SHA384"}
"""The TLS 1.3 suite each PSK hash goes with (NVMe/TCP allows these two)."""
IDENTITY_VERSIONS = (0, 1)
"""0: ``NVMe0R0h <hostnqn> <subnqn>`` (NVMe/TCP 1.0c); 1: with the PSK digest (TP 8018)."""


def _cipher_for_length(length: int) -> PskHash:
    return PskHash.SHA256 if length == 32 else PskHash.SHA384


@dataclass(frozen=True)
class ConfiguredPsk:
    """A configured PSK and the hash that turns it into the retained PSK (NONE: it is one)."""

    key: bytes = field(repr=False)
    hash_id: PskHash

    def __post_init__(self) -> None:
        _check_key(self.key, self.hash_id)
        object.__setattr__(self, "hash_id", PskHash(self.hash_id))

    @property
    def cipher(self) -> PskHash:
        """The hash of the TLS PSK and its suite: ``hash_id``, or by the key's length."""
        return self.hash_id or _cipher_for_length(len(self.key))


@dataclass(frozen=True)
class TlsPsk:
    """What a TLS 1.3 handshake offers: the PSK identity and the key behind it."""

    identity: str
    key: bytes = field(repr=False)
    cipher: PskHash

    @property
    def suite(self) -> str:
        return CIPHER_SUITES[self.cipher]


def _check_key(key: bytes, hash_id: int) -> None:
    if hash_id not in tuple(PskHash):
        raise ValueError(f"hash {hash_id} is not 0 (none), 1 (SHA-256) or 2 (SHA-384)")
    allowed = (32, 48) if hash_id == PskHash.NONE else (HASH_LENGTHS[PskHash(hash_id)],)
    if len(key) not in allowed:
        raise ValueError(f"a key for hash {hash_id:02d} is "
                         f"{' or '.join(map(str, allowed))} bytes, not {len(key)}")


# --- the interchange format --------------------------------------------------------------


def format_interchange(key: bytes, hash_id: int) -> str:
    """``NVMeTLSkey-1:hh:<base64(key || CRC-32 LE)>:`` (libnvme's ``nvme_export_tls_key``)."""
    _check_key(key, hash_id)
    blob = key + zlib.crc32(key).to_bytes(4, "little")
    return f"{INTERCHANGE_PREFIX}1:{hash_id:02x}:{base64.b64encode(blob).decode()}:"


def parse_interchange(text: str) -> ConfiguredPsk:
    """A key in the interchange format, with every check libnvme makes and its CRC-32.

    Raises ValueError whose message says what is wrong (for "--keydata <message>") and
    never holds the key.
    """
    text = text.strip()
    if text.startswith("DHHC-1:"):
        raise ValueError(f"is a DH-HMAC-CHAP secret (DHHC-1:...), not a TLS PSK "
                         f"({INTERCHANGE_FORM})")
    if not text.startswith(INTERCHANGE_PREFIX):
        raise ValueError(f"is not a TLS PSK in the interchange format {INTERCHANGE_FORM}")
    parts = text.split(":")
    version = parts[0].removeprefix(INTERCHANGE_PREFIX)
    if version != "1":
        shown = f"version {version}" if version.isdigit() and len(version) <= 3 else \
            "an unknown version"
        raise ValueError(f"has {shown}; only version 1 ({INTERCHANGE_PREFIX}1:) is defined")
    if len(parts) != 4 or parts[3]:
        raise ValueError(f"is not of the form {INTERCHANGE_FORM} (the key's base64 between "
                         "the second and a final ':')")
    hh = parts[1]
    if len(hh) != 2 or any(c not in "0123456789abcdefABCDEF" for c in hh):
        raise ValueError(f"has no two-digit hash after {INTERCHANGE_PREFIX}1:")
    if int(hh, 16) not in tuple(PskHash):
        raise ValueError(f"names hash {hh}; 00 (none), 01 (SHA-256) and 02 (SHA-384) are "
                         "defined")
    hash_id = PskHash(int(hh, 16))
    try:
        raw = base64.b64decode(parts[2], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"is not valid base64 after {INTERCHANGE_PREFIX}1:{hh}:") from None
    if len(raw) not in (36, 52):
        raise ValueError(f"holds {len(raw)} bytes; a key of 32 (SHA-256) or 48 (SHA-384) "
                         "bytes and its CRC-32 (36 or 52) are expected")
    key, crc = raw[:-4], raw[-4:]
    if hash_id != PskHash.NONE and len(key) != HASH_LENGTHS[hash_id]:
        raise ValueError(f"holds a {len(key)}-byte key, but hash {hh} "
                         f"({HASH_NAMES[hash_id].upper()}) takes {HASH_LENGTHS[hash_id]} bytes")
    if zlib.crc32(key).to_bytes(4, "little") != crc:
        raise ValueError("fails its CRC-32 check (mistyped or truncated)")
    return ConfiguredPsk(key, hash_id)


# --- HKDF (RFC 5869) and TLS 1.3's HkdfLabel (RFC 8446 section 7.1) ----------------------


def _hkdf(hash_id: PskHash, ikm: bytes, info: bytes, length: int) -> bytes:
    """HKDF-Extract with the zero salt, then HKDF-Expand (OpenSSL's EVP_PKEY_HKDF default)."""
    name = HASH_NAMES[hash_id]
    prk = hmac.new(bytes(HASH_LENGTHS[hash_id]), ikm, name).digest()
    return hkdf_expand(prk, info, length, name)


def hkdf_expand(prk: bytes, info: bytes, length: int, hash_name: str) -> bytes:
    """HKDF-Expand (RFC 5869) of ``prk`` with ``info``, ``length`` bytes, by ``hash_name``."""
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hash_name).digest()
        out += block
        counter += 1
    return out[:length]


def hkdf_label(length: int, label: str, context: bytes) -> bytes:
    """``HkdfLabel``: length (big-endian 16 bits), then "tls13 " + label and the context,
    each after a length byte."""
    full = b"tls13 " + label.encode()
    if len(context) > MAX_HKDF_CONTEXT:
        raise ValueError(f"an HKDF-Expand-Label context is at most {MAX_HKDF_CONTEXT} bytes, "
                         f"not {len(context)}")
    return length.to_bytes(2, "big") + bytes([len(full)]) + full + bytes([len(context)]) \
        + context


def _compat_info(length: int, label: str, context: bytes) -> bytes:
    """libnvme's older info: length little-endian, "tls13 " + label and the context, with
    no length bytes (not RFC 8446's HkdfLabel)."""
    if len(context) > MAX_COMPAT_CONTEXT:
        raise ValueError(f"the older derivation's context is at most {MAX_COMPAT_CONTEXT} "
                         f"bytes, not {len(context)}")
    return length.to_bytes(2, "little") + b"tls13 " + label.encode() + context


def _nqn_bytes(nqn: str, which: str) -> bytes:
    if not isinstance(nqn, str) or not nqn or "\0" in nqn:
        raise ValueError(f"the {which} NQN is empty or holds a NUL")
    raw = nqn.encode()
    if len(raw) > MAX_NQN_BYTES:
        raise ValueError(f"the {which} NQN is {len(raw)} bytes; an NQN is at most "
                         f"{MAX_NQN_BYTES}")
    return raw


# --- the derivations ---------------------------------------------------------------------


def retained_psk(configured: ConfiguredPsk, hostnqn: str, *, compat: bool = False) -> bytes:
    """The retained PSK: HKDF-Expand-Label(HKDF-Extract(0, PSK), "HostNQN", hostnqn, len),
    or the configured PSK itself when its hash is NONE."""
    host = _nqn_bytes(hostnqn, "host")
    if configured.hash_id == PskHash.NONE:
        return configured.key
    length = len(configured.key)
    info = (_compat_info(length, "HostNQN", host) if compat
            else hkdf_label(length, "HostNQN", host))
    return _hkdf(configured.hash_id, configured.key, info, length)


def psk_digest(retained: bytes, cipher: PskHash, hostnqn: str, subnqn: str) -> str:
    """Base64 of HMAC(retained, "<hostnqn> <subnqn> NVMe-over-Fabrics"), identity version 1's
    last field."""
    message = (_nqn_bytes(hostnqn, "host") + b" " + _nqn_bytes(subnqn, "subsystem")
               + b" NVMe-over-Fabrics")
    return base64.b64encode(hmac.new(retained, message, HASH_NAMES[cipher]).digest()).decode()


def psk_identity(version: int, cipher: PskHash, hostnqn: str, subnqn: str,
                 digest: str | None = None) -> str:
    """``NVMe0R0h <hostnqn> <subnqn>``, or ``NVMe1R0h <hostnqn> <subnqn> <digest>``."""
    _nqn_bytes(hostnqn, "host")
    _nqn_bytes(subnqn, "subsystem")
    if version == 0:
        return f"NVMe0R{cipher:02d} {hostnqn} {subnqn}"
    if version != 1:
        raise ValueError(f"PSK identity version {version} is not 0 or 1")
    if not digest:
        raise ValueError("PSK identity version 1 needs the PSK digest")
    return f"NVMe1R{cipher:02d} {hostnqn} {subnqn} {digest}"


def tls_psk(retained: bytes, cipher: PskHash, version: int, context: str, *,
            compat: bool = False) -> bytes:
    """The TLS PSK: HKDF-Expand-Label(HKDF-Extract(0, retained), "nvme-tls-psk", C, len).

    C is the whole identity for version 0, and "0h <digest>" for version 1 (the
    kernel's ``nvme_auth_derive_tls_psk``); ``context`` is that identity or digest.
    """
    if version == 0:
        ctx = context.encode()
    elif version == 1:
        ctx = f"{cipher:02d} {context}".encode()
    else:
        raise ValueError(f"PSK identity version {version} is not 0 or 1")
    length = len(retained)
    try:
        info = (_compat_info(length, "nvme-tls-psk", ctx) if compat
                else hkdf_label(length, "nvme-tls-psk", ctx))
    except ValueError:
        limit = MAX_COMPAT_CONTEXT if compat else MAX_HKDF_CONTEXT
        raise ValueError(f"the PSK identity is {len(ctx)} bytes; version {version}'s TLS PSK "
                         f"takes it as an HKDF context of at most {limit} (libnvme refuses it "
                         "too): shorter NQNs, or identity version 1") from None
    return _hkdf(cipher, retained, info, length)


def derive(configured: ConfiguredPsk, hostnqn: str, subnqn: str, *, version: int = 0,
           compat: bool = False) -> TlsPsk:
    """The identity and TLS PSK a host offers for ``configured`` (libnvme's
    ``derive_nvme_keys``, which ``nvme gen-tls-key --insert`` loads into the keyring)."""
    if version not in IDENTITY_VERSIONS:
        raise ValueError(f"PSK identity version {version} is not 0 or 1")
    retained = retained_psk(configured, hostnqn, compat=compat)
    cipher = configured.cipher
    digest = psk_digest(retained, cipher, hostnqn, subnqn) if version == 1 else None
    identity = psk_identity(version, cipher, hostnqn, subnqn, digest)
    key = tls_psk(retained, cipher, version, digest if digest else identity, compat=compat)
    return TlsPsk(identity, key, cipher)


# --- PSKs in the kernel keyring ----------------------------------------------------------

KERNEL_DEFAULT_ORDER = ((False, PskHash.SHA384), (False, PskHash.SHA256),
                        (True, PskHash.SHA384), (True, PskHash.SHA256))
"""The identities the kernel offers when ``nvme connect --tls`` names no key
(``nvme_tls_psk_default``): retained before generated, SHA-384 before SHA-256."""


def default_identities(hostnqn: str, subnqn: str) -> list[str]:
    """The version-0 identities the kernel looks up in its keyring, in its order."""
    return [f"NVMe0{'G' if generated else 'R'}{cipher:02d} {hostnqn} {subnqn}"
            for generated, cipher in KERNEL_DEFAULT_ORDER]


def identity_cipher(identity: str) -> PskHash:
    """The hash (and so the suite) a PSK identity names: ``NVMe<v><R|G><hh> ...``."""
    head = identity.split(" ", 1)[0]
    if (len(head) != 8 or not head.startswith("NVMe") or head[4] not in "01"
            or head[5] not in "RG" or head[6:] not in ("01", "02")):
        raise ValueError(f"is not an NVMe/TCP PSK identity (NVMe0R01 <hostnqn> <subnqn>, "
                         f"NVMe1R02 ... <digest>): it begins {head[:16]!r}")
    return PskHash(int(head[6:]))


def keyring_psk(identity: str, key: bytes) -> TlsPsk:
    """The TLS PSK a keyring holds under ``identity`` (what ``nvme gen-tls-key --insert``
    loaded: already derived, used as is)."""
    cipher = identity_cipher(identity)
    if len(key) != HASH_LENGTHS[cipher]:
        raise ValueError(f"holds {len(key)} bytes, but its identity names "
                         f"{HASH_NAMES[cipher].upper()} ({HASH_LENGTHS[cipher]} bytes)")
    return TlsPsk(identity, key, cipher)
