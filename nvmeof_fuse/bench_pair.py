"""Our core against a peer in alternating slices of one process: the ``nvmeof`` library,
or the companion API on a mounted namespace file.

  python -m nvmeof_fuse.bench_pair -a ADDR -n NQN [-s PORT] [--nsid 2] [--slices 8]
                                   [--slice-seconds 1.5] [--jobs KEY,...] [--json]
                                   [--peer nvmeof | --peer companion --file MOUNT/nN]

``python -m nvmeof_fuse.bench core`` and ``nvmeof`` (or ``companion``) run one after the
other, and a host under load moves a job's figure between them: in one VM boot under TCG
the library's 4 KiB QD1 went 656, 248 and 407 IOPS in three rounds, and the companion's
CPU per 4 KiB read 1,267 to 2,427 us in four.  Here both sides are connected at once, and
each job runs in short slices that alternate between them (who goes first flips every
slice), so the drift falls on both alike.  The peer runs in a worker thread (the library's
calls block; a companion ``File`` is driven from its caller's thread) while our trio loop
stays free for its keep-alive.  Our core connects a controller of its own, as in ``bench
core``; the companion uses the mount's.  Prints, per job, both medians, their ratio, each
side's CPU per I/O (of this process, both sides' threads) and in how many slices ours was
ahead.  Nothing is asserted.
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
    companion_slice,
    core_slice,
    figure,
    library_slice,
)

PEERS = {"nvmeof": "the nvmeof library", "companion": "the companion API"}
LABELS = {"nvmeof": "nvmeof lib", "companion": "companion"}


class LibraryPeer:
    """The ``nvmeof`` reference library, connected to the same target."""

    key = "nvmeof"

    def __init__(self, args: argparse.Namespace) -> None:
        try:
            import nvmeof
        except ImportError as e:
            raise SystemExit(f"bench_pair: the nvmeof library is not installed ({e})") from None
        self.ctrl = nvmeof.Controller.connect(args.traddr, args.nqn, port=args.trsvcid,
                                              timeout=args.connect_timeout)
        try:
            self.ns = self.ctrl.namespace(args.nsid)
            self.buf = self.ctrl.allocate(16 * MIB)
        except BaseException:
            self.ctrl.close()
            raise

    def cursor(self, job: Job) -> Cursor:
        return Cursor(job, self.ns.lba_size, self.ns.info.size_lbas)

    def run(self, job: Job, cur: Cursor, seconds: float) -> tuple[int, float]:
        return library_slice(self.ctrl, self.ns, self.buf, job, cur, seconds)

    def close(self) -> None:
        try:
            self.buf.close()
        finally:
            self.ctrl.close()


class CompanionPeer:
    """A companion ``File`` on a mounted namespace, into ``nvmeof_fuse.empty`` arrays."""

    key = "companion"

    def __init__(self, args: argparse.Namespace) -> None:
        import nvmeof_fuse

        self.file = nvmeof_fuse.File(args.file)
        if self.file.nsid != args.nsid:
            self.file.close()
            raise SystemExit(f"bench_pair: {args.file} is namespace {self.file.nsid}, and our "
                             f"core would read namespace {args.nsid} (--nsid)")
        self.bufs = nvmeof_fuse.empty((16, MIB))

    def cursor(self, job: Job) -> Cursor:
        return Cursor(job, self.file.lba_size, self.file.nbytes // self.file.lba_size)

    def run(self, job: Job, cur: Cursor, seconds: float) -> tuple[int, float]:
        return companion_slice(self.file, self.bufs, job, cur, seconds)

    def close(self) -> None:
        self.file.close()


async def _pair(args: argparse.Namespace) -> dict:
    import trio

    from .host.controller import ConnectOptions, connect

    jobs = [job for job in JOBS if not args.jobs or job.key in args.jobs]
    results: dict = {"peer": args.peer, "slices": args.slices,
                     "slice_seconds": args.slice_seconds, "jobs": {}, "errors": {}}
    make = CompanionPeer if args.peer == "companion" else LibraryPeer
    peer = await trio.to_thread.run_sync(make, args)
    try:
        options = ConnectOptions(args.traddr, args.nqn, trsvcid=args.trsvcid,
                                 connect_timeout=args.connect_timeout)
        async with connect(options) as ctrl:
            ns = ctrl.namespaces.get(args.nsid)
            if ns is None:
                raise SystemExit(f"bench_pair: namespace {args.nsid} not found "
                                 f"(have {sorted(ctrl.namespaces)})")
            region = ctrl.allocate(16 * MIB)
            for job in jobs:
                try:
                    with trio.fail_after(2 * args.slices * (args.slice_seconds + 30)):
                        results["jobs"][job.key] = await _alternate(job, ns, region, peer, args)
                except Exception as e:  # noqa: BLE001 - one failed job shows as n/a
                    results["errors"][job.key] = _reason(e)
    finally:
        await trio.to_thread.run_sync(peer.close)
    return results


async def _alternate(job: Job, ns, region, peer, args: argparse.Namespace) -> dict:
    """``args.slices`` slices of ``job`` on each side, alternating; the figures."""
    import trio

    sides = ("core", peer.key)
    ours, theirs = Cursor(job, ns.lba_size, ns.nlb), peer.cursor(job)
    figures: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    for i in range(args.slices):
        for side in sides if i % 2 == 0 else sides[::-1]:
            before = time.process_time()
            if side == "core":
                count, elapsed = await core_slice(ns, region, job, ours, args.slice_seconds)
            else:
                count, elapsed = await trio.to_thread.run_sync(
                    peer.run, job, theirs, args.slice_seconds)
            figures[side].append(figure(job, count, elapsed))
            if count:
                cpu[side].append((time.process_time() - before) / count * 1e6)
    medians = {side: statistics.median(figures[side]) for side in sides}
    return {"median": medians,
            "ratio": medians["core"] / medians[peer.key] if medians[peer.key] else None,
            "ahead": sum(a > b for a, b in zip(figures["core"], figures[peer.key], strict=True)),
            "cpu_us_per_io": {side: round(statistics.median(cpu[side])) if cpu[side] else None
                              for side in sides},
            "slices": figures}


def render(results: dict) -> str:
    """The table ``_pair``'s results print as."""
    peer = results.get("peer", "nvmeof")
    label = LABELS[peer]
    head = (f"our core against {PEERS[peer]}, {results['slices']} alternating slices of "
            f"{results['slice_seconds']:g} s each, one process (medians):")
    rows = [head, f"{'metric':42} {'our core':>10} {label:>10} {'core/' + peer:>11} "
                  f"{'ahead':>6}  CPU per I/O, us (core / {label})"]
    for key, r in results["jobs"].items():
        metric, unit = METRICS[key]
        cpu = r["cpu_us_per_io"]
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "n/a"
        rows.append(f"{metric + f' ({unit})':42} {_fmt(r['median']['core']):>10} "
                    f"{_fmt(r['median'][peer]):>10} {ratio:>11} "
                    f"{r['ahead']:>2} of {results['slices']:<2} {cpu['core']} / {cpu[peer]}")
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
    ap.add_argument("--peer", choices=sorted(PEERS), default="nvmeof",
                    help="what our core runs against (default nvmeof)")
    ap.add_argument("--file", help="--peer companion: the mounted namespace file (MOUNT/nN)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if (args.slices < 1 or args.slice_seconds <= 0 or args.nsid <= 0
            or not 0 < args.trsvcid < 65536):
        print("bench_pair: --slices, --slice-seconds, --nsid and --trsvcid must be positive "
              "(port < 65536)", file=sys.stderr)
        return 2
    if (args.peer == "companion") != (args.file is not None):
        print("bench_pair: --file names the mounted namespace file, with --peer companion "
              "only", file=sys.stderr)
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
