"""A second process using nvmeof_fuse.File (run by test_companion.py inside the VM).

    python companion_child.py roundtrip PATH OFFSET SIZE   write random data, read it back
    python companion_child.py loop PATH SIZE               read forever (to be killed)

``roundtrip`` prints one JSON line: the SHA-256 of what it wrote, whether the read
matched, and the daemon's companion counters before and after the read.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np

import nvmeof_fuse


def roundtrip(path: str, offset: int, size: int) -> None:
    data = nvmeof_fuse.empty(size)
    data[:] = np.frombuffer(os.urandom(size), dtype=np.uint8)
    out = nvmeof_fuse.empty(size)
    with nvmeof_fuse.File(path) as f:
        assert f.pwrite(data, file_offset=offset).get(600) == size
        before = f.stats()
        assert f.read(out, file_offset=offset) == size
        after = f.stats()
    print(json.dumps({"sha256": hashlib.sha256(data).hexdigest(),
                      "equal": bool((out == data).all()), "before": before, "after": after}))


def loop(path: str, size: int) -> None:
    out = nvmeof_fuse.empty(size)
    with nvmeof_fuse.File(path) as f:
        f.read(out, file_offset=511)
        print("reading", flush=True)
        while True:
            f.read(out, file_offset=511)


if __name__ == "__main__":
    mode, path, *numbers = sys.argv[1:]
    if mode == "roundtrip":
        roundtrip(path, int(numbers[0]), int(numbers[1]))
    else:
        loop(path, int(numbers[0]))
