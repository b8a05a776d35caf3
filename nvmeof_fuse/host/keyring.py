"""The kernel keyring, where ``nvme gen-tls-key --insert`` leaves TLS PSKs for the kernel
initiator and tlshd: found by name, searched by PSK identity, read and written.

Straight system calls (``add_key``, ``keyctl``) through libc's ``syscall``, so no library
beyond libc is needed; keyrings are found by name in ``/proc/keys``, as libkeyutils'
``find_key_by_type_and_desc`` finds them.  Errors name the keyring and identity, never a key.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform

from ..errors import InvalidArgument

DEFAULT_KEYRING = ".nvme"
"""The kernel's own NVMe keyring (nvme-keyring.ko), nvme-cli's default."""
PSK_KEY_TYPE = "psk"
"""The key type nvme-keyring.ko registers for TLS PSKs."""
PROC_KEYS = "/proc/keys"
MAX_KEY_BYTES = 4096
"""A TLS PSK is 32 or 48 bytes: anything much longer is not one, and is not read."""

_KEYCTL_LINK = 8
_KEYCTL_SEARCH = 10
_KEYCTL_READ = 11
_SESSION_KEYRING = -3  # KEY_SPEC_SESSION_KEYRING
_SYSCALLS = {  # (add_key, keyctl) by machine
    "x86_64": (248, 250), "aarch64": (217, 219), "riscv64": (217, 219),
    "ppc64le": (269, 271), "s390x": (278, 280), "i686": (286, 288), "i386": (286, 288),
}
_NOT_FOUND = {errno.ENOKEY, errno.EKEYREVOKED, errno.EKEYEXPIRED}


class KeyringError(InvalidArgument):
    """A keyring or key could not be found or read: the message says which and why."""


def _numbers() -> tuple[int, int]:
    try:
        return _SYSCALLS[platform.machine()]
    except KeyError:
        raise KeyringError(f"the kernel keyring is not supported on {platform.machine()} "
                           "here: give the key with --tls-key") from None


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _call(number: int, *args: object) -> int:
    result = _libc().syscall(ctypes.c_long(number), *args)
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def find_keyring(name: str, proc_keys: str = PROC_KEYS) -> int:
    """The serial of the keyring named ``name`` (or given as a number, ``0x...`` too)."""
    try:
        return int(name, 0)
    except ValueError:
        pass
    try:
        with open(proc_keys, encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 22).splitlines()
    except OSError as exc:
        raise KeyringError(f"keyring {name}: cannot read {proc_keys} ({exc.strerror}); the "
                           "kernel may lack CONFIG_KEYS") from None
    for line in lines:
        fields = line.split(None, 8)
        if len(fields) == 9 and fields[7] == "keyring":
            description = fields[8].rsplit(": ", 1)[0]
            if description == name:
                return int(fields[0], 16)
    hint = " (load nvme-keyring, or nvme-tcp, first)" if name == DEFAULT_KEYRING else ""
    raise KeyringError(f"keyring {name} not found in {proc_keys}{hint}, or this user may "
                       "not see it")


def search(keyring: int, description: str, key_type: str | None = None) -> int | None:
    """The serial of the key of ``key_type`` (``psk``) named ``description`` in ``keyring``
    (or the keyrings it links); None if it holds none, or only a revoked or expired one."""
    key_type = key_type or PSK_KEY_TYPE
    _possess(keyring)
    try:
        return _call(_numbers()[1], ctypes.c_long(_KEYCTL_SEARCH), ctypes.c_long(keyring),
                     key_type.encode(), description.encode(), ctypes.c_long(0))
    except OSError as exc:
        if exc.errno in _NOT_FOUND:
            return None
        raise KeyringError(f"searching keyring {keyring:#x} for {key_type} key "
                           f"{description!r}: {exc.strerror}") from None


def _possess(keyring: int) -> None:
    """Link ``keyring`` into our session keyring, as libnvme does before a search: the keys
    nvme-cli and the kernel put in ``.nvme`` give their owner view and read, but search only
    to a possessor.  A failure leaves the search to say what is wrong."""
    try:
        _call(_numbers()[1], ctypes.c_long(_KEYCTL_LINK), ctypes.c_long(keyring),
              ctypes.c_long(_SESSION_KEYRING))
    except OSError:
        pass


def read(key: int) -> bytes:
    """The payload of key ``key`` (at most :data:`MAX_KEY_BYTES`)."""
    buffer = ctypes.create_string_buffer(MAX_KEY_BYTES)
    try:
        length = _call(_numbers()[1], ctypes.c_long(_KEYCTL_READ), ctypes.c_long(key),
                       buffer, ctypes.c_long(MAX_KEY_BYTES))
    except OSError as exc:
        raise KeyringError(f"reading key {key:#x}: {exc.strerror}") from None
    if length > MAX_KEY_BYTES:
        raise KeyringError(f"key {key:#x} holds {length} bytes: not a TLS PSK")
    return buffer.raw[:length]


def add(keyring: int, description: str, payload: bytes, key_type: str | None = None) -> int:
    """Put ``payload`` in ``keyring`` as a ``key_type`` (``psk``) key named ``description``
    (replacing a key of that name): its serial."""
    key_type = key_type or PSK_KEY_TYPE
    try:
        return _call(_numbers()[0], key_type.encode(), description.encode(), payload,
                     ctypes.c_size_t(len(payload)), ctypes.c_long(keyring))
    except OSError as exc:
        raise KeyringError(f"adding {key_type} key {description!r} to keyring "
                           f"{keyring:#x}: {exc.strerror}") from None
