"""Issue #56 item 6 against the real daemon and FUSE: a target with 65,536 namespaces
(tests/hostile/faults_scale.py) mounts within the harness's bound and its memory bound,
unmount flushes only what was written and the keep-alive holds meanwhile, and a cap
refuses the rest in one line."""

from __future__ import annotations

import os

import trio
from companion_fakes import wait_for
from hostile_faults_scale import Namespaces100, Namespaces65536
from hostile_harness import MOUNT_OPTIONS, UNMOUNT_BOUND

from nvmeof_fuse import File

RSS_BOUND_MIB = 128  # issue #56: 65,536 namespaces in under 128 MiB (32 MiB with one)
WAIT = 20.0  # s: bound on waiting for a condition
HOLD_S = 2.5  # s the final Flush of the namespace written through File waits: > KATO (1 s)


def test_65536_namespaces_mount_and_unmount_flushes_only_those_written(hostile):
    """n1 written with dd (whose close flushes it) and n5 through a companion File (which
    does not): unmount flushes n5 alone, and while the target holds that Flush past the
    keep-alive timeout the keep-alive goes on and the connection holds."""
    fault = Namespaces65536(hold_nsid=5, hold_s=HOLD_S)
    m = hostile.start(fault)
    assert m.mount() == "ready", m.log()[-2000:]
    connections = m.target.connections
    assert len(os.listdir(m.mountpoint)) == 65536 + 1  # and .nvmeof
    dd, _ = m.dd("write")
    assert dd is not None and dd.returncode == 0, dd
    assert set(fault.flushes) == {1}  # dd's close (FUSE FLUSH)
    closing = len(fault.flushes)
    with File(str(m.mountpoint / "n5")) as f:
        assert f.write(b"\x5a" * 4096) == 4096
    assert os.stat(m.mountpoint / "n65536").st_size == 4096
    assert m.rss_mib() < RSS_BOUND_MIB, f"peak RSS {m.rss_mib():.0f} MiB"
    clean, seconds = m.unmount()
    assert clean and seconds < UNMOUNT_BOUND, m.log()[-2000:]
    log = m.log()
    assert fault.flushes[closing:] == [5], fault.flushes  # none of the 65,534 not written
    assert fault.keep_alives_held is not None and fault.keep_alives_held >= 2, \
        fault.keep_alives_held
    assert m.target.connections == connections  # no reconnect: the keep-alive held
    assert "flushed n5 (the 1 of 65536 namespaces written since their last flush)" in log, log
    assert "reconnect" not in log and "lost" not in log and "Traceback" not in log, log
    assert max(len(line) for line in log.splitlines() if "flushed" in line) < 200


def test_namespaces_past_the_cap_are_refused_in_one_line(hostile):
    fault = Namespaces65536()
    m = hostile.start(fault, options=(*MOUNT_OPTIONS, "--max-namespaces", "4096"))
    assert m.mount() == "ready"
    names = os.listdir(m.mountpoint)
    assert len(names) == 4096 + 1 and "n4096" in names and "n4097" not in names
    assert not os.path.exists(m.mountpoint / ".nvmeof" / "n4097.json")
    assert fault.identified == 4096  # nothing past the cap is identified
    assert m.unmount()[0]
    log = m.log()
    said = [line for line in log.splitlines() if "--max-namespaces" in line]
    assert said == ["nvmeof-fuse: nqn.2026-11.io.nvmeof-fuse:fake-tcp: serving the first 4096 "
                    "of 65536 namespaces (--max-namespaces)"], log
    assert "Traceback" not in log


def test_a_namespace_past_the_cap_added_later_is_refused_and_said_once(hostile):
    """The target adds a namespace and says so: the mount keeps what it serves, refuses the
    new one and says the new count once."""
    fault = Namespaces100()
    m = hostile.start(fault, options=(*MOUNT_OPTIONS, "--max-namespaces", "100"))
    assert m.mount() == "ready"
    trio.from_thread.run_sync(fault.grow, 101, trio_token=m._trio["token"])
    assert wait_for(lambda: "of 101 namespaces" in m.log(), WAIT), m.log()
    assert len(os.listdir(m.mountpoint)) == 100 + 1
    assert m.unmount()[0]
    log = m.log()
    assert log.count("--max-namespaces") == 1 and "added" not in log, log
