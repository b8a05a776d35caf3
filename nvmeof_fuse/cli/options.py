"""The options every command shares: their checks, the connection's arguments, error lines.

Option names follow nvme-cli. A bad value raises :class:`UsageError`, reported as one
line like any other error (exit status 1).
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Sequence
from typing import Any

from nvmeof_fuse.cli.mounthelper import refuse_secret_option
from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.transport import registry

PROG = "nvmeof-fuse"
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"


class UsageError(Exception):
    """A bad option value; reported like any other error (exit 1)."""


# --- option values ------------------------------------------------------------


def _int(name: str, value: str | None, lo: int, hi: int) -> int | None:
    if value is None:
        return None
    try:
        n = int(value, 0)
    except ValueError:
        raise UsageError(f"{name} {value!r} is not an integer") from None
    if not lo <= n <= hi:
        raise UsageError(f"{name} {value} is out of range ({lo}-{hi})")
    return n


def _seconds(name: str, value: str, *, low: float = 0, high: float = 65535,
             forever: bool = False, off: bool = False) -> float:
    try:
        s = float(value)
    except ValueError:
        raise UsageError(f"{name} {value!r} is not a number of seconds") from None
    if not low <= s <= high:
        also = ", or -1 for ever" if forever else ", or -1 for off" if off else ""
        raise UsageError(f"{name} {value} is out of range ({low:.0f}-{high:.0f} s{also})")
    return s


def _mode(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        mode = int(value, 8)
    except ValueError:
        raise UsageError(f"--mode {value!r} is not an octal mode like 0660") from None
    if not 0 <= mode <= 0o777:
        raise UsageError(f"--mode {value} is out of range (0000-0777)")
    return mode


def _nqn(name: str, value: str | None) -> str | None:
    if value is not None and (not value.startswith("nqn.") or len(value.encode()) > 223):
        raise UsageError(f"{name} {value!r} is not an NQN (nqn.YYYY-MM.domain:..., <= 223 bytes)")
    return value


def _hostid(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise UsageError(f"--hostid {value!r} is not a UUID") from None


def mount_flags(values: list[str]) -> set[str]:
    """The ``-o`` flags of ``mount`` (allow_other, fuse=SERVER), checked."""
    flags = {f.strip() for v in values for f in v.split(",") if f.strip()}
    for flag in flags:
        refuse_secret_option(flag, on_command_line=True)
    known = {"allow_other", "fuse", "path", "iopolicy", "workers", "max_namespaces"}
    unknown = {f.partition("=")[0] for f in flags} - known  # values unsaid
    if unknown:
        raise UsageError(f"unsupported -o option(s): {', '.join(sorted(unknown))} "
                         "(known: allow_other, fuse=SERVER, path=URI, iopolicy=POLICY, "
                         "workers=N|auto, max_namespaces=N)")
    return flags


def _flag_values(args: argparse.Namespace, key: str) -> list[str]:
    """The values of ``-o key=VALUE`` items, in the order given."""
    return [value for v in args.options for f in v.split(",")
            for k, _, value in [f.strip().partition("=")] if k == key]


def _one_value(args: argparse.Namespace, key: str, what: str) -> str | None:
    """The one value ``--KEY`` and ``-o KEY=`` name (None: neither); two different ones are
    refused as conflicting ``what``."""
    named = set(_flag_values(args, key))
    if getattr(args, key, None) is not None:
        named.add(getattr(args, key))
    if len(named) > 1:
        raise UsageError(f"conflicting {what}: {', '.join(sorted(named))}")
    return named.pop() if named else None


def mount_paths(args: argparse.Namespace) -> tuple[str, ...]:
    """The further paths of ``--path`` and ``-o path=``, checked (each an NVMe URI of a
    subsystem, without a namespace; none twice)."""
    from nvmeof_fuse.nvme.uri import parse_uri, split_path_keys

    uris = [*getattr(args, "paths", []), *_flag_values(args, "path")]
    seen = set()
    for uri in uris:
        where = parse_uri(split_path_keys(uri)[0])
        if where.nsid is not None:
            raise UsageError(f"path {uri} names a namespace (/{where.nsid}): a path is a "
                             "subsystem's address; --nsid picks the namespace")
        if uri in seen:
            raise UsageError(f"path {uri} is given twice")
        seen.add(uri)
    return tuple(uris)


def _iopolicy(args: argparse.Namespace) -> str:
    """``--iopolicy`` or ``-o iopolicy=`` (default queue-depth), checked."""
    from nvmeof_fuse.host.multipath.iopolicy import DEFAULT_POLICY, POLICIES

    policy = _one_value(args, "iopolicy", "iopolicies")
    if policy is None:
        policy = DEFAULT_POLICY
    if policy not in POLICIES:
        raise UsageError(f"unknown iopolicy {policy!r} (known: {', '.join(POLICIES)})")
    return policy


MAX_WORKERS = 256


def _workers(args: argparse.Namespace, fuse: str) -> dict[str, Any]:
    """``--workers N`` or ``-o workers=N``, checked, or ``auto`` (also when neither is
    given): chosen from the cores this process may use (:func:`auto_workers`; one where
    ``fuse`` serves one descriptor).  MountOptions' fields: the count and how it was
    chosen."""
    from nvmeof_fuse.fs.mount_options import AUTO_WORKERS, auto_workers, usable_cores

    named = _one_value(args, "workers", "worker counts")
    if named is not None and named != AUTO_WORKERS:
        return {"workers": _int("--workers", named, 1, MAX_WORKERS),
                "workers_chosen": "--workers"}
    if fuse != "builtin":
        return {"workers": 1, "workers_chosen": f"auto: --fuse {fuse} serves one descriptor"}
    cores = usable_cores()
    return {"workers": auto_workers(cores),
            "workers_chosen": f"auto: {cores} usable core{'s' if cores != 1 else ''}"}


def _max_namespaces(args: argparse.Namespace) -> int | None:
    """``--max-namespaces`` or ``-o max_namespaces=`` (None: the default), checked."""
    from nvmeof_fuse.host.connect_options import MAX_NSID

    named = _one_value(args, "max_namespaces", "namespace caps")
    return _int("--max-namespaces", named, 1, MAX_NSID)


def _fuse_server(args: argparse.Namespace) -> str:
    """The FUSE server named by ``--fuse`` or ``-o fuse=`` (default: builtin, ours)."""
    from nvmeof_fuse.fs.mount_options import FUSE_SERVERS

    items = (flag.partition("=") for flag in mount_flags(args.options))
    named = {value for key, _, value in items if key == "fuse"}
    if args.fuse is not None:
        named.add(args.fuse)
    if len(named) > 1:
        raise UsageError(f"conflicting FUSE servers: {', '.join(sorted(named))}")
    server = named.pop() if named else FUSE_SERVERS[0]
    if server not in FUSE_SERVERS:
        raise UsageError(f"unknown FUSE server {server!r} (known: {', '.join(FUSE_SERVERS)})")
    return server


def connect_options(args: argparse.Namespace, *, nqn: str, default_port: int) -> Any:
    """ConnectOptions from the parsed nvme-cli style options."""
    from nvmeof_fuse.host.connect_options import MAX_SHUTDOWN_TIMEOUT, ConnectOptions

    kwargs: dict[str, Any] = {
        "traddr": args.traddr,
        "nqn": _nqn("--nqn", nqn),
        "transport": args.transport or registry.DEFAULT,
        "trsvcid": _int("--trsvcid", args.trsvcid, 1, 65535) or default_port,
        "host_traddr": args.host_traddr,
        "host_iface": getattr(args, "host_iface", None),
        "hostnqn": _nqn("--hostnqn", args.hostnqn),
        "hostid": _hostid(args.hostid),
        "dhchap_secret": getattr(args, "dhchap_secret", None),  # discovery.conf has none
        "dhchap_ctrl_secret": getattr(args, "dhchap_ctrl_secret", None),
        "allow_insecure_secret_file": getattr(args, "allow_insecure_secret_file", False),
        "hdr_digest": args.hdr_digest,
        "data_digest": args.data_digest,
        "tls": getattr(args, "tls", False),
        "tls_key": getattr(args, "tls_key", None),
        "tls_compat": getattr(args, "tls_compat", False),
        "keyring": getattr(args, "keyring", None),
        "tls_key_identity": getattr(args, "tls_key_identity", None),
    }
    _from_config_json(args, kwargs)
    if args.command == "mount":
        kwargs["keep_alive_tmo"] = _seconds("--keep-alive-tmo", args.keep_alive_tmo)
        kwargs["reconnect_delay"] = _seconds("--reconnect-delay", args.reconnect_delay, low=1)
        kwargs["ctrl_loss_tmo"] = (-1.0 if args.ctrl_loss_tmo.strip() == "-1" else
                                   _seconds("--ctrl-loss-tmo", args.ctrl_loss_tmo,
                                            high=2**31, forever=True))
        kwargs["fast_io_fail_tmo"] = (-1.0 if args.fast_io_fail_tmo.strip() == "-1" else
                                      _seconds("--fast-io-fail-tmo", args.fast_io_fail_tmo,
                                               high=2**31, off=True))
        if args.shutdown_timeout is not None:
            kwargs["shutdown_timeout"] = _seconds("--shutdown-timeout", args.shutdown_timeout,
                                                  low=1, high=MAX_SHUTDOWN_TIMEOUT)
        kwargs["nr_io_queues"] = _int("--nr-io-queues", args.nr_io_queues, 1, 65535)
        companion_queues = _int("--companion-queues", args.companion_queues, 0, 65534)
        if companion_queues is not None:
            kwargs["companion_queues"] = companion_queues
        queue_size = _int("--queue-size", args.queue_size, 2, 65536)
        if queue_size is not None:
            kwargs["queue_size"] = queue_size
        max_namespaces = _max_namespaces(args)
        if max_namespaces is not None:
            kwargs["max_namespaces"] = max_namespaces
    opts = ConnectOptions(**kwargs)
    opts.validate()
    return opts


CONFIG_JSON_FIELDS = {"tls": "tls", "tls_key": "tls_key", "keyring": "keyring",
                      "tls_key_identity": "tls_key_identity", "dhchap_secret": "dhchap_key",
                      "dhchap_ctrl_secret": "dhchap_ctrl_key"}
"""ConnectOptions' fields that /etc/nvme/config.json may give, and its names for them."""


def _from_config_json(args: argparse.Namespace, kwargs: dict[str, Any]) -> None:
    """Fill in what config.json (``-J/--config``; ``none``: no file) holds for this port
    where the command line gave nothing, as ``nvme connect`` does."""
    from nvmeof_fuse.cli import nvmeconfig
    from nvmeof_fuse.host.hostid import host_identity

    path = getattr(args, "config", None)
    if path == "none" or kwargs["traddr"] is None:
        return
    port = nvmeconfig.Port(host_identity(kwargs["hostnqn"], kwargs["hostid"]).hostnqn,
                           kwargs["nqn"], kwargs["transport"], kwargs["traddr"],
                           kwargs["trsvcid"])
    found = nvmeconfig.load(path or nvmeconfig.CONFIG_JSON, port, required=path is not None,
                            allow_insecure=kwargs["allow_insecure_secret_file"])
    if found is None:
        return
    for name, theirs in CONFIG_JSON_FIELDS.items():
        value = getattr(found, theirs)
        if value is not None and not kwargs.get(name):
            kwargs[name] = value


def mount_options(args: argparse.Namespace) -> Any:
    from nvmeof_fuse.fs.mount_options import DEFAULT_MODE, MountOptions

    mode = _mode(args.mode)
    fuse = _fuse_server(args)
    return MountOptions(
        nsid=_int("--nsid", args.nsid, 1, 0xFFFFFFFE),
        source=getattr(args, "fsname", None),  # set by apply_source
        read_only=args.read_only,
        allow_other="allow_other" in mount_flags(args.options),
        uid=_int("--uid", args.uid, 0, 2**32 - 2),
        gid=_int("--gid", args.gid, 0, 2**32 - 2),
        mode=DEFAULT_MODE if mode is None else mode,
        debug=args.debug,
        fuse=fuse,
        paths=mount_paths(args),
        iopolicy=_iopolicy(args),
        **_workers(args, fuse),
    )


# --- arguments ------------------------------------------------------------------


def add_connection(p: argparse.ArgumentParser, *, port_help: str,
                   addr_required: bool = True) -> list[argparse.Action]:
    """The connection's arguments (nvme-cli's names), shared by mount, discover, mount-all."""
    return [
        p.add_argument("-t", "--transport", choices=list(registry.NAMES),
                       help=" or ".join(f"{name} (default)" if name == registry.DEFAULT
                                        else name for name in registry.NAMES)),
        p.add_argument("-a", "--traddr", required=addr_required, help="target address"),
        p.add_argument("-s", "--trsvcid", help=port_help),
        p.add_argument("-w", "--host-traddr", help="local address to connect from"),
        p.add_argument("--host-iface", metavar="DEVICE",
                       help="local device to connect through: NVMe/TCP binds to this netdev; "
                            "NVMe/RDMA refuses a route RDMA-CM binds to another RDMA device "
                            "(mlx5_3). A further path names its own: URI?host_iface=DEVICE"),
        p.add_argument("-g", "--hdr-digest", action="store_true",
                       help="NVMe/TCP header digests (CRC32C)"),
        p.add_argument("-G", "--data-digest", action="store_true",
                       help="NVMe/TCP data digests (CRC32C)"),
        p.add_argument("-q", "--hostnqn", help="host NQN (default: /etc/nvme/hostnqn)"),
        p.add_argument("-I", "--hostid", help="host UUID (default: /etc/nvme/hostid)"),
        p.add_argument("-S", "--dhchap-secret", metavar="SECRET|FILE",
                       help="DH-HMAC-CHAP host secret (DHHC-1:0N:...:), or better the path "
                            "of a file (mode 0600) holding it"),
        p.add_argument("-C", "--dhchap-ctrl-secret", metavar="SECRET|FILE",
                       help="DH-HMAC-CHAP controller secret, or its file: authenticate the "
                            "target too"),
        p.add_argument("--tls", action="store_true",
                       help="NVMe/TCP: TLS 1.3 with a PSK on every connection: --tls-key's, "
                            "or else the kernel keyring's for this host and subsystem, as "
                            "`nvme connect --tls` takes it"),
        p.add_argument("--tls-key", metavar="KEY|FILE",
                       help="NVMe/TCP: the TLS PSK as `nvme gen-tls-key` prints it "
                            "(NVMeTLSkey-1:hh:...:), or better the path of a file (mode 0600) "
                            "holding it; implies --tls"),
        p.add_argument("--tls-compat", action="store_true",
                       help="NVMe/TCP: derive --tls-key's PSK the older way, as nvme-cli "
                            "before 2.16 (libnvme before 1.16, Debian 13's 2.13) loads it "
                            "for a target (nvme-cli's compat derivation)"),
        p.add_argument("--keyring", metavar="NAME|SERIAL",
                       help="NVMe/TCP: the keyring --tls looks its PSK up in (default .nvme)"),
        p.add_argument("--tls-key-identity", metavar="IDENTITY",
                       help="NVMe/TCP: the PSK identity to offer: the keyring's key of that "
                            "name, or with --tls-key its version-1 identity; implies --tls"),
        p.add_argument("-J", "--config", metavar="FILE|none",
                       help="libnvme's JSON configuration, whose TLS and DH-HMAC-CHAP settings "
                            "for this port fill in what the command line does not give "
                            "(default /etc/nvme/config.json; none: no file)"),
        p.add_argument("--allow-insecure-secret-file", action="store_true",
                       help="read secret files that group or others may access (refused "
                            "otherwise, as ssh refuses such keys)"),
        p.add_argument("--debug", action="store_true", help="verbose logs and tracebacks"),
    ]


def parse_command_line(parser: argparse.ArgumentParser,
                       argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed; ``mount SOURCE [OPTIONS] MOUNTPOINT`` too (argparse leaves it over)."""
    args, extra = parser.parse_known_args(argv)
    if (len(extra) == 1 and args.command == "mount" and args.source is None
            and not extra[0].startswith("-")):
        args.source, args.mountpoint = args.mountpoint, extra[0]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


# --- errors as one line -------------------------------------------------------------


def leaf(exc: BaseException) -> BaseException:
    """The first interesting exception inside (nested) exception groups."""
    from nvmeof_fuse.concurrency import first_error

    while isinstance(exc, BaseExceptionGroup):
        exc = first_error(exc) or exc.exceptions[0]
    return exc


def one_line(exc: BaseException) -> str:
    """``exc`` as the one line an error message holds."""
    exc = leaf(exc)
    if isinstance(exc, NVMeoFError | UsageError):
        text = str(exc)
    elif isinstance(exc, OSError):
        text = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split()) or type(exc).__name__
