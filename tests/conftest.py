"""What every test shares: the log's rate limits start afresh, as in a new daemon, so that a
test's lines do not depend on those of the tests before it in the same process."""

from __future__ import annotations

import pytest

from nvmeof_fuse import ratelimit

pytest_plugins = ["keyrings"]  # own_keyring: a keyring of the test process


@pytest.fixture(autouse=True)
def fresh_rate_limits():
    ratelimit.forget_all()
    yield
