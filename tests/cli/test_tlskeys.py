"""``gen-tls-key`` and ``check-tls-key``: nvme-cli's options and output, every refusal in one
line that never holds the key, and this machine's nvme-cli as the second opinion.

We follow nvme-cli 3.0 (``nvme keys gen-tls``/``check-tls``, which the old names forward to).
Where nvme-cli 2.3 (Debian 12's, on the development machines and in the testbed VM) differs:
``check-tls-key`` takes ``-k/--key`` (``-d/--keydata`` since 2.4, ``-k`` became ``--keyring``)
and adds the key's CRC-32 to its line; it refuses hash 00, which libnvme and we accept; its
``gen-tls-key --secret`` reads half the secret and refuses every full-length one (fixed in 2.4);
its messages repeat the key.  Stricter than any nvme-cli: a key must end with its ':', and a
``--secret`` longer than the key is refused, not cut.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys

import pytest
from cli_fakes import one_line_error

from nvmeof_fuse.cli import entry
from nvmeof_fuse.nvme import tls_psk

# libnvme's test/psk.c: the configured PSKs and their interchange form
HEX32 = "5512DBB6737D0106F65975B773DFB011FFC344BCF442E2DD6D8BC4870B5D5B03"
HEX48 = HEX32 + "FFC344BCF442E2DD6D8BC4870B5D5B03"
KEY01 = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"
KEY02 = ("NVMeTLSkey-1:02:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwP/w0S89ELi3W2LxIcLXVsDn8kX"
         "ZQ==:")
BODY01 = KEY01.split(":")[2]
HOST, SUBSYS = "nqn.psk-test-host", "nqn.psk-test-subsys"
ID01 = f"NVMe1R01 {HOST} {SUBSYS} iSbjiStwJ/1TrTvDlt2fjFmzvsytOJelidNnA+X5lEU="
ID01_COMPAT = f"NVMe1R01 {HOST} {SUBSYS} 66GuqV08TsAGII39teWUfwQwizjv06Jy8jOcX3NAAzM="
ID02 = (f"NVMe1R02 {HOST} {SUBSYS} "
        "QhW2+Rp6RzHlNtCslyRxMnwJ11tKKhz8JCAQpQ+XUD8f9td1VeH5h53yz2wKJG1a")


def run(capsys, argv: list[str]) -> list[str]:
    assert entry.main(argv) == 0
    out = capsys.readouterr()
    assert out.err == ""
    return out.out.splitlines()


def secret_file(tmp_path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "key"
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


@pytest.fixture
def stdin(monkeypatch):
    def feed(text: str, tty: bool = False):
        stream = io.StringIO(text)
        stream.isatty = lambda: tty
        monkeypatch.setattr(sys, "stdin", stream)
    return feed


# --- gen-tls-key ---------------------------------------------------------------------------


def test_gen_tls_key_from_a_secret_prints_libnvmes_export(capsys):
    assert run(capsys, ["gen-tls-key", "--secret", HEX32]) == [KEY01]
    assert run(capsys, ["gen-tls-key", "-s", HEX48.lower(), "-m", "2"]) == [KEY02]


def test_gen_tls_key_makes_a_random_key_of_the_hmacs_length(capsys):
    first, second = (run(capsys, ["gen-tls-key"])[0] for _ in range(2))
    assert first != second
    assert tls_psk.parse_interchange(first).hash_id == tls_psk.PskHash.SHA256
    made = tls_psk.parse_interchange(run(capsys, ["gen-tls-key", "--hmac", "2"])[0])
    assert made.hash_id == tls_psk.PskHash.SHA384 and len(made.key) == 48


def test_gen_tls_key_takes_nvme_clis_other_options(capsys):
    argv = ["gen-tls-key", "-s", HEX32, "-n", HOST, "-c", SUBSYS, "-I", "1", "-C", "-k", ".nvme",
            "-t", "psk"]
    assert run(capsys, argv) == [KEY01]  # as nvme-cli without --insert: the key only


def test_gen_tls_key_reads_the_secret_from_a_file_or_stdin(capsys, tmp_path, stdin):
    assert run(capsys, ["gen-tls-key", "-s", secret_file(tmp_path, HEX32)]) == [KEY01]
    stdin(HEX48 + "\n")
    assert run(capsys, ["gen-tls-key", "-m", "2", "-s", "-"]) == [KEY02]


@pytest.mark.parametrize("argv, message", [
    (["-m", "3"], "--hmac 3 is not one of 1 (SHA-256), 2 (SHA-384)"),
    (["-m", "0"], "--hmac 0 is not one of 1 (SHA-256), 2 (SHA-384)"),
    (["-m", "sha256"], "--hmac 'sha256' is not an integer"),
    (["-I", "2"], "--identity 2 is not one of 0 (NVMe/TCP 1.0c), 1 (with the digest)"),
    (["-i"], "--insert needs -c/--subsysnqn: the PSK identity names the subsystem"),
    (["-i", "-c", SUBSYS, "-k", "no-such-keyring"], "keyring no-such-keyring not found in "
                                                    "/proc/keys"),
    (["-f", "/tmp/k"], "--keyfile is not supported yet"),
    (["-s", "pin:1234"], "--secret pin:... (nvme-cli 3.0's key from a PIN) is not supported yet"),
    (["-s", "abc"], "--secret is too short: 32 bytes in hexadecimal are 64 digits"),
    (["-s", HEX32[:-1]], "--secret is not hexadecimal (an even number of 0-9, a-f)"),
    (["-s", HEX32[:-2]], "--secret is 31 bytes; --hmac 1 takes 32 (--hmac 2 takes 48)"),
    (["-s", HEX48], "--secret is 48 bytes; --hmac 1 takes 32 (--hmac 2 takes 48)"),
    (["-m", "2", "-s", HEX32], "--secret is 32 bytes; --hmac 2 takes 48 (--hmac 1 takes 32)"),
    (["-s", HEX32[:-2] + "zz"], "--secret is neither a hexadecimal secret nor the path of a "
                                "file holding it"),
])
def test_gen_tls_key_refusals(capsys, argv, message):
    err = one_line_error(capsys, ["gen-tls-key", *argv], message)
    assert HEX32[:16] not in err
    assert capsys.readouterr().out == ""  # no key printed before a refusal


def test_gen_tls_key_refuses_bad_secret_files(capsys, tmp_path, stdin):
    loose = secret_file(tmp_path, HEX32, 0o644)
    one_line_error(capsys, ["gen-tls-key", "-s", loose], "permissions 0644 are too open")
    assert run(capsys, ["gen-tls-key", "-s", loose, "--allow-insecure-secret-file"]) == [KEY01]
    junk = secret_file(tmp_path, "not hex at all")
    err = one_line_error(capsys, ["gen-tls-key", "-s", junk],
                         f"--secret file {junk} is not hexadecimal")
    assert "not hex at all" not in err
    stdin("")
    one_line_error(capsys, ["gen-tls-key", "-s", "-"], "no hexadecimal secret on stdin")


# --- check-tls-key -------------------------------------------------------------------------


def test_check_tls_key_says_the_key_is_valid(capsys):
    assert run(capsys, ["check-tls-key", "-d", KEY01]) == ["Key is valid (HMAC 1, length 32)"]
    assert run(capsys, ["check-tls-key", "--key", KEY02]) == ["Key is valid (HMAC 2, length 48)"]


@pytest.mark.parametrize("key, options, identity", [
    (KEY01, ["-I", "1"], ID01),
    (KEY01, ["--identity", "1", "--compat"], ID01_COMPAT),
    (KEY02, ["-I", "1"], ID02),
    (KEY01, [], f"NVMe0R01 {HOST} {SUBSYS}"),
    (KEY02, ["-I", "0"], f"NVMe0R02 {HOST} {SUBSYS}"),
])
def test_check_tls_key_prints_the_identity_for_a_subsystem(capsys, key, options, identity):
    lines = run(capsys, ["check-tls-key", "-d", key, "-n", HOST, "-c", SUBSYS, *options])
    assert lines[1:] == [identity]


def test_check_tls_keys_host_nqn_defaults_as_nvme_clis(capsys, monkeypatch):
    from nvmeof_fuse.host import hostid

    monkeypatch.setattr(hostid, "host_identity",
                        lambda: hostid.HostIdentity(HOST, hostid.uuid.UUID(int=1)))
    assert run(capsys, ["check-tls-key", "-d", KEY01, "-c", SUBSYS, "-I", "1"])[1] == ID01


def test_check_tls_key_reads_the_key_from_a_file_stdin_or_the_terminal(capsys, tmp_path, stdin,
                                                                       monkeypatch):
    valid = ["Key is valid (HMAC 1, length 32)"]
    assert run(capsys, ["check-tls-key", "-d", secret_file(tmp_path, KEY01)]) == valid
    stdin(KEY01 + "\n")
    assert run(capsys, ["check-tls-key"]) == valid
    stdin(KEY02)
    assert run(capsys, ["check-tls-key", "-d", "-"]) == ["Key is valid (HMAC 2, length 48)"]
    asked = []
    monkeypatch.setattr("getpass.getpass", lambda prompt: asked.append(prompt) or KEY01)
    stdin("", tty=True)
    assert run(capsys, ["check-tls-key"]) == valid
    assert asked == ["TLS key: "]  # typed without echo


@pytest.mark.parametrize("argv, message", [
    (["-d", KEY01.replace("Nf9LrZ", "Nf9LrA")], "--keydata fails its CRC-32 check"),
    (["-d", KEY01.replace(":01:", ":05:")], "--keydata names hash 05; 00 (none), 01 (SHA-256)"),
    (["-d", BODY01], "--keydata is neither a TLS key nor the path of a file holding it"),
    (["-k", KEY01], "-k/--keyring names a keyring (nvme-cli 2.4 and later); give the key with "
                    "-d/--keydata"),
    (["-d", KEY01, "-i", "-n", HOST], "--insert needs -c/--subsysnqn"),
    (["-d", KEY01, "-i", "-c", SUBSYS, "-k", ".nvme-nowhere"], "keyring .nvme-nowhere not found"),
    (["-d", KEY01, "-I", "7"], "--identity 7 is not one of 0 (NVMe/TCP 1.0c), 1"),
    (["-d", KEY01, "-n", "", "-c", SUBSYS],
     "cannot derive the PSK identity: the host NQN is empty or holds a NUL"),
    (["-d", KEY01, "-n", HOST, "-c", "nqn." + "s" * 230],
     "cannot derive the PSK identity: the subsystem NQN is 234 bytes; an NQN is at most 223"),
])
def test_check_tls_key_refusals(capsys, argv, message):
    err = one_line_error(capsys, ["check-tls-key", *argv], message)
    assert BODY01[:12] not in err


def test_check_tls_key_refuses_bad_input_from_files_and_stdin(capsys, tmp_path, stdin):
    loose = secret_file(tmp_path, KEY01, 0o640)
    one_line_error(capsys, ["check-tls-key", "-d", loose], "permissions 0640 are too open")
    bad = secret_file(tmp_path, KEY01.replace(":01:", ":02:"))
    err = one_line_error(capsys, ["check-tls-key", "-d", bad],
                         f"--keydata file {bad} holds a 32-byte key, but hash 02")
    assert BODY01[:12] not in err
    stdin("   \n")
    one_line_error(capsys, ["check-tls-key"], "no TLS key on stdin")
    stdin("x" * 5000)
    one_line_error(capsys, ["check-tls-key"], "stdin holds over 4096 characters")
    stdin(KEY01[:-1] + "\n")
    one_line_error(capsys, ["check-tls-key"], "the TLS key on stdin is not of the form")


# --- nvme-cli on this machine as the second opinion ---------------------------------------

NVME = shutil.which("nvme")
needs_nvme_cli = pytest.mark.skipif(NVME is None, reason="nvme-cli is not installed")
NVME_STEP = 30  # s for one nvme-cli run


def nvme(*args: str) -> subprocess.CompletedProcess:
    """nvme-cli with ``args``: only throwaway test keys ever go into its argv."""
    return subprocess.run([NVME, *args], capture_output=True, text=True, timeout=NVME_STEP,
                          check=False)


def nvme_cli_version() -> tuple[int, int]:
    found = re.search(r"nvme version (\d+)\.(\d+)", nvme("version").stdout)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def nvme_check(key: str) -> tuple[int, str]:
    """nvme-cli's check of ``key``: 2.3 takes -k/--key; 2.4 on take -d/--keydata and want a
    subsystem NQN."""
    if nvme_cli_version() <= (2, 3):
        done = nvme("check-tls-key", "--key", key)
    else:
        done = nvme("check-tls-key", "--keydata", key, "-n", HOST, "-c", SUBSYS)
    return done.returncode, done.stdout


def expected_check_line(key: str) -> str:
    """What ``check-tls-key`` prints of a valid key, in nvme-cli 2.3's form: ours and the
    CRC-32 it adds."""
    parsed = tls_psk.parse_interchange(key)
    return (f"Key is valid (HMAC {int(parsed.hash_id)}, length {len(parsed.key)}, "
            f"CRC {tls_psk.zlib.crc32(parsed.key):08x})")


@needs_nvme_cli
@pytest.mark.parametrize("hmac", ["1", "2"])
def test_nvme_cli_and_we_accept_each_others_keys(capsys, hmac):
    """nvme-cli's random key checks here, ours there, with the same line (2.3 adds the CRC)."""
    theirs = nvme("gen-tls-key", "--hmac", hmac)
    assert theirs.returncode == 0, theirs.stderr
    their_key = theirs.stdout.strip()
    our_line = run(capsys, ["check-tls-key", "-d", their_key])[0]
    ours = run(capsys, ["gen-tls-key", "--hmac", hmac])[0]
    for key in (their_key, ours):
        rc, out = nvme_check(key)
        assert rc == 0, out
        if nvme_cli_version() <= (2, 3):
            assert out == expected_check_line(key) + "\n"  # byte for byte
    assert our_line == expected_check_line(their_key).rsplit(", CRC", 1)[0] + ")"


@needs_nvme_cli
@pytest.mark.parametrize("key", [KEY01, KEY02])
def test_nvme_cli_checks_libnvmes_vectors_as_we_do(capsys, key):
    rc, out = nvme_check(key)
    assert rc == 0
    ours = run(capsys, ["check-tls-key", "-d", key, "-n", HOST, "-c", SUBSYS])
    if nvme_cli_version() <= (2, 3):
        assert out == expected_check_line(key) + "\n"
    else:  # 2.4 on print the identity (3.0 our first line too, and the keyring's answer)
        assert ours[1] in out.splitlines()


@needs_nvme_cli
@pytest.mark.parametrize("bad", [
    KEY01.replace("Nf9LrZ", "Nf9LrA"),            # CRC
    KEY01.replace(":01:", ":03:"),                # hash
    KEY01.replace(":01:", ":02:"),                # length against the hash
    KEY01.replace("NVMeTLSkey-1", "NVMeTLSkey-2"),  # version
    KEY01.replace("VRLb", "VR?b"),                # base64
    KEY02[:60] + ":",                             # truncated
])
def test_nvme_cli_refuses_what_we_refuse(capsys, bad):
    """Both refuse; nvme-cli 2.3 echoes the key in some of its messages, we never do."""
    assert nvme_check(bad)[0] != 0
    err = one_line_error(capsys, ["check-tls-key", "-d", bad], "--keydata ")
    assert bad.split(":")[2][:12] not in err


@needs_nvme_cli
def test_gen_tls_key_from_a_secret_matches_nvme_cli_where_it_works(capsys):
    """nvme-cli 2.3 reads only half of ``--secret`` (fixed in 2.4), so it refuses every
    full-length secret; a newer one must print what we print."""
    for hex_secret, hmac, ours in ((HEX32, "1", KEY01), (HEX48, "2", KEY02)):
        theirs = nvme("gen-tls-key", "--secret", hex_secret, "--hmac", hmac)
        if nvme_cli_version() <= (2, 3):
            assert theirs.returncode != 0 and "Invalid key length" in theirs.stderr
            continue
        assert theirs.stdout.splitlines()[0] == ours
        assert run(capsys, ["gen-tls-key", "--secret", hex_secret, "--hmac", hmac]) == [ours]
    if nvme_cli_version() <= (2, 3):
        pytest.skip(f"nvme-cli {'.'.join(map(str, nvme_cli_version()))}: --secret is broken "
                    "there; the vectors above are libnvme's")


def test_the_key_never_reaches_argv_env_or_logs_of_a_process_we_start(monkeypatch, capsys):
    """Neither command starts a process or logs; the key stays in this one."""
    monkeypatch.setattr(subprocess, "Popen", None)  # any start fails the test
    monkeypatch.setattr(os, "execv", None)
    assert entry.main(["check-tls-key", "-d", KEY01, "-n", HOST, "-c", SUBSYS, "-I", "1"]) == 0
    assert entry.main(["gen-tls-key", "-s", HEX32]) == 0
    assert all(BODY01 not in value for value in os.environ.values())


def test_insert_loads_the_derived_psk_under_its_identity_as_nvme_cli_does(capsys, own_keyring):
    """``--insert`` with ``-k SERIAL -t user`` (the ``psk`` type exists only with
    nvme-keyring.ko): the key nvme-cli would load, under the identity it would use."""
    from nvmeof_fuse.host import keyring

    name, serial = own_keyring
    out = run(capsys, ["check-tls-key", "-d", KEY01, "-n", HOST, "-c", SUBSYS, "-I", "1",
                       "-i", "-k", name, "-t", "user"])
    assert re.fullmatch(r"Key is valid \(HMAC 1, length 32\)", out[0])
    inserted = int(out[1].removeprefix("Inserted TLS key "), 16)
    assert keyring.search(serial, ID01, "user") == inserted
    derived = tls_psk.derive(tls_psk.parse_interchange(KEY01), HOST, SUBSYS, version=1)
    assert keyring.read(inserted) == derived.key
    out = run(capsys, ["gen-tls-key", "-s", HEX32, "-n", HOST, "-c", SUBSYS, "-i",
                       "-k", str(serial), "-t", "user"])
    assert out[0] == KEY01 and out[1].startswith("Inserted TLS key ")
    v0 = tls_psk.derive(tls_psk.parse_interchange(KEY01), HOST, SUBSYS)
    assert keyring.read(keyring.search(serial, v0.identity, "user")) == v0.key
