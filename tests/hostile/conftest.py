"""The ``hostile`` fixture (tests/hostile_harness.py); every test here needs FUSE."""

from __future__ import annotations

import pytest
from hostile_harness import Hostile, needs_fuse


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/hostile/" in str(item.fspath):
            item.add_marker(needs_fuse)


@pytest.fixture
def hostile(tmp_path):
    h = Hostile(tmp_path)
    try:
        yield h
    finally:
        h.close()
