"""The CLI process checks a mount's options without importing trio.

``mount --daemon`` checks its options in the parent, then starts the daemon, which imports trio
itself: a parent that imported trio too paid for it twice before a bad option could fail.
"""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
from nvmeof_fuse.cli.entry import build_parser
from nvmeof_fuse.cli.mounthelper import apply_source
from nvmeof_fuse.cli.options import connect_options, mount_options
args = build_parser().parse_args(sys.argv[1:])
apply_source(args)
conn = connect_options(args, nqn=args.nqn, default_port=4420)
mount_options(args)
print(conn.transport, conn.ctrl_loss_tmo, 'trio' in sys.modules)
"""
MOUNT = ["mount", "-t", "tcp", "-a", "127.0.0.1", "-n", "nqn.2026-11.io.example:sub",
         "-l", "-1", "--daemon", "/mnt/x"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_checking_mount_options_imports_no_trio():
    result = run("-c", CHECK, *MOUNT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["tcp", "-1.0", "False"]


def test_a_bad_option_fails_before_trio_is_imported():
    secret = "DHHC-1:01:" + "A" * 44 + ":"  # a CRC-32 that does not match
    result = run("-X", "importtime", "-m", "nvmeof_fuse.cli", *MOUNT[:-1], "-S", secret, "/mnt/x")
    lines = result.stderr.splitlines()
    errors = [line for line in lines if not line.startswith("import time:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert errors[0].startswith("nvmeof-fuse: error: --dhchap-secret") and secret not in errors[0]
    assert not [line for line in lines if line.rstrip().endswith("| trio")], "trio was imported"


def test_the_options_module_needs_no_trio():
    result = run("-c", "import sys, nvmeof_fuse.host.connect_options; print('trio' in sys.modules)")
    assert result.stdout.strip() == "False", result.stderr
