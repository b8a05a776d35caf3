"""Issue #49 items 1-3 against the real daemon and FUSE: a command whose every try breaks
its connection (tests/hostile/faults_core.py has the faults) ends in EIO after its retry
budget (``IO_RETRIES`` tries), the log names the target's fault, and neither the unmount
nor SIGTERM waits on it."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest

# fault, dd, and what the log must say of it
CASES = [
    ("poison c2h past buffer", "read", "C2HData for command .* names bytes 32768\\+32768"),
    ("poison c2h unknown cid", "read", "C2HData for command ID .*, which is not in flight"),
    ("poison resp unknown cid", "read", "CapsuleResp for command ID .*, which is not in flight"),
    ("poison pdu length", "read", "4294967280"),
    ("poison unknown pdu type", "read", "0xc"),
    ("poison c2h term req", "read", "C2HTermReq"),
    ("poison read without data", "read", "claims success after 0 of 32768 bytes"),
    ("poison late duplicate resp", "read", "CapsuleResp for command ID .*, which is not in flight"),
    ("poison r2t unknown cid", "write", "R2T for command ID .*, which is not in flight"),
    ("poison r2t past write", "write", "R2T for command .* names bytes 0\\+65536, past its"),
]


@pytest.mark.parametrize(("name", "direction", "says"), CASES, ids=[c[0] for c in CASES])
def test_a_command_that_breaks_its_connection_each_time_ends_in_eio(hostile, name, direction,
                                                                    says):
    out = hostile.run(name, direction).check("EIO")
    target = hostile.mounts[0].target
    assert target.hostile.fired >= 1, f"the fault never fired; {out.log[-2000:]}"
    assert re.search(says, out.log), out.log[-3000:]
    # The error is logged once, naming the target's fault (or the outage's end, when
    # --ctrl-loss-tmo ran out first).
    # (the controller's line; FUSE's line for the failed read or write quotes it)
    budget = len(re.findall(r"^nvmeof-fuse: (Read|Write) failed: its connection failed under",
                            out.log, re.M))
    assert budget + out.log.count("gave up after") >= 1 and budget <= 1, out.log[-3000:]


def test_sigterm_does_not_wait_on_a_command_caught_in_the_retry_loop(hostile):
    """SIGTERM took 62 s while a poison read looped.  Here the loop would run for about
    IO_RETRIES * 4 s (--reconnect-delay 4): the daemon must exit long before that."""
    m = hostile.start("poison c2h term req", options=("-c", "4", "-l", "600", "-k", "1"))
    assert m.mount() == "ready"
    n1 = m.mountpoint / "n1"
    dd = subprocess.Popen(["dd", f"if={n1}", "of=/dev/null", "iflag=direct", "bs=32768",
                           "count=1", "status=none"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while "C2HTermReq" not in m.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "C2HTermReq" in m.log(), m.log()
        start = time.monotonic()
        m.proc.send_signal(signal.SIGTERM)
        m.proc.wait(timeout=15)
        took = time.monotonic() - start
        _, err = dd.communicate(timeout=15)
    finally:
        if dd.poll() is None:
            dd.kill()
    assert took < 8, f"the daemon took {took:.1f} s to exit; {m.log()[-3000:]}"
    assert dd.returncode != 0
    assert "Traceback" not in m.log(), m.log()
