"""NVMe URIs as libnvme's nvme_parse_uri reads them (its test/uriparser.c cases, our subset)."""

import pytest

from nvmeof_fuse.nvme.uri import NVMeURI, URIError, looks_like_uri, parse_uri, split_path_keys

NQN = "nqn.2014-08.org.example:sub1"


@pytest.mark.parametrize(
    "text, want",
    [
        (f"nvme+rdma://10.0.0.1/{NQN}", NVMeURI("rdma", "10.0.0.1", None, NQN)),
        (f"nvme+rdma://10.0.0.1/{NQN}/", NVMeURI("rdma", "10.0.0.1", None, NQN)),
        (f"nvme+tcp://10.0.0.1:4421/{NQN}/2", NVMeURI("tcp", "10.0.0.1", 4421, NQN, 2)),
        (f"NVME+TCP://host.example//{NQN}//7/", NVMeURI("tcp", "host.example", None, NQN, 7)),
        (f"nvme+rdma://[fe80::1010]:4420/{NQN}", NVMeURI("rdma", "fe80::1010", 4420, NQN)),
        (f"nvme+rdma://[fe80::1010]/{NQN}/1", NVMeURI("rdma", "fe80::1010", None, NQN, 1)),
        ("nvme+tcp://h/nqn.2014-08.org.example%3Asub1", NVMeURI("tcp", "h", None, NQN)),
    ],
)
def test_parse(text, want):
    assert parse_uri(text) == want


def test_str_round_trips():
    for text in (f"nvme+rdma://10.0.0.1:4420/{NQN}/2", f"nvme+tcp://[fe80::1]/{NQN}"):
        assert str(parse_uri(text)) == text


@pytest.mark.parametrize(
    "text, match",
    [
        ("nvme+rdma://10.0.0.1", "missing the subsystem NQN"),
        ("nvme+rdma://10.0.0.1:4420/", "missing the subsystem NQN"),
        (f"nvme+rdma://10.0.0.1:44x0/{NQN}", "bad port '44x0'"),
        (f"nvme+rdma://10.0.0.1:70000/{NQN}", "bad port '70000'"),
        (f"nvme+rdma://10.0.0.1:/{NQN}", "bad port ''"),
        (f"nvme+fc://10.0.0.1/{NQN}", "unknown scheme 'nvme+fc'"),
        (f"nfs://10.0.0.1/{NQN}", "unknown scheme 'nfs'"),
        (f"nvme://10.0.0.1/{NQN}", "unknown scheme 'nvme'"),
        (f"nvme+rdma://10.0.0.1/{NQN}/two", "NSID 'two' in"),
        (f"nvme+rdma://10.0.0.1/{NQN}/-1", "NSID '-1' in"),
        (f"nvme+rdma://10.0.0.1/{NQN}/0", "NSID 0 in"),
        (f"nvme+rdma://10.0.0.1/{NQN}/1/x", "too many path parts"),
        ("nvme+rdma://h/sub1", "'sub1' in 'nvme+rdma://h/sub1' is not a subsystem NQN"),
        (f"nvme+rdma:///{NQN}", "missing host"),
        (f"nvme+rdma://[fe80::1/{NQN}", "bad host"),
        (f"nvme+rdma://u@h/{NQN}", "user information"),
        (f"nvme+rdma://h/{NQN}?x=1", "query or fragment"),
        (NQN, "is not an NVMe URI"),
    ],
)
def test_bad_uris_name_the_wrong_part(text, match):
    with pytest.raises(URIError) as e:
        parse_uri(text)
    assert match in str(e.value) and "\n" not in str(e.value)


def test_looks_like_uri():
    assert looks_like_uri("nvme+rdma://x/y") and looks_like_uri("nfs://x")
    assert not looks_like_uri("/mnt/nvme") and not looks_like_uri(NQN)


def test_a_further_path_says_its_local_side_after_its_uri():
    uri = f"nvme+rdma://10.0.1.1/{NQN}"
    assert split_path_keys(uri) == (uri, {})
    assert split_path_keys(f"{uri}?host_iface=mlx5_1&host_traddr=10.0.1.9") == \
        (uri, {"host_iface": "mlx5_1", "host_traddr": "10.0.1.9"})


@pytest.mark.parametrize("keys, match", [
    ("hca=mlx5_1", "unknown key 'hca' after"),
    ("host_iface=", "host_iface after .* is empty"),
    ("host_iface=a&host_iface=b", "host_iface after .* is given twice"),
    ("&&", "bad keys '&&' after"),
])
def test_bad_path_keys_are_named(keys, match):
    with pytest.raises(URIError, match=match):
        split_path_keys(f"nvme+rdma://10.0.1.1/{NQN}?{keys}")
