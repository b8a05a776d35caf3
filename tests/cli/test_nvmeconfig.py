"""/etc/nvme/config.json: the TLS and DH-HMAC-CHAP settings libnvme's JSON holds for a port
fill in what the command line leaves out; every bad file or entry is one line naming it."""

from __future__ import annotations

import json

import pytest

from nvmeof_fuse.cli import nvmeconfig
from nvmeof_fuse.cli.mount import mount_parser
from nvmeof_fuse.cli.options import connect_options
from nvmeof_fuse.errors import InvalidArgument

HOST = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000c1"
SUB = "nqn.2014-08.org.example:cfg"
KEY = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"  # libnvme's psk.c
DHCHAP = "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"
PORT = nvmeconfig.Port(HOST, SUB, "tcp", "192.0.2.7", 4420)


def config(tmp_path, ports, mode=0o600, host_extra=None):
    tree = [{"hostnqn": "nqn.2014-08.org.example:other-host", "subsystems": []},
            {"hostnqn": HOST, **(host_extra or {}),
             "subsystems": [{"nqn": "nqn.2014-08.org.example:other", "ports": []},
                            {"nqn": SUB, "ports": ports}]}]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tree))
    path.chmod(mode)
    return str(path)


def test_the_ports_entry_is_found_by_host_subsystem_transport_address_and_port(tmp_path):
    path = config(tmp_path, [
        {"transport": "tcp", "traddr": "192.0.2.7", "trsvcid": "4421", "tls": False},
        {"transport": "tcp", "traddr": "192.0.2.7", "trsvcid": "4420", "tls": True,
         "tls_key": KEY, "keyring": ".nvme", "tls_key_identity": "none"}])
    found = nvmeconfig.load(path, PORT, required=True)
    assert (found.tls, found.tls_key, found.keyring, found.tls_key_identity) == \
        (True, KEY, ".nvme", None)
    assert KEY not in repr(found)
    for other in (nvmeconfig.Port(HOST, SUB, "rdma", "192.0.2.7", 4420),
                  nvmeconfig.Port(HOST, SUB, "tcp", "192.0.2.8", 4420),
                  nvmeconfig.Port(HOST, SUB, "tcp", "192.0.2.7", 4422),
                  nvmeconfig.Port(HOST, "nqn.2014-08.org.example:x", "tcp", "192.0.2.7", 4420),
                  nvmeconfig.Port("nqn.2014-08.org.example:h", SUB, "tcp", "192.0.2.7", 4420)):
        assert nvmeconfig.load(path, other, required=True) is None
    assert nvmeconfig.load(str(tmp_path / "absent"), PORT, required=False) is None


def test_a_hosts_dhchap_key_stands_for_its_ports(tmp_path):
    path = config(tmp_path, [{"transport": "tcp", "traddr": "192.0.2.7"}],
                  host_extra={"dhchap_key": DHCHAP})
    assert nvmeconfig.load(path, PORT, required=True).dhchap_key == DHCHAP


@pytest.mark.parametrize(("write", "message"), [
    (lambda p: p.write_text("[{"), "is not valid JSON (line 1)"),
    (lambda p: p.write_text('{"hosts": 3}'), ": hosts is not a list of objects"),
    (lambda p: p.write_text(json.dumps([{"hostnqn": HOST, "subsystems": [
        {"nqn": SUB, "ports": [{"transport": "tcp", "traddr": "192.0.2.7", "tls": "yes"}]}]}])),
     f": {SUB} at 192.0.2.7:4420: tls is not true or false"),
    (lambda p: p.write_text(json.dumps([{"hostnqn": HOST, "subsystems": [
        {"nqn": SUB, "ports": [{"transport": "tcp", "traddr": "192.0.2.7",
                                "tls_key": KEY.replace("VRLb", "VRLc")}]}]}])),
     f": {SUB} at 192.0.2.7:4420: tls_key fails its CRC-32 check"),
])
def test_a_bad_file_or_entry_is_one_line_naming_it(tmp_path, write, message):
    path = tmp_path / "config.json"
    write(path)
    path.chmod(0o600)
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")) \
            as info:
        nvmeconfig.load(str(path), PORT, required=True)
    assert "VRL" not in str(info.value)
    with pytest.raises(InvalidArgument, match=r"--config .*/absent: no such file"):
        nvmeconfig.load(str(tmp_path / "absent"), PORT, required=True)


def test_a_file_others_may_read_is_refused_only_when_it_holds_a_secret_we_use(tmp_path):
    path = config(tmp_path, [{"transport": "tcp", "traddr": "192.0.2.7", "tls_key": KEY}],
                  mode=0o644)
    with pytest.raises(InvalidArgument, match=f"holds a secret for {SUB}, but its permissions "
                       "0644 are too open"):
        nvmeconfig.load(path, PORT, required=True)
    assert nvmeconfig.load(path, PORT, required=True, allow_insecure=True).tls_key == KEY
    plain = config(tmp_path, [{"transport": "tcp", "traddr": "192.0.2.7", "tls": True}],
                   mode=0o644)
    assert nvmeconfig.load(plain, PORT, required=True).tls is True


def test_mount_takes_what_the_command_line_leaves_out(tmp_path):
    path = config(tmp_path, [{"transport": "tcp", "traddr": "192.0.2.7", "tls": True,
                              "tls_key": KEY, "dhchap_key": DHCHAP}])

    def opts(*extra):
        args = mount_parser().parse_args(["mount", "-t", "tcp", "-a", "192.0.2.7", "-n", SUB,
                                          "-q", HOST, *extra, "/mnt"])
        return connect_options(args, nqn=args.nqn, default_port=4420)

    taken = opts("--config", path)
    assert (taken.tls, taken.tls_key, taken.dhchap_secret) == (True, KEY, DHCHAP)
    other = "NVMeTLSkey-1:01:" + KEY.split(":")[2] + ":"
    assert opts("--config", path, "--tls-key", other).tls_key == other  # the line wins
    assert opts("--config", "none").tls_key is None
