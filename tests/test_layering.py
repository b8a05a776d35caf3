"""Each layer imports only the layers below it.

nvme, transport < host < fs, companion < daemon, inprocess (nvmeof_fuse.mount), cli.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("module", ["nvmeof_fuse.transport.rdma.transport",
                                    "nvmeof_fuse.transport.tcp.transport", "nvmeof_fuse.nvme"])
def test_wire_formats_and_transports_load_nothing_of_the_host(module):
    assert within(loaded_after_import(module), "nvmeof_fuse.host") == []


@pytest.mark.parametrize("module", ["nvmeof_fuse.host", "nvmeof_fuse.host.controller",
                                    "nvmeof_fuse.host.namespace.namespace", "nvmeof_fuse.host.sync",
                                    "nvmeof_fuse.host.discovery"])
def test_the_host_loads_nothing_of_the_filesystem_or_the_companion(module):
    loaded = loaded_after_import(module)
    assert within(loaded, "nvmeof_fuse.fs") + within(loaded, "nvmeof_fuse.companion") == []


TOP = ("nvmeof_fuse.daemon", "nvmeof_fuse.inprocess", "nvmeof_fuse.cli")


@pytest.mark.parametrize("module", ["nvmeof_fuse.companion", "nvmeof_fuse.companion.server.server",
                                    "nvmeof_fuse.companion.client.own_queues",
                                    "nvmeof_fuse.companion.files.fsfile",
                                    "nvmeof_fuse.companion.files.safetensors_load",
                                    "nvmeof_fuse.fs.mount"])
def test_the_filesystem_and_the_companion_load_nothing_above_them(module):
    loaded = loaded_after_import(module)
    assert [m for m in TOP if m in loaded] == []
    if module.startswith("nvmeof_fuse.fs"):
        assert within(loaded, "nvmeof_fuse.companion") == []


PACKAGE = Path(__file__).resolve().parent.parent / "nvmeof_fuse"


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Every module's imports of others in the package at ``root``, all of them: at the
    top, inside functions and under ``TYPE_CHECKING`` (read from the source, not run)."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                           else base for alias in node.names]
            for target in targets:
                while target and target not in modules:  # a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_above_the_transports_names_one():
    """The host looks transports up by name (transport/registry.py); only the transport
    layer imports a fabric's module."""
    named = {(module, target) for module, targets in import_graph().items()
             for target in targets
             if not module.startswith("nvmeof_fuse.transport")
             and target.startswith(("nvmeof_fuse.transport.rdma", "nvmeof_fuse.transport.tcp"))}
    assert named == set()


@pytest.mark.parametrize("module", ["nvmeof_fuse.companion.files.fiemap",
                                    "nvmeof_fuse.companion.files.safetensors_header"])
def test_the_companions_formats_import_nothing_of_ours(module):
    """FIEMAP's structures and the safetensors header are pure, as nvme/ is: the ioctls and
    sysfs are fsmap.py's, the reads safetensors_load.py's."""
    assert import_graph()[module] == set()


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_graph_holds_function_local_and_type_checking_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n")
    (package / "c.py").write_text("import pkg.a\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_no_module_imports_itself_round_a_circle():
    """No import circle, not even one hidden inside functions or under TYPE_CHECKING."""
    assert circles(import_graph()) == []
