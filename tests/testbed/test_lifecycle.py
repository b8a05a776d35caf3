"""Issue #56 items 2, 3 and 7 against nvmet, where the hostile fakes cannot speak for a real
target: its R2Ts satisfy the check that a write's success counts its data, a normal unmount
still shuts the controller down in order (CSTS.SHST confirmed, nothing skipped), and
``--ctrl-loss-tmo`` bounds the give-up while the subsystem is off its port."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import subprocess
import time

import pytest
from kernel_initiator import _controllers, connected
from vm import NVMET_PORTS, sh, target_away, wait_for

MNT = "/tmp/nvmeof-lifecycle"
EXIT_BOUND = 15.0  # s: an unmount ends the daemon within this (issue #56)
CONNECT_TIMEOUT = 10  # s: ConnectOptions.connect_timeout


@contextlib.contextmanager
def mounted(testbed, log: str, *options: str, transport: str):
    os.makedirs(MNT, exist_ok=True)
    addr = testbed.rdma_addr if transport == "rdma" else testbed.tcp_addr
    sh("nvmeof-fuse", "mount", "-t", transport, "-a", addr, "-s", str(testbed.port),
       "-n", testbed.nqn, "--daemon", "--log-file", log, *options, MNT, timeout=600)
    try:
        yield MNT
    finally:
        subprocess.run(["fusermount3", "-u", MNT], capture_output=True, timeout=120)
        wait_for(lambda: not any(f" {MNT} " in line for line in open("/proc/mounts")), 60)


def log_text(log: str) -> str:
    with open(log) as f:
        return f.read()


def record(name: str, value) -> None:
    """Keep a measured figure in TESTBED_OUT/lifecycle-figures.json (it comes back to the
    host), for docs/; the tests assert on their own."""
    out = os.environ.get("TESTBED_OUT")
    if not out:
        return
    path = os.path.join(out, "lifecycle-figures.json")
    figures = json.load(open(path)) if os.path.exists(path) else {}
    figures.setdefault(name, []).append(value)
    with open(path, "w") as f:
        json.dump(figures, f, indent=1)


@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_writes_land_and_a_normal_unmount_shuts_the_controller_down_in_order(
        testbed, tmp_path, transport):
    log = str(tmp_path / "daemon.log")
    data = os.urandom(1 << 20)  # past the in-capsule data: nvmet asks for it by R2T (TCP)
    with mounted(testbed, log, transport=transport) as mnt:
        with open(f"{mnt}/n2", "r+b", buffering=0) as f:
            os.pwrite(f.fileno(), data, 4096)
            os.fsync(f.fileno())
        fd = os.open(f"{mnt}/n2", os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, len(data))
            assert os.preadv(fd, [buf], 4096) == len(data)
            assert bytes(buf) == data
        finally:
            os.close(fd)
        start = time.monotonic()
        sh("fusermount3", "-u", mnt)
        assert wait_for(lambda: "disconnected from" in log_text(log), EXIT_BOUND), log_text(log)
        took = time.monotonic() - start
    text = log_text(log)
    last = text.strip().splitlines()[-1]
    assert re.fullmatch(rf"nvmeof-fuse: disconnected from {re.escape(testbed.nqn)}", last), text
    assert "not confirmed" not in text and "orderly shutdown" not in text, text
    assert "claims success" not in text and "Traceback" not in text, text
    assert took < EXIT_BOUND, (took, text)
    record(f"{transport}: fusermount3 -u to the last line, s", round(took, 2))


@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_ctrl_loss_tmo_bounds_the_give_up_while_the_port_is_unlinked(testbed, tmp_path,
                                                                     transport):
    """-c 4 -l 6: Linux's count (ceil(6 / 4) = 2 tries, at 4 and 8 s) gave up after 8 s;
    the last try now comes at the end of --ctrl-loss-tmo, 6 s, and giving up takes no
    longer than that plus one connect timeout, however the target answers the tries."""
    log = str(tmp_path / "daemon.log")
    with mounted(testbed, log, "-k", "2", "-c", "4", "-l", "6", transport=transport) as mnt:
        with target_away(testbed.nqn, NVMET_PORTS[transport]):
            unlinked = time.monotonic()
            assert wait_for(lambda: "lost the connection" in log_text(log), 90), log_text(log)
            lost = time.monotonic()
            assert wait_for(lambda: "gave up after" in log_text(log), 90), log_text(log)
            took = time.monotonic() - lost
            record(f"{transport}: ours, -c 4 -l 6: unlink to 'gave up', s",
                   round(time.monotonic() - unlinked, 1))
            dd = subprocess.run(["dd", f"if={mnt}/n2", "of=/dev/null", "bs=4k", "count=1",
                                 "iflag=direct"], capture_output=True, text=True, timeout=60)
        assert dd.returncode != 0 and "Input/output error" in dd.stderr, dd.stderr
    text = log_text(log)
    gave_up = re.search(r"gave up after (\d+) reconnects in (\d+) s \(--ctrl-loss-tmo 6\)", text)
    assert gave_up, text
    # tries at 4 and 6 s (one, if the first outlasts 6 s under TCG)
    assert 1 <= int(gave_up[1]) <= 2 and int(gave_up[2]) <= 6 + CONNECT_TIMEOUT, text
    assert took < 6 + CONNECT_TIMEOUT + 2, (took, text)  # (+ the log's polling)
    assert "Traceback" not in text, text


@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_the_kernel_initiators_give_up_with_the_same_options_for_comparison(testbed,
                                                                           transport):
    """Not a check of ours: the peer's figure in the same boot (Linux counts tries,
    ceil(6 / 4) = 2, and deletes the controller after the last one fails)."""
    addr = testbed.rdma_addr if transport == "rdma" else testbed.tcp_addr
    with connected(transport, addr, testbed.port, testbed.nqn,
                   extra=("-k", "2", "-c", "4", "-l", "6")):
        ctrls = _controllers(testbed.nqn, transport)
        with target_away(testbed.nqn, NVMET_PORTS[transport]):
            unlinked = time.monotonic()
            gone = wait_for(lambda: not (_controllers(testbed.nqn, transport) & ctrls), 90)
            took = time.monotonic() - unlinked
    assert gone
    record(f"{transport}: Linux, -c 4 -l 6: unlink to the controller deleted, s",
           round(took, 1))
