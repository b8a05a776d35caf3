"""Issue #58 item 7 against the real daemon and FUSE, over TLS (tests/hostile/faults_tls.py
has the faults, all the TLS front's): a connection that TLS breaks in the middle of a read
(part of a record and a close, an alert, a KeyUpdate or a late NewSessionTicket) is lost in
one line that names what broke it, and the read rides the reconnect (a fresh handshake) or
fails with EIO within a bound; a reconnect whose handshake stalls is given up on within
--ctrl-loss-tmo plus one connect timeout; a key the target stopped taking ends reconnecting
at once, in one line that names the identity.  Each time: no traceback, a clean unmount.
"""

from __future__ import annotations

import os
import re
import time

import pytest
from hostile_faults_tls import start
from hostile_harness import DD_BOUND
from tls_front import post_handshake_call

EXIT_BOUND = 15.0  # s: the unmount ends the daemon within this
CTRL_LOSS_TMO = 5  # s: the harness's -l 5
CONNECT_TIMEOUT = 10  # s: ConnectOptions.connect_timeout, which bounds a handshake
RECONNECTED = 20.0  # s: a reconnect after a loss (-c 1) comes within this


def lines_with(m, text: str) -> list[str]:
    return [line for line in m.log().splitlines() if text in line]


def finish(t) -> None:
    """The checks every fault ends with: a clean unmount within its bound, no traceback,
    the key nowhere in the log."""
    m = t.m
    clean, took = m.unmount(bound=EXIT_BOUND)
    assert clean and took < EXIT_BOUND, (took, m.log()[-3000:])
    assert "Traceback" not in m.log(), m.log()
    assert t.key.split(":")[2] not in m.log()


def read(m):
    """A 32 KiB O_DIRECT read of n1 (which the armed front breaks): its outcome, in bound."""
    dd, _ = m.dd("read")
    assert dd is not None, f"dd ran past {DD_BOUND} s; {m.log()[-3000:]}"
    return dd


BREAKS = [
    ("cut mid-record", "the target closed the connection in the middle of a TLS record"),
    ("close_notify", "a TLS alert (warning, close_notify)"),
    ("KeyUpdate", "a TLS KeyUpdate after the handshake"),
    ("NewSessionTicket", "a TLS NewSessionTicket after the handshake"),
]


def can_send(what: str) -> None:
    if what in ("KeyUpdate", "NewSessionTicket") and post_handshake_call(what) is None:
        pytest.skip(f"this libssl cannot send a {what}")


@pytest.mark.parametrize(("what", "named"), BREAKS, ids=[b[0] for b in BREAKS])
def test_tls_broken_under_a_read_loses_the_connection_in_one_line(hostile, what, named):
    """Once, in place of the read's data: the connection ends with one line that names what
    broke it, the reconnect shakes hands anew, and the read rides it (or fails with EIO)."""
    can_send(what)
    t = start(hostile)
    m = t.m
    assert m.mount() == "ready", m.log()
    handshakes = t.front.handshakes
    t.front.inject(what)
    dd = read(m)
    assert dd.returncode == 0 or "Input/output error" in dd.stderr, (dd, m.log()[-3000:])
    assert t.front.injected == [what] and t.front.failures == [], t.front.failures
    lost = lines_with(m, named)
    assert len(lost) == 1, m.log()[-3000:]
    assert re.search(r"lost the connection to .+?: I/O queue \d+: the TLS connection to "
                     r"127\.0\.0\.1:\d+ ended: ", lost[0]), lost
    assert m.wait_for_log(r"reconnected to ", RECONNECTED), m.log()[-3000:]
    assert t.front.handshakes > handshakes  # the new connections shook hands anew
    finish(t)


def test_tls_broken_on_every_connection_fails_the_read_with_eio(hostile):
    """Every connection's reads are cut in the middle of a record: each try of the read
    breaks its connection (one line each, as any poison command's), so it fails with EIO
    within the retry budget, and one line says so."""
    t = start(hostile)
    m = t.m
    assert m.mount() == "ready", m.log()
    t.front.inject("cut mid-record", times=None)
    dd = read(m)
    assert dd.returncode != 0 and "Input/output error" in dd.stderr, (dd, m.log()[-3000:])
    tries = len(t.front.injected)
    assert tries >= 2
    lost = lines_with(m, "lost the connection to")
    assert len(lost) == tries and all("in the middle of a TLS record" in li for li in lost), \
        m.log()[-3000:]
    assert len(lines_with(m, f"Read failed: its connection failed under each of its {tries} "
                             "tries (the last: I/O queue 1: the TLS connection to")) == 2, \
        m.log()[-3000:]  # the controller's line, and the FUSE request's
    finish(t)


def test_a_handshake_that_stalls_on_a_reconnect_is_given_up_on(hostile):
    """The first connections shake hands; from the loss on, the front accepts and never
    answers: each try ends at the connect timeout, naming the handshake, and reconnecting
    gives up within --ctrl-loss-tmo plus one connect timeout; reads fail with EIO."""
    t = start(hostile)
    m = t.m
    assert m.mount() == "ready", m.log()
    t.front.stall = True
    t.front.cut_all()
    cut = time.monotonic()
    assert m.wait_for_log(r"lost the connection to", 10), m.log()[-3000:]
    dd = read(m)  # waits for the reconnect, which never comes
    assert dd.returncode != 0 and "Input/output error" in dd.stderr, (dd, m.log()[-3000:])
    gave_up = m.wait_for_log(r"gave up after (\d+) reconnects in (\d+) s", 30)
    took = time.monotonic() - cut
    assert gave_up, m.log()[-3000:]
    assert int(gave_up[2]) <= CTRL_LOSS_TMO + CONNECT_TIMEOUT, m.log()[-3000:]
    assert took < CTRL_LOSS_TMO + CONNECT_TIMEOUT + 3, (took, m.log()[-3000:])
    assert re.search(r"reconnect 1 to \S+ failed: NVMe/TCP admin queue: no TLS handshake with "
                     r"127\.0\.0\.1:\d+ within 10 s", m.log()), m.log()[-3000:]
    finish(t)


KEY_CHANGES = [
    ("another key", "sslv3 alert illegal parameter"),
    ("no key", "sslv3 alert handshake failure"),
]


@pytest.mark.parametrize(("change", "alert"), KEY_CHANGES, ids=[c[0] for c in KEY_CHANGES])
def test_a_key_the_target_stopped_taking_ends_reconnecting(hostile, change, alert):
    """The target's PSK for our identity changed (or it dropped the identity) during an
    outage: the reconnect's handshake is refused with an alert, and reconnecting stops at
    once, though --ctrl-loss-tmo would allow 600 s (as a rejected DH-HMAC-CHAP secret does),
    in one line that names the identity; reads fail with EIO from then on.  The mount's path
    connects anew every -c, as after any controller that gave up (so a key put right on the
    target is taken again), each failure logged ever more rarely."""
    t = start(hostile, options=("-c", "1", "-l", "600", "-k", "1"))
    m = t.m
    assert m.mount() == "ready", m.log()
    t.front.keys = {t.psk.identity: os.urandom(32)} if change == "another key" else {}
    t.front.cut_all()
    stopped = m.wait_for_log(r"stopped reconnecting: (.*)$", 20)
    assert stopped, m.log()[-3000:]
    assert stopped[1] == (
        f"NVMe/TCP admin queue: the TLS handshake failed: {alert} with 127.0.0.1:"
        f"{t.front.port} (the target refused the PSK: does it hold the same PSK for "
        f"identity '{t.psk.identity}'?)"), m.log()[-3000:]
    named = lines_with(m, alert)
    assert len([li for li in named if not li.startswith("nvmeof-fuse: path ")]) == 1, \
        m.log()[-3000:]  # the controller's: no "reconnect 1 failed" line before it
    dd = read(m)
    assert dd.returncode != 0 and "Input/output error" in dd.stderr, (dd, m.log()[-3000:])
    finish(t)
