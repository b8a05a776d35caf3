"""Contents of the files under ``.nvmeof/``: controller, namespace and stats reports."""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable
from typing import Any, Protocol

from nvmeof_fuse.host.namespace.stats import IoStats


class NamespaceLike(Protocol):
    nsid: int
    lba_size: int
    nlb: int
    size: int
    unavailable: str  # why we cannot serve it ('' when we can): opening it fails
    generation: int  # tells it from the namespaces that had or will have its NSID
    identify: Any  # .to_dict()
    stats: IoStats
    io_stats: IoStats | None  # stats, None while it did no I/O (reading builds nothing)

    async def read(self, offset: int, length: int) -> bytes: ...

    async def read_lent(self, offset: int, length: int) -> bytes | memoryview:
        """Like read, but valid only until the calling task next yields."""
        ...

    def start_read_lent(self, offset: int, length: int,
                        done: Callable[[memoryview | None], None]) -> bool:
        """Like read_lent with no task waiting: ``done`` gets the data (or None: it failed;
        read again), lent for that call.  False: nothing started, call read_lent."""
        ...

    async def write(self, offset: int, data: bytes | memoryview) -> int: ...

    def start_write(self, offset: int, data: memoryview, done: Callable[[bool], None]) -> bool:
        """Like write with no task waiting: ``done`` is told whether it landed (False: it
        failed; write again).  False: nothing started, call write."""
        ...

    async def flush(self) -> None: ...


class ControllerLike(Protocol):
    identify: Any  # .to_dict(), .mn .sn .fr .subnqn .cntlid
    namespaces: dict[int, Any]  # NamespaceLike by NSID
    starts_io: bool  # its namespaces' start_read_lent/start_write can start I/O

    def describe(self) -> dict: ...


class CompanionLike(Protocol):
    """The mount's companion server, as ``.nvmeof/`` reports it (handed down by the daemon)."""

    def info(self) -> dict[str, Any]: ...

    def snapshot(self) -> dict[str, Any]: ...


def _json_default(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def to_json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, default=_json_default) + "\n").encode()


def _text(title: str, sections: dict[str, dict]) -> bytes:
    lines = [title]
    for name, fields in sections.items():
        lines.append(f"\n[{name}]")
        width = max((len(k) for k in fields), default=0)
        for key, value in fields.items():
            if isinstance(value, dict | list | tuple):
                value = json.dumps(value, default=_json_default)
            elif isinstance(value, enum.Enum):
                value = value.name
            elif isinstance(value, bytes | bytearray):
                value = bytes(value).hex()
            lines.append(f"{key.ljust(width)} : {value}")
    return ("\n".join(lines) + "\n").encode()


def namespace_summary(ns: NamespaceLike) -> dict[str, int]:
    return {"nsid": ns.nsid, "size": ns.size, "lba_size": ns.lba_size, "nlb": ns.nlb}


def controller_dict(ctrl: ControllerLike) -> dict[str, Any]:
    doc = {
        "controller": ctrl.describe(),
        "identify": ctrl.identify.to_dict(),
        "namespaces": [namespace_summary(ctrl.namespaces[n]) for n in sorted(ctrl.namespaces)],
    }
    if hasattr(ctrl, "paths_snapshot"):  # what `nvmeof-fuse list` shows of each path
        doc["paths"] = paths_list(ctrl)
    return doc


def controller_text(ctrl: ControllerLike) -> bytes:
    ident = ctrl.identify
    title = f"{ident.mn} (serial {ident.sn}, firmware {ident.fr}), {ident.subnqn}"
    namespaces = {
        f"n{n}": f"{ns.size} bytes, {ns.nlb} LBAs of {ns.lba_size} bytes"
        for n, ns in sorted(ctrl.namespaces.items())
    }
    return _text(
        title,
        {"connection": ctrl.describe(), "namespaces": namespaces, "identify": ident.to_dict()},
    )


def namespace_dict(ns: NamespaceLike) -> dict[str, Any]:
    doc = {**namespace_summary(ns), "identify": ns.identify.to_dict()}
    identity = getattr(ns, "identity", None)  # what a rescan compares (host.identity)
    if identity is not None:
        doc.update(identity=identity.describe(), generation=ns.generation)
    return doc


def namespace_text(ns: NamespaceLike) -> bytes:
    title = f"namespace {ns.nsid}: {ns.size} bytes, {ns.nlb} LBAs of {ns.lba_size} bytes"
    return _text(title, {"identify": ns.identify.to_dict()})


def io_stats(ns: NamespaceLike) -> IoStats:
    """What ``ns`` counted; empty for a namespace that did no I/O yet, which a report does
    not make build its I/O (a target may have 65,536 namespaces)."""
    stats = ns.io_stats
    return stats if stats is not None else IoStats()


IDLE_LISTED_MAX = 1024
"""Namespaces a stats report lists one by one whether or not they did I/O; past that many,
it lists those that did and counts the rest (a target may have 65,536 namespaces)."""


def reported_namespaces(ctrl: ControllerLike) -> tuple[list[tuple[int, Any]], int]:
    """The namespaces a stats report lists, by NSID, and how many idle ones it only counts."""
    items = sorted(ctrl.namespaces.items())
    if len(items) <= IDLE_LISTED_MAX:
        return items, 0
    used = [(n, ns) for n, ns in items if ns.io_stats is not None]
    return used, len(items) - len(used)


def stats_dict(ctrl: ControllerLike, companion: CompanionLike | None = None,
               served: dict[str, int] | None = None,
               serving: dict[str, Any] | None = None) -> dict[str, Any]:
    """``stats.json``; ``served``: the FUSE requests this process read and its waits for
    them, shown beside each FUSE worker's (how the kernel spread them); ``serving``: how
    many processes serve the mount and how that was chosen (``--workers``)."""
    listed, idle = reported_namespaces(ctrl)
    doc: dict[str, Any] = {f"n{n}": io_stats(ns).snapshot() for n, ns in listed}
    workers = worker_reports(companion)
    if workers:  # FUSE workers: the namespaces' figures summed, and each process's own
        main = {"index": 0, "pid": os.getpid(), **(served or {}), "namespaces": doc}
        doc = _with_workers(doc, workers)
        doc["workers"] = [main, *workers]
    if serving is not None:  # (the main process's figures too: a mount may have no workers)
        doc["serving"] = {**serving, **({"main": served} if served else {})}
    if idle:
        doc["idle_namespaces"] = idle  # namespaces that did no I/O, not listed
    connection = getattr(ctrl, "connection_snapshot", None)
    if connection is not None:
        doc["connection"] = connection()
    if companion is not None:
        doc["companion"] = companion.snapshot()
    return doc


def _with_workers(main: dict[str, Any], workers: list[dict[str, Any]]) -> dict[str, Any]:
    """The main process's namespace statistics summed with each worker's report (counts;
    latency means weighted, maxima and percentiles the largest)."""
    total = {}
    for name, ns in main.items():
        total[name] = {**ns, "ops": {op: dict(st) for op, st in ns.get("ops", {}).items()},
                       "counters": dict(ns.get("counters", {}))}
    for worker in workers:
        for name, ns in (worker.get("namespaces") or {}).items():
            if not isinstance(ns, dict) or name not in total:
                continue
            into = total[name]
            for op, st in (ns.get("ops") or {}).items():
                into["ops"][op] = _sum_op(into["ops"].get(op), st)
            for counter, n in (ns.get("counters") or {}).items():
                if isinstance(n, int):
                    into["counters"][counter] = into["counters"].get(counter, 0) + n
    return total


def _sum_op(a: dict | None, b: dict) -> dict:
    if a is None:
        return dict(b)
    ops = a.get("ops", 0) + b.get("ops", 0)
    lat_a, lat_b = a.get("latency_us", {}), b.get("latency_us", {})
    latency = {k: max(lat_a.get(k, 0), lat_b.get(k, 0)) for k in {*lat_a, *lat_b}}
    if ops:
        latency["mean"] = (lat_a.get("mean", 0) * a.get("ops", 0)
                           + lat_b.get("mean", 0) * b.get("ops", 0)) / ops
    return {"ops": ops, "bytes": a.get("bytes", 0) + b.get("bytes", 0),
            "errors": a.get("errors", 0) + b.get("errors", 0), "latency_us": latency}


def worker_reports(companion: CompanionLike | None) -> list[dict[str, Any]]:
    """What each FUSE worker process last reported (none without workers), by index: the
    companion server keeps what the mount's own processes report of themselves."""
    reports = getattr(companion, "own_reports", None)
    return sorted(reports(), key=lambda w: w.get("index", 0)) if reports is not None else []


def companion_dict(companion: CompanionLike | None) -> dict[str, Any]:
    """Where companion clients (``nvmeof_fuse.File``) find this mount's daemon."""
    return companion.info() if companion is not None else {"socket": None}


def stats_text(ctrl: ControllerLike, companion: CompanionLike | None = None,
               serving: dict[str, Any] | None = None) -> bytes:
    parts = []
    workers = worker_reports(companion)
    listed, idle = reported_namespaces(ctrl)
    for n, ns in listed:
        body = io_stats(ns).format_text().rstrip("\n").replace("\n", "\n  ")
        title = f"n{n} (the main process; stats.json sums the workers)" if workers else f"n{n}"
        parts.append(f"{title}:\n  {body}\n")
    if idle:
        parts.append(f"{idle} more namespaces did no I/O\n")
    for worker in workers:  # each FUSE worker: where it serves and how much
        fields = {"pid": worker.get("pid"), "queues": worker.get("qids"),
                  "state": worker.get("state"), "reconnects": worker.get("reconnects")}
        if "requests" in worker:  # what it asked the main process, per request it read
            sent = worker.get("to_main") or {}
            fields.update({"requests": worker["requests"], "parks": worker.get("parks"),
                           "to main per request": worker.get("to_main_per_request"),
                           "to main": ", ".join(f"{kind} {n}" for kind, n in sent.items()
                                                if n) if isinstance(sent, dict) else sent})
        if worker.get("tls"):  # where its own queues' TLS records go
            fields["tls"] = worker["tls"]
        for name, ns in sorted((worker.get("namespaces") or {}).items()):
            for op, st in sorted((ns.get("ops") or {}).items()):
                fields[f"{name} {op}"] = (f"{st.get('ops', 0)} ops, {st.get('bytes', 0)} bytes, "
                                          f"{st.get('errors', 0)} errors")
        parts.append(_section(f"FUSE worker {worker.get('index')}", fields))
    if serving:  # how many processes serve the mount, and why that many
        parts.append(_section("serving", serving))
    connection = getattr(ctrl, "connection_snapshot", None)
    if connection is not None:
        parts.append(_section("connection", connection()))
    if companion is not None:
        fields = companion.snapshot()
        sessions = fields.pop("sessions", [])
        parts.append(_section("companion", fields))
        for session in sessions:  # each client: where it places each kind of memory
            client = dict(session)
            placement = client.pop("placement", None) or {}
            client = {k: v for k, v in client.items() if v and k != "peer"}
            client.update({f"placement {kind}": how for kind, how in placement.items()})
            if client:
                parts.append(_section(f"companion client {session.get('peer', '?')}", client))
    return "\n".join(parts).encode()


def _section(title: str, fields: dict[str, Any]) -> str:
    width = max(len(k) for k in fields)
    body = "\n  ".join(f"{k.ljust(width)} : {v}" for k, v in fields.items())
    return f"{title}:\n  {body}\n"


PATH_COLUMNS = (("path", "index"), ("transport", "transport"), ("address", None),
                ("cntlid", "cntlid"), ("ana group", "ana_group"), ("ana state", "ana_state"),
                ("state", "state"), ("usable", "usable"), ("outstanding", "outstanding"),
                ("ios", "ios"), ("bytes", "bytes"), ("losses", "losses"),
                ("reconnects", "reconnects"), ("device", "device"),
                ("numa", "device_numa_node"))


def paths_list(ctrl: Any) -> list[dict[str, Any]]:
    """``paths.json``: one object per path of a multipath mount (none without paths)."""
    snapshot = getattr(ctrl, "paths_snapshot", None)
    return snapshot() if snapshot is not None else []


def paths_text(ctrl: Any) -> bytes:
    """``paths``: the paths as a table, the I/O policy first."""
    rows = [[title for title, _ in PATH_COLUMNS]]
    for path in paths_list(ctrl):
        row = []
        for _, key in PATH_COLUMNS:
            if key is None:
                value = f"{path['traddr']}:{path['trsvcid']}"
            else:
                value = path.get(key)
            row.append("-" if value is None else str(value).lower()
                       if isinstance(value, bool) else str(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    policy = getattr(ctrl, "policy", None)
    lines = [f"iopolicy: {policy}"] if policy else []
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    return ("\n".join(lines) + "\n").encode()
