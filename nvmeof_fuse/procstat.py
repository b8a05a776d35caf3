"""CPU seconds of processes from ``/proc/PID/stat``, for the benches and checks that show what
each side (client, daemon, target) costs.  It imports nothing of the package: any layer, the
tests and the scripts may use it."""

from __future__ import annotations

import os

# fields after the command name in /proc/PID/stat (proc(5), counted from "state" as 0)
_PPID, _UTIME, _STIME, _CUTIME, _CSTIME = 1, 11, 12, 13, 14


def _fields(pid: int | str) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and ")"


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of the live processes."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found[int(entry)] = int(_fields(entry)[_PPID])
            except (OSError, ValueError, IndexError):  # gone meanwhile, or not a process
                pass
    return found


def children(parent: int) -> list[int]:
    """The live processes whose parent is ``parent``."""
    return [pid for pid, ppid in _parents().items() if ppid == parent]


def process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants alive now (``pid`` itself even when it is gone)."""
    below: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        below.setdefault(parent, []).append(child)
    tree, todo = set(), [pid]
    while todo:
        member = todo.pop()
        if member in tree:  # a pid reused during the scan can close a loop
            continue
        tree.add(member)
        todo += below.get(member, [])
    return tree


def cpu_seconds(pid: int, with_children: bool = False) -> float:
    """User and system CPU seconds of process ``pid`` (all its threads) so far; with
    ``with_children``, also those of its children, live or waited for (a target that
    serves each connection from a child process).  OSError when ``pid`` is gone."""
    fields = _fields(pid)
    ticks = int(fields[_UTIME]) + int(fields[_STIME])
    if with_children:
        ticks += int(fields[_CUTIME]) + int(fields[_CSTIME])
        for child in children(pid):
            try:
                child_fields = _fields(child)
            except OSError:  # waited for meanwhile: counted in ours next time
                continue
            ticks += int(child_fields[_UTIME]) + int(child_fields[_STIME])
    return ticks / os.sysconf("SC_CLK_TCK")


def processes_cpu(pids: set[int]) -> float:
    """User and system CPU seconds of the processes ``pids`` together (those gone meanwhile
    count nothing)."""
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except OSError:  # gone meanwhile
            continue
    return total


MACHINE_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
"""The kinds of CPU time in ``/proc/stat``'s first line, in its order (proc(5))."""


def machine_cpu() -> dict[str, float]:
    """The whole machine's CPU seconds since boot by kind (:data:`MACHINE_FIELDS`)."""
    with open("/proc/stat") as f:
        ticks = f.readline().split()[1:1 + len(MACHINE_FIELDS)]
    hz = os.sysconf("SC_CLK_TCK")
    return {kind: int(t) / hz for kind, t in zip(MACHINE_FIELDS, ticks, strict=True)}
