"""transport/pollbudget: how long a caller polls for its command, per size class."""

from __future__ import annotations

import pytest

from nvmeof_fuse.transport.pollbudget import PROBE_EVERY, PollBudget

POLL_MAX = 0.002
KIB4, MIB = 4096, 1 << 20


def slow(budget: PollBudget, nbytes: int, seconds: float = 0.3) -> None:
    """Commands of ``nbytes`` took ``seconds`` each, found after sleeping."""
    for _ in range(40):
        budget.record(nbytes, seconds, polled=False)


@pytest.mark.parametrize("nbytes, same_as", [(4096, 4000), (4096, 2049), (0, 0), (1, 1)])
def test_sizes_within_a_power_of_two_share_a_class(nbytes, same_as):
    assert PollBudget.size_class(nbytes) == PollBudget.size_class(same_as)


def test_4_kib_and_8_kib_are_classes_apart():
    assert PollBudget.size_class(KIB4) != PollBudget.size_class(KIB4 + 1)


def test_a_class_with_no_samples_yet_is_polled_for_up_to_the_limit():
    assert PollBudget(POLL_MAX).budget(KIB4) == pytest.approx(POLL_MAX)


def test_the_poll_is_twice_the_recent_latency_of_commands_that_size():
    budget = PollBudget(POLL_MAX)
    for _ in range(60):
        budget.record(KIB4, 0.0004, polled=True)
    assert budget.budget(KIB4) == pytest.approx(0.0008, rel=0.01)


def test_slow_large_commands_do_not_stop_polling_for_small_ones():
    """A 1 MiB read that waited behind fifteen others says nothing of a 4 KiB read."""
    budget = PollBudget(POLL_MAX)
    budget.record(KIB4, 0.0004, polled=True)
    slow(budget, MIB)
    assert budget.budget(KIB4) > 0
    assert budget.budget(MIB) == 0


def test_a_class_too_slow_to_poll_for_is_probed_now_and_then():
    budget = PollBudget(POLL_MAX)
    slow(budget, KIB4)
    budgets = [budget.budget(KIB4) for _ in range(3 * PROBE_EVERY)]
    assert budgets.count(POLL_MAX) == 3 and budgets.count(0.0) == 3 * PROBE_EVERY - 3


def test_a_probe_that_catches_its_command_restarts_the_class_from_there():
    """Slept latencies hold the wake-up too: without this, a class past the limit once
    would never be polled for again, however fast its commands became."""
    budget = PollBudget(POLL_MAX)
    slow(budget, KIB4, 0.0025)
    budget.record(KIB4, 0.0003, polled=True)
    assert budget.budget(KIB4) == pytest.approx(0.0006)


def test_a_probe_that_misses_only_adds_its_sample():
    budget = PollBudget(POLL_MAX)
    slow(budget, KIB4, 0.01)
    before = budget.latency(KIB4)
    budget.record(KIB4, 0.004, polled=False)
    assert budget.budget(KIB4) == 0 and budget.latency(KIB4) < before


def test_a_zero_limit_never_polls():
    budget = PollBudget(0.0)
    assert {budget.budget(KIB4) for _ in range(2 * PROBE_EVERY)} == {0.0}
