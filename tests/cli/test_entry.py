"""The command line as a whole: help, usage errors, tracebacks only with --debug."""

import pytest
from cli_fakes import MOUNT

from nvmeof_fuse.cli import entry, options
from nvmeof_fuse.errors import ConnectError


def test_help_and_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        entry.main(["--help"])
    assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        entry.main(["mount", "-a", "192.0.2.1", "-n", "nqn.x:y"])  # no mountpoint
    assert e.value.code == 2




def test_debug_shows_the_traceback(host, tmp_path):
    host.error = ConnectError("refused")
    with pytest.raises(BaseException) as e:
        entry.main([*MOUNT, "--debug", str(tmp_path)])
    assert "refused" in str(options.leaf(e.value))


def test_the_entry_point_and_no_module_imports_it_back():
    """pyproject's ``nvmeof_fuse.cli:main``; only the package and ``__main__`` import
    ``entry``, which imports the rest: no circle through the parser's assembly."""
    from test_layering import import_graph

    import nvmeof_fuse.cli

    assert nvmeof_fuse.cli.main is entry.main
    importers = {m for m, targets in import_graph().items() if "nvmeof_fuse.cli.entry" in targets}
    assert importers == {"nvmeof_fuse.cli", "nvmeof_fuse.cli.__main__"}
