"""The client side of a queue lease: what the daemon's ``lease`` reply grants, and how to
connect the leased queues (the mount's own target, host identity and recovery rules)."""

from __future__ import annotations

from typing import Any

from ...errors import InvalidArgument
from ...host.attached import Lease, NamespaceShape
from ...host.controller import ConnectOptions
from ...nvme import tls_psk

RENEW_FOREVER = 365 * 86400.0  # s: bound of a lease wait when the mount never gives up


def lease_from(reply: dict) -> Lease:
    return Lease(qids=tuple(reply["qids"]), cntlid=reply["cntlid"],
                 queue_size=reply["queue_size"], in_capsule_bytes=reply["in_capsule_bytes"],
                 max_transfer=reply["max_transfer"],
                 namespaces=tuple(NamespaceShape(*shape) for shape in reply["namespaces"]),
                 traddr=reply.get("traddr"), trsvcid=reply.get("trsvcid"),
                 host_iface=reply.get("host_iface"), host_traddr=reply.get("host_traddr"))


def options_from(reply: dict, timeout: float) -> ConnectOptions:
    """How to connect: the mount's own target, host identity and recovery rules, with
    ``timeout`` as the command timeout (a File's bound, at least the mount's)."""
    return ConnectOptions(
        traddr=reply["traddr"], nqn=reply["subnqn"], transport=reply["transport"],
        trsvcid=reply["trsvcid"], host_traddr=reply["host_traddr"],
        host_iface=reply.get("host_iface"), hostnqn=reply["hostnqn"], hostid=reply["hostid"],
        nr_io_queues=len(reply["qids"]),
        companion_queues=0, keep_alive_tmo=0, timeout=timeout,
        reconnect_delay=reply["reconnect_delay"], ctrl_loss_tmo=reply["ctrl_loss_tmo"],
        fast_io_fail_tmo=reply["fast_io_fail_tmo"], dhchap_secret=reply.get("dhchap_secret"),
        dhchap_ctrl_secret=reply.get("dhchap_ctrl_secret"), tls_key=reply.get("tls_key"),
        tls_compat=bool(reply.get("tls_compat", False)),
        tls_psk_given=given_psk(reply.get("tls_psk")))


def given_psk(field: Any) -> tls_psk.TlsPsk | None:
    """The TLS PSK the mount resolved from its keyring (``{"identity", "key"}``), checked."""
    if field is None:
        return None
    try:
        return tls_psk.keyring_psk(str(field["identity"]), bytes.fromhex(field["key"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument("the mount's lease reply holds a malformed TLS PSK "
                              f"({type(exc).__name__})") from None


def renew_timeout(options: ConnectOptions) -> float:
    """How long a wait for a lease (again, after a reconnect) may take: the mount's own
    controller-loss bound and two command timeouts, or as good as forever."""
    if options.ctrl_loss_tmo < 0:
        return RENEW_FOREVER
    return options.ctrl_loss_tmo + 2 * options.timeout


def path_words(path: Any) -> str:
    """A lease reply's ``path`` in words, as ``placement`` says it: ``direct via path 2
    (mlx5_3, PIX to GPU 0000:9a:00.0)``; empty when the mount named none (one path)."""
    if not isinstance(path, dict) or type(path.get("index")) is not int:
        return ""
    device, distance, memory = (_word(path.get(key)) for key in ("device", "distance",
                                                                  "memory"))
    if distance and memory:
        where = f"{distance} to {memory}"
    elif memory:
        where = f"distance to {memory} unknown"
    else:
        where = "where our memory is was not said"
    return f"direct via path {path['index']} ({device or 'device unknown'}, {where})"


def _word(value: Any) -> str:
    """A reply's word, printable and short (it goes into log lines and stats)."""
    if not isinstance(value, str):
        return ""
    return "".join(c for c in value if c.isprintable())[:64]
