"""The host's DH-HMAC-CHAP driver against a fake controller side (the real one: tests/testbed)."""

from __future__ import annotations

import hmac
import os

import pytest
import trio

from nvmeof_fuse.errors import CommandTimeout, InvalidArgument, TransportError
from nvmeof_fuse.host import auth as host_auth
from nvmeof_fuse.host.controller import ConnectOptions
from nvmeof_fuse.nvme import auth

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000cafe"
SUBNQN = "nqn.2026-11.io.nvmeof-fuse:auth"
HOST_SECRET = auth.format_secret(bytes(range(32)), 1)
CTRL_SECRET = auth.format_secret(bytes(range(100, 148)), 2)
OTHER_SECRET = auth.format_secret(bytes(range(1, 33)), 1)


class FakeController:
    """The controller's side of DH-HMAC-CHAP, as Linux nvmet runs it, over two queues of bytes."""

    def __init__(self, host_secret: str, ctrl_secret: str | None = None,
                 hash_id: int = auth.HashId.SHA256, group: int = auth.DhGroup.NULL) -> None:
        self.host_key = auth.transform_key(auth.parse_secret(host_secret), HOSTNQN)
        self.ctrl_key = (auth.transform_key(auth.parse_secret(ctrl_secret), SUBNQN)
                         if ctrl_secret else None)
        self.hash_id, self.group = hash_id, group
        self.sent: list[int] = []  # message IDs the host sent
        self.outbox: list[bytes] = []
        self.authenticated = False

    async def send(self, message: bytes, prompt: bool = False) -> None:  # Authentication Send
        kind, tid = message[1], int.from_bytes(message[4:6], "little")
        self.sent.append(kind)
        if kind == auth.MessageId.NEGOTIATE:
            assert message[8:12] == bytes([1, 0, 3, 6])
            self.tid, self.s1 = tid, 4242
            self.c1 = bytes(range(auth.hash_length(self.hash_id)))
            dh = b""
            if self.group:
                self.x = auth.dh_private_key(self.group)
                dh = auth.dh_public_value(self.group, self.x)
            hl = len(self.c1)
            self.outbox.append(bytes([1, 1, 0, 0, *tid.to_bytes(2, "little"), hl, 0,
                                      self.hash_id, self.group, *len(dh).to_bytes(2, "little"),
                                      *self.s1.to_bytes(4, "little")]) + self.c1 + dh)
        elif kind == auth.MessageId.REPLY:
            hl, cvalid = message[6], message[8]
            s2 = int.from_bytes(message[12:16], "little")
            r1, c2, dh = message[16:16 + hl], message[16 + hl:16 + 2 * hl], message[16 + 2 * hl:]
            c1 = self.c1
            if self.group:
                skey = auth.dh_session_key(self.group, self.x, dh)
                c1 = auth.augmented_challenge(self.hash_id, skey, c1)
                c2 = auth.augmented_challenge(self.hash_id, skey, c2)
            expected = auth.host_response(self.hash_id, self.host_key, c1, self.s1, tid,
                                          HOSTNQN, SUBNQN)
            if not hmac.compare_digest(expected, r1):
                self.outbox.append(auth.failure1(tid, auth.FailureReason.FAILED))
                return
            rval = b""
            if cvalid and self.ctrl_key:
                rval = auth.controller_response(self.hash_id, self.ctrl_key, c2, s2, tid,
                                                HOSTNQN, SUBNQN)
            self.outbox.append(bytes([1, 3, 0, 0, *tid.to_bytes(2, "little"), hl, 0,
                                      int(bool(rval))]) + bytes(7) + rval)
            self.authenticated = not cvalid
        elif kind == auth.MessageId.SUCCESS2:
            self.authenticated = True

    async def receive(self, prompt: bool = False) -> bytes:  # Authentication Receive
        return self.outbox.pop(0) + bytes(64)


def run(dhchap, target, qid=0):
    async def main():
        await host_auth.authenticate_queue(dhchap, qid, "rdma 192.0.2.1:4420 (sub)",
                                           target.send, target.receive)
    trio.run(main)


def dhchap(secret=HOST_SECRET, ctrl_secret=None):
    return host_auth.host_dhchap(*host_auth.secret_sources(secret, ctrl_secret), HOSTNQN, SUBNQN)


def load(value, option="--dhchap-secret", allow_insecure=False):
    return host_auth.SecretSource.of(value, option).load(allow_insecure)


@pytest.mark.parametrize("hash_id, group", [
    (auth.HashId.SHA256, auth.DhGroup.NULL),
    (auth.HashId.SHA384, auth.DhGroup.FFDHE2048),
    (auth.HashId.SHA512, auth.DhGroup.FFDHE3072),
])
def test_host_authenticates(hash_id, group):
    target = FakeController(HOST_SECRET, hash_id=hash_id, group=group)
    run(dhchap(), target)
    assert target.authenticated and target.sent == [auth.MessageId.NEGOTIATE,
                                                    auth.MessageId.REPLY]


def test_bidirectional_checks_the_controller_and_sends_success2():
    target = FakeController(HOST_SECRET, CTRL_SECRET, group=auth.DhGroup.FFDHE2048)
    run(dhchap(ctrl_secret=CTRL_SECRET), target)
    assert target.authenticated and target.sent[-1] == auth.MessageId.SUCCESS2


def test_wrong_controller_secret_fails_and_tells_the_controller():
    target = FakeController(HOST_SECRET, CTRL_SECRET)
    with pytest.raises(host_auth.AuthenticationError) as info:
        run(dhchap(ctrl_secret=OTHER_SECRET), target, qid=3)
    assert str(info.value) == (
        "rdma 192.0.2.1:4420 (sub): authentication of queue 3 failed: Authentication failed "
        "(0x01): the controller's response does not match --dhchap-ctrl-secret (inline)")
    assert target.sent[-1] == auth.MessageId.FAILURE2 and not target.authenticated


def test_wrong_secret_names_the_targets_failure_reason():
    target = FakeController(OTHER_SECRET)
    with pytest.raises(host_auth.AuthenticationError,
                       match=r"queue 0 failed: Authentication failed \(0x01\): the controller "
                             r"refused \(AUTH_Failure1 for SUCCESS1\) \(is --dhchap-secret "
                             r"\(inline\) the host key") as e:
        run(dhchap(), target)
    assert HOST_SECRET not in str(e.value) and target.sent[-1] == auth.MessageId.REPLY
    assert e.value.final  # a reconnect would be refused the same way: it stops


def test_missing_secret_is_one_line():
    with pytest.raises(host_auth.AuthenticationError,
                       match="requires in-band authentication .* --dhchap-secret") as e:
        run(None, FakeController(HOST_SECRET))
    assert e.value.final


def key_file(tmp_path, text=HOST_SECRET, mode=0o600, name="key"):
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def test_secrets_from_files(tmp_path):
    path = key_file(tmp_path)
    assert load(str(path)) == auth.parse_secret(HOST_SECRET)
    target = FakeController(HOST_SECRET)
    run(dhchap(str(path)), target)
    assert target.authenticated


def test_failures_name_the_secrets_file(tmp_path):
    """A rejected reply names where the secret came from: here its file."""
    path = key_file(tmp_path, OTHER_SECRET)
    with pytest.raises(host_auth.AuthenticationError) as e:
        run(dhchap(str(path)), FakeController(HOST_SECRET))
    assert f"(is --dhchap-secret file {path} the host key" in str(e.value)
    assert OTHER_SECRET[10:-6] not in str(e.value)


@pytest.mark.parametrize("value, message", [
    ("/nonexistent/key", "--dhchap-secret file /nonexistent/key: No such file or directory"),
    ("not-a-secret", "--dhchap-secret is neither a DHHC-1:0N:<base64>: secret nor the path"),
    (HOST_SECRET[:-5] + "AAAA:", "--dhchap-secret (inline) fails its CRC-32 check"),
    ("DHHC-l:01:a/b" + HOST_SECRET[10:], "--dhchap-secret (inline) is not a DH-HMAC-CHAP secret"),
])
def test_bad_secrets_are_one_line_without_the_secret(value, message):
    with pytest.raises(InvalidArgument) as info:
        load(value)
    assert str(info.value).startswith(message) and HOST_SECRET[10:-6] not in str(info.value)


def test_bad_secret_file_names_the_file(tmp_path):
    path = key_file(tmp_path, "DHHC-1:00:garbage:")
    with pytest.raises(InvalidArgument, match=f"--dhchap-ctrl-secret file {path} is not valid"):
        load(str(path), "--dhchap-ctrl-secret")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_secret_file_others_may_access_is_refused_by_its_mode(tmp_path, mode):
    path = key_file(tmp_path, mode=mode).resolve()
    with pytest.raises(InvalidArgument) as info:
        load(str(path))
    assert str(info.value) == (
        f"--dhchap-secret file {path}: permissions {mode:04o} are too open (group or others "
        f"may read the secret): chmod 600 {path}, or give --allow-insecure-secret-file")
    assert load(str(path), allow_insecure=True) == auth.parse_secret(HOST_SECRET)
    path.chmod(0o400)
    assert load(str(path)) == auth.parse_secret(HOST_SECRET)


def test_a_symlinked_secret_file_is_checked_at_its_target(tmp_path):
    target = key_file(tmp_path, mode=0o644, name="real")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(InvalidArgument) as info:
        load(str(link))
    assert str(info.value).startswith(f"--dhchap-secret file {link} (-> {target.resolve()}): "
                                      "permissions 0644 are too open")
    target.chmod(0o600)  # the link itself is 0777, as every symlink
    assert load(str(link)) == auth.parse_secret(HOST_SECRET)


def test_a_secret_path_that_is_no_regular_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(InvalidArgument, match=f"^--dhchap-secret file {fifo} is not a regular"):
        load(str(fifo))


def test_connect_options_check_and_hide_secrets(tmp_path):
    opts = ConnectOptions(traddr="192.0.2.1", nqn=SUBNQN, dhchap_secret=HOST_SECRET,
                          dhchap_ctrl_secret=CTRL_SECRET)
    opts.validate()
    assert HOST_SECRET not in repr(opts) and CTRL_SECRET not in repr(opts)
    with pytest.raises(InvalidArgument, match="--dhchap-ctrl-secret needs --dhchap-secret"):
        ConnectOptions(traddr="192.0.2.1", nqn=SUBNQN, dhchap_ctrl_secret=CTRL_SECRET).validate()
    path = key_file(tmp_path, mode=0o644)
    opts = ConnectOptions(traddr="192.0.2.1", nqn=SUBNQN, dhchap_secret=str(path))
    with pytest.raises(InvalidArgument, match="permissions 0644 are too open"):
        opts.validate()
    opts.allow_insecure_secret_file = True
    opts.validate()


def test_sources_name_inline_secrets_and_files_never_the_secret(tmp_path):
    host, ctrl = host_auth.secret_sources(HOST_SECRET, "key")
    assert (str(host), host.shown) == ("--dhchap-secret (inline)", "inline")
    assert (str(ctrl), ctrl.shown) == ("--dhchap-ctrl-secret file key", os.path.abspath("key"))
    assert HOST_SECRET not in repr(host)


def test_mode_for_the_info_files():
    assert host_auth.dhchap_mode(None) == "off"
    assert host_auth.dhchap_mode(dhchap()) == "host"
    assert host_auth.dhchap_mode(dhchap(ctrl_secret=CTRL_SECRET)) == "bidirectional"


class QueueTarget:
    """A queue whose Authentication Send/Receive reach a FakeController (or fail with status)."""

    qid = 1

    def __init__(self, target: FakeController, status: int = 0) -> None:
        self.target, self.status, self.commands, self.timeouts = target, status, [], []

    async def execute(self, sqe, data=None, *, to_controller=False, timeout):
        from nvmeof_fuse.nvme import Completion

        self.timeouts.append(timeout)
        self.commands.append((sqe[4], int.from_bytes(sqe[44:48], "little"), data.length,
                              to_controller))
        if not self.status:
            if sqe[4] == 0x05:
                await self.target.send(bytes(data.region.view[:data.length]))
            else:
                reply = await self.target.receive()
                data.region.view[:len(reply)] = reply
        return Completion(0, 0, 1, 0, self.status, True)


class ScratchController:
    """What queue_messages needs of a Controller: options.timeout and scratch()."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.options = SimpleNamespace(timeout=30.0, keep_alive_tmo=5.0)
        self.region = SimpleNamespace(view=memoryview(bytearray(8192)))

    def scratch(self, length):
        import contextlib

        from nvmeof_fuse.host.memory import DataRef

        @contextlib.asynccontextmanager
        async def ref():
            self.region.view[:length] = bytes(length)
            yield DataRef(self.region, 0, length)
        return ref()


def test_messages_travel_in_auth_send_and_receive_commands():
    target, ctrl = FakeController(HOST_SECRET), ScratchController()
    queue = QueueTarget(target)
    trio.run(host_auth.authenticate_queue, dhchap(), 1, "sub",
             *host_auth.queue_messages(ctrl, queue))
    assert target.authenticated
    # (FCTYPE, TL/AL, data length, host to controller) of Send Negotiate, Receive, Send Reply,
    # Receive: the transfer length always matches the data, as nvmet checks
    assert queue.commands == [(0x05, 72, 72, True), (0x06, 4096, 4096, False),
                              (0x05, 80, 80, True), (0x06, 4096, 4096, False)]
    # the answer to the Reply is due at once: it waits only the keep-alive timeout
    assert queue.timeouts == [30.0, 30.0, 30.0, 5.0]


def test_a_failed_auth_command_is_one_line():
    queue = QueueTarget(FakeController(HOST_SECRET), status=0x0002)  # Invalid Field in Command
    with pytest.raises(host_auth.AuthenticationError,
                       match="sub: authentication of queue 1 failed: .*Authentication Send"):
        trio.run(host_auth.authenticate_queue, dhchap(), 1, "sub",
                 *host_auth.queue_messages(ScratchController(), queue))


class DroppingQueue(QueueTarget):
    """The Receive after the Reply fails as ``error`` does (nvmet hung up, or went silent)."""

    def __init__(self, target: FakeController, error: Exception) -> None:
        super().__init__(target)
        self.error = error

    async def execute(self, sqe, data=None, *, to_controller=False, timeout):
        if len(self.commands) == 3:
            raise self.error
        return await super().execute(sqe, data, to_controller=to_controller, timeout=timeout)


def test_a_target_that_hangs_up_after_the_reply_is_named():
    closed = TransportError("admin queue: the target at 192.0.2.1:4420 closed the connection")
    queue = DroppingQueue(FakeController(OTHER_SECRET), closed)
    with pytest.raises(host_auth.AuthenticationError) as info:
        trio.run(host_auth.authenticate_queue, dhchap(), 0, "sub",
                 *host_auth.queue_messages(ScratchController(), queue))
    assert str(info.value) == (
        "sub: authentication of queue 0 failed: the target closed the connection after the "
        "host's DH-HMAC-CHAP_Reply, so it likely rejected the secret (is --dhchap-secret "
        "(inline) the host key the target has for this host NQN?)")
    assert not info.value.final  # a lost connection may be a blip: reconnecting goes on


def test_no_answer_after_the_reply_suggests_the_secret():
    silent = CommandTimeout("admin queue: command 30 got no completion within 5 s")
    queue = DroppingQueue(FakeController(OTHER_SECRET), silent)
    with pytest.raises(host_auth.AuthenticationError) as info:
        trio.run(host_auth.authenticate_queue, dhchap(), 0, "sub",
                 *host_auth.queue_messages(ScratchController(), queue))
    assert str(info.value) == (
        "sub: authentication of queue 0 failed: no answer to the host's DH-HMAC-CHAP_Reply "
        "(admin queue: command 30 got no completion within 5 s): the target likely closed the "
        "connection as it rejected the secret (is --dhchap-secret (inline) right?)")
    assert not info.value.final  # silence may pass: reconnecting goes on
