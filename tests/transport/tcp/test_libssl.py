"""The libssl and libcrypto Python's ssl loads: every symbol we rely on, and AES-GCM."""

from __future__ import annotations

import os

import pytest

from nvmeof_fuse.transport.tcp import libssl


def test_the_loaded_openssl_has_every_symbol_we_rely_on():
    """Fails loudly, naming them, if an OpenSSL update drops or renames what we call."""
    ssl_lib, crypto = libssl.libs()
    assert libssl.missing(ssl_lib, libssl.SSL_FUNCTIONS) == []
    assert libssl.missing(crypto, libssl.CRYPTO_FUNCTIONS) == []


def test_it_binds_the_libssl_python_already_loaded():
    ssl_lib, _ = libssl.libs()
    assert ssl_lib._name == libssl._loaded_path("libssl.so")


def test_a_library_lacking_a_symbol_is_refused_in_one_line():
    ssl_lib, _ = libssl.libs()
    with pytest.raises(Exception, match="lacks SSL_no_such_function") as info:
        libssl._bind(ssl_lib, {"SSL_no_such_function": ([], None)}, "libssl")
    assert "\n" not in str(info.value)


# NIST GCM test vector (McGrew-Viega test case 4: AES-128, 60-byte plaintext, 20-byte AAD).
GCM_KEY = bytes.fromhex("feffe9928665731c6d6a8f9467308308")
GCM_IV = bytes.fromhex("cafebabefacedbaddecaf888")
GCM_PT = bytes.fromhex("d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
                       "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b39")
GCM_AAD = bytes.fromhex("feedfacedeadbeeffeedfacedeadbeefabaddad2")
GCM_CT = bytes.fromhex("42831ec2217774244b7221b784d0d49ce3aa212f2c02a4e035c17e2329aca12e"
                       "21d514b25466931c7d8f6a5aac84aa051ba30b396a0aac973d58e091")
GCM_TAG = bytes.fromhex("5bc94fbc3221a5db94fae95ae7121a47")


def test_aead_seals_and_opens_nists_vector_in_place():
    buf = bytearray(GCM_PT + bytes(16))
    view = memoryview(buf)
    libssl.Aead(GCM_KEY, True).seal(GCM_IV, GCM_AAD, view[:len(GCM_PT)], view)
    assert bytes(buf) == GCM_CT + GCM_TAG
    assert libssl.Aead(GCM_KEY, False).open(GCM_IV, GCM_AAD, view)
    assert bytes(buf[:len(GCM_PT)]) == GCM_PT


def test_aead_open_fails_on_a_bad_tag():
    buf = bytearray(GCM_CT + GCM_TAG)
    buf[0] ^= 1
    assert not libssl.Aead(GCM_KEY, False).open(GCM_IV, GCM_AAD, memoryview(buf))


def test_aead_with_a_256_bit_key_round_trips():
    key, data = os.urandom(32), bytearray(os.urandom(1000) + bytes(16))
    plain = bytes(data[:1000])
    view = memoryview(data)
    libssl.Aead(key, True).seal(bytes(12), b"aad", view[:1000], view)
    assert bytes(data[:1000]) != plain
    assert libssl.Aead(key, False).open(bytes(12), b"aad", view)
    assert bytes(data[:1000]) == plain
