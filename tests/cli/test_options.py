"""The shared options: nvme-cli's names, their checks, one-line errors."""

import sys

import pytest
from cli_fakes import MOUNT, SECRET, one_line_error

from nvmeof_fuse.cli import entry, options
from nvmeof_fuse.errors import ConnectError


def test_mount_without_a_target(capsys, host, tmp_path):
    one_line_error(capsys, ["mount", "-n", "nqn.2014-08.org.example:s1", str(tmp_path)],
                   "no target given: give nvme+rdma://HOST[:PORT]/SUBNQN[/NSID], or -a")
    assert host.connects == []


@pytest.mark.parametrize(
    "extra, match",
    [
        (["-s", "abc"], "--trsvcid 'abc' is not an integer"),
        (["-s", "70000"], "--trsvcid 70000 is out of range"),
        (["--mode", "999"], "--mode '999' is not an octal mode"),
        (["--mode", "1777"], "--mode 1777 is out of range"),
        (["-o", "allow_other,exec"], "unsupported -o option(s): exec"),
        (["--uid", "-1"], "--uid -1 is out of range"),
        (["-I", "not-a-uuid"], "--hostid 'not-a-uuid' is not a UUID"),
        (["-q", "host1"], "--hostnqn 'host1' is not an NQN"),
        (["-k", "soon"], "--keep-alive-tmo 'soon' is not a number"),
        (["-Q", "1"], "--queue-size 1 is out of range"),
        (["-i", "0"], "--nr-io-queues 0 is out of range"),
        (["--companion-queues", "-1"], "--companion-queues -1 is out of range"),
        (["--companion-queues", "many"], "--companion-queues 'many' is not an integer"),
        (["-c", "0"], "--reconnect-delay 0 is out of range (1-65535 s)"),
        (["-l", "-5"], "--ctrl-loss-tmo -5 is out of range (0-2147483648 s, or -1 for ever)"),
        (["-l", "later"], "--ctrl-loss-tmo 'later' is not a number"),
        (["-f", "-2"], "--fast-io-fail-tmo -2 is out of range (0-2147483648 s, or -1 for off)"),
        (["--shutdown-timeout", "0"], "--shutdown-timeout 0 is out of range (1-255 s)"),
        (["--shutdown-timeout", "300"], "--shutdown-timeout 300 is out of range (1-255 s)"),
        (["--shutdown-timeout", "soon"], "--shutdown-timeout 'soon' is not a number"),
        (["--fuse", "fusepy"], "unknown FUSE server 'fusepy' (known: builtin, pyfuse3)"),
        (["-o", "fuse=pyfuse3", "--fuse", "builtin"], "conflicting FUSE servers: builtin, pyfuse3"),
    ],
)
def test_bad_option_values_are_one_line(capsys, host, tmp_path, extra, match):
    one_line_error(capsys, [*MOUNT, *extra, str(tmp_path)], match)
    assert host.connects == []


@pytest.mark.parametrize("extra, server", [
    ([], "builtin"),
    (["--fuse", "pyfuse3"], "pyfuse3"),
    (["-o", "allow_other,fuse=pyfuse3"], "pyfuse3"),
    (["-o", "fuse=builtin"], "builtin"),
    (["--fuse", "pyfuse3", "-o", "fuse=pyfuse3"], "pyfuse3"),
])
def test_the_fuse_server_is_an_option(extra, server, tmp_path):
    assert options.mount_options(entry.parse_args([*MOUNT, *extra, str(tmp_path)])).fuse == server


def test_pyfuse3_missing_is_one_line_before_connecting(capsys, host, tmp_path, monkeypatch):
    import nvmeof_fuse.fs

    monkeypatch.setitem(sys.modules, "pyfuse3", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "nvmeof_fuse.fs.pyfuse3_server", raising=False)
    monkeypatch.delattr(nvmeof_fuse.fs, "pyfuse3_server", raising=False)
    host.error = ConnectError("connected before the FUSE server was checked")  # never serves
    one_line_error(capsys, [*MOUNT, "-o", "fuse=pyfuse3", str(tmp_path)],
                   "fuse=pyfuse3 needs pyfuse3, which cannot be imported")
    assert host.connects == []


def test_connect_error_is_one_line(capsys, host, tmp_path):
    host.error = ConnectError("cannot connect to 192.0.2.1:4420: connection refused")
    one_line_error(capsys, [*MOUNT, str(tmp_path)], "connection refused")
    assert host.connects[0].traddr == "192.0.2.1" and host.connects[0].keep_alive_tmo == 5.0
    assert (host.connects[0].reconnect_delay, host.connects[0].ctrl_loss_tmo) == (10.0, 600.0)



def test_dhchap_options_follow_nvme_cli(tmp_path):
    key = tmp_path / "key"
    key.write_text(SECRET + "\n")
    key.chmod(0o600)
    args = entry.build_parser().parse_args([*MOUNT, "-S", str(key), "--dhchap-ctrl-secret",
                                          SECRET, str(tmp_path)])
    opts = options.connect_options(args, nqn=args.nqn, default_port=4420)
    assert (opts.dhchap_secret, opts.dhchap_ctrl_secret) == (str(key), SECRET)


@pytest.mark.parametrize("extra, match", [
    (["-S", SECRET[:-5] + "AAAA:"], "--dhchap-secret (inline) fails its CRC-32 check"),
    (["-S", "/nonexistent/key"], "--dhchap-secret file /nonexistent/key: No such file"),
    (["-C", SECRET], "--dhchap-ctrl-secret needs --dhchap-secret"),
    (["-o", f"dhchap_secret={SECRET}"], "mount option dhchap_secret= is refused: mount "
     "options are readable by every user (in /etc/fstab and the process list); "
     "put the secret in a file only its owner can read (chmod 600) and write --dhchap-secret "
     "FILE instead"),
    (["-o", f"allow_other,x={SECRET}"], "unsupported -o option(s): x (known: allow_other, "
     "fuse=SERVER, path=URI, iopolicy=POLICY, workers=N|auto, max_namespaces=N)"),
])
def test_bad_dhchap_secrets_are_one_line_without_the_secret(capsys, tmp_path, extra, match):
    err = one_line_error(capsys, [*MOUNT, *extra, str(tmp_path)], match)
    assert SECRET[10:-5] not in err


def test_reconnect_options_follow_nvme_cli(tmp_path):
    args = entry.build_parser().parse_args([*MOUNT, "-c", "2", "-l", "-1", str(tmp_path)])
    opts = options.connect_options(args, nqn=args.nqn, default_port=4420)
    assert (opts.reconnect_delay, opts.ctrl_loss_tmo, opts.fast_io_fail_tmo) == (2.0, -1.0, -1.0)
    for spelling in ("--fast-io-fail-tmo", "--fast_io_fail_tmo"):  # nvme-cli's is the latter
        args = entry.build_parser().parse_args([*MOUNT, spelling, "7", str(tmp_path)])
        assert options.connect_options(args, nqn=args.nqn, default_port=4420).fast_io_fail_tmo == 7


def test_the_shutdown_timeout_is_an_option_as_linuxs_module_parameter(tmp_path):
    args = entry.build_parser().parse_args([*MOUNT, str(tmp_path)])
    assert options.connect_options(args, nqn=args.nqn, default_port=4420).shutdown_timeout == 5
    args = entry.build_parser().parse_args([*MOUNT, "--shutdown-timeout", "12", str(tmp_path)])
    assert options.connect_options(args, nqn=args.nqn, default_port=4420).shutdown_timeout == 12


P2, P3 = "nvme+tcp://192.0.2.2/nqn.2014-08.org.example:s1", "nvme+rdma://192.0.2.3:4421/nqn.x:y"


@pytest.mark.parametrize("extra, paths, policy", [
    ([], (), "queue-depth"),
    (["--path", P2, "--iopolicy", "round-robin"], (P2,), "round-robin"),
    (["--path", P2, "-o", f"path={P3},iopolicy=failover"], (P2, P3), "failover"),
    (["-o", f"allow_other,path={P3}", "-o", "iopolicy=queue-depth", "--iopolicy",
      "queue-depth"], (P3,), "queue-depth"),
    (["--path", f"{P3}?host_iface=mlx5_1"], (f"{P3}?host_iface=mlx5_1",), "queue-depth"),
])
def test_paths_and_iopolicy_are_options(extra, paths, policy, tmp_path):
    mopts = options.mount_options(entry.parse_args([*MOUNT, *extra, str(tmp_path)]))
    assert (mopts.paths, mopts.iopolicy) == (paths, policy)


@pytest.mark.parametrize("extra, match", [
    (["--path", "nvme+tcp://192.0.2.2/nqn.2014-08.org.example:s1/1"], "names a namespace (/1)"),
    (["--path", "192.0.2.2"], "is not an NVMe URI"),
    (["--path", P2, "-o", f"path={P2}"], f"path {P2} is given twice"),
    (["--path", f"{P2}?hca=mlx5_1"], f"unknown key 'hca' after '{P2}' (known: host_iface, "
     "host_traddr)"),
    (["--path", f"{P2}?host_iface="], f"host_iface after '{P2}' is empty"),
    (["--host-iface", "a/b"], "--host-iface 'a/b' is not a device name"),
    (["-o", "iopolicy=numa"], "unknown iopolicy 'numa' (known: failover, round-robin, "
     "queue-depth)"),
    (["-o", "iopolicy=failover", "--iopolicy", "round-robin"],
     "conflicting iopolicies: failover, round-robin"),
])
def test_bad_paths_and_iopolicies_are_one_line_before_connecting(capsys, host, tmp_path,
                                                                 extra, match):
    one_line_error(capsys, [*MOUNT, *extra, str(tmp_path)], match)
    assert host.connects == []


def test_the_daemon_connects_every_path_with_the_policy(host, tmp_path, monkeypatch):
    from nvmeof_fuse.cli import mount as mount_cli

    seen = {}

    def run(fn, conn, mopts, *rest):
        seen["paths"], seen["policy"] = mopts.paths, mopts.iopolicy
    monkeypatch.setattr("trio.run", run)
    assert mount_cli.cmd_mount(entry.parse_args(
        [*MOUNT, "--path", P2, "--iopolicy", "failover", str(tmp_path)]), []) == 0
    assert seen == {"paths": (P2,), "policy": "failover"}


@pytest.mark.parametrize(("argv", "workers", "chosen"), [
    ([], 8, "auto: 16 usable cores"), (["--workers", "auto"], 8, "auto: 16 usable cores"),
    (["-o", "workers=auto"], 8, "auto: 16 usable cores"),
    (["--workers", "2"], 2, "--workers"), (["-o", "workers=4"], 4, "--workers"),
    (["--workers", "1"], 1, "--workers"), (["--workers", "64"], 64, "--workers"),
    (["--workers", "3", "-o", "workers=3"], 3, "--workers"),
    (["--workers", "auto", "-o", "workers=auto"], 8, "auto: 16 usable cores"),
    (["--fuse", "pyfuse3"], 1, "auto: --fuse pyfuse3 serves one descriptor")])
def test_workers_from_the_option_or_o_else_auto(monkeypatch, argv, workers, chosen):
    """A count given wins over the cores (past auto's cap too); without one, or with
    ``auto``, the count is chosen from the cores the process may use (16 here)."""
    from nvmeof_fuse.cli.mount import parse_mount_args

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    args = parse_mount_args(["mount", *argv, "-t", "tcp", "-a", "192.0.2.1", "-n", "nqn.x:y",
                             "/mnt"])
    mopts = options.mount_options(args)
    assert (mopts.workers, mopts.workers_chosen) == (workers, chosen)


def test_workers_auto_keeps_one_on_two_usable_cores(monkeypatch):
    from nvmeof_fuse.cli.mount import parse_mount_args

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 5})  # taskset -c 0,5
    args = parse_mount_args(["mount", "-t", "tcp", "-a", "192.0.2.1", "-n", "nqn.x:y", "/mnt"])
    mopts = options.mount_options(args)
    assert (mopts.workers, mopts.workers_chosen) == (1, "auto: 2 usable cores")


@pytest.mark.parametrize(("argv", "cap"), [
    ([], 65536), (["--max-namespaces", "16"], 16), (["-o", "max_namespaces=0x100"], 256),
    (["--max-namespaces", "4294967294"], 0xFFFFFFFE)])
def test_max_namespaces_from_the_option_or_o(argv, cap):
    args = entry.parse_args(["mount", *argv, "-t", "tcp", "-a", "192.0.2.1", "-n", "nqn.x:y",
                             "/mnt"])
    assert options.connect_options(args, nqn="nqn.x:y", default_port=4420).max_namespaces == cap


@pytest.mark.parametrize(("argv", "error"), [
    (["--max-namespaces", "0"], "--max-namespaces 0 is out of range (1-4294967294)"),
    (["--max-namespaces", "4294967295"],
     "--max-namespaces 4294967295 is out of range (1-4294967294)"),
    (["-o", "max_namespaces=many"], "--max-namespaces 'many' is not an integer"),
    (["--max-namespaces", "8", "-o", "max_namespaces=9"], "conflicting namespace caps: 8, 9")])
def test_bad_max_namespaces_are_one_line(argv, error):
    args = entry.parse_args(["mount", *argv, "-t", "tcp", "-a", "192.0.2.1", "-n", "nqn.x:y",
                             "/mnt"])
    with pytest.raises(options.UsageError) as bad:
        options.connect_options(args, nqn="nqn.x:y", default_port=4420)
    assert str(bad.value) == error


@pytest.mark.parametrize(("argv", "error"), [
    (["--workers", "0"], "--workers 0 is out of range (1-256)"),
    (["--workers", "two"], "--workers 'two' is not an integer"),
    (["-o", "workers=Auto"], "--workers 'Auto' is not an integer"),
    (["--workers", "auto", "-o", "workers=2"], "conflicting worker counts: 2, auto"),
    (["--workers", "2", "-o", "workers=3"], "conflicting worker counts: 2, 3")])
def test_bad_workers_are_one_line(argv, error):
    from nvmeof_fuse.cli.mount import parse_mount_args

    args = parse_mount_args(["mount", *argv, "-t", "tcp", "-a", "192.0.2.1", "-n", "nqn.x:y",
                             "/mnt"])
    with pytest.raises(options.UsageError) as bad:
        options.mount_options(args)
    assert str(bad.value) == error


def test_the_local_device_is_an_option_as_nvme_clis_host_iface(tmp_path):
    from nvmeof_fuse.cli.mounthelper import key_to_args

    args = entry.parse_args([*MOUNT, "--host-iface", "mlx5_3", str(tmp_path)])
    assert options.connect_options(args, nqn=args.nqn, default_port=4420).host_iface == "mlx5_3"
    assert key_to_args("host_iface=mlx5_3") == ["--host-iface", "mlx5_3"]  # fstab's key
