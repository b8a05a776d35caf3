"""The TLS 1.3 handshake of an NVMe/TCP connection, with an external PSK, by OpenSSL.

As nvme-cli and tlshd do it: TLS 1.3 only, the PSK's identity and key only (no
certificates: a server that offers one instead of taking the PSK is refused), its suite by
the key's hash (TLS_AES_128_GCM_SHA256 or TLS_AES_256_GCM_SHA384), psk_dhe_ke offered and
psk_ke accepted, no session tickets.  OpenSSL does the handshake over the connection's
non-blocking socket (:func:`handshake` waits on trio between its steps, under the caller's
deadline; :func:`handshake_blocking` polls, for threads); its keylog callback hands on the
two application traffic secrets, from which :mod:`~nvmeof_fuse.nvme.tls_record` derives the
record keys for the kernel or the userspace record layer (:mod:`.tls_records`).

The server side (:func:`server`) is here for the tests' fake target and for a TLS front;
the host never uses it.
"""

from __future__ import annotations

import ctypes
import errno
import select
import time
from dataclasses import dataclass, field

import trio

from ...nvme.tls_record import SUITES
from . import libssl
from .libssl import (
    KEYLOG_CB,
    PSK_FIND_SESSION_CB,
    PSK_USE_SESSION_CB,
    SSL_ERROR_SSL,
    SSL_ERROR_SYSCALL,
    SSL_ERROR_WANT_READ,
    SSL_ERROR_WANT_WRITE,
    SSL_ERROR_ZERO_RETURN,
    TLS1_3_VERSION,
)

KEYLOG_LABELS = {b"CLIENT_TRAFFIC_SECRET_0": "client", b"SERVER_TRAFFIC_SECRET_0": "server"}
UNEXPECTED_EOF = "unexpected eof while reading"
"""OpenSSL 3's reason for a close without close_notify (1.1 gave SSL_ERROR_SYSCALL)."""
REFUSED_KEY = ("decrypt error", "handshake failure", "unknown psk identity", "bad record mac",
               "illegal parameter", "insufficient security")
"""Alerts a target sends when it does not take our PSK (OpenSSL's reason texts)."""
NOT_TLS = ("wrong version number", "packet length too long", "record layer failure",
           "unexpected message", "record too large")
"""What OpenSSL says when the peer does not speak TLS."""


class HandshakeError(Exception):
    """The handshake failed; the message says why, in one line (no key in it)."""


@dataclass(frozen=True)
class Secrets:
    """What a finished handshake hands the record layer."""

    suite: str
    client: bytes = field(repr=False)
    """CLIENT_TRAFFIC_SECRET_0: the host's sending direction."""
    server: bytes = field(repr=False)


class Connection:
    """One OpenSSL ``SSL`` over a socket's fd, client or server, until :meth:`close`."""

    def __init__(self, fd: int, *, server: bool, suite: str, identity: bytes | None = None,
                 key: bytes | None = None, keys: dict[bytes, bytes] | None = None) -> None:
        if suite not in SUITES:
            raise ValueError(f"cipher suite {suite} is not one NVMe/TCP uses")
        self._ssl_lib, _ = libssl.libs()
        lib = self._ssl_lib
        self.suite = suite
        self.server = server
        self._identity = ctypes.create_string_buffer(identity or b"", len(identity or b""))
        self._key = key
        self._keys = keys or {}
        self._secrets: dict[str, bytes] = {}
        self._ctx = lib.SSL_CTX_new(lib.TLS_server_method() if server
                                    else lib.TLS_client_method())
        self._ssl = None
        if not self._ctx:
            raise HandshakeError(f"OpenSSL could not make a TLS context: {libssl.last_error()}")
        try:
            self._configure(fd)
        except BaseException:
            self.close()
            raise

    def _configure(self, fd: int) -> None:
        lib = self._ssl_lib
        ctx = self._ctx
        lib.SSL_CTX_ctrl(ctx, libssl.SSL_CTRL_SET_MIN_PROTO_VERSION, TLS1_3_VERSION, None)
        lib.SSL_CTX_ctrl(ctx, libssl.SSL_CTRL_SET_MAX_PROTO_VERSION, TLS1_3_VERSION, None)
        # No read-ahead (OpenSSL's default, made sure): the handshake reads no byte past its
        # own records, which the kernel's record layer must get once it takes the socket.
        lib.SSL_CTX_ctrl(ctx, libssl.SSL_CTRL_SET_READ_AHEAD, 0, None)
        options = libssl.SSL_OP_NO_TICKET
        if not self.server:
            options |= libssl.SSL_OP_ALLOW_NO_DHE_KEX  # offer psk_ke beside psk_dhe_ke
        lib.SSL_CTX_set_options(ctx, options)
        if lib.SSL_CTX_set_ciphersuites(ctx, self.suite.encode()) != 1:
            raise HandshakeError(f"OpenSSL refused the suite {self.suite}: "
                                 f"{libssl.last_error()}")
        lib.SSL_CTX_set_num_tickets(ctx, 0)
        if not self.server:
            # No certificate is trusted: only the PSK can authenticate the target.
            lib.SSL_CTX_set_verify(ctx, libssl.SSL_VERIFY_PEER
                                   | libssl.SSL_VERIFY_FAIL_IF_NO_PEER_CERT, None)
        self._keylog_cb = KEYLOG_CB(self._keylog)
        lib.SSL_CTX_set_keylog_callback(ctx, self._keylog_cb)
        if self.server:
            self._psk_cb = PSK_FIND_SESSION_CB(self._find_session)
            lib.SSL_CTX_set_psk_find_session_callback(ctx, self._psk_cb)
        else:
            self._psk_cb = PSK_USE_SESSION_CB(self._use_session)
            lib.SSL_CTX_set_psk_use_session_callback(ctx, self._psk_cb)
        self._ssl = lib.SSL_new(ctx)
        if not self._ssl or lib.SSL_set_fd(self._ssl, fd) != 1:
            raise HandshakeError(f"OpenSSL could not take the socket: {libssl.last_error()}")

    # -- OpenSSL's callbacks (they must not raise) ----------------------------------------------

    def _session(self, ssl, key: bytes):
        lib = self._ssl_lib
        session = lib.SSL_SESSION_new()
        if not session:
            return None
        cipher = lib.SSL_CIPHER_find(ssl, libssl.CIPHER_IDS[self.suite])
        if (not cipher or lib.SSL_SESSION_set1_master_key(session, key, len(key)) != 1
                or lib.SSL_SESSION_set_cipher(session, cipher) != 1
                or lib.SSL_SESSION_set_protocol_version(session, TLS1_3_VERSION) != 1):
            lib.SSL_SESSION_free(session)
            return None
        return session  # OpenSSL frees it

    def _use_session(self, ssl, md, id_out, idlen_out, session_out) -> int:
        try:
            session = self._session(ssl, self._key or b"")
            if session is None:
                return 0
            id_out[0] = ctypes.cast(self._identity, ctypes.c_void_p).value
            idlen_out[0] = len(self._identity.raw)
            session_out[0] = session
            return 1
        except Exception:  # noqa: BLE001 - a callback from C: fail the handshake instead
            return 0

    def _find_session(self, ssl, identity, length, session_out) -> int:
        try:
            key = self._keys.get(ctypes.string_at(identity, length))
            session_out[0] = self._session(ssl, key) if key is not None else None
            return 1  # an unknown identity: no session, and the handshake fails
        except Exception:  # noqa: BLE001 - a callback from C
            return 0

    def _keylog(self, ssl, line: bytes) -> None:
        try:
            label, _, secret = line.split(b" ")
            if label in KEYLOG_LABELS:
                self._secrets[KEYLOG_LABELS[label]] = bytes.fromhex(secret.decode())
        except Exception:  # noqa: BLE001 - a callback from C; a missing secret fails later
            pass

    # -- the handshake ------------------------------------------------------------------------

    def step(self) -> str | None:
        """One go at the handshake: None once done, else "read" or "write" (what to wait
        for).  HandshakeError when it failed."""
        lib = self._ssl_lib
        ret = (lib.SSL_accept if self.server else lib.SSL_connect)(self._ssl)
        if ret == 1:
            return None
        err = lib.SSL_get_error(self._ssl, ret)
        if err == SSL_ERROR_WANT_READ:
            return "read"
        if err == SSL_ERROR_WANT_WRITE:
            return "write"
        reason = libssl.last_error()
        if err == SSL_ERROR_SYSCALL:
            code = ctypes.get_errno()
            if ret == 0 or code in (0, errno.ECONNRESET, errno.EPIPE):
                raise HandshakeError("the peer closed the connection during the TLS handshake")
            raise HandshakeError(f"the TLS handshake failed: {errno.errorcode.get(code, code)}")
        if err == SSL_ERROR_ZERO_RETURN:
            raise HandshakeError("the peer ended TLS during the handshake")
        if err == SSL_ERROR_SSL and reason == UNEXPECTED_EOF:
            # OpenSSL 3's word for a close without an alert: what nvmet does when tlshd
            # refuses a PSK (its handshake fails and the kernel closes the socket)
            raise HandshakeError("the peer closed the connection during the TLS handshake")
        if err == SSL_ERROR_SSL and reason:
            raise HandshakeError(f"the TLS handshake failed: {reason}")
        raise HandshakeError(f"the TLS handshake failed (OpenSSL error {err})")

    def secrets(self) -> Secrets:
        """The traffic secrets of the finished handshake, after checking it is what we
        asked for: TLS 1.3, our suite, the PSK (not a certificate)."""
        lib = self._ssl_lib
        if lib.SSL_version(self._ssl) != TLS1_3_VERSION:
            raise HandshakeError("the peer did not negotiate TLS 1.3")
        if lib.SSL_session_reused(self._ssl) != 1:
            raise HandshakeError("the peer did not take the PSK")
        cipher = lib.SSL_get_current_cipher(self._ssl)
        name = lib.SSL_CIPHER_get_name(cipher).decode() if cipher else "none"
        if name != self.suite:
            raise HandshakeError(f"the peer chose {name}, not {self.suite}")
        if set(self._secrets) != {"client", "server"}:
            raise HandshakeError("OpenSSL's keylog callback gave no traffic secrets")
        return Secrets(self.suite, self._secrets["client"], self._secrets["server"])

    # -- OpenSSL's own record layer (the fake target's TLS front) -----------------------------

    def read_into(self, buf) -> int:
        """SSL_read into ``buf``: bytes read, 0 at the peer's end; -1: wait for the socket."""
        lib = self._ssl_lib
        n = lib.SSL_read(self._ssl, libssl._address(buf), len(buf))
        if n > 0:
            return n
        err = lib.SSL_get_error(self._ssl, n)
        if err in (SSL_ERROR_WANT_READ, SSL_ERROR_WANT_WRITE):
            return -1
        reason = libssl.last_error()
        if err in (SSL_ERROR_ZERO_RETURN, SSL_ERROR_SYSCALL) or reason == UNEXPECTED_EOF:
            # a close without close_notify, as the kernel's
            return 0
        raise HandshakeError(f"SSL_read failed: {reason}")

    def close_notify(self) -> None:
        """Send a close_notify alert (SSL_shutdown's first half)."""
        self._ssl_lib.SSL_shutdown(self._ssl)

    def pending(self) -> int:
        return self._ssl_lib.SSL_pending(self._ssl)

    def buffered(self) -> bool:
        """Whether OpenSSL holds bytes it read from the socket and has not handed out (after
        the handshake: records past it, which a kernel record layer would then never see)."""
        return self._ssl_lib.SSL_has_pending(self._ssl) == 1

    def write(self, data: bytes) -> None:
        """SSL_write of all of ``data`` (a blocking socket)."""
        lib = self._ssl_lib
        view = memoryview(bytearray(data))
        while len(view):
            n = lib.SSL_write(self._ssl, libssl._address(view), len(view))
            if n <= 0:
                raise OSError(errno.EPIPE, f"SSL_write failed: {libssl.last_error()}")
            view = view[n:]

    def close(self) -> None:
        if self._ssl:
            self._ssl_lib.SSL_free(self._ssl)
            self._ssl = None
        if self._ctx:
            self._ssl_lib.SSL_CTX_free(self._ctx)
            self._ctx = None


def client(fd: int, identity: str, key: bytes, suite: str) -> Connection:
    """The host's side, offering ``identity`` and its TLS PSK ``key``."""
    return Connection(fd, server=False, suite=suite, identity=identity.encode(), key=key)


def server(fd: int, keys: dict[str, bytes], suite: str) -> Connection:
    """A target's side, taking the PSKs ``keys`` (by identity)."""
    return Connection(fd, server=True, suite=suite,
                      keys={identity.encode(): key for identity, key in keys.items()})


async def handshake(conn: Connection, sock) -> Secrets:
    """Run ``conn``'s handshake over ``sock`` (a trio socket), waiting on trio between
    steps; the caller's cancel scope bounds it.  The SSL object is freed either way."""
    try:
        while (wait := conn.step()) is not None:
            if wait == "read":
                await trio.lowlevel.wait_readable(sock)
            else:
                await trio.lowlevel.wait_writable(sock)
        return conn.secrets()
    finally:
        conn.close()


def handshake_blocking(conn: Connection, fd: int, timeout: float) -> Secrets:
    """The handshake on a non-blocking fd, polling it, within ``timeout`` seconds
    (HandshakeError once past it).  The SSL object stays for :meth:`Connection.read_into`."""
    deadline = time.monotonic() + timeout
    poll = select.poll()
    while (wait := conn.step()) is not None:
        poll.register(fd, select.POLLIN if wait == "read" else select.POLLOUT)
        left = deadline - time.monotonic()
        if left <= 0 or not poll.poll(left * 1000):
            raise HandshakeError(f"no TLS handshake within {timeout:g} s")
        poll.unregister(fd)
    return conn.secrets()
