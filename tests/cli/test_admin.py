"""mount-all (connect-all with a mount per subsystem) through the command line."""

import json
import re

import pytest
from cli_fakes import SECRET, one_line_error

from nvmeof_fuse.cli import admin, entry, options
from nvmeof_fuse.fs.mount import MountInfo

S1, S2 = "nqn.2014-08.org.example:s1", "nqn.2014-08.org.example:s2"


def rec(subnqn, subtype="nvme subsystem", trtype="rdma", traddr="192.0.2.1", trsvcid="4420"):
    return {"subnqn": subnqn, "subtype": subtype, "trtype": trtype, "traddr": traddr,
            "trsvcid": trsvcid}



class Page:
    def __init__(self, *records):
        self.records = list(records)

    def to_dict(self):
        return {"genctr": 1, "numrec": len(self.records), "records": self.records}


@pytest.fixture
def spawned(monkeypatch):
    calls = []

    def spawn(cmd, log_file, secrets=None):
        assert not secrets  # mount-all takes secrets only as files (-O dhchap_secret_file=)
        calls.append(cmd)
        if "--nqn=nqn.2014-08.org.example:bad" in cmd:
            raise options.UsageError("cannot connect to 192.0.2.1:4420: refused")
        return 0

    monkeypatch.setattr(admin, "spawn_daemon", spawn)
    return calls


def test_mount_all(capsys, host, spawned, tmp_path, monkeypatch):
    host.page = Page(rec(S1), rec(S2))
    root = tmp_path / "root"
    assert entry.main(["mount-all", "-a", "192.0.2.1", "-O", "ctrl_loss_tmo=-1,read_only",
                     str(root)]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"{S1}\s+rdma\s+192.0.2.1:4420\s+{root}/{S1}\s+mounted", out), out
    assert host.connects[0].nqn == options.DISCOVERY_NQN and host.connects[0].trsvcid == 4420
    assert sorted(entry.parse_args(c[3:]).nqn for c in spawned) == [S1, S2]
    [first] = [c for c in spawned if f"--nqn={S1}" in c]  # mounted in parallel: any order
    assert first[3:] == ["mount", "--transport=rdma", "--traddr=192.0.2.1", "--trsvcid=4420",
                         f"--nqn={S1}", "--ctrl-loss-tmo=-1", "--read-only", f"{root}/{S1}"]
    assert (root / S1).is_dir() and (root / S2).is_dir()
    # the second run finds them mounted
    mounted = [MountInfo(str(root / S1), "fuse.nvmeof-fuse", "x"),
               MountInfo(str(root / S2), "fuse.nvmeof-fuse", "x")]
    monkeypatch.setattr("nvmeof_fuse.fs.mount.read_mountinfo", lambda: mounted)
    assert entry.main(["mount-all", "-a", "192.0.2.1", "-o", "json", str(root)]) == 0
    assert [o["status"] for o in json.loads(capsys.readouterr().out)] == ["already mounted"] * 2
    assert len(spawned) == 2


def test_mount_all_makes_secret_files_absolute(host, spawned, tmp_path,
                                               monkeypatch):
    """Each mount runs in /, where a relative dhchap_secret_file names another file or none."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "host.key").write_text(SECRET + "\n")
    (tmp_path / "host.key").chmod(0o600)
    host.page = Page(rec(S1))
    assert entry.main(["mount-all", "-a", "192.0.2.1", "-O", "dhchap_secret_file=host.key",
                     str(tmp_path / "root")]) == 0
    [argv] = spawned
    monkeypatch.chdir("/")
    args = entry.parse_args(argv[3:])
    assert args.dhchap_secret == str(tmp_path / "host.key")
    options.connect_options(args, nqn=args.nqn, default_port=4420)


def test_mount_all_refuses_an_inline_secret_in_its_mount_options(capsys, host, spawned,
                                                                 tmp_path):
    err = one_line_error(capsys, ["mount-all", "-a", "192.0.2.1", "-O",
                                  f"dhchap_secret={SECRET}", str(tmp_path)],
                         "mount option dhchap_secret= is refused: mount options are readable")
    assert SECRET[10:-1] not in err and not spawned


def test_mount_all_failures_are_rows(capsys, host, spawned, tmp_path):
    host.page = Page(rec("nqn.2014-08.org.example:bad"), rec(S1))
    assert entry.main(["mount-all", "-a", "192.0.2.1", "-o", "json", str(tmp_path)]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert [(r["status"], r["reason"]) for r in rows] == [
        ("failed", "cannot connect to 192.0.2.1:4420: refused"), ("mounted", "")]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["-a", "192.0.2.1", "-O", "traddr=192.0.2.2"], "mount option 'traddr' comes from the "
                                                        "discovery log page"),
        (["-a", "192.0.2.1", "-O", "colour=red"], "unknown mount option 'colour'"),
        (["-a", "192.0.2.1", "-O", "ctrl_loss_tmo=x"], "--ctrl-loss-tmo 'x' is not a number"),
        (["--discovery-conf", "/nonexistent"], "no -a ADDRESS given and no /nonexistent"),
    ],
)
def test_mount_all_errors(capsys, host, spawned, tmp_path, argv, match):
    one_line_error(capsys, ["mount-all", *argv, str(tmp_path)], match)
    assert host.connects == [] and spawned == []


def test_mount_all_asks_its_discovery_controller_over_tls_with_its_key(host, spawned, tmp_path):
    """``--tls --tls-key`` reach the discovery connection (a TLS-only port's discovery
    controller takes nothing else); the mounts take their key as ``-O tls_key_file=``."""
    key = tmp_path / "tls.key"
    key.write_text("NVMeTLSkey-1:01:ERERERERERERERERERERERERERERERERERERERERERHYIEm8:\n")
    key.chmod(0o600)
    host.page = Page(rec(S1, trtype="tcp"))
    assert entry.main(["mount-all", "-t", "tcp", "-a", "192.0.2.1", "--tls", "--tls-key",
                       str(key), "-O", f"tls_key_file={key}", str(tmp_path / "root")]) == 0
    [discovery] = host.connects
    assert discovery.tls and discovery.tls_key == str(key)
    assert discovery.configured_psk() is not None
    [argv] = spawned
    assert entry.parse_args(argv[3:]).tls_key == str(key)
