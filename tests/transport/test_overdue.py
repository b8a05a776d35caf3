"""OverdueWatch: the same oldest command at two looks ``after`` s apart is overdue."""

from __future__ import annotations

from nvmeof_fuse.transport.overdue import OverdueWatch


class Queue:
    def __init__(self) -> None:
        self.commands: list[object] = []

    def oldest_command(self):
        return self.commands[0] if self.commands else None


def test_an_idle_queue_is_never_overdue():
    watch, queue = OverdueWatch(0.5), Queue()
    assert not any(watch.overdue([queue], now) for now in (0.0, 1.0, 10.0))


def test_a_command_still_oldest_after_the_limit_is_overdue():
    watch, queue = OverdueWatch(0.5), Queue()
    queue.commands.append(object())
    assert not watch.overdue([queue], 0.0)  # first seen
    assert not watch.overdue([queue], 0.4)
    assert watch.overdue([queue], 0.5)
    assert watch.overdue([queue], 0.9)


def test_a_queue_that_moves_on_is_not_overdue_however_busy():
    """Commands keep completing: the oldest is a new one at each look."""
    watch, queue = OverdueWatch(0.5), Queue()
    for look in range(20):
        queue.commands = [object(), object()]  # two in flight, never the same ones
        assert not watch.overdue([queue], look * 0.3)


def test_one_stuck_queue_among_busy_ones_is_overdue():
    watch = OverdueWatch(0.5)
    busy, stuck = Queue(), Queue()
    stuck.commands.append(object())
    for look in range(4):
        busy.commands = [object()]
        late = watch.overdue([busy, stuck], look * 0.25)
    assert late


def test_a_queue_no_longer_passed_is_forgotten():
    """After a reconnect the old queues are gone: nothing of theirs counts, and a new
    queue's command starts its own wait."""
    watch, old, new = OverdueWatch(0.5), Queue(), Queue()
    command = object()
    old.commands.append(command)
    watch.overdue([old], 0.0)
    new.commands.append(object())
    assert not watch.overdue([new], 1.0)
    assert not watch.overdue([old], 1.1)  # seen anew, not since 0.0
    assert watch.overdue([old], 1.6)
