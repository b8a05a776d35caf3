"""A controller's state and the transitions allowed between them (no I/O).

Like the kernel's ``nvme_change_ctrl_state()``: every change goes through
:meth:`StateMachine.change`, which refuses a transition the table does not allow,
so two paths racing (a loss while closing, a second loss while resetting) cannot
move the controller somewhere it must not be.

- ``new``: created, nothing connected yet;
- ``connecting``: connecting the queues (bring-up, or a reconnect attempt);
- ``live``: queues connected, commands run;
- ``resetting``: the connection was lost; its queues are being torn down;
- ``deleting``: going away (closed, or reconnecting gave up);
- ``dead``: gone; every caller gets the reason.
"""

from __future__ import annotations

import enum

import trio


class CtrlState(enum.StrEnum):
    NEW = "new"
    CONNECTING = "connecting"
    LIVE = "live"
    RESETTING = "resetting"
    DELETING = "deleting"
    DEAD = "dead"


NEW, CONNECTING, LIVE, RESETTING, DELETING, DEAD = CtrlState

ALLOWED: dict[CtrlState, frozenset[CtrlState]] = {
    # new state: the states it may follow
    CONNECTING: frozenset({NEW, RESETTING}),
    LIVE: frozenset({CONNECTING, RESETTING}),
    RESETTING: frozenset({NEW, LIVE}),
    DELETING: frozenset({NEW, CONNECTING, LIVE, RESETTING}),
    DEAD: frozenset({DELETING}),
    NEW: frozenset(),
}


class StateMachine:
    """The current state; waiters wake on every change (and on :meth:`wake`)."""

    def __init__(self) -> None:
        self.current = NEW
        self._changed = trio.Event()

    def can_change(self, new: CtrlState) -> bool:
        return self.current in ALLOWED[new]

    def change(self, new: CtrlState) -> bool:
        """Move to ``new`` if the table allows it from the current state; whether it did."""
        if not self.can_change(new):
            return False
        self.current = new
        self.wake()
        return True

    def wake(self) -> None:
        """Wake the waiters without a change (they re-check what they wait for)."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()
