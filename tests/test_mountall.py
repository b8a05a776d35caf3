"""mount-all (connect-all with a mount per subsystem) and `list` of every mount."""

import json
import re

import pytest
from test_cli import SECRET, host, one_line_error  # noqa: F401  (host is a fixture)

from nvmeof_fuse import cli, mountall
from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.fs.mount import MountInfo
from nvmeof_fuse.mountall import DiscoveryTarget, plan, read_discovery_conf

S1, S2 = "nqn.2014-08.org.example:s1", "nqn.2014-08.org.example:s2"


def rec(subnqn, subtype="nvme subsystem", trtype="rdma", traddr="192.0.2.1", trsvcid="4420"):
    return {"subnqn": subnqn, "subtype": subtype, "trtype": trtype, "traddr": traddr,
            "trsvcid": trsvcid}


def test_discovery_conf_as_nvme_cli_reads_it(tmp_path):
    conf = tmp_path / "discovery.conf"
    conf.write_text("# comment\n\n"
                    "--transport=tcp --traddr=192.0.2.1 --trsvcid=8009\n"
                    "-t rdma -a 192.0.2.2 -q nqn.2014-08.org.example:host --keep-alive-tmo=5\n"
                    "--traddr=192.0.2.3\n")  # no transport: skipped, as nvme-cli does
    assert read_discovery_conf(str(conf)) == [
        DiscoveryTarget("tcp", "192.0.2.1", "8009"),
        DiscoveryTarget("rdma", "192.0.2.2", hostnqn="nqn.2014-08.org.example:host"),
    ]
    with pytest.raises(InvalidArgument, match="no -a ADDRESS given and no .*absent"):
        read_discovery_conf(str(tmp_path / "absent"))


def test_plan(tmp_path):
    records = [rec("nqn.2014-08.org.nvmexpress.discovery", "current discovery subsystem"),
               rec(S1), rec(S1, traddr="192.0.2.9"), rec(S2, trtype="fc"),
               rec("nqn.x/y"), rec(S2, "discovery subsystem referral"),
               rec("nqn.2014-08.org.example:s3"), rec("nqn.2014-08.org.example:s4")]
    mounts = [(f"{tmp_path}/nqn.2014-08.org.example:s3", "fuse.nvmeof-fuse"),
              (f"{tmp_path}/nqn.2014-08.org.example:s4", "ext4")]
    outcomes = plan(records, str(tmp_path), mounts, ["-i", "2"])
    got = [(o.subnqn, o.status, o.reason) for o in outcomes]
    assert got == [
        (S1, "mount", ""),
        (S1, "skipped", "another path to a subsystem mounted above"),
        (S2, "skipped", "transport fc is not supported"),
        ("nqn.x/y", "skipped", "'nqn.x/y' is not an NQN usable as a directory name"),
        (S2, "skipped", "a referral to another discovery controller"),
        ("nqn.2014-08.org.example:s3", "already mounted", ""),
        ("nqn.2014-08.org.example:s4", "failed", "a ext4 filesystem is mounted there"),
    ]
    first = plan(records, str(tmp_path), mounts, ["-i", "2"])[0]
    assert first.argv == ["mount", "-t", "rdma", "-a", "192.0.2.1", "-s", "4420", "-n", S1,
                          "-i", "2", f"{tmp_path}/{S1}"]


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
            raise cli.UsageError("cannot connect to 192.0.2.1:4420: refused")
        return 0

    monkeypatch.setattr(cli, "spawn_daemon", spawn)
    return calls


def test_mount_all(capsys, host, spawned, tmp_path, monkeypatch):  # noqa: F811
    host.page = Page(rec(S1), rec(S2))
    root = tmp_path / "root"
    assert cli.main(["mount-all", "-a", "192.0.2.1", "-O", "ctrl_loss_tmo=-1,read_only",
                     str(root)]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"{S1}\s+rdma\s+192.0.2.1:4420\s+{root}/{S1}\s+mounted", out), out
    assert host.connects[0].nqn == cli.DISCOVERY_NQN and host.connects[0].trsvcid == 4420
    assert sorted(cli.parse_args(c[3:]).nqn for c in spawned) == [S1, S2]
    [first] = [c for c in spawned if f"--nqn={S1}" in c]  # mounted in parallel: any order
    assert first[3:] == ["mount", "--transport=rdma", "--traddr=192.0.2.1", "--trsvcid=4420",
                         f"--nqn={S1}", "--ctrl-loss-tmo=-1", "--read-only", f"{root}/{S1}"]
    assert (root / S1).is_dir() and (root / S2).is_dir()
    # the second run finds them mounted
    mounted = [MountInfo(str(root / S1), "fuse.nvmeof-fuse", "x"),
               MountInfo(str(root / S2), "fuse.nvmeof-fuse", "x")]
    monkeypatch.setattr("nvmeof_fuse.fs.mount.read_mountinfo", lambda: mounted)
    assert cli.main(["mount-all", "-a", "192.0.2.1", "-o", "json", str(root)]) == 0
    assert [o["status"] for o in json.loads(capsys.readouterr().out)] == ["already mounted"] * 2
    assert len(spawned) == 2


def test_mount_all_makes_secret_files_absolute(host, spawned, tmp_path,  # noqa: F811
                                               monkeypatch):
    """Each mount runs in /, where a relative dhchap_secret_file names another file or none."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "host.key").write_text(SECRET + "\n")
    (tmp_path / "host.key").chmod(0o600)
    host.page = Page(rec(S1))
    assert cli.main(["mount-all", "-a", "192.0.2.1", "-O", "dhchap_secret_file=host.key",
                     str(tmp_path / "root")]) == 0
    [argv] = spawned
    monkeypatch.chdir("/")
    args = cli.parse_args(argv[3:])
    assert args.dhchap_secret == str(tmp_path / "host.key")
    cli.connect_options(args, nqn=args.nqn, default_port=4420)


def test_mount_all_refuses_an_inline_secret_in_its_mount_options(capsys, host, spawned,  # noqa: F811
                                                                 tmp_path):
    err = one_line_error(capsys, ["mount-all", "-a", "192.0.2.1", "-O",
                                  f"dhchap_secret={SECRET}", str(tmp_path)],
                         "mount option dhchap_secret= is refused: mount options are readable")
    assert SECRET[10:-1] not in err and not spawned


def test_mount_all_failures_are_rows(capsys, host, spawned, tmp_path):  # noqa: F811
    host.page = Page(rec("nqn.2014-08.org.example:bad"), rec(S1))
    assert cli.main(["mount-all", "-a", "192.0.2.1", "-o", "json", str(tmp_path)]) == 1
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
def test_mount_all_errors(capsys, host, spawned, tmp_path, argv, match):  # noqa: F811
    one_line_error(capsys, ["mount-all", *argv, str(tmp_path)], match)
    assert host.connects == [] and spawned == []


def test_list_every_mount(capsys, tmp_path, monkeypatch):
    good, stale = tmp_path / "good", tmp_path / "stale"
    (good / ".nvmeof").mkdir(parents=True)
    stale.mkdir()
    doc = {"controller": {"transport": "rdma", "traddr": "192.0.2.1", "trsvcid": 4420},
           "identify": {"mn": "Model X", "sn": "SN1", "fr": "1"},
           "namespaces": [{"nsid": 2, "size": 4096, "lba_size": 512, "nlb": 8}]}
    (good / ".nvmeof" / "controller.json").write_text(json.dumps(doc))
    mounts = [MountInfo("/proc", "proc", "proc"),
              MountInfo(str(good), mountall.FSTYPE, f"nvme+rdma://192.0.2.1/{S1}/2"),
              MountInfo(str(stale), mountall.FSTYPE, "x")]
    monkeypatch.setattr("nvmeof_fuse.fs.mount.read_mountinfo", lambda: mounts)
    assert cli.main(["list"]) == 1  # the stale one is an error line, the rest still listed
    out, err = capsys.readouterr()
    assert f"{good}: Model X" in out and f"{good}/n2" in out and "/proc" not in out
    assert err.count("\n") == 1 and f"{stale} is not an nvmeof-fuse mount" in err
    assert cli.main(["list", "-o", "json"]) == 1
    docs = json.loads(capsys.readouterr().out)
    assert [(d["mountpoint"], d["source"]) for d in docs] == [
        (str(good), f"nvme+rdma://192.0.2.1/{S1}/2")]
