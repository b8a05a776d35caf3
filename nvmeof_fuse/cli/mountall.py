"""``nvmeof-fuse mount-all``: nvme-cli's ``connect-all``, with a mount per subsystem.

Each NVMe subsystem a discovery log page lists is mounted at ``ROOT/<subnqn>``;
subsystems already mounted there are skipped.  With no address, the discovery
controllers come from ``/etc/nvme/discovery.conf``, read as nvme-cli reads it.
Planning and reporting are pure; the caller discovers and mounts.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.nvme.uri import NVMeURI
from nvmeof_fuse.transport import registry

DISCOVERY_CONF = "/etc/nvme/discovery.conf"
FSTYPE = "fuse.nvmeof-fuse"
NVME_SUBSYSTEM = "nvme subsystem"
REFERRAL = "discovery subsystem referral"
FROM_DISCOVERY = ("transport", "traddr", "trsvcid", "nqn", "nsid", "namespace_id", "path")


@dataclass(frozen=True)
class DiscoveryTarget:
    """A discovery controller to ask: one ``-t/-a/-s`` set or one discovery.conf line."""

    transport: str
    traddr: str
    trsvcid: str | None = None
    host_traddr: str | None = None
    hostnqn: str | None = None
    hostid: str | None = None


@dataclass
class Outcome:
    """One row of the report: a subsystem and what became of it."""

    subnqn: str
    transport: str
    traddr: str
    trsvcid: str
    mountpoint: str
    status: str  # "mount" (to do), "mounted", "already mounted", "path", "skipped", "failed"
    reason: str = ""
    argv: list[str] = field(default_factory=list, repr=False)  # the `mount` command line


def read_discovery_conf(path: str = DISCOVERY_CONF) -> list[DiscoveryTarget]:
    """The discovery controllers in nvme-cli's ``discovery.conf``.

    As nvme-cli: lines starting with ``#`` or empty are skipped, the rest split
    at spaces and ``=`` into ``discover`` options (``-t tcp -a 10.0.0.1 -s 8009``
    or ``--transport=tcp --traddr=...``); lines without transport or address are
    skipped, and options other than the connection's are ignored.
    """
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("-t", "--transport")
    parser.add_argument("-a", "--traddr")
    parser.add_argument("-s", "--trsvcid")
    parser.add_argument("-w", "--host-traddr")
    parser.add_argument("-q", "--hostnqn")
    parser.add_argument("-I", "--hostid")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise InvalidArgument(f"no -a ADDRESS given and no {path}") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from None
    targets = []
    for n, line in enumerate(lines, 1):
        if not line or line.startswith("#"):
            continue
        try:
            args, _ = parser.parse_known_args([t for t in re.split(r"[ =]", line) if t])
        except argparse.ArgumentError as exc:
            raise InvalidArgument(f"{path}:{n}: {exc}") from None
        if args.transport is None or args.traddr is None:
            continue
        targets.append(DiscoveryTarget(args.transport, args.traddr, args.trsvcid,
                                       args.host_traddr, args.hostnqn, args.hostid))
    return targets


def check_mount_options(items: Iterable[str]) -> None:
    """Refuse ``-O`` keys that the discovery log page decides."""
    for item in items:
        key = item.partition("=")[0].strip().replace("-", "_")
        if key in FROM_DISCOVERY:
            raise InvalidArgument(f"mount option {key!r} comes from the discovery log page; "
                                  "mount one subsystem with `nvmeof-fuse mount` instead")


def plan(records: Iterable[dict], root: str, mounts: Iterable[tuple[str, str]],
         common: list[str], keyring_psk: Callable[[str], str | None] | None = None,
         ) -> list[Outcome]:
    """What to do with each discovery log entry (``records`` as ``DiscoveryLogPage.to_dict``).

    ``mounts`` are (mountpoint, fstype) pairs of the mounts now; ``common`` the
    ``mount`` options given to every mount.  Entries that are not NVMe subsystems
    (the discovery controller itself) are left out.  There is one mount per subsystem:
    a further entry of a subsystem in the plan becomes a further path of its mount
    (``--path``, status ``path``); the same address twice, or a further path of a
    subsystem already mounted, is skipped.  An entry whose port requires TLS is mounted with
    ``--tls`` when ``keyring_psk(subnqn)`` (the identity looked for; None: the keyring holds
    its PSK) finds its key, and refused in one line naming the identity otherwise.
    """
    mounted = dict(mounts)  # mountpoint -> fstype, the last mount on a path winning
    root = os.path.abspath(root)
    seen: set[str] = set()
    first: dict[str, Outcome] = {}  # subnqn -> the entry that mounts it
    places: dict[str, set[tuple[str, str, str]]] = {}  # subnqn -> its addresses so far
    out = []
    for r in records:
        subtype = r.get("subtype")
        subnqn, trtype = str(r.get("subnqn", "")), str(r.get("trtype", ""))
        traddr, trsvcid = str(r.get("traddr", "")), str(r.get("trsvcid", ""))
        if subtype not in (NVME_SUBSYSTEM, REFERRAL):
            continue
        point = os.path.join(root, subnqn)
        o = Outcome(subnqn, trtype, traddr, trsvcid, point, "mount")
        if subtype == REFERRAL:
            o.status, o.reason = "skipped", "a referral to another discovery controller"
        elif not subnqn.startswith("nqn.") or "/" in subnqn:
            o.status, o.reason = "skipped", f"{subnqn!r} is not an NQN usable as a directory name"
        elif trtype not in registry.NAMES:
            o.status, o.reason = "skipped", f"transport {trtype} is not supported"
        elif (trtype, traddr, trsvcid) in places.get(subnqn, set()):
            o.status, o.reason = "skipped", "the same address as a path above"
        elif subnqn in seen and first[subnqn].status == "mount":
            mount = first[subnqn]
            uri = NVMeURI(trtype, traddr, int(trsvcid) if trsvcid.isdigit() else None, subnqn)
            mount.argv[-1:-1] = ["--path", str(uri)]
            o.status, o.reason = "path", "a further path of the mount above"
            places[subnqn].add((trtype, traddr, trsvcid))
        elif subnqn in seen:
            o.status, o.reason = "skipped", ("another path to a subsystem mounted above (add "
                                             "it with: nvmeof-fuse add-path)")
        elif mounted.get(point) == FSTYPE:
            o.status = "already mounted"
        elif point in mounted:
            o.status, o.reason = "failed", f"a {mounted[point]} filesystem is mounted there"
        elif (why := _tls_refusal(r, common, keyring_psk)) is not None:
            o.status, o.reason = "failed", why
        else:
            o.argv = ["mount", "-t", trtype, "-a", traddr,
                      "-s", trsvcid or str(registry.capabilities(trtype).port),
                      "-n", subnqn, *common, *_tls_from_keyring(r, common), point]
        if o.status in ("mount", "already mounted"):
            seen.add(subnqn)
            first[subnqn] = o
            places[subnqn] = {(trtype, traddr, trsvcid)}
        out.append(o)
    return out


TLS_OPTIONS = ("--tls", "--tls-key", "--tls-compat", "--keyring", "--tls-key-identity")
"""Options that choose TLS and its key for every mount (``-O tls``, ``-O tls_key_file=``...)."""


def _requires_tls(record: dict) -> bool:
    return (record.get("tcp_sectype", "none") != "none"
            and str(record.get("treq", "")).startswith("required"))


def _tls_refusal(record: dict, common: list[str],
                 keyring_psk: Callable[[str], str | None] | None) -> str | None:
    """Why an entry whose port requires TLS (TREQ required, TSAS SECTYPE tls or tls13)
    cannot be mounted with ``common``; None when it can (its key is given, or in the
    keyring)."""
    if not _requires_tls(record):
        return None
    sectype = record.get("tcp_sectype")
    if sectype != "tls13":
        return f"the port requires TLS ({sectype}); nvmeof-fuse speaks TLS 1.3 only"
    if any(option in common for option in TLS_OPTIONS):
        return None
    missing = keyring_psk(str(record.get("subnqn", ""))) if keyring_psk else "its PSK"
    if missing is None:
        return None
    return (f"the port requires TLS 1.3 (its TSAS) and the keyring holds no {missing!r}: "
            "load it (nvmeof-fuse gen-tls-key --insert) or give -O tls_key_file=FILE")


def _tls_from_keyring(record: dict, common: list[str]) -> list[str]:
    """``--tls`` for an entry that requires TLS and was given no TLS option: its PSK is in
    the keyring (:func:`_tls_refusal` checked)."""
    if _requires_tls(record) and not any(option in common for option in TLS_OPTIONS):
        return ["--tls"]
    return []


def format_table(outcomes: list[Outcome]) -> str:
    rows = [["Subsystem NQN", "Transport", "Address", "Mountpoint", "Status"]]
    for o in outcomes:
        status = f"{o.status}: {o.reason}" if o.reason else o.status
        rows.append([o.subnqn, o.transport, f"{o.traddr}:{o.trsvcid}", o.mountpoint, status])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def to_json(outcomes: list[Outcome]) -> list[dict]:
    return [{k: v for k, v in asdict(o).items() if k != "argv"} for o in outcomes]
