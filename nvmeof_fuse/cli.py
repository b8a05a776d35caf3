"""``nvmeof-fuse``: mount an NVMe-oF controller's namespaces as files, discover, list.

Option names follow nvme-cli. Errors are one line on stderr and exit status 1
(2 for usage errors caught by argparse); ``--debug`` adds tracebacks.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from nvmeof_fuse.errors import NVMeoFError

if TYPE_CHECKING:  # trio is imported where it runs: `mount --daemon` checks options without it
    import trio

PROG = "nvmeof-fuse"
DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
DAEMON_READY_TIMEOUT = 120.0  # s the --daemon parent waits for the mount
LIST_TIMEOUT = 10.0  # s for reading a mount's .nvmeof files

log = logging.getLogger(PROG)


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


def _mount_flags(values: list[str]) -> set[str]:
    from nvmeof_fuse.mounthelper import refuse_secret_option

    flags = {f.strip() for v in values for f in v.split(",") if f.strip()}
    for flag in flags:
        refuse_secret_option(flag, on_command_line=True)
    unknown = {f.partition("=")[0] for f in flags} - {"allow_other", "fuse"}  # values unsaid
    if unknown:
        raise UsageError(f"unsupported -o option(s): {', '.join(sorted(unknown))} "
                         "(known: allow_other, fuse=SERVER)")
    return flags


def _fuse_server(args: argparse.Namespace) -> str:
    """The FUSE server named by ``--fuse`` or ``-o fuse=`` (default: builtin, ours)."""
    from nvmeof_fuse.fs.options import FUSE_SERVERS

    items = (flag.partition("=") for flag in _mount_flags(args.options))
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
    from nvmeof_fuse.host.options import ConnectOptions

    kwargs: dict[str, Any] = {
        "traddr": args.traddr,
        "nqn": _nqn("--nqn", nqn),
        "transport": args.transport or "rdma",
        "trsvcid": _int("--trsvcid", args.trsvcid, 1, 65535) or default_port,
        "host_traddr": args.host_traddr,
        "hostnqn": _nqn("--hostnqn", args.hostnqn),
        "hostid": _hostid(args.hostid),
        "dhchap_secret": getattr(args, "dhchap_secret", None),  # discovery.conf has none
        "dhchap_ctrl_secret": getattr(args, "dhchap_ctrl_secret", None),
        "allow_insecure_secret_file": getattr(args, "allow_insecure_secret_file", False),
        "hdr_digest": args.hdr_digest,
        "data_digest": args.data_digest,
    }
    if args.command == "mount":
        kwargs["keep_alive_tmo"] = _seconds("--keep-alive-tmo", args.keep_alive_tmo)
        kwargs["reconnect_delay"] = _seconds("--reconnect-delay", args.reconnect_delay, low=1)
        kwargs["ctrl_loss_tmo"] = (-1.0 if args.ctrl_loss_tmo.strip() == "-1" else
                                   _seconds("--ctrl-loss-tmo", args.ctrl_loss_tmo,
                                            high=2**31, forever=True))
        kwargs["fast_io_fail_tmo"] = (-1.0 if args.fast_io_fail_tmo.strip() == "-1" else
                                      _seconds("--fast-io-fail-tmo", args.fast_io_fail_tmo,
                                               high=2**31, off=True))
        kwargs["nr_io_queues"] = _int("--nr-io-queues", args.nr_io_queues, 1, 65535)
        companion_queues = _int("--companion-queues", args.companion_queues, 0, 65534)
        if companion_queues is not None:
            kwargs["companion_queues"] = companion_queues
        queue_size = _int("--queue-size", args.queue_size, 2, 65536)
        if queue_size is not None:
            kwargs["queue_size"] = queue_size
    opts = ConnectOptions(**kwargs)
    opts.validate()
    return opts


def mount_options(args: argparse.Namespace) -> Any:
    from nvmeof_fuse.fs.options import DEFAULT_MODE, MountOptions

    mode = _mode(args.mode)
    return MountOptions(
        nsid=_int("--nsid", args.nsid, 1, 0xFFFFFFFE),
        source=getattr(args, "fsname", None),  # set by apply_source
        read_only=args.read_only,
        allow_other="allow_other" in _mount_flags(args.options),
        uid=_int("--uid", args.uid, 0, 2**32 - 2),
        gid=_int("--gid", args.gid, 0, 2**32 - 2),
        mode=DEFAULT_MODE if mode is None else mode,
        debug=args.debug,
        fuse=_fuse_server(args),
    )


# --- argument parser ------------------------------------------------------------


def _add_connection(p: argparse.ArgumentParser, *, port_help: str,
                    addr_required: bool = True) -> list[argparse.Action]:
    return [
        p.add_argument("-t", "--transport", choices=["rdma", "tcp"],
                       help="rdma (default) or tcp"),
        p.add_argument("-a", "--traddr", required=addr_required, help="target address"),
        p.add_argument("-s", "--trsvcid", help=port_help),
        p.add_argument("-w", "--host-traddr", help="local address to connect from"),
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
        p.add_argument("--allow-insecure-secret-file", action="store_true",
                       help="read secret files that group or others may access (refused "
                            "otherwise, as ssh refuses such keys)"),
        p.add_argument("--debug", action="store_true", help="verbose logs and tracebacks"),
    ]


def _add_mount_arguments(m: argparse.ArgumentParser) -> list[argparse.Action]:
    """``mount``'s arguments; the actions, from which :func:`daemon_command` rebuilds a line."""
    from nvmeof_fuse.host.options import DEFAULT_COMPANION_QUEUES, QUEUES_PER_CLIENT

    actions = _add_connection(m, port_help="transport service id (default 4420)",
                              addr_required=False)
    add = m.add_argument
    actions += [
        add("-n", "--nqn", help="subsystem NQN"),
        add("--nsid", "--namespace-id", help="mount only this namespace"),
        add("-i", "--nr-io-queues", help="number of I/O queues"),
        add("--companion-queues",
            help="more I/O queue IDs to lease to companion clients, which connect them "
                 f"themselves (default {DEFAULT_COMPANION_QUEUES}, "
                 f"{QUEUES_PER_CLIENT} per client; 0: off)"),
        add("-Q", "--queue-size", help="I/O queue size (default 128)"),
        add("-k", "--keep-alive-tmo", default="5", help="keep-alive timeout, s (5)"),
        add("-c", "--reconnect-delay", default="10",
            help="after losing the connection, reconnect every this many s (10)"),
        add("-l", "--ctrl-loss-tmo", default="600",
            help="keep reconnecting this many s before I/O fails; -1: for ever (600)"),
        add("-f", "--fast-io-fail-tmo", "--fast_io_fail_tmo", default="-1",
            help="fail I/O this many s after a loss while reconnecting goes on (-1: off)"),
        add("--read-only", action="store_true", help="refuse writes (EROFS)"),
        add("-o", dest="options", action="append", default=[],
            metavar="allow_other,fuse=SERVER"),
        add("--fuse", metavar="SERVER",
            help="what serves FUSE: builtin (default; our own /dev/fuse session) or pyfuse3 "
                 "(pip install 'nvmeof-fuse[pyfuse3]')"),
        add("--uid", help="owner of the namespace files (default: you)"),
        add("--gid", help="group of the namespace files (default: yours)"),
        add("--mode", help="octal mode of the namespace files (default 0660)"),
        add("--daemon", action="store_true", help="detach once mounted"),
        add("--log-file", help="with --daemon: where its logs go (default: none)"),
        add("--ready-fd", type=int, help=argparse.SUPPRESS),
        add("--secrets-fd", type=int, help=argparse.SUPPRESS),  # inline secrets, from the parent
        add("source", nargs="?",
            help="nvme+rdma://HOST[:PORT]/SUBNQN[/NSID] (or nvme+tcp://), instead of -a/-n"),
        add("mountpoint"),
    ]
    return actions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Mount NVMe-oF namespaces as files; discover; list mounts."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser("mount", help="connect and mount the namespaces as files")
    _add_mount_arguments(m)

    d = sub.add_parser("discover", help="print a discovery controller's log page")
    _add_connection(d, port_help="transport service id (default 8009 tcp, 4420 rdma)")
    d.add_argument("-o", "--output-format", choices=["normal", "json"], default="normal")

    ls = sub.add_parser("list", help="show the controller mounted at MOUNTPOINT (default: all)")
    ls.add_argument("-o", "--output-format", choices=["normal", "json"], default="normal")
    ls.add_argument("--debug", action="store_true", help="tracebacks on errors")
    ls.add_argument("mountpoint", nargs="?")

    from nvmeof_fuse import admin  # mount-all, install-helper

    admin.add_parsers(sub, _add_connection)
    return parser


# --- mount ------------------------------------------------------------------------


async def _stop_on_signal(signals: Any, stop: trio.Event, ready: trio.Event,
                          scope: trio.CancelScope) -> None:
    """First signal: unmount in order.  Before the mount is up, or a second time: abandon."""
    async for signum in signals:
        name = signal.Signals(signum).name
        if ready.is_set() and not stop.is_set():
            log.info("%s: unmounting", name)
            stop.set()
        else:
            log.info("%s: giving up", name)
            scope.cancel()


async def run_mount(
    conn: Any, mopts: Any, mountpoint: str, ready: Callable[[], None], connect: Any = None
) -> None:
    """Serve the mount (see :func:`nvmeof_fuse.daemon.serve_mount`) until SIGINT/SIGTERM."""
    import trio

    from nvmeof_fuse.daemon import serve_mount

    stop, mounted = trio.Event(), trio.Event()

    def on_ready(_ctrl: Any, _server: Any) -> None:
        mounted.set()
        ready()

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, signals, stop, mounted, nursery.cancel_scope)
            await serve_mount(conn, mopts, mountpoint, on_ready, connect, stop)
            log.info("disconnected from %s", conn.nqn)
            nursery.cancel_scope.cancel()


def _report(fd: int | None, message: str) -> None:
    """Tell a waiting --daemon parent how the mount went (once)."""
    if fd is None:
        return
    try:
        os.write(fd, message.encode() + b"\n")
        os.close(fd)
    except OSError:
        pass


def cmd_mount(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from nvmeof_fuse.mounthelper import apply_source

    fd = args.ready_fd  # set in the daemon: its parent waits for the outcome there
    try:
        if args.secrets_fd is not None:
            receive_secrets(args, args.secrets_fd)
        apply_source(args)
        conn = connect_options(args, nqn=args.nqn, default_port=4420)
        mopts = mount_options(args)
        if args.daemon:
            cmd, secrets = daemon_command(argv)
            return spawn_daemon(cmd, args.log_file, secrets=secrets)
        import trio

        trio.run(run_mount, conn, mopts, args.mountpoint, lambda: _report(fd, "ready"))
    except BaseException as exc:
        _report(fd, "error: " + _one_line(exc))
        raise
    return 0


SECRET_OPTIONS = ("dhchap_secret", "dhchap_ctrl_secret")
"""Options that may hold a secret: inline, it goes to the daemon over a pipe, never in its
argv (a TLS PSK, once added, belongs here too; tests/test_cli.py checks the names)."""
NOT_FORWARDED = ("daemon", "ready_fd", "secrets_fd")


def daemon_command(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The daemon's command line (this mount in foreground form) and the inline secrets to
    hand it over a pipe (:func:`spawn_daemon`).

    The line is rebuilt from the parsed options, whatever form they took (``-SVALUE``,
    ``--opt=value``, a prefix of an option's name, ``-gS``): it names a secret only by its
    file, made absolute as the daemon runs in / and reads it again at each reconnect.
    """
    from nvmeof_fuse.host.auth import is_inline

    args = parse_args(argv)  # as given: before apply_source filled it in
    line, secrets = ["mount"], {}
    for action in _add_mount_arguments(argparse.ArgumentParser(add_help=False)):
        dest, value = action.dest, getattr(args, action.dest)
        if not action.option_strings or dest in NOT_FORWARDED or value is None:
            continue
        flag = next((o for o in action.option_strings if o.startswith("--")),
                    action.option_strings[0])
        if dest in SECRET_OPTIONS:
            if is_inline(value):
                secrets[dest] = value
            else:
                line.append(f"{flag}={os.path.abspath(value)}")
        elif dest == "options":
            line += [a for f in sorted(_mount_flags(value)) for a in ("-o", f)]
        elif action.nargs == 0:  # a flag
            if value:
                line.append(flag)
        elif dest == "log_file":
            line.append(f"{flag}={os.path.abspath(value)}")
        elif value != action.default:
            line.append(f"{flag}={value}")
    if args.source is not None:
        line.append(args.source)
    line.append(os.path.abspath(args.mountpoint))
    return [sys.executable, "-m", "nvmeof_fuse.cli", *line], secrets


SECRETS_TIMEOUT = 10.0  # s the daemon waits for its secrets (written before it started)
SECRETS_MAX = 16384  # bytes: far below a pipe's capacity, so the parent never blocks


def secrets_pipe(secrets: dict[str, str]) -> int:
    """A pipe's read end that holds ``secrets`` (as JSON) and then EOF, for a child."""
    payload = json.dumps(secrets).encode()
    if len(payload) > SECRETS_MAX:
        raise UsageError(f"the secrets are too long ({len(payload)} bytes)")
    rfd, wfd = os.pipe()
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(wfd, view):]
    except BaseException:
        os.close(rfd)
        raise
    finally:
        os.close(wfd)
    return rfd


def receive_secrets(args: argparse.Namespace, fd: int) -> None:
    """Take the inline secrets a --daemon parent handed over descriptor ``fd`` into ``args``."""
    try:
        data = b""
        deadline = time.monotonic() + SECRETS_TIMEOUT
        while len(data) <= SECRETS_MAX:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise UsageError(f"--secrets-fd {fd}: no secrets within {SECRETS_TIMEOUT:g} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
        os.close(fd)
    except OSError as exc:
        raise UsageError(f"--secrets-fd {fd}: {exc.strerror}") from None
    try:
        secrets = json.loads(data)
        assert isinstance(secrets, dict)
    except (ValueError, AssertionError):
        raise UsageError(f"--secrets-fd {fd} does not hold the secrets of a --daemon "
                         "parent") from None
    for name in SECRET_OPTIONS:
        if isinstance(secrets.get(name), str):
            setattr(args, name, secrets[name])


def spawn_daemon(
    cmd: list[str], log_file: str | None, timeout: float = DAEMON_READY_TIMEOUT,
    secrets: dict[str, str] | None = None,
) -> int:
    """Run ``cmd --ready-fd N`` detached; 0 once it reports ready, else raise its error.

    ``secrets`` (inline ones) go over a pipe of their own (``--secrets-fd``), never in
    the daemon's arguments or environment.
    """
    from nvmeof_fuse.mounthelper import daemon_output

    rfd, wfd = os.pipe()
    fds, extra = [wfd], []  # the child's ends: closed here once it has them
    try:
        if secrets:
            fds.append(secrets_pipe(secrets))
            extra = ["--secrets-fd", str(fds[-1])]
        with daemon_output(log_file) as out:
            proc = subprocess.Popen(
                [*cmd, *extra, "--ready-fd", str(wfd)],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                cwd="/",
            )
    except BaseException:
        os.close(rfd)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    try:
        status = _read_line(rfd, timeout)
    finally:
        os.close(rfd)
    if status == "ready":
        return 0
    if status is None:
        proc.terminate()
        raise UsageError(
            f"the daemon did not report the mount ready within {timeout:g} s; stopped it"
        )
    if status.startswith("error: "):
        raise UsageError(status.removeprefix("error: "))
    try:
        rc = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        rc = None
    where = f"; see {log_file}" if log_file else "; run without --daemon to see why"
    raise UsageError(f"the daemon exited (status {rc}) before the mount was ready{where}")


def _read_line(fd: int, timeout: float) -> str | None:
    """The first line written to ``fd``; "" at EOF, None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").split("\n")[0]


# --- discover and list --------------------------------------------------------------


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


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

    port = 8009 if args.transport == "tcp" else 4420
    conn = connect_options(args, nqn=DISCOVERY_NQN, default_port=port)
    page = trio.run(discover, conn)
    if args.output_format == "json":
        print(json.dumps(page.to_dict(), indent=2))
    else:
        print(format_discovery(page))
    return 0


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


async def _read_mount_info(mountpoint: str) -> dict[str, Any]:
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
    rows = [["Node", "NSID", "Size (bytes)", "LBA size", "LBAs"]]
    for ns in doc.get("namespaces", []):
        node = os.path.join(mountpoint, f"n{ns['nsid']}")
        rows.append([node, str(ns["nsid"]), str(ns["size"]), str(ns["lba_size"]), str(ns["nlb"])])
    return "\n".join(lines) + "\n" + _table(rows)


def cmd_list(args: argparse.Namespace) -> int:
    import trio

    doc = trio.run(_read_mount_info, args.mountpoint)
    if args.output_format == "json":
        print(json.dumps({"mountpoint": os.path.abspath(args.mountpoint), **doc}, indent=2))
    else:
        print(format_list(args.mountpoint, doc))
    return 0


# --- entry point -----------------------------------------------------------------------


def _leaf(exc: BaseException) -> BaseException:
    """The first interesting exception inside (nested) exception groups."""
    from nvmeof_fuse.concurrency import first_error

    while isinstance(exc, BaseExceptionGroup):
        exc = first_error(exc) or exc.exceptions[0]
    return exc


def _one_line(exc: BaseException) -> str:
    exc = _leaf(exc)
    if isinstance(exc, NVMeoFError | UsageError):
        text = str(exc)
    elif isinstance(exc, OSError):
        text = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split()) or type(exc).__name__


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line; ``mount SOURCE [OPTIONS] MOUNTPOINT`` too (argparse leaves it over)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if (len(extra) == 1 and args.command == "mount" and args.source is None
            and not extra[0].startswith("-")):
        args.source, args.mountpoint = args.mountpoint, extra[0]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


COMMANDS = ("mount", "discover", "list", "mount-all", "install-helper")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        from nvmeof_fuse.mounthelper import helper_argv  # mount.fuse3: SOURCE DIR -o OPTS

        try:
            argv = helper_argv(argv)
        except NVMeoFError as exc:
            print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
            return 1
    args = parse_args(argv)
    debug = getattr(args, "debug", False)
    logging.basicConfig(
        level=logging.DEBUG
        if debug
        else logging.INFO
        if args.command == "mount"
        else logging.WARNING,
        format=f"{PROG}: %(message)s"
        if not debug
        else f"{PROG}: %(name)s: %(levelname)s: %(message)s",
    )
    try:
        if args.command == "mount":
            return cmd_mount(args, argv)
        if args.command == "discover":
            return cmd_discover(args)
        from nvmeof_fuse import admin

        if args.command == "mount-all":
            return admin.cmd_mount_all(args)
        if args.command == "install-helper":
            return admin.cmd_install_helper(args)
        if args.mountpoint is None:
            return admin.cmd_list_all(args)
        return cmd_list(args)
    except BaseException as exc:
        leaf = _leaf(exc)
        if isinstance(leaf, KeyboardInterrupt):
            return 130
        if debug or isinstance(leaf, SystemExit):
            raise
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
