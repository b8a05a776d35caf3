"""The idle poll's budget: pure arithmetic on what the polls saw."""

from __future__ import annotations

import pytest

from nvmeof_fuse.fs.idlepoll import MAX_SKIP, IdlePoll


def test_polls_for_twice_the_gaps_it_caught():
    poll = IdlePoll(poll_max=0.001)
    assert poll.budget() == 0.001  # nothing seen yet: the longest poll
    for _ in range(100):
        poll.caught(0.00002)
    assert poll.budget() == pytest.approx(0.00004, rel=0.05)


def test_never_past_poll_max():
    poll = IdlePoll(poll_max=0.001)
    for _ in range(100):
        poll.caught(0.5)  # (a caller's clock can run past the budget it was given)
    assert poll.budget() == 0.001


def test_a_poll_that_ran_out_sleeps_through_more_idle_moments_each_time():
    poll = IdlePoll(poll_max=0.001)
    for _ in range(100):
        poll.caught(0.00002)
    skipped = []
    for _ in range(9):
        assert poll.budget() > 0  # the probe
        poll.missed()
        n = 0
        while poll.budget() == 0:
            n += 1
        skipped.append(n)
        poll.skip = 0  # (that last budget() call was the next probe)
    assert skipped == [1, 2, 4, 8, 16, 32, 64, 64, 64]
    assert skipped[-1] == MAX_SKIP


def test_a_probe_after_misses_polls_longer_and_a_catch_ends_the_back_off():
    poll = IdlePoll(poll_max=0.001)
    for _ in range(100):
        poll.caught(0.00002)
    short = poll.budget()
    poll.missed()
    assert poll.budget() == 0
    assert poll.budget() == pytest.approx(2 * short)  # the client may have slowed down
    poll.caught(0.0001)
    poll.missed()  # after a catch, one idle moment is slept through, not 2
    assert poll.budget() == 0 and poll.budget() > 0


def test_misses_alone_keep_the_probe_within_poll_max():
    poll = IdlePoll(poll_max=0.001)
    for _ in range(20):
        poll.missed()
        poll.skip = 0
        assert 0 < poll.budget() <= 0.001
