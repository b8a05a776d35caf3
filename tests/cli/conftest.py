"""The CLI tests' fixtures."""

import contextlib
import sys
import types

import pytest
from cli_fakes import FakeConnectOptions, fake_multipath
from fakes import make_controller


@pytest.fixture
def host(monkeypatch):
    """Fake nvmeof_fuse.host.controller / .discovery modules; records connects."""
    state = types.SimpleNamespace(connects=[], error=None, page=None)

    @contextlib.asynccontextmanager
    async def connect(opts):
        state.connects.append(opts)
        if state.error:
            raise state.error
        yield make_controller((1, 512, 64))

    async def discover(opts):
        state.connects.append(opts)
        return state.page

    ctrl_mod = types.ModuleType("nvmeof_fuse.host.controller")
    ctrl_mod.ConnectOptions, ctrl_mod.connect = FakeConnectOptions, connect
    disc_mod = types.ModuleType("nvmeof_fuse.host.discovery")
    disc_mod.discover = discover
    monkeypatch.setitem(sys.modules, "nvmeof_fuse.host.controller", ctrl_mod)
    monkeypatch.setitem(sys.modules, "nvmeof_fuse.host.discovery", disc_mod)
    monkeypatch.setitem(sys.modules, "nvmeof_fuse.host.multipath.head",
                        fake_multipath(connect, state))
    return state

