"""What clearing a bounce buffer before a read costs (issue #49 item 3's RDMA guard):
``BouncePool.for_read`` per read size, beside a copy of the same bytes out of it (what a
read that is copied to its caller costs anyway).  ``python tests/host/bench_bounce_clear.py``.
"""

from __future__ import annotations

import time

from nvmeof_fuse.host.memory import BouncePool

SIZES = (4096, 32 << 10, 128 << 10, 1 << 20)
ROUNDS = 2000


class _Register:
    def __call__(self, addr: int, length: int, owner: object):
        return type("R", (), {"close": lambda self: None})()


def per_call_ns(fn, rounds: int = ROUNDS) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(rounds):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / rounds)
    return best


def main() -> None:
    pool = BouncePool(_Register(), max(SIZES), 1, clear_reads=True)
    region = pool._free[0]
    view = region.view
    out = bytearray(max(SIZES))
    print(f"{'bytes':>8} {'clear ns':>10} {'copy-out ns':>12} {'clear/copy':>10}")
    for size in SIZES:
        clear = per_call_ns(lambda size=size: pool.for_read(view, size))
        copy = per_call_ns(lambda size=size: out.__setitem__(slice(0, size), view[:size]))
        print(f"{size:>8} {clear:>10.0f} {copy:>12.0f} {clear / copy:>10.2f}")
    pool.close()


if __name__ == "__main__":
    main()
