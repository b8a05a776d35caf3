"""Host NQN and host ID: options, then /etc/nvme, then a stable generated pair."""

import uuid

import pytest

from nvmeof_fuse.errors import InvalidArgument
from nvmeof_fuse.host import hostid
from nvmeof_fuse.host.hostid import NQN_UUID_PREFIX, host_identity

ID_A = "0f4e2c3a-5b6d-4e7f-8a9b-0c1d2e3f4a5b"
ID_B = "11111111-2222-4333-8444-555555555555"
MACHINE = uuid.UUID("99999999-8888-4777-8666-555555555555")


@pytest.fixture
def etc(tmp_path, monkeypatch):
    monkeypatch.setattr(hostid, "_stable_uuid", lambda: MACHINE)
    return tmp_path


def test_options_win_over_files(etc):
    (etc / "hostnqn").write_text("nqn.2014-08.org.example:file\n")
    (etc / "hostid").write_text(ID_B + "\n")
    ident = host_identity("nqn.2014-08.org.example:option", ID_A, etc=etc)
    assert ident.hostnqn == "nqn.2014-08.org.example:option"
    assert ident.hostid == uuid.UUID(ID_A)


def test_files_are_read_and_stripped(etc):
    (etc / "hostnqn").write_text("  nqn.2014-08.org.example:file\n")
    (etc / "hostid").write_text(ID_B + "\n")
    ident = host_identity(etc=etc)
    assert ident.hostnqn == "nqn.2014-08.org.example:file"
    assert ident.hostid == uuid.UUID(ID_B)


def test_each_value_falls_back_on_its_own(etc):
    (etc / "hostid").write_text(ID_B)
    ident = host_identity("nqn.2014-08.org.example:option", etc=etc)
    assert ident.hostnqn == "nqn.2014-08.org.example:option"
    assert ident.hostid == uuid.UUID(ID_B)


def test_empty_files_are_ignored(etc):
    (etc / "hostnqn").write_text("\n")
    (etc / "hostid").write_text("")
    assert host_identity(etc=etc).hostid == MACHINE


def test_hostid_derived_from_uuid_hostnqn(etc):
    ident = host_identity(NQN_UUID_PREFIX + ID_A, etc=etc)
    assert ident.hostnqn == NQN_UUID_PREFIX + ID_A
    assert ident.hostid == uuid.UUID(ID_A)


def test_hostid_from_file_hostnqn(etc):
    (etc / "hostnqn").write_text(NQN_UUID_PREFIX + ID_B)
    assert host_identity(etc=etc).hostid == uuid.UUID(ID_B)


def test_malformed_uuid_hostnqn_falls_back(etc):
    ident = host_identity(NQN_UUID_PREFIX + "not-a-uuid", etc=etc)
    assert ident.hostnqn == NQN_UUID_PREFIX + "not-a-uuid"
    assert ident.hostid == MACHINE


def test_generated_pair_is_consistent(etc):
    ident = host_identity(etc=etc)
    assert ident.hostid == MACHINE
    assert ident.hostnqn == f"{NQN_UUID_PREFIX}{MACHINE}"


def test_hostnqn_generated_from_given_hostid(etc):
    ident = host_identity(hostid=ID_A, etc=etc)
    assert ident.hostnqn == NQN_UUID_PREFIX + ID_A


def test_bad_hostid_names_it(etc):
    with pytest.raises(InvalidArgument, match=r"--hostid: 'nope' is not a UUID"):
        host_identity(hostid="nope", etc=etc)


def test_bad_hostid_file_names_the_file(etc):
    (etc / "hostid").write_text("garbage\n")
    with pytest.raises(InvalidArgument, match=r"/hostid: 'garbage' is not a UUID"):
        host_identity(etc=etc)


def fake_sources(monkeypatch, files):
    monkeypatch.setattr(hostid, "_read", lambda path: files.get(str(path)))


def test_stable_uuid_prefers_dmi(monkeypatch):
    fake_sources(monkeypatch, {"/sys/class/dmi/id/product_uuid": ID_A, "/etc/machine-id": "x"})
    assert hostid._stable_uuid() == uuid.UUID(ID_A)


def test_stable_uuid_from_machine_id(monkeypatch):
    fake_sources(monkeypatch, {"/etc/machine-id": "0123456789abcdef0123456789abcdef"})
    assert hostid._stable_uuid() == uuid.UUID("0123456789abcdef0123456789abcdef")


def test_stable_uuid_hashes_a_non_uuid_source(monkeypatch):
    fake_sources(monkeypatch, {"/sys/class/dmi/id/product_uuid": "Not Settable"})
    assert hostid._stable_uuid() == uuid.uuid5(uuid.NAMESPACE_OID, "Not Settable")
