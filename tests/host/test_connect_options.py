"""ConnectOptions.validate: every bad value gets a message naming its option."""

import dataclasses
import re

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
    ({"transport": "tcp", "tls": True, "keyring": "no-such-keyring"},
     "keyring no-such-keyring not found in /proc/keys"),
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


# --- TLS PSKs from the kernel keyring -----------------------------------------------------

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:h"


@pytest.fixture
def psk_keyring(own_keyring, monkeypatch):
    """``own_keyring`` with ``user`` keys standing for ``psk`` ones (nvme-keyring.ko's type
    exists only in the VM): add(identity, key) loads one."""
    from nvmeof_fuse.host import keyring

    monkeypatch.setattr(keyring, "PSK_KEY_TYPE", "user")
    name, serial = own_keyring

    def add(identity: str, key: bytes) -> None:
        keyring.add(serial, identity, key)

    return name, add


def test_tls_takes_the_kernels_default_identity_from_the_keyring(psk_keyring):
    """As ``nvme connect --tls`` without a key: retained before generated, SHA-384 first."""
    name, add = psk_keyring
    opts = options(transport="tcp", tls=True, keyring=name)
    opts.validate()
    with pytest.raises(InvalidArgument, match=re.escape(
            f"--tls: keyring {name} holds no TLS PSK for this host and subsystem "
            f"('NVMe0R01 {HOSTNQN} nqn.2014-08.org.example:t', or its SHA-384 or generated "
            "form): load one")):
        opts.tls_psk(HOSTNQN)
    add(f"NVMe0G01 {HOSTNQN} nqn.2014-08.org.example:t", b"g" * 32)
    assert opts.tls_psk(HOSTNQN).key == b"g" * 32
    add(f"NVMe0R01 {HOSTNQN} nqn.2014-08.org.example:t", b"r" * 32)
    psk = opts.tls_psk(HOSTNQN)  # looked up again at each connection
    assert (psk.key, psk.suite) == (b"r" * 32, "TLS_AES_128_GCM_SHA256")
    add(f"NVMe0R02 {HOSTNQN} nqn.2014-08.org.example:t", b"s" * 48)
    psk = opts.tls_psk(HOSTNQN)
    assert (psk.key, psk.suite) == (b"s" * 48, "TLS_AES_256_GCM_SHA384")
    assert "sss" not in repr(opts)


def test_tls_key_identity_names_the_keyrings_key_or_the_keys_version(psk_keyring):
    name, add = psk_keyring
    v1 = f"NVMe1R01 {HOSTNQN} nqn.2014-08.org.example:t digest="
    opts = options(transport="tcp", tls_key_identity=v1, keyring=name)
    assert opts.uses_tls
    with pytest.raises(InvalidArgument, match=f"keyring {name} holds no TLS PSK '{v1}'"):
        opts.tls_psk(HOSTNQN)
    add(v1, b"k" * 48)
    with pytest.raises(InvalidArgument, match="holds 48 bytes, but its identity names SHA256"):
        opts.tls_psk(HOSTNQN)
    add(v1, b"k" * 32)
    assert opts.tls_psk(HOSTNQN).identity == v1
    # with --tls-key: the identity picks the version the key is derived for
    derived = options(transport="tcp", tls_key=TLS_KEY).tls_psk(HOSTNQN)
    from nvmeof_fuse.nvme import tls_psk
    v1_of_key = tls_psk.derive(tls_psk.parse_interchange(TLS_KEY), HOSTNQN,
                               "nqn.2014-08.org.example:t", version=1)
    for identity, want in ((derived.identity, derived), (v1_of_key.identity, v1_of_key)):
        assert options(transport="tcp", tls_key=TLS_KEY,
                       tls_key_identity=identity).tls_psk(HOSTNQN) == want
    with pytest.raises(InvalidArgument, match="--tls-key-identity is neither identity "
                       "--tls-key gives this host and subsystem: 'NVMe0R01 "):
        options(transport="tcp", tls_key=TLS_KEY, tls_key_identity=v1).tls_psk(HOSTNQN)


def test_a_psk_the_mount_resolved_is_used_as_given():
    from nvmeof_fuse.nvme import tls_psk

    given = tls_psk.TlsPsk("NVMe0R01 h s", b"x" * 32, tls_psk.PskHash.SHA256)
    opts = options(transport="tcp", tls_psk_given=given)
    opts.validate()
    assert opts.uses_tls and opts.tls_psk(HOSTNQN) is given and "xxx" not in repr(opts)


def test_tls_compat_derives_the_psk_as_libnvme_before_1_16():
    """``--tls-compat``: the PSK nvme-cli before 2.16 loads into a target's keyring for the
    same key (libnvme's older derivation: our check-tls-key --compat)."""
    from nvmeof_fuse.nvme import tls_psk

    configured = tls_psk.parse_interchange(TLS_KEY)
    for compat in (False, True):
        got = options(transport="tcp", tls_key=TLS_KEY, tls_compat=compat).tls_psk(HOSTNQN)
        assert got == tls_psk.derive(configured, HOSTNQN, "nqn.2014-08.org.example:t",
                                     compat=compat)
    assert (options(transport="tcp", tls_key=TLS_KEY).tls_psk(HOSTNQN).key
            != options(transport="tcp", tls_key=TLS_KEY, tls_compat=True).tls_psk(HOSTNQN).key)
