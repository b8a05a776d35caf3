"""The kernel keyring through the real system calls: a keyring found by name or serial, keys
searched, read and added; every failure one line naming the keyring or key, never a key."""

from __future__ import annotations

import pytest

from nvmeof_fuse.host import keyring

PROC_KEYS = """\
0c1cb7e3 I------     1 perm 1f0b0000     0     0 keyring   .builtin_trusted_keys: empty
1234abcd I------     1 perm 3f3b0000     0     0 keyring   .nvme: 2
2345bcde I--Q---     1 perm 3f010000     0     0 psk       NVMe0R01 nqn.h nqn.s: 32
3456cdef I------     1 perm 1f0b0000     0     0 keyring   a name: with colons: empty
"""


def test_a_keyring_is_found_by_name_in_proc_keys_or_taken_as_a_serial(tmp_path):
    proc = tmp_path / "keys"
    proc.write_text(PROC_KEYS)
    assert keyring.find_keyring(".nvme", str(proc)) == 0x1234ABCD
    assert keyring.find_keyring("a name: with colons", str(proc)) == 0x3456CDEF
    assert keyring.find_keyring("0x1234abcd", str(proc)) == 0x1234ABCD
    assert keyring.find_keyring("305441741", str(proc)) == 0x1234ABCD
    with pytest.raises(keyring.KeyringError, match=r"^keyring NVMe0R01 nqn.h nqn.s not found"):
        keyring.find_keyring("NVMe0R01 nqn.h nqn.s", str(proc))  # a key, not a keyring
    proc.write_text("")
    with pytest.raises(keyring.KeyringError, match=r"keyring \.nvme not found in .* \(load "
                       r"nvme-keyring, or nvme-tcp, first\), or this user may not see it"):
        keyring.find_keyring(".nvme", str(proc))


def test_no_proc_keys_is_one_line(tmp_path):
    with pytest.raises(keyring.KeyringError, match=r"keyring \.nvme: cannot read .*/none \(No "
                       "such file or directory\\); the kernel may lack CONFIG_KEYS"):
        keyring.find_keyring(".nvme", str(tmp_path / "none"))


def test_keys_are_added_found_and_read_back(own_keyring):
    name, serial = own_keyring
    assert keyring.find_keyring(name) == serial  # through the real /proc/keys
    assert keyring.search(serial, "NVMe0R01 h s", "user") is None
    key = keyring.add(serial, "NVMe0R01 h s", b"\x00k" * 16, "user")
    assert keyring.search(serial, "NVMe0R01 h s", "user") == key
    assert keyring.read(key) == b"\x00k" * 16
    again = keyring.add(serial, "NVMe0R01 h s", b"n" * 32, "user")  # replaces it
    assert again == key and keyring.read(key) == b"n" * 32


def test_failures_name_the_key_and_never_hold_it(own_keyring):
    _, serial = own_keyring
    with pytest.raises(keyring.KeyringError, match=r"^reading key 0x7ffffff0: "):
        keyring.read(0x7FFFFFF0)
    with pytest.raises(keyring.KeyringError, match=r"^adding no-such-type key 'k' to keyring "):
        keyring.add(serial, "k", b"secret-bytes", "no-such-type")
    assert keyring.search(0x7FFFFFF0, "k", "user") is None  # no such keyring: no such key
    key = keyring.add(serial, "k", b"x", "user")
    with pytest.raises(keyring.KeyringError, match=rf"^searching keyring {key:#x} for user key "
                       "'k': Not a directory"):
        keyring.search(key, "k", "user")  # a key, not a keyring
