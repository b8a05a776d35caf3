"""When reconnecting stops before --ctrl-loss-tmo: DNR and rejected secrets or TLS PSKs, as the
kernel."""

from __future__ import annotations

import pytest

from nvmeof_fuse.errors import ConnectError, KeyRejected, TransportError
from nvmeof_fuse.host.auth import AuthenticationError
from nvmeof_fuse.host.reconnect_policy import final_failure
from nvmeof_fuse.nvme import NVMeStatusError

DNR = 1 << 14
INVALID_PARAMETERS = 1 << 8 | 0x82  # SCT 1 (command specific), Connect Invalid Parameters
INVALID_HOST = 1 << 8 | 0x84


def connect_failed(status: int) -> ConnectError:
    try:
        raise NVMeStatusError(status, "Connect", fabrics=True)
    except NVMeStatusError as exc:
        try:
            raise ConnectError(f"connect to rdma 192.0.2.1:4420 failed: {exc}") from exc
        except ConnectError as outer:
            return outer


@pytest.mark.parametrize("exc, final", [
    (connect_failed(DNR | INVALID_HOST), True),  # not allowed: nothing changes by retrying
    (connect_failed(INVALID_HOST), False),  # no DNR: may try again
    (connect_failed(DNR | INVALID_PARAMETERS), False),  # nvmet: the subsystem is off the port
    (AuthenticationError("rejected", final=True), True),  # the kernel's EKEYREJECTED, ENOKEY
    (AuthenticationError("no answer to the host's DH-HMAC-CHAP_Reply"), False),
    (KeyRejected("the TLS handshake failed: sslv3 alert illegal parameter"), True),
    (TransportError("connect refused"), False),
    (ConnectError("no RDMA route"), False),
])
def test_what_ends_reconnecting(exc, final):
    assert final_failure(exc) is final


def test_a_suppressed_context_does_not_count():
    try:
        try:
            raise NVMeStatusError(DNR | INVALID_HOST, "Connect", fabrics=True)
        except NVMeStatusError:
            raise TransportError("later, unrelated") from None
    except TransportError as exc:
        assert not final_failure(exc)
