"""Command IDs with a generation (transport/cids.py)."""

import pytest

from nvmeof_fuse.transport.cids import CommandIds


def test_ids_name_their_slot_in_the_low_bits():
    ids = CommandIds(127)
    cids = [ids.take() for _ in range(127)]
    assert sorted(cid & ids.mask for cid in cids) == list(range(127))
    assert not ids.free


def test_a_reused_slot_carries_a_new_generation():
    ids = CommandIds(4)
    first = ids.take()
    ids.give_back(first)
    second = ids.take()
    assert second & ids.mask == first & ids.mask and second != first
    assert ids.current(ids.slot(second)) == second


def test_generations_wrap_within_sixteen_bits():
    ids = CommandIds(1)
    seen = set()
    for _ in range(1 << 16):
        cid = ids.take()
        seen.add(cid)
        ids.give_back(cid)
    assert seen == set(range(0, 1 << 16, 2))  # every generation before one repeats


def test_a_queue_of_every_id_has_no_generation_left():
    ids = CommandIds(1 << 16)
    cid = ids.take()
    ids.give_back(cid)
    assert ids.take() == cid  # degenerate, but still a valid command ID


def test_bad_size_is_refused():
    with pytest.raises(ValueError, match="1-65536"):
        CommandIds(0)
