"""mount: its checks, --daemon, the secrets' pipe, and a whole mount through the kernel."""

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
from cli_fakes import FOREGROUND, MOUNT, SECRET, STEP, one_line_error

from nvmeof_fuse.cli import entry, mount, options
from nvmeof_fuse.fs.mount import read_mountinfo


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



# --- --daemon ------------------------------------------------------------------------


def child(code):
    return [sys.executable, "-c", "import os, sys, time\nfd = int(sys.argv[-1])\n" + code]


def test_daemon_ready():
    assert mount.spawn_daemon(child("os.write(fd, b'ready\\n')"), None, timeout=STEP) == 0


def test_daemon_error_is_relayed():
    with pytest.raises(options.UsageError, match="^mountpoint /x does not exist$"):
        mount.spawn_daemon(
            child("os.write(fd, b'error: mountpoint /x does not exist\\n'); sys.exit(1)"),
            None,
            timeout=STEP,
        )


def test_daemon_dying_silently(tmp_path):
    log = tmp_path / "daemon.log"
    with pytest.raises(options.UsageError, match=f"exited \\(status 3\\).*see {log}"):
        mount.spawn_daemon(child("print('boom'); sys.exit(3)"), str(log), timeout=STEP)
    assert log.read_text() == "boom\n"


def test_daemon_timeout_stops_the_child(tmp_path):
    pidfile = tmp_path / "pid"
    code = f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)"
    with pytest.raises(options.UsageError, match="did not report the mount ready within 1 s"):
        mount.spawn_daemon(child(code), None, timeout=1)
    pid = int(pidfile.read_text())
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)  # terminated: reaped here (bounded: SIGTERM was sent)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_daemon_command_is_foreground_with_absolute_mountpoint(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cmd, secrets = mount.daemon_command([*MOUNT, "--daemon", "-k", "7", "-o", "allow_other",
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
            "0600", "--log-file", "/l", "--path", "nvme+rdma://192.0.2.2/nqn.2014-08.org.e:s1",
            "--path", "nvme+tcp://192.0.2.3/nqn.2014-08.org.e:s1", "--iopolicy", "failover",
            "-o", "path=nvme+tcp://192.0.2.4/nqn.2014-08.org.e:s1", "/m"]
    cmd, _ = mount.daemon_command(argv)
    given, child = vars(entry.parse_args(argv)), vars(entry.parse_args(cmd[3:]))
    assert child == given, cmd


@pytest.mark.parametrize("flag", ["--dae", "--daem", "--daemo"])
def test_daemon_command_drops_an_abbreviated_daemon_flag(flag):
    """argparse takes ``--dae`` for ``--daemon``: left in, the child would detach again,
    and its child too, without end."""
    cmd, _ = mount.daemon_command([*MOUNT, flag, "/mnt"])
    assert not entry.parse_args(cmd[3:]).daemon


def test_daemon_command_makes_secret_files_absolute(monkeypatch, tmp_path):
    """The daemon runs in /, and reads the secret files again (at connect and reconnect)."""
    monkeypatch.chdir(tmp_path)
    for name in ("host.key", "ctrl.key"):
        (tmp_path / name).write_text(SECRET + "\n")
        (tmp_path / name).chmod(0o600)
    cmd, secrets = mount.daemon_command([*MOUNT, "--daemon", "-S", "host.key",
                                       "--dhchap-ctrl-secret=ctrl.key", "mnt"])
    monkeypatch.chdir("/")
    child = entry.parse_args(cmd[3:])
    opts = options.connect_options(child, nqn=child.nqn, default_port=4420)
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
            args = entry.parse_args(cmd[3:])
            mount.receive_secrets(args, os.dup(fd))
            started.append(args)
            os.write(int(cmd[cmd.index("--ready-fd") + 1]), b"ready\n")

    monkeypatch.setattr(mount.subprocess, "Popen", Popen)
    assert entry.main(argv) == 0
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
    monkeypatch.setattr(mount.subprocess, "Popen", None)  # any start fails the test
    err = one_line_error(capsys, argv, ": mount options are readable by every user")
    assert SECRET.split(":")[2] not in err


def test_every_option_that_may_hold_a_secret_is_kept_out_of_the_daemons_argv():
    """A secret option added later (a TLS PSK) must join SECRET_OPTIONS, or it would be
    copied into the daemon's command line."""

    actions = mount.add_mount_arguments(mount.argparse.ArgumentParser(add_help=False))
    named = {a.dest for a in actions
             if a.nargs != 0 and re.search(r"secret|psk|(^|_)key($|_)|password", a.dest)}
    not_secret = {"secrets_fd", "tls_key_identity"}  # a number; NQNs and a public digest
    assert named - not_secret == set(mount.SECRET_OPTIONS)


def test_secrets_reach_a_real_child_over_a_pipe_only(tmp_path):
    out = tmp_path / "child.json"
    code = f"""
import argparse, json
from nvmeof_fuse.cli import mount
args = argparse.Namespace(dhchap_secret=None, dhchap_ctrl_secret=None)
mount.receive_secrets(args, int(sys.argv[sys.argv.index("--secrets-fd") + 1]))
with open("/proc/self/cmdline", "rb") as c, open("/proc/self/environ", "rb") as e:
    seen = [vars(args), c.read().decode(), e.read().decode()]
open({str(out)!r}, "w").write(json.dumps(seen))
os.write(fd, b"ready\\n")
"""
    secrets = {"dhchap_secret": SECRET, "dhchap_ctrl_secret": CTRL_SECRET}
    assert mount.spawn_daemon(child(code), None, timeout=STEP, secrets=secrets) == 0
    received, cmdline, environ = json.loads(out.read_text())
    assert received == secrets
    assert not any(s.split(":")[2] in cmdline + environ for s in secrets.values())


def test_bad_secrets_descriptor_is_one_line(monkeypatch):
    args = types.SimpleNamespace(dhchap_secret=None)
    rfd, wfd = os.pipe()
    os.write(wfd, b"not json")
    os.close(wfd)
    with pytest.raises(options.UsageError, match=f"^--secrets-fd {rfd} does not hold the secrets"):
        mount.receive_secrets(args, rfd)
    with pytest.raises(options.UsageError, match=f"^--secrets-fd {rfd}: Bad file descriptor$"):
        mount.receive_secrets(args, rfd)  # closed above
    rfd, wfd = os.pipe()
    monkeypatch.setattr(mount, "SECRETS_TIMEOUT", 0.05)
    try:
        with pytest.raises(options.UsageError, match=f"^--secrets-fd {rfd}: no secrets within"):
            mount.receive_secrets(args, rfd)
    finally:
        os.close(rfd)
        os.close(wfd)
    with pytest.raises(options.UsageError, match=r"^the secrets are too long \(\d+ bytes\)$"):
        mount.secrets_pipe({"dhchap_secret": "x" * mount.SECRETS_MAX})
    assert args.dhchap_secret is None




@pytest.mark.skipif(
    not os.access("/dev/fuse", os.W_OK) or shutil.which("fusermount3") is None,
    reason="needs /dev/fuse and fusermount3",
)
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM", "fusermount3 -u"])
def test_foreground_mount_until_stopped(tmp_path, stop):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    rfd, wfd = os.pipe()
    script = FOREGROUND.format(tests=str(Path(__file__).resolve().parent.parent))
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *MOUNT, "--ready-fd", str(wfd), str(mnt)],
        pass_fds=(wfd,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(wfd)
    try:
        status = mount.read_line(rfd, STEP)
        os.close(rfd)
        assert status == "ready", proc.stderr.read() if status == "" else status
        assert sorted(os.listdir(mnt)) == [".nvmeof", "n1", "n2"]
        assert entry.main(["list", str(mnt)]) == 0
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


TLS_KEY = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"


@pytest.mark.parametrize("argv", [
    [*TCP_MOUNT, "--tls", "--tls-key", TLS_KEY, "--daemon", "/mnt"],
    [*TCP_MOUNT, f"--tls-key={TLS_KEY}", "--daemon", "/mnt"],
])
def test_an_inline_tls_key_reaches_the_daemon_over_the_pipe_only(monkeypatch, argv):
    started = []

    class Popen:
        def __init__(self, cmd, **kwargs):
            started.append(cmd)
            args = entry.parse_args(cmd[3:])
            mount.receive_secrets(args, os.dup(int(cmd[cmd.index("--secrets-fd") + 1])))
            started.append(args)
            os.write(int(cmd[cmd.index("--ready-fd") + 1]), b"ready\n")

    monkeypatch.setattr(mount.subprocess, "Popen", Popen)
    assert entry.main(argv) == 0
    cmd, child = started
    assert not any("VRLb" in a for a in cmd), cmd
    assert child.tls_key == TLS_KEY and child.tls == ("--tls" in argv)


def test_tls_without_a_key_is_one_line(capsys):
    one_line_error(capsys, [*TCP_MOUNT, "--tls", "--keyring", "nowhere", "/mnt"],
                   "--tls without --tls-key takes the PSK from the kernel keyring, but keyring "
                   "nowhere not found in /proc/keys")
