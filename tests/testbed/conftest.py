"""Integration tests against the real Linux nvmet target inside the testbed VM.

They run only under ``scripts/testbed run`` (which sets ``TESTBED_NQN`` and friends);
elsewhere they are skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from fabrics import Fabric, make_fabric


@dataclass(frozen=True)
class Testbed:
    nqn: str
    rdma_addr: str
    tcp_addr: str
    port: int
    out: str


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.testbed)


@pytest.fixture(scope="session")
def testbed() -> Testbed:
    if "TESTBED_NQN" not in os.environ:
        pytest.skip("needs the testbed VM: run via scripts/testbed run (scripts/test does)")
    env = os.environ
    return Testbed(env["TESTBED_NQN"], env["TESTBED_RDMA_ADDR"], env["TESTBED_TCP_ADDR"],
                   int(env["TESTBED_PORT"]), env["TESTBED_OUT"])


@pytest.fixture(scope="module", params=["rdma", "tcp"])
def fabric(request, testbed) -> Fabric:
    """The target over RDMA, then over NVMe/TCP (module-scoped: one mount per transport)."""
    return make_fabric(testbed, request.param)
