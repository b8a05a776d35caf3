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
    tls_port: int = 0
    """nvmet port 4's service id: tcp with TLS 1.3 required, tlshd doing its handshakes
    (issue #58); 0 where the testbed has no TLS target (``tls_unavailable`` says why)."""
    tls_unavailable: str = ""
    nvme_tls: str = ""
    """trixie's nvme-cli (2.13: ``connect --tls``, ``gen-tls-key --insert``)."""


SLOW_IN_CI = {
    # test (as pytest names it in this folder) -> what proves its case in the default run.
    # `scripts/test` leaves these out to stay under 30 minutes; `scripts/test -m ''` runs them.
    "test_fs.py::test_bad_mounts_fail_in_one_line[tcp]":
        "[rdma] here; refused and unreachable TCP ports: tests/transport/tcp/test_transport.py",
    "test_fs.py::test_sigint_sigterm_and_fusermount_each_flush_unmount_and_disconnect[tcp]":
        "[rdma] here; the three stops over TCP: tests/hostile/test_lifecycle.py",
    "test_lifecycle.py::test_the_kernel_initiators_give_up_with_the_same_options_for_"
    "comparison[rdma]": "a measurement of the kernel's initiator, not a check of ours",
    "test_lifecycle.py::test_the_kernel_initiators_give_up_with_the_same_options_for_"
    "comparison[tcp]": "a measurement of the kernel's initiator, not a check of ours",
    "test_lifecycle.py::test_writes_land_and_a_normal_unmount_shuts_the_controller_down_in_"
    "order[tcp]": "[rdma]: the orderly shutdown is Property Sets, the same over both",
    "test_reconnect.py::test_io_fails_by_name_once_ctrl_loss_tmo_passes[rdma]":
        "test_lifecycle.py::test_ctrl_loss_tmo_bounds_the_give_up_while_the_port_is_unlinked",
    "test_reconnect.py::test_io_fails_by_name_once_ctrl_loss_tmo_passes[tcp]":
        "test_lifecycle.py::test_ctrl_loss_tmo_bounds_the_give_up_while_the_port_is_unlinked",
    "test_reconnect.py::test_fio_verify_writes_at_depth_ride_out_an_outage[rdma]":
        "test_fio_and_companion_clients_ride_out_an_outage[rdma] (fio verify writes at QD16)",
    "test_workers.py::test_a_worker_killed_under_load_is_replaced_on_its_queue_ids[tcp]":
        "[rdma]; tests/workers/test_workers.py",
    "test_multipath.py::test_a_path_to_another_subsystem_or_namespace_is_refused_in_one_"
    "line": "tests/host/multipath/test_head.py and tests/hostile/test_identity.py",
    "test_auth.py::test_secret_files_are_checked_and_fstab_takes_only_files":
        "tests/cli (the file checks); test_admin.py (an fstab mount through mount(8))",
    "test_companion.py::test_a_cuda_allocation_is_registered_once_and_released_on_close"
    "[tcp-own-queues]": "[rdma-own-queues]; over TCP: tests/companion/cuda/test_gpu.py",
    "test_events.py::test_a_namespace_grown_on_the_target_shows_its_new_size":
        "test_a_namespace_grown_while_fuse_workers_serve_is_read_whole_by_each",
    "test_final_flush.py::test_unmount_flushes_just_the_namespaces_written_and_their_data_"
    "stays[rdma]": "[tcp]: which namespaces are flushed is above the transports",
}


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.testbed)
            if f"{os.path.basename(str(item.fspath))}::{item.name}" in SLOW_IN_CI:
                item.add_marker(pytest.mark.slow)


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
                   env.get("TESTBED_RAIL_ADDR", ""),
                   int(env.get("TESTBED_TLS_PORT", 0)) if "TESTBED_NVME_TLS" in env else 0,
                   env.get("TESTBED_TLS_UNAVAILABLE", ""), env.get("TESTBED_NVME_TLS", ""))


@pytest.fixture(scope="module", params=["rdma", "tcp"])
def fabric(request, testbed) -> Fabric:
    """The target over RDMA, then over NVMe/TCP (module-scoped: one mount per transport)."""
    return make_fabric(testbed, request.param)
