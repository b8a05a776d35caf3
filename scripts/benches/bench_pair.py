"""Our core against a peer in alternating slices: the ``nvmeof`` library, the companion
API on a mounted namespace file, or the kernel initiator.

  python scripts/benches/bench_pair.py -a ADDR -n NQN [-s PORT] [-t rdma|tcp] [--nsid 2]
                                   [--slices 8] [--slice-seconds 1.5] [--jobs KEY,...] [--json]
                                   [--peer nvmeof | self | companion --file MOUNT/nN
                                    | kernel --device /dev/nvmeXnY]

``bench.py core`` and ``nvmeof`` (or ``companion``) run one after the
other, and a host under load moves a job's figure between them: in one VM boot under TCG
the library's 4 KiB QD1 went 656, 248 and 407 IOPS in three rounds, and the companion's
CPU per 4 KiB read 1,267 to 2,427 us in four.  Here both sides are connected at once, and
each job runs in short slices that alternate between them (who goes first flips every
slice), so the drift falls on both alike.  The library runs in a worker thread of this
process while our trio loop stays free for its keep-alive.  The companion runs in a worker
process of its own, as a user's process would hold a ``File``: in this process it read
at 0.65x of our core at 4 KiB QD1 where, run alone just before, it read at 1.03x.
``--peer self`` runs our core against itself in such a worker process: a null test of the
method (in the VM, 4 KiB ratios of 1.00-1.10 from 6 slices, 1.30 once from 4).
``--peer kernel`` runs fio on the kernel initiator's block device of the same namespace,
connected beforehand over the same transport (``nvme connect``; scripts/bench-guest), one
fio run per slice: over NVMe/TCP our core's 1 MiB read went 0.54x to 0.93x of the kernel's
in six boots when the two ran minutes apart.  Only fio's measured runtime counts, not its
start; the kernel's CPU is not shown (its work runs in kworkers and softirqs, which no
process's CPU time holds).  Our core connects a controller of its own over ``-t``, as in
``bench core``; the companion uses the mount's.  Prints, per job, both medians, the ratio
the issues set goals for (our core over the library or the kernel, the companion over our
core), each side's CPU per I/O (of the side's process; for the library, of this process,
both sides' threads) and in how many slices the first of the ratio was ahead.  Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench import (
    JOBS,
    METRICS,
    MIB,
    Cursor,
    Job,
    NoNamespace,
    _fmt,
    _job_keys,
    _reason,
    companion_slice,
    core_slice,
    figure,
    fio_command,
    fio_json,
    library_slice,
    own_core,
)

PEERS = {"nvmeof": "the nvmeof library", "companion": "the companion API",
         "self": "itself in a worker process (a null test: the ratio should be 1)",
         "kernel": "the kernel initiator (fio on its block device, one run per slice)"}
LABELS = {"nvmeof": "nvmeof lib", "companion": "companion", "self": "core again",
          "kernel": "kernel"}
SUBJECTS = {"nvmeof": "core", "companion": "companion", "self": "self", "kernel": "core"}
"""Whose figure the ratio and the slices ahead are about: the issues' goals put our core
against the library and the kernel, and the companion against our core."""
JOB_BY_KEY = {job.key: job for job in JOBS}
REPLY_GRACE = 60.0
"""Seconds past a slice's own that a worker process may take to answer (its commands in
flight drain after the slice ends; under TCG a 1 MiB QD16 drain takes a while)."""


class LibraryPeer:
    """The ``nvmeof`` reference library in this process (its calls block: a worker thread)."""

    key = "nvmeof"

    def __init__(self, args: argparse.Namespace) -> None:
        try:
            import nvmeof
        except ImportError as e:
            raise SystemExit(f"bench_pair: the nvmeof library is not installed ({e})") from None
        self.ctrl = nvmeof.Controller.connect(args.traddr, args.nqn, port=args.trsvcid,
                                              timeout=args.connect_timeout)
        self._cursors: dict[str, Cursor] = {}
        try:
            self.ns = self.ctrl.namespace(args.nsid)
            self.buf = self.ctrl.allocate(16 * MIB)
        except BaseException:
            self.ctrl.close()
            raise

    @classmethod
    async def open(cls, args: argparse.Namespace) -> LibraryPeer:
        import trio

        return await trio.to_thread.run_sync(cls, args)

    async def run(self, job: Job, seconds: float) -> tuple[int, float, float]:
        """One slice: I/Os done, seconds taken, CPU seconds of this process meanwhile."""
        import trio

        cur = self._cursors.setdefault(job.key, Cursor(job, self.ns.lba_size,
                                                       self.ns.info.size_lbas))
        before = time.process_time()
        count, elapsed = await trio.to_thread.run_sync(
            library_slice, self.ctrl, self.ns, self.buf, job, cur, seconds)
        return count, elapsed, time.process_time() - before

    async def aclose(self) -> None:
        import trio

        def close() -> None:
            try:
                self.buf.close()
            finally:
                self.ctrl.close()

        await trio.to_thread.run_sync(close)


def fio_slice_command(job: Job, device: str, seconds: float) -> list[str]:
    """fio running ``job`` on ``device`` for ``seconds``, as scripts/bench-fio runs it."""
    rw = ("write" if job.write else "read") if job.sequential else "randread"
    return fio_command(device, "slice", rw, job.size, job.qd, seconds)


def fio_slice_result(job: Job, output: str) -> tuple[int, float]:
    """The I/Os done and the seconds fio measured, from its JSON ``output``."""
    try:
        data = fio_json(output)
        side = data["jobs"][0]["write" if job.write else "read"]
        count, elapsed = int(side["total_ios"]), side["runtime"] / 1000
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise RuntimeError(f"fio printed no result ({_reason(e)})") from None
    if data["jobs"][0].get("error"):
        raise RuntimeError(f"fio's job failed (error {data['jobs'][0]['error']})")
    return count, elapsed


class KernelPeer:
    """The kernel initiator: fio on its block device of the namespace, one run per slice
    (fio's start does not count: only the runtime it measured)."""

    key = "kernel"

    def __init__(self, device: str) -> None:
        self.device = device

    @classmethod
    async def open(cls, args: argparse.Namespace) -> KernelPeer:
        import stat

        try:
            is_block = stat.S_ISBLK(os.stat(args.device).st_mode)
        except OSError as e:
            raise RuntimeError(f"--device {args.device}: {e.strerror}") from None
        if not is_block:
            raise RuntimeError(f"--device {args.device} is not a block device")
        return cls(args.device)

    async def run(self, job: Job, seconds: float) -> tuple[int, float, None]:
        """One slice: I/Os done and seconds taken by fio; no CPU figure (module docstring)."""
        import subprocess

        import trio

        with trio.fail_after(seconds + REPLY_GRACE):
            done = await trio.run_process(fio_slice_command(job, self.device, seconds),
                                          capture_stdout=True, capture_stderr=True,
                                          check=False, stdin=subprocess.DEVNULL)
        if done.returncode:
            why = (done.stderr.decode(errors="replace").strip().splitlines() or ["no message"])
            raise RuntimeError(f"fio on {self.device} failed (rc {done.returncode}): {why[-1]}")
        count, elapsed = fio_slice_result(job, done.stdout.decode(errors="replace"))
        return count, elapsed, None

    async def aclose(self) -> None:
        pass


class WorkerPeer:
    """A side run by a worker process of its own (``--worker``): a companion ``File`` on
    the mount, as a user's process would hold it, with nothing of our core's controller,
    loop or threads in its process; or our core again (``self``), which shows what the
    method itself costs a side.  It runs a slice when asked on its stdin and answers on its
    stdout."""

    def __init__(self, key: str, process, timeout: float) -> None:
        self.key = key
        self._process = process
        self._timeout = timeout
        self._pending = b""

    @classmethod
    async def open(cls, args: argparse.Namespace) -> WorkerPeer:
        import subprocess

        import trio

        process = await trio.lowlevel.open_process(
            [sys.executable, os.path.abspath(__file__), "-a", args.traddr,
             "-s", str(args.trsvcid), "-n", args.nqn, "--nsid", str(args.nsid),
             "-t", args.transport, "--connect-timeout", str(args.connect_timeout),
             "--peer", args.peer,
             *(["--file", args.file] if args.file else []), "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        peer = cls(args.peer, process, args.connect_timeout)
        try:
            await peer._reply(args.connect_timeout + REPLY_GRACE)
        except BaseException:
            await peer.aclose()
            raise
        return peer

    async def run(self, job: Job, seconds: float) -> tuple[int, float, float]:
        """One slice in the worker: I/Os done, seconds taken, the worker's CPU seconds."""
        ask = json.dumps({"job": job.key, "seconds": seconds}) + "\n"
        await self._process.stdin.send_all(ask.encode())
        reply = await self._reply(seconds + REPLY_GRACE)
        return reply["count"], reply["elapsed"], reply["cpu"]

    async def _reply(self, timeout: float) -> dict:
        import trio

        with trio.fail_after(timeout):
            while b"\n" not in self._pending:
                chunk = await self._process.stdout.receive_some()
                if not chunk:
                    raise RuntimeError(f"the {self.key} worker ended (its error is above)")
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.key} worker: {reply['error']}")
        return reply

    async def aclose(self) -> None:
        import trio

        process = self._process
        with trio.move_on_after(self._timeout):
            try:
                await process.stdin.aclose()  # its end of input: it closes the File and ends
            except trio.BrokenResourceError:
                pass
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


def _sayer(out):
    def say(**reply) -> None:
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return say


def companion_worker(path: str, nsid: int, asks=None, out=None) -> int:
    """``--worker --peer companion``: hold a companion ``File`` and run the slices asked for
    on ``asks`` (stdin: a JSON line each), answering each with a JSON line on ``out``."""
    import nvmeof_fuse

    asks = sys.stdin if asks is None else asks
    say = _sayer(sys.stdout if out is None else out)

    try:
        f = nvmeof_fuse.File(path)
    except Exception as e:  # noqa: BLE001 - one line, to the parent
        say(error=_reason(e))
        return 1
    with f:
        if f.nsid != nsid:
            say(error=f"{path} is namespace {f.nsid}, and our core reads namespace {nsid} "
                      "(--nsid)")
            return 1
        bufs = nvmeof_fuse.empty((16, MIB))
        cursors: dict[str, Cursor] = {}
        say(ready=True)
        for line in asks:
            ask = json.loads(line)
            job = JOB_BY_KEY[ask["job"]]
            cur = cursors.setdefault(job.key, Cursor(job, f.lba_size, f.nbytes // f.lba_size))
            before = time.process_time()
            try:
                count, elapsed = companion_slice(f, bufs, job, cur, ask["seconds"])
            except Exception as e:  # noqa: BLE001 - the job shows as n/a
                say(error=_reason(e))
                continue
            say(count=count, elapsed=elapsed, cpu=time.process_time() - before)
    return 0


async def core_worker(args: argparse.Namespace) -> int:
    """``--worker --peer self``: our core on a controller of its own, run as
    :func:`companion_worker` runs the companion."""
    import trio

    say = _sayer(sys.stdout)
    try:
        async with own_core(args, "bench_pair", transport=args.transport) as (_, ns, region):
            cursors: dict[str, Cursor] = {}
            say(ready=True)
            while line := await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True):
                ask = json.loads(line)
                job = JOB_BY_KEY[ask["job"]]
                cur = cursors.setdefault(job.key, Cursor(job, ns.lba_size, ns.nlb))
                before = time.process_time()
                count, elapsed = await core_slice(ns, region, job, cur, ask["seconds"])
                say(count=count, elapsed=elapsed, cpu=time.process_time() - before)
    except NoNamespace as e:
        say(error=e.text)
        return 1
    except Exception as e:  # noqa: BLE001 - one line, to the parent
        say(error=_reason(e))
        return 1
    return 0


async def _pair(args: argparse.Namespace) -> dict:
    import trio

    jobs = [job for job in JOBS if not args.jobs or job.key in args.jobs]
    results: dict = {"peer": args.peer, "transport": args.transport, "slices": args.slices,
                     "slice_seconds": args.slice_seconds, "jobs": {}, "errors": {}}
    peer_class = {"nvmeof": LibraryPeer, "kernel": KernelPeer}.get(args.peer, WorkerPeer)
    peer = await peer_class.open(args)
    try:
        async with own_core(args, "bench_pair", transport=args.transport) as (_, ns, region):
            for job in jobs:
                try:
                    with trio.fail_after(2 * args.slices * (args.slice_seconds + 30)):
                        results["jobs"][job.key] = await _alternate(job, ns, region, peer, args)
                except Exception as e:  # noqa: BLE001 - one failed job shows as n/a
                    results["errors"][job.key] = _reason(e)
    finally:
        await peer.aclose()
    return results


async def _alternate(job: Job, ns, region, peer, args: argparse.Namespace) -> dict:
    """``args.slices`` slices of ``job`` on each side, alternating; the figures."""
    sides = ("core", peer.key)
    ours = Cursor(job, ns.lba_size, ns.nlb)
    figures: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    for i in range(args.slices):
        for side in sides if i % 2 == 0 else sides[::-1]:
            if side == "core":
                before = time.process_time()
                count, elapsed = await core_slice(ns, region, job, ours, args.slice_seconds)
                cpu_seconds = time.process_time() - before
            else:
                count, elapsed, cpu_seconds = await peer.run(job, args.slice_seconds)
            figures[side].append(figure(job, count, elapsed))
            if count and cpu_seconds is not None:
                cpu[side].append(cpu_seconds / count * 1e6)
    medians = {side: statistics.median(figures[side]) for side in sides}
    subject = SUBJECTS[peer.key]
    other = sides[1] if subject == "core" else "core"
    return {"median": medians,
            "ratio": medians[subject] / medians[other] if medians[other] else None,
            "ahead": sum(a > b for a, b in zip(figures[subject], figures[other], strict=True)),
            "cpu_us_per_io": {side: round(statistics.median(cpu[side])) if cpu[side] else None
                              for side in sides},
            "slices": figures}


def render(results: dict) -> str:
    """The table ``_pair``'s results print as."""
    peer = results.get("peer", "nvmeof")
    label = LABELS[peer]
    subject = SUBJECTS[peer]
    ratio_name = f"{subject}/{peer if subject == 'core' else 'core'}"
    over = f" over {results['transport']}" if results.get("transport", "rdma") != "rdma" else ""
    head = (f"our core{over} against {PEERS[peer]}, {results['slices']} alternating slices of "
            f"{results['slice_seconds']:g} s each (medians; {subject} ahead in how many):")
    rows = [head, f"{'metric':42} {'our core':>10} {label:>10} {ratio_name:>14} "
                  f"{'ahead':>6}  CPU per I/O, us (core / {label})"]
    for key, r in results["jobs"].items():
        metric, unit = METRICS[key]
        cpu = {side: "n/a" if us is None else us for side, us in r["cpu_us_per_io"].items()}
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "n/a"
        rows.append(f"{metric + f' ({unit})':42} {_fmt(r['median']['core']):>10} "
                    f"{_fmt(r['median'][peer]):>10} {ratio:>14} "
                    f"{r['ahead']:>2} of {results['slices']:<2} {cpu['core']} / {cpu[peer]}")
    for key, why in results["errors"].items():
        rows.append(f"{METRICS[key][0]:42} n/a ({why})")
    return "\n".join(rows) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/benches/bench_pair.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-a", "--traddr", required=True)
    ap.add_argument("-s", "--trsvcid", type=int, default=4420)
    ap.add_argument("-n", "--nqn", required=True)
    ap.add_argument("-t", "--transport", choices=("rdma", "tcp"), default="rdma",
                    help="our core's (default rdma)")
    ap.add_argument("--nsid", type=int, default=2)
    ap.add_argument("--slices", type=int, default=8, help="per side and job (default 8)")
    ap.add_argument("--slice-seconds", type=float, default=1.5, help="(default 1.5)")
    ap.add_argument("--connect-timeout", type=float, default=60.0)
    ap.add_argument("--jobs", type=_job_keys, default=None, metavar="KEY[,KEY...]",
                    help=f"run only these jobs (of {', '.join(j.key for j in JOBS)})")
    ap.add_argument("--peer", choices=sorted(PEERS), default="nvmeof",
                    help="what our core runs against (default nvmeof; self: a null test)")
    ap.add_argument("--file", help="--peer companion: the mounted namespace file (MOUNT/nN)")
    ap.add_argument("--device", help="--peer kernel: the kernel's block device of the "
                                     "namespace (/dev/nvmeXnY)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.worker:  # a WorkerPeer's process: it reports its errors to the parent itself
        if args.peer == "self":
            import trio

            return trio.run(core_worker, args)
        return companion_worker(args.file, args.nsid)
    if (args.slices < 1 or args.slice_seconds <= 0 or args.nsid <= 0
            or not 0 < args.trsvcid < 65536):
        print("bench_pair: --slices, --slice-seconds, --nsid and --trsvcid must be positive "
              "(port < 65536)", file=sys.stderr)
        return 2
    if (args.peer == "companion") != (args.file is not None):
        print("bench_pair: --file names the mounted namespace file, with --peer companion "
              "only", file=sys.stderr)
        return 2
    if (args.peer == "kernel") != (args.device is not None):
        print("bench_pair: --device names the kernel's block device of the namespace, with "
              "--peer kernel only", file=sys.stderr)
        return 2
    if args.peer == "nvmeof" and args.transport != "rdma":
        print("bench_pair: the nvmeof library speaks RDMA only (-t rdma)", file=sys.stderr)
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
