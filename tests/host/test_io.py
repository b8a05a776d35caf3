"""The Controller is what its namespaces and its event loop take it for: every member
that :class:`CommandIssuer` and :class:`EventSource` name, with the same parameters."""

from __future__ import annotations

import inspect

import pytest
import trio

from nvmeof_fuse.host.controller import ConnectOptions, Controller
from nvmeof_fuse.host.events import EventSource
from nvmeof_fuse.host.io import CommandIssuer


def members(protocol: type) -> dict[str, object]:
    """The attributes (None) and methods or properties a protocol names."""
    named: dict[str, object] = dict.fromkeys(protocol.__annotations__)
    named.update({name: value for name, value in vars(protocol).items()
                  if not name.startswith("_") and (callable(value) or isinstance(value, property))})
    return named


def takes_the_same_calls(implementation, declared) -> bool:
    """Whether ``implementation`` has ``declared``'s parameters, and more only with defaults."""
    have = list(inspect.signature(implementation).parameters.values())
    want = [(p.name, p.kind) for p in inspect.signature(declared).parameters.values()]
    return ([(p.name, p.kind) for p in have[:len(want)]] == want
            and all(p.default is not p.empty for p in have[len(want):]))


class NoTransport:
    address = "rdma 192.0.2.1:4420"


def a_controller() -> Controller:
    async def main() -> Controller:
        async with trio.open_nursery() as nursery:
            return Controller(ConnectOptions("192.0.2.1", "nqn.2014-08.org.example:t"),
                              NoTransport(), nursery)  # type: ignore[arg-type]

    return trio.run(main)


@pytest.mark.parametrize("protocol", [CommandIssuer, EventSource])
def test_a_controller_has_every_member_the_protocol_names(protocol):
    ctrl = a_controller()
    for name, member in members(protocol).items():
        assert hasattr(ctrl, name), name
        if isinstance(member, property):
            assert isinstance(inspect.getattr_static(Controller, name), property), name
        elif member is not None:
            assert takes_the_same_calls(getattr(Controller, name), member), name


def test_the_issuer_names_only_what_a_namespace_uses():
    """Kept small, so that a multipath head can be one too."""
    assert sorted(members(CommandIssuer)) == [
        "bounce", "io_command", "io_failed", "live", "max_transfer", "scratch", "start_io",
        "wait_live"]
