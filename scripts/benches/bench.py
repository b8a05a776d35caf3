"""Read/write throughput of one namespace: our core, the ``nvmeof`` library; a side-by-side table.

  python scripts/benches/bench.py core   -a ADDR -n NQN [-s PORT] [--nsid 2] [--seconds 5]
                                         [--json]
  python scripts/benches/bench.py nvmeof -a ADDR -n NQN [-s PORT] [--nsid 2] [--seconds 5]
                                         [--json]
  python scripts/benches/bench.py companion --file MOUNT/nN [--seconds 5] [--processes 1]
      [--queues N] [--json]
  python scripts/benches/bench.py fuse-ram MOUNTPOINT [--size-mib 256] [--lba-size 4096]
                                         [--image F] [--fuse builtin|pyfuse3] [--workers N]
  python scripts/benches/bench.py table --kernel F --core F --nvmeof F --fuse F --companion F \
      --companion2 F --fuse-ram F [--kernel-tcp F --core-tcp F --fuse-tcp F]
      [--core-tcp-host F --fuse-tcp-host F] [--out DIR]

``core``, ``nvmeof`` and ``companion`` (``nvmeof_fuse.File`` on a mounted namespace, from this
separate process, into ``nvmeof_fuse.empty`` arrays, ``qd`` futures outstanding from one
thread; ``--processes N`` adds up N such processes measured over the same seconds) print
figures (MB = 10^6 bytes);
``table`` reads their ``--json`` output and fio ``--output-format=json`` files (jobs named as
in :data:`FIO_JOBS`).  ``fuse-ram`` mounts a namespace kept in RAM (``MOUNTPOINT/n1``) through
the same FUSE layer until it is unmounted: fio on it shows the best the FUSE file can do with
no NVMe behind it (``--fuse pyfuse3``: with pyfuse3 as the FUSE server, as the host bench
sets the two servers side by side; ``--workers N``: N processes serve it, each on a cloned
/dev/fuse descriptor over the same bytes, their writes under the range locks of one memfd,
as a mount's FUSE workers do).  A missing input
file, or one with a ``.err`` file beside it, shows as ``n/a`` with the reason.  Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1] / "tests"
"""Where the RAM namespace (``ramdisk.py``, which the tests' fakes build on) lives."""
MIB = 1 << 20
SMALL = 4096
IDLE_SECONDS = 2.0
"""How long ``core`` sits connected with no I/O to measure its idle CPU."""

# metric key -> (row label, unit)
METRICS: dict[str, tuple[str, str]] = {
    "seq_read": ("1 MiB seq read QD16", "MB/s"),
    "seq_read_bounce": ("1 MiB seq read QD16, bounce (read_lbas)", "MB/s"),
    "seq_write": ("1 MiB seq write QD16", "MB/s"),
    "rand_read_qd1": ("4 KiB randread QD1", "IOPS"),
    "rand_read_qd16": ("4 KiB randread QD16", "IOPS"),
}
FIO_JOBS = {"seqread": "seq_read", "seqwrite": "seq_write",
            "randread1": "rand_read_qd1", "randread16": "rand_read_qd16"}
COLUMNS = ("kernel", "core", "nvmeof", "fuse", "companion", "companion2", "fuse_ram")
TITLES = {"kernel": "kernel (fio)", "core": "our core", "nvmeof": "nvmeof lib",
          "fuse": "FUSE file (fio)", "companion": "companion API",
          "companion2": "companion, 2 processes", "fuse_ram": "FUSE over RAM (fio)"}
RATIOS = (("core", "kernel"), ("core", "nvmeof"), ("fuse", "kernel"), ("companion", "kernel"),
          ("companion", "core"), ("companion2", "companion"), ("fuse_ram", "kernel"))
TCP_COLUMNS = ("kernel_tcp", "core_tcp", "fuse_tcp")
"""The same jobs over NVMe/TCP: a second table below the first."""
TITLES.update({"kernel_tcp": "kernel nvme-tcp (fio)", "core_tcp": "our core over TCP",
               "fuse_tcp": "FUSE file over TCP (fio)"})
TCP_RATIOS = (("core_tcp", "kernel_tcp"), ("fuse_tcp", "kernel_tcp"))
HOST_COLUMNS = ("kernel_tcp", "core_tcp_host", "fuse_tcp_host")
"""Our core and the FUSE file on the host over the forwarded port, against the kernel in the VM."""
TITLES.update({"core_tcp_host": "our core on the host",
               "fuse_tcp_host": "FUSE file on the host (fio)"})
HOST_RATIOS = (("core_tcp_host", "kernel_tcp"), ("fuse_tcp_host", "kernel_tcp"))
HOST_CAVEAT = ("From the host: our core and the FUSE file reach the target through the VM's "
               "forwarded port (QEMU user networking is part of their figures); the kernel "
               "nvme-tcp figure is measured inside the VM.")
ALL_COLUMNS = tuple(dict.fromkeys(COLUMNS + TCP_COLUMNS + HOST_COLUMNS))


@dataclass
class Job:
    """One measurement: ``size``-byte I/Os at queue depth ``qd``, sequential or random."""

    key: str
    size: int
    qd: int
    sequential: bool
    write: bool = False


JOBS = [Job("seq_read", MIB, 16, True), Job("seq_write", MIB, 16, True, write=True),
        Job("rand_read_qd1", SMALL, 1, False), Job("rand_read_qd16", SMALL, 16, False)]


def figure(job: Job, ios: int, elapsed: float) -> float:
    """MB/s for 1 MiB jobs, IOPS for small ones."""
    return ios * job.size / elapsed / 1e6 if job.size >= MIB else ios / elapsed


class Cursor:
    """Where the next I/O of a job goes: one shared sequential stream, or uniform random."""

    def __init__(self, job: Job, lba_size: int, nlb_total: int) -> None:
        self.nlb = job.size // lba_size
        self.slots = nlb_total // self.nlb
        self.sequential = job.sequential
        self.pos = 0

    def next(self) -> int:
        if self.sequential:
            self.pos = (self.pos + 1) % self.slots
            return self.pos * self.nlb
        return random.randrange(self.slots) * self.nlb


# -- our core -------------------------------------------------------------------------------------

class NoNamespace(SystemExit):
    """The namespace a bench was asked for is not on the controller: ``prog: text``."""

    def __init__(self, prog: str, text: str) -> None:
        super().__init__(f"{prog}: {text}")
        self.text = text


@asynccontextmanager
async def own_core(args: argparse.Namespace, prog: str, **options) -> AsyncIterator[tuple]:
    """Our core on a controller of its own (``args``' address, ``options`` more of its
    ConnectOptions): ``(controller, namespace args.nsid, a registered 16 MiB region)``.
    :class:`NoNamespace` naming the namespaces there when ``args.nsid`` is not one of them."""
    from nvmeof_fuse.host.controller import ConnectOptions, connect

    async with connect(ConnectOptions(args.traddr, args.nqn, trsvcid=args.trsvcid,
                                      connect_timeout=args.connect_timeout,
                                      **options)) as ctrl:
        ns = ctrl.namespaces.get(args.nsid)
        if ns is None:
            raise NoNamespace(prog, f"namespace {args.nsid} not found "
                                    f"(have {sorted(ctrl.namespaces)})")
        yield ctrl, ns, ctrl.allocate(16 * MIB)


async def _core(args: argparse.Namespace) -> dict:
    import trio

    results: dict = {"initiator": "core", "metrics": {}, "errors": {}, "cpu_us_per_io": {},
                     "sys_us_per_io": {}}
    jobs = [job for job in [*JOBS, Job("seq_read_bounce", MIB, 16, True)]
            if not args.jobs or job.key in args.jobs]
    async with own_core(args, "bench", transport=getattr(args, "transport", "rdma"),
                        nr_io_queues=getattr(args, "nr_io_queues", None)) as (ctrl, ns, region):
        for job in jobs:
            cur = Cursor(job, ns.lba_size, ns.nlb)
            try:
                with trio.fail_after(args.seconds + 60):
                    cpu = os.times()
                    count, elapsed = await core_slice(ns, region, job, cur, args.seconds)
                    end = os.times()
                results["metrics"][job.key] = figure(job, count, elapsed)
                if count:  # our process's CPU: user (Python) and system (syscalls, rxe's work)
                    user, system = end.user - cpu.user, end.system - cpu.system
                    results["cpu_us_per_io"][job.key] = round((user + system) / count * 1e6)
                    results["sys_us_per_io"][job.key] = round(system / count * 1e6)
            except Exception as e:  # noqa: BLE001 - one failed job shows as n/a
                results["errors"][job.key] = _reason(e)
        # An idle controller must not burn a core (completion polling is bounded): its
        # CPU over a quiet interval, keep-alive included.
        cpu = time.process_time()
        await trio.sleep(IDLE_SECONDS)
        results["idle_cpu_percent"] = round((time.process_time() - cpu) / IDLE_SECONDS * 100, 2)
        results["notes"] = {"queues": len(ctrl.io_queues),
                            "path": "read_into/write_from on registered buffers; "
                                    "bounce = read_lbas"}
    return results


async def core_slice(ns, region, job: Job, cur: Cursor, seconds: float) -> tuple[int, float]:
    """Run ``job`` on our core for ``seconds`` (``job.qd`` tasks, each with its own piece of
    the registered ``region``); the I/Os done and the seconds taken."""
    import trio

    count = 0
    start = time.monotonic()
    deadline = start + seconds

    async def worker(i: int) -> None:
        nonlocal count
        ref = region.ref(i * job.size, job.size)
        while time.monotonic() < deadline:
            slba = cur.next()
            if job.key == "seq_read_bounce":
                await ns.read_lbas(slba, cur.nlb)
            elif job.write:
                await ns.write_from(slba, cur.nlb, ref)
            else:
                await ns.read_into(slba, cur.nlb, ref)
            count += 1

    async with trio.open_nursery() as nursery:
        for i in range(job.qd):
            nursery.start_soon(worker, i)
    return count, time.monotonic() - start


def run_core(args: argparse.Namespace) -> dict:
    import trio

    return trio.run(_core, args)


# -- the nvmeof library (synchronous, one I/O queue) ---------------------------------------------

def run_nvmeof(args: argparse.Namespace) -> dict:
    """The ``nvmeof`` library: QD1 via ``Namespace.read/write``; QD16 via its exported
    ``RDMAQueue.submit``/``poll`` on the controller's single I/O queue (busy polling)."""
    try:
        import nvmeof
    except ImportError as e:
        raise SystemExit(f"bench: the nvmeof library is not installed ({e})") from None
    results: dict = {"initiator": "nvmeof", "metrics": {}, "errors": {},
                     "notes": {"version": nvmeof.__version__,
                               "qd1": "Namespace.read (sync)",
                               "qd16": "RDMAQueue.submit/poll on its one I/O queue"}}
    with nvmeof.Controller.connect(args.traddr, args.nqn, port=args.trsvcid,
                                   timeout=args.connect_timeout) as ctrl:
        ns = ctrl.namespace(args.nsid)
        buf = ctrl.allocate(16 * MIB)
        try:
            for job in JOBS:
                if args.jobs and job.key not in args.jobs:
                    continue
                cur = Cursor(job, ns.lba_size, ns.info.size_lbas)
                try:
                    count, elapsed = library_slice(ctrl, ns, buf, job, cur, args.seconds)
                    results["metrics"][job.key] = figure(job, count, elapsed)
                except Exception as e:  # noqa: BLE001 - one failed job shows as n/a
                    results["errors"][job.key] = _reason(e)
        finally:
            buf.close()
    return results


def library_slice(ctrl, ns, buf, job: Job, cur: Cursor, seconds: float) -> tuple[int, float]:
    """Run ``job`` on the ``nvmeof`` library for ``seconds``: QD1 through ``Namespace.read``
    or ``write``, deeper through its queue's ``submit``/``poll``; I/Os done, seconds taken."""
    if job.qd == 1:
        def one() -> None:
            (ns.write if job.write else ns.read)(buf, cur.next(), cur.nlb)
        return _sync_loop(one, seconds)
    from nvmeof import protocol as p

    return _queued(ctrl, ns, buf, job, cur, p.OPC_WRITE if job.write else p.OPC_READ, seconds)


def _sync_loop(one: Callable[[], None], seconds: float) -> tuple[int, float]:
    count = 0
    start = time.monotonic()
    deadline = start + seconds
    while time.monotonic() < deadline:
        one()
        count += 1
    return count, time.monotonic() - start


def _queued(ctrl, ns, buf, job: Job, cur: Cursor, opcode: int,
            seconds: float) -> tuple[int, float]:
    """Keep ``job.qd`` commands in flight on the library's queue for ``seconds``."""
    from nvmeof import protocol as p

    io = ctrl.io
    if job.size > ctrl.max_transfer_bytes:
        raise ValueError(f"{job.size} B exceeds the controller's {ctrl.max_transfer_bytes} B MDTS")
    qd = min(job.qd, io.depth - 1)
    free = list(range(qd))
    slot_of: dict[int, int] = {}
    count = 0
    start = time.monotonic()
    deadline = start + seconds
    hard = deadline + 30
    while True:
        now = time.monotonic()
        while free and now < deadline:
            slot = free.pop()
            cmd = p.rw_command(opcode, ns.nsid, cur.next(), cur.nlb, buf,
                               lba_size=ns.lba_size, buffer_offset=slot * job.size)
            slot_of[id(io.submit(cmd, data_owner=buf))] = slot
        if not slot_of:
            break
        if now > hard:
            raise TimeoutError(f"{len(slot_of)} commands still outstanding 30 s after the run")
        for req in io.poll():
            req.response.raise_for_status()
            free.append(slot_of.pop(id(req)))
            count += 1
    return count, time.monotonic() - start


# -- the companion API (another process, through the mount daemon) -------------------------------

def run_companion(args: argparse.Namespace) -> dict:
    """``File.pread``/``pwrite`` futures from one thread, ``qd`` outstanding, into
    ``nvmeof_fuse.empty`` arrays; with ``--processes N``, N such processes at once."""
    if args.processes > 1:
        return _companion_processes(args)
    import nvmeof_fuse

    jobs = [j for j in JOBS if args.jobs is None or j.key in args.jobs]
    results: dict = {"initiator": "companion", "metrics": {}, "errors": {},
                     "cpu_us_per_io": {}, "sys_us_per_io": {}}
    queues = getattr(args, "queues", None)
    kwargs = {} if queues is None else {"queues": queues}
    with nvmeof_fuse.File(args.file, **kwargs) as f:
        results["own_queues"] = list(f.own_queues)
        results["placement"] = f.placement["shared"]
        bufs = nvmeof_fuse.empty((16, MIB))
        if args.start_at:  # line up with the other processes of one measurement
            time.sleep(max(0.0, args.start_at - time.time()))
        for job in jobs:
            cur = Cursor(job, f.lba_size, f.nbytes // f.lba_size)
            cpu = os.times()
            try:
                ios, elapsed = companion_slice(f, bufs, job, cur, args.seconds)
            except Exception as e:  # noqa: BLE001 - reported as n/a
                results["errors"][job.key] = _reason(e)
            else:
                end = os.times()
                results["metrics"][job.key] = figure(job, ios, elapsed)
                if ios:  # this process's CPU (all its threads), as the core's figure
                    user, system = end.user - cpu.user, end.system - cpu.system
                    results["cpu_us_per_io"][job.key] = round((user + system) / ios * 1e6)
                    results["sys_us_per_io"][job.key] = round(system / ios * 1e6)
        stats = f.stats()
    results["notes"] = {k: stats[k] for k in (
        "client_queue_read_bytes", "direct_read_bytes", "staged_read_bytes",
        "daemon_copied_bytes")}
    return results


def companion_slice(f, bufs, job: Job, cur: Cursor, seconds: float) -> tuple[int, float]:
    """Keep ``job.qd`` ``pread``/``pwrite`` futures of the companion ``File`` ``f`` in
    flight from this thread for ``seconds`` (``bufs[i]``: future i's memory); I/Os done,
    seconds taken."""
    from collections import deque

    move = f.pwrite if job.write else f.pread
    ios = 0
    start = time.monotonic()
    deadline = start + seconds
    pending = deque((i, move(bufs[i], job.size, cur.next() * f.lba_size))
                    for i in range(job.qd))
    while pending:
        i, future = pending.popleft()
        future.get()
        ios += 1
        if time.monotonic() < deadline:
            pending.append((i, move(bufs[i], job.size, cur.next() * f.lba_size)))
    return ios, time.monotonic() - start


def _companion_processes(args: argparse.Namespace) -> dict:
    """Run ``args.processes`` companion benches over the same seconds; sum their figures."""
    import subprocess

    start_at = time.time() + 20 + 5 * args.processes  # after every child's imports and connect
    cmd = [sys.executable, str(HERE / "bench.py"), "companion", "--file", args.file,
           "--seconds", str(args.seconds), "--json", "--start-at", str(start_at)]
    if args.jobs:
        cmd += ["--jobs", ",".join(args.jobs)]
    if getattr(args, "queues", None) is not None:
        cmd += ["--queues", str(args.queues)]
    children = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for _ in range(args.processes)]
    limit = start_at - time.time() + (args.seconds + 60) * len(JOBS) + 60
    outputs = [child.communicate(timeout=limit) for child in children]
    results: dict = {"initiator": f"companion x{args.processes}", "metrics": {}, "errors": {},
                     "per_process": []}
    for child, (out, err) in zip(children, outputs, strict=True):
        if child.returncode != 0:
            raise RuntimeError(err.strip().splitlines()[-1] if err.strip() else
                               f"a companion process exited {child.returncode}")
        one = json.loads(out)
        results["per_process"].append(one["metrics"])
        results["errors"].update(one["errors"])
    for key in results["per_process"][0]:
        if all(key in m for m in results["per_process"]):
            results["metrics"][key] = sum(m[key] for m in results["per_process"])
    return results


# -- the table ------------------------------------------------------------------------------------

def _shared_ram(args: argparse.Namespace) -> None:
    """Back ``--workers`` with bytes every worker maps: a memfd, unless an image is given."""
    if args.image or args.workers <= 1:
        return
    fd = os.memfd_create("nvmeof-fuse-bench-ram")  # inherited by the workers
    os.ftruncate(fd, args.size_mib * MIB)
    args.image = f"/dev/fd/{fd}"
    args.image_fd = fd
    from nvmeof_fuse.host.namespace.sharedranges import SharedRanges

    args.ranges = SharedRanges.create(30.0)  # as a mount's: every process's writes take them


def _ram_workers(session: object, args: argparse.Namespace) -> list:
    """Start ``args.workers - 1`` processes serving the mount on cloned descriptors."""
    import subprocess

    from nvmeof_fuse.fs.devfuse import clone_fd

    procs = []
    ranges = getattr(args, "ranges", None)
    keep = (getattr(args, "image_fd", None), ranges.fd if ranges is not None else None)
    shared = ["--range-locks", str(ranges.fd)] if ranges is not None else []
    for index in range(1, args.workers):
        fd = clone_fd(session.fd)  # type: ignore[attr-defined]
        try:
            procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__)), "fuse-ram-worker", "--fd", str(fd),
                 "--image", args.image, "--lba-size", str(args.lba_size), "--index",
                 str(index), *shared],
                pass_fds=tuple(f for f in (fd, *keep) if f is not None)))
        finally:
            os.close(fd)
    return procs


def serve_ram_worker(args: argparse.Namespace) -> int:
    """One more process serving a ``fuse-ram --workers`` mount on its cloned descriptor:
    READ and WRITE over the shared bytes, and the metadata too (the tree is fixed, and
    handles say what they opened), until the mount ends."""
    import trio

    from nvmeof_fuse.fs.mount import MAX_BACKGROUND, MAX_WRITE
    from nvmeof_fuse.fs.operations import NamespaceFS
    from nvmeof_fuse.fs.session import FuseSession
    from nvmeof_fuse.fs.wire import InitParams

    ctrl = _ram_controller(args)
    if ctrl is None:
        return 1
    if args.range_locks is not None:
        from nvmeof_fuse.host.namespace.sharedranges import SharedRanges, share_range_locks

        share_range_locks(ctrl, SharedRanges(args.range_locks, 30.0))
    session = FuseSession(NamespaceFS(ctrl, shared_handles=True), args.fd,
                          InitParams(max_write=MAX_WRITE, max_background=MAX_BACKGROUND),
                          shared=True)
    try:
        trio.run(session.run)
    except KeyboardInterrupt:
        pass
    finally:
        session.close()
    return 0


def _ram_controller(args: argparse.Namespace):  # noqa: ANN202 - ramdisk's, from tests/
    if str(TESTS) not in sys.path:
        sys.path.append(str(TESTS))
    from ramdisk import RamDevice, RamNamespace, ram_controller

    ctrl = ram_controller()
    if args.image:  # the image's bytes, shared with whoever else serves that file
        try:
            with open(args.image, "r+b") as f:
                # Populated: pages mapped up front, so that requests do not pay a page
                # fault each (the other servers pread/pwrite the file, which faults nothing).
                data = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except (OSError, ValueError) as e:
            print(f"bench fuse-ram: cannot map {args.image}: {_reason(e)}", file=sys.stderr)
            return None
        nlb = len(data) // args.lba_size
        if not nlb or len(data) % args.lba_size:
            print(f"bench fuse-ram: {args.image} is {len(data)} bytes, not a positive "
                  f"multiple of the {args.lba_size} B LBA size", file=sys.stderr)
            return None
        ctrl.namespaces[1] = RamNamespace(1, RamDevice(args.lba_size, nlb, data))
    else:
        ctrl.namespaces[1] = RamNamespace(1, RamDevice(args.lba_size,
                                                       args.size_mib * MIB // args.lba_size))
    return ctrl


def serve_ram(args: argparse.Namespace) -> int:
    """Mount a RAM namespace at ``args.mountpoint`` until it is unmounted or signalled."""
    import trio

    from nvmeof_fuse.concurrency import unwrap_groups
    from nvmeof_fuse.fs.mount import MountError, MountOptions, serve

    _shared_ram(args)
    ctrl = _ram_controller(args)
    if ctrl is None:
        return 1
    if getattr(args, "ranges", None) is not None:
        from nvmeof_fuse.host.namespace.sharedranges import share_range_locks

        share_range_locks(ctrl, args.ranges)
    procs: list = []

    async def main() -> None:
        with unwrap_groups():
            async with trio.open_nursery() as nursery:
                ops = await nursery.start(serve, ctrl, args.mountpoint,
                                          MountOptions(fuse=args.fuse, workers=args.workers))
                if args.workers > 1 and args.fuse == "builtin":
                    procs.extend(_ram_workers(ops.kernel, args))
                print(f"READY {args.mountpoint}/n1", flush=True)

    try:
        trio.run(main)
    except MountError as e:
        print(f"bench fuse-ram: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        for proc in procs:  # they end with the mount (ENODEV); bounded all the same
            try:
                proc.wait(30)
            except Exception:  # noqa: BLE001
                proc.kill()
    return 0


def _reason(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")[:120]


def load(path: str | None) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, errors) from one of our JSON outputs or a fio JSON file."""
    if not path:
        return {}, {"*": "not run"}
    err = path + ".err"
    if os.path.exists(err):
        with open(err) as f:
            return {}, {"*": (f.read().strip().splitlines() or ["failed"])[-1][:120]}
    try:
        with open(path) as f:
            text = f.read()
        data = fio_json(text)
    except (OSError, ValueError) as e:
        return {}, {"*": _reason(e)}
    if "jobs" not in data:
        return data.get("metrics", {}), data.get("errors", {})
    metrics: dict[str, float] = {}
    for j in data["jobs"]:
        key = FIO_JOBS.get(j.get("jobname", ""))
        if key is None:
            continue
        if j.get("error"):
            continue
        metrics[key] = fio_job_figure(j, write=key == "seq_write",
                                      mb_per_s=METRICS[key][1] == "MB/s")
    return metrics, {}


def fio_command(target: str, name: str, rw: str, bs: int | str, qd: int,
                seconds: float) -> list[str]:
    """fio running one O_DIRECT libaio job on ``target`` for ``seconds``, printing JSON."""
    return ["fio", "--output-format=json", f"--filename={target}", "--ioengine=libaio",
            "--direct=1", f"--runtime={max(1, round(seconds * 1000))}ms", "--time_based",
            f"--name={name}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}"]


def fio_json(text: str) -> dict:
    """fio's JSON output (it may print notes before the JSON); ValueError without one."""
    return json.loads(text[text.index("{"):])


def fio_job_figure(job: dict, *, write: bool, mb_per_s: bool) -> float:
    """One job of fio's JSON output as MB/s (10^6 bytes) or IOPS."""
    side = job["write" if write else "read"]
    return side["bw_bytes"] / 1e6 if mb_per_s else side["iops"]


def _cpu_notes(path: str | None) -> list[str]:
    """Our core's CPU per I/O and its idle CPU, from its JSON output (if it has them)."""
    try:
        with open(path or "") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return []
    cpu, system = data.get("cpu_us_per_io", {}), data.get("sys_us_per_io", {})
    notes = [f"our core, {METRICS[k][0]}: {v:,} us CPU per I/O ({system.get(k, 0):,} in the "
             "kernel)" for k, v in cpu.items() if k in METRICS]
    if "idle_cpu_percent" in data:
        notes.append(f"our core, connected and idle for {IDLE_SECONDS:g} s: "
                     f"{data['idle_cpu_percent']:g}% of a CPU")
    return notes


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _grid(loaded: dict, columns: tuple[str, ...], ratios: tuple) -> list[str]:
    heads = ["metric", *(TITLES[c] for c in columns), *(f"{a}/{b}" for a, b in ratios)]
    rows = []
    for key, (label, unit) in METRICS.items():
        vals = {c: loaded[c][0].get(key) for c in columns}
        quotients = [vals[a] / vals[b] if vals[a] and vals[b] else None for a, b in ratios]
        rows.append([f"{label} ({unit})", *(_fmt(vals[c]) for c in columns),
                     *("n/a" if r is None else f"{r:.2f}" for r in quotients)])
    return text_grid(heads, rows)


def text_grid(heads: list[str], rows: list[list[str]]) -> list[str]:
    """``heads`` and ``rows`` as aligned text lines: the first column to the left, the
    others to the right, a rule under the heads."""
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads))]
    line = "  ".join

    def fmt(r: list[str]) -> str:
        return line(r[0].ljust(widths[0]) if i == 0 else r[i].rjust(widths[i])
                    for i in range(len(r)))

    return [fmt(heads), line("-" * w for w in widths), *(fmt(r) for r in rows)]


def _given(path: str | None) -> bool:
    """Whether a part was run: its result, or its ``.err`` file, exists."""
    return bool(path) and (os.path.exists(path) or os.path.exists(path + ".err"))


def table(sources: dict[str, str | None]) -> tuple[str, dict]:
    """The side-by-side table text and a JSON-able dict of every figure and failure.

    A grid is shown for the parts that were run: RDMA (the first), NVMe/TCP in the VM,
    NVMe/TCP from the host (with its caveat); with nothing run, the first, all n/a.
    """
    run = {c for c in ALL_COLUMNS if _given(sources.get(c))}
    host = bool(run & {"core_tcp_host", "fuse_tcp_host"})
    tcp = bool(run & {"core_tcp", "fuse_tcp"}) or ("kernel_tcp" in run and not host)
    rdma = bool(run & set(COLUMNS)) or not (tcp or host)
    grids = [(title, columns, ratios) for shown, title, columns, ratios in (
        (rdma, "", COLUMNS, RATIOS), (tcp, "NVMe/TCP:", TCP_COLUMNS, TCP_RATIOS),
        (host, "NVMe/TCP from the host:", HOST_COLUMNS, HOST_RATIOS)) if shown]
    columns = tuple(dict.fromkeys(c for _, cols, _ in grids for c in cols))
    loaded = {c: load(sources.get(c)) for c in columns}
    out: list[str] = []
    for title, cols, ratios in grids:
        out += (["", title] if out else [title] if title else []) + _grid(loaded, cols, ratios)
    if host:
        out += ["", HOST_CAVEAT]
    notes = []
    for c in columns:
        errs = loaded[c][1]
        if "*" in errs:
            notes.append(f"n/a {TITLES[c]}: {errs['*']}")
        notes += [f"n/a {TITLES[c]}, {METRICS[k][0]}: {v}" for k, v in errs.items() if k != "*"]
    if rdma:
        blank = [METRICS[k][0] for k in METRICS if k not in loaded["core"][0]
                 and k not in loaded["core"][1] and "*" not in loaded["core"][1]]
        if blank:
            notes.append(f"n/a our core: not measured: {', '.join(blank)}")
    notes += _cpu_notes(sources.get("core"))
    out += ["", "MB = 10^6 bytes.", *notes]
    data = {"figures": {c: loaded[c][0] for c in columns},
            "errors": {c: loaded[c][1] for c in columns}, "sources": sources}
    return "\n".join(out) + "\n", data


# -- command line ---------------------------------------------------------------------------------

def _print(results: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(results, indent=2))
        return
    cpu = results.get("cpu_us_per_io", {})
    for key, v in results["metrics"].items():
        label, unit = METRICS[key]
        extra = (f"  ({cpu[key]:,} us CPU per I/O, {results['sys_us_per_io'][key]:,} in the "
                 "kernel)" if key in cpu else "")
        print(f"{results['initiator']:7} {label:42} {_fmt(v):>10} {unit}{extra}")
    for key, why in results["errors"].items():
        print(f"{results['initiator']:7} {METRICS[key][0]:42} {'n/a':>10} ({why})")
    if "idle_cpu_percent" in results:
        print(f"{results['initiator']:7} idle CPU over {IDLE_SECONDS:g} s connected: "
              f"{results['idle_cpu_percent']:g}% of a CPU")


def name_list(choices: Iterable[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names from ``choices``."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or repr(text)} "
                                             f"(have {', '.join(allowed)})")
        return names
    return parse


_job_keys = name_list(METRICS, "job")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/benches/bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    for name in ("core", "nvmeof"):
        s = sub.add_parser(name, help=f"benchmark {name} on one namespace")
        s.add_argument("-a", "--traddr", required=True)
        s.add_argument("-s", "--trsvcid", type=int, default=4420)
        s.add_argument("-n", "--nqn", required=True)
        s.add_argument("--nsid", type=int, default=2)
        s.add_argument("--seconds", type=float, default=5.0, help="per job (default 5)")
        s.add_argument("--connect-timeout", type=float, default=60.0)
        s.add_argument("--json", action="store_true", help="print JSON")
        s.add_argument("--jobs", type=_job_keys, default=None, metavar="KEY[,KEY...]",
                       help=f"run only these jobs (of {', '.join(METRICS)})")
        if name == "core":
            s.add_argument("-t", "--transport", choices=("rdma", "tcp"), default="rdma")
            s.add_argument("--nr-io-queues", type=int, default=None,
                           help="I/O queues to connect (default: the controller's choice)")
    c = sub.add_parser("companion", help="benchmark nvmeof_fuse.File on a mounted namespace")
    c.add_argument("--file", required=True, help="a namespace file of a mount: MOUNT/nN")
    c.add_argument("--seconds", type=float, default=5.0, help="per job (default 5)")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.add_argument("--jobs", type=_job_keys, default=None, metavar="KEY[,KEY...]",
                   help=f"run only these jobs (of {', '.join(METRICS)})")
    c.add_argument("--processes", type=int, default=1,
                   help="run this many client processes at once and add up (default 1)")
    c.add_argument("--queues", type=int, default=None,
                   help="queues of its own each File leases (0: the mount daemon's queues; "
                        "default: nvmeof_fuse.File's)")
    c.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    r = sub.add_parser("fuse-ram", help="mount a namespace kept in RAM (MOUNTPOINT/n1)")
    r.add_argument("mountpoint")
    r.add_argument("--size-mib", type=int, default=256, help="namespace size (default 256)")
    r.add_argument("--lba-size", type=int, choices=(512, 4096), default=4096)
    r.add_argument("--image", metavar="FILE",
                   help="serve this file's bytes (mapped shared) instead of fresh RAM")
    r.add_argument("--fuse", default="builtin", metavar="SERVER",
                   help="the FUSE server: builtin (ours, the default) or pyfuse3")
    r.add_argument("--workers", type=int, default=1,
                   help="processes serving it, each on a cloned /dev/fuse descriptor")
    w = sub.add_parser("fuse-ram-worker", help=argparse.SUPPRESS)
    w.add_argument("--fd", type=int, required=True)
    w.add_argument("--image", required=True)
    w.add_argument("--lba-size", type=int, default=4096)
    w.add_argument("--index", type=int, default=1)
    w.add_argument("--range-locks", type=int, help="the mount's range locks (a memfd)")
    t = sub.add_parser("table", help="side-by-side table of saved results")
    for c in ALL_COLUMNS:
        t.add_argument(f"--{c.replace('_', '-')}", dest=c, metavar="FILE")
    t.add_argument("--out", metavar="DIR", help="also write DIR/bench.txt and DIR/bench.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.what == "table":
        text, data = table({c: getattr(args, c) for c in ALL_COLUMNS})
        print(text, end="")
        if args.out:
            with open(os.path.join(args.out, "bench.txt"), "w") as f:
                f.write(text)
            with open(os.path.join(args.out, "bench.json"), "w") as f:
                json.dump(data, f, indent=2)
        return 0
    if args.what == "fuse-ram":
        if args.size_mib <= 0:
            print("bench: --size-mib must be positive", file=sys.stderr)
            return 2
        return serve_ram(args)
    if args.what == "fuse-ram-worker":
        return serve_ram_worker(args)
    if args.what == "companion":
        if args.seconds <= 0 or args.processes < 1:
            print("bench: --seconds and --processes must be positive", file=sys.stderr)
            return 2
        try:
            results = run_companion(args)
        except Exception as e:  # noqa: BLE001 - one line, not a traceback
            print(f"bench companion: {_reason(e)}", file=sys.stderr)
            return 1
        _print(results, args.json)
        return 0
    if args.seconds <= 0 or not 0 < args.trsvcid < 65536 or args.nsid <= 0:
        print("bench: --seconds, --trsvcid and --nsid must be positive (port < 65536)",
              file=sys.stderr)
        return 2
    try:
        results = (run_core if args.what == "core" else run_nvmeof)(args)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - one line, not a traceback
        if isinstance(e, KeyboardInterrupt):
            raise
        print(f"bench {args.what}: {_reason(e)}", file=sys.stderr)
        return 1
    _print(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
