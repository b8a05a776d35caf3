"""PathSelector: the kernel's iopolicies over usable paths, optimized first."""

import pytest

from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.host.multipath.iopolicy import POLICIES, PathSelector, check_policy
from nvmeof_fuse.nvme.ana import AnaState

OPT, NONOPT = AnaState.OPTIMIZED, AnaState.NON_OPTIMIZED


def pick(selector, states, depths=None, n=1):
    paths = list(range(len(states)))
    depths = depths or [0] * len(states)
    return [selector.choose(paths, states.__getitem__, depths.__getitem__) for _ in range(n)]


@pytest.mark.parametrize("policy", POLICIES)
def test_optimized_first_nonoptimized_only_without_and_none_when_none(policy):
    assert set(pick(PathSelector(policy), [NONOPT, OPT, NONOPT], n=4)) == {1}
    assert pick(PathSelector(policy), [None, NONOPT], n=2) == [1, 1]
    assert pick(PathSelector(policy), [None, None]) == [None]


def test_failover_keeps_to_one_path_until_it_stops_being_optimized():
    s = PathSelector("failover")
    assert pick(s, [OPT, OPT], n=3) == [0, 0, 0]
    assert pick(s, [None, OPT], n=2) == [1, 1]
    assert pick(s, [OPT, OPT]) == [1]  # path 0 is back: stay on 1
    assert pick(s, [NONOPT, NONOPT]) == [1]  # no optimized path: stay on the one in use


def test_round_robin_alternates_over_optimized_paths():
    s = PathSelector("round-robin")
    assert pick(s, [OPT, OPT, OPT], n=4) == [0, 1, 2, 0]
    assert pick(s, [OPT, NONOPT, OPT], n=3) == [2, 0, 2]


def test_queue_depth_takes_the_least_busy_and_equals_in_turn():
    s = PathSelector("queue-depth")
    assert pick(s, [OPT, OPT], depths=[3, 1], n=2) == [1, 1]
    assert pick(s, [OPT, OPT], n=4) == [0, 1, 0, 1]
    assert pick(s, [NONOPT, OPT], depths=[0, 9]) == [1]  # optimized first, however busy


def test_forget_and_unknown_policy():
    s = PathSelector("failover")
    pick(s, [OPT, OPT])
    s.forget(0)
    assert s.last is None
    with pytest.raises(InvalidArgument, match="unknown iopolicy 'numa'.*queue-depth"):
        check_policy("numa")
