"""What one path's controller says of Asymmetric Namespace Access, sans I/O.

The multipath head reads each path's ANA log page (LID 0Ch) at connect, on an
ANA-change event and after each reconnect, and hands it here with the time.
:class:`PathAna` keeps the state per ANA group and which group each namespace
is in, and runs the ANATT clock of the change state as the kernel's
``nvme_read_ana_log`` does (one timer, twice ANATT, while any group changes).
An ANA status on a command marks the path pending until the log is read again
(the kernel's ``NVME_NS_ANA_PENDING``): no I/O goes there meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...nvme.ana import AnaLogPage, AnaState

ANATT_SLACK = 2
"""The change state may last this many ANATTs before the path counts as failed (the
kernel doubles ANATT "for transports or AEN processing overhead")."""


@dataclass(frozen=True, slots=True)
class AnaGroupChange:
    """One ANA group whose state changed on a path (``old`` None: first seen)."""

    grpid: int
    old: AnaState | None
    new: AnaState

    def describe(self) -> str:
        old = self.old.label if self.old is not None else "unknown"
        return f"ana group {self.grpid}: {old} -> {self.new.label}"


class PathAna:
    """ANA state of the namespaces behind one controller.

    ``reporting`` False (Identify CMIC bit 3 clear): every namespace counts as
    optimized, as the kernel treats a controller without ANA.
    """

    def __init__(self, *, reporting: bool, anatt: float) -> None:
        self.reporting = reporting
        self.anatt = anatt
        self.groups: dict[int, AnaState] = {}
        self.ns_group: dict[int, int] = {}
        self.chgcnt = 0
        self.pending = False
        self.change_since: float | None = None
        self.reads = 0  # ANA log pages taken

    def set_namespace_group(self, nsid: int, grpid: int) -> None:
        """Identify Namespace's ANAGRPID for ``nsid`` (0: not reported)."""
        if grpid:
            self.ns_group[nsid] = grpid

    def update(self, page: AnaLogPage, now: float) -> list[AnaGroupChange]:
        """Take a new ANA log page read at ``now``; the groups whose state changed."""
        changes = []
        for group in page.groups:
            old = self.groups.get(group.grpid)
            if old is not group.state:
                changes.append(AnaGroupChange(group.grpid, old, group.state))
            self.groups[group.grpid] = group.state
            for nsid in group.nsids:
                self.ns_group[nsid] = group.grpid
        self.chgcnt = page.chgcnt
        self.pending = False
        self.reads += 1
        if any(state is AnaState.CHANGE for state in self.groups.values()):
            if self.change_since is None:
                self.change_since = now
        else:
            self.change_since = None
        return changes

    def mark_pending(self) -> None:
        """A command failed with an ANA status: no I/O here until the log is read again."""
        if self.reporting:
            self.pending = True

    def group(self, nsid: int) -> int | None:
        return self.ns_group.get(nsid)

    def state(self, nsid: int) -> AnaState | None:
        """The ANA state of ``nsid`` on this path; None while not known."""
        if not self.reporting:
            return AnaState.OPTIMIZED
        grpid = self.ns_group.get(nsid)
        return self.groups.get(grpid) if grpid is not None else None

    def usable_state(self, nsid: int) -> AnaState | None:
        """The state if I/O for ``nsid`` may go here (optimized or non-optimized, not
        pending), else None."""
        if self.pending:
            return None
        state = self.state(nsid)
        return state if state is not None and state.usable else None

    def anatt_deadline(self) -> float | None:
        """When a change state that has not ended counts as a failed path; None if none."""
        if self.change_since is None:
            return None
        return self.change_since + ANATT_SLACK * self.anatt

    def anatt_expired(self, now: float) -> bool:
        deadline = self.anatt_deadline()
        return deadline is not None and now >= deadline
