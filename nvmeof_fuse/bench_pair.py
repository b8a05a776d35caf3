"""Our core against the ``nvmeof`` library in alternating slices of one process.

  python -m nvmeof_fuse.bench_pair -a ADDR -n NQN [-s PORT] [--nsid 2] [--slices 8]
                                   [--slice-seconds 1.5] [--jobs KEY,...] [--json]

``python -m nvmeof_fuse.bench core`` and ``nvmeof`` run one after the other, and a host
under load moves a job's figure between them: in one VM boot under TCG the library's
4 KiB QD1 went 656, 248 and 407 IOPS in three rounds.  Here both initiators are connected
at once, and each job runs in short slices that alternate between them (who goes first
flips every slice), so the drift falls on both alike.  The library runs in a worker thread
while our trio loop stays free for its keep-alive.  Prints, per job, both medians, their
ratio, each side's CPU per I/O (of this process, both sides' threads) and in how many
slices ours was ahead.  Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from .bench import (
    JOBS,
    METRICS,
    MIB,
    Cursor,
    Job,
    _fmt,
    _job_keys,
    _reason,
    core_slice,
    figure,
    library_slice,
)

SIDES = ("core", "nvmeof")


async def _pair(args: argparse.Namespace) -> dict:
    import trio

    try:
        import nvmeof
    except ImportError as e:
        raise SystemExit(f"bench_pair: the nvmeof library is not installed ({e})") from None
    from .host.controller import ConnectOptions, connect

    jobs = [job for job in JOBS if not args.jobs or job.key in args.jobs]
    results: dict = {"slices": args.slices, "slice_seconds": args.slice_seconds, "jobs": {},
                     "errors": {}}
    lib = await trio.to_thread.run_sync(lambda: nvmeof.Controller.connect(
        args.traddr, args.nqn, port=args.trsvcid, timeout=args.connect_timeout))
    try:
        options = ConnectOptions(args.traddr, args.nqn, trsvcid=args.trsvcid,
                                 connect_timeout=args.connect_timeout)
        async with connect(options) as ctrl:
            ns = ctrl.namespaces.get(args.nsid)
            if ns is None:
                raise SystemExit(f"bench_pair: namespace {args.nsid} not found "
                                 f"(have {sorted(ctrl.namespaces)})")
            lib_ns = lib.namespace(args.nsid)
            region, lib_buf = ctrl.allocate(16 * MIB), lib.allocate(16 * MIB)
            try:
                for job in jobs:
                    try:
                        with trio.fail_after(2 * args.slices * (args.slice_seconds + 30)):
                            results["jobs"][job.key] = await _alternate(
                                job, ns, region, lib, lib_ns, lib_buf, args)
                    except Exception as e:  # noqa: BLE001 - one failed job shows as n/a
                        results["errors"][job.key] = _reason(e)
            finally:
                lib_buf.close()
    finally:
        lib.close()
    return results


async def _alternate(job: Job, ns, region, lib, lib_ns, lib_buf,
                     args: argparse.Namespace) -> dict:
    """``args.slices`` slices of ``job`` on each side, alternating; the figures."""
    import trio

    ours = Cursor(job, ns.lba_size, ns.nlb)
    theirs = Cursor(job, lib_ns.lba_size, lib_ns.info.size_lbas)
    figures: dict[str, list[float]] = {side: [] for side in SIDES}
    cpu: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(args.slices):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            before = time.process_time()
            if side == "core":
                count, elapsed = await core_slice(ns, region, job, ours, args.slice_seconds)
            else:
                count, elapsed = await trio.to_thread.run_sync(
                    library_slice, lib, lib_ns, lib_buf, job, theirs, args.slice_seconds)
            figures[side].append(figure(job, count, elapsed))
            if count:
                cpu[side].append((time.process_time() - before) / count * 1e6)
    medians = {side: statistics.median(figures[side]) for side in SIDES}
    return {"median": medians,
            "ratio": medians["core"] / medians["nvmeof"] if medians["nvmeof"] else None,
            "ahead": sum(a > b for a, b in zip(figures["core"], figures["nvmeof"], strict=True)),
            "cpu_us_per_io": {side: round(statistics.median(cpu[side])) if cpu[side] else None
                              for side in SIDES},
            "slices": figures}


def render(results: dict) -> str:
    """The table ``_pair``'s results print as."""
    head = (f"our core against the nvmeof library, {results['slices']} alternating slices of "
            f"{results['slice_seconds']:g} s each, one process (medians):")
    rows = [head, f"{'metric':42} {'our core':>10} {'nvmeof lib':>10} {'core/nvmeof':>11} "
                  f"{'ahead':>6}  CPU per I/O, us (core / lib)"]
    for key, r in results["jobs"].items():
        label, unit = METRICS[key]
        cpu = r["cpu_us_per_io"]
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "n/a"
        rows.append(f"{label + f' ({unit})':42} {_fmt(r['median']['core']):>10} "
                    f"{_fmt(r['median']['nvmeof']):>10} {ratio:>11} "
                    f"{r['ahead']:>2} of {results['slices']:<2} {cpu['core']} / {cpu['nvmeof']}")
    for key, why in results["errors"].items():
        rows.append(f"{METRICS[key][0]:42} n/a ({why})")
    return "\n".join(rows) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nvmeof_fuse.bench_pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-a", "--traddr", required=True)
    ap.add_argument("-s", "--trsvcid", type=int, default=4420)
    ap.add_argument("-n", "--nqn", required=True)
    ap.add_argument("--nsid", type=int, default=2)
    ap.add_argument("--slices", type=int, default=8, help="per side and job (default 8)")
    ap.add_argument("--slice-seconds", type=float, default=1.5, help="(default 1.5)")
    ap.add_argument("--connect-timeout", type=float, default=60.0)
    ap.add_argument("--jobs", type=_job_keys, default=None, metavar="KEY[,KEY...]",
                    help=f"run only these jobs (of {', '.join(j.key for j in JOBS)})")
    ap.add_argument("--json", action="store_true", help="print JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if (args.slices < 1 or args.slice_seconds <= 0 or args.nsid <= 0
            or not 0 < args.trsvcid < 65536):
        print("bench_pair: --slices, --slice-seconds, --nsid and --trsvcid must be positive "
              "(port < 65536)", file=sys.stderr)
        return 2
    import trio

    try:
        results = trio.run(_pair, args)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        print(f"bench_pair: {_reason(e)}", file=sys.stderr)
        return 1
    print(json.dumps(results, indent=2) if args.json else render(results).rstrip("\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
