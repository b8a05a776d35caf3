"""NVMe-oF URIs of the NVMe Boot Specification, as libnvme's ``nvme_parse_uri`` reads them.

``nvme+rdma://HOST[:PORT]/SUBNQN[/NSID]`` and ``nvme+tcp://...``; HOST may be an
IPv6 address in brackets (``[fe80::1]:4420``).  Path segments are
percent-decoded and empty ones skipped, as libnvme does.  No I/O here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

from ..errors import InvalidArgument

TRANSPORTS = ("rdma", "tcp")
DEFAULT_PORT = 4420
FORM = "nvme+rdma://HOST[:PORT]/SUBNQN[/NSID]"
MAX_NSID = 0xFFFFFFFE  # 0xFFFFFFFF is "all namespaces", 0 is no namespace

_URI = re.compile(r"^(?P<scheme>[^:/]+)://(?P<authority>[^/?#]*)(?P<path>[^?#]*)(?P<rest>.*)$")
_DIGITS = re.compile(r"[0-9]+")
_HOST_PORT = re.compile(r"^(?:\[(?P<ip6>[^\]]*)\]|(?P<host>[^:\[\]]*))(?::(?P<port>.*))?$")


class URIError(InvalidArgument):
    """An NVMe URI that cannot be used; the message names the part that is wrong."""


@dataclass(frozen=True)
class NVMeURI:
    """Where a subsystem is (transport, address, port, NQN) and optionally one namespace."""

    transport: str
    traddr: str
    trsvcid: int | None  # None: not in the URI (the transport's default applies)
    subnqn: str
    nsid: int | None = None

    def __str__(self) -> str:
        host = f"[{self.traddr}]" if ":" in self.traddr else self.traddr
        port = "" if self.trsvcid is None else f":{self.trsvcid}"
        tail = "" if self.nsid is None else f"/{self.nsid}"
        return f"nvme+{self.transport}://{host}{port}/{self.subnqn}{tail}"


PATH_KEYS = ("host_iface", "host_traddr")
"""What a mount's further path may say of its own local side, after its URI:
``nvme+rdma://10.0.1.1/nqn...?host_iface=mlx5_1`` (one rail's device)."""


def split_path_keys(text: str) -> tuple[str, dict[str, str]]:
    """A further path's URI and its own keys (:data:`PATH_KEYS`); URIError names a key that
    is unknown, empty or given twice."""
    uri, mark, query = text.strip().partition("?")
    if not mark:
        return uri, {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise URIError(f"bad keys {query!r} after {uri!r} (KEY=VALUE&...)") from None
    keys: dict[str, str] = {}
    for key, value in pairs:
        if key not in PATH_KEYS:
            raise URIError(f"unknown key {key!r} after {uri!r} (known: {', '.join(PATH_KEYS)})")
        if not value or key in keys:
            raise URIError(f"{key} after {uri!r} is {'empty' if not value else 'given twice'}")
        keys[key] = value
    return uri, keys


def looks_like_uri(text: str) -> bool:
    """Whether ``text`` is meant as a URI (has ``scheme://``), good or bad."""
    return "://" in text


def parse_uri(text: str) -> NVMeURI:
    """Parse ``text``; raise :class:`URIError` naming the scheme, host, port, NQN or NSID."""
    m = _URI.match(text.strip())
    if m is None:
        raise URIError(f"{text!r} is not an NVMe URI ({FORM})")
    scheme = m["scheme"].lower()
    kind, _, transport = scheme.partition("+")
    if kind != "nvme" or transport not in TRANSPORTS:
        raise URIError(
            f"unknown scheme {m['scheme']!r} in {text!r} (known: "
            + ", ".join(f"nvme+{t}" for t in TRANSPORTS) + ")"
        )
    if m["rest"]:
        raise URIError(f"a query or fragment ({m['rest']!r}) is not supported in {text!r}")
    authority = m["authority"]
    if "@" in authority:
        raise URIError(f"user information ({authority.rpartition('@')[0]!r}@) is not supported "
                       f"in {text!r}")
    hp = _HOST_PORT.match(authority)
    if hp is None:
        raise URIError(f"bad host {authority!r} in {text!r} (an IPv6 address goes in [])")
    host = unquote(hp["ip6"] if hp["ip6"] is not None else hp["host"])
    if not host:
        raise URIError(f"missing host in {text!r} ({FORM})")
    port = None
    if hp["port"] is not None:
        if not _DIGITS.fullmatch(hp["port"]) or not 1 <= int(hp["port"]) <= 65535:
            raise URIError(f"bad port {hp['port']!r} in {text!r} (1-65535)")
        port = int(hp["port"])
    segments = [unquote(s) for s in m["path"].split("/") if s]
    if not segments:
        raise URIError(f"missing the subsystem NQN in {text!r} ({FORM})")
    if len(segments) > 2:
        raise URIError(f"too many path parts in {text!r}: {'/'.join(segments[2:])!r} ({FORM})")
    subnqn = segments[0]
    if not subnqn.lower().startswith("nqn.") or len(subnqn.encode()) > 223:
        raise URIError(f"{subnqn!r} in {text!r} is not a subsystem NQN "
                       "(nqn.YYYY-MM.domain:..., <= 223 bytes)")
    nsid = None
    if len(segments) == 2:
        if not _DIGITS.fullmatch(segments[1]):
            raise URIError(f"NSID {segments[1]!r} in {text!r} is not a number")
        nsid = int(segments[1])
        if not 1 <= nsid <= MAX_NSID:
            raise URIError(f"NSID {nsid} in {text!r} is out of range (1-{MAX_NSID})")
    return NVMeURI(transport, host, port, subnqn, nsid)
