"""discover and list: one mount, and every mount."""

import json

from cli_fakes import one_line_error

from nvmeof_fuse.cli import entry, mountall, options
from nvmeof_fuse.fs.mount import MountInfo


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
    assert entry.main(["discover", "-t", "tcp", "-a", "192.0.2.1"]) == 0
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
    assert host.connects[0].trsvcid == 8009 and host.connects[0].nqn == options.DISCOVERY_NQN
    assert entry.main(["discover", "-a", "192.0.2.1", "-o", "json"]) == 0
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
    assert entry.main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Model X (serial SN1, firmware 1.2)" in out and "rdma 192.0.2.1:4420 nqn.x:y" in out
    assert f"{tmp_path}/n1  1     4096" in out
    assert entry.main(["list", "-o", "json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["identify"]["sn"] == "SN1"


def test_list_errors(capsys, tmp_path):
    one_line_error(capsys, ["list", str(tmp_path / "nope")], "does not exist")
    one_line_error(capsys, ["list", str(tmp_path)], "is not an nvmeof-fuse mount")



S1, S2 = "nqn.2014-08.org.example:s1", "nqn.2014-08.org.example:s2"


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
    assert entry.main(["list"]) == 1  # the stale one is an error line, the rest still listed
    out, err = capsys.readouterr()
    assert f"{good}: Model X" in out and f"{good}/n2" in out and "/proc" not in out
    assert err.count("\n") == 1 and f"{stale} is not an nvmeof-fuse mount" in err
    assert entry.main(["list", "-o", "json"]) == 1
    docs = json.loads(capsys.readouterr().out)
    assert [(d["mountpoint"], d["source"]) for d in docs] == [
        (str(good), f"nvme+rdma://192.0.2.1/{S1}/2")]


def test_list_shows_the_paths_of_a_multipath_mount(capsys, tmp_path):
    (tmp_path / ".nvmeof").mkdir()
    path = {"index": 0, "uri": "nvme+rdma://192.0.2.1:4420/nqn.x:y", "transport": "rdma",
            "traddr": "192.0.2.1", "trsvcid": 4420, "cntlid": 3, "ana_group": 1,
            "ana_state": "optimized", "state": "live", "usable": True, "outstanding": 2,
            "ios": 10, "bytes": 40960, "losses": 0, "reconnects": 0}
    other = {**path, "index": 1, "transport": "tcp", "traddr": "192.0.2.2", "cntlid": None,
             "ana_state": "inaccessible", "state": "connecting", "usable": False, "ios": 0}
    doc = {
        "controller": {"transport": "rdma", "traddr": "192.0.2.1", "trsvcid": 4420, "cntlid": 3,
                       "subnqn": "nqn.x:y", "iopolicy": "queue-depth"},
        "identify": {"mn": "Model X", "sn": "SN1", "fr": "1.2", "subnqn": "nqn.x:y"},
        "namespaces": [{"nsid": 1, "size": 4096, "lba_size": 512, "nlb": 8}],
        "paths": [path, other],
    }
    (tmp_path / ".nvmeof" / "controller.json").write_text(json.dumps(doc))
    assert entry.main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "  nqn.x:y, iopolicy queue-depth"
    assert out[2] == ("  path 0: rdma 192.0.2.1:4420 cntlid 3 live optimized, 10 I/Os, "
                      "2 outstanding")
    assert out[3] == ("  path 1: tcp 192.0.2.2:4420 cntlid - connecting inaccessible (unused), "
                      "0 I/Os, 2 outstanding")
    assert entry.main(["list", "-o", "json", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["paths"][1]["ana_state"] == "inaccessible"
    path.update(device="mlx5_3", device_pci="0000:9b:00.0", device_numa_node=1)
    other.update(device="eth2", device_pci=None, device_numa_node=None)
    (tmp_path / ".nvmeof" / "controller.json").write_text(json.dumps(doc))
    assert entry.main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("  path 0: rdma 192.0.2.1:4420 via mlx5_3 (0000:9b:00.0, NUMA 1) "
                             "cntlid 3 live")
    assert out[3].startswith("  path 1: tcp 192.0.2.2:4420 via eth2 cntlid -")
    doc["paths"] = [path]
    (tmp_path / ".nvmeof" / "controller.json").write_text(json.dumps(doc))
    assert entry.main(["list", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == \
        "  rdma 192.0.2.1:4420 nqn.x:y cntlid 3 via mlx5_3 (0000:9b:00.0, NUMA 1)"
