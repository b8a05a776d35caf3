"""A keyring of this test process's own (the kernel's, through the real system calls), for
tests of what nvmeof-fuse finds, reads and loads there.  The kernel's ``psk`` key type exists
only where nvme-keyring.ko is loaded (the testbed VM): host tests use ``user`` keys, which
the same calls treat alike."""

from __future__ import annotations

import itertools
import os

import pytest

from nvmeof_fuse.host import keyring

PROCESS_KEYRING = -2  # KEY_SPEC_PROCESS_KEYRING
_names = itertools.count()


@pytest.fixture
def own_keyring() -> tuple[str, int]:
    """A fresh keyring linked to this process: (its name, its serial)."""
    name = f"nvmeof-fuse-test-{os.getpid()}-{next(_names)}"
    try:
        serial = keyring.add(PROCESS_KEYRING, name, b"", "keyring")
    except keyring.KeyringError as exc:
        pytest.skip(f"no kernel keyrings here: {exc}")
    return name, serial
