"""NVMe/TCP over TLS beside plain NVMe/TCP, in one run: our core and the FUSE file (fio).

  python scripts/benches/bench_tls.py -a TCP_ADDR -n NQN [-s PORT] [--nsid 2] [--seconds 5]
                                      [--mount DIR] [--jobs KEY,...] [--json]
  python scripts/benches/bench_tls.py front --mode plain|ktls --backend HOST:PORT
      (a front in a process of its own: the PSK as JSON on stdin, ``READY PORT`` on stdout,
      served until stdin closes)

Our core's TLS ends in a front before nvmet's plain port: tests/tls_front.KernelRelayFront, the
handshake by OpenSSL, then the records in the kernel (kTLS) and the bytes spliced to nvmet in
the kernel.  The relay costs something of its own, so the fair peer of our core through the
kTLS front is our core through the same front in plain mode (no TLS, the same splice relay);
our core straight to nvmet shows what the relay costs.  Columns: our core direct, through
the plain relay, through the kTLS relay; with ``--mount``, fio on the FUSE file through
either relay.  Where the testbed has nvmet's own TLS port (``TESTBED_TLS_PORT``, tlshd doing
its handshakes, and trixie's nvme-cli as ``TESTBED_NVME_TLS``: docs/testbed.md), fio on the
kernel initiator's device over ``nvme connect --tls`` to that port, beside the same over
plain ``nvme connect`` to the plain port (kernel CPU is in no process: no CPU per I/O there).

CPU per I/O: our core's process (user + system: kTLS seals and opens in its syscalls), the
front's process (its splices; on the kTLS side it opens and seals too), and for the FUSE
file the mount daemon's processes; softirq work no process holds is in none.  A PSK made
afresh each run (SHA-256, TLS_AES_128_GCM_SHA256, as ``nvme gen-tls-key`` makes by
default).  Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import (
    JOBS,
    METRICS,
    TESTS,
    Cursor,
    Job,
    _fmt,
    _job_keys,
    _reason,
    core_slice,
    figure,
    fio_command,
    fio_job_figure,
    fio_json,
    own_core,
    text_grid,
)

from nvmeof_fuse.procstat import cpu_seconds

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:7e57b0e1-0000-4000-8000-0000000007f5"
FRONT_READY = 180.0
"""Seconds a front's process may take to say READY (imports are slow under TCG)."""
KERNEL_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:7e57b0e1-0000-4000-8000-0000000007f6"
KERNEL_COLUMNS = ("kernel", "kernel_tls")
CORE_COLUMNS = ("direct", "relay", "ktls")
FUSE_COLUMNS = ("fuse_relay", "fuse_ktls")
NVMET = "/sys/kernel/config/nvmet"
TITLES = {"kernel": "kernel plain", "kernel_tls": "kernel --tls", "direct": "core direct",
          "relay": "core plain relay", "ktls": "core kTLS relay",
          "fuse_relay": "FUSE plain relay", "fuse_ktls": "FUSE kTLS relay"}
RATIOS = (("kernel_tls", "kernel"), ("ktls", "relay"), ("ktls", "direct"),
          ("relay", "direct"), ("fuse_ktls", "fuse_relay"))
NO_TLS_PORT = ("n/a: no nvmet TLS port here (TESTBED_TLS_PORT and TESTBED_NVME_TLS unset: "
               "tlshd and nvme connect --tls come with the testbed, docs/testbed.md)")
FIO_SPECS = {"seq_read": ("seqread", "read", "1M", 16),
             "seq_write": ("seqwrite", "write", "1M", 16),
             "rand_read_qd1": ("randread1", "randread", "4k", 1),
             "rand_read_qd16": ("randread16", "randread", "4k", 16)}


# -- the front, in a process of its own (its CPU apart from our core's) --------------------------

def serve_front(args: argparse.Namespace) -> int:
    """Run a KernelRelayFront until stdin closes (the PSK, for ``ktls``, is stdin's first
    line: JSON with identity, key (hex) and suite)."""
    if str(TESTS) not in sys.path:
        sys.path.append(str(TESTS))
    from tls_front import KernelRelayFront

    host, _, port = args.backend.rpartition(":")
    keys = suite = None
    if args.mode == "ktls":
        psk = json.loads(sys.stdin.readline())
        keys, suite = {psk["identity"]: bytes.fromhex(psk["key"])}, psk["suite"]
    with KernelRelayFront(int(port), keys, suite, backend_host=host) as front:
        print(f"READY {front.port}", flush=True)
        sys.stdin.read()  # until the bench closes it
    print(f"front ({args.mode}): {front.connections} connections, {front.handshakes} "
          f"handshakes, failures: {front.failures or 'none'}", file=sys.stderr)
    return 0


class Front:
    """A front's process: ``port`` once ready, ``cpu()`` its CPU seconds so far."""

    def __init__(self, mode: str, backend: str, psk, log: Path) -> None:
        self.mode = mode
        self._log = open(log, "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "front", "--mode", mode, "--backend", backend],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if psk is not None:
            self.proc.stdin.write(json.dumps({"identity": psk.identity, "key": psk.key.hex(),
                                              "suite": psk.suite}) + "\n")
            self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], FRONT_READY)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            self.__exit__()
            said = log.read_text().strip().splitlines() or ["no output"]
            raise RuntimeError(f"the {mode} front did not start: {said[-1]}")
        self.port = int(line.split()[1])

    def cpu(self) -> float:
        return process_cpu([self.proc.pid])

    def __enter__(self) -> Front:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def process_cpu(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (all their threads) so far; a gone pid counts 0."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += cpu_seconds(pid)
    return total


# -- our core -------------------------------------------------------------------------------------

async def core_column(args: argparse.Namespace, port: int, front: Front | None,
                      key_file: str | None) -> dict:
    """Our core's jobs against ``args.traddr`` (direct) or a front on ``port``."""
    import trio

    where = argparse.Namespace(**vars(args))
    if front is not None:
        where.traddr, where.trsvcid = "127.0.0.1", port
    options = {"transport": "tcp", "hostnqn": HOSTNQN}
    if key_file:
        options["tls_key"] = key_file
    out: dict = {"metrics": {}, "errors": {}, "cpu_us_per_io": {}, "front_us_per_io": {}}
    async with own_core(where, "bench tls", **options) as (ctrl, ns, region):
        out["tls"] = ctrl.connection_snapshot().get("tls", "off")
        for job in jobs(args):
            cur = Cursor(job, ns.lba_size, ns.nlb)
            try:
                with trio.fail_after(args.seconds + 60):
                    mine, theirs = os.times(), front.cpu() if front else 0.0
                    count, elapsed = await core_slice(ns, region, job, cur, args.seconds)
                    end, theirs_end = os.times(), front.cpu() if front else 0.0
            except Exception as e:  # noqa: BLE001 - one failed job shows as n/a
                out["errors"][job.key] = _reason(e)
                continue
            out["metrics"][job.key] = figure(job, count, elapsed)
            if count:
                used = end.user - mine.user + end.system - mine.system
                out["cpu_us_per_io"][job.key] = round(used / count * 1e6)
                if front:
                    out["front_us_per_io"][job.key] = round((theirs_end - theirs) / count * 1e6)
    return out


def jobs(args: argparse.Namespace) -> list[Job]:
    return [job for job in JOBS if not args.jobs or job.key in args.jobs]


# -- the FUSE file --------------------------------------------------------------------------------

def fuse_column(args: argparse.Namespace, front: Front, key_file: str | None,
                work: Path) -> dict:
    """fio on the FUSE file of a mount through ``front``, one job at a time, with the mount
    daemon's and the front's CPU per I/O."""
    mnt = Path(args.mount)
    mnt.mkdir(parents=True, exist_ok=True)
    log = work / f"fuse_{front.mode}.log"
    argv = ["nvmeof-fuse", "mount", "-t", "tcp", "-a", "127.0.0.1", "-s", str(front.port),
            "-n", args.nqn, "-q", HOSTNQN, "--daemon", str(mnt), "--log-file", str(log)]
    if key_file:
        argv += ["--tls-key", key_file]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200, check=False)
    if done.returncode:
        why = (done.stderr.strip().splitlines() or [f"rc {done.returncode}"])[-1]
        raise RuntimeError(f"nvmeof-fuse mount through the {front.mode} front failed: {why}")
    out: dict = {"metrics": {}, "errors": {}, "cpu_us_per_io": {}, "front_us_per_io": {}}
    try:
        stats = (mnt / ".nvmeof" / "stats").read_text()
        out["tls"] = next((line.split(":", 1)[1].strip() for line in stats.splitlines()
                           if line.strip().startswith("tls") and ":" in line), "off")
        daemons = mount_daemons(mnt)
        target = str(mnt / f"n{args.nsid}")
        for job in jobs(args):
            before = process_cpu(daemons), front.cpu()
            result, error = fio_job(target, job, args, "--size=128M")
            after = process_cpu(daemons), front.cpu()
            if result is None:
                out["errors"][job.key] = error
                continue
            out["metrics"][job.key] = fio_job_figure(result, write=job.write,
                                                     mb_per_s=job.size >= (1 << 20))
            ios = result["write" if job.write else "read"].get("total_ios", 0)
            if ios:
                out["cpu_us_per_io"][job.key] = round((after[0] - before[0]) / ios * 1e6)
                out["front_us_per_io"][job.key] = round((after[1] - before[1]) / ios * 1e6)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], timeout=60, check=False)
    return out


def mount_daemons(mnt: Path) -> list[int]:
    """The pids of the processes serving ``mnt`` (the daemon and any FUSE workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if str(mnt).encode() in argv and any(b"nvmeof" in a for a in argv):
            pids.append(int(entry))
    return pids


# -- the kernel initiator: nvme connect --tls to nvmet's TLS port, beside plain ----------------

def nvmet_port_of(trsvcid: int) -> str:
    """nvmet's configfs port whose service id is ``trsvcid``."""
    for port in sorted(os.listdir(f"{NVMET}/ports")):
        with open(f"{NVMET}/ports/{port}/addr_trsvcid") as f:
            if f.read().strip() == str(trsvcid):
                return f"{NVMET}/ports/{port}"
    raise RuntimeError(f"no nvmet port has service id {trsvcid}")


@contextlib.contextmanager
def kernel_connected(nvme: str, args: argparse.Namespace, port: int, *extra: str):
    """The kernel initiator connected to ``port`` (``extra``: ``--tls``); the /dev node of
    namespace ``args.nsid``; disconnected after."""
    import glob
    import time

    before = set(os.listdir("/sys/class/nvme"))
    subprocess.run([nvme, "connect", "-t", "tcp", "-a", args.traddr, "-s", str(port), "-n",
                    args.nqn, "-q", KERNEL_HOSTNQN, *extra], check=True, capture_output=True,
                   text=True, timeout=120)
    new = set(os.listdir("/sys/class/nvme")) - before
    try:
        deadline = time.monotonic() + 60
        while True:
            found = [os.path.dirname(p) for c in new
                     for p in glob.glob(f"/sys/class/nvme/{c}/nvme*n*/nsid")
                     if Path(p).read_text().strip() == str(args.nsid)]
            dev = f"/dev/{os.path.basename(found[0])}" if found else ""
            if dev and os.path.exists(dev):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"nvme connect {' '.join(extra)}: no namespace {args.nsid}")
            time.sleep(0.2)
        yield dev
    finally:
        for ctrl in new:
            subprocess.run(["nvme", "disconnect", "-d", ctrl], capture_output=True, timeout=120,
                           check=False)


def fio_job(target: str, job, args: argparse.Namespace, *extra: str
            ) -> tuple[dict | None, str | None]:
    """fio's ``job`` on ``target``: its result (fio's job), or None and the line that says
    why."""
    name, rw, bs, qd = FIO_SPECS[job.key]
    run = subprocess.run([*fio_command(target, name, rw, bs, qd, args.seconds), *extra],
                         capture_output=True, text=True, timeout=args.seconds + 120,
                         check=False)
    try:
        result = fio_json(run.stdout)["jobs"][0]
        if result.get("error"):
            raise ValueError(f"fio error {result['error']}")
    except (ValueError, KeyError, IndexError) as e:
        return None, (run.stderr.strip().splitlines() or [_reason(e)])[-1]
    return result, None


def kernel_column(args: argparse.Namespace, nvme: str, port: int, *extra: str) -> dict:
    """fio's jobs on the kernel initiator's device, connected to ``port``."""
    out: dict = {"metrics": {}, "errors": {}, "tls": "tlshd (kTLS)" if extra else "off"}
    with kernel_connected(nvme, args, port, *extra) as dev:
        for job in jobs(args):
            result, error = fio_job(dev, job, args)
            if result is None:
                out["errors"][job.key] = error
                continue
            out["metrics"][job.key] = fio_job_figure(result, write=job.write,
                                                     mb_per_s=job.size >= (1 << 20))
    return out


def kernel_columns(args: argparse.Namespace, results: dict) -> None:
    """The kernel initiator plain and over TLS, into ``results`` (n/a with the reason where
    the testbed has no TLS port).  The subsystem is on the TLS port while they run, the
    kernel's PSK in ``.nvme`` by nvme-cli's own ``gen-tls-key --insert``."""
    nvme, tls_port = os.environ.get("TESTBED_NVME_TLS"), os.environ.get("TESTBED_TLS_PORT")
    if not nvme or not tls_port:
        results["errors"]["kernel_tls"] = os.environ.get("TESTBED_TLS_UNAVAILABLE") \
            or NO_TLS_PORT
        return
    try:
        subprocess.run([nvme, "gen-tls-key", "--hmac=1", "--identity=0",
                        f"--hostnqn={KERNEL_HOSTNQN}", f"--subsysnqn={args.nqn}", "--insert"],
                       check=True, capture_output=True, text=True, timeout=60)
        link = f"{nvmet_port_of(int(tls_port))}/subsystems/{args.nqn}"
        os.symlink(f"{NVMET}/subsystems/{args.nqn}", link)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        results["errors"]["kernel_tls"] = _reason(e)
        return
    try:
        for column, port, extra in (("kernel", args.trsvcid, ()),
                                    ("kernel_tls", int(tls_port), ("--tls",))):
            print(f"bench tls: {TITLES[column]}", file=sys.stderr, flush=True)
            try:
                results["columns"][column] = kernel_column(args, nvme, port, *extra)
            except Exception as e:  # noqa: BLE001 - a column that fails shows as n/a
                results["errors"][column] = _reason(e)
    finally:
        os.unlink(link)


# -- the run and its table ------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    import trio

    from nvmeof_fuse.nvme import tls_psk

    key = os.urandom(32)
    psk = tls_psk.derive(tls_psk.ConfiguredPsk(key, 1), HOSTNQN, args.nqn)
    results: dict = {"suite": psk.suite, "seconds": args.seconds, "columns": {}, "errors": {}}
    kernel_columns(args, results)
    backend = f"{args.traddr}:{args.trsvcid}"
    with tempfile.TemporaryDirectory(prefix="bench-tls.") as tmp:
        work = Path(tmp)
        key_file = work / "tls.key"
        key_file.write_text(tls_psk.format_interchange(key, 1))
        key_file.chmod(0o600)
        for column in (*CORE_COLUMNS, *(FUSE_COLUMNS if args.mount else ())):
            mode = "ktls" if column.endswith("ktls") else "plain"
            tls_key = str(key_file) if mode == "ktls" else None
            print(f"bench tls: {TITLES[column]}", file=sys.stderr, flush=True)
            try:
                if column == "direct":
                    results["columns"][column] = trio.run(core_column, args, args.trsvcid,
                                                          None, None)
                    continue
                with Front(mode, backend, psk if mode == "ktls" else None,
                           work / f"front_{column}.log") as front:
                    if column in CORE_COLUMNS:
                        results["columns"][column] = trio.run(core_column, args, front.port,
                                                              front, tls_key)
                    else:
                        results["columns"][column] = fuse_column(args, front, tls_key, work)
            except Exception as e:  # noqa: BLE001 - a column that fails shows as n/a
                results["errors"][column] = _reason(e) + front_failures(
                    work / f"front_{column}.log")
            finally:
                for log in work.glob(f"front_{column}.log"):
                    sys.stderr.write(log.read_text())
    results["kernel_gcm"] = kernel_gcm()
    return results


def kernel_gcm() -> str:
    """The kernel's AES-GCM that kTLS took (the highest priority ``gcm(aes)`` in
    /proc/crypto): AES-NI's or the generic C one, which under TCG is many times slower."""
    try:
        with open("/proc/crypto") as f:
            blocks = f.read().split("\n\n")
    except OSError as e:
        return f"unknown ({_reason(e)})"
    found = []
    for block in blocks:
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if fields.get("name") == "gcm(aes)" and fields.get("priority", "").isdigit():
            found.append((int(fields["priority"]), fields.get("driver", "?")))
    return max(found)[1] if found else "none instantiated"


def front_failures(log: Path) -> str:
    """The front's own failures, from its log's last line, to add to a column's n/a."""
    try:
        last = (log.read_text().strip().splitlines() or [""])[-1]
    except OSError:
        return ""
    return f" (the front's failures: {last.split('failures: ', 1)[1]})" \
        if "failures: " in last and not last.endswith("failures: none") else ""


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "n/a"


def render(results: dict) -> str:
    """The table ``run``'s results print as: figures, ratios, CPU per I/O, the goal."""
    columns = [c for c in (*KERNEL_COLUMNS, *CORE_COLUMNS, *FUSE_COLUMNS)
               if c in results["columns"] or c in results["errors"]]
    got = {c: results["columns"].get(c, {}) for c in columns}
    ratios = [(a, b) for a, b in RATIOS if a in columns and b in columns]
    heads = ["metric", *(TITLES[c] for c in columns), *(f"{a}/{b}" for a, b in ratios)]
    keys = [k for k in METRICS if any(k in got[c].get("metrics", {}) for c in columns)]
    rows = []
    for key in keys:
        vals = {c: got[c].get("metrics", {}).get(key) for c in columns}
        rows.append([f"{METRICS[key][0]} ({METRICS[key][1]})",
                     *(_fmt(vals[c]) for c in columns),
                     *(ratio(vals[a], vals[b]) for a, b in ratios)])
    cpu_columns = [c for c in columns if c not in KERNEL_COLUMNS]
    cpu_rows = []
    for key in keys:
        cells = []
        for c in cpu_columns:
            mine, front = (got[c].get(f, {}).get(key) for f in ("cpu_us_per_io",
                                                                  "front_us_per_io"))
            cells.append("n/a" if mine is None else f"{mine:,}" if front is None
                         else f"{mine:,} + {front:,}")
        cpu_rows.append([METRICS[key][0], *cells])
    lines = [f"NVMe/TCP with TLS 1.3 ({results['suite']}), {results['seconds']:g} s per job; "
             "the kernel initiator to nvmet's TLS port (tlshd), our core's TLS ends in a "
             "front before nvmet's plain port (tests/tls_front.py):"]
    lines += text_grid(heads, rows)
    lines += ["", "CPU per I/O, us (our core's process, or the FUSE mount's daemons; "
              "+ the front's process):"]
    lines += text_grid(["metric", *(TITLES[c] for c in cpu_columns)], cpu_rows)
    lines.append("")
    if "kernel_gcm" in results:
        lines.append(f"the kernel's AES-GCM (kTLS's): {results['kernel_gcm']}")
    lines += [f"{TITLES[c]}: tls {got[c]['tls']}" for c in columns if "tls" in got[c]]
    lines += [f"n/a {TITLES[c]}: {why}" for c, why in results["errors"].items()]
    lines += [f"n/a {TITLES[c]}, {METRICS[k][0]}: {why}" for c in columns
              for k, why in got[c].get("errors", {}).items()]
    tls, plain = got.get("ktls", {}).get("metrics", {}), got.get("relay", {}).get("metrics", {})
    goal = [f"{METRICS[k][0]} {ratio(tls.get(k), plain.get(k))}" for k in ("seq_read",
                                                                             "seq_write")
            if k in tls or k in plain]
    if goal:
        lines.append("goal, our core over kTLS at 1 MiB >= 0.8x over plain TCP "
                     f"(kTLS relay / plain relay): {', '.join(goal)}")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/benches/bench_tls.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what")
    f = sub.add_parser("front", help="serve a front until stdin closes")
    f.add_argument("--mode", choices=("plain", "ktls"), required=True)
    f.add_argument("--backend", required=True, metavar="HOST:PORT")
    ap.add_argument("-a", "--traddr", help="nvmet's plain NVMe/TCP address")
    ap.add_argument("-s", "--trsvcid", type=int, default=4420)
    ap.add_argument("-n", "--nqn")
    ap.add_argument("--nsid", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0, help="per job (default 5)")
    ap.add_argument("--connect-timeout", type=float, default=60.0)
    ap.add_argument("--mount", metavar="DIR", help="also fio on the FUSE file mounted here")
    ap.add_argument("--jobs", type=_job_keys, default=None, metavar="KEY[,KEY...]",
                    help=f"run only these jobs (of {', '.join(j.key for j in JOBS)})")
    ap.add_argument("--json", action="store_true", help="print JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.what == "front":
        return serve_front(args)
    if not args.traddr or not args.nqn:
        print("bench tls: -a and -n are needed", file=sys.stderr)
        return 2
    if args.seconds <= 0 or not 0 < args.trsvcid < 65536 or args.nsid <= 0:
        print("bench tls: --seconds, --trsvcid and --nsid must be positive (port < 65536)",
              file=sys.stderr)
        return 2
    results = run(args)
    print(json.dumps(results, indent=2) if args.json else render(results), end="\n"
          if args.json else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
