"""The forwarded-target tests need the testbed up (scripts/test raises it): marked ``testbed``,
so ``pytest -m 'not testbed'`` leaves them out like the VM tests."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.testbed)
