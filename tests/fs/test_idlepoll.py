"""The idle poll's budget: pure arithmetic on what the polls saw."""

from __future__ import annotations

import pytest

from nvmeof_fuse.fs.idlepoll import MAX_SKIP, MIN_ALONE, IdlePoll


def serial(poll_max: float = 0.001) -> IdlePoll:
    """An idle poll that has seen a client keep one request in flight, polls catching each
    next request 20 us after it began."""
    poll = IdlePoll(poll_max=poll_max)
    for _ in range(MIN_ALONE):
        poll.budget(served=1)
    for _ in range(100):
        poll.caught(0.00002)
    return poll


def test_polls_for_twice_the_gaps_it_caught():
    poll = IdlePoll(poll_max=0.001)
    budgets = [poll.budget(served=1) for _ in range(MIN_ALONE)]
    assert budgets[-1] == 0.001 and not any(budgets[:-1])  # then the longest poll
    for _ in range(100):
        poll.caught(0.00002)
    assert poll.budget(served=1) == pytest.approx(0.00004, rel=0.05)


def test_no_poll_while_several_requests_come_between_idle_moments():
    poll = serial()
    assert poll.budget(served=1) > 0
    assert poll.budget(served=3) == 0  # a deeper queue: the server is busy anyway
    assert [poll.budget(served=1) > 0 for _ in range(MIN_ALONE)] == \
        [False] * (MIN_ALONE - 1) + [True]


def test_never_past_poll_max():
    poll = serial()
    for _ in range(100):
        poll.caught(0.5)  # (a caller's clock can run past the budget it was given)
    assert poll.budget(served=1) == 0.001


def test_a_poll_that_ran_out_sleeps_through_more_idle_moments_each_time():
    poll = serial()
    skipped = []
    for _ in range(9):
        poll.missed()
        n = 0
        while poll.budget(served=1) == 0:
            n += 1
        skipped.append(n)  # (the budget that ended the loop was the next probe)
    assert skipped == [1, 2, 4, 8, 16, 32, 64, 64, 64]
    assert skipped[-1] == MAX_SKIP


def test_a_probe_after_misses_polls_longer_and_a_catch_ends_the_back_off():
    poll = serial()
    short = poll.budget(served=1)
    poll.missed()
    assert poll.budget(served=1) == 0
    assert poll.budget(served=1) == pytest.approx(2 * short)  # the client may have slowed
    poll.caught(0.0001)
    poll.missed()  # after a catch, one idle moment is slept through, not 2
    assert poll.budget(served=1) == 0 and poll.budget(served=1) > 0


def test_misses_alone_keep_the_probe_within_poll_max():
    poll = serial()
    for _ in range(20):
        poll.missed()
        poll.skip = 0
        assert 0 < poll.budget(served=1) <= 0.001
