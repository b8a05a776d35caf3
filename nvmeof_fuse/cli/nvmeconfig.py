"""``/etc/nvme/config.json``, libnvme's JSON configuration: the TLS and DH-HMAC-CHAP settings
it holds for one port of one subsystem, as ``nvme connect`` and ``connect-all`` take them.

The file is a list of hosts, each with its ``hostnqn`` and ``subsystems``, each with its
``nqn`` and ``ports``; a port names ``transport``, ``traddr`` and ``trsvcid`` and may hold
``tls``, ``tls_key``, ``keyring``, ``tls_key_identity``, ``dhchap_key`` and
``dhchap_ctrl_key`` (a host's own ``dhchap_key`` stands for its ports').  Options on the
command line win.  A file that holds a secret we use is refused if group or others may read
it, as a secret file is (``--allow-insecure-secret-file`` lifts it).  Errors name the file
and the entry, never a secret.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.host.auth import INSECURE_MODE_BITS
from nvmeof_fuse.nvme import auth, tls_psk

CONFIG_JSON = "/etc/nvme/config.json"
MAX_BYTES = 4 << 20
"""A configuration of thousands of ports is far smaller; a larger file is refused unread."""
SECRETS = ("tls_key", "dhchap_key", "dhchap_ctrl_key")


@dataclass(frozen=True)
class Port:
    """Where to connect, as config.json's entries are matched (libnvme's port lookup)."""

    hostnqn: str
    subnqn: str
    transport: str
    traddr: str
    trsvcid: int


@dataclass(frozen=True)
class PortSettings:
    """What config.json holds for one port (None: it says nothing)."""

    tls: bool | None = None
    keyring: str | None = None
    tls_key_identity: str | None = None
    tls_key: str | None = field(default=None, repr=False)
    dhchap_key: str | None = field(default=None, repr=False)
    dhchap_ctrl_key: str | None = field(default=None, repr=False)


def load(path: str, port: Port, *, required: bool, allow_insecure: bool = False,
         ) -> PortSettings | None:
    """The settings ``path`` holds for ``port``; None if it holds none (or, unless
    ``required``, does not exist)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if required:
            raise InvalidArgument(f"--config {path}: no such file") from None
        return None
    except OSError as exc:
        raise InvalidArgument(f"{path}: {exc.strerror}") from None
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"{path} is not a regular file")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise InvalidArgument(f"{path} is over {MAX_BYTES >> 20} MiB: not an NVMe "
                              "configuration")
    try:
        tree = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        where = f" (line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise InvalidArgument(f"{path} is not valid JSON{where}") from None
    settings = find(tree, port, path)
    if settings is not None and any(getattr(settings, s) for s in SECRETS):
        mode = stat.S_IMODE(st.st_mode)
        if mode & INSECURE_MODE_BITS and not allow_insecure:
            raise InvalidArgument(f"{path} holds a secret for {port.subnqn}, but its "
                                  f"permissions {mode:04o} are too open (group or others may "
                                  f"read it): chmod 600 {path}, or give "
                                  "--allow-insecure-secret-file")
    return settings


def _entries(node: Any, key: str, where: str) -> list[dict]:
    items = node.get(key, []) if isinstance(node, dict) else node
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise InvalidArgument(f"{where}: {key} is not a list of objects")
    return items


def find(tree: Any, port: Port, path: str = CONFIG_JSON) -> PortSettings | None:
    """The settings ``tree`` (config.json parsed) holds for ``port``."""
    for host in _entries(tree, "hosts", path):
        if host.get("hostnqn") != port.hostnqn:
            continue
        for subsystem in _entries(host, "subsystems", path):
            if subsystem.get("nqn") != port.subnqn:
                continue
            for entry in _entries(subsystem, "ports", f"{path}: {port.subnqn}"):
                if _matches(entry, port):
                    return _settings(entry, host, f"{path}: {port.subnqn} at "
                                     f"{port.traddr}:{port.trsvcid}")
    return None


def _matches(entry: dict, port: Port) -> bool:
    trsvcid = entry.get("trsvcid")
    return (entry.get("transport") == port.transport and entry.get("traddr") == port.traddr
            and (trsvcid in (None, "") or str(trsvcid) == str(port.trsvcid)))


def _settings(entry: dict, host: dict, where: str) -> PortSettings:
    def text(key: str, node: dict = entry) -> str | None:
        value = node.get(key)
        if value is None or value == "none":
            return None
        if not isinstance(value, str) or not value or len(value) > 4096:
            raise InvalidArgument(f"{where}: {key} is not a string")
        return value

    tls = entry.get("tls")
    if tls is not None and not isinstance(tls, bool):
        raise InvalidArgument(f"{where}: tls is not true or false")
    secrets = {"tls_key": text("tls_key"),
               "dhchap_key": text("dhchap_key") or text("dhchap_key", host),
               "dhchap_ctrl_key": text("dhchap_ctrl_key")}
    checks = {"tls_key": tls_psk.parse_interchange, "dhchap_key": auth.parse_secret,
              "dhchap_ctrl_key": auth.parse_secret}
    for key, value in secrets.items():
        if value is not None:
            try:
                checks[key](value)
            except ValueError as exc:
                raise InvalidArgument(f"{where}: {key} {exc}") from None
    return PortSettings(tls=tls, keyring=text("keyring"),
                        tls_key_identity=text("tls_key_identity"), **secrets)
