"""``add-path`` / ``remove-path``: the request reaches the daemon's socket; errors are one line."""

import json

import pytest
from cli_fakes import one_line_error

from nvmeof_fuse.cli import entry
from nvmeof_fuse.companion.protocol import CompanionError

URI = "nvme+tcp://192.0.2.2/nqn.2014-08.org.example:s1"


@pytest.fixture
def daemon(monkeypatch, tmp_path):
    """A mount whose companion.json names a socket, and a fake channel to it."""
    (tmp_path / ".nvmeof").mkdir()
    (tmp_path / ".nvmeof" / "companion.json").write_text(json.dumps({"socket": "@mp-test"}))
    calls = []

    class Channel:
        def __init__(self, address, timeout):
            assert address == "\0mp-test"

        def call(self, op, **fields):
            calls.append((op, fields))
            if fields["uri"] == "refused":
                raise CompanionError("path x refused: it reaches subsystem a, not b")
            return {"index": 1, "uri": URI}

        def close(self):
            calls.append("closed")

    monkeypatch.setattr("nvmeof_fuse.companion.client.channel.SocketChannel", Channel)
    return tmp_path, calls


def test_add_and_remove_path_ask_the_daemon(capsys, daemon):
    mnt, calls = daemon
    assert entry.main(["add-path", str(mnt), URI]) == 0
    assert capsys.readouterr().out == f"nvmeof-fuse: {mnt}: path 1 ({URI}) added\n"
    assert entry.main(["remove-path", str(mnt), "1"]) == 0
    assert calls == [("add_path", {"uri": URI}), "closed", ("remove_path", {"uri": "1"}),
                     "closed"]


def test_refusals_and_bad_input_are_one_line(capsys, daemon, tmp_path):
    mnt, calls = daemon
    one_line_error(capsys, ["remove-path", str(mnt), "refused"],
                   "path x refused: it reaches subsystem a, not b")
    one_line_error(capsys, ["add-path", str(mnt), "192.0.2.2"], "is not an NVMe URI")
    one_line_error(capsys, ["add-path", str(mnt / "nope"), URI], "is not an nvmeof-fuse mount")
