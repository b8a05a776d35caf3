"""The harness itself: a good target passes every check, and the target's hooks lie."""

from __future__ import annotations

import pytest
from hostile_target import FAULTS, Fault, HostileTarget, fault


def test_a_good_target_reads_and_writes(hostile):
    for direction in ("read", "write"):
        out = hostile.run("none", direction).check("ok")
        assert out.dd_seconds < 30 and out.unmount_seconds < 20


def test_a_fault_name_is_registered_once():
    with pytest.raises(ValueError, match="twice"):
        fault("none", "again")(Fault)


def test_every_fault_has_a_description():
    assert all(cls.description for cls in FAULTS.values())
    assert isinstance(HostileTarget("none").hostile, Fault)
