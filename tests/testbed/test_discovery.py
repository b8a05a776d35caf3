"""Discovery against the real target while it changes: nvmet's discovery log, read as
subsystems are linked to and unlinked from the port in a loop, is never shown torn (issue
#56 item 4).  Each page we return holds NUMREC records, and its subsystems are exactly
those of one moment of the loop; a read that found the log changed each of its ten times is
refused in one line instead."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from vm import NVMET, TCP_PORT, run_guarded, wait_for

from nvmeof_fuse.host.controller import ConnectOptions, Controller
from nvmeof_fuse.host.discovery import discover
from nvmeof_fuse.host.logread import LogPageChanging
from nvmeof_fuse.nvme import DISCOVERY_NQN

PREFIX = "nqn.2026-11.io.nvmeof-fuse:churn-"
SUBSYSTEMS = 8  # 9 KiB of log with all linked: three 4 KiB pieces
PIECE = 4096  # bytes a Get Log Page moves, as a target with MDTS 4 KiB asks
READS = 25  # discoveries read in-process while the loop churns
CLI_READS = 3  # and through the command, with its own start-up each
PAUSE = 0.02  # s between two changes of the loop (with none, nvmet's log changed under
# each of ten reads in pieces every time in the slow guest: refused, never torn)

CHURN = """
import json, os, signal, sys, time
nvmet, port, prefix, count, out, pause = sys.argv[1:7]
count, pause = int(count), float(pause)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
linked = []
with open(out, "w") as states:
    def state():
        states.write(json.dumps(sorted(linked)) + "\\n")
        states.flush()
    for i in range(count):
        sub = f"{nvmet}/subsystems/{prefix}{i}"
        os.mkdir(sub)
        with open(f"{sub}/attr_allow_any_host", "w") as f:
            f.write("1")
    state()
    while not stop:
        for i in list(range(count)) + list(range(count)):
            name, link = f"{prefix}{i}", f"{nvmet}/ports/{port}/subsystems/{prefix}{i}"
            if name in linked:
                os.unlink(link)
                linked.remove(name)
            else:
                os.symlink(f"{nvmet}/subsystems/{name}", link)
                linked.append(name)
            state()
            time.sleep(pause)
"""


def clean_up() -> None:
    for i in range(SUBSYSTEMS):
        name = f"{PREFIX}{i}"
        link = f"{NVMET}/ports/{TCP_PORT}/subsystems/{name}"
        if os.path.lexists(link):
            os.unlink(link)
        if os.path.isdir(f"{NVMET}/subsystems/{name}"):
            os.rmdir(f"{NVMET}/subsystems/{name}")


@pytest.fixture
def churn(tmp_path):
    """A process linking and unlinking SUBSYSTEMS subsystems to the TCP port, one at a
    time, for ever; yields a function giving every state it reached so far (each a set of
    subsystem NQNs, in order)."""
    out = tmp_path / "states"
    clean_up()
    proc = subprocess.Popen([sys.executable, "-c", CHURN, NVMET, str(TCP_PORT), PREFIX,
                             str(SUBSYSTEMS), str(out), str(PAUSE)])

    def states() -> list[frozenset[str]]:
        lines = out.read_text().splitlines() if out.exists() else []
        return [frozenset(json.loads(line)) for line in lines if line.endswith("]")]

    try:
        assert wait_for(lambda: len(states()) > 2 * SUBSYSTEMS, 120), "the loop did not churn"
        yield states
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        clean_up()


def churned(nqns) -> frozenset[str]:
    return frozenset(n for n in nqns if n.startswith(PREFIX))


def test_discovery_read_in_pieces_while_subsystems_come_and_go_is_never_torn(
        testbed, churn, monkeypatch):
    monkeypatch.setattr(Controller, "log_page_piece", lambda self: PIECE)
    reads: list[int] = []  # Controller.get_log_page calls (a page's pieces are one) per read
    get_log_page = Controller.get_log_page

    async def counted(self, lid, length, offset=0):
        reads[-1] += 1
        return await get_log_page(self, lid, length, offset)

    monkeypatch.setattr(Controller, "get_log_page", counted)
    options = ConnectOptions(traddr=testbed.tcp_addr, nqn=DISCOVERY_NQN, transport="tcp",
                             trsvcid=testbed.port)
    pages, refused = [], []
    for _ in range(READS):
        reads.append(0)
        try:
            pages.append(run_guarded(discover, options, hang_guard=120))
        except LogPageChanging as exc:
            refused.append(str(exc))
    states = set(churn())
    seen = set()
    for page in pages:
        assert page.numrec == len(page.entries), page
        mine = churned(e.subnqn for e in page.entries)
        assert mine in states, f"a torn page: {sorted(mine)} was never the port's state"
        seen.add(mine)
        assert testbed.nqn in {e.subnqn for e in page.entries}
    print(f"{READS} reads in {PIECE}-byte pieces: {len(pages)} pages of {len(seen)} states, "
          f"{len(refused)} refused; log page reads per discovery: {reads} (header, page in "
          "pieces, header again: 3 when it held still; 2 when one command moved it)")
    assert set(refused) <= {f"the discovery log of {testbed.tcp_addr} kept changing while it "
                            "was read (10 tries)"}, refused
    assert pages, "every read was refused"
    assert len(seen) > 1, "the log never changed between reads: the loop did not run"


def test_the_discover_command_while_subsystems_come_and_go_shows_one_state(testbed, churn):
    for _ in range(CLI_READS):
        done = subprocess.run(
            [sys.executable, "-m", "nvmeof_fuse.cli", "discover", "-t", "tcp",
             "-a", testbed.tcp_addr, "-s", str(testbed.port)],
            capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        head = re.search(r"Number of Records (\d+), Generation counter (\d+)", done.stdout)
        assert head, done.stdout
        rows = [line.split()[-1] for line in done.stdout.splitlines()[2:] if line.strip()]
        assert len(rows) == int(head[1]), done.stdout
        assert churned(rows) in set(churn()), done.stdout
