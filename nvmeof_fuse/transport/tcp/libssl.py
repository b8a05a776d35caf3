"""The libssl and libcrypto that Python's ``ssl`` module already loads, through ctypes.

Python 3.11's ``ssl`` has no PSK API (3.13 adds one) and pyOpenSSL none either, but the
OpenSSL behind ``ssl`` does all TLS 1.3 with an external PSK needs.  We bind only the
public API we use (:data:`SSL_FUNCTIONS`, :data:`CRYPTO_FUNCTIONS`), from the very
libraries ``_ssl`` was linked against (read from ``/proc/self/maps``), so no second
OpenSSL is loaded; :func:`missing` says which symbols a library lacks, and a test pins
them.  AES-GCM for the userspace record layer is libcrypto's EVP (:class:`Aead`).

ctypes releases the GIL around each call, so the record layer's threads encrypt on
several CPUs at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ssl  # noqa: F401 - loads _ssl, and with it the libssl we bind
from ctypes import POINTER, c_char_p, c_int, c_long, c_size_t, c_uint64, c_void_p

from ...errors import ConnectError

TLS1_3_VERSION = 0x0304
SSL_OP_ALLOW_NO_DHE_KEX = 1 << 10
SSL_OP_NO_TICKET = 1 << 14
SSL_CTRL_SET_MIN_PROTO_VERSION = 123
SSL_CTRL_SET_MAX_PROTO_VERSION = 124
SSL_CTRL_SET_READ_AHEAD = 41
SSL_VERIFY_PEER = 1
SSL_VERIFY_FAIL_IF_NO_PEER_CERT = 2
SSL_ERROR_SSL, SSL_ERROR_WANT_READ, SSL_ERROR_WANT_WRITE = 1, 2, 3
SSL_ERROR_SYSCALL, SSL_ERROR_ZERO_RETURN = 5, 6
EVP_CTRL_GCM_GET_TAG = 0x10
EVP_CTRL_GCM_SET_TAG = 0x11

PSK_USE_SESSION_CB = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, POINTER(c_void_p),
                                      POINTER(c_size_t), POINTER(c_void_p))
"""``int cb(SSL *, const EVP_MD *, const unsigned char **id, size_t *idlen, SSL_SESSION **)``"""
PSK_FIND_SESSION_CB = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, POINTER(c_void_p))
"""``int cb(SSL *, const unsigned char *identity, size_t len, SSL_SESSION **)``"""
KEYLOG_CB = ctypes.CFUNCTYPE(None, c_void_p, c_char_p)
"""``void cb(const SSL *, const char *line)``"""

SSL_FUNCTIONS = {
    "TLS_client_method": ([], c_void_p),
    "TLS_server_method": ([], c_void_p),
    "SSL_CTX_new": ([c_void_p], c_void_p),
    "SSL_CTX_free": ([c_void_p], None),
    "SSL_CTX_ctrl": ([c_void_p, c_int, c_long, c_void_p], c_long),
    "SSL_CTX_set_options": ([c_void_p, c_uint64], c_uint64),
    "SSL_CTX_set_ciphersuites": ([c_void_p, c_char_p], c_int),
    "SSL_CTX_set_num_tickets": ([c_void_p, c_size_t], c_int),
    "SSL_CTX_set_verify": ([c_void_p, c_int, c_void_p], None),
    "SSL_CTX_set_psk_use_session_callback": ([c_void_p, PSK_USE_SESSION_CB], None),
    "SSL_CTX_set_psk_find_session_callback": ([c_void_p, PSK_FIND_SESSION_CB], None),
    "SSL_CTX_set_keylog_callback": ([c_void_p, KEYLOG_CB], None),
    "SSL_new": ([c_void_p], c_void_p),
    "SSL_free": ([c_void_p], None),
    "SSL_set_fd": ([c_void_p, c_int], c_int),
    "SSL_connect": ([c_void_p], c_int),
    "SSL_accept": ([c_void_p], c_int),
    "SSL_get_error": ([c_void_p, c_int], c_int),
    "SSL_read": ([c_void_p, c_void_p, c_int], c_int),
    "SSL_write": ([c_void_p, c_void_p, c_int], c_int),
    "SSL_pending": ([c_void_p], c_int),
    "SSL_has_pending": ([c_void_p], c_int),
    "SSL_shutdown": ([c_void_p], c_int),
    "SSL_session_reused": ([c_void_p], c_int),
    "SSL_version": ([c_void_p], c_int),
    "SSL_get_current_cipher": ([c_void_p], c_void_p),
    "SSL_CIPHER_get_name": ([c_void_p], c_char_p),
    "SSL_CIPHER_find": ([c_void_p, c_char_p], c_void_p),
    "SSL_SESSION_new": ([], c_void_p),
    "SSL_SESSION_free": ([c_void_p], None),
    "SSL_SESSION_set1_master_key": ([c_void_p, c_char_p, c_size_t], c_int),
    "SSL_SESSION_set_cipher": ([c_void_p, c_void_p], c_int),
    "SSL_SESSION_set_protocol_version": ([c_void_p, c_int], c_int),
}
"""Every libssl function used, with its C signature."""

CRYPTO_FUNCTIONS = {
    "ERR_get_error": ([], ctypes.c_ulong),
    "ERR_clear_error": ([], None),
    "ERR_reason_error_string": ([ctypes.c_ulong], c_char_p),
    "EVP_aes_128_gcm": ([], c_void_p),
    "EVP_aes_256_gcm": ([], c_void_p),
    "EVP_CIPHER_CTX_new": ([], c_void_p),
    "EVP_CIPHER_CTX_free": ([c_void_p], None),
    "EVP_CIPHER_CTX_ctrl": ([c_void_p, c_int, c_int, c_void_p], c_int),
    "EVP_EncryptInit_ex": ([c_void_p, c_void_p, c_void_p, c_char_p, c_char_p], c_int),
    "EVP_EncryptUpdate": ([c_void_p, c_void_p, POINTER(c_int), c_void_p, c_int], c_int),
    "EVP_EncryptFinal_ex": ([c_void_p, c_void_p, POINTER(c_int)], c_int),
    "EVP_DecryptInit_ex": ([c_void_p, c_void_p, c_void_p, c_char_p, c_char_p], c_int),
    "EVP_DecryptUpdate": ([c_void_p, c_void_p, POINTER(c_int), c_void_p, c_int], c_int),
    "EVP_DecryptFinal_ex": ([c_void_p, c_void_p, POINTER(c_int)], c_int),
}
"""Every libcrypto function used, with its C signature."""

CIPHER_IDS = {"TLS_AES_128_GCM_SHA256": b"\x13\x01", "TLS_AES_256_GCM_SHA384": b"\x13\x02"}


def _loaded_path(stem: str) -> str | None:
    """The path of the ``stem`` library (``libssl.so``) this process has mapped, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if f"/{stem}." in path:
                    return path
    except OSError:
        pass
    return None


def _open(stem: str, name: str) -> ctypes.CDLL:
    path = _loaded_path(stem) or ctypes.util.find_library(name)
    if path is None:
        raise ConnectError(f"TLS needs OpenSSL's {stem}, which this system lacks")
    return ctypes.CDLL(path, use_errno=True)


def missing(lib: ctypes.CDLL, functions: dict) -> list[str]:
    """The names in ``functions`` that ``lib`` does not export."""
    return [name for name in functions if not hasattr(lib, name)]


def _bind(lib: ctypes.CDLL, functions: dict, what: str):
    lacking = missing(lib, functions)
    if lacking:
        raise ConnectError(f"TLS for NVMe/TCP needs OpenSSL 3.0 or newer: {what} "
                           f"({lib._name}) lacks {', '.join(lacking)}")
    for name, (argtypes, restype) in functions.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return lib


_libs: tuple[ctypes.CDLL, ctypes.CDLL] | None = None


def libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """(libssl, libcrypto), bound; ConnectError in one line when a symbol is missing."""
    global _libs
    if _libs is None:
        ssl_lib = _bind(_open("libssl.so", "ssl"), SSL_FUNCTIONS, "libssl")
        crypto = _bind(_open("libcrypto.so", "crypto"), CRYPTO_FUNCTIONS, "libcrypto")
        _libs = (ssl_lib, crypto)
    return _libs


def last_error() -> str:
    """OpenSSL's reason for the last failure on this thread (its queue emptied)."""
    _, crypto = libs()
    reasons = []
    while code := crypto.ERR_get_error():
        text = crypto.ERR_reason_error_string(code)
        reasons.append(text.decode() if text else f"error {code:#x}")
    return reasons[0] if reasons else ""


class Aead:
    """AES-GCM of one direction (its key set once; a nonce per record), by libcrypto."""

    def __init__(self, key: bytes, encrypt: bool) -> None:
        _, crypto = libs()
        self._crypto = crypto
        self._ctx = crypto.EVP_CIPHER_CTX_new()
        if not self._ctx:
            raise MemoryError("EVP_CIPHER_CTX_new failed")
        cipher = crypto.EVP_aes_128_gcm() if len(key) == 16 else crypto.EVP_aes_256_gcm()
        init = crypto.EVP_EncryptInit_ex if encrypt else crypto.EVP_DecryptInit_ex
        if init(self._ctx, cipher, None, key, None) != 1:
            self.close()
            raise ValueError(f"AES-GCM refused the key: {last_error()}")
        self._outlen = c_int()

    def seal(self, nonce: bytes, aad: bytes, data, out) -> None:
        """Encrypt ``data`` into ``out`` (its length plus the 16-byte tag; may be ``data``'s
        own memory)."""
        c = self._crypto
        n = len(data)
        src = _address(data)
        dst = _address(out)
        if (c.EVP_EncryptInit_ex(self._ctx, None, None, None, nonce) != 1
                or c.EVP_EncryptUpdate(self._ctx, None, ctypes.byref(self._outlen), aad,
                                       len(aad)) != 1
                or c.EVP_EncryptUpdate(self._ctx, dst, ctypes.byref(self._outlen), src, n) != 1
                or c.EVP_EncryptFinal_ex(self._ctx, dst + n, ctypes.byref(self._outlen)) != 1
                or c.EVP_CIPHER_CTX_ctrl(self._ctx, EVP_CTRL_GCM_GET_TAG, 16, dst + n) != 1):
            raise ValueError(f"AES-GCM encryption failed: {last_error()}")

    def open(self, nonce: bytes, aad: bytes, data) -> bool:
        """Decrypt ``data`` (ciphertext, then the tag) in place; False when it fails its
        tag (the plaintext is then garbage)."""
        c = self._crypto
        n = len(data) - 16
        at = _address(data)
        if (c.EVP_DecryptInit_ex(self._ctx, None, None, None, nonce) != 1
                or c.EVP_DecryptUpdate(self._ctx, None, ctypes.byref(self._outlen), aad,
                                       len(aad)) != 1
                or c.EVP_DecryptUpdate(self._ctx, at, ctypes.byref(self._outlen), at, n) != 1
                or c.EVP_CIPHER_CTX_ctrl(self._ctx, EVP_CTRL_GCM_SET_TAG, 16, at + n) != 1):
            raise ValueError(f"AES-GCM decryption failed: {last_error()}")
        ok = c.EVP_DecryptFinal_ex(self._ctx, at + n, ctypes.byref(self._outlen)) == 1
        if not ok:
            c.ERR_clear_error()
        return ok

    def close(self) -> None:
        if self._ctx:
            self._crypto.EVP_CIPHER_CTX_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        self.close()


def _address(buffer) -> int:
    """The address of a writable buffer (a bytearray or a memoryview of one)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
