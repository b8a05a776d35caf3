"""ratelimit: lines of one kind per window, a failure's lines ever more rarely, short lists,
capped lines; on a clock the tests turn."""

from __future__ import annotations

import logging

import pytest

from nvmeof_fuse import ratelimit
from nvmeof_fuse.ratelimit import FailureStreak, LineCap, RateLimitedLog, brief_list


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def logs(caplog):
    """caplog at every level of the tests' logger; ``logs.messages``: what was written."""
    caplog.set_level(logging.DEBUG, logger="test.ratelimit")
    return caplog


LOG = logging.getLogger("test.ratelimit")


def test_a_storm_of_one_kind_writes_its_burst_then_says_how_many_it_left_out(clock, logs):
    limited = RateLimitedLog(LOG, interval=10, burst=3, clock=clock)
    for i in range(1207):
        limited.log("aen", logging.INFO, "event %d", i)
        clock.now += 0.005  # about 2,000 a second, for 6 s
    assert logs.messages == ["event 0", "event 1", "event 2"]
    clock.now += 10
    limited.log("aen", logging.INFO, "event %d", 1207)
    assert logs.messages[3] == "event 1207 ... and 1,204 more in the last 16 s"
    limited.log("aen", logging.INFO, "event %d", 1208)  # a new window: its burst again
    assert logs.messages[4:] == ["event 1208"]


def test_kinds_have_budgets_of_their_own(clock, logs):
    limited = RateLimitedLog(LOG, interval=10, burst=1, clock=clock)
    for _ in range(5):
        limited.log("ana", logging.INFO, "ana")
        limited.log(("keep-alive", "path 0"), logging.INFO, "keep-alive")
    assert logs.messages == ["ana", "keep-alive"]


def test_report_suppressed_says_the_last_line_left_out_once_its_window_ended(clock, logs):
    limited = RateLimitedLog(LOG, interval=10, burst=1, clock=clock)
    for i in range(4):
        limited.log("ana", logging.WARNING, "flip %d", i)
    assert limited.report_suppressed() == 0  # the window goes on
    clock.now += 10
    assert ratelimit.report_suppressed() == 1
    assert logs.messages == ["flip 0", "flip 3 ... and 2 more in the last 10 s"]
    assert limited.report_suppressed() == 0  # said once
    limited.log("ana", logging.WARNING, "flip %d", 4)  # a quiet kind starts anew
    assert logs.messages[-1] == "flip 4"


def test_one_line_left_out_is_reported_as_it_was(clock, logs):
    limited = RateLimitedLog(LOG, interval=10, burst=1, clock=clock)
    limited.log("k", logging.INFO, "a")
    limited.log("k", logging.INFO, "b")
    assert limited.report_suppressed(final=True) == 1
    assert logs.messages == ["a", "b"]


def test_keys_are_bounded_and_the_evicted_kind_says_what_it_left_out(clock, logs):
    limited = RateLimitedLog(LOG, interval=10, burst=1, max_keys=4, clock=clock)
    limited.log(0, logging.INFO, "k0")
    limited.log(0, logging.INFO, "k0 again")
    limited.log(0, logging.INFO, "k0 once more")
    for key in range(1, 100):
        limited.log(key, logging.INFO, "k%d", key)
    assert len(limited._windows) == 4
    assert logs.messages[:3] == ["k0", "k1", "k2"]
    assert "k0 once more ... and 1 more in the last 1 s" in logs.messages


def test_a_level_not_logged_costs_no_state(clock, logs):
    limited = RateLimitedLog(LOG, clock=clock)
    LOG.setLevel(logging.INFO)
    try:
        assert not limited.log("debug", logging.DEBUG, "x")
    finally:
        LOG.setLevel(logging.NOTSET)
    assert not limited._windows and not logs.messages


def test_a_failure_is_logged_when_it_starts_then_ever_more_rarely(clock, logs):
    streak = FailureStreak(LOG, first_gap=1, longest_gap=60, clock=clock)
    for _ in range(2 * 3600):  # one every 0.5 s for an hour
        streak.failed(logging.ERROR, "keep-alive failed: %s", "Internal Error")
        clock.now += 0.5
    assert logs.messages[0] == "keep-alive failed: Internal Error"
    assert logs.messages[1] == "keep-alive failed: Internal Error (3 failures in 1 s)"
    assert logs.messages[2] == "keep-alive failed: Internal Error (7 failures in 3 s)"
    assert len(logs.messages) < 3600 / 60 + 10  # at most one a minute once it slowed down
    assert logs.messages[-1].startswith("keep-alive failed: Internal Error (")
    assert streak.end() == " after 7,200 failures in 3600 s"
    assert streak.end() == ""  # over
    streak.failed(logging.ERROR, "again")  # a new one starts at once
    assert logs.messages[-1] == "again"


def test_brief_list_names_a_few_and_counts_the_rest():
    assert brief_list([]) == ""
    assert brief_list(["n1", "n2"]) == "n1, n2"
    names = (f"n{i}" for i in range(1, 65537))
    assert brief_list(names, shown=3) == "n1, n2, n3 and 65,533 more"


def test_line_cap_cuts_a_long_line_and_says_how_much(clock):
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "mounted %s", ("n1, " * 5000,),
                               None)
    assert LineCap(4096).filter(record)
    text = record.getMessage()
    assert len(text) <= 4096 and text.endswith("more characters)"), text[-60:]
    short = logging.LogRecord("x", logging.INFO, __file__, 1, "mounted %s", ("n1",), None)
    LineCap(4096).filter(short)
    assert short.getMessage() == "mounted n1"


def test_forget_starts_every_kind_afresh(clock, logs):
    limited = RateLimitedLog(LOG, interval=10, burst=1, clock=clock)
    limited.log("k", logging.INFO, "a")
    limited.log("k", logging.INFO, "b")
    ratelimit.forget_all()
    limited.log("k", logging.INFO, "c")
    assert logs.messages == ["a", "c"]
