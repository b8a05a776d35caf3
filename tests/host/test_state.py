"""The controller's state table: allowed transitions, refusals, waking waiters."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from nvmeof_fuse.host.state import (
    ALLOWED,
    CONNECTING,
    DEAD,
    DELETING,
    LIVE,
    NEW,
    RESETTING,
    CtrlState,
    StateMachine,
)


def walk(*states: CtrlState) -> StateMachine:
    machine = StateMachine()
    for state in states:
        assert machine.change(state), f"{machine.current} -> {state}"
    return machine


def test_bring_up_loss_reconnect_and_giving_up_are_allowed():
    machine = walk(CONNECTING, LIVE, RESETTING, CONNECTING, LIVE, RESETTING, CONNECTING,
                   DELETING, DEAD)
    assert machine.current is DEAD and machine.current == "dead"


@pytest.mark.parametrize("path,refused", [
    ((), LIVE),  # not connected yet
    ((CONNECTING, LIVE), CONNECTING),  # a loss resets first
    ((CONNECTING, LIVE, RESETTING), RESETTING),  # a second loss while resetting
    ((CONNECTING, DELETING), LIVE),  # closed while connecting: never live again
    ((CONNECTING, LIVE, DELETING, DEAD), RESETTING),
    ((CONNECTING, LIVE), DEAD),  # dead only by way of deleting
])
def test_transitions_outside_the_table_are_refused_and_change_nothing(path, refused):
    machine = walk(*path)
    before = machine.current
    assert not machine.change(refused)
    assert machine.current is before


def test_every_state_is_in_the_table():
    assert set(ALLOWED) == set(CtrlState) and not ALLOWED[NEW]


def test_waiters_wake_on_a_change_and_on_wake():
    async def main():
        machine = walk(CONNECTING)
        woken = []

        async def waiter():
            await machine.wait_changed()
            woken.append(machine.current)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            machine.change(LIVE)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            machine.wake()
        assert woken == [LIVE, LIVE]

    trio.run(main)
