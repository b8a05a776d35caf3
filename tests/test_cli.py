import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from nvmeof_fuse import cli
from nvmeof_fuse.errors import ConnectError
from nvmeof_fuse.fs.mount import read_mountinfo
from nvmeof_fuse.host.controller import ConnectOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakes import make_controller  # noqa: E402

STEP = 20  # s: bound on any wait


class FakeConnectOptions(ConnectOptions):
    """The real options without their transport check, so CLI parsing of any -t is testable."""

    def validate(self) -> None:
        pass


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
    return state


MOUNT = ["mount", "-t", "rdma", "-a", "192.0.2.1", "-n", "nqn.2014-08.org.example:s1"]


def one_line_error(capsys, argv, match):
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("nvmeof-fuse: error: ") and match in err, err
    return err


def test_help_and_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        cli.main(["mount", "-a", "192.0.2.1", "-n", "nqn.x:y"])  # no mountpoint
    assert e.value.code == 2


def test_mount_without_a_target(capsys, host, tmp_path):
    one_line_error(capsys, ["mount", "-n", "nqn.2014-08.org.example:s1", str(tmp_path)],
                   "no target given: give nvme+rdma://HOST[:PORT]/SUBNQN[/NSID], or -a")
    assert host.connects == []


@pytest.mark.parametrize(
    "extra, match",
    [
        (["-s", "abc"], "--trsvcid 'abc' is not an integer"),
        (["-s", "70000"], "--trsvcid 70000 is out of range"),
        (["--mode", "999"], "--mode '999' is not an octal mode"),
        (["--mode", "1777"], "--mode 1777 is out of range"),
        (["-o", "allow_other,exec"], "unsupported -o option(s): exec"),
        (["--uid", "-1"], "--uid -1 is out of range"),
        (["-I", "not-a-uuid"], "--hostid 'not-a-uuid' is not a UUID"),
        (["-q", "host1"], "--hostnqn 'host1' is not an NQN"),
        (["-k", "soon"], "--keep-alive-tmo 'soon' is not a number"),
        (["-Q", "1"], "--queue-size 1 is out of range"),
        (["-i", "0"], "--nr-io-queues 0 is out of range"),
        (["--companion-queues", "-1"], "--companion-queues -1 is out of range"),
        (["--companion-queues", "many"], "--companion-queues 'many' is not an integer"),
        (["-c", "0"], "--reconnect-delay 0 is out of range (1-65535 s)"),
        (["-l", "-5"], "--ctrl-loss-tmo -5 is out of range (0-2147483648 s, or -1 for ever)"),
        (["-l", "later"], "--ctrl-loss-tmo 'later' is not a number"),
        (["-f", "-2"], "--fast-io-fail-tmo -2 is out of range (0-2147483648 s, or -1 for off)"),
        (["--fuse", "fusepy"], "unknown FUSE server 'fusepy' (known: builtin, pyfuse3)"),
        (["-o", "fuse=pyfuse3", "--fuse", "builtin"], "conflicting FUSE servers: builtin, pyfuse3"),
    ],
)
def test_bad_option_values_are_one_line(capsys, host, tmp_path, extra, match):
    one_line_error(capsys, [*MOUNT, *extra, str(tmp_path)], match)
    assert host.connects == []


@pytest.mark.parametrize("extra, server", [
    ([], "builtin"),
    (["--fuse", "pyfuse3"], "pyfuse3"),
    (["-o", "allow_other,fuse=pyfuse3"], "pyfuse3"),
    (["-o", "fuse=builtin"], "builtin"),
    (["--fuse", "pyfuse3", "-o", "fuse=pyfuse3"], "pyfuse3"),
])
def test_the_fuse_server_is_an_option(extra, server, tmp_path):
    assert cli.mount_options(cli.parse_args([*MOUNT, *extra, str(tmp_path)])).fuse == server


def test_pyfuse3_missing_is_one_line_before_connecting(capsys, host, tmp_path, monkeypatch):
    import nvmeof_fuse.fs

    monkeypatch.setitem(sys.modules, "pyfuse3", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "nvmeof_fuse.fs.pyfuse3_server", raising=False)
    monkeypatch.delattr(nvmeof_fuse.fs, "pyfuse3_server", raising=False)
    host.error = ConnectError("connected before the FUSE server was checked")  # never serves
    one_line_error(capsys, [*MOUNT, "-o", "fuse=pyfuse3", str(tmp_path)],
                   "fuse=pyfuse3 needs pyfuse3, which cannot be imported")
    assert host.connects == []


def test_missing_mountpoint(capsys, host, tmp_path):
    one_line_error(capsys, [*MOUNT, str(tmp_path / "nope")], "does not exist")
    assert host.connects == []


def test_mountpoint_not_a_directory(capsys, host, tmp_path):
    (tmp_path / "f").write_text("x")
    one_line_error(capsys, [*MOUNT, str(tmp_path / "f")], "is not a directory")


def test_mountpoint_already_mounted(capsys, host):
    one_line_error(capsys, [*MOUNT, "/proc"], "/proc is already a mountpoint")


def test_stale_mountpoint(capsys, host, tmp_path, monkeypatch):
    real_stat = os.stat

    def stat(path, *a, **kw):
        if os.fspath(path) == str(tmp_path):
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(os, "stat", stat)
    err = one_line_error(capsys, [*MOUNT, str(tmp_path)], "stale mount")
    assert f"dead nvmeof-fuse daemon at {tmp_path}; clear it with: fusermount3 -u {tmp_path}" in err


def test_connect_error_is_one_line(capsys, host, tmp_path):
    host.error = ConnectError("cannot connect to 192.0.2.1:4420: connection refused")
    one_line_error(capsys, [*MOUNT, str(tmp_path)], "connection refused")
    assert host.connects[0].traddr == "192.0.2.1" and host.connects[0].keep_alive_tmo == 5.0
    assert (host.connects[0].reconnect_delay, host.connects[0].ctrl_loss_tmo) == (10.0, 600.0)


SECRET = "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"


def test_dhchap_options_follow_nvme_cli(tmp_path):
    key = tmp_path / "key"
    key.write_text(SECRET + "\n")
    key.chmod(0o600)
    args = cli.build_parser().parse_args([*MOUNT, "-S", str(key), "--dhchap-ctrl-secret",
                                          SECRET, str(tmp_path)])
    opts = cli.connect_options(args, nqn=args.nqn, default_port=4420)
    assert (opts.dhchap_secret, opts.dhchap_ctrl_secret) == (str(key), SECRET)


@pytest.mark.parametrize("extra, match", [
    (["-S", SECRET[:-5] + "AAAA:"], "--dhchap-secret (inline) fails its CRC-32 check"),
    (["-S", "/nonexistent/key"], "--dhchap-secret file /nonexistent/key: No such file"),
    (["-C", SECRET], "--dhchap-ctrl-secret needs --dhchap-secret"),
    (["-o", f"dhchap_secret={SECRET}"], "mount option dhchap_secret= is refused: mount "
     "options are readable by every user (in /etc/fstab and the process list); "
     "put the secret in a file only its owner can read (chmod 600) and write --dhchap-secret "
     "FILE instead"),
    (["-o", f"allow_other,x={SECRET}"], "unsupported -o option(s): x (known: allow_other, "
     "fuse=SERVER)"),
])
def test_bad_dhchap_secrets_are_one_line_without_the_secret(capsys, tmp_path, extra, match):
    err = one_line_error(capsys, [*MOUNT, *extra, str(tmp_path)], match)
    assert SECRET[10:-5] not in err


def test_reconnect_options_follow_nvme_cli(tmp_path):
    args = cli.build_parser().parse_args([*MOUNT, "-c", "2", "-l", "-1", str(tmp_path)])
    opts = cli.connect_options(args, nqn=args.nqn, default_port=4420)
    assert (opts.reconnect_delay, opts.ctrl_loss_tmo, opts.fast_io_fail_tmo) == (2.0, -1.0, -1.0)
    for spelling in ("--fast-io-fail-tmo", "--fast_io_fail_tmo"):  # nvme-cli's is the latter
        args = cli.build_parser().parse_args([*MOUNT, spelling, "7", str(tmp_path)])
        assert cli.connect_options(args, nqn=args.nqn, default_port=4420).fast_io_fail_tmo == 7


def test_debug_shows_the_traceback(host, tmp_path):
    host.error = ConnectError("refused")
    with pytest.raises(BaseException) as e:
        cli.main([*MOUNT, "--debug", str(tmp_path)])
    assert "refused" in str(cli._leaf(e.value))


# --- --daemon ------------------------------------------------------------------------


def child(code):
    return [sys.executable, "-c", "import os, sys, time\nfd = int(sys.argv[-1])\n" + code]


def test_daemon_ready():
    assert cli.spawn_daemon(child("os.write(fd, b'ready\\n')"), None, timeout=STEP) == 0


def test_daemon_error_is_relayed():
    with pytest.raises(cli.UsageError, match="^mountpoint /x does not exist$"):
        cli.spawn_daemon(
            child("os.write(fd, b'error: mountpoint /x does not exist\\n'); sys.exit(1)"),
            None,
            timeout=STEP,
        )


def test_daemon_dying_silently(tmp_path):
    log = tmp_path / "daemon.log"
    with pytest.raises(cli.UsageError, match=f"exited \\(status 3\\).*see {log}"):
        cli.spawn_daemon(child("print('boom'); sys.exit(3)"), str(log), timeout=STEP)
    assert log.read_text() == "boom\n"


def test_daemon_timeout_stops_the_child(tmp_path):
    pidfile = tmp_path / "pid"
    code = f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)"
    with pytest.raises(cli.UsageError, match="did not report the mount ready within 1 s"):
        cli.spawn_daemon(child(code), None, timeout=1)
    pid = int(pidfile.read_text())
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)  # terminated: reaped here (bounded: SIGTERM was sent)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_daemon_command_is_foreground_with_absolute_mountpoint(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cmd, secrets = cli.daemon_command([*MOUNT, "--daemon", "-k", "7", "-o", "allow_other",
                                       "--log-file", "log", "mnt"])
    assert cmd[:3] == [sys.executable, "-m", "nvmeof_fuse.cli"] and not secrets
    assert cmd[3:] == ["mount", "--transport=rdma", "--traddr=192.0.2.1",
                       "--nqn=nqn.2014-08.org.example:s1", "--keep-alive-tmo=7", "-o",
                       "allow_other", f"--log-file={tmp_path / 'log'}", str(tmp_path / "mnt")]


def test_daemon_command_keeps_every_option():
    """The line is rebuilt from the parsed options: none may be lost on the way."""
    argv = ["mount", "nvme+tcp://192.0.2.1/nqn.2014-08.org.example:s1", "-w", "192.0.2.9",
            "-g", "-G", "-q", "nqn.2014-08.org.example:h", "-I",
            "00000000-0000-4000-8000-000000000001", "--allow-insecure-secret-file", "--debug",
            "--namespace-id", "2", "-i", "3", "--companion-queues", "0", "-Q", "64", "-k", "0",
            "-c", "3", "-l", "-1", "--fast_io_fail_tmo", "5", "--read-only", "-o", "allow_other",
            "-o", "fuse=pyfuse3", "--fuse", "pyfuse3", "--uid", "1", "--gid", "2", "--mode",
            "0600", "--log-file", "/l", "/m"]
    cmd, _ = cli.daemon_command(argv)
    given, child = vars(cli.parse_args(argv)), vars(cli.parse_args(cmd[3:]))
    assert child == given, cmd


@pytest.mark.parametrize("flag", ["--dae", "--daem", "--daemo"])
def test_daemon_command_drops_an_abbreviated_daemon_flag(flag):
    """argparse takes ``--dae`` for ``--daemon``: left in, the child would detach again,
    and its child too, without end."""
    cmd, _ = cli.daemon_command([*MOUNT, flag, "/mnt"])
    assert not cli.parse_args(cmd[3:]).daemon


def test_daemon_command_makes_secret_files_absolute(monkeypatch, tmp_path):
    """The daemon runs in /, and reads the secret files again (at connect and reconnect)."""
    monkeypatch.chdir(tmp_path)
    for name in ("host.key", "ctrl.key"):
        (tmp_path / name).write_text(SECRET + "\n")
        (tmp_path / name).chmod(0o600)
    cmd, secrets = cli.daemon_command([*MOUNT, "--daemon", "-S", "host.key",
                                       "--dhchap-ctrl-secret=ctrl.key", "mnt"])
    monkeypatch.chdir("/")
    child = cli.parse_args(cmd[3:])
    opts = cli.connect_options(child, nqn=child.nqn, default_port=4420)
    assert (opts.dhchap_secret, opts.dhchap_ctrl_secret) == (
        str(tmp_path / "host.key"), str(tmp_path / "ctrl.key"))
    assert child.mountpoint == str(tmp_path / "mnt") and not secrets


CTRL_SECRET = "DHHC-1:00:yMnKy8zNzs/Q0dLT1NXW19jZ2tvc3d7f4OHi4+Tl5ufLkDyH:"
TCP_MOUNT = ["mount", "-t", "tcp", "-a", "192.0.2.1", "-n", "nqn.2014-08.org.example:s1"]


@pytest.mark.parametrize("argv", [
    [*MOUNT, "-S", SECRET, "-C", CTRL_SECRET, "--daemon", "/mnt"],
    [*MOUNT, f"-S{SECRET}", f"-C{CTRL_SECRET}", "--daemon", "/mnt"],
    [*TCP_MOUNT, "-gGS", SECRET, "-gC", CTRL_SECRET, "--daemon", "/mnt"],  # short flags joined
    [*MOUNT, f"--dhchap-secret={SECRET}", f"--dhchap-ctrl-secret={CTRL_SECRET}", "--daemon",
     "/mnt"],
    [*MOUNT, "--dhchap-secret", SECRET, "--dhchap-ctrl-secret", CTRL_SECRET, "--daemon", "/mnt"],
    [*MOUNT, "--dhchap-s", SECRET, f"--dhchap-c={CTRL_SECRET}", "--dae", "/mnt"],  # prefixes
    ["mount", f"nvme+rdma://192.0.2.1/{MOUNT[-1]}", "-S", SECRET, "-C", CTRL_SECRET, "--daemon",
     "/mnt"],
])
def test_the_daemons_argv_holds_no_secret_whatever_the_form(monkeypatch, argv):
    """Issue #43, acceptance 3: inline secrets reach the daemon over a pipe, never in its
    arguments or environment."""
    started = []

    class Popen:  # the daemon, as spawn_daemon starts it
        def __init__(self, cmd, **kwargs):
            started.append((cmd, kwargs))
            fd = int(cmd[cmd.index("--secrets-fd") + 1])
            args = cli.parse_args(cmd[3:])
            cli.receive_secrets(args, os.dup(fd))
            started.append(args)
            os.write(int(cmd[cmd.index("--ready-fd") + 1]), b"ready\n")

    monkeypatch.setattr(cli.subprocess, "Popen", Popen)
    assert cli.main(argv) == 0
    (cmd, kwargs), child = started
    bodies = (SECRET.split(":")[2], CTRL_SECRET.split(":")[2])
    assert not any(b in a for b in bodies for a in cmd), cmd
    assert kwargs.get("env") is None and not any(b in v for b in bodies
                                                 for v in os.environ.values())
    assert (child.dhchap_secret, child.dhchap_ctrl_secret) == (SECRET, CTRL_SECRET)
    assert not child.daemon and child.mountpoint == "/mnt"


@pytest.mark.parametrize("argv", [
    [*MOUNT, "-o", f"dhchap_secret={SECRET}", "--daemon", "/mnt"],
    [f"nvme+rdma://192.0.2.1/{MOUNT[-1]}", "/mnt", "-o", f"dhchap_secret={SECRET}"],  # fstab
    [f"nvme+rdma://192.0.2.1/{MOUNT[-1]}", "/mnt", "-o", f"dhchap_ctrl_secret_file={SECRET}"],
])
def test_a_secret_in_o_options_starts_no_daemon(capsys, monkeypatch, argv):
    monkeypatch.setattr(cli.subprocess, "Popen", None)  # any start fails the test
    err = one_line_error(capsys, argv, ": mount options are readable by every user")
    assert SECRET.split(":")[2] not in err


def test_every_option_that_may_hold_a_secret_is_kept_out_of_the_daemons_argv():
    """A secret option added later (a TLS PSK) must join SECRET_OPTIONS, or it would be
    copied into the daemon's command line."""
    import re

    actions = cli._add_mount_arguments(cli.argparse.ArgumentParser(add_help=False))
    named = {a.dest for a in actions
             if a.nargs != 0 and re.search(r"secret|psk|(^|_)key($|_)|password", a.dest)}
    assert named - {"secrets_fd"} == set(cli.SECRET_OPTIONS)  # secrets_fd: a number


def test_secrets_reach_a_real_child_over_a_pipe_only(tmp_path):
    out = tmp_path / "child.json"
    code = f"""
import argparse, json
from nvmeof_fuse import cli
args = argparse.Namespace(dhchap_secret=None, dhchap_ctrl_secret=None)
cli.receive_secrets(args, int(sys.argv[sys.argv.index("--secrets-fd") + 1]))
with open("/proc/self/cmdline", "rb") as c, open("/proc/self/environ", "rb") as e:
    seen = [vars(args), c.read().decode(), e.read().decode()]
open({str(out)!r}, "w").write(json.dumps(seen))
os.write(fd, b"ready\\n")
"""
    secrets = {"dhchap_secret": SECRET, "dhchap_ctrl_secret": CTRL_SECRET}
    assert cli.spawn_daemon(child(code), None, timeout=STEP, secrets=secrets) == 0
    received, cmdline, environ = json.loads(out.read_text())
    assert received == secrets
    assert not any(s.split(":")[2] in cmdline + environ for s in secrets.values())


def test_bad_secrets_descriptor_is_one_line(monkeypatch):
    args = types.SimpleNamespace(dhchap_secret=None)
    rfd, wfd = os.pipe()
    os.write(wfd, b"not json")
    os.close(wfd)
    with pytest.raises(cli.UsageError, match=f"^--secrets-fd {rfd} does not hold the secrets"):
        cli.receive_secrets(args, rfd)
    with pytest.raises(cli.UsageError, match=f"^--secrets-fd {rfd}: Bad file descriptor$"):
        cli.receive_secrets(args, rfd)  # closed above
    rfd, wfd = os.pipe()
    monkeypatch.setattr(cli, "SECRETS_TIMEOUT", 0.05)
    try:
        with pytest.raises(cli.UsageError, match=f"^--secrets-fd {rfd}: no secrets within"):
            cli.receive_secrets(args, rfd)
    finally:
        os.close(rfd)
        os.close(wfd)
    with pytest.raises(cli.UsageError, match=r"^the secrets are too long \(\d+ bytes\)$"):
        cli.secrets_pipe({"dhchap_secret": "x" * cli.SECRETS_MAX})
    assert args.dhchap_secret is None


# --- discover and list ------------------------------------------------------------------


class FakePage:
    def to_dict(self):
        rec = {
            "trtype": "rdma",
            "adrfam": "ipv4",
            "subtype": "nvme subsystem",
            "treq": "not specified",
            "portid": 1,
            "trsvcid": "4420",
            "subnqn": "nqn.2014-08.org.example:s1",
            "traddr": "192.0.2.1",
        }
        return {"genctr": 5, "numrec": 1, "recfmt": 0, "records": [rec]}


def test_discover_table_and_json(capsys, host):
    host.page = FakePage()
    assert cli.main(["discover", "-t", "tcp", "-a", "192.0.2.1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Discovery Log Number of Records 1, Generation counter 5"
    assert out[1].split() == [
        "#",
        "trtype",
        "adrfam",
        "subtype",
        "portid",
        "trsvcid",
        "traddr",
        "subnqn",
    ]
    assert "nqn.2014-08.org.example:s1" in out[2] and out[2].startswith("0  rdma")
    assert host.connects[0].trsvcid == 8009 and host.connects[0].nqn == cli.DISCOVERY_NQN
    assert cli.main(["discover", "-a", "192.0.2.1", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"][0]["portid"] == 1
    assert host.connects[1].trsvcid == 4420


def test_list(capsys, tmp_path):
    (tmp_path / ".nvmeof").mkdir()
    doc = {
        "controller": {"transport": "rdma", "traddr": "192.0.2.1", "trsvcid": 4420, "cntlid": 3},
        "identify": {"mn": "Model X", "sn": "SN1", "fr": "1.2", "subnqn": "nqn.x:y"},
        "namespaces": [{"nsid": 1, "size": 4096, "lba_size": 512, "nlb": 8}],
    }
    (tmp_path / ".nvmeof" / "controller.json").write_text(json.dumps(doc))
    assert cli.main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Model X (serial SN1, firmware 1.2)" in out and "rdma 192.0.2.1:4420 nqn.x:y" in out
    assert f"{tmp_path}/n1  1     4096" in out
    assert cli.main(["list", "-o", "json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["identify"]["sn"] == "SN1"


def test_list_errors(capsys, tmp_path):
    one_line_error(capsys, ["list", str(tmp_path / "nope")], "does not exist")
    one_line_error(capsys, ["list", str(tmp_path)], "is not an nvmeof-fuse mount")


# --- the whole mount command through the kernel -------------------------------------------

FOREGROUND = """
import sys, types
sys.path.insert(0, {tests!r})
import test_cli, fakes
from nvmeof_fuse import cli
mod = types.ModuleType("nvmeof_fuse.host.controller")
mod.ConnectOptions = test_cli.FakeConnectOptions
import contextlib, math, trio
@contextlib.asynccontextmanager
async def connect(opts):
    # Like the real controller: completions are reaped by a task in connect's own
    # nursery, so a flush only completes while that task still runs.
    ctrl = fakes.make_controller((1, 512, 64), (2, 4096, 8))
    send, recv = trio.open_memory_channel(math.inf)

    async def reaper():
        async for done in recv:
            done.set()

    def reaped_flush(ns):
        async def flush():
            done = trio.Event()
            send.send_nowait(done)
            with trio.move_on_after(2):
                await done.wait()
            ns.flushes += done.is_set()
        return flush

    for ns in ctrl.namespaces.values():
        ns.flush = reaped_flush(ns)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reaper)
        try:
            yield ctrl
        finally:
            print("flushes", {{n: ns.flushes for n, ns in ctrl.namespaces.items()}}, flush=True)
            nursery.cancel_scope.cancel()
mod.connect = connect
sys.modules[mod.__name__] = mod
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.skipif(
    not os.access("/dev/fuse", os.W_OK) or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3",
)
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM", "fusermount3 -u"])
def test_foreground_mount_until_stopped(tmp_path, stop):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    rfd, wfd = os.pipe()
    script = FOREGROUND.format(tests=str(Path(__file__).resolve().parent))
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *MOUNT, "--ready-fd", str(wfd), str(mnt)],
        pass_fds=(wfd,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(wfd)
    try:
        status = cli._read_line(rfd, STEP)
        os.close(rfd)
        assert status == "ready", proc.stderr.read() if status == "" else status
        assert sorted(os.listdir(mnt)) == [".nvmeof", "n1", "n2"]
        assert cli.main(["list", str(mnt)]) == 0
        if stop.startswith("SIG"):
            proc.send_signal(getattr(signal, stop))
        else:
            subprocess.run(["fusermount3", "-u", str(mnt)], timeout=STEP, check=True)
        out, err = proc.communicate(timeout=STEP)
        assert proc.returncode == 0, err
        assert "flushes {1: 1, 2: 1}" in out  # final flush, while the controller still runs
        assert "flushed n1, n2" in err and "disconnected from" in err and "Traceback" not in err
        if stop.startswith("SIG"):
            assert f"{stop}: unmounting" in err
        assert not any(m.mountpoint == str(mnt) for m in read_mountinfo())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STEP)
        if any(m.mountpoint == str(mnt) for m in read_mountinfo()):  # also when stale
            subprocess.run(["fusermount3", "-uz", str(mnt)], timeout=STEP, check=False)
