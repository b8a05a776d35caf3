"""What to connect to and how (:class:`ConnectOptions`), checked without any I/O.

Apart from the controller, so that the CLI can check a mount's options (``mount
--daemon`` does before it starts the daemon) without importing trio.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import InvalidArgument
from ..nvme import tls_psk
from ..transport import registry
from . import auth, keyring

DEFAULT_COMPANION_QUEUES = 16
"""Four clients' worth of queue IDs (they cost the target nothing until a client connects)."""
MAX_SHUTDOWN_TIMEOUT = 255
"""Seconds: the longest ``--shutdown-timeout`` (Linux's module parameter is a byte)."""
QUEUES_PER_CLIENT = 4
"""I/O queues a companion ``File`` leases and connects: 2 polled, 2 on its loop."""
DEFAULT_MAX_NAMESPACES = 65536
"""Active namespaces a mount serves at most (the first by NSID), unless
``--max-namespaces`` says otherwise: each costs about 1 KiB of memory and two Identify
commands at mount (docs/reliability.md, "Many namespaces").  NVMe allows 0xFFFFFFFE."""
MAX_NSID = 0xFFFFFFFE
_DEVICE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,63}")
"""A netdev's or an RDMA device's name (IB_DEVICE_NAME_MAX is 64 with its NUL)."""


@dataclass
class ConnectOptions:
    """What to connect to and how; the names follow nvme-cli's options."""

    traddr: str
    nqn: str
    transport: str = registry.DEFAULT
    trsvcid: int = registry.IO_PORT
    host_traddr: str | None = None
    host_iface: str | None = None
    """The local device the queues must use (nvme-cli's ``host_iface``): NVMe/TCP binds its
    sockets to this netdev; NVMe/RDMA refuses a path RDMA-CM binds to another RDMA device
    than this one (``mlx5_3``), as the ``nvmeof`` library's ``--expected-hca``."""
    hostnqn: str | None = None
    hostid: str | None = None
    nr_io_queues: int | None = None
    companion_queues: int = DEFAULT_COMPANION_QUEUES
    """Extra I/O queue IDs asked for at connect time and leased to companion clients."""
    queue_size: int = 128
    keep_alive_tmo: float = 5.0
    reconnect_delay: float = 10.0
    """Seconds between reconnect attempts after the connection is lost."""
    ctrl_loss_tmo: float = 600.0
    """Seconds to keep reconnecting before I/O fails for good; 0: never, -1: forever."""
    fast_io_fail_tmo: float = -1.0
    """Seconds after a loss from which I/O fails while reconnecting goes on; -1: off."""
    timeout: float = 30.0
    """Per-command timeout in seconds."""
    max_namespaces: int = DEFAULT_MAX_NAMESPACES
    """Active namespaces served at most, the first by NSID; the rest are refused in one
    line."""
    connect_timeout: float = 10.0
    """Seconds for one transport connect (TCP connect and ICResp, RDMA-CM)."""
    shutdown_timeout: float = 5.0
    """Seconds an orderly shutdown waits for the controller at least (Linux's
    ``shutdown_timeout``); RTD3E raises it, up to ``SHUTDOWN_TIMEOUT_CAP``."""
    dhchap_secret: str | None = field(default=None, repr=False)
    """DH-HMAC-CHAP host secret (DHHC-1:0N:...:) or the path of a file holding it (read
    again at each connect and reconnect)."""
    dhchap_ctrl_secret: str | None = field(default=None, repr=False)
    """Controller secret (or its file): the host also authenticates the controller."""
    allow_insecure_secret_file: bool = False
    """Read secret files that group or others may access (refused otherwise, as ssh does)."""
    hdr_digest: bool = False
    """NVMe/TCP: CRC32C header digests (nvme-cli's --hdr-digest)."""
    data_digest: bool = False
    """NVMe/TCP: CRC32C data digests (nvme-cli's --data-digest)."""
    tls: bool = False
    """NVMe/TCP: TLS 1.3 with a PSK on every connection (nvme-cli's --tls)."""
    tls_key: str | None = field(default=None, repr=False)
    """The configured PSK (``NVMeTLSkey-1:hh:...:``, as ``nvme gen-tls-key`` prints it) or
    the path of a file holding it, read at each connect as DH-HMAC-CHAP secrets are; it
    implies ``tls``.  Without it, ``tls`` takes the PSK from the kernel keyring."""
    tls_compat: bool = False
    """Derive ``tls_key``'s TLS PSK the older way, as libnvme before 1.16 (nvme-cli before
    2.16) loads it into a target's keyring: nvme-cli's ``--compat``."""
    keyring: str | None = None
    """The keyring ``tls`` looks its PSK up in (a name or a serial; nvme-cli's --keyring):
    ``.nvme`` by default."""
    tls_key_identity: str | None = None
    """The PSK identity to offer (nvme-cli's --tls-key-identity): the keyring's key of that
    name, or, with ``tls_key``, the identity version (0 or 1) the key derives it for."""
    tls_psk_given: tls_psk.TlsPsk | None = field(default=None, repr=False)
    """A PSK already resolved by the mount (from its keyring), handed to a companion client or
    FUSE worker that may not read that keyring itself."""

    def validate(self) -> None:
        fabric = registry.capabilities(self.transport)
        if (self.hdr_digest or self.data_digest) and not fabric.digests:
            raise InvalidArgument("--hdr-digest and --data-digest apply only to "
                                  f"{registry.with_digests()}")
        if self.host_iface is not None and not _DEVICE_NAME.fullmatch(self.host_iface):
            raise InvalidArgument(f"--host-iface {self.host_iface!r} is not a device name "
                                  "(as mlx5_0 or eth0: 1-63 letters, digits, _ . : -)")
        if not 0 < self.trsvcid < 65536:
            raise InvalidArgument(f"--trsvcid {self.trsvcid} is not a port number (1-65535)")
        if self.nr_io_queues is not None and not 1 <= self.nr_io_queues <= 65535:
            raise InvalidArgument(f"--nr-io-queues {self.nr_io_queues} must be 1-65535")
        if not 0 <= self.companion_queues <= 65534:
            raise InvalidArgument(f"--companion-queues {self.companion_queues} must be 0-65534")
        if not 2 <= self.queue_size <= 65536:
            raise InvalidArgument(f"--queue-size {self.queue_size} must be 2-65536")
        if not 0 <= self.keep_alive_tmo <= 65535:
            raise InvalidArgument(f"--keep-alive-tmo {self.keep_alive_tmo} must be 0-65535 s")
        if not 1 <= self.reconnect_delay <= 65535:
            raise InvalidArgument(f"--reconnect-delay {self.reconnect_delay} must be 1-65535 s")
        if not (self.ctrl_loss_tmo == -1 or 0 <= self.ctrl_loss_tmo <= 2**31):
            raise InvalidArgument(f"--ctrl-loss-tmo {self.ctrl_loss_tmo} must be -1 (forever) "
                                  "or 0 or more seconds")
        if not (self.fast_io_fail_tmo == -1 or 0 <= self.fast_io_fail_tmo <= 2**31):
            raise InvalidArgument(f"--fast-io-fail-tmo {self.fast_io_fail_tmo} must be -1 (off) "
                                  "or 0 or more seconds")
        if not 1 <= self.shutdown_timeout <= MAX_SHUTDOWN_TIMEOUT:
            raise InvalidArgument(f"--shutdown-timeout {self.shutdown_timeout:g} must be "
                                  f"1-{MAX_SHUTDOWN_TIMEOUT} s")
        if not 1 <= self.max_namespaces <= MAX_NSID:
            raise InvalidArgument(f"--max-namespaces {self.max_namespaces} must be "
                                  f"1-{MAX_NSID}")
        if not self.nqn:
            raise InvalidArgument("--nqn is required")
        for source in self.dhchap_sources():
            if source is not None:
                source.load(self.allow_insecure_secret_file)
        if self.uses_tls:
            if not fabric.tls:
                raise InvalidArgument(f"--tls and --tls-key apply only to {registry.with_tls()}")
            self.configured_psk()
            if self.tls_key is None and self.tls_psk_given is None:
                try:
                    keyring.find_keyring(self.keyring or keyring.DEFAULT_KEYRING)
                except keyring.KeyringError as exc:
                    raise keyring.KeyringError(f"--tls without --tls-key takes the PSK from "
                                               f"the kernel keyring, but {exc}") from None

    @property
    def uses_tls(self) -> bool:
        """Whether every connection is TLS: ``--tls``, or a key or identity that implies it."""
        return bool(self.tls or self.tls_key or self.tls_key_identity or self.tls_psk_given)

    def configured_psk(self) -> tls_psk.ConfiguredPsk | None:
        """The configured TLS PSK (its file read now); None without ``--tls-key``.  Errors
        name the option, never the key."""
        if not self.tls_key:
            return None
        source = auth.SecretSource.of(self.tls_key, "--tls-key")
        try:
            return tls_psk.parse_interchange(source.text(self.allow_insecure_secret_file))
        except ValueError as exc:
            raise InvalidArgument(f"{source} {exc}") from None

    def tls_psk(self, hostnqn: str) -> tls_psk.TlsPsk | None:
        """The PSK identity and TLS PSK a connection's handshake offers for this host and
        subsystem (read again at each connection); None without TLS.

        From ``--tls-key``: derived as nvme-cli derives it, for identity version 0 unless
        ``--tls-key-identity`` is the key's version-1 identity.  Otherwise from the keyring:
        the key named ``--tls-key-identity``, or the first of the kernel's default identities.
        """
        if self.tls_psk_given is not None:
            return self.tls_psk_given
        if not self.uses_tls:
            return None
        configured = self.configured_psk()
        if configured is None:
            return self._keyring_psk(hostnqn)
        versions = (0,) if self.tls_key_identity is None else tls_psk.IDENTITY_VERSIONS
        try:  # (only the version asked for: this runs at each connection)
            derived = [tls_psk.derive(configured, hostnqn, self.nqn, version=v,
                                      compat=self.tls_compat) for v in versions]
        except ValueError as exc:
            raise InvalidArgument(f"--tls-key: {exc}") from None
        if self.tls_key_identity is None:
            return derived[0]
        for psk in derived:
            if psk.identity == self.tls_key_identity:
                return psk
        raise InvalidArgument("--tls-key-identity is neither identity --tls-key gives this "
                              f"host and subsystem: {derived[0].identity!r} (version 0) or "
                              f"{derived[1].identity!r} (version 1)")

    def _keyring_psk(self, hostnqn: str) -> tls_psk.TlsPsk:
        name = self.keyring or keyring.DEFAULT_KEYRING
        wanted = ([self.tls_key_identity] if self.tls_key_identity
                  else tls_psk.default_identities(hostnqn, self.nqn))
        psk = keyring_psk(name, wanted)
        if psk is not None:
            return psk
        looked = (f"{wanted[0]!r}" if self.tls_key_identity
                  else f"for this host and subsystem ({wanted[1]!r}, or its SHA-384 or "
                  "generated form)")
        raise InvalidArgument(f"--tls: keyring {name} holds no TLS PSK {looked}: load one "
                              "(`nvmeof-fuse gen-tls-key --insert`, as nvme-cli's), or give "
                              "--tls-key")

    def dhchap_sources(self) -> tuple[auth.SecretSource | None, auth.SecretSource | None]:
        """Where the host's and the controller's DH-HMAC-CHAP secrets come from (not read)."""
        return auth.secret_sources(self.dhchap_secret, self.dhchap_ctrl_secret)


def keyring_psk(name: str, identities: list[str]) -> tls_psk.TlsPsk | None:
    """The TLS PSK under the first of ``identities`` that keyring ``name`` holds; None if it
    holds none of them."""
    ring = keyring.find_keyring(name)
    for identity in identities:
        key = keyring.search(ring, identity)
        if key is not None:
            try:
                return tls_psk.keyring_psk(identity, keyring.read(key))
            except ValueError as exc:
                raise InvalidArgument(f"keyring {name}: key {identity!r} {exc}") from None
    return None
