"""The reliability soak, inside the testbed VM (run by ``scripts/soak``; see there).

Mounts the testbed's subsystem over TRANSPORT with ``-c 1 -l 120``, runs fio (randrw, 4k-256k,
QD16, crc32c verify with verify_backlog) on ``n1`` for SOAK_SECONDS while a companion client
(``nvmeof_fuse.File`` on ``n2``, an ``nvmeof_fuse.empty`` buffer) re-reads a known pattern in a
loop, and takes the subsystem off its port once per SOAK_OUTAGES entry (seconds each), spread
over the run.  Prints what happened and writes it to ``$TESTBED_OUT/soak-TRANSPORT.json``.
With SOAK_WORKERS (``"1 2"``), one soak per count in turn on a mount of that many FUSE
workers (``soak-TRANSPORT-wN.json``), in one boot, and the bytes each moved against the
first's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "testbed"))

from vm import NVMET_PORTS, sh, target_away, wait_for  # noqa: E402

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


def moved(mnt: str, name: str) -> int:
    """Bytes read and written on namespace ``name`` so far."""
    return sum(op["bytes"] for op in stats(mnt)[name]["ops"].values())


def count(path: str, text: str) -> int:
    with open(path) as f:
        return f.read().count(text)


def main() -> int:
    transport = sys.argv[1] if len(sys.argv) > 1 else "rdma"
    if transport not in NVMET_PORTS:
        print(f"soak: transport must be rdma or tcp, not {transport!r}", file=sys.stderr)
        return 2
    seconds = float(os.environ.get("SOAK_SECONDS") or 240)
    outages = [float(s) for s in (os.environ.get("SOAK_OUTAGES") or "3 6 9").split()]
    counts = os.environ.get("SOAK_WORKERS", "").split()
    if not all(c.isdigit() and int(c) >= 1 for c in counts):
        print(f"soak: SOAK_WORKERS is worker counts (1 or more), not {counts!r}",
              file=sys.stderr)
        return 2
    results = []
    for workers in [int(c) for c in counts] or [0]:  # (0: as before, no --workers)
        ok, result = soak(transport, seconds, outages, workers)
        results.append((ok, result))
    if len(results) > 1:
        base = results[0][1]
        for _, result in results[1:]:
            ratio = moved_bytes(result) / max(1, moved_bytes(base))
            print(f"{result['workers']} workers moved {ratio:.2f}x the bytes of "
                  f"{base['workers']} ({moved_bytes(result) / 1e6:,.0f} MB against "
                  f"{moved_bytes(base) / 1e6:,.0f} MB, fio's reads and writes)")
    return 0 if all(ok for ok, _ in results) else 1


def moved_bytes(result: dict) -> int:
    return result["fio"].get("read_bytes", 0) + result["fio"].get("written_bytes", 0)


def soak(transport: str, seconds: float, outages: list[float], workers: int
         ) -> tuple[bool, dict]:
    """One soak on a mount of ``workers`` FUSE workers (0: no ``--workers``): whether it
    passed, and what happened (also written to the output folder)."""
    out_dir = os.environ["TESTBED_OUT"]
    nqn, port = os.environ["TESTBED_NQN"], os.environ["TESTBED_PORT"]
    addr = os.environ["TESTBED_RDMA_ADDR" if transport == "rdma" else "TESTBED_TCP_ADDR"]
    name = f"{transport}-w{workers}" if workers else transport
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
         f"--output={fio_out}"], stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    timeline = []

    def sample(note: str = "") -> None:
        conn = stats(MNT)["connection"]
        row = {"t": round(time.monotonic() - started), "state": conn["state"],
               "losses": conn["losses"], "reconnects": conn["reconnects"],
               **{k: v for k, v in conn.items() if k.startswith("bounce_")},
               "rss_kib": rss_kib(daemon), "note": note}
        timeline.append(row)
        print("  " + " ".join(f"{k}={v}" for k, v in row.items() if v != ""), flush=True)

    try:
        # WARM_UP s of load, from fio's first bytes: under TCG, fio and the client may take
        # longer than WARM_UP to start, and an RSS taken before any I/O is no "before"
        wait_for(lambda: moved(MNT, "n1") > 0, 120)
        time.sleep(WARM_UP)
        rss_before = rss_kib(daemon)
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
    ok = (fio_result["exit"] == 0 and fio_result["error"] == 0
          and fio_result.get("total_err", 0) == 0 and not c["errors"] and not c["mismatches"]
          and d["losses"] == d["reconnects"] == len(outages)
          and d["rss_change"] <= 0.2)  # growth is bloat; memory given back (the client's
                                        # session ended before the reading) is not
    print(f"  {'PASS' if ok else 'FAIL'}", flush=True)
    return ok, result


if __name__ == "__main__":
    sys.exit(main())
