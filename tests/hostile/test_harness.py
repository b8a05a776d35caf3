"""The harness itself: a good target passes every check, and the target's hooks lie."""

from __future__ import annotations

import pytest
from hostile_harness import DD_BOUND, UNMOUNT_BOUND
from hostile_target import FAULTS, Fault, HostileTarget, fault


def test_a_good_target_reads_and_writes(hostile):
    for direction in ("read", "write"):
        out = hostile.run("none", direction).check("ok")
        assert out.dd_seconds < DD_BOUND and out.unmount_seconds < UNMOUNT_BOUND


def test_a_fault_name_is_registered_once():
    with pytest.raises(ValueError, match="twice"):
        fault("none", "again")(Fault)


def test_every_fault_has_a_description():
    assert all(cls.description for cls in FAULTS.values())
    assert isinstance(HostileTarget("none").hostile, Fault)


def test_the_target_as_a_command_lists_every_registered_fault():
    import subprocess
    import sys
    from pathlib import Path

    from hostile_target import load_faults

    script = Path(__file__).resolve().parents[1] / "hostile_target.py"
    listed = subprocess.run([sys.executable, str(script), "--list"], capture_output=True,
                            text=True, timeout=30, check=True).stdout
    names = {line.split(":")[0] for line in listed.splitlines()}
    assert names == set(load_faults()) and len(names) > 1
