"""Issue #49 item 4 against the real daemon and FUSE: every length and count from the wire
is bounded before use (tests/hostile/faults_bounds.py has the faults)."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
from companion_fakes import wait_for
from hostile_harness import RSS_BOUND_MIB, UNMOUNT_BOUND
from hostile_target import LID_ANA, LID_DISCOVERY, NQN

from nvmeof_fuse.host.discovery import MAX_RECORDS

WAIT = 20.0  # s: bound on waiting for a condition


def test_a_forged_ana_log_turns_ana_off_and_keep_alive_goes_on(hostile):
    """NN, MNAN and NANAGRPID 0x0FFFFFF0 make a 9 GiB ANA log: past MDTS, so ANA is off on
    the path (Linux's rule), in one line; the log is never read, the keep-alive still
    answered and the data still there."""
    m = hostile.start("forged ana log")
    assert m.mount() == "ready"
    connections, keep_alives = m.target.connections, m.target.keep_alives
    assert wait_for(lambda: m.target.keep_alives >= keep_alives + 2, WAIT), \
        f"no keep-alive within {WAIT} s"
    dd, _ = m.dd("read")
    assert dd is not None and dd.returncode == 0, dd
    assert m.rss_mib() < RSS_BOUND_MIB
    assert m.unmount()[0]
    log = m.log()
    assert log.count("ANA reporting is off on this path") == 1, log
    assert "Traceback" not in log
    assert m.target.connections == connections  # no reconnect: the keep-alive held
    assert not [p for p in m.target.log_pages if p[0] == LID_ANA]


def test_an_ana_log_claiming_more_groups_than_it_holds(hostile):
    hostile.run("ana ngrps huge", "read").check("ok")


@pytest.mark.parametrize("fault", ["lbads 63", "lbads 0", "lbads 17", "nsze max",
                                   "nsze overflow", "flbas past nlbaf"])
def test_an_identify_namespace_we_cannot_serve(hostile, fault):
    """The namespace shows with size 0 (as Linux shows a block device of capacity 0, so
    ``ls`` names what is there), opening it fails with ENXIO, and the log says why once."""
    m = hostile.start(fault)
    assert m.mount() == "ready"
    listing = subprocess.run(["ls", "-l", str(m.mountpoint)], capture_output=True, text=True,
                             timeout=WAIT)
    assert "?" not in listing.stdout and listing.returncode == 0, listing
    assert os.stat(m.mountpoint / "n1").st_size == 0
    with pytest.raises(OSError) as opened:
        open(m.mountpoint / "n1", "rb").close()
    assert opened.value.errno == errno.ENXIO
    report = (m.mountpoint / ".nvmeof" / "n1.json").read_text()
    assert '"unusable"' in report
    dd, _ = m.dd("read")
    assert dd is not None and "No such device or address" in dd.stderr
    clean, seconds = m.unmount()
    assert clean and seconds < UNMOUNT_BOUND
    log = m.log()
    assert log.count("namespace n1 is unavailable") == 1 and "Traceback" not in log, log


@pytest.mark.parametrize("fault", ["lbads 63", "nsze max"])
def test_the_harness_sees_an_unavailable_namespace_as_enxio(hostile, fault):
    hostile.run(fault, "write").check("ENXIO")


def test_a_command_retry_delay_of_hours_is_not_slept(hostile):
    """CRDT1 0xFFFF and CRD 1 on the first read: we never enabled retry delays (ACRE), so
    the read runs again at once and lands (DD_BOUND is far below 109 minutes)."""
    out = hostile.run("crd of hours", "read").check("ok")
    assert hostile.mounts[0].target.hostile.fired == 1, out


def test_a_discovery_log_claiming_2_64_records_is_refused_in_one_line(hostile):
    done = hostile.discover("huge discovery log")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert (f"claims {2**64 - 1} records; more than {MAX_RECORDS} are refused"
            in done.stderr), done.stderr
    asked = [length for lid, _, length in hostile.mounts[0].target.log_pages
             if lid == LID_DISCOVERY]
    assert asked and max(asked) <= 1024  # the header only


def test_a_discovery_log_past_mdts_is_read_in_pieces(hostile):
    done = hostile.discover("many discovery records")
    assert done.returncode == 0, done.stderr
    assert "Number of Records 300," in done.stdout and done.stdout.count(NQN) == 300
    pieces = [(offset, length) for lid, offset, length in hostile.mounts[0].target.log_pages
              if lid == LID_DISCOVERY]
    assert len(pieces) > 2 and max(length for _, length in pieces) <= 32 << 10, pieces


@pytest.mark.parametrize("fault", ["pdu length huge", "data length huge", "data offset huge",
                                   "header length huge", "close mid-payload"])
def test_a_broken_c2hdata_once_costs_a_reconnect(hostile, fault):
    out = hostile.run(fault, "read").check("ok")
    assert "reconnect" in out.log or "lost" in out.log, out.log


def test_a_wrong_data_digest_once_costs_a_reconnect(hostile):
    out = hostile.run("data digest wrong", "read",
                      options=("-c", "1", "-l", "5", "-k", "1", "--data-digest")).check("ok")
    assert "digest" in out.log, out.log


@pytest.mark.parametrize("fault", ["r2t huge", "r2t past the write"])
def test_a_broken_r2t_once_costs_a_reconnect(hostile, fault):
    out = hostile.run(fault, "write").check("ok")
    assert "R2T" in out.log, out.log


@pytest.mark.parametrize("fault", ["namespace list unsorted", "changed namespace list forged",
                                   "async event storm"])
def test_namespace_lists_and_notices(hostile, fault):
    hostile.run(fault, "read").check("ok")


def test_a_full_namespace_list_is_served_and_logged_in_one_short_line(hostile):
    out = hostile.run("namespace list of 1024", "read").check("ok")
    connected = [line for line in out.log.splitlines() if "connected as controller" in line]
    assert len(connected) == 1 and "1,016 more" in connected[0], connected
    assert len(connected[0]) < 400


@pytest.mark.parametrize("fault, named", [("icresp pfv 1", "PDU format version 1"),
                                          ("icresp maxh2cdata 0", "MAXH2CDATA 0"),
                                          ("icresp cpda 128", "CPDA 128"),
                                          ("connect stall", "Connect")])
def test_a_bad_icresp_or_a_stalled_connect_is_refused_in_one_line(hostile, fault, named):
    """What held before issue #49, kept: the mount fails in one line naming the fault."""
    out = hostile.run(fault, "read").check("refused")
    assert named in out.ready, out.ready


@pytest.mark.parametrize("fault, named", [("cap mqes 0", "CAP.MQES 0"), ("maxcmd 1", "MAXCMD 1")])
def test_queues_of_one_entry_are_refused_by_name(hostile, fault, named):
    out = hostile.run(fault, "read").check("refused")
    assert named in out.ready and "at least 2" in out.ready, out.ready


@pytest.mark.parametrize("fault", ["identify controller absurd", "cap to max",
                                   "queues granted 65535"])
@pytest.mark.parametrize("direction", ["read", "write"])
def test_absurd_controller_values_within_what_we_take(hostile, fault, direction):
    """MDTS 31 (we move at most 1 MiB a command anyway), IOCCSZ 4 GiB, NN and AERL at their
    maximum, CAP.TO 127.5 s, 65535 queues granted: nothing is sized by them."""
    hostile.run(fault, direction).check("ok")
