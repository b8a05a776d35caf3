"""``gen-tls-key`` and ``check-tls-key``: NVMe/TCP TLS PSKs as nvme-cli makes and checks them.

Options, defaults and output follow nvme-cli's newest (3.0, ``nvme keys gen-tls`` and
``check-tls``, which the old names forward to): ``gen-tls-key`` prints a configured PSK in
the interchange format, ``check-tls-key`` checks one and, given a subsystem NQN, prints the
PSK identity a host offers for it; with ``--insert`` both load the TLS PSK derived for a
host and subsystem into the kernel keyring under its identity, where the kernel initiator,
tlshd and ``nvmeof-fuse mount --tls`` look it up.  A key or secret may be given inline as
nvme-cli takes it, in a file (mode 0600), or on stdin; messages never hold it.
"""

from __future__ import annotations

import argparse
import getpass
import os
import secrets
import sys
from typing import Any

from nvmeof_fuse.cli.options import UsageError
from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.nvme import tls_psk

STDIN_MAX = 4096
"""Bytes read of stdin for a key or secret (a key is 89 characters at most)."""
KEY_HELP = "the key (NVMeTLSkey-1:hh:<base64>:), the path of a file holding it, or -"


def add_parsers(sub: Any) -> None:
    """The ``gen-tls-key`` and ``check-tls-key`` commands, in the subcommands ``sub``."""
    g = sub.add_parser("gen-tls-key", help="make a TLS PSK in the NVMe PSK interchange format "
                       "(nvme gen-tls-key)")
    g.add_argument("-s", "--secret", metavar="HEX|FILE|-",
                   help="the configured PSK in hexadecimal (32 bytes for --hmac 1, 48 for 2), "
                        "the path of a file holding it, or - for stdin (default: random)")
    g.add_argument("-m", "--hmac", default="1",
                   help="hash of the retained key: 1 SHA-256 (default), 2 SHA-384")
    _add_common(g)

    c = sub.add_parser("check-tls-key", help="check a TLS PSK in the NVMe PSK interchange "
                       "format; with --subsysnqn, print its PSK identity (nvme check-tls-key)")
    c.add_argument("-d", "--keydata", "--key", dest="keydata", metavar="KEY|FILE|-",
                   help=f"{KEY_HELP} (default: stdin; --key is nvme-cli 2.3's name)")
    _add_common(c)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--hostnqn", help="host NQN (default: /etc/nvme/hostnqn)")
    p.add_argument("-c", "--subsysnqn", help="subsystem NQN of the PSK identity")
    p.add_argument("-I", "--identity", default="0",
                   help="PSK identity version: 0 (NVMe/TCP 1.0c, default), 1 (with the PSK "
                        "digest, TP 8018)")
    p.add_argument("-C", "--compat", action="store_true",
                   help="libnvme's older, non-RFC 8446 derivation, for targets that used it")
    p.add_argument("-i", "--insert", action="store_true",
                   help="load the TLS PSK derived for --hostnqn and --subsysnqn into the "
                        "kernel keyring, under its PSK identity")
    p.add_argument("-k", "--keyring", default=".nvme", help="keyring for --insert")
    p.add_argument("-t", "--keytype", default="psk", help="key type for --insert")
    p.add_argument("-f", "--keyfile", help="key file to import or export (not supported yet)")
    p.add_argument("--allow-insecure-secret-file", action="store_true",
                   help="read key files that group or others may access")


# --- where a secret comes from -------------------------------------------------------------


def _read_stdin(what: str) -> str:
    """The first word of stdin, or of a line typed at the terminal without echo."""
    if sys.stdin is None:
        raise InvalidArgument(f"no {what} given and no stdin to read it from")
    if sys.stdin.isatty():
        try:
            data = getpass.getpass(f"{what}: ")
        except EOFError:
            data = ""
    else:
        data = sys.stdin.read(STDIN_MAX + 1)
    if len(data) > STDIN_MAX:
        raise InvalidArgument(f"stdin holds over {STDIN_MAX} characters; the {what} is one "
                              "short line")
    lines = data.split()
    if not lines:
        raise InvalidArgument(f"no {what} on stdin")
    return lines[0]


def _secret_text(value: str | None, option: str, what: str, inline: bool,
                 allow_insecure: bool) -> tuple[str, str]:
    """The text of a key or secret and where it came from, for messages.

    ``inline``: ``value`` is the thing itself.  Else ``-`` or no value is stdin, and an
    existing path a file; nothing else is read as a path, so a mistyped key is never echoed.
    """
    from nvmeof_fuse.host.auth import read_secret_file

    if value is None or value == "-":
        return _read_stdin(what), f"the {what} on stdin"
    if inline:
        return value.strip(), option
    if os.path.lexists(value):
        return read_secret_file(value, option, allow_insecure), f"{option} file {value}"
    raise InvalidArgument(f"{option} is neither a {what} nor the path of a file holding it")


# --- the options both commands share ---------------------------------------------------


def _small_int(option: str, value: str, allowed: dict[int, str]) -> int:
    try:
        number = int(value, 0)
    except ValueError:
        raise UsageError(f"{option} {value!r} is not an integer") from None
    if number not in allowed:
        choices = ", ".join(f"{n} ({name})" for n, name in allowed.items())
        raise UsageError(f"{option} {number} is not one of {choices}")
    return number


def _identity_version(args: argparse.Namespace) -> int:
    return _small_int("--identity", args.identity, {0: "NVMe/TCP 1.0c", 1: "with the digest"})


def _refuse_keyfile(args: argparse.Namespace) -> None:
    if args.keyfile is not None:
        raise InvalidArgument("--keyfile is not supported yet: give the key with --keydata "
                              "(or --secret)")


def _insert(args: argparse.Namespace, configured: tls_psk.ConfiguredPsk, version: int) -> None:
    """Derive the TLS PSK for ``--hostnqn`` and ``--subsysnqn`` and load it into
    ``--keyring`` under its identity, printing what nvme-cli prints."""
    from nvmeof_fuse.host import keyring

    if args.subsysnqn is None:
        raise InvalidArgument("--insert needs -c/--subsysnqn: the PSK identity names the "
                              "subsystem")
    try:
        derived = tls_psk.derive(configured, _hostnqn(args), args.subsysnqn, version=version,
                                 compat=args.compat)
    except ValueError as exc:
        raise InvalidArgument(f"cannot derive the TLS PSK: {exc}") from None
    serial = keyring.add(keyring.find_keyring(args.keyring), derived.identity, derived.key,
                         args.keytype)
    print(f"Inserted TLS key {serial:08x}")


def _refuse_key_as_keyring(args: argparse.Namespace) -> None:
    """nvme-cli 2.3's ``check-tls-key -k KEY`` is ``--keyring`` since 2.4: say so, unechoed."""
    if ":" in args.keyring:
        raise UsageError("-k/--keyring names a keyring (nvme-cli 2.4 and later); give the key "
                         "with -d/--keydata (nvme-cli 2.3's -k/--key)")


def _hostnqn(args: argparse.Namespace) -> str:
    """``--hostnqn``, else nvme-cli's default (/etc/nvme/hostnqn, or one made from the
    machine's UUID)."""
    from nvmeof_fuse.host.hostid import host_identity

    return args.hostnqn if args.hostnqn is not None else host_identity().hostnqn


# --- gen-tls-key --------------------------------------------------------------------------


def _configured_key(args: argparse.Namespace, key_len: int) -> bytes:
    """``--secret`` as bytes (libnvme's ``create_raw_secret``), or ``key_len`` random bytes."""
    if args.secret is None:
        return secrets.token_bytes(key_len)
    if args.secret.startswith("pin:"):
        raise InvalidArgument("--secret pin:... (nvme-cli 3.0's key from a PIN) is not "
                              "supported yet")
    inline = args.secret != "-" and all(c in "0123456789abcdefABCDEF" for c in args.secret)
    text, source = _secret_text(args.secret, "--secret", "hexadecimal secret", inline,
                                args.allow_insecure_secret_file)
    if len(text) < 4:
        raise InvalidArgument(f"{source} is too short: {key_len} bytes in hexadecimal are "
                              f"{2 * key_len} digits")
    if len(text) % 2 or any(c not in "0123456789abcdefABCDEF" for c in text):
        raise InvalidArgument(f"{source} is not hexadecimal (an even number of 0-9, a-f)")
    raw = bytes.fromhex(text)
    if len(raw) != key_len:
        other = 48 if key_len == 32 else 32
        raise InvalidArgument(f"{source} is {len(raw)} bytes; --hmac {1 if key_len == 32 else 2}"
                              f" takes {key_len} (--hmac {2 if key_len == 32 else 1} takes "
                              f"{other})")
    return raw


def cmd_gen_tls_key(args: argparse.Namespace) -> int:
    hash_id = tls_psk.PskHash(_small_int("--hmac", args.hmac, {1: "SHA-256", 2: "SHA-384"}))
    version = _identity_version(args)
    _refuse_keyfile(args)
    key = _configured_key(args, tls_psk.HASH_LENGTHS[hash_id])
    print(tls_psk.format_interchange(key, hash_id))
    if args.insert:
        _insert(args, tls_psk.ConfiguredPsk(key, hash_id), version)
    return 0


# --- check-tls-key ------------------------------------------------------------------------


def read_tls_key(value: str | None, option: str = "--keydata",
                 allow_insecure: bool = False) -> tls_psk.ConfiguredPsk:
    """The configured PSK ``value`` names (inline, a file, or stdin), checked; one line
    naming the problem and where the key came from, never the key, if it is bad."""
    inline = value is not None and ":" in value  # never read a mistyped key as a path
    text, source = _secret_text(value, option, "TLS key", inline, allow_insecure)
    try:
        return tls_psk.parse_interchange(text)
    except ValueError as exc:
        raise InvalidArgument(f"{source} {exc}") from None


def cmd_check_tls_key(args: argparse.Namespace) -> int:
    version = _identity_version(args)
    _refuse_key_as_keyring(args)
    _refuse_keyfile(args)
    configured = read_tls_key(args.keydata, allow_insecure=args.allow_insecure_secret_file)
    print(f"Key is valid (HMAC {int(configured.hash_id)}, length {len(configured.key)})")
    if args.insert:
        _insert(args, configured, version)
        return 0
    if args.subsysnqn is None:
        return 0
    try:
        derived = tls_psk.derive(configured, _hostnqn(args), args.subsysnqn,
                                 version=version, compat=args.compat)
    except ValueError as exc:
        raise InvalidArgument(f"cannot derive the PSK identity: {exc}") from None
    print(derived.identity)
    return 0
