"""The companion wire format's plans: which LBAs go where, what the client copies."""

from __future__ import annotations

import pytest

from nvmeof_fuse.companion import protocol
from nvmeof_fuse.companion.protocol import EdgeCopy, Piece, plan_read, plan_write
from nvmeof_fuse.errors import InvalidArgument


def test_aligned_read_is_one_piece_straight_to_the_destination():
    plan = plan_read(4096, 8192, 512, dest_region=7, dest_offset=100, edge_region=1,
                     edge_offset=0)
    assert plan.pieces == [Piece(8, 16, 7, 100)] and plan.edges == []


def test_unaligned_read_puts_partial_lbas_in_the_edge_buffer():
    plan = plan_read(1000, 2000, 512, dest_region=7, dest_offset=0, edge_region=1,
                     edge_offset=4096)
    # bytes 1000..2999: LBA 1 partial (488 B from 488), LBAs 2..4 whole, LBA 5 partial (440 B)
    assert plan.pieces == [Piece(1, 1, 1, 4096), Piece(5, 1, 1, 4608), Piece(2, 3, 7, 24)]
    assert plan.edges == [EdgeCopy(4096 + 488, 0, 24), EdgeCopy(4608, 1560, 440)]


def test_read_inside_one_lba():
    plan = plan_read(10, 5, 512, dest_region=7, dest_offset=0, edge_region=1, edge_offset=0)
    assert plan.pieces == [Piece(0, 1, 1, 0)] and plan.edges == [EdgeCopy(10, 0, 5)]


def test_write_plan_slices_the_callers_bytes():
    plan = plan_write(1000, 2000, 512)
    assert (plan.head, plan.middle, plan.tail) == (slice(0, 24), slice(24, 1560),
                                                   slice(1560, 2000))
    aligned = plan_write(512, 1024, 512)
    assert aligned.head == slice(0, 0) and aligned.tail == slice(1024, 1024)


def test_chunks_cut_at_lba_boundaries_and_cover_the_range():
    pieces = list(protocol.chunks(1000, 5000, 512, 2048))
    assert pieces[0] == (1000, 1560) and sum(n for _, n in pieces) == 5000
    for offset, length in pieces:  # each chunk touches at most 2048 // 512 LBAs
        assert (offset + length - 1) // 512 - offset // 512 < 4
    with pytest.raises(InvalidArgument, match="smaller than an LBA"):
        list(protocol.chunks(0, 10, 4096, 512))


def test_pieces_are_checked_when_decoded():
    assert Piece.from_list([1, 2, 3, 4]) == Piece(1, 2, 3, 4)
    for bad in ([1, 2, 3], [1, 2, 3, "4"], [1, 2, 3, True], "x"):
        with pytest.raises(protocol.ProtocolError, match="read piece"):
            Piece.from_list(bad)


@pytest.mark.parametrize(("nsids", "why"), [
    ("1", "got str"),
    ({"1": 1}, "got dict"),
    ([1] * (protocol.MAX_NAMED_NAMESPACES + 1), f"got {protocol.MAX_NAMED_NAMESPACES + 1}"),
    ([1, "2"], "got '2'"),
    ([True], "got True"),
    ([0], "got 0"),
    ([0xFFFFFFFF], "got 4294967295"),
    ([1, ["x" * 100]], "got [" + repr("x" * 100)[:19]),
])
def test_nsids_are_a_bounded_list_of_nsids_or_one_line_says_why(nsids, why):
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.nsids_field({"op": "lease", "nsids": nsids})
    assert str(refused.value) == (
        f"companion request 'lease': field 'nsids' must be a list of at most "
        f"{protocol.MAX_NAMED_NAMESPACES} NSIDs (1 to 0xFFFFFFFE), {why}")


def test_nsids_may_be_absent_or_name_any_nsids():
    assert protocol.nsids_field({"op": "lease"}) is None
    assert protocol.nsids_field({"op": "lease", "nsids": None}) is None
    assert protocol.nsids_field({"op": "lease", "nsids": []}) == []
    most = list(range(1, protocol.MAX_NAMED_NAMESPACES + 1))
    assert protocol.nsids_field({"op": "lease", "nsids": most}) == most
    assert protocol.nsids_field({"op": "lease", "nsids": [0xFFFFFFFE]}) == [0xFFFFFFFE]


@pytest.mark.parametrize(("header", "got"), [
    ({"event": "namespaces"}, "None"),
    ({"event": "namespaces", "generation": 0}, "0"),
    ({"event": "namespaces", "generation": True}, "True"),
    ({"event": "namespaces", "generation": "1"}, "'1'"),
    ({"op": "fuse", "generation": 1 << 63}, str(1 << 63)[:20]),
])
def test_a_generation_is_a_count_from_1_or_one_line_says_why(header, got):
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.generation_field(header)
    name = header.get("op") or header.get("event")
    assert str(refused.value) == (f"companion message {name!r}: field 'generation' must be a "
                                  f"count from 1, got {got}")
    assert protocol.generation_field({**header, "generation": (1 << 63) - 1}) == (1 << 63) - 1
