"""Fixtures the companion tests share."""

from __future__ import annotations

import pytest
from fake_cuda import FakeDriver, install

from nvmeof_fuse.companion.cuda import gpu


@pytest.fixture
def cuda():
    """A fake CUDA driver behind the CUDA seam (strict about contexts): the driver."""
    driver, _ = install(FakeDriver())
    yield driver
    gpu.use(None)
