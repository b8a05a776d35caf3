"""mount-all's plan: discovery.conf as nvme-cli reads it, and what to do with each record."""

import pytest

from nvmeof_fuse.cli.mountall import DiscoveryTarget, plan, read_discovery_conf
from nvmeof_fuse.errors import InvalidArgument

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
        (S1, "path", "a further path of the mount above"),
        (S2, "skipped", "transport fc is not supported"),
        ("nqn.x/y", "skipped", "'nqn.x/y' is not an NQN usable as a directory name"),
        (S2, "skipped", "a referral to another discovery controller"),
        ("nqn.2014-08.org.example:s3", "already mounted", ""),
        ("nqn.2014-08.org.example:s4", "failed", "a ext4 filesystem is mounted there"),
    ]
    first = plan(records, str(tmp_path), mounts, ["-i", "2"])[0]
    assert first.argv == ["mount", "-t", "rdma", "-a", "192.0.2.1", "-s", "4420", "-n", S1,
                          "-i", "2", "--path", f"nvme+rdma://192.0.2.9:4420/{S1}",
                          f"{tmp_path}/{S1}"]


def test_the_entries_of_one_subsystem_make_one_mount_with_several_paths(tmp_path):
    s3 = "nqn.2014-08.org.example:s3"
    records = [rec(S1), rec(S1, trtype="tcp", traddr="192.0.2.2", trsvcid="4421"),
               rec(S1),  # the same address again (a second discovery controller says it)
               rec(S1, traddr="fe80::1"), rec(s3), rec(s3, traddr="192.0.2.9")]
    mounts = [(f"{tmp_path}/{s3}", "fuse.nvmeof-fuse")]
    outcomes = plan(records, str(tmp_path), mounts, [])
    assert [(o.status, o.reason) for o in outcomes] == [
        ("mount", ""), ("path", "a further path of the mount above"),
        ("skipped", "the same address as a path above"),
        ("path", "a further path of the mount above"), ("already mounted", ""),
        ("skipped", "another path to a subsystem mounted above (add it with: nvmeof-fuse "
                    "add-path)")]
    assert outcomes[0].argv[-5:] == ["--path", f"nvme+tcp://192.0.2.2:4421/{S1}",
                                     "--path", f"nvme+rdma://[fe80::1]:4420/{S1}",
                                     f"{tmp_path}/{S1}"]


def test_a_port_that_requires_tls_is_mounted_with_its_key_or_refused_in_one_line(tmp_path):
    def tls(subnqn, sectype="tls13", treq="required"):
        return {**rec(subnqn, trtype="tcp"), "tcp_sectype": sectype, "treq": treq}

    s3 = "nqn.2014-08.org.example:s3"
    records = [tls(S1), tls(S2, "tls"), tls(s3, treq="not required"),
               {**rec("nqn.2014-08.org.example:s4", trtype="tcp"), "tcp_sectype": "none",
                "treq": "required"}]
    identity = f"NVMe0R01 h {S1}"
    outcomes = plan(records, str(tmp_path), [], [], lambda subnqn: identity)
    assert [(o.status, o.reason) for o in outcomes] == [
        ("failed", f"the port requires TLS 1.3 (its TSAS) and the keyring holds no "
                   f"'{identity}': load it (nvmeof-fuse gen-tls-key --insert) or give -O "
                   "tls_key_file=FILE"),
        ("failed", "the port requires TLS (tls); nvmeof-fuse speaks TLS 1.3 only"),
        ("mount", ""), ("mount", "")]
    assert "--tls" not in outcomes[2].argv  # TLS is not required there
    keyed = plan(records, str(tmp_path), [], ["--tls-key", "/etc/nvme/tls-s1"])
    assert keyed[0].status == "mount" and "--tls-key" in keyed[0].argv
    assert "--tls" not in keyed[0].argv  # the key implies it
    in_keyring = plan(records, str(tmp_path), [], [], lambda subnqn: None)
    assert in_keyring[0].status == "mount" and in_keyring[0].argv[-2] == "--tls"
    asked = plan(records, str(tmp_path), [], ["--tls", "--keyring", "ring"], lambda s: identity)
    assert asked[0].status == "mount" and asked[0].argv.count("--tls") == 1
