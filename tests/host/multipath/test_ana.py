"""PathAna: ANA state per namespace from log pages, pending after an ANA status, ANATT."""

from nvmeof_fuse.host.multipath.ana import AnaGroupChange, PathAna
from nvmeof_fuse.nvme.ana import AnaLogPage, AnaState

OPT, NONOPT, INACC, LOSS, CHANGE = (AnaState.OPTIMIZED, AnaState.NON_OPTIMIZED,
                                    AnaState.INACCESSIBLE, AnaState.PERSISTENT_LOSS,
                                    AnaState.CHANGE)


def page(**groups):
    return AnaLogPage.of({int(k[1:]): v for k, v in groups.items()})


def test_states_per_namespace_and_the_changes_reported():
    ana = PathAna(reporting=True, anatt=10)
    assert ana.state(1) is None and ana.usable_state(1) is None  # nothing read yet
    changes = ana.update(page(g1=(OPT, (1,)), g2=(INACC, (2,))), now=0)
    assert changes == [AnaGroupChange(1, None, OPT), AnaGroupChange(2, None, INACC)]
    assert (ana.state(1), ana.usable_state(1), ana.group(1)) == (OPT, OPT, 1)
    assert (ana.state(2), ana.usable_state(2)) == (INACC, None)
    changes = ana.update(page(g1=(NONOPT, (1,)), g2=(INACC, (2,))), now=1)
    assert [c.describe() for c in changes] == ["ana group 1: optimized -> non-optimized"]
    assert ana.usable_state(1) is NONOPT and ana.reads == 2


def test_groups_only_pages_use_identify_namespace_anagrpid():
    ana = PathAna(reporting=True, anatt=10)
    ana.set_namespace_group(5, 3)
    ana.set_namespace_group(6, 0)  # not reported: ignored
    ana.update(page(g3=(LOSS, ())), now=0)
    assert ana.state(5) is LOSS and ana.usable_state(5) is None and ana.state(6) is None


def test_a_controller_without_ana_is_optimized_for_every_namespace():
    ana = PathAna(reporting=False, anatt=0)
    ana.mark_pending()
    assert ana.usable_state(7) is OPT


def test_an_ana_status_makes_the_path_pending_until_the_next_read():
    ana = PathAna(reporting=True, anatt=10)
    ana.update(page(g1=(OPT, (1,))), now=0)
    ana.mark_pending()
    assert ana.usable_state(1) is None and ana.state(1) is OPT
    ana.update(page(g1=(OPT, (1,))), now=1)
    assert ana.usable_state(1) is OPT


def test_anatt_runs_while_any_group_is_changing_and_doubles_as_the_kernel():
    ana = PathAna(reporting=True, anatt=10)
    ana.update(page(g1=(CHANGE, (1,))), now=100)
    assert ana.anatt_deadline() == 120 and not ana.anatt_expired(119)
    ana.update(page(g1=(CHANGE, (1,))), now=110)  # still changing: the clock runs on
    assert ana.anatt_expired(120)
    ana.update(page(g1=(OPT, (1,))), now=115)
    assert ana.anatt_deadline() is None and not ana.anatt_expired(1000)
