"""Mounting the way admins do: fstab lines, ``mount -t fuse.nvmeof-fuse``, NVMe URIs, systemd.

``mount -t fuse.nvmeof-fuse SOURCE DIR -o OPTS`` (and an fstab line of that type)
runs ``/sbin/mount.fuse`` (fuse3's mount.fuse3), which runs ``nvmeof-fuse SOURCE DIR
-o OPTS,dev,suid`` through ``/bin/sh`` with the caller's PATH.  :func:`helper_argv`
turns that into a ``nvmeof-fuse mount ... --daemon`` command line: every ``mount``
option is also an ``-o`` key (``ctrl_loss_tmo=600,nr_io_queues=4,read_only``), the
keys of mount(8) and systemd are accepted and ignored, any other key is refused
by name.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from typing import IO

from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.nvme.uri import FORM, looks_like_uri, parse_uri
from nvmeof_fuse.transport import registry

PROGRAM = "nvmeof-fuse"
FSTYPE = "fuse.nvmeof-fuse"
HELPER_USAGE = f"{PROGRAM} SOURCE MOUNTPOINT [-o KEY[=VALUE],...] (what mount.fuse3 runs)"
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MOUNT_FUSE = ("/sbin/mount.fuse", "/usr/sbin/mount.fuse")

# -o key -> (the `mount` option it stands for, whether it takes a value).  Keys are
# the kernel's fabrics option names (as in /dev/nvme-fabrics) where there is one.
KEYS: dict[str, tuple[str, bool]] = {
    "transport": ("--transport", True),
    "traddr": ("--traddr", True),
    "trsvcid": ("--trsvcid", True),
    "host_traddr": ("--host-traddr", True),
    "host_iface": ("--host-iface", True),
    "hostnqn": ("--hostnqn", True),
    "hostid": ("--hostid", True),
    "dhchap_secret_file": ("--dhchap-secret", True),  # the path of a file: see SECRET_KEYS
    "dhchap_ctrl_secret_file": ("--dhchap-ctrl-secret", True),
    "allow_insecure_secret_file": ("--allow-insecure-secret-file", False),
    "tls": ("--tls", False),
    "tls_key_file": ("--tls-key", True),  # the path of a file: see SECRET_KEYS
    "tls_compat": ("--tls-compat", False),
    "keyring": ("--keyring", True),
    "config": ("--config", True),
    "tls_key_identity": ("--tls-key-identity", True),
    "nqn": ("--nqn", True),
    "nsid": ("--nsid", True),
    "namespace_id": ("--nsid", True),
    "nr_io_queues": ("--nr-io-queues", True),
    "companion_queues": ("--companion-queues", True),
    "queue_size": ("--queue-size", True),
    "keep_alive_tmo": ("--keep-alive-tmo", True),
    "reconnect_delay": ("--reconnect-delay", True),
    "ctrl_loss_tmo": ("--ctrl-loss-tmo", True),
    "fast_io_fail_tmo": ("--fast-io-fail-tmo", True),
    "shutdown_timeout": ("--shutdown-timeout", True),
    "hdr_digest": ("--hdr-digest", False),
    "data_digest": ("--data-digest", False),
    "read_only": ("--read-only", False),
    "ro": ("--read-only", False),
    "allow_other": ("-o allow_other", False),
    "fuse": ("--fuse", True),
    "path": ("--path", True),  # repeatable: a further path to the subsystem (multipath)
    "iopolicy": ("--iopolicy", True),
    "workers": ("--workers", True),
    "max_namespaces": ("--max-namespaces", True),
    "uid": ("--uid", True),
    "gid": ("--gid", True),
    "mode": ("--mode", True),
    "log_file": ("--log-file", True),
    "debug": ("--debug", False),
}
# Options of mount(8), the VFS and systemd: meaningful to them, not to us.
IGNORED = frozenset(
    "defaults rw auto noauto user nouser users owner group _netdev nofail dev nodev suid "
    "nosuid exec noexec atime noatime relatime norelatime strictatime nostrictatime "
    "diratime nodiratime lazytime nolazytime sync async dirsync silent loud iversion "
    "noiversion mand nomand default_permissions".split()
)
IGNORED_PREFIXES = ("x-", "comment=")
# Secrets are accepted only as files: mount options show in /etc/fstab and in the process
# list while mounting, both readable by every user.  Inline key -> the file key to write.
SECRET_KEYS = {"dhchap_secret": "dhchap_secret_file",
               "dhchap_ctrl_secret": "dhchap_ctrl_secret_file", "tls_key": "tls_key_file"}
FILE_OPTIONS = {"dhchap_secret": "--dhchap-secret", "dhchap_ctrl_secret": "--dhchap-ctrl-secret",
                "tls_key": "--tls-key"}
SILENT_FLAGS = ("-n", "-v", "-s")  # no-mtab, verbose, sloppy: what mount(8) may add


def refuse_secret_option(item: str, on_command_line: bool = False) -> None:
    """Refuse an ``-o`` item that holds a secret, saying why and what to write instead.

    ``on_command_line``: ``nvmeof-fuse mount -o`` rather than fstab or ``mount -o``.
    The message never holds the value.
    """
    key, _, value = item.partition("=")
    key = key.strip().replace("-", "_")
    if key in SECRET_KEYS:
        what, file_key = "is refused", SECRET_KEYS[key]
    elif key in SECRET_KEYS.values() and ":" in value:  # DHHC-1:...: the secret itself
        what, file_key = "names a file, not the secret itself", key
    else:
        return
    instead = (f"{FILE_OPTIONS[file_key.removesuffix('_file')]} FILE" if on_command_line
               else f"{file_key}=FILE")
    raise InvalidArgument(
        f"mount option {key}= {what}: mount options are readable by every user (in "
        "/etc/fstab and the process list); put the secret in a file only its owner can read "
        f"(chmod 600) and write {instead} instead")


def key_to_args(item: str) -> list[str]:
    """``mount`` arguments for one ``-o`` item (``[]`` for an ignored one)."""
    key, eq, value = item.partition("=")
    key = key.strip().replace("-", "_")
    if not key or key in IGNORED or item.startswith(IGNORED_PREFIXES):
        return []
    refuse_secret_option(item)
    if key not in KEYS:
        raise InvalidArgument(f"unknown mount option {key!r} (known: {', '.join(sorted(KEYS))};"
                              " mount(8) and x-systemd.* options are ignored)")
    flag, takes_value = KEYS[key]
    if takes_value and not eq:
        raise InvalidArgument(f"mount option {key!r} needs a value ({key}=...)")
    if not takes_value and eq:
        raise InvalidArgument(f"mount option {key!r} takes no value (got {item!r})")
    return [*flag.split(), *([value] if takes_value else [])]


def helper_argv(argv: Sequence[str]) -> list[str]:
    """``SOURCE MOUNTPOINT -o OPTS`` (mount.fuse3's form) as a ``mount ... --daemon`` argv."""
    positional: list[str] = []
    items: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "-o":
            value = next(args, None)
            if value is None:
                raise InvalidArgument(f"-o needs a value; usage: {HELPER_USAGE}")
            items += value.split(",")
        elif arg.startswith("-o"):
            items += arg[2:].split(",")
        elif arg == "-t":
            next(args, None)  # the type mount(8) already matched
        elif arg in SILENT_FLAGS:
            continue
        elif arg.startswith("-"):
            raise InvalidArgument(f"unknown argument {arg!r}; usage: {HELPER_USAGE}")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise InvalidArgument(f"give a source and a mountpoint; usage: {HELPER_USAGE}")
    options = [a for item in items if item.strip() for a in key_to_args(item)]
    source, mountpoint = positional
    return ["mount", *options, "--daemon", source, os.path.abspath(mountpoint)]


def apply_source(args: argparse.Namespace) -> None:
    """Fill ``args`` (transport, traddr, trsvcid, nqn, nsid, fsname) from the mount's source.

    The source is an NVMe URI, or with ``-a`` and ``-n`` any label shown as the
    mount's source in /proc/self/mountinfo (as sshfs' fsname).
    """
    source = args.source
    if source is not None and looks_like_uri(source):
        uri = parse_uri(source)
        given = [f"-{o}" for o, v in (("t", args.transport), ("a", args.traddr),
                                       ("s", args.trsvcid), ("n", args.nqn)) if v is not None]
        if given:
            raise InvalidArgument(f"the URI {source} already names the target; drop "
                                  f"{', '.join(given)}")
        args.transport, args.traddr, args.nqn = uri.transport, uri.traddr, uri.subnqn
        args.trsvcid = None if uri.trsvcid is None else str(uri.trsvcid)
        if uri.nsid is not None:
            if args.nsid is not None and args.nsid.strip() != str(uri.nsid):
                raise InvalidArgument(f"--nsid {args.nsid} contradicts the URI's /{uri.nsid}")
            args.nsid = str(uri.nsid)
    elif args.traddr is None or args.nqn is None:
        what = f"{source!r} is not an NVMe URI" if source is not None else "no target given"
        raise InvalidArgument(f"{what}: give {FORM}, or -a ADDRESS -n NQN")
    args.transport = args.transport or registry.DEFAULT
    args.fsname = source


def under_systemd(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether systemd runs us (a unit's INVOCATION_ID, or stderr is the journal)."""
    return bool(environ.get("INVOCATION_ID") or environ.get("JOURNAL_STREAM"))


@contextlib.contextmanager
def daemon_output(log_file: str | None) -> Iterator[IO[bytes] | None]:
    """Where a detached daemon's stdout/stderr go: the log file if given; else the journal
    (inherited) when systemd runs us; else nowhere."""
    if log_file is None and under_systemd():
        yield None
        return
    with open(log_file or os.devnull, "ab") as out:
        yield out


def install_helper(bindir: str = "/usr/local/sbin", program: str | None = None,
                   mount_fuse: Sequence[str] = MOUNT_FUSE) -> str:
    """Make ``mount -t fuse.nvmeof-fuse`` (and systemd) find this program; what was done.

    mount(8) runs fuse3's ``/sbin/mount.fuse`` for ``fuse.*`` types, which runs
    ``nvmeof-fuse`` from PATH; under systemd PATH is the default one, where a
    virtualenv's ``bin`` is not.  A link in ``bindir`` fixes that.
    """
    if not any(os.path.exists(p) for p in mount_fuse):
        raise InvalidArgument(f"{mount_fuse[0]} not found: install fuse3 (it has mount.fuse3)")
    program = os.path.realpath(program or shutil.which(PROGRAM) or "")
    if not os.path.isfile(program):
        raise InvalidArgument(f"cannot find the {PROGRAM} program to link to")
    found = shutil.which(PROGRAM, path=bindir + os.pathsep + SYSTEMD_PATH)
    if found and os.path.realpath(found) == program:
        return f"{found} is already on the default PATH: nothing to do"
    link = os.path.join(bindir, PROGRAM)
    if os.path.lexists(link):
        if not os.path.islink(link):
            raise InvalidArgument(f"{link} exists and is not a link; remove it first")
        os.unlink(link)
    os.makedirs(bindir, exist_ok=True)
    os.symlink(program, link)
    return f"linked {link} -> {program}"
