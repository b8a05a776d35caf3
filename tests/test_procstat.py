import os
import subprocess
import sys
import time

from nvmeof_fuse.procstat import (
    MACHINE_FIELDS,
    children,
    cpu_seconds,
    machine_cpu,
    process_tree,
    processes_cpu,
)


def test_our_cpu_seconds_grow_as_we_compute():
    before = cpu_seconds(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert cpu_seconds(os.getpid()) > before >= 0


def test_a_child_is_found_and_its_cpu_counts_with_children_once_waited_for():
    spin = ("import sys, time; sys.stdin.read(); end = time.process_time() + 0.1\n"
            "while time.process_time() < end: pass")
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE)
    try:
        assert child.pid in children(os.getpid())
        assert {os.getpid(), child.pid} <= process_tree(os.getpid())
        assert process_tree(child.pid) == {child.pid}
    finally:
        child.communicate(b"", timeout=60)
    assert child.pid not in children(os.getpid())
    alone = cpu_seconds(os.getpid())
    assert cpu_seconds(os.getpid(), with_children=True) > alone


def test_a_loop_of_parents_seen_while_pids_are_reused_ends(monkeypatch):
    import nvmeof_fuse.procstat as procstat

    monkeypatch.setattr(procstat, "_parents", lambda: {10: 1, 11: 10, 10_000: 11, 1: 10_000})
    assert process_tree(10) == {10, 11, 10_000, 1}


def test_processes_cpu_sums_the_live_ones_and_counts_a_gone_one_as_nothing():
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait(60)
    ours = cpu_seconds(os.getpid())
    assert ours <= processes_cpu({os.getpid(), gone.pid}) <= cpu_seconds(os.getpid())


def test_the_machines_cpu_comes_by_kind_and_grows():
    before = machine_cpu()
    assert tuple(before) == MACHINE_FIELDS and all(v >= 0 for v in before.values())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert sum(machine_cpu().values()) > sum(before.values())
