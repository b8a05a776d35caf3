"""A keyring of this test process's own (the kernel's, through the real system calls), for
tests of what nvmeof-fuse finds, reads and loads there.  The kernel's ``psk`` key type exists
only where nvme-keyring.ko is loaded (the testbed VM): host tests use ``user`` keys, which
the same calls treat alike."""

from __future__ import annotations

import ctypes
import itertools
import os

import pytest

from nvmeof_fuse.host import keyring

PROCESS_KEYRING = -2  # KEY_SPEC_PROCESS_KEYRING
KEYCTL_JOIN_SESSION_KEYRING = 1
_names = itertools.count()
_joined: list[bool] = []


def _own_session_keyring() -> None:
    """A new anonymous session keyring for this process, once: the keyrings a search links
    into the session (as libnvme does) then go with the process, not into the user's."""
    if not _joined:
        keyring._call(keyring._numbers()[1], ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None)
        _joined.append(True)


@pytest.fixture
def own_keyring() -> tuple[str, int]:
    """A fresh keyring linked to this process: (its name, its serial)."""
    name = f"nvmeof-fuse-test-{os.getpid()}-{next(_names)}"
    try:
        _own_session_keyring()
        serial = keyring.add(PROCESS_KEYRING, name, b"", "keyring")
    except (keyring.KeyringError, OSError) as exc:
        pytest.skip(f"no kernel keyrings here: {exc}")
    return name, serial
