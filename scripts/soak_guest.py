"""The reliability soak, inside the testbed VM (run by ``scripts/soak``; see there).

Mounts the testbed's subsystem over TRANSPORT with ``-c 1 -l 120``, runs fio (randrw, 4k-256k,
QD16, crc32c verify with verify_backlog and serialize_overlap) on ``n1`` for SOAK_SECONDS while a
companion client (``nvmeof_fuse.File`` on ``n2``, an ``nvmeof_fuse.empty`` buffer) re-reads a
known pattern in a loop, and takes the subsystem off its port once per SOAK_OUTAGES entry
(seconds each), spread over the run (``none``: no outage).  Prints what happened, and where the
CPU went, and writes it to ``$TESTBED_OUT/soak-TRANSPORT.json``.
With SOAK_WORKERS (``"1 2 2 1"``), one soak per count in turn on a mount of that many FUSE
workers (``soak-TRANSPORT-wN.json``, ``-wN-2.json`` for a count's second), in one boot, and
the bytes each count moved, summed over its soaks, against the first count's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "testbed"))

from vm import NVMET_PORTS, sh, target_away, wait_for  # noqa: E402

from nvmeof_fuse.procstat import (  # noqa: E402
    MACHINE_FIELDS,
    cpu_seconds,
    machine_cpu,
    process_tree,
    processes_cpu,
)

CHILD = os.path.join(REPO, "tests", "testbed", "companion_child.py")
MNT = "/tmp/nvmeof-soak"
READ_SIZE = 16 << 20
READ_OFFSET = 8 << 20
WARM_UP = 10.0  # s of load before the daemon's RSS is taken as its value before the soak
SAMPLE_EVERY = 10.0  # s between lines of the timeline


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def stats(mnt: str) -> dict:
    with open(f"{mnt}/.nvmeof/stats.json") as f:
        return json.load(f)


def moved(mnt: str, name: str, doc: dict | None = None) -> int:
    """Bytes read and written on namespace ``name`` so far (in ``doc``, a ``stats.json``
    already read)."""
    return sum(op["bytes"] for op in (doc or stats(mnt))[name]["ops"].values())


def cpu_snapshot(doc: dict, daemon: int, fio: int, reader: int) -> dict[str, Any]:
    """Where the CPU went so far: the machine's by kind, the daemon's main process, its FUSE
    workers, fio and the companion reader, beside the bytes n1 and n2 moved (``doc``: the
    mount's ``stats.json`` just read)."""
    return {"at": time.monotonic(), "machine": machine_cpu(),
            "main": cpu_seconds(daemon),
            "workers": processes_cpu(process_tree(daemon) - {daemon}),
            "fio": cpu_seconds(fio, with_children=True),  # (its job's, also once reaped)
            "reader": processes_cpu(process_tree(reader)),
            "n1_bytes": moved(MNT, "n1", doc), "n2_bytes": moved(MNT, "n2", doc)}


def cpu_use(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """What :func:`cpu_snapshot` saw between two snapshots: seconds, each side's CPU seconds
    and per MB that n1 moved (fio's), and how busy the machine was."""
    wall = last["at"] - first["at"]
    machine = {k: last["machine"][k] - first["machine"][k] for k in MACHINE_FIELDS}
    total = sum(machine.values())
    sides = {k: last[k] - first[k] for k in ("main", "workers", "fio", "reader")}
    busy = total - machine["idle"] - machine["iowait"]
    sides["rest"] = busy - sum(sides.values())  # kernel threads, softirqs, the target
    mb = (last["n1_bytes"] - first["n1_bytes"]) / 1e6
    return {"seconds": round(wall, 1), "n1_mb": round(mb, 1),
            "n2_mb": round((last["n2_bytes"] - first["n2_bytes"]) / 1e6, 1),
            "busy": round(busy / max(total, 1e-9), 3),
            "machine_s": {k: round(v, 1) for k, v in machine.items()},
            "cpu_s": {k: round(v, 1) for k, v in sides.items()},
            "cpu_ms_per_n1_mb": {k: round(1e3 * v / max(mb, 1e-9), 2)
                                 for k, v in sides.items()}}


def count(path: str, text: str) -> int:
    with open(path) as f:
        return f.read().count(text)


def main() -> int:
    transport = sys.argv[1] if len(sys.argv) > 1 else "rdma"
    if transport not in NVMET_PORTS:
        print(f"soak: transport must be rdma or tcp, not {transport!r}", file=sys.stderr)
        return 2
    seconds = float(os.environ.get("SOAK_SECONDS") or 240)
    outages_text = os.environ.get("SOAK_OUTAGES") or "3 6 9"
    outages = [] if outages_text == "none" else [float(s) for s in outages_text.split()]
    counts = os.environ.get("SOAK_WORKERS", "").split()
    if not all(c.isdigit() and int(c) >= 1 for c in counts):
        print(f"soak: SOAK_WORKERS is worker counts (1 or more), not {counts!r}",
              file=sys.stderr)
        return 2
    results = []
    runs: dict[int, int] = {}
    for workers in [int(c) for c in counts] or [0]:  # (0: as before, no --workers)
        runs[workers] = runs.get(workers, 0) + 1
        ok, result = soak(transport, seconds, outages, workers, runs[workers])
        results.append((ok, result))
    if len(results) > 1:
        compare([result for _, result in results])
    return 0 if all(ok for ok, _ in results) else 1


def compare(results: list[dict]) -> None:
    """Each count of workers' bytes against the first count's, summed over its soaks (with
    the counts alternating, ``1 2 2 1``, a boot that slows as it runs weighs on each
    alike), and each soak's CPU per MB of n1 by side."""
    order = " ".join(str(r["workers"]) for r in results)
    by_count: dict[int, list[dict]] = {}
    for result in results:
        by_count.setdefault(result["workers"], []).append(result)
    (first, base), *others = by_count.items()
    base_bytes = sum(moved_bytes(r) for r in base)
    for count, runs in others:
        mb = sum(moved_bytes(r) for r in runs)
        print(f"{count} workers moved {mb / max(1, base_bytes):.2f}x the bytes of {first} "
              f"({mb / 1e6:,.0f} MB against {base_bytes / 1e6:,.0f} MB, fio's reads and "
              f"writes; {len(runs)} and {len(base)} soaks, in the order {order})")
    for result in results:
        if result["cpu"]:
            print(f"  {result['workers']} workers, CPU ms per MB of n1: " + ", ".join(
                f"{k} {v:g}" for k, v in result["cpu"]["cpu_ms_per_n1_mb"].items()))


def moved_bytes(result: dict) -> int:
    return result["fio"].get("read_bytes", 0) + result["fio"].get("written_bytes", 0)


def soak(transport: str, seconds: float, outages: list[float], workers: int, run: int = 1
         ) -> tuple[bool, dict]:
    """One soak on a mount of ``workers`` FUSE workers (0: no ``--workers``), the ``run``-th
    with that count: whether it passed, and what happened (also written to the output
    folder)."""
    out_dir = os.environ["TESTBED_OUT"]
    nqn, port = os.environ["TESTBED_NQN"], os.environ["TESTBED_PORT"]
    addr = os.environ["TESTBED_RDMA_ADDR" if transport == "rdma" else "TESTBED_TCP_ADDR"]
    name = (f"{transport}-w{workers}" if workers else transport) + (f"-{run}" if run > 1 else "")
    log = os.path.join(out_dir, f"soak-{name}-daemon.log")
    stop = f"/tmp/soak-{name}.stop"
    os.makedirs(MNT, exist_ok=True)
    for path in (log, stop):
        if os.path.exists(path):
            os.unlink(path)
    sh("nvmeof-fuse", "mount", "-t", transport, "-a", addr, "-s", port, "-n", nqn,
       "-c", "1", "-l", "120", "--daemon", "--log-file", log,
       *(["--workers", str(workers)] if workers else []), MNT)
    with open(f"{MNT}/.nvmeof/companion.json") as f:
        daemon = json.load(f)["pid"]
    rss_mounted = rss_kib(daemon)
    reader_out = os.path.join(out_dir, f"soak-{name}-reader.out")
    reader = subprocess.Popen(
        [sys.executable, CHILD, "reread", f"{MNT}/n2", str(READ_OFFSET), str(READ_SIZE), stop],
        stdout=open(reader_out, "w"), stderr=open(reader_out + ".err", "w"))
    fio_out = os.path.join(out_dir, f"soak-{name}-fio.json")
    fio = subprocess.Popen(
        ["fio", "--name=soak", f"--filename={MNT}/n1", "--rw=randrw", "--bsrange=4k-256k",
         "--iodepth=16", "--ioengine=libaio", "--direct=1", "--size=64M", "--time_based",
         f"--runtime={seconds:.0f}", "--verify=crc32c", "--verify_backlog=64",
         "--verify_fatal=1", "--continue_on_error=io", "--output-format=json",
         # writes in flight at once on the same LBAs (past a wrap of the file) land in
         # either order (NVMe orders no two commands, nor do two FUSE workers): fio's verify
         # then needs them one after the other
         "--serialize_overlap=1",
         f"--output={fio_out}"], stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    timeline = []
    cpu: list[dict[str, Any]] = []  # the first taken once warmed up, the last while fio ran

    def sample(note: str = "") -> None:
        doc = stats(MNT)
        conn = doc["connection"]
        row = {"t": round(time.monotonic() - started), "state": conn["state"],
               "losses": conn["losses"], "reconnects": conn["reconnects"],
               **{k: v for k, v in conn.items() if k.startswith("bounce_")},
               "rss_kib": rss_kib(daemon), "n1_mb": round(moved(MNT, "n1", doc) / 1e6),
               "forwarded": sum(w.get("forwarded", 0) for w in doc.get("workers", [])),
               "note": note}
        timeline.append(row)
        print("  " + " ".join(f"{k}={v}" for k, v in row.items() if v != ""), flush=True)
        if fio.poll() is None:  # (once fio is done, its CPU is no longer seen)
            cpu.append(cpu_snapshot(doc, daemon, fio.pid, reader.pid))

    try:
        # WARM_UP s of load, from fio's first bytes: under TCG, fio and the client may take
        # longer than WARM_UP to start, and an RSS taken before any I/O is no "before"
        wait_for(lambda: moved(MNT, "n1") > 0, 120)
        time.sleep(WARM_UP)
        rss_before = rss_kib(daemon)
        cpu.clear()
        sample("warmed up")
        # outages spread over the run, the last one ending well before fio does
        gap = (seconds - WARM_UP - 30) / max(1, len(outages))
        for i, outage in enumerate(outages):
            at = WARM_UP + i * gap + gap / 2
            while (left := at - (time.monotonic() - started)) > 0:
                time.sleep(min(SAMPLE_EVERY, left))
                sample()
            reconnected = count(log, "reconnected to")
            with target_away(nqn, NVMET_PORTS[transport]):
                sample(f"port off for {outage:g} s")
                time.sleep(outage)
            wait_for(lambda n=reconnected: count(log, "reconnected to") > n, 180)
            sample("reconnected" if count(log, "reconnected to") > reconnected else
                   "NOT reconnected")
        while fio.poll() is None:
            time.sleep(SAMPLE_EVERY)
            sample()
        fio_err = fio.communicate(timeout=300)[1]
    finally:
        open(stop, "w").close()
        try:
            reader.wait(300)
        except subprocess.TimeoutExpired:
            reader.kill()
        if fio.poll() is None:
            fio.kill()
    final = stats(MNT)
    serving = [{k: v for k, v in process.items() if k != "namespaces"}
               for process in final.get("workers", [])] or [final.get("serving", {})]
    rss_after = rss_kib(daemon)
    subprocess.run(["fusermount3", "-u", MNT], capture_output=True, timeout=120)
    with open(reader_out) as f:
        lines = [json.loads(line) for line in f if line.startswith("{")]
    summary = lines[-1] if lines and "rounds" in lines[-1] else {"rounds": 0, "errors": [
        f"the reader ended without a summary (exit {reader.returncode})"], "mismatches": 0,
        "slowest_s": 0, "own_queues": []}
    try:
        with open(fio_out) as f:
            job = json.load(f)["jobs"][0]
        fio_result = {"exit": fio.returncode, "error": job["error"],
                      "total_err": job.get("total_err", 0),
                      "read_bytes": job["read"]["io_bytes"],
                      "written_bytes": job["write"]["io_bytes"]}
    except (OSError, ValueError, KeyError) as exc:
        fio_result = {"exit": fio.returncode, "error": f"no fio report: {exc}",
                      "stderr": fio_err[-2000:]}
    conn = final["connection"]
    result = {
        "transport": transport, "workers": workers or 1, "seconds": seconds,
        "outages_s": outages,
        "fio": fio_result,
        "companion": {"reads": summary["rounds"], "mismatches": summary["mismatches"],
                      "errors": summary["errors"], "slowest_read_s": summary["slowest_s"],
                      "own_queues": summary["own_queues"]},
        "daemon": {"losses": conn["losses"], "reconnects": conn["reconnects"],
                   "bounce": {k: v for k, v in conn.items() if k.startswith("bounce_")},
                   "rss_kib_mounted": rss_mounted, "rss_kib_before": rss_before,
                   "rss_kib_peak": max(row["rss_kib"] for row in timeline),
                   "rss_kib_after": rss_after,
                   "rss_change": round(rss_after / rss_before - 1, 3),
                   "log_tracebacks": count(log, "Traceback")},
        "cpu": cpu_use(cpu[0], cpu[-1]) if len(cpu) > 1 else None,
        "serving": serving,  # each serving process's counts (with workers)
        "timeline": timeline,
    }
    with open(os.path.join(out_dir, f"soak-{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    c, d = result["companion"], result["daemon"]
    print(f"soak over {transport}{f' with --workers {workers}' if workers else ''}: "
          f"{seconds:g} s, outages of {', '.join(f'{o:g}' for o in outages)} s")
    first = fio_result["error"]
    first = f"{first} ({os.strerror(first)})" if isinstance(first, int) and first else first
    print(f"  fio: exit {fio_result['exit']}, first error {first}, "
          f"{fio_result.get('total_err', '?')} errors continued past, "
          f"{fio_result.get('read_bytes', 0) / 1e6:.0f} MB read, "
          f"{fio_result.get('written_bytes', 0) / 1e6:.0f} MB written")
    print(f"  companion: {c['reads']} reads of {READ_SIZE >> 20} MiB, {c['mismatches']} "
          f"mismatches, {len(c['errors'])} errors, slowest read {c['slowest_read_s']:.1f} s, "
          f"on queues {c['own_queues'] or 'of the daemon'}")
    for error in c["errors"][:5]:
        print(f"    {error}")
    print(f"  daemon: {d['losses']} losses, {d['reconnects']} reconnects, bounce {d['bounce']}, "
          f"RSS {d['rss_kib_before'] / 1024:.1f} MiB before, {d['rss_kib_after'] / 1024:.1f} "
          f"MiB after ({d['rss_change']:+.1%}; {d['rss_kib_mounted'] / 1024:.1f} MiB "
          f"once mounted, {d['rss_kib_peak'] / 1024:.1f} MiB at most during), "
          f"{d['log_tracebacks']} tracebacks in its log")
    if result["cpu"]:
        use = result["cpu"]
        print(f"  CPU over {use['seconds']:g} s ({use['n1_mb']:,.0f} MB on n1, machine "
              f"{use['busy']:.0%} busy), ms per MB of n1: " + ", ".join(
                  f"{k} {v:g}" for k, v in use["cpu_ms_per_n1_mb"].items()))
    ok = (fio_result["exit"] == 0 and fio_result["error"] == 0
          and fio_result.get("total_err", 0) == 0 and not c["errors"] and not c["mismatches"]
          and d["losses"] == d["reconnects"] == len(outages)
          and d["rss_change"] <= 0.2)  # growth is bloat; memory given back (the client's
                                        # session ended before the reading) is not
    print(f"  {'PASS' if ok else 'FAIL'}", flush=True)
    return ok, result


if __name__ == "__main__":
    sys.exit(main())
