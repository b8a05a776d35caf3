"""ConnectOptions.validate: every bad value gets a message naming its option."""

import dataclasses

import pytest

from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.host.controller import ConnectOptions, reconnect_attempts


def options(**changes) -> ConnectOptions:
    return dataclasses.replace(ConnectOptions("192.0.2.1", "nqn.2014-08.org.example:t"), **changes)


@pytest.mark.parametrize("changes", [
    {}, {"trsvcid": 1}, {"trsvcid": 65535}, {"nr_io_queues": 1}, {"nr_io_queues": 65535},
    {"queue_size": 2}, {"queue_size": 65536}, {"keep_alive_tmo": 0}, {"keep_alive_tmo": 65535},
    {"reconnect_delay": 1}, {"ctrl_loss_tmo": 0}, {"ctrl_loss_tmo": -1},
    {"fast_io_fail_tmo": -1}, {"fast_io_fail_tmo": 0}, {"transport": "tcp"},
    {"shutdown_timeout": 1}, {"shutdown_timeout": 255},
    {"transport": "tcp", "hdr_digest": True, "data_digest": True},
    {"max_namespaces": 1}, {"max_namespaces": 0xFFFFFFFE},
    {"host_iface": "mlx5_3"}, {"host_iface": "enp26s0f1np1"}, {"host_iface": "a" * 63},
])
def test_valid_options(changes):
    options(**changes).validate()


@pytest.mark.parametrize(("changes", "message"), [
    ({"transport": "fc"}, "--transport 'fc' is not supported (supported: rdma, tcp)"),
    ({"transport": "RDMA"}, "--transport 'RDMA' is not supported"),
    ({"hdr_digest": True}, "--hdr-digest and --data-digest apply only to -t tcp"),
    ({"data_digest": True}, "--hdr-digest and --data-digest apply only to -t tcp"),
    ({"trsvcid": 0}, "--trsvcid 0 is not a port number (1-65535)"),
    ({"trsvcid": 65536}, "--trsvcid 65536 is not a port number"),
    ({"nr_io_queues": 0}, "--nr-io-queues 0 must be 1-65535"),
    ({"nr_io_queues": 65536}, "--nr-io-queues 65536 must be 1-65535"),
    ({"queue_size": 1}, "--queue-size 1 must be 2-65536"),
    ({"queue_size": 65537}, "--queue-size 65537 must be 2-65536"),
    ({"keep_alive_tmo": -1}, "--keep-alive-tmo -1 must be 0-65535 s"),
    ({"keep_alive_tmo": 70000.5}, "--keep-alive-tmo 70000.5 must be 0-65535 s"),
    ({"nqn": ""}, "--nqn is required"),
    ({"reconnect_delay": 0}, "--reconnect-delay 0 must be 1-65535 s"),
    ({"ctrl_loss_tmo": -2}, "--ctrl-loss-tmo -2 must be -1 (forever) or 0 or more seconds"),
    ({"fast_io_fail_tmo": -3}, "--fast-io-fail-tmo -3 must be -1 (off) or 0 or more seconds"),
    ({"shutdown_timeout": 0.5}, "--shutdown-timeout 0.5 must be 1-255 s"),
    ({"shutdown_timeout": 256}, "--shutdown-timeout 256 must be 1-255 s"),
    ({"max_namespaces": 0}, "--max-namespaces 0 must be 1-4294967294"),
    ({"max_namespaces": 2**32}, "--max-namespaces 4294967296 must be 1-4294967294"),
    ({"host_iface": "../mlx5_0"}, "--host-iface '../mlx5_0' is not a device name (as mlx5_0 "
     "or eth0: 1-63 letters, digits, _ . : -)"),
    ({"host_iface": ""}, "--host-iface '' is not a device name"),
    ({"host_iface": "a" * 64}, "--host-iface 'aaaa"),
])
def test_bad_option_message(changes, message):
    with pytest.raises(InvalidArgument) as info:
        options(**changes).validate()
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("ctrl_loss_tmo", "delay", "attempts"), [
    (600, 10, 60), (0, 10, 0), (5, 10, 1), (25, 10, 3), (-1, 10, float("inf")),
])
def test_reconnect_attempts_follow_the_kernel(ctrl_loss_tmo, delay, attempts):
    """max_reconnects = DIV_ROUND_UP(ctrl_loss_tmo, reconnect_delay); -1 is unlimited."""
    assert reconnect_attempts(ctrl_loss_tmo, delay) == attempts


# --- TLS (NVMe/TCP) ---------------------------------------------------------------------------

TLS_KEY = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"  # libnvme's psk.c


def test_a_tls_key_inline_or_in_a_file_implies_tls(tmp_path):
    path = tmp_path / "tls.key"
    path.write_text(TLS_KEY + "\n")
    path.chmod(0o600)
    for value in (TLS_KEY, str(path)):
        opts = options(transport="tcp", tls_key=value)
        opts.validate()
        psk = opts.tls_psk("nqn.2014-08.org.nvmexpress:uuid:h")
        assert psk.identity == ("NVMe0R01 nqn.2014-08.org.nvmexpress:uuid:h "
                                "nqn.2014-08.org.example:t")
        assert psk.suite == "TLS_AES_128_GCM_SHA256"
    assert TLS_KEY not in repr(opts)
    assert options(transport="tcp").tls_psk("nqn.h") is None


@pytest.mark.parametrize(("changes", "message"), [
    ({"transport": "tcp", "tls": True}, "--tls needs --tls-key: the PSK as `nvme gen-tls-key` "
     "prints it (NVMeTLSkey-1:hh:...:), or better the path of a file (mode 0600) holding it; "
     "the kernel keyring is not read"),
    ({"tls_key": TLS_KEY}, "--tls and --tls-key apply only to -t tcp"),
    ({"tls": True}, "--tls and --tls-key apply only to -t tcp"),
    ({"transport": "tcp", "tls_key": TLS_KEY.replace("VRLb", "VRLc")},
     "--tls-key (inline) fails its CRC-32 check (mistyped or truncated)"),
    ({"transport": "tcp", "tls_key": "DHHC-1:00:abcd:"},
     "--tls-key (inline) is a DH-HMAC-CHAP secret (DHHC-1:...), not a TLS PSK"),
    ({"transport": "tcp", "tls_key": "no-such-file"},
     "--tls-key is neither an NVMeTLSkey-1:hh:<base64>: key nor the path of a file holding "
     "one"),
])
def test_bad_tls_options_are_named(changes, message):
    with pytest.raises(InvalidArgument) as info:
        options(**changes).validate()
    assert message in str(info.value) and "VRLb" not in str(info.value)


def test_a_tls_key_file_others_may_read_is_refused(tmp_path):
    path = tmp_path / "tls.key"
    path.write_text(TLS_KEY)
    path.chmod(0o644)
    with pytest.raises(InvalidArgument, match="permissions 0644 are too open"):
        options(transport="tcp", tls_key=str(path)).validate()
