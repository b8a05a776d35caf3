"""``nvmeof-fuse mount``: its arguments, the foreground mount, and the ``--daemon`` that
detaches once mounted (inline secrets reach it over a pipe, never its argv)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from nvmeof_fuse.cli.mounthelper import apply_source, daemon_output
from nvmeof_fuse.cli.options import (
    PROG,
    UsageError,
    add_connection,
    connect_options,
    mount_flags,
    mount_options,
    one_line,
    parse_command_line,
)
from nvmeof_fuse.transport import registry

if TYPE_CHECKING:  # trio is imported where it runs: `mount --daemon` checks options without it
    import trio

DAEMON_READY_TIMEOUT = 120.0  # s the --daemon parent waits for the mount

log = logging.getLogger(PROG)


# --- arguments ---------------------------------------------------------------------


def add_mount_arguments(m: argparse.ArgumentParser) -> list[argparse.Action]:
    """``mount``'s arguments; the actions, from which :func:`daemon_command` rebuilds a line."""
    from nvmeof_fuse.fs.mount_options import AUTO_WORKERS, FEW_CORES, MAX_AUTO_WORKERS
    from nvmeof_fuse.host.connect_options import (
        DEFAULT_COMPANION_QUEUES,
        DEFAULT_MAX_NAMESPACES,
        QUEUES_PER_CLIENT,
    )
    from nvmeof_fuse.host.multipath.iopolicy import DEFAULT_POLICY as DEFAULT_IOPOLICY
    from nvmeof_fuse.host.multipath.iopolicy import POLICIES as IOPOLICIES

    actions = add_connection(m, port_help="transport service id (default 4420)",
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
        add("--shutdown-timeout",
            help="at unmount, wait this many s at least for the controller's orderly "
                 "shutdown (RTD3E may raise it to 10), then disconnect (5)"),
        add("--read-only", action="store_true", help="refuse writes (EROFS)"),
        add("--path", dest="paths", action="append", default=[], metavar="URI",
            help="a further path to the same subsystem (nvme+rdma:// or nvme+tcp://); "
                 "repeatable; -o path=URI"),
        add("--iopolicy", choices=list(IOPOLICIES),
            help=f"how I/O spreads over the paths (default {DEFAULT_IOPOLICY}); "
                 "-o iopolicy=..."),
        add("--workers", metavar="N|auto",
            help="processes serving READ and WRITE, each on queues of its own (builtin FUSE "
                 f"server only); default {AUTO_WORKERS}: 1 on up to {FEW_CORES} usable cores, "
                 f"else half of them, at most {MAX_AUTO_WORKERS}; -o workers=N|auto"),
        add("--max-namespaces", metavar="N",
            help=f"serve at most the first N active namespaces (default "
                 f"{DEFAULT_MAX_NAMESPACES}; the rest are refused in one line); "
                 "-o max_namespaces=N"),
        add("-o", dest="options", action="append", default=[],
            metavar="allow_other,fuse=SERVER,path=URI,iopolicy=POLICY,workers=N|auto,"
                    "max_namespaces=N"),
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


def add_parser(sub: Any) -> None:
    """The ``mount`` command, in the subcommands ``sub``."""
    m = sub.add_parser("mount", help="connect and mount the namespaces as files")
    add_mount_arguments(m)


def mount_parser() -> argparse.ArgumentParser:
    """A parser of ``mount ...`` command lines alone: they parse as with the whole CLI's."""
    parser = argparse.ArgumentParser(prog=PROG)
    add_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return parser


def parse_mount_args(argv: Sequence[str]) -> argparse.Namespace:
    """A ``mount ...`` command line, parsed as the whole CLI parses it."""
    return parse_command_line(mount_parser(), argv)


# --- the mount ------------------------------------------------------------------------


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
            skipped = await serve_mount(conn, mopts, mountpoint, on_ready, connect, stop)
            if skipped:  # the last line says what the target left undone
                log.warning("disconnected from %s (%s)", conn.nqn, skipped)
            else:
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
    fd = args.ready_fd  # set in the daemon: its parent waits for the outcome there
    try:
        if args.secrets_fd is not None:
            receive_secrets(args, args.secrets_fd)
        apply_source(args)
        conn = connect_options(args, nqn=args.nqn, default_port=registry.IO_PORT)
        mopts = mount_options(args)
        if args.daemon:
            cmd, secrets = daemon_command(argv)
            return spawn_daemon(cmd, args.log_file, secrets=secrets)
        import trio

        trio.run(run_mount, conn, mopts, args.mountpoint, lambda: _report(fd, "ready"))
    except BaseException as exc:
        _report(fd, "error: " + one_line(exc))
        raise
    return 0


# --- the daemon ---------------------------------------------------------------------------

SECRET_OPTIONS = ("dhchap_secret", "dhchap_ctrl_secret", "tls_key")
"""Options that may hold a secret: inline, it goes to the daemon over a pipe, never in its
argv (tests/cli/test_mount.py checks the names)."""
NOT_FORWARDED = ("daemon", "ready_fd", "secrets_fd")


def daemon_command(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The daemon's command line (this mount in foreground form) and the inline secrets to
    hand it over a pipe (:func:`spawn_daemon`).

    The line is rebuilt from the parsed options, whatever form they took (``-SVALUE``,
    ``--opt=value``, a prefix of an option's name, ``-gS``): it names a secret only by its
    file, made absolute as the daemon runs in / and reads it again at each reconnect.
    """
    from nvmeof_fuse.host.auth import is_inline

    args = parse_mount_args(argv)  # as given: before apply_source filled it in
    line, secrets = ["mount"], {}
    for action in add_mount_arguments(argparse.ArgumentParser(add_help=False)):
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
            line += [a for f in sorted(mount_flags(value)) for a in ("-o", f)]
        elif dest == "paths":
            line += [f"{flag}={uri}" for uri in value]
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
        status = read_line(rfd, timeout)
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


def read_line(fd: int, timeout: float) -> str | None:
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
