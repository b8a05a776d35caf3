"""Small checks and decoders shared by the wire-layer modules (private)."""

from __future__ import annotations

import operator
from typing import TypeAlias

BytesLike: TypeAlias = bytes | bytearray | memoryview


def uint(name: str, value: int, bits: int) -> int:
    """Return ``value`` as an int if it fits in ``bits`` unsigned bits, else raise ValueError."""
    value = operator.index(value)
    if not 0 <= value < (1 << bits):
        raise ValueError(f"{name} must fit in {bits} bits (0..{(1 << bits) - 1}), got {value}")
    return value


def in_range(name: str, value: int, low: int, high: int) -> int:
    """Return ``value`` if ``low <= value <= high``, else raise ValueError."""
    value = operator.index(value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be {low}..{high}, got {value}")
    return value


def buffer(name: str, data: BytesLike, size: int) -> memoryview:
    """View the first ``size`` bytes of ``data``; raise ValueError if it is shorter."""
    view = memoryview(data).cast("B")
    if len(view) < size:
        raise ValueError(f"{name} needs {size} bytes, got {len(view)}")
    return view[:size]


def text(view: memoryview, offset: int, length: int) -> str:
    """Decode a fixed-width ASCII field: stop at the first NUL, drop padding spaces."""
    raw = bytes(view[offset : offset + length]).split(b"\0", 1)[0]
    return raw.decode("ascii", "replace").strip()


def le(view: memoryview, offset: int, length: int) -> int:
    """Read a little-endian unsigned integer of ``length`` bytes (any width, e.g. 128-bit)."""
    return int.from_bytes(view[offset : offset + length], "little")
