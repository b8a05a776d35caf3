"""In-band authentication (DH-HMAC-CHAP) of a queue right after its Fabrics Connect.

Like the kernel host (``drivers/nvme/host/auth.c``): every queue, admin and I/O,
runs Negotiate, Challenge, Reply, Success1 and, when a controller secret is
given, checks the controller's response and sends Success2.  The messages and
the maths are in :mod:`nvmeof_fuse.nvme.auth`; this module moves them through
Authentication Send and Receive and turns failures into one-line errors that
name the AUTH_Failure reason and where the secret came from (a :class:`SecretSource`:
inline, or a file), never the secret.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import secrets
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..errors import (
    CommandTimeout,
    ConnectError,
    InvalidArgument,
    NVMeoFError,
    TransportError,
)
from ..nvme import auth
from ..ratelimit import RateLimitedLog

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)  # a target that drops each connection makes us authenticate again

Send = Callable[..., Awaitable[None]]
"""``send(message, prompt=False)``: ``prompt`` waits only as long as a live target needs."""
Receive = Callable[..., Awaitable[bytes]]
"""``receive(prompt=False)``, as ``send``."""

_seqnum = itertools.count(secrets.randbelow(1 << 31) + 1)  # like nvme_auth_get_seqnum


def next_seqnum() -> int:
    """A sequence number for the host's challenge to the controller (never 0)."""
    return next(_seqnum) % 0xFFFFFFFF + 1


class AuthenticationError(ConnectError):
    """The target or this host refused the DH-HMAC-CHAP exchange.

    ``final``: trying again with the same secrets cannot help (the kernel's EKEYREJECTED
    and ENOKEY, which end its reconnects); not for a timeout or a lost connection.
    """

    def __init__(self, message: str, *, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


INSECURE_MODE_BITS = 0o077
"""A secret file with any of these permission bits is refused, as ssh refuses such a key."""
SECRET_FILE_MAX = 4096  # bytes read of a secret file (a secret is about 100)


def is_inline(value: str) -> bool:
    """Whether an option's value is the secret itself (``DHHC-1:...:``) rather than a path.

    Any colon counts: a mistyped secret is then never read as a path and echoed.
    """
    return ":" in value


@dataclass(frozen=True)
class SecretSource:
    """Where a DH-HMAC-CHAP secret comes from: given inline, or a file read at each use.

    ``str()`` names it for messages and :attr:`shown` for ``.nvmeof``; neither holds the secret.
    """

    option: str
    """The option that gave it, as messages name it (``--dhchap-secret``)."""
    path: str | None = None
    inline: str | None = field(default=None, repr=False)

    @classmethod
    def of(cls, value: str, option: str) -> SecretSource:
        """``value`` is the secret itself or the path of a file holding it (nvme-cli's form)."""
        return cls(option, inline=value) if is_inline(value) else cls(option, path=value)

    def __str__(self) -> str:
        if self.path is None:
            return f"{self.option} (inline)"
        return f"{self.option} file {self.path}"

    @property
    def shown(self) -> str:
        """``inline``, or the file's absolute path."""
        return "inline" if self.path is None else os.path.abspath(self.path)

    def text(self, allow_insecure: bool = False) -> str:
        """The secret's text: the inline value, or the file read now (:func:`read_secret_file`)."""
        if self.path is None:
            return (self.inline or "").strip()
        return read_secret_file(self.path, self.option, allow_insecure)

    def load(self, allow_insecure: bool = False) -> auth.Secret:
        """The parsed secret; errors name the source, never the secret."""
        text = self.text(allow_insecure)
        try:
            return auth.parse_secret(text)
        except ValueError as exc:
            raise InvalidArgument(f"{self} {exc}") from None


def read_secret_file(path: str, option: str, allow_insecure: bool = False) -> str:
    """The secret in the file at ``path`` (a symlink is followed: its target is checked).

    As ssh does for a private key, a file that group or others may access is refused,
    unless ``allow_insecure``; so is anything but a regular file (a FIFO would block).
    """
    where = f"{option} file {path}"
    real = os.path.realpath(path)
    if real != os.path.abspath(path):
        where += f" (-> {real})"
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if "/" in path or os.path.lexists(path):
            raise InvalidArgument(f"{where}: {exc.strerror}") from None
        kind = ("an NVMeTLSkey-1:hh:<base64>: key" if option == "--tls-key"
                else "a DHHC-1:0N:<base64>: secret")
        raise InvalidArgument(f"{option} is neither {kind} nor the path of a file holding "
                              "one") from None
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"{where} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & INSECURE_MODE_BITS and not allow_insecure:
            raise InvalidArgument(f"{where}: permissions {mode:04o} are too open (group or "
                                  f"others may read the secret): chmod 600 {real}, or give "
                                  "--allow-insecure-secret-file")
        data = f.read(SECRET_FILE_MAX)
    return data.decode("ascii", errors="replace").strip()


def secret_sources(secret: str | None, ctrl_secret: str | None
                   ) -> tuple[SecretSource | None, SecretSource | None]:
    """ConnectOptions' ``dhchap_secret`` and ``dhchap_ctrl_secret`` as sources (nothing read)."""
    if ctrl_secret and not secret:
        raise InvalidArgument("--dhchap-ctrl-secret needs --dhchap-secret (the host "
                              "authenticates first)")
    return (SecretSource.of(secret, "--dhchap-secret") if secret else None,
            SecretSource.of(ctrl_secret, "--dhchap-ctrl-secret") if ctrl_secret else None)


def refused_after_reply(host_source: str) -> str:
    return ("the target closed the connection after the host's DH-HMAC-CHAP_Reply, so it "
            f"likely rejected the secret (is {host_source} the host key the target has for "
            "this host NQN?)")


class DhChap:
    """The host's secrets for one controller; :meth:`authenticate` runs one queue's exchange."""

    def __init__(self, secret: auth.Secret, ctrl_secret: auth.Secret | None,
                 hostnqn: str, subnqn: str, *, host_source: str = "--dhchap-secret",
                 ctrl_source: str = "--dhchap-ctrl-secret") -> None:
        self.hostnqn, self.subnqn = hostnqn, subnqn
        self.host_source, self.ctrl_source = host_source, ctrl_source
        """Where the secrets came from, for messages (:class:`SecretSource`'s ``str``)."""
        self._host_key = auth.transform_key(secret, hostnqn)
        self._ctrl_key = (auth.transform_key(ctrl_secret, subnqn)
                          if ctrl_secret is not None else None)
        self._tid = itertools.count(secrets.randbelow(1 << 16))

    @property
    def bidirectional(self) -> bool:
        return self._ctrl_key is not None

    async def authenticate(self, send: Send, receive: Receive) -> str:
        """Run the exchange; returns "hash, DH group" or raises AuthFailure.

        A failure this host finds is reported to the controller with AUTH_Failure2.
        """
        tid = next(self._tid) & 0xFFFF
        await send(auth.negotiate(tid))
        try:
            challenge = auth.parse_challenge(await receive(), tid)
            hash_id, group = challenge.hash_id, challenge.dh_group
            c1 = challenge.challenge
            dh_value, session_key = b"", b""
            if group != auth.DhGroup.NULL:
                private = auth.dh_private_key(group)
                dh_value = auth.dh_public_value(group, private)
                session_key = auth.dh_session_key(group, private, challenge.dh_value)
                c1 = auth.augmented_challenge(hash_id, session_key, c1)
            response = auth.host_response(hash_id, self._host_key, c1, challenge.seqnum, tid,
                                          self.hostnqn, self.subnqn)
            c2, s2 = None, 0
            if self._ctrl_key is not None:
                c2, s2 = secrets.token_bytes(auth.hash_length(hash_id)), next_seqnum()
            try:
                await send(auth.reply(tid, response, c2, s2, dh_value))
                # the answer was made while the Reply was checked: a live target gives it at
                # once, and nvmet closes the connection as it rejects a response, which over
                # RDMA (rxe) was seen to go unnoticed: so wait only as long as a live one needs
                answer = await receive(prompt=True)
            except TransportError as exc:
                # nvmet tears the controller down as it answers AUTH_Failure1, and the
                # answer can lose that race: the transport then sees the connection close
                # Not final (the kernel retries a lost connection too): only the target's own
                # AUTH_Failure1 proves the secret wrong, and a reconnect says it again if so.
                log.debug("connection lost after the DH-HMAC-CHAP_Reply: %s", exc)
                raise AuthenticationError(refused_after_reply(self.host_source)) from None
            except CommandTimeout as exc:
                raise AuthenticationError(f"no answer to the host's DH-HMAC-CHAP_Reply ({exc}): "
                                          "the target likely closed the connection as it "
                                          f"rejected the secret (is {self.host_source} "
                                          "right?)") from None
            success = auth.parse_success1(answer, tid, hash_id)
            if self._ctrl_key is not None:
                assert c2 is not None
                if success.response is None:
                    raise auth.AuthFailure(auth.FailureReason.FAILED,
                                           "the controller did not answer the host's challenge")
                if session_key:
                    c2 = auth.augmented_challenge(hash_id, session_key, c2)
                expected = auth.controller_response(hash_id, self._ctrl_key, c2, s2, tid,
                                                    self.hostnqn, self.subnqn)
                if not hmac.compare_digest(expected, success.response):
                    raise auth.AuthFailure(auth.FailureReason.FAILED,
                                           "the controller's response does not match "
                                           f"{self.ctrl_source}")
                await send(auth.success2(tid))
        except auth.AuthFailure as failure:
            if not failure.by_controller:
                try:
                    await send(auth.failure2(tid, failure.code), prompt=True)
                except NVMeoFError as exc:
                    log.debug("AUTH_Failure2 not delivered: %s", exc)
            raise
        return f"{auth.hash_name(hash_id)}, {auth.DhGroup(group).name.lower()}"


def host_dhchap(host: SecretSource | None, ctrl: SecretSource | None, hostnqn: str,
                subnqn: str, *, allow_insecure: bool = False) -> DhChap | None:
    """The DhChap for these secrets (files read now); None when no secret is given."""
    if host is None:
        if ctrl is not None:
            raise InvalidArgument("--dhchap-ctrl-secret needs --dhchap-secret (the host "
                                  "authenticates first)")
        return None
    return DhChap(host.load(allow_insecure),
                  ctrl.load(allow_insecure) if ctrl is not None else None, hostnqn, subnqn,
                  host_source=str(host), ctrl_source=str(ctrl) if ctrl is not None else "")


def dhchap_mode(dhchap: DhChap | None) -> str:
    """What ``.nvmeof/controller`` shows: off, host, or bidirectional (never a secret)."""
    if dhchap is None:
        return "off"
    return "bidirectional" if dhchap.bidirectional else "host"


async def authenticate_queue(dhchap: DhChap | None, qid: int, where: str,
                             send: Send, receive: Receive) -> None:
    """Authenticate queue ``qid`` after a Connect that asked for it; one-line errors."""
    if dhchap is None:
        raise AuthenticationError(f"{where} requires in-band authentication (DH-HMAC-CHAP): "
                                  "give the host's secret with --dhchap-secret", final=True)
    try:
        how = await dhchap.authenticate(send, receive)
    except auth.AuthFailure as failure:
        hint = ""
        if failure.by_controller and failure.code == auth.FailureReason.FAILED:
            hint = (f" (is {dhchap.host_source} the host key the target has for this host "
                    "NQN?)")
        raise AuthenticationError(f"{where}: authentication of queue {qid} failed: "
                                  f"{failure}{hint}", final=True) from None
    except NVMeoFError as exc:
        final = isinstance(exc, AuthenticationError) and exc.final
        raise AuthenticationError(f"{where}: authentication of queue {qid} failed: "
                                  f"{exc}", final=final) from None
    if qid == 0:
        mode = "bidirectional" if dhchap.bidirectional else "host only"
        limited.log("authenticated", logging.INFO, "authenticated to %s with DH-HMAC-CHAP (%s, "
                    "%s) from %s", where, how, mode, dhchap.host_source)


def queue_messages(ctrl, queue) -> tuple[Send, Receive]:
    """Send and Receive over ``queue`` through the controller's registered scratch buffer."""
    from ..nvme import NULL_SGL
    from ..nvme import command as cmd

    opts = ctrl.options
    # a prompt answer comes within the keep-alive timeout, or the connection is gone (the
    # kernel's keep-alive rule; nvmet also expires an unfinished transaction after KATO)
    prompt_timeout = min(opts.timeout, opts.keep_alive_tmo or opts.timeout)

    async def send(message: bytes, prompt: bool = False) -> None:
        timeout = prompt_timeout if prompt else opts.timeout
        async with ctrl.scratch(len(message)) as ref:
            ref.region.view[: len(message)] = message
            completion = await queue.execute(cmd.auth_send(len(message), sgl=NULL_SGL), ref,
                                             to_controller=True, timeout=timeout)
            completion.raise_for_status("Authentication Send", fabrics=True)

    async def receive(prompt: bool = False) -> bytes:
        timeout = prompt_timeout if prompt else opts.timeout
        async with ctrl.scratch(auth.RECEIVE_BUFFER) as ref:
            completion = await queue.execute(cmd.auth_receive(auth.RECEIVE_BUFFER, sgl=NULL_SGL),
                                             ref, timeout=timeout)
            completion.raise_for_status("Authentication Receive", fabrics=True)
            return bytes(ref.region.view[: auth.RECEIVE_BUFFER])

    return send, receive
