"""How an attached controller shares its leased queues between callers' threads and its loop."""

import pytest

from nvmeof_fuse.host.attached import polled_share
from nvmeof_fuse.host.connect_options import QUEUES_PER_CLIENT


@pytest.mark.parametrize(("wanted", "leased", "share"), [
    (2, 4, 2),  # a full lease: two polled, two on the loop
    (2, 3, 1),  # the loop keeps two for writes
    (2, 2, 1),
    (2, 1, 0),  # one queue: the loop's
    (2, 0, 0),
    (0, 4, 0),  # polling off
    (3, 8, 3),
])
def test_the_loop_keeps_half_of_the_leased_queues_at_least(wanted, leased, share):
    assert polled_share(wanted, leased) == share


def test_a_full_lease_polls_as_many_queues_as_a_file_asks_for():
    from nvmeof_fuse.companion.client.own_queues import POLLED_QUEUES

    assert polled_share(POLLED_QUEUES, QUEUES_PER_CLIENT) == POLLED_QUEUES
