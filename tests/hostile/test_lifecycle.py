"""Issue #56 items 2, 3 and 7 against the real daemon and FUSE (tests/hostile/faults_lifecycle.py
has the faults): a write acknowledged without its data ends in EIO and is never reported
written; a controller that never confirms its shutdown, a final Flush never answered, a read
never answered or a target silent at the exit hold neither the unmount nor SIGTERM or SIGINT
past 15 s, and the last log line says what was skipped; a target that goes silent after a
loss is given up on within --ctrl-loss-tmo plus one connect timeout."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
from hostile_harness import DD_SIZE, MOUNT_OPTIONS

from nvmeof_fuse import File

EXIT_BOUND = 15.0  # s: unmount, SIGTERM or SIGINT ends the daemon within this (issue #56)
CTRL_LOSS_TMO = 5  # s: the harness's -l 5
CONNECT_TIMEOUT = 10  # s: ConnectOptions.connect_timeout
LOSS_NOTICED = 2  # s: a keep-alive (-k 1) unanswered within its timeout, and its interval
OLD = b"\xab" * DD_SIZE  # what the namespace holds before the write that is lied about


# -- item 2: a write's success counts its data ---------------------------------------------------

WRITE_LIES = [
    ("write success without r2t", "claims success after 0 of 32768 bytes were asked for by R2T"),
    ("write success after half its r2t",
     "claims success after 16384 of 32768 bytes were asked for by R2T"),
]


@pytest.mark.parametrize(("name", "says"), WRITE_LIES, ids=[c[0] for c in WRITE_LIES])
@pytest.mark.parametrize("workers", [1, 2], ids=["daemon", "workers"])
def test_a_write_acknowledged_without_its_data_fails_with_eio(hostile, name, says, workers):
    """Issue #56: dd exited 0 and the old bytes read back.  Every try of the write breaks
    its connection now, so it ends in EIO within the retry budget, and nothing of it is
    reported written; the log names the lie.  FUSE workers write on leased queues of their
    own: the same rule holds there."""
    options = ("-c", "1", "-l", "5", "-k", "1", "--workers", str(workers))
    m = hostile.start(name, options=options)
    m.target.data[:DD_SIZE] = OLD
    assert m.mount() == "ready", m.log()
    dd, _ = m.dd("write")
    assert dd is not None, f"dd ran past its bound; {m.log()[-3000:]}"
    assert dd.returncode != 0 and "Input/output error" in dd.stderr, (dd.stderr, m.log()[-3000:])
    assert m.target.hostile.fired >= 1
    assert says in m.log(), m.log()[-3000:]
    assert bytes(m.target.data[:DD_SIZE]) == OLD  # the target never had the data
    clean, took = m.unmount()
    assert clean and took < EXIT_BOUND, (took, m.log()[-3000:])
    assert "Traceback" not in m.log(), m.log()


COMPANION_WRITE = """
import sys
from nvmeof_fuse import File
with File(sys.argv[1]) as f:
    try:
        f.write(bytearray(b"\\xcd" * 32768), file_offset=0)
    except Exception as exc:
        print("refused", getattr(exc, "errno", None), type(exc).__name__, exc)
    else:
        print("written")
"""


def test_a_companion_write_acknowledged_without_its_data_fails(hostile):
    """A companion client writes on its own leased NVMe/TCP queues (companion/direct.py):
    the same queue code refuses the lie there."""
    m = hostile.start("write success without r2t", io_queues=8)  # 6 to lease
    m.target.data[:DD_SIZE] = OLD
    assert m.mount() == "ready", m.log()
    out = subprocess.run([sys.executable, "-c", COMPANION_WRITE, str(m.mountpoint / "n1")],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("refused 5 "), (out.stdout, out.stderr[-3000:], m.log()[-3000:])
    assert "claims success after 0 of 32768 bytes were asked for by R2T" in out.stdout
    assert re.search(r"companion: pid \d+ uid \d+ leases queues", m.log()), m.log()  # its own
    assert bytes(m.target.data[:DD_SIZE]) == OLD
    assert "Traceback" not in m.log(), m.log()


# -- item 3: a shutdown within a bound -----------------------------------------------------------


def stop_daemon(m, stop: str) -> float:
    """Ask the daemon to stop (``unmount``: fusermount3 -u; or a signal's name) and wait
    for it, EXIT_BOUND at most; the seconds it took (it exited 0)."""
    start = time.monotonic()
    if stop == "unmount":
        clean, _ = m.unmount(bound=EXIT_BOUND)
        assert clean, m.log()[-3000:]
    else:
        m.proc.send_signal(getattr(signal, stop))
        m.proc.wait(timeout=EXIT_BOUND)
        assert m.proc.returncode == 0, m.log()[-3000:]
    return time.monotonic() - start


def last_line(m) -> str:
    return m.log().strip().splitlines()[-1]


def start(hostile, fault: str, workers: int):
    """A mount on ``fault`` with ``workers`` FUSE workers: the target grants the queues the
    workers lease (2 I/O queues, its default, leave none)."""
    return hostile.start(fault, options=(*MOUNT_OPTIONS, "--workers", str(workers)),
                         io_queues=8)


def check_workers_served(m, workers: int) -> None:
    if workers > 1:
        assert m.wait_for_log(r"FUSE worker 1 \(pid \d+\) serves on queues", 20), m.log()


def write_unflushed(m) -> None:
    """Write n1 through a companion File, whose writes (unlike a FUSE file's close) leave
    the flush to the unmount: the final flush has n1 to flush."""
    with File(str(m.mountpoint / "n1")) as f:
        assert f.write(b"\x5a" * 4096) == 4096

SHUTDOWN_FAULTS = [
    ("shst never set", "shutdown not confirmed within 5 s (CSTS.SHST not set)"),
    ("shst never set, rtd3e 60 s",  # RTD3E raises the wait, up to 10 s
     "shutdown not confirmed within 10 s (CSTS.SHST not set)"),
    ("cc.shn never answered", "shutdown not confirmed within 5 s (CC.SHN unanswered)"),
]
STOPS = ["unmount", "SIGTERM", "SIGINT"]


@pytest.mark.parametrize("stop", STOPS)
@pytest.mark.parametrize(("name", "says"), SHUTDOWN_FAULTS, ids=[c[0] for c in SHUTDOWN_FAULTS])
def test_a_shutdown_never_confirmed_holds_no_exit_past_15_s(hostile, name, says, stop):
    """Issue #56: the unmount waited 127.5 s (CAP.TO) and SIGTERM did not end it."""
    m = hostile.start(name)
    assert m.mount() == "ready", m.log()
    took = stop_daemon(m, stop)
    assert took < EXIT_BOUND, f"{stop} took {took:.1f} s; {m.log()[-3000:]}"
    last = last_line(m)
    assert last.startswith("nvmeof-fuse: disconnected from ") and says in last, m.log()[-3000:]
    assert "Traceback" not in m.log(), m.log()


@pytest.mark.parametrize("workers", [1, 2], ids=["daemon", "workers"])
def test_a_confirmed_shutdown_leaves_no_note(hostile, workers):
    """A healthy target: the final flush of what was written is confirmed, the shutdown
    too, and nothing is said skipped."""
    m = start(hostile, "none", workers)
    assert m.mount() == "ready", m.log()
    write_unflushed(m)
    check_workers_served(m, workers)
    clean, took = m.unmount()
    assert clean and took < EXIT_BOUND
    last = last_line(m)
    assert re.fullmatch(r"nvmeof-fuse: disconnected from \S+", last), m.log()[-3000:]
    assert "flushed n1 (the 1 of 1 namespaces written since their last flush)" in m.log()
    for skipped in ("not confirmed", "orderly shutdown", "final flush", "did not drain",
                    "abandon", "lost the connection"):
        assert skipped not in m.log(), m.log()[-3000:]


@pytest.mark.parametrize("stop", STOPS)
@pytest.mark.parametrize("workers", [1, 2], ids=["daemon", "workers"])
def test_a_final_flush_never_answered_holds_no_exit_past_15_s(hostile, workers, stop):
    """Issue #56: SIGTERM took 30.1 s, the command timeout of a final Flush the target never
    answered.  Its timeout is cut to what the exit leaves the flush (9 s, the shutdown's
    5 s after it, less what the drain took), and the last line names the namespace not
    flushed."""
    m = start(hostile, "flush never answered", workers)
    assert m.mount() == "ready", m.log()
    write_unflushed(m)
    check_workers_served(m, workers)
    took = stop_daemon(m, stop)
    assert took < EXIT_BOUND, f"{stop} took {took:.1f} s; {m.log()[-3000:]}"
    assert m.target.hostile.fired == 1  # the final Flush of n1, and no other
    last = last_line(m)
    assert last.startswith("nvmeof-fuse: disconnected from "), m.log()[-3000:]
    assert re.search(r"final flush of n1 not confirmed within (9|8\.\d) s", last), \
        m.log()[-3000:]
    assert "Traceback" not in m.log(), m.log()


@pytest.mark.parametrize(("workers", "stop"), [(1, "unmount"), (1, "SIGTERM"), (1, "SIGINT"),
                                               (2, "SIGTERM")])
def test_a_target_silent_at_the_exit_holds_no_exit_past_15_s(hostile, workers, stop):
    """Nothing is answered from the moment the daemon is asked to stop: not the final Flush,
    not a keep-alive, not the shutdown.  The keep-alive's timeout costs the connection,
    the flush and the orderly shutdown are skipped, and the last line says both."""
    m = start(hostile, "silent once armed", workers)
    assert m.mount() == "ready", m.log()
    write_unflushed(m)
    check_workers_served(m, workers)
    m.target.hostile.armed = True
    took = stop_daemon(m, stop)
    assert took < EXIT_BOUND, f"{stop} took {took:.1f} s; {m.log()[-3000:]}"
    assert m.target.hostile.fired >= 1
    last = last_line(m)
    assert last.startswith("nvmeof-fuse: disconnected from "), m.log()[-3000:]
    assert "final flush of n1 " in last and "shutdown" in last, m.log()[-3000:]
    assert "Traceback" not in m.log(), m.log()


@pytest.mark.parametrize("workers", [1, 2], ids=["daemon", "workers"])
def test_a_read_in_flight_never_answered_holds_no_sigterm_past_15_s(hostile, workers):
    """A process reads when SIGTERM comes, and the target never answers the read: the
    drain waits for it only until the exit's drain deadline, its command times out by the
    exit's deadline (in the main process: its timeout is cut) or its FUSE worker is killed
    then, and the reader gets an error."""
    m = start(hostile, "reads never answered once armed", workers)
    assert m.mount() == "ready", m.log()
    check_workers_served(m, workers)
    m.target.hostile.armed = True
    reader = subprocess.Popen(["dd", f"if={m.mountpoint / 'n1'}", "of=/dev/null",
                               "iflag=direct", f"bs={DD_SIZE}", "count=1", "status=none"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    m.stragglers.append(reader)  # (reaped once the daemon is gone, if the test fails)
    deadline = time.monotonic() + 10
    while m.target.hostile.fired == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # the read is in flight now
    assert m.target.hostile.fired, m.log()[-3000:]
    took = stop_daemon(m, "SIGTERM")
    assert took < EXIT_BOUND, f"SIGTERM took {took:.1f} s; {m.log()[-3000:]}"
    _, err = reader.communicate(timeout=EXIT_BOUND)
    assert reader.returncode != 0, err
    last = last_line(m)
    assert re.match(r"nvmeof-fuse: disconnected from \S+ \(.+\)$", last), m.log()[-3000:]
    assert "Traceback" not in m.log(), m.log()


# -- item 7: giving up within --ctrl-loss-tmo -----------------------------------------------------

SILENT = ["icresp never after a loss", "connect never answered after a loss",
          "property get never answered after a loss"]


@pytest.mark.parametrize("name", SILENT)
def test_a_target_silent_after_a_loss_is_given_up_on_within_ctrl_loss_tmo(hostile, name):
    """Issue #56: with -l 5 the daemon gave up after 55 s (five tries, each waiting 10 s for
    an ICResp).  Now within --ctrl-loss-tmo plus one connect timeout, however many tries fit;
    I/O waiting meanwhile fails with EIO, and the unmount that follows is not held by the
    path being connected anew."""
    m = hostile.start(name)
    assert m.mount() == "ready", m.log()
    m.target.hostile.armed = True
    armed = time.monotonic()
    assert m.wait_for_log(r"lost the connection to", 10), m.log()[-3000:]
    dd, _ = m.dd("read")  # waits for the reconnect, which never comes
    assert dd is not None and dd.returncode != 0 and "Input/output error" in dd.stderr, \
        (dd, m.log()[-3000:])
    gave_up = m.wait_for_log(r"gave up after (\d+) reconnects in (\d+) s", 30)
    took = time.monotonic() - armed
    assert gave_up, m.log()[-3000:]
    assert int(gave_up[2]) <= CTRL_LOSS_TMO + CONNECT_TIMEOUT, m.log()[-3000:]
    assert took < LOSS_NOTICED + CTRL_LOSS_TMO + CONNECT_TIMEOUT + 3, (took, m.log()[-3000:])
    assert m.target.hostile.fired >= 1
    clean, took = m.unmount(bound=EXIT_BOUND)
    assert clean and took < EXIT_BOUND, (took, m.log()[-3000:])
    assert "Traceback" not in m.log(), m.log()


def test_sigterm_while_a_reconnect_try_waits_for_its_connect_ends_the_daemon(hostile):
    """A reconnect try waiting for a Connect that never comes (30 s command timeout) does not
    hold SIGTERM: the controller's queues are torn down under it."""
    m = hostile.start("connect never answered after a loss",
                      options=("-c", "1", "-l", "600", "-k", "1"))
    assert m.mount() == "ready", m.log()
    m.target.hostile.armed = True
    assert m.wait_for_log(r"lost the connection to", 10), m.log()[-3000:]
    deadline = time.monotonic() + 10
    while m.target.hostile.fired == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # a try waits for its Connect now
    assert m.target.hostile.fired, m.log()[-3000:]
    start = time.monotonic()
    m.proc.send_signal(signal.SIGTERM)
    m.proc.wait(timeout=EXIT_BOUND)
    took = time.monotonic() - start
    assert took < EXIT_BOUND and m.proc.returncode == 0, (took, m.log()[-3000:])
    last = m.log().strip().splitlines()[-1]
    assert "no orderly shutdown: the controller was connecting" in last, m.log()[-3000:]
    assert "Traceback" not in m.log(), m.log()
