"""Issue #56 item 1 against the real daemon and FUSE: a target that answers, after a
reconnect or a notice, with another namespace behind n1, or another controller, never has
that one served under the old name (tests/hostile/faults_identity.py has the faults).

What the user sees: a file open on the old namespace fails with EIO from then on (never the
new volume's data, not even for a read that waited through the outage); the new namespace
is a new file of the same name (another inode); one log line names the NSID and both
identities.  A controller of another subsystem is refused at each reconnect, in one line,
until --ctrl-loss-tmo gives up.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import sys
import threading

import pytest
import trio
from companion_fakes import wait_for
from hostile_target import load_faults

load_faults()  # (the faults' module, by the name the harness gave it)
faults = sys.modules["hostile_faults_identity"]
NGUID_A, NGUID_B, cut = faults.NGUID_A, faults.NGUID_B, faults.cut

WAIT = 30.0  # s: bound on waiting for a condition
SIZE = 64 << 10  # bytes read through the files
A = bytes([0xA5]) * SIZE  # the mounted namespace's data
B = bytes([0x5B]) * SIZE  # the other namespace's


def on_target(m, fn, *args):
    """Run ``await fn(*args)`` on the target's loop."""
    async def run():
        result = fn(*args)
        if hasattr(result, "__await__"):
            await result
    trio.from_thread.run(run, trio_token=m._trio["token"])


def swap(m, *, notify: bool = False) -> None:
    """The target's n1 becomes the other namespace (data B); the connections are cut, or
    with ``notify`` a namespace attribute notice says so."""
    async def run():
        m.target.hostile.swap(m.target, B)
        if notify:
            await m.target.hostile.notify(m.target)
        else:
            await cut(m.target)
    on_target(m, run)


def open_direct(path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


def read(fd: int, size: int = SIZE) -> bytes:
    buf = mmap.mmap(-1, size)  # page-aligned, for O_DIRECT
    try:
        n = os.preadv(fd, [buf], 0)
        return bytes(buf[:n])
    finally:
        buf.close()


def read_fails_with_eio(fd: int) -> None:
    with pytest.raises(OSError) as failed:
        data = read(fd)
        pytest.fail(f"the old file read {data[:4]!r}... ({len(data)} bytes)")
    assert failed.value.errno == errno.EIO, failed.value


def mounted_with(hostile, fault: str):
    m = hostile.start(fault)
    m.target.data[:SIZE] = A
    assert m.mount() == "ready", m.log()
    return m


def check_clean(m) -> None:
    log = m.log()
    assert "Traceback" not in log, log
    clean, _ = m.unmount()
    assert clean, m.log()[-3000:]


def replaced_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "is another namespace now" in line]


@pytest.mark.parametrize("notify", [False, True], ids=["reconnect", "notice"])
def test_another_namespace_behind_n1_fails_the_open_file_and_shows_as_a_new_one(hostile,
                                                                                notify):
    m = mounted_with(hostile, "nguid swap by notice" if notify else "nguid swap")
    n1 = m.mountpoint / "n1"
    old = open_direct(n1)
    try:
        old_inode = os.fstat(old).st_ino
        assert read(old) == A
        swap(m, notify=notify)
        assert wait_for(lambda: replaced_lines(m.log()), WAIT), m.log()
        read_fails_with_eio(old)
        read_fails_with_eio(old)  # from then on
        assert wait_for(lambda: os.stat(n1).st_ino != old_inode, WAIT)
        fresh = open_direct(n1)
        try:
            assert os.fstat(fresh).st_ino != old_inode
            assert read(fresh) == B
        finally:
            os.close(fresh)
    finally:
        os.close(old)
    (line,) = replaced_lines(m.log())
    assert "n1" in line and NGUID_A.hex() in line and NGUID_B.hex() in line, line
    if not notify:
        assert "reconnected" in m.log()
    check_clean(m)


def test_a_read_that_waited_through_the_outage_never_gets_the_new_volume(hostile):
    """The read is sent while the host reconnects (the target refuses Connect): it waits
    for the reconnect, and the identity is checked before it may run."""
    m = mounted_with(hostile, "nguid swap")
    fault = m.target.hostile
    old = open_direct(m.mountpoint / "n1")
    try:
        assert read(old) == A
        fault.down = True
        swap(m)
        assert wait_for(lambda: "reconnect 1 to" in m.log(), WAIT), m.log()
        outcome: list = []

        def reader() -> None:
            try:
                outcome.append(read(old))
            except OSError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=reader)
        thread.start()
        thread.join(1.5)
        assert thread.is_alive() and not outcome, outcome  # it waits for the reconnect
        fault.down = False
        thread.join(WAIT)
        assert not thread.is_alive()
        (result,) = outcome
        assert isinstance(result, OSError) and result.errno == errno.EIO, result[:4] \
            if isinstance(result, bytes) else result
    finally:
        os.close(old)
    assert len(replaced_lines(m.log())) == 1, m.log()
    check_clean(m)


@pytest.mark.parametrize(("fault", "says"), [
    ("serial swap", "serial number 'SERIAL-A' != 'SERIAL-B'"),
    ("subsystem swap", "subsystem NQN 'nqn.2026-11.io.nvmeof-fuse:fake-tcp' != "
                       "'nqn.2026-11.io.example:another'"),
])
def test_a_controller_of_another_subsystem_is_refused_at_each_reconnect(hostile, fault, says):
    """Each reconnect fails in one line naming old and new, until --ctrl-loss-tmo (5 s)
    gives up; the open file fails with EIO, and nothing of the other target is served."""
    m = mounted_with(hostile, fault)
    n1 = m.mountpoint / "n1"
    old = open_direct(n1)
    try:
        assert read(old) == A
        swap(m)
        assert wait_for(lambda: "gave up after" in m.log(), WAIT), m.log()
        read_fails_with_eio(old)
    finally:
        os.close(old)
    log = m.log()
    refusals = [line for line in log.splitlines() if "is not the controller we mounted" in line]
    assert refusals and all(says in line for line in refusals), log
    assert all(line.count("\n") == 0 and len(line) < 400 for line in refusals)
    assert "reconnected" not in log and not replaced_lines(log)
    # A fresh open serves nothing of it either: the path stays out while it is refused.
    fresh = open_direct(n1)
    try:
        read_fails_with_eio(fresh)
    finally:
        os.close(fresh)
    check_clean(m)


def test_a_namespace_without_identifiers_is_told_apart_by_its_size(hostile):
    """The fake target reports no identifiers: after the reconnect n1 has half the size,
    and that is another namespace (the README's rule), not a resize."""
    m = mounted_with(hostile, "size swap without identifiers")
    n1 = m.mountpoint / "n1"
    size = os.stat(n1).st_size
    old = open_direct(n1)
    try:
        assert read(old) == A
        swap(m)
        assert wait_for(lambda: replaced_lines(m.log()), WAIT), m.log()
        read_fails_with_eio(old)
    finally:
        os.close(old)
    assert wait_for(lambda: os.stat(n1).st_size == size // 2, WAIT)
    fresh = open_direct(n1)
    try:
        assert read(fresh) == B
    finally:
        os.close(fresh)
    (line,) = replaced_lines(m.log())
    assert re.search(r"size \d+ != \d+ LBAs, with no identifiers", line), line
    check_clean(m)


def test_a_namespace_that_reports_another_ones_identifiers_is_refused(hostile):
    """Identify Namespace of n2 answers with n1's data: two namespaces with one NGUID.  As
    Linux ignores the duplicate, n2 is unavailable (size 0, ENXIO), said once; n1 serves."""
    m = hostile.start("identify of another nsid")
    m.target.data[:SIZE] = A
    assert m.mount() == "ready", m.log()
    assert os.stat(m.mountpoint / "n2").st_size == 0
    with pytest.raises(OSError) as opened:
        open_direct(m.mountpoint / "n2")
    assert opened.value.errno == errno.ENXIO
    fd = open_direct(m.mountpoint / "n1")
    try:
        assert read(fd) == A
    finally:
        os.close(fd)
    said = [line for line in m.log().splitlines()
            if "namespace n2 is unavailable: it reports the identifiers of namespace n1" in line]
    assert len(said) == 1 and NGUID_A.hex() in said[0], m.log()
    check_clean(m)
