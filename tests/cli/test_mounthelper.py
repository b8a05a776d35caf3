"""The mount(8)/fstab/systemd side: mount.fuse3's command line, -o keys, URI sources."""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_fakes import FOREGROUND, SECRET, STEP, one_line_error

from nvmeof_fuse.cli import entry, mount, mounthelper
from nvmeof_fuse.cli.mounthelper import apply_source, helper_argv, install_helper, key_to_args
from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.fs.mount import read_mountinfo

NQN = "nqn.2014-08.org.example:s1"
URI = f"nvme+rdma://192.0.2.1:4421/{NQN}"


def test_helper_form_becomes_a_daemon_mount():
    # what mount.fuse3 runs for an fstab line: it adds dev,suid and keeps _netdev/nofail out
    argv = helper_argv([URI, "/mnt/x", "-o", "rw,_netdev,nofail,ctrl_loss_tmo=-1,nr-io-queues=4,"
                        "read_only,allow_other,x-systemd.automount,uid=7,dev,suid"])
    assert argv == ["mount", "--ctrl-loss-tmo", "-1", "--nr-io-queues", "4", "--read-only",
                    "-o", "allow_other", "--uid", "7", "--daemon", URI, "/mnt/x"]
    assert helper_argv(["-v", URI, "rel", "-oro", "-n", "-t", "fuse.nvmeof-fuse"]) == [
        "mount", "--read-only", "--daemon", URI, os.path.abspath("rel")]


def test_shutdown_timeout_as_an_o_key():
    assert helper_argv([URI, "/m", "-o", "_netdev,shutdown_timeout=12"]) == [
        "mount", "--shutdown-timeout", "12", "--daemon", URI, "/m"]


def test_fuse_server_as_an_o_key():
    assert helper_argv([URI, "/m", "-o", "_netdev,fuse=pyfuse3"]) == [
        "mount", "--fuse", "pyfuse3", "--daemon", URI, "/m"]


@pytest.mark.parametrize(
    "argv, match",
    [
        ([URI, "/m", "-o", "ctrl_loss_tmo=1,bogus=3"], "unknown mount option 'bogus' (known: "),
        ([URI, "/m", "-o", "nr_io_queues"], "mount option 'nr_io_queues' needs a value"),
        ([URI, "/m", "-o", "read_only=yes"], "mount option 'read_only' takes no value"),
        ([URI, "/m", "-o"], "-o needs a value"),
        ([URI, "/m", "-x"], "unknown argument '-x'"),
        ([URI], "give a source and a mountpoint"),
    ],
)
def test_helper_form_errors(argv, match):
    with pytest.raises(InvalidArgument, match=re.escape(match)):
        helper_argv(argv)


def test_every_mount_option_is_an_o_key(capsys):
    with pytest.raises(SystemExit):
        entry.main(["mount", "--help"])
    longs = set(re.findall(r"--([a-z][a-z_-]+)", capsys.readouterr().out))
    flags = {f.split()[0] for f, _ in mounthelper.KEYS.values()}
    missing = {o for o in longs if f"--{o}" not in flags} - {"help", "daemon", "namespace-id",
                                                             "fast_io_fail_tmo"}
    assert not missing, f"mount options without an -o key in mounthelper.KEYS: {missing}"
    for key, (flag, takes_value) in mounthelper.KEYS.items():
        assert key_to_args(f"{key}=1" if takes_value else key)[:len(flag.split())] == flag.split()




def test_dhchap_secret_files_as_o_keys():
    assert key_to_args("dhchap_secret_file=/etc/nvme/key") == ["--dhchap-secret",
                                                               "/etc/nvme/key"]
    assert key_to_args("dhchap_ctrl_secret_file=/etc/nvme/ck") == ["--dhchap-ctrl-secret",
                                                                   "/etc/nvme/ck"]
    assert key_to_args("allow_insecure_secret_file") == ["--allow-insecure-secret-file"]


@pytest.mark.parametrize("item, message", [
    (f"dhchap_secret={SECRET}", "mount option dhchap_secret= is refused"),
    ("dhchap_secret=/etc/nvme/key", "mount option dhchap_secret= is refused"),  # old spelling
    (f"dhchap-ctrl-secret={SECRET}", "mount option dhchap_ctrl_secret= is refused"),
    (f"dhchap_ctrl_secret_file={SECRET}",
     "mount option dhchap_ctrl_secret_file= names a file, not the secret itself"),
])
def test_secrets_in_mount_options_are_refused_saying_why_and_what_to_write(item, message):
    with pytest.raises(InvalidArgument) as info:
        key_to_args(item)
    file_key = "dhchap_ctrl_secret_file" if "ctrl" in item else "dhchap_secret_file"
    assert str(info.value) == (
        f"{message}: mount options are readable by every user (in /etc/fstab and the process "
        "list); put the secret in a file only its owner can read (chmod 600) and write "
        f"{file_key}=FILE instead")


def test_ignored_keys():
    for item in ("defaults", "_netdev", "nofail", "noauto", "auto", "user", "users", "rw",
                 "x-systemd.requires=network-online.target", "x-systemd.automount", "dev",
                 "suid", "exec", "noatime", "comment=x"):
        assert key_to_args(item) == [], item


def source_args(*argv):
    args = entry.parse_args(["mount", *argv, "/m"])
    apply_source(args)
    return args


def test_uri_source_fills_the_target():
    a = source_args(f"{URI}/2")
    assert (a.transport, a.traddr, a.trsvcid, a.nqn, a.nsid, a.fsname) == (
        "rdma", "192.0.2.1", "4421", NQN, "2", f"{URI}/2")
    a = source_args("nvme+tcp://h/" + NQN)
    assert (a.transport, a.trsvcid, a.nsid) == ("tcp", None, None)
    a = source_args("label", "-a", "192.0.2.1", "-n", NQN)  # like sshfs' fsname
    assert (a.transport, a.fsname) == ("rdma", "label")


@pytest.mark.parametrize(
    "argv, match",
    [
        ([URI, "-a", "192.0.2.2"], f"the URI {URI} already names the target; drop -a"),
        ([URI + "/1", "--nsid", "2"], "--nsid 2 contradicts the URI's /1"),
        (["somewhere"], "'somewhere' is not an NVMe URI: give nvme+rdma://"),
        ([f"nvme+rdma://h:99999/{NQN}"], "bad port '99999'"),
    ],
)
def test_source_errors(argv, match):
    with pytest.raises(InvalidArgument, match=re.escape(match)):
        source_args(*argv)


def test_mount_with_a_uri_connects_there(capsys, host, tmp_path):
    one_line_error(capsys, ["mount", f"{URI}/2", str(tmp_path)],
                   "namespace 2 is not active on the controller (active: 1)")
    c = host.connects[0]
    assert (c.transport, c.traddr, c.trsvcid, c.nqn) == ("rdma", "192.0.2.1", 4421, NQN)


@pytest.mark.parametrize(
    "argv, match",
    [
        ([f"nvme+rdma://192.0.2.1/{NQN}/x", "/m"], "NSID 'x' in"),
        ([f"nvme+rdma://192.0.2.1:0/{NQN}", "/m"], "bad port '0'"),
        (["nvme+rdma://192.0.2.1/", "/m"], "missing the subsystem NQN"),
        ([f"nvme+fc://192.0.2.1/{NQN}", "/m"], "unknown scheme 'nvme+fc'"),
        ([URI, "/m", "-o", "nr_io_queues=2,colour=blue"], "unknown mount option 'colour'"),
        ([URI, "/m", "-o", "ctrl_loss_tmo=soon"], "--ctrl-loss-tmo 'soon' is not a number"),
    ],
)
def test_helper_form_errors_are_one_line(capsys, host, argv, match):
    one_line_error(capsys, argv, match)
    assert host.connects == []


def test_helper_form_refuses_an_inline_secret_in_one_line(capsys, host, tmp_path):
    """What mount(8) runs for an fstab line with dhchap_secret=: refused before any daemon."""
    err = one_line_error(capsys, [URI, str(tmp_path), "-o", f"_netdev,dhchap_secret={SECRET}"],
                         "mount option dhchap_secret= is refused: mount options are readable")
    assert SECRET[10:-1] not in err and not host.connects


def test_helper_form_spawns_the_daemon(host, tmp_path, monkeypatch):
    spawned = []
    monkeypatch.setattr(mount, "spawn_daemon",
                        lambda cmd, log_file, secrets: spawned.append(cmd) or 0)
    assert entry.main([URI, str(tmp_path), "-o", "dev,suid,_netdev,keep_alive_tmo=7"]) == 0
    cmd = spawned[0]
    assert cmd[:3] == [sys.executable, "-m", "nvmeof_fuse.cli"] and "--daemon" not in cmd
    assert cmd[3:] == ["mount", "--keep-alive-tmo=7", URI, str(tmp_path)]


def test_daemon_logs_to_the_journal_under_systemd(monkeypatch, tmp_path):
    assert not mounthelper.under_systemd({})
    assert mounthelper.under_systemd({"INVOCATION_ID": "abc"})
    assert mounthelper.under_systemd({"JOURNAL_STREAM": "8:123"})
    monkeypatch.setenv("INVOCATION_ID", "abc")
    with mounthelper.daemon_output(None) as out:
        assert out is None  # inherited: systemd's journal stream
    with mounthelper.daemon_output(str(tmp_path / "log")) as out:
        assert out.name == str(tmp_path / "log")  # an explicit log file still wins
    monkeypatch.delenv("INVOCATION_ID")
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    with mounthelper.daemon_output(None) as out:
        assert out.name == os.devnull


def test_install_helper(tmp_path):
    prog = tmp_path / "venv" / "nvmeof-fuse"
    prog.parent.mkdir()
    prog.write_text("#!/bin/sh\n")
    prog.chmod(0o755)
    mount_fuse = tmp_path / "mount.fuse"
    mount_fuse.write_text("")
    bindir = tmp_path / "sbin"
    done = install_helper(str(bindir), str(prog), [str(mount_fuse)])
    assert done == f"linked {bindir}/nvmeof-fuse -> {prog}"
    assert os.path.realpath(bindir / "nvmeof-fuse") == str(prog)
    assert "already on the default PATH" in install_helper(str(bindir), str(prog),
                                                            [str(mount_fuse)])
    with pytest.raises(InvalidArgument, match="not found: install fuse3"):
        install_helper(str(bindir), str(prog), [str(tmp_path / "absent")])


GENERATOR = "/lib/systemd/system-generators/systemd-fstab-generator"


@pytest.mark.skipif(not os.access(GENERATOR, os.X_OK), reason="needs systemd's fstab generator")
def test_systemd_fstab_generator_makes_a_network_mount(tmp_path):
    """The README's fstab line, through systemd-fstab-generator: a remote mount unit."""
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{URI}/2  /mnt/nvme  fuse.nvmeof-fuse  _netdev,nofail,ctrl_loss_tmo=-1  0 0\n"
                     f"{URI}  /mnt/auto  fuse.nvmeof-fuse  _netdev,x-systemd.automount  0 0\n")
    out = [tmp_path / d for d in ("normal", "early", "late")]
    for d in out:
        d.mkdir()
    env = {**os.environ, "SYSTEMD_FSTAB": str(fstab), "SYSTEMD_LOG_LEVEL": "err"}
    subprocess.run([GENERATOR, *map(str, out)], env=env, check=True, timeout=30)
    unit = (out[0] / "mnt-nvme.mount").read_text()
    assert f"What={URI}/2\n" in unit and "Where=/mnt/nvme\n" in unit
    assert "Type=fuse.nvmeof-fuse\n" in unit
    assert "Options=_netdev,nofail,ctrl_loss_tmo=-1\n" in unit
    # _netdev makes it a remote mount: pulled in by remote-fs.target (systemd then orders it
    # After=network-online.target and Wants= it, see systemd.mount(5)), not local-fs.target
    assert (out[0] / "remote-fs.target.wants" / "mnt-nvme.mount").exists()
    assert "local-fs.target" not in unit
    assert not (out[0] / "local-fs.target.requires" / "mnt-nvme.mount").exists()
    assert (out[0] / "mnt-auto.automount").exists()
    assert "Type=fuse.nvmeof-fuse" in (out[0] / "mnt-auto.mount").read_text()


@pytest.mark.skipif(shutil.which("mount.fuse3") is None and not os.path.exists(
    "/sbin/mount.fuse3"), reason="needs fuse3's mount.fuse3")
def test_mount_fuse3_runs_us_as_the_readme_says(tmp_path):
    """mount.fuse3 -t fuse.nvmeof-fuse runs `nvmeof-fuse SOURCE DIR -o OPTS` from PATH."""
    fake = tmp_path / "bin" / "nvmeof-fuse"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/argv\n")
    fake.chmod(0o755)
    helper = shutil.which("mount.fuse3") or "/sbin/mount.fuse3"
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    subprocess.run([helper, URI, "/mnt/x", "-o", "rw,_netdev,nofail,ctrl_loss_tmo=-1", "-t",
                    "fuse.nvmeof-fuse"], env=env, check=True, timeout=30)
    argv = Path(tmp_path / "argv").read_text().splitlines()
    assert argv == [URI, "/mnt/x", "-o", "rw,ctrl_loss_tmo=-1,dev,suid"]
    assert helper_argv(argv) == ["mount", "--ctrl-loss-tmo", "-1", "--daemon", URI, "/mnt/x"]
    path = URI.replace("rdma", "tcp").replace("192.0.2.1", "192.0.2.2")  # the README's fstab
    subprocess.run([helper, URI, "/mnt/x", "-o", f"path={path},iopolicy=queue-depth,_netdev",
                    "-t", "fuse.nvmeof-fuse"], env=env, check=True, timeout=30)
    argv = Path(tmp_path / "argv").read_text().splitlines()
    assert argv[3].startswith(f"path={path},iopolicy=queue-depth"), argv
    assert helper_argv(argv)[:4] == ["mount", "--path", path, "--iopolicy"]


@pytest.mark.skipif(not os.access("/dev/fuse", os.W_OK) or shutil.which("fusermount3") is None,
                    reason="needs /dev/fuse and fusermount3")
def test_uri_with_nsid_mounts_one_namespace_under_our_fstype(tmp_path):
    """Through the kernel: n2 only, fstype fuse.nvmeof-fuse, the URI as source (for mount -a)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    rfd, wfd = os.pipe()
    script = FOREGROUND.format(tests=str(Path(__file__).resolve().parent.parent))
    uri = f"nvme+rdma://192.0.2.1/{NQN}/2"
    proc = subprocess.Popen([sys.executable, "-c", script, "mount", uri, "--ready-fd", str(wfd),
                             str(mnt)], pass_fds=(wfd,), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    os.close(wfd)
    try:
        status = mount.read_line(rfd, STEP)
        os.close(rfd)
        assert status == "ready", proc.stderr.read() if status == "" else status
        assert sorted(os.listdir(mnt)) == [".nvmeof", "n2"]
        [m] = [m for m in read_mountinfo() if m.mountpoint == str(mnt)]
        assert (m.fstype, m.source) == ("fuse.nvmeof-fuse", uri)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STEP) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STEP)
        if any(m.mountpoint == str(mnt) for m in read_mountinfo()):
            subprocess.run(["fusermount3", "-uz", str(mnt)], timeout=STEP, check=False)


def test_paths_and_iopolicy_as_fstab_keys():
    uri1, uri2 = "nvme+tcp://192.0.2.2/nqn.2014-08.org.example:s1", "nvme+rdma://[fe80::1]/nqn.x:y"
    argv = helper_argv(["nvme+rdma://192.0.2.1/nqn.2014-08.org.example:s1", "/mnt/n",
                        "-o", f"path={uri1},path={uri2},iopolicy=round-robin,_netdev"])
    assert argv[argv.index("--path") + 1] == uri1
    assert argv.count("--path") == 2 and uri2 in argv
    assert argv[argv.index("--iopolicy") + 1] == "round-robin"


def test_max_namespaces_as_an_fstab_key():
    argv = helper_argv(["nvme+tcp://192.0.2.1/nqn.2014-08.org.example:s1", "/mnt/n",
                        "-o", "max_namespaces=1024,_netdev"])
    assert argv[argv.index("--max-namespaces") + 1] == "1024"


def test_workers_as_an_fstab_key():
    argv = helper_argv(["nvme+tcp://192.0.2.1/nqn.2014-08.org.example:s1", "/mnt/n",
                        "-o", "workers=4,_netdev"])
    assert argv[argv.index("--workers") + 1] == "4"
    argv = helper_argv(["nvme+tcp://192.0.2.1/nqn.2014-08.org.example:s1", "/mnt/n",
                        "-o", "workers=auto,_netdev"])
    assert argv[argv.index("--workers") + 1] == "auto"


def test_tls_as_o_keys():
    assert key_to_args("tls") == ["--tls"]
    assert key_to_args("tls_key_file=/etc/nvme/tls.key") == ["--tls-key", "/etc/nvme/tls.key"]


@pytest.mark.parametrize("item", [
    "tls_key=NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:",
    "tls_key_file=NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:",
])
def test_a_tls_key_in_the_mount_options_is_refused(item):
    with pytest.raises(InvalidArgument) as info:
        key_to_args(item)
    assert "mount options are readable by every user" in str(info.value)
    assert "tls_key_file=FILE" in str(info.value) and "VRLb" not in str(info.value)
