"""Integration tests against the real Linux nvmet target inside the testbed VM.

They run under ``scripts/testbed run`` (which sets ``TESTBED_NQN`` and friends).  Elsewhere
they fail, so that a run that never reached the target cannot pass; on the host, deselect
them with ``-m 'not testbed'`` or ``--ignore=tests/testbed``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from fabrics import Fabric, make_fabric

TESTBED_VARIABLES = ("TESTBED_NQN", "TESTBED_RDMA_ADDR", "TESTBED_TCP_ADDR", "TESTBED_PORT",
                     "TESTBED_OUT")


@dataclass(frozen=True)
class Testbed:
    nqn: str
    rdma_addr: str
    tcp_addr: str
    port: int
    out: str
    rail_addr: str = ""
    """rdma on the second Soft-RoCE device (rxe1), nvmet port 3 (issue #59)."""


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.testbed)


@pytest.fixture(scope="session")
def testbed() -> Testbed:
    env = os.environ
    missing = [name for name in TESTBED_VARIABLES if name not in env]
    if missing:
        pytest.fail(f"{', '.join(missing)} not set: VM tests run inside the testbed "
                    "(scripts/testbed run ...); deselect them with -m 'not testbed'",
                    pytrace=False)
    return Testbed(env["TESTBED_NQN"], env["TESTBED_RDMA_ADDR"], env["TESTBED_TCP_ADDR"],
                   int(env["TESTBED_PORT"]), env["TESTBED_OUT"],
                   env.get("TESTBED_RAIL_ADDR", ""))


@pytest.fixture(scope="module", params=["rdma", "tcp"])
def fabric(request, testbed) -> Fabric:
    """The target over RDMA, then over NVMe/TCP (module-scoped: one mount per transport)."""
    return make_fabric(testbed, request.param)
