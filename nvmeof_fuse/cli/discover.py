"""``nvmeof-fuse discover`` and ``nvmeof-fuse list``: a discovery log page, and the mounts
(one, or every nvmeof-fuse mount as ``nvme list`` lists controllers)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from typing import Any

from nvmeof_fuse.cli.mountall import FSTYPE
from nvmeof_fuse.cli.options import (
    DISCOVERY_NQN,
    PROG,
    UsageError,
    add_connection,
    connect_options,
    one_line,
)
from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.transport import registry

LIST_TIMEOUT = 10.0  # s for reading a mount's .nvmeof files


def add_parsers(sub: Any) -> None:
    """The ``discover`` and ``list`` commands, in the subcommands ``sub``."""
    d = sub.add_parser("discover", help="print a discovery controller's log page")
    add_connection(d, port_help="transport service id (default 8009 tcp, 4420 rdma)")
    d.add_argument("-o", "--output-format", choices=["normal", "json"], default="normal")

    ls = sub.add_parser("list", help="show the controller mounted at MOUNTPOINT (default: all)")
    ls.add_argument("-o", "--output-format", choices=["normal", "json"], default="normal")
    ls.add_argument("--debug", action="store_true", help="tracebacks on errors")
    ls.add_argument("mountpoint", nargs="?")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


# --- discover ---------------------------------------------------------------------------


def format_discovery(page: Any) -> str:
    doc = page.to_dict()
    records = doc.get("records", [])
    head = f"Discovery Log Number of Records {doc.get('numrec', len(records))}, "
    head += f"Generation counter {doc.get('genctr', 0)}"
    cols = ["trtype", "adrfam", "subtype", "portid", "trsvcid", "traddr", "subnqn"]
    rows = [["#", *cols]] + [
        [str(i)] + [str(r.get(c, "")) for c in cols] for i, r in enumerate(records)
    ]
    return head + "\n" + _table(rows)


def cmd_discover(args: argparse.Namespace) -> int:
    import trio

    from nvmeof_fuse.host.discovery import discover

    port = registry.capabilities(args.transport or registry.DEFAULT).discovery_port
    conn = connect_options(args, nqn=DISCOVERY_NQN, default_port=port)
    page = trio.run(discover, conn)
    if args.output_format == "json":
        print(json.dumps(page.to_dict(), indent=2))
    else:
        print(format_discovery(page))
    return 0


# --- list ------------------------------------------------------------------------------


def read_mount_info(mountpoint: str) -> dict[str, Any]:
    """The controller.json of an nvmeof-fuse mount (blocking; may hang on a hung mount)."""
    from nvmeof_fuse.fs.mount import MountError, stale_message

    path = os.path.join(mountpoint, ".nvmeof", "controller.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        if not os.path.isdir(mountpoint):
            raise MountError(
                f"mountpoint {mountpoint} does not exist or is not a directory"
            ) from None
        raise MountError(
            f"{mountpoint} is not an nvmeof-fuse mount (no .nvmeof/controller.json)"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise MountError(stale_message(mountpoint)) from None
        raise MountError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise MountError(f"{path} is not valid JSON: {exc}") from None


async def read_mount_info_in_time(mountpoint: str) -> dict[str, Any]:
    """:func:`read_mount_info` in a thread, given up after ``LIST_TIMEOUT``."""
    from nvmeof_fuse.concurrency import in_thread

    return await in_thread(read_mount_info, mountpoint, timeout=LIST_TIMEOUT, too_slow=UsageError(
        f"{mountpoint} does not respond within {LIST_TIMEOUT:g} s (a hung daemon?)"))


def format_list(mountpoint: str, doc: dict[str, Any]) -> str:
    c, ident = doc.get("controller", {}), doc.get("identify", {})
    lines = [
        f"{mountpoint}: {ident.get('mn', '?')} (serial {ident.get('sn', '?')}, "
        f"firmware {ident.get('fr', '?')})",
        f"  {c.get('transport', '?')} {c.get('traddr', '?')}:{c.get('trsvcid', '?')} "
        f"{c.get('subnqn', ident.get('subnqn', '?'))} cntlid {c.get('cntlid', '?')}",
    ]
    paths = doc.get("paths") or []
    if len(paths) == 1:
        lines[1] += _device_words(paths[0])
    if len(paths) > 1 or any(p.get("ana_state") not in (None, "optimized") for p in paths):
        lines[1] = f"  {c.get('subnqn', ident.get('subnqn', '?'))}, iopolicy " \
                   f"{c.get('iopolicy', '?')}"
        lines += [_path_line(p) for p in paths]
    rows = [["Node", "NSID", "Size (bytes)", "LBA size", "LBAs"]]
    for ns in doc.get("namespaces", []):
        node = os.path.join(mountpoint, f"n{ns['nsid']}")
        rows.append([node, str(ns["nsid"]), str(ns["size"]), str(ns["lba_size"]), str(ns["nlb"])])
    return "\n".join(lines) + "\n" + _table(rows)


def _device_words(p: dict[str, Any]) -> str:
    """`` via mlx5_3 (0000:9b:00.0, NUMA 1)``: the local device a path goes through, as far
    as it is known; empty when it is not."""
    if not p.get("device"):
        return ""
    where = [str(p["device_pci"])] if p.get("device_pci") else []
    if p.get("device_numa_node") is not None:
        where.append(f"NUMA {p['device_numa_node']}")
    return f" via {p['device']}" + (f" ({', '.join(where)})" if where else "")


def _path_line(p: dict[str, Any]) -> str:
    """One path of a multipath mount, as ``nvme list-subsys`` shows one: where, its local
    device, state, ANA."""
    cntlid = p.get("cntlid")
    ana = p.get("ana_state") or "ana unknown"
    return (f"  path {p.get('index')}: {p.get('transport')} {p.get('traddr')}:"
            f"{p.get('trsvcid')}{_device_words(p)} cntlid {cntlid if cntlid is not None else '-'} "
            f"{p.get('state')} {ana}{'' if p.get('usable') else ' (unused)'}, "
            f"{p.get('ios', 0)} I/Os, {p.get('outstanding', 0)} outstanding")


def cmd_list(args: argparse.Namespace) -> int:
    """The mount at ``args.mountpoint``; with none, every mount (:func:`cmd_list_all`)."""
    import trio

    if args.mountpoint is None:
        return cmd_list_all(args)
    doc = trio.run(read_mount_info_in_time, args.mountpoint)
    if args.output_format == "json":
        print(json.dumps({"mountpoint": os.path.abspath(args.mountpoint), **doc}, indent=2))
    else:
        print(format_list(args.mountpoint, doc))
    return 0


def cmd_list_all(args: argparse.Namespace) -> int:
    """Every nvmeof-fuse mount of this mount namespace, as ``nvme list`` lists controllers."""
    import trio

    from nvmeof_fuse.fs.mount import read_mountinfo

    docs, texts, rc = [], [], 0
    for m in read_mountinfo():
        if m.fstype != FSTYPE:
            continue
        try:
            doc = trio.run(read_mount_info_in_time, m.mountpoint)
        except (NVMeoFError, UsageError) as exc:
            print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
            rc = 1
            continue
        docs.append({"mountpoint": m.mountpoint, "source": m.source, **doc})
        texts.append(format_list(m.mountpoint, doc))
    if args.output_format == "json":
        print(json.dumps(docs, indent=2))
    elif texts:
        print("\n\n".join(texts))
    return rc
