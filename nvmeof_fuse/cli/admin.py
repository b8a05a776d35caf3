"""The admin commands: ``mount-all`` (connect-all with a mount per subsystem) and
``install-helper`` (for mount(8), fstab and systemd)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
from collections.abc import Callable
from typing import Any

from nvmeof_fuse.cli import mountall
from nvmeof_fuse.cli.mount import daemon_command, mount_parser, spawn_daemon
from nvmeof_fuse.cli.mountall import DISCOVERY_CONF, DiscoveryTarget, Outcome
from nvmeof_fuse.cli.mounthelper import install_helper, key_to_args
from nvmeof_fuse.cli.options import (
    DISCOVERY_NQN,
    UsageError,
    add_connection,
    connect_options,
    mount_options,
    one_line,
)
from nvmeof_fuse.errors import InvalidArgument, NVMeoFError
from nvmeof_fuse.transport import registry

MAX_PARALLEL_MOUNTS = 4


def add_parsers(sub: Any) -> None:
    """The ``mount-all`` and ``install-helper`` commands, in the subcommands ``sub``."""
    ma = sub.add_parser("mount-all", help="mount every subsystem a discovery controller lists "
                        "at ROOT/<subnqn> (connect-all)")
    add_connection(ma, port_help="discovery service id (default 8009 tcp, 4420 rdma)",
                   addr_required=False)
    ma.add_argument("-O", "--mount-options", action="append", default=[],
                    metavar="KEY[=VALUE],...",
                    help="options for every mount, as in fstab (ctrl_loss_tmo=-1,read_only)")
    ma.add_argument("-o", "--output-format", choices=["normal", "json"], default="normal")
    ma.add_argument("--discovery-conf", default=DISCOVERY_CONF,
                    help=f"with no -a: the discovery controllers (default {DISCOVERY_CONF})")
    ma.add_argument("root", help="directory under which each subsystem gets <subnqn>/")

    ih = sub.add_parser("install-helper", help="let mount(8), fstab and systemd find nvmeof-fuse")
    ih.add_argument("--bindir", default="/usr/local/sbin",
                    help="where to link (default %(default)s)")


# --- mount-all -------------------------------------------------------------------------


DISCOVERY_SECURITY = ("tls", "tls_key", "tls_compat", "keyring", "tls_key_identity",
                      "dhchap_secret", "dhchap_ctrl_secret", "allow_insecure_secret_file",
                      "config")
"""mount-all's own options that secure its discovery connections (a discovery controller
that requires TLS or DH-HMAC-CHAP), as connect-all's do; ``-O`` options go to the mounts."""


def _discovery_records(t: DiscoveryTarget, args: argparse.Namespace | None = None
                       ) -> list[dict]:
    import trio

    from nvmeof_fuse.host.discovery import discover

    ns = argparse.Namespace(command="discover", transport=t.transport, traddr=t.traddr,
                            trsvcid=t.trsvcid, host_traddr=t.host_traddr,
                            hostnqn=t.hostnqn, hostid=t.hostid, hdr_digest=False,
                            data_digest=False,
                            **{k: getattr(args, k, None) for k in DISCOVERY_SECURITY})
    for flag in ("tls", "tls_compat", "allow_insecure_secret_file"):
        setattr(ns, flag, bool(getattr(ns, flag)))
    port = registry.capabilities(t.transport).discovery_port
    conn = connect_options(ns, nqn=DISCOVERY_NQN, default_port=port)
    return trio.run(discover, conn).to_dict().get("records", [])


def _common_mount_args(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The ``mount`` options every mount gets, checked once; and the log file among them."""
    items = [i for v in args.mount_options for i in v.split(",") if i.strip()]
    mountall.check_mount_options(items)
    common = [a for i in items for a in key_to_args(i)]
    for flag, value in (("-w", args.host_traddr), ("-q", args.hostnqn), ("-I", args.hostid)):
        if value is not None:
            common += [flag, value]
    # the transport comes from each record: probe with one that takes every option given
    # (-O tls_key_file= is for NVMe/TCP records only)
    tls_fabric = next(name for name in registry.NAMES if registry.capabilities(name).tls)
    fabric = ["-t", tls_fabric] if set(mountall.TLS_OPTIONS) & set(common) else []
    probe = mount_parser().parse_args(["mount", *fabric, *common, "-a", "192.0.2.1", "-n",
                                       "nqn.2014-08.org.example:probe", "/"])
    connect_options(probe, nqn=probe.nqn, default_port=registry.IO_PORT)  # secret files read
    mount_options(probe)
    return common, probe.log_file


def _mount_one(o: Outcome, log_file: str | None) -> None:
    try:
        os.makedirs(o.mountpoint, exist_ok=True)
        cmd, secrets = daemon_command(o.argv)  # secret files made absolute
        spawn_daemon(cmd, log_file, secrets=secrets)
        o.status = "mounted"
    except (NVMeoFError, UsageError, OSError) as exc:
        o.status, o.reason = "failed", one_line(exc)


def _keyring_finder(hostnqn: str | None, hostid: str | None) -> Callable[[str], str | None]:
    """For ``mount-all``: None when the kernel keyring holds this host's TLS PSK for a
    subsystem (as its mount will look it up), else the identity it lacks."""
    from nvmeof_fuse.host.connect_options import keyring_psk
    from nvmeof_fuse.host.hostid import host_identity
    from nvmeof_fuse.host.keyring import DEFAULT_KEYRING
    from nvmeof_fuse.nvme.tls_psk import default_identities

    host = host_identity(hostnqn, hostid).hostnqn

    def missing(subnqn: str) -> str | None:
        wanted = default_identities(host, subnqn)
        try:
            found = keyring_psk(DEFAULT_KEYRING, wanted)
        except (NVMeoFError, ValueError):
            found = None
        return None if found is not None else wanted[1]

    return missing


def cmd_mount_all(args: argparse.Namespace) -> int:
    from nvmeof_fuse.fs.mount import read_mountinfo

    common, log_file = _common_mount_args(args)
    if args.traddr is not None:
        targets = [DiscoveryTarget(args.transport or registry.DEFAULT, args.traddr, args.trsvcid,
                                   args.host_traddr, args.hostnqn, args.hostid)]
    else:
        targets = mountall.read_discovery_conf(args.discovery_conf)
        if not targets:
            raise InvalidArgument(f"no -a ADDRESS given and no discovery controllers in "
                                  f"{args.discovery_conf}")
    records: list[dict] = []
    failed: list[Outcome] = []
    for t in targets:
        try:
            records += _discovery_records(t, args)
        except (NVMeoFError, UsageError) as exc:
            failed.append(Outcome(DISCOVERY_NQN, t.transport, t.traddr, t.trsvcid or "", "",
                                  "failed", one_line(exc)))
    mounts = [(m.mountpoint, m.fstype) for m in read_mountinfo()]
    outcomes = failed + mountall.plan(records, args.root, mounts, common,
                                      _keyring_finder(args.hostnqn, args.hostid))
    todo = [o for o in outcomes if o.status == "mount"]
    if todo:
        with concurrent.futures.ThreadPoolExecutor(min(len(todo), MAX_PARALLEL_MOUNTS)) as pool:
            list(pool.map(lambda o: _mount_one(o, log_file), todo))
    if args.output_format == "json":
        print(json.dumps(mountall.to_json(outcomes), indent=2))
    elif outcomes:
        print(mountall.format_table(outcomes))
    else:
        print("no NVMe subsystems in the discovery log page")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


# --- install-helper ------------------------------------------------------------------


def cmd_install_helper(args: argparse.Namespace) -> int:
    print(install_helper(args.bindir))
    return 0
