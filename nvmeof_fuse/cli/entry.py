"""The command line assembled: the parser of every command, and :func:`main`.

Errors are one line on stderr and exit status 1 (2 for usage errors caught by argparse);
``--debug`` adds tracebacks.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from nvmeof_fuse.cli import admin, discover, mount, paths, tlskeys
from nvmeof_fuse.cli.mounthelper import helper_argv
from nvmeof_fuse.cli.options import PROG, leaf, one_line, parse_command_line
from nvmeof_fuse.errors import NVMeoFError
from nvmeof_fuse.ratelimit import cap_lines

COMMANDS = ("mount", "discover", "list", "mount-all", "install-helper", "add-path",
            "remove-path", "gen-tls-key", "check-tls-key")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Mount NVMe-oF namespaces as files; discover; list mounts."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    mount.add_parser(sub)
    discover.add_parsers(sub)  # discover, list
    admin.add_parsers(sub)  # mount-all, install-helper
    paths.add_parsers(sub)  # add-path, remove-path
    tlskeys.add_parsers(sub)  # gen-tls-key, check-tls-key
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line; ``mount SOURCE [OPTIONS] MOUNTPOINT`` too (argparse leaves it over)."""
    return parse_command_line(build_parser(), argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        try:  # mount.fuse3's form: SOURCE DIR -o OPTS
            argv = helper_argv(argv)
        except NVMeoFError as exc:
            print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
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
    cap_lines()  # no line past 4 KiB, whatever it quotes
    try:
        if args.command == "mount":
            return mount.cmd_mount(args, argv)
        if args.command == "discover":
            return discover.cmd_discover(args)
        if args.command == "mount-all":
            return admin.cmd_mount_all(args)
        if args.command == "install-helper":
            return admin.cmd_install_helper(args)
        if args.command in ("add-path", "remove-path"):
            return paths.cmd_change_path(args)
        if args.command == "gen-tls-key":
            return tlskeys.cmd_gen_tls_key(args)
        if args.command == "check-tls-key":
            return tlskeys.cmd_check_tls_key(args)
        return discover.cmd_list(args)
    except BaseException as exc:
        inner = leaf(exc)
        if isinstance(inner, KeyboardInterrupt):
            return 130
        if debug or isinstance(inner, SystemExit):
            raise
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        return 1
