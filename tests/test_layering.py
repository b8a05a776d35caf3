"""Each layer imports only the layers below it.

nvme, transport < host < fs, companion < daemon, inprocess (nvmeof_fuse.mount), cli.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def loaded_after_import(module: str) -> set[str]:
    """The nvmeof_fuse modules a fresh interpreter holds after importing ``module``."""
    code = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('nvmeof_fuse'))))")
    out = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return set(json.loads(out))


def within(modules: set[str], package: str) -> list[str]:
    return sorted(m for m in modules if m == package or m.startswith(package + "."))


@pytest.mark.parametrize("module", ["nvmeof_fuse.transport.rdma", "nvmeof_fuse.transport.tcp",
                                    "nvmeof_fuse.nvme"])
def test_wire_formats_and_transports_load_nothing_of_the_host(module):
    assert within(loaded_after_import(module), "nvmeof_fuse.host") == []


@pytest.mark.parametrize("module", ["nvmeof_fuse.host", "nvmeof_fuse.host.controller",
                                    "nvmeof_fuse.host.namespace", "nvmeof_fuse.host.sync",
                                    "nvmeof_fuse.host.discovery", "nvmeof_fuse.host.ramdisk"])
def test_the_host_loads_nothing_of_the_filesystem_or_the_companion(module):
    loaded = loaded_after_import(module)
    assert within(loaded, "nvmeof_fuse.fs") + within(loaded, "nvmeof_fuse.companion") == []


TOP = ("nvmeof_fuse.daemon", "nvmeof_fuse.inprocess", "nvmeof_fuse.cli")


@pytest.mark.parametrize("module", ["nvmeof_fuse.companion", "nvmeof_fuse.companion.server",
                                    "nvmeof_fuse.companion.direct", "nvmeof_fuse.fs.mount"])
def test_the_filesystem_and_the_companion_load_nothing_above_them(module):
    loaded = loaded_after_import(module)
    assert [m for m in TOP if m in loaded] == []
    if module.startswith("nvmeof_fuse.fs"):
        assert within(loaded, "nvmeof_fuse.companion") == []
