"""TLS faults (issue #58 item 7): a good target (fault "none") behind a TLS front of OpenSSL's
(tests/tls_front.py) that breaks TLS where a target, its tlshd or a middlebox can.  Each
fault is the front's, armed by the test once the mount is up:

- ``front.inject("cut mid-record")``: in place of a read's data, a record's header and a
  third of its body, then the connection closes;
- ``front.inject("close_notify")``: an alert in the middle of the stream, then a close;
- ``front.inject("KeyUpdate")``, ``front.inject("NewSessionTicket")``: a post-handshake
  message, which NVMe/TCP never carries (``times=None``: on every connection);
- ``front.stall = True`` then ``front.cut_all()``: the reconnect's handshakes never answered;
- ``front.keys = {...}`` then ``front.cut_all()``: the target's key for our identity changed
  (or it has none), so the reconnect's handshake is refused.

tests/hostile/test_tls.py runs them against the real daemon and FUSE (:func:`start`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hostile_target import NQN
from tls_front import TlsFront

from nvmeof_fuse.nvme import tls_psk

if TYPE_CHECKING:  # (the harness loads this module as it starts)
    from hostile_harness import HostileMount

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0"
KEY_BYTES = 32  # a SHA-256 configured PSK: TLS_AES_128_GCM_SHA256


@dataclass
class TlsMount:
    """A hostile mount whose daemon reaches its target through ``front``."""

    m: HostileMount
    front: TlsFront
    psk: tls_psk.TlsPsk
    """What the daemon's handshakes offer: its identity and the derived TLS PSK."""
    key: str
    """The configured PSK, as ``nvme gen-tls-key`` prints it (never to be logged)."""


def start(hostile, *, options: tuple[str, ...] | None = None) -> TlsMount:
    """A good target behind a TLS front that holds the host's PSK, and a daemon to mount it
    with ``--tls-key FILE`` (``m.mount()``, not yet called); ``options``: the harness's
    MOUNT_OPTIONS unless given."""
    from hostile_harness import MOUNT_OPTIONS

    options = MOUNT_OPTIONS if options is None else options
    configured = tls_psk.ConfiguredPsk(os.urandom(KEY_BYTES), tls_psk.PskHash.SHA256)
    key = tls_psk.format_interchange(configured.key, configured.hash_id)
    psk = tls_psk.derive(configured, HOSTNQN, NQN)
    key_file = hostile.tmp_path / f"tls{len(hostile.mounts)}.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    m = hostile.start("none", options=(*options, "-q", HOSTNQN, "--tls-key", str(key_file)))
    front = m.fronts.enter_context(TlsFront(m.target.port, {psk.identity: psk.key}, psk.suite))
    m.port = front.port
    return TlsMount(m, front, psk, key)
