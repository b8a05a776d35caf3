"""I/O counters and latency percentiles, cheap enough to record on every command.

Latencies go into a log-scale histogram (16 buckets per power of two of
nanoseconds, so any percentile is within ~3% of the truth) that never grows
past about a thousand buckets, however long the process runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p50", 0.50),
    ("p90", 0.90),
    ("p99", 0.99),
    ("p99.9", 0.999),
)
_SUB_BITS = 4  # 2**4 buckets per power of two


def _width(lower: int) -> int:
    return 1 << max(0, lower.bit_length() - _SUB_BITS - 1)


@dataclass
class LatencyHistogram:
    """Log-scale latency histogram with exact count, sum and max."""

    buckets: dict[int, int] = field(default_factory=dict)
    count: int = 0
    total_ns: int = 0
    max_ns: int = 0

    def add(self, seconds: float) -> None:
        ns = int(seconds * 1e9) if seconds > 0 else 0
        # the bucket's lower bound: ns with all but its top _SUB_BITS + 1 bits cleared
        shift = ns.bit_length() - _SUB_BITS - 1
        key = (ns >> shift) << shift if shift > 0 else ns
        buckets = self.buckets
        buckets[key] = buckets.get(key, 0) + 1
        self.count += 1
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns

    def percentile(self, q: float) -> int:
        """Latency in ns below which a fraction ``q`` of samples fall (bucket midpoint)."""
        if not self.count:
            return 0
        rank = q * self.count
        seen = 0
        for lower in sorted(self.buckets):
            seen += self.buckets[lower]
            if seen >= rank:
                return min(lower + _width(lower) // 2, self.max_ns)
        return self.max_ns


@dataclass
class OpStats:
    """Counters of one operation kind."""

    ops: int = 0
    bytes: int = 0
    errors: int = 0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def snapshot(self) -> dict:
        lat = self.latency
        us = {name: lat.percentile(q) / 1000 for name, q in PERCENTILES}
        us["max"] = lat.max_ns / 1000
        us["mean"] = lat.total_ns / lat.count / 1000 if lat.count else 0.0
        return {"ops": self.ops, "bytes": self.bytes, "errors": self.errors, "latency_us": us}


class IoStats:
    """Per-operation counters and latencies plus free-form named counters."""

    def __init__(self) -> None:
        self.started = time.time()
        self.ops: dict[str, OpStats] = {}
        self.counters: dict[str, int] = {}

    def record(self, op: str, nbytes: int, seconds: float, ok: bool = True) -> None:
        """Count one ``op`` that moved ``nbytes`` in ``seconds``."""
        try:
            st = self.ops[op]
        except KeyError:
            st = self.ops[op] = OpStats()
        st.ops += 1
        if ok:
            st.bytes += nbytes
        else:
            st.errors += 1
        st.latency.add(seconds)

    def add(self, name: str, n: int = 1) -> None:
        """Bump the named counter (e.g. ``direct_bytes``) by ``n``."""
        self.counters[name] = self.counters.get(name, 0) + n

    def snapshot(self) -> dict:
        """A JSON-able copy of everything counted so far."""
        return {
            "uptime_s": round(time.time() - self.started, 3),
            "ops": {op: st.snapshot() for op, st in sorted(self.ops.items())},
            "counters": dict(sorted(self.counters.items())),
        }

    def format_text(self) -> str:
        """The snapshot as an aligned table for people."""
        snap = self.snapshot()
        cols = ["op", "ops", "bytes", "errors", *(n for n, _ in PERCENTILES), "max"]
        rows = [cols]
        for op, st in snap["ops"].items():
            lat = st["latency_us"]
            rows.append(
                [op, str(st["ops"]), _human_bytes(st["bytes"]), str(st["errors"])]
                + [_human_us(lat[c]) for c in cols[4:]]
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        lines = [f"uptime: {snap['uptime_s']:.0f} s (latencies in microseconds)"]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        for name, n in snap["counters"].items():
            lines.append(f"{name}: {n}")
        return "\n".join(lines) + "\n"


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _human_us(us: float) -> str:
    return f"{us:.0f}" if us >= 100 else f"{us:.1f}"
