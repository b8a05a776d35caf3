"""The house: its layers and its three kinds of process, each importing only what it may.

Layers, lowest first; each imports only those below it (tests import anything):

    errors, concurrency, procstat,    nothing of ours but errors
    ratelimit
    nvme/                             wire formats: bytes in, bytes and events out, no I/O
    transport/ (rdma/, tcp/)          sockets, queue pairs, registered memory
    host/ (multipath/, namespace/)    controllers, paths, namespaces
    fs/, companion/                   the FUSE filesystem; the companion API (neither imports
                                      the other)
    workers/, daemon, inprocess       the mount's processes (inprocess: nvmeof_fuse.mount)
    cli/                              the command line

Inside companion/, protocol.py (the socket's wire format) and cuda/ sit at the bottom;
client/ and server/ beside each other, never importing each other; files/ above client/.

The processes, and what each runs:

- the mount daemon: daemon.py, workers/supervisor.py, companion/server/, fs/, host/ and below;
  never the client library (companion/client/);
- a FUSE worker (python -m nvmeof_fuse.workers): workers/worker.py, workers/fs.py, fs/ and
  companion/client/ (it is a companion client of the daemon); never the daemon's side
  (companion/server/, workers/supervisor.py, daemon.py);
- a companion client, a user's process (nvmeof_fuse.File): companion/ (client/, files/,
  cuda/) and host/ and below; never the daemon's side, fs/ or workers/.

workers/messages.py is what the daemon and its workers say to each other: both import it.
"""

from __future__ import annotations

import ast
import json
import os
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
                                    "nvmeof_fuse.host.namespace", "nvmeof_fuse.host.sync",
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


# --- the layers and the processes, from the import graph ----------------------------------

LAYERS = (
    ("nvmeof_fuse.errors", "nvmeof_fuse.concurrency", "nvmeof_fuse.procstat",
     "nvmeof_fuse.ratelimit"),
    ("nvmeof_fuse.nvme",),
    ("nvmeof_fuse.transport",),
    ("nvmeof_fuse.host",),
    ("nvmeof_fuse.fs", "nvmeof_fuse.companion"),
    ("nvmeof_fuse.workers", "nvmeof_fuse.daemon", "nvmeof_fuse.inprocess"),
    ("nvmeof_fuse.cli",),
)
"""Lowest first: a module imports only modules of its own room or of a lower layer."""

NEVER = (
    # beside each other in one layer
    ("nvmeof_fuse.fs", "nvmeof_fuse.companion", "the filesystem and the companion API are apart"),
    ("nvmeof_fuse.companion", "nvmeof_fuse.fs", "the filesystem and the companion API are apart"),
    ("nvmeof_fuse.workers", "nvmeof_fuse.daemon", "the daemon starts the workers, not back"),
    ("nvmeof_fuse.workers", "nvmeof_fuse.inprocess", "nvmeof_fuse.mount serves through the daemon"),
    ("nvmeof_fuse.daemon", "nvmeof_fuse.inprocess", "nvmeof_fuse.mount serves through the daemon"),
    # inside companion/
    ("nvmeof_fuse.companion.client", "nvmeof_fuse.companion.server",
     "the client library runs in users' processes, the server in the mount daemon"),
    ("nvmeof_fuse.companion.server", "nvmeof_fuse.companion.client",
     "the server runs in the mount daemon, the client library in users' processes"),
    ("nvmeof_fuse.companion.client", "nvmeof_fuse.companion.files",
     "files on filesystems sit above the client (it asks their opener: open_others_with)"),
    ("nvmeof_fuse.companion.server", "nvmeof_fuse.companion.files", "files are the client's"),
    ("nvmeof_fuse.companion.files", "nvmeof_fuse.companion.server", "files are the client's"),
    ("nvmeof_fuse.companion.cuda", "nvmeof_fuse.companion.client", "CUDA is below both sides"),
    ("nvmeof_fuse.companion.cuda", "nvmeof_fuse.companion.server", "CUDA is below both sides"),
    ("nvmeof_fuse.companion.cuda", "nvmeof_fuse.companion.files", "CUDA is below both sides"),
    # the processes
    ("nvmeof_fuse.workers.worker", "nvmeof_fuse.companion.server",
     "a FUSE worker is a companion client of the daemon"),
    ("nvmeof_fuse.workers.fs", "nvmeof_fuse.companion.server",
     "a FUSE worker is a companion client of the daemon"),
    ("nvmeof_fuse.workers.worker", "nvmeof_fuse.workers.supervisor",
     "the worker process and the daemon share only workers/messages.py"),
    ("nvmeof_fuse.workers.fs", "nvmeof_fuse.workers.supervisor",
     "the worker process and the daemon share only workers/messages.py"),
    ("nvmeof_fuse.workers.messages", "nvmeof_fuse.workers.supervisor",
     "the worker process and the daemon share only workers/messages.py"),
    ("nvmeof_fuse.workers.supervisor", "nvmeof_fuse.workers.worker",
     "the daemon and the worker process share only workers/messages.py"),
    ("nvmeof_fuse.workers.supervisor", "nvmeof_fuse.workers.fs",
     "the daemon and the worker process share only workers/messages.py"),
    ("nvmeof_fuse.workers.supervisor", "nvmeof_fuse.companion.client",
     "the daemon serves companion clients; it is none"),
    ("nvmeof_fuse.daemon", "nvmeof_fuse.companion.client",
     "the daemon serves companion clients; it is none"),
)
"""``(importer, imported, why)``: no module in the first package imports one in the second."""


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer(module: str) -> int:
    """The layer of ``module`` (the package's face, ``nvmeof_fuse``, stands on top)."""
    for rank, packages in enumerate(LAYERS):
        if any(_within(module, package) for package in packages):
            return rank
    return len(LAYERS)


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs up a layer or breaks one of :data:`NEVER`, as a line."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer(target) > layer(module):
                found.append(f"{module} -> {target}: runs up a layer")
            for importer, imported, why in NEVER:
                if _within(module, importer) and _within(target, imported):
                    found.append(f"{module} -> {target}: {why}")
    return found


def test_the_checker_finds_imports_the_wrong_way():
    graph = {"nvmeof_fuse.companion.client.file": {"nvmeof_fuse.companion.server.server"},
             "nvmeof_fuse.host.controller": {"nvmeof_fuse.workers.supervisor"},
             "nvmeof_fuse.workers.worker": {"nvmeof_fuse.workers.messages"},
             "nvmeof_fuse.workers.supervisor": {"nvmeof_fuse.workers.messages",
                                                "nvmeof_fuse.companion.server.roles"}}
    assert wrong_way(graph) == [
        "nvmeof_fuse.companion.client.file -> nvmeof_fuse.companion.server.server: the client "
        "library runs in users' processes, the server in the mount daemon",
        "nvmeof_fuse.host.controller -> nvmeof_fuse.workers.supervisor: runs up a layer"]


def test_no_import_runs_the_wrong_way_between_layers_or_processes():
    """Across layers only downwards; companion's client and server apart; each process only
    what it runs (see the module)."""
    assert wrong_way(import_graph()) == []


@pytest.mark.parametrize(("module", "never"), [
    ("nvmeof_fuse.companion", ("nvmeof_fuse.companion.server", "nvmeof_fuse.fs",
                               "nvmeof_fuse.workers", "nvmeof_fuse.daemon")),
    ("nvmeof_fuse.workers.worker", ("nvmeof_fuse.companion.server", "nvmeof_fuse.daemon",
                                    "nvmeof_fuse.workers.supervisor")),
])
def test_a_process_loads_nothing_of_the_others_side(module, never):
    """What a user's process (``import nvmeof_fuse``'s companion API) and a FUSE worker load,
    run for real: nothing of the daemon's side."""
    loaded = loaded_after_import(module)
    assert [m for m in sorted(loaded) if any(_within(m, p) for p in never)] == []


# --- rooms of a fit size, one concept each --------------------------------------------------

MAX_SHARE = 0.15
"""Of the package's lines, what one folder's own modules (its subfolders apart) may hold."""
LONG_MODULE = 700
WHY_ONE_MODULE = "Why one module:"


def _lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def test_no_folder_holds_over_15_percent_of_the_package():
    own: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        folder = str(path.parent.relative_to(PACKAGE.parent))
        own[folder] = own.get(folder, 0) + _lines(path)
    total = sum(own.values())
    over = {folder: f"{n / total:.1%}" for folder, n in own.items() if n > MAX_SHARE * total}
    assert over == {}


def test_a_long_module_says_why_it_is_one_concept():
    """A module over 700 lines says, in its docstring, why it is one (or it is split)."""
    unsaid = [str(path.relative_to(PACKAGE.parent)) for path in sorted(PACKAGE.rglob("*.py"))
              if _lines(path) > LONG_MODULE
              and WHY_ONE_MODULE not in (ast.get_docstring(ast.parse(path.read_text())) or "")]
    assert unsaid == []


def test_nothing_above_the_transports_compares_a_transport_name():
    """Transports declare what they can do (transport/registry.py: Capabilities); nothing
    above transport/ tests for "rdma" or "tcp"."""
    from nvmeof_fuse.transport.registry import NAMES

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path, PACKAGE)
        if layer(module) <= layer("nvmeof_fuse.transport"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            for operand in (node.left, *node.comparators):
                items = operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) \
                    else [operand]
                if any(isinstance(i, ast.Constant) and i.value in NAMES for i in items):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert found == []


# --- every module is tested, and docs/architecture.md lists it ------------------------------

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
TESTS = PACKAGE.parent / "tests"


def test_every_module_has_its_test_file_or_the_architecture_names_the_tests():
    """tests/ mirrors the package (tests/host/test_controller.py for host/controller.py);
    a module without a test file of its name has a line in docs/architecture.md's table
    that names it and the tests that cover it."""
    text = ARCHITECTURE.read_text()
    rows = [line for line in text.splitlines() if line.startswith("|")]
    unlisted, untested = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        name = f"`{rel}`"
        row = next((r for r in rows if name in r.split("|")[1]), None)
        if row is None:
            unlisted.append(str(rel))
            continue
        mirrored = TESTS / rel.parent / f"test_{path.name}"
        if not mirrored.exists() and "tests/" not in row:
            untested.append(str(rel))
    assert (unlisted, untested) == ([], [])
    named = {t for row in rows for t in row.split("`") if t.startswith("tests/")}
    assert [t for t in sorted(named) if not os.path.exists(PACKAGE.parent / t.split("::")[0])] \
        == []
