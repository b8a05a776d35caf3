"""host/identity.py: a namespace's identity read as the kernel reads it, duplicates refused,
a controller of another subsystem refused in one line (the target's side faked)."""

from __future__ import annotations

import logging
import struct
from types import SimpleNamespace

import pytest
import trio

from nvmeof_fuse.errors import ControllerChanged, NamespaceUnavailable
from nvmeof_fuse.host.identity import (
    NO_IDS,
    IdentityIndex,
    check_controller,
    namespace_identity,
    replaced_line,
)
from nvmeof_fuse.host.namespace import Namespace
from nvmeof_fuse.nvme import (
    Cns,
    IdentifyController,
    IdentifyNamespace,
    NamespaceIdentity,
    NamespaceIds,
    NVMeStatusError,
)

NGUID = bytes(range(16))
UUID = bytes(range(16, 32))


def identify_namespace(nlb: int = 100, nguid: bytes = NGUID) -> IdentifyNamespace:
    data = bytearray(4096)
    struct.pack_into("<QQQ", data, 0, nlb, nlb, 0)
    data[104:120] = nguid
    data[130] = 9
    return IdentifyNamespace.from_bytes(bytes(data))


def source(descriptors: bytes | Exception):
    async def identify_raw(cns: int, nsid: int = 0) -> bytes:
        assert cns == Cns.NS_DESCRIPTOR_LIST and nsid == 7
        if isinstance(descriptors, Exception):
            raise descriptors
        return descriptors
    return SimpleNamespace(options=SimpleNamespace(nqn="nqn.2014-08.org.example:t"),
                           identify_raw=identify_raw)


def test_the_descriptor_list_adds_to_identify_namespace():
    ident = identify_namespace()
    ctrl = source(NamespaceIds(uuid=UUID, csi=0).to_descriptors())
    got = trio.run(namespace_identity, ctrl, 7, ident)
    assert got == NamespaceIdentity(NamespaceIds(nguid=NGUID, uuid=UUID), 9, 0, 100)


@pytest.mark.parametrize("answer", [
    NVMeStatusError(0x4002, "Identify"),  # a controller without the list (Invalid Field)
    struct.pack("<BBxx", 2, 8) + bytes(4092),  # a list we refuse (NGUID of 8 bytes)
], ids=["no list", "bad list"])
def test_without_a_usable_list_identify_namespace_says_it_all(answer):
    got = trio.run(namespace_identity, source(answer), 7, identify_namespace())
    assert got == NamespaceIdentity(NamespaceIds(nguid=NGUID), 9, 0, 100)


def test_namespaces_without_identifiers_share_one_object_for_them():
    """A target may have 65,536 namespaces, each kept: those that report no identifiers
    hold one NamespaceIds between them."""
    ctrl = source(bytes(4096))
    a, b = (trio.run(namespace_identity, ctrl, 7, identify_namespace(nguid=bytes(16)))
            for _ in range(2))
    assert a.ids is b.ids is NO_IDS


def test_the_replaced_line_names_the_nsid_and_both_identities():
    old = NamespaceIdentity(NamespaceIds(nguid=NGUID), 9, 0, 100)
    new = NamespaceIdentity(NamespaceIds(nguid=UUID), 9, 0, 100)
    line = replaced_line("nqn.x", 3, old, new, old.change(new))
    assert line.startswith(f"namespace n3 of nqn.x is another namespace now (NGUID {NGUID.hex()}"
                           f" != {UUID.hex()}): it was NGUID {NGUID.hex()}, 512 B LBAs, it is "
                           f"NGUID {UUID.hex()}, 512 B LBAs")
    assert "\n" not in line


def namespace(nsid: int, nguid: bytes = NGUID) -> Namespace:
    ns = Namespace(SimpleNamespace(), nsid, identify_namespace(nguid=nguid))
    ns.identity = NamespaceIdentity.of(ns.identify)
    return ns


def test_a_namespace_that_reports_another_ones_identifiers_is_refused_as_unavailable():
    first, duplicate, other = namespace(1), namespace(2), namespace(3, UUID)
    index = IdentityIndex([(1, first)])
    index.claim(2, duplicate)
    index.claim(3, other)
    assert not first.unavailable and not other.unavailable
    assert duplicate.unavailable == (f"it reports the identifiers of namespace n1 (NGUID "
                                     f"{NGUID.hex()})")
    assert duplicate.size == 0
    with pytest.raises(NamespaceUnavailable, match="namespace n2 is unavailable: it reports"):
        trio.run(duplicate.read_lbas, 0, 1)
    duplicate.resize(identify_namespace(nlb=200))  # stays refused
    assert duplicate.size == 0


def test_namespaces_without_identifiers_are_never_duplicates():
    a, b = namespace(1, bytes(16)), namespace(2, bytes(16))
    IdentityIndex([(1, a), (2, b)])
    assert not a.unavailable and not b.unavailable


def controller(serial: bytes) -> IdentifyController:
    b = bytearray(4096)
    b[4:4 + len(serial)] = serial
    b[24:29] = b"model"
    b[768:773] = b"nqn.x"
    return IdentifyController.from_bytes(bytes(b))


def test_a_controller_of_another_subsystem_is_refused_in_one_line(caplog):
    check_controller(None, controller(b"A"), "anywhere")  # nothing to compare with
    check_controller(controller(b"A"), controller(b"A"), "here")
    with caplog.at_level(logging.DEBUG), pytest.raises(ControllerChanged) as refused:
        check_controller(controller(b"A"), controller(b"B"), "the controller at tcp 1.2.3.4")
    assert str(refused.value) == ("the controller at tcp 1.2.3.4 is not the controller we "
                                  "mounted: its serial number 'A' != 'B'; refused")
