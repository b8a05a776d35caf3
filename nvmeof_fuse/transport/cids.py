"""Command IDs with a generation in their top bits, as the kernel's ``nvme_cid``.

A queue of N slots names each command by its slot (the low bits of the 16-bit command
ID) and by how often that slot was used (the bits above them).  A CapsuleResp, C2HData
or R2T for a slot whose command is from another generation is then an ID not in flight:
a late second answer for an earlier command can never complete the one using the slot
now.  The generation takes every bit the slots leave (at least four below 4,096 slots).
"""

from __future__ import annotations

CID_LIMIT = 1 << 16


class CommandIds:
    """The free slots of one queue and the command ID each carried last (no I/O)."""

    __slots__ = ("free", "mask", "step", "last")

    def __init__(self, slots: int) -> None:
        if not 0 < slots <= CID_LIMIT:
            raise ValueError(f"a queue holds 1-{CID_LIMIT} commands, not {slots}")
        tag_bits = max(1, (slots - 1).bit_length())
        self.mask = (1 << tag_bits) - 1
        """The bits of a command ID that name its slot."""
        self.step = 1 << tag_bits
        """What one generation adds to a command ID."""
        self.last = list(range(slots))
        """The command ID each slot carried last."""
        self.free = list(range(slots))
        """Free slots (read on the hot path, where a property call costs)."""

    def take(self) -> int:
        """The command ID for a free slot, one generation past the slot's last (the caller
        checked that one is free)."""
        slot = self.free.pop()
        last = self.last
        cid = last[slot] = (last[slot] + self.step) & (CID_LIMIT - 1)
        return cid

    def give_back(self, cid: int) -> None:
        """Free the slot of command ID ``cid``."""
        self.free.append(cid & self.mask)

    def slot(self, cid: int) -> int:
        return cid & self.mask

    def current(self, slot: int) -> int:
        """The command ID ``slot`` carries now, or carried last."""
        return self.last[slot]
