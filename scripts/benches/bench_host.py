"""The FUSE layer on the host, with no VM: one RAM image served four ways, fio on each.

  python scripts/benches/bench_host.py [--seconds 5] [--size-mib 256] [--out DIR]
                                      [--only ours,...]
  python scripts/benches/bench_host.py table FILE.json

One image on tmpfs (``/dev/shm``) is served by the kernel loop device (``losetup``), by
qemu-storage-daemon's FUSE export (C, libfuse), by our FUSE layer over RAM (``bench.py fuse-ram
--image``, the image mapped shared) and by the same operations with pyfuse3 as the FUSE server
(``--fuse pyfuse3``, the extra), the reason our own session is the default measured in every
run.  Each fio job (O_DIRECT, libaio) runs on the four in turn, so a busy host skews them
alike.  The table shows every figure, the server's CPU time per request (user+system of the
serving process; the loop device has none), and ours against qemu's, the loop device's and
pyfuse3's.  Figures are printed, never asserted.  Needs root (losetup, fusectl), fio and
qemu-storage-daemon (Debian ``qemu-system-common``); a server that cannot run shows as n/a.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench import IDLE_SECONDS, MIB, fio_command, fio_job_figure, fio_json, name_list

from nvmeof_fuse.procstat import cpu_seconds

HERE = Path(__file__).resolve().parent
FUSECTL = "/sys/fs/fuse/connections"
MAX_BACKGROUND = 32  # the same for every FUSE server (ours sets it itself, at INIT)
READY_TIMEOUT = 60.0  # s for a server to show its mount


@dataclass(frozen=True)
class FioJob:
    key: str
    label: str
    unit: str  # "IOPS" or "MB/s"
    rw: str
    bs: str
    qd: int


JOBS = (
    FioJob("randread16", "4 KiB randread QD16", "IOPS", "randread", "4k", 16),
    FioJob("randread1", "4 KiB randread QD1", "IOPS", "randread", "4k", 1),
    FioJob("randwrite16", "4 KiB randwrite QD16", "IOPS", "randwrite", "4k", 16),
    FioJob("read1m", "1 MiB read QD16", "MB/s", "read", "1M", 16),
    FioJob("write1m", "1 MiB write QD16", "MB/s", "write", "1M", 16),
)
COLUMNS = {"loop": "kernel loop device", "qemu": "qemu-storage-daemon FUSE (C)",
           "ours": "our FUSE over RAM", "pyfuse3": "the same on pyfuse3"}
RATIOS = (("ours", "qemu"), ("ours", "loop"), ("ours", "pyfuse3"))


# -- the table (pure: tests feed it canned figures) ------------------------------------------------

def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _rows(results: dict) -> list[list[str]]:
    """One row per job: label, each server's figure (with its CPU per request), ratios."""
    figures, cpu = results["figures"], results.get("cpu_us", {})
    rows = []
    for job in JOBS:
        cells = []
        for c in COLUMNS:
            v = figures.get(c, {}).get(job.key)
            us = cpu.get(c, {}).get(job.key)
            cells.append(_fmt(v) + (f" ({us:.0f} us)" if us is not None and v else ""))
        ratios = []
        for a, b in RATIOS:
            va, vb = figures.get(a, {}).get(job.key), figures.get(b, {}).get(job.key)
            ratios.append(f"{va / vb:.2f}x" if va and vb else "n/a")
        rows.append([f"{job.label}, {job.unit}", *cells, *ratios])
    return rows


HEADS = ["job", *COLUMNS.values(), *(f"{a}/{b}" for a, b in RATIOS)]
CPU_NOTE = "(N us) = CPU time of the serving process per request"


def table(results: dict) -> str:
    """Text table of ``results`` (as :func:`run` returns): figures, server CPU per request
    (in µs, in parentheses), ratios; then the notes and failures."""
    rows = _rows(results)
    widths = [max(len(r[i]) for r in [HEADS, *rows]) for i in range(len(HEADS))]

    def fmt(r: list[str]) -> str:
        return "  ".join(r[i].ljust(widths[i]) if i == 0 else r[i].rjust(widths[i])
                         for i in range(len(r)))

    out = [fmt(HEADS), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows), ""]
    out.append(f"MB = 10^6 bytes; {CPU_NOTE}.")
    out += [f"note: {n}" for n in results.get("notes", [])]
    out += [f"n/a {COLUMNS[c]}, {k}: {why}" for c, errs in results.get("errors", {}).items()
            for k, why in errs.items()]
    return "\n".join(out) + "\n"


def markdown(results: dict) -> str:
    """The same rows as a Markdown table (for the README)."""
    lines = ["| " + " | ".join(HEADS) + " |", "|---|" + "---:|" * (len(HEADS) - 1)]
    lines += ["| " + " | ".join(r) + " |" for r in _rows(results)]
    return "\n".join(lines) + "\n"


def fio_figure(job: FioJob, data: dict) -> float:
    """IOPS or MB/s of ``job`` from fio's JSON output."""
    (j,) = data["jobs"]
    if j.get("error"):
        raise RuntimeError(f"fio error {j['error']}")
    return fio_job_figure(j, write="write" in job.rw, mb_per_s=job.unit != "IOPS")


# -- the servers --------------------------------------------------------------------------------

def _is_mounted(path: str) -> bool:
    from nvmeof_fuse.fs.mount import read_mountinfo

    return any(m.mountpoint == path for m in read_mountinfo())


def _wait(cond, what: str, timeout: float = READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:g} s")
        time.sleep(0.05)


def _set_max_background(path: str) -> str:
    from nvmeof_fuse.fs.mount import raise_max_background

    got = raise_max_background(path, MAX_BACKGROUND)
    return f"{got}" if got else "kernel default (fusectl unavailable)"


@contextmanager
def _fusectl(notes: list[str]) -> Iterator[None]:
    """fusectl mounted (as systemd does), so both FUSE servers get the same max_background."""
    mounted = False
    if os.path.isdir(FUSECTL) and not _is_mounted(FUSECTL):
        mounted = subprocess.run(["mount", "-t", "fusectl", "none", FUSECTL],
                                 capture_output=True).returncode == 0
        if not mounted:
            notes.append("fusectl could not be mounted: FUSE max_background stays at the default")
    try:
        yield
    finally:
        if mounted:
            subprocess.run(["umount", FUSECTL], capture_output=True)


@contextmanager
def loop_device(image: str) -> Iterator[tuple[str, int | None]]:
    dev = subprocess.run(["losetup", "-f", "--show", image], capture_output=True, text=True,
                         check=True).stdout.strip()
    try:
        yield dev, None
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


@contextmanager
def qemu_export(image: str, workdir: str, notes: list[str]) -> Iterator[tuple[str, int]]:
    target = os.path.join(workdir, "qemu-export")
    open(target, "wb").close()  # the export's mountpoint: an existing regular file
    log = open(os.path.join(workdir, "qemu.log"), "wb")
    proc = subprocess.Popen(
        ["qemu-storage-daemon", "--blockdev",
         f"driver=file,node-name=f,filename={image}", "--export",
         f"type=fuse,id=e,node-name=f,mountpoint={target},writable=on"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _is_mounted(target) or proc.poll() is not None, "qemu-storage-daemon")
        if proc.poll() is not None:
            raise RuntimeError(f"qemu-storage-daemon exited {proc.returncode}: "
                               f"{_tail(log.name)}")
        notes.append(f"qemu-storage-daemon max_background: {_set_max_background(target)}")
        yield target, proc.pid
    finally:
        _stop(proc, target, signal.SIGTERM)
        log.close()


@contextmanager
def our_export(image: str, workdir: str, notes: list[str],
               fuse: str = "builtin") -> Iterator[tuple[str, int]]:
    """Our FUSE layer over RAM, served by FUSE server ``fuse`` (ours, or pyfuse3)."""
    mnt = os.path.join(workdir, fuse)
    os.mkdir(mnt)
    log = open(os.path.join(workdir, f"{fuse}.log"), "wb")
    proc = subprocess.Popen([sys.executable, str(HERE / "bench.py"), "fuse-ram", mnt,
                             "--image", image, "--fuse", fuse],
                            stdout=subprocess.PIPE, stderr=log)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()  # READY, or EOF when it failed
        if not line.startswith("READY"):
            raise RuntimeError(f"fuse-ram did not mount: {_tail(log.name)}")
        who = "our" if fuse == "builtin" else fuse
        notes.append(f"{who} max_background: {_set_max_background(mnt)}")
        yield os.path.join(mnt, "n1"), proc.pid
    finally:
        if _is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", mnt], capture_output=True, timeout=30)
        _stop(proc, mnt, signal.SIGINT)
        log.close()


def _stop(proc: subprocess.Popen, mountpoint: str, sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    if _is_mounted(mountpoint):
        subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True)


def _tail(path: str) -> str:
    with open(path, "rb") as f:
        lines = f.read().decode(errors="replace").strip().splitlines()
    return lines[-1][:150] if lines else "no output"


# -- the run --------------------------------------------------------------------------------------

def fio(target: str, job: FioJob, seconds: float) -> dict:
    cmd = fio_command(target, job.key, job.rw, job.bs, job.qd, seconds)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    if out.returncode != 0:
        raise RuntimeError((out.stderr.strip().splitlines() or ["fio failed"])[-1][:150])
    return fio_json(out.stdout)


def make_image(size: int, directory: str) -> str:
    """A file of ``size`` random bytes on tmpfs, so that no server reads holes."""
    fd, path = tempfile.mkstemp(prefix="nvmeof-fuse-bench-", suffix=".img", dir=directory)
    with os.fdopen(fd, "wb") as f:
        chunk = os.urandom(MIB)
        for _ in range(size // MIB):
            f.write(chunk)
    return path


def run(seconds: float, size_mib: int, only: list[str], log=print) -> dict:
    results: dict = {"seconds_per_job": seconds, "size_mib": size_mib, "figures": {},
                     "cpu_us": {}, "errors": {}, "notes": [],
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "loadavg_before": os.getloadavg()[0]}
    notes = results["notes"]
    with tempfile.TemporaryDirectory(prefix="nvmeof-fuse-bench-") as workdir, ExitStack() as st:
        image = make_image(size_mib * MIB, "/dev/shm")
        st.callback(os.unlink, image)
        st.enter_context(_fusectl(notes))
        makers = {"loop": lambda: loop_device(image),
                  "qemu": lambda: qemu_export(image, workdir, notes),
                  "ours": lambda: our_export(image, workdir, notes),
                  "pyfuse3": lambda: our_export(image, workdir, notes, "pyfuse3")}
        targets = {}
        for c in only:
            try:
                targets[c] = st.enter_context(makers[c]())
                log(f"{COLUMNS[c]}: {targets[c][0]}")
            except Exception as e:  # noqa: BLE001 - the column shows n/a with the reason
                results["errors"][c] = {"*": str(e)[:150]}
        for job in JOBS:  # job by job, each on every server in turn
            for c, (target, pid) in targets.items():
                try:
                    before = cpu_seconds(pid) if pid else 0.0
                    data = fio(target, job, seconds)
                    value = fio_figure(job, data)
                except Exception as e:  # noqa: BLE001 - one failed job shows as n/a
                    results["errors"].setdefault(c, {})[job.key] = str(e)[:150]
                    continue
                results["figures"].setdefault(c, {})[job.key] = value
                if pid:
                    side = data["jobs"][0]["write" if "write" in job.rw else "read"]
                    if side["total_ios"]:
                        used = cpu_seconds(pid) - before
                        results["cpu_us"].setdefault(c, {})[job.key] = \
                            used / side["total_ios"] * 1e6
                log(f"{job.label:22} {COLUMNS[c]:30} {_fmt(value):>10} {job.unit}")
        # A server that polls must not burn a CPU once its client stops: its CPU over a
        # quiet interval right after the last job.
        idle = {c: cpu_seconds(pid) for c, (_, pid) in targets.items() if pid}
        time.sleep(IDLE_SECONDS)
        for c, before in idle.items():
            percent = (cpu_seconds(targets[c][1]) - before) / IDLE_SECONDS * 100
            notes.append(f"{COLUMNS[c]}: {percent:.1f}% of a CPU while idle "
                         f"({IDLE_SECONDS:g} s after the last job)")
    results["loadavg_after"] = os.getloadavg()[0]
    notes.append(f"load average {results['loadavg_before']:.2f} before, "
                 f"{results['loadavg_after']:.2f} after ({os.cpu_count()} CPUs)")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["table"]:
        t = argparse.ArgumentParser(prog="bench_host.py table")
        t.add_argument("file")
        t.add_argument("--markdown", action="store_true")
        args = t.parse_args(argv[1:])
        with open(args.file) as f:
            results = json.load(f)
        print((markdown if args.markdown else table)(results), end="")
        return 0
    ap = argparse.ArgumentParser(prog="python scripts/benches/bench_host.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="per job and server (default 5)")
    ap.add_argument("--size-mib", type=int, default=256, help="image size (default 256)")
    ap.add_argument("--only", type=name_list(COLUMNS, "server"), default=list(COLUMNS),
                    metavar="NAME[,NAME...]",
                    help=f"serve only these ways (of {', '.join(COLUMNS)})")
    ap.add_argument("--out", metavar="DIR", help="also write DIR/bench-host.txt and .json")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.size_mib <= 0:
        print("bench host: --seconds and --size-mib must be positive", file=sys.stderr)
        return 2
    missing = [p for p in ("fio", "losetup", "qemu-storage-daemon", "fusermount3")
               if not shutil.which(p)]
    if missing:
        print(f"bench host: missing {', '.join(missing)} (scripts/testbed install "
              "installs them)", file=sys.stderr)
        return 1
    results = run(args.seconds, args.size_mib, args.only,
                  log=lambda s: print(s, file=sys.stderr, flush=True))
    text = table(results)
    print(text, end="")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench-host.txt"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "bench-host.json"), "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
