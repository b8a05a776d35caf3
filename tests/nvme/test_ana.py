"""ANA log page (LID 0Ch) built byte by byte as the Linux target writes it
(``nvmet_execute_get_log_page_ana``: 16-byte header, 32-byte group descriptors,
NSIDs after each), and the encoder the fakes use."""

import struct

import pytest

from nvmeof_fuse.nvme.ana import (
    GROUP_DESCRIPTOR_SIZE,
    HEADER_SIZE,
    AnaGroup,
    AnaLogPage,
    AnaState,
    ana_log_size,
)


def nvmet_page(groups, chgcnt=7, ngrps=None, size=4096):
    """What nvmet copies: descriptors in group order, the header last, zeroes after."""
    body = b""
    for grpid, state, nsids in groups:
        body += struct.pack("<IIQB15x", grpid, len(nsids), chgcnt, state)
        body += struct.pack(f"<{len(nsids)}I", *nsids)
    head = struct.pack("<QH6x", chgcnt, len(groups) if ngrps is None else ngrps)
    return (head + body).ljust(size, b"\0")


def test_layout_sizes_match_the_kernel_structs():
    assert (HEADER_SIZE, GROUP_DESCRIPTOR_SIZE) == (16, 32)


def test_parses_groups_states_and_nsids():
    page = AnaLogPage.from_bytes(nvmet_page([(1, 1, [1, 2]), (2, 3, [5])]))
    assert (page.chgcnt, page.ngrps, page.complete) == (7, 2, True)
    assert page.groups[0] == AnaGroup(1, AnaState.OPTIMIZED, 7, (1, 2))
    assert page.group(2).state is AnaState.INACCESSIBLE
    assert page.nsid_states() == {1: AnaState.OPTIMIZED, 2: AnaState.OPTIMIZED,
                                  5: AnaState.INACCESSIBLE}
    assert not page.changing


def test_return_groups_only_has_no_nsids():
    page = AnaLogPage.from_bytes(nvmet_page([(1, 2, []), (3, 15, [])]))
    assert [(g.grpid, g.state, g.nsids) for g in page.groups] == [
        (1, AnaState.NON_OPTIMIZED, ()), (3, AnaState.CHANGE, ())]
    assert page.changing and page.nsid_states() == {}


def test_a_short_buffer_keeps_the_whole_descriptors_only():
    # nvmet stops copying descriptors that do not fit but still counts them in NGRPS
    full = nvmet_page([(1, 1, [1]), (2, 1, [2, 3, 4])], size=0)
    page = AnaLogPage.from_bytes(full[: HEADER_SIZE + GROUP_DESCRIPTOR_SIZE + 4 + 40])
    assert page.ngrps == 2 and [g.grpid for g in page.groups] == [1] and not page.complete


def test_reserved_state_and_group_zero_are_refused():
    with pytest.raises(ValueError, match="reserved ANA state 0x5"):
        AnaLogPage.from_bytes(nvmet_page([(1, 5, [1])]))
    with pytest.raises(ValueError, match="group ID 0"):
        AnaLogPage.from_bytes(nvmet_page([(0, 1, [1])]))
    with pytest.raises(ValueError, match="needs 16 bytes"):
        AnaLogPage.from_bytes(b"\0" * 8)


def test_encoder_round_trips_and_pads():
    page = AnaLogPage.of({2: (AnaState.INACCESSIBLE, (3,)), 1: (AnaState.OPTIMIZED, (1, 2))},
                         chgcnt=9)
    data = page.to_bytes(4096)
    assert len(data) == 4096 and data == nvmet_page([(1, 1, [1, 2]), (2, 3, [3])], chgcnt=9)
    assert AnaLogPage.from_bytes(data) == page


def test_state_labels_are_the_kernel_sysfs_names():
    assert [s.label for s in AnaState] == ["optimized", "non-optimized", "inaccessible",
                                           "persistent-loss", "change"]
    assert [s.usable for s in AnaState] == [True, True, False, False, False]


def test_log_size_is_what_the_kernel_allocates():
    # nvmet: NANAGRPID 128, MNAN 1024
    assert ana_log_size(128, 1024) == 16 + 128 * 32 + 1024 * 4
