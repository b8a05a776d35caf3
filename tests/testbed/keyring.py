"""The kernel's ``.nvme`` keyring, where nvmet and the kernel initiator find TLS PSKs by their
identity (type ``psk``): add a key, read one back.  The add_key and keyctl system calls by
ctypes (Python has no binding and the guest no keyutils)."""

from __future__ import annotations

import ctypes
import os

SYS_ADD_KEY = 248  # x86_64
SYS_KEYCTL = 250
KEYCTL_LINK = 8
KEYCTL_READ = 11
KEY_SPEC_SESSION_KEYRING = -3
NVME_KEYRING = ".nvme"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def serial(description: str, key_type: str = "keyring") -> int:
    """The serial of the key of ``key_type`` described ``description``, from /proc/keys."""
    with open("/proc/keys") as f:
        for line in f:
            fields = line.split(None, 8)
            if len(fields) == 9 and fields[7] == key_type \
                    and fields[8].rsplit(":", 1)[0] == description:
                return int(fields[0], 16)
    raise LookupError(f"no {key_type} key {description!r} in /proc/keys")


def add_psk(identity: str, psk: bytes) -> int:
    """``psk`` into ``.nvme`` as a ``psk`` key described ``identity`` (what nvme-cli's
    ``gen-tls-key --insert`` does with the key it derives); its serial."""
    return _check(_libc.syscall(SYS_ADD_KEY, b"psk", identity.encode(), psk,
                                ctypes.c_size_t(len(psk)),
                                ctypes.c_int(serial(NVME_KEYRING))), "add_key")


def read_psk(identity: str) -> bytes:
    """The PSK ``.nvme`` holds for ``identity``.  A ``psk`` key is readable by its possessor
    only, so ``.nvme`` is linked into this process's session keyring first, as tlshd does."""
    key = serial(identity, "psk")
    _check(_libc.syscall(SYS_KEYCTL, KEYCTL_LINK, ctypes.c_int(serial(NVME_KEYRING)),
                         ctypes.c_int(KEY_SPEC_SESSION_KEYRING)), "keyctl link")
    buf = ctypes.create_string_buffer(64)
    n = _check(_libc.syscall(SYS_KEYCTL, KEYCTL_READ, ctypes.c_int(key), buf,
                             ctypes.c_size_t(len(buf))), "keyctl read")
    return buf.raw[:n]
