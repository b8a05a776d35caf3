"""A file on ext4 on a mounted namespace: ``nvmeof_fuse.File`` beside the kernel's reads of it.

  python scripts/benches/bench_files.py --dir FS_DIR [--mib 192] [--rounds 3] [--json]

Runs in the VM (scripts/benches/bench-guest, part ``files``), where FS_DIR is ext4 on a loop
device (``--direct-io=on``) over ``MOUNT/n2``.  It writes one safetensors checkpoint of about
``--mib`` MiB there, then in each round, one after the other and each from a cold page cache
(``drop_caches``):

- ``file``: ``File(path).read`` of the whole file into host memory (an array allocated once);
- ``fio_direct``: fio reading the same file with O_DIRECT, 1 MiB at QD16 (libaio);
- ``buffered``: ``read()`` of the file in 1 MiB pieces through the page cache;
- ``load_safetensors``: ``nvmeof_fuse.load_safetensors(path)``;
- ``load_file``: ``safetensors.numpy.load_file(path)``, its peer.

MB = 10^6 bytes.  Prints every round and the medians, with the ratios; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

MIB = 1 << 20


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def checkpoint(total: int) -> dict[str, np.ndarray]:
    """Tensors of a few dtypes adding up to about ``total`` bytes (a cheap pattern: the VM
    makes random numbers slowly)."""
    out, left, i = {}, total, 0
    dtypes = [np.float32, np.float16, np.int64, np.uint8]
    while left > 0:
        dtype = np.dtype(dtypes[i % len(dtypes)])
        n = max(1, min(left, (9 << 20) + 4093 * i) // dtype.itemsize)
        out[f"layer.{i}.weight"] = ((np.arange(n, dtype=np.uint64) * 2654435761 + i)
                                    % 251).astype(dtype)
        left -= n * dtype.itemsize
        i += 1
    return out


def timed(fn) -> tuple[float, object]:
    drop_caches()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def fio_direct(path: str, size: int) -> float:
    """MB/s of fio's O_DIRECT read of the whole file, 1 MiB at QD16."""
    out = subprocess.run(
        ["fio", "--name=seqread", f"--filename={path}", "--rw=read", "--bs=1M", "--iodepth=16",
         "--ioengine=libaio", "--direct=1", f"--size={size}", "--output-format=json"],
        capture_output=True, text=True, check=True, timeout=900).stdout
    job = json.loads(out)["jobs"][0]["read"]
    return job["bw_bytes"] / 1e6


def buffered(path: str) -> int:
    done = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(MIB):
            done += len(chunk)
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--mib", type=int, default=192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from safetensors.numpy import load_file, save_file

    import nvmeof_fuse

    path = os.path.join(args.dir, "bench.safetensors")
    save_file(checkpoint(args.mib * MIB), path)
    size = os.path.getsize(path)
    buf = np.empty(size, dtype=np.uint8)
    f = nvmeof_fuse.File(path)  # opened once, its queues connected, as fio opens before it runs
    f.read(buf)  # and the array registered once
    rounds: dict[str, list[float]] = {k: [] for k in (
        "file", "fio_direct", "buffered", "load_safetensors", "load_file")}
    for r in range(args.rounds):
        seconds, n = timed(lambda: f.read(buf))
        assert n == size
        rounds["file"].append(size / 1e6 / seconds)
        drop_caches()
        rounds["fio_direct"].append(fio_direct(path, size))
        seconds, n = timed(lambda: buffered(path))
        assert n == size
        rounds["buffered"].append(size / 1e6 / seconds)
        seconds, ours = timed(lambda: nvmeof_fuse.load_safetensors(path))
        rounds["load_safetensors"].append(seconds)
        seconds, theirs = timed(lambda: load_file(path))
        rounds["load_file"].append(seconds)
        if r == 0:
            assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rounds.items()),
              file=sys.stderr)
    f.close()
    med = {k: statistics.median(v) for k, v in rounds.items()}
    result = {"size": size, "rounds": rounds, "median": med,
              "placement": f.placement["extents"],
              "file/fio_direct": med["file"] / med["fio_direct"],
              "file/buffered": med["file"] / med["buffered"],
              "load_file/load_safetensors": med["load_file"] / med["load_safetensors"]}
    if args.json:
        print(json.dumps(result))
    print(render(result), file=sys.stderr if args.json else sys.stdout)
    return 0


def render(result: dict) -> str:
    med, rounds = result["median"], result["rounds"]
    lines = [f"A {result['size'] / MIB:.1f} MiB file on ext4 on a loop device over MOUNT/n2, "
             f"cold cache each ({result['placement']})",
             "| metric | File.read (ours) | fio O_DIRECT 1 MiB QD16 | buffered read() | "
             "ours/fio | ours/buffered |",
             "|---|---|---|---|---|---|",
             f"| whole file, MB/s, median | {med['file']:.1f} | {med['fio_direct']:.1f} | "
             f"{med['buffered']:.1f} | {result['file/fio_direct']:.2f} | "
             f"{result['file/buffered']:.2f} |",
             f"| rounds | {_list(rounds['file'])} | {_list(rounds['fio_direct'])} | "
             f"{_list(rounds['buffered'])} | | |",
             "",
             "| metric | load_safetensors (ours) | safetensors.numpy.load_file | "
             "load_file/ours |",
             "|---|---|---|---|",
             f"| seconds, median | {med['load_safetensors']:.2f} | {med['load_file']:.2f} | "
             f"{result['load_file/load_safetensors']:.2f} |",
             f"| rounds | {_list(rounds['load_safetensors'], 2)} | "
             f"{_list(rounds['load_file'], 2)} | |"]
    return "\n".join(lines) + "\n"


def _list(values: list[float], digits: int = 1) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


if __name__ == "__main__":
    sys.exit(main())
