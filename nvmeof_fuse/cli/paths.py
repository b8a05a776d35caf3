"""``nvmeof-fuse add-path MOUNTPOINT URI`` and ``remove-path``: change a live mount's paths.

The request goes to the mount daemon over its companion socket (named in
``MOUNTPOINT/.nvmeof/companion.json``; only the mount's user and root may use it),
which connects and admits the path, or takes it out, and answers in one line.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
from typing import Any

from nvmeof_fuse.cli.options import PROG, UsageError

CHANGE_TIMEOUT = 120.0
"""s for the daemon to connect and admit a path (connect, Identify, the ANA log) or take
one out (its commands end first)."""


def add_parsers(sub: Any) -> None:
    """The ``add-path`` and ``remove-path`` commands, in the subcommands ``sub``."""
    for name, what in (("add-path", "connect a further path to a mounted subsystem"),
                       ("remove-path", "take a path out of a mount (its commands end first)")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--debug", action="store_true", help="tracebacks on errors")
        p.add_argument("mountpoint")
        p.add_argument("uri", help="nvme+rdma://HOST[:PORT]/SUBNQN or nvme+tcp://... "
                                   "(remove-path: or the path's index)")


def _socket_of(mountpoint: str) -> str:
    path = os.path.join(mountpoint, ".nvmeof", "companion.json")
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{mountpoint} is not an nvmeof-fuse mount (no {path})") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise UsageError(f"stale mount at {mountpoint}: its daemon is gone") from None
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}") from None
    socket = info.get("socket")
    if not socket:
        raise UsageError(f"the mount at {mountpoint} serves no control socket")
    return "\0" + socket[1:] if socket.startswith("@") else str(socket)  # abstract


def cmd_change_path(args: argparse.Namespace) -> int:
    from nvmeof_fuse.companion.client.channel import SocketChannel
    from nvmeof_fuse.nvme.uri import looks_like_uri, parse_uri

    op = "add_path" if args.command == "add-path" else "remove_path"
    if op == "add_path" or looks_like_uri(args.uri):
        parse_uri(args.uri)  # a bad URI is refused here, in one line
    channel = SocketChannel(_socket_of(args.mountpoint), CHANGE_TIMEOUT)
    try:
        reply = channel.call(op, uri=args.uri)
    finally:
        channel.close()
    verb = "added" if op == "add_path" else "removed"
    print(f"{PROG}: {args.mountpoint}: path {reply.get('index')} ({reply.get('uri')}) {verb}")
    return 0
