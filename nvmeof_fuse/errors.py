"""Exceptions shared by every layer.

Every error a user can cause derives from :class:`NVMeoFError` and carries a
one-line message that names the problem; the CLI prints ``str(exc)`` and
exits non-zero, never a traceback.
"""

from __future__ import annotations

import errno as _errno


class NVMeoFError(Exception):
    """Base of all nvmeof-fuse errors; ``errno`` is what the filesystem returns."""

    errno: int = _errno.EIO


class ConnectError(NVMeoFError):
    """A queue or controller could not be connected (address, route, NQN, refusal)."""

    errno = _errno.ENOTCONN


class KeyRejected(ConnectError):
    """The target refused this host's key (a TLS handshake it failed with an alert that says
    so: it holds no PSK, or another one, for our identity).  The same key fails again, so
    reconnecting stops, as for the kernel's EKEYREJECTED and a rejected DH-HMAC-CHAP secret."""


class DeviceMismatch(ConnectError):
    """A path's queues went through another local device than the one it must use
    (``host_iface``): the message names both."""


class CommandTimeout(NVMeoFError):
    """A command got no completion within its timeout."""

    errno = _errno.ETIMEDOUT


class TransportError(NVMeoFError):
    """The transport failed (a failed work completion, a lost connection)."""

    errno = _errno.EIO
    sent = True
    """Whether the command it failed was in flight (False: its queue had failed before it
    was sent, so it costs no try of the command's retry budget)."""


class TargetProtocolError(NVMeoFError):
    """The target claimed something we refuse to act on (a log page or list longer than
    our bounds): a fault of the target, not of the connection."""

    errno = _errno.EIO


class ControllerLost(NVMeoFError):
    """The connection to the controller is gone and reconnecting gave up (or is off)."""

    errno = _errno.EIO


class InvalidArgument(NVMeoFError):
    """A caller passed a bad value (an out-of-range LBA, a misaligned buffer)."""

    errno = _errno.EINVAL


class NamespaceUnavailable(NVMeoFError):
    """The target describes the namespace with values we cannot serve (its LBA size, its
    size): it shows with size 0, and opening it fails."""

    errno = _errno.ENXIO


def unavailable_line(nsid: int, why: str) -> str:
    """The one line that says namespace ``nsid`` is unavailable (NamespaceUnavailable), and why."""
    return f"namespace n{nsid} is unavailable: {why}"


class NamespaceRemoved(NVMeoFError):
    """The namespace was removed from the subsystem (detached or disabled on the target)."""

    errno = _errno.ENODEV


class NamespaceReplaced(NamespaceRemoved):
    """Another namespace answers behind the NSID now (its identifiers or format changed, or,
    where it reports none, its size): whatever was opened of the old one fails from then on,
    and never reaches the new one."""

    errno = _errno.EIO


class ControllerChanged(ConnectError):
    """A reconnect reached a controller that is not of the subsystem we mounted (another
    subsystem NQN, serial number or model number): refused, as a failed reconnect."""
