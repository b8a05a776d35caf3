"""Fixtures the companion tests share."""

from __future__ import annotations

import pytest
from companion_fakes import FakeCuda

from nvmeof_fuse.companion import gpu


@pytest.fixture
def cuda():
    fake = FakeCuda()
    gpu.use(fake)
    yield fake
    gpu.use(None)
