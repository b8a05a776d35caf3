"""When reconnecting cannot succeed: the kernel's ``nvmf_should_reconnect``, one exception.

The kernel (``drivers/nvme/host/fabrics.c``) stops reconnecting on any status with Do Not
Retry set, and when authentication was rejected (``-EKEYREJECTED``) or had no key
(``-ENOKEY``).  We do the same, but keep retrying a Connect answered with Connect Invalid
Parameters: Linux nvmet answers exactly that, with DNR, while the subsystem is off the
port (``nvmet_find_get_subsys`` finds nothing: a port reconfiguration, a target restart
in progress, the outage tests' unlinked port), which ends when the subsystem is back.
A host that is not allowed (Connect Invalid Host) stops at once, and so does a TLS handshake
that the target refused for our PSK (:class:`~nvmeof_fuse.errors.KeyRejected`), as a
rejected DH-HMAC-CHAP secret does.
"""

from __future__ import annotations

from ..errors import KeyRejected
from ..nvme.status import SC_CONNECT_INVALID_PARAMETERS, SCT_COMMAND_SPECIFIC, NVMeStatusError
from .auth import AuthenticationError


def _causes(exc: BaseException):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def final_failure(exc: BaseException) -> bool:
    """Whether a reconnect that failed with ``exc`` cannot succeed by trying again."""
    for cause in _causes(exc):
        if isinstance(cause, KeyRejected):
            return True
        if isinstance(cause, AuthenticationError):
            return cause.final
        if isinstance(cause, NVMeStatusError):
            transient = (cause.sct, cause.sc) == (SCT_COMMAND_SPECIFIC,
                                                 SC_CONNECT_INVALID_PARAMETERS)
            return cause.dnr and not transient
    return False
