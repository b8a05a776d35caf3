"""SyncController: a blocking handle on a fake controller served by a background trio thread."""

import threading
import time
from contextlib import asynccontextmanager

import pytest
import trio
from fakes import make_controller

from nvmeof_fuse.errors import ConnectError, InvalidArgument, TransportError
from nvmeof_fuse.host import controller as controller_module
from nvmeof_fuse.host.controller import ConnectOptions
from nvmeof_fuse.host.sync import SyncController, SyncNamespace

WAIT = 10.0  # bound on every wait for the background thread (never asserted on)


def options(**changes) -> ConnectOptions:
    return ConnectOptions("192.0.2.1", "nqn.2014-08.org.example:sync", **changes)


class Fake:
    """A fake ``connect`` and the controller it yields, recording what happens."""

    def __init__(self, *, fail: BaseException | None = None, hang: bool = False) -> None:
        self.controller = make_controller((1, 512, 64), (2, 4096, 16))
        self.controller.register = self._on_loop("register", lambda obj: ("region", obj))
        self.controller.unregister = self._on_loop("unregister", lambda region: None)
        self.controller.allocate = self._on_loop("allocate", lambda n: ("allocated", n))
        self.fail = fail
        self.hang = hang
        self.events: list[str] = []
        self.threads: dict[str, int] = {}
        self.connecting = threading.Event()
        self.crash = None

    def _on_loop(self, name, fn):
        def method(*args):
            trio.lowlevel.current_trio_token()  # raises outside the loop thread
            self.threads[name] = threading.get_ident()
            return fn(*args)
        return method

    @asynccontextmanager
    async def __call__(self, opts: ConnectOptions):
        self.events.append("connect")
        self.connecting.set()
        try:
            if self.hang:
                await trio.sleep_forever()
            if self.fail is not None:
                raise self.fail
            self.crash = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watchdog)
                yield self.controller
                nursery.cancel_scope.cancel()
        except trio.Cancelled:
            self.events.append("cancelled")
            raise
        finally:
            self.events.append("exit")

    async def _watchdog(self):
        await self.crash.wait()
        raise TransportError("I/O queue 1: work request failed")


def test_read_write_round_trip():
    fake = Fake()
    with SyncController(options(), connect=fake) as ctrl:
        assert sorted(ctrl.namespaces) == [1, 2]
        ns = ctrl.namespaces[1]
        assert isinstance(ns, SyncNamespace)
        assert (ns.nsid, ns.lba_size, ns.nlb, ns.size) == (1, 512, 64, 512 * 64)
        assert ns.write(100, b"hello") == 5
        assert ns.read(98, 9) == b"\0\0hello\0\0"
        ns.flush()
        assert fake.controller.namespaces[1].flushes == 1
        assert ctrl.describe()["subnqn"] == "nqn.2014-08.org.example:fake"
        assert "exit" not in fake.events
    assert fake.events == ["connect", "exit"]


def test_namespace_errors_propagate_and_the_controller_stays_usable():
    with SyncController(options(), connect=Fake()) as ctrl:
        ns = ctrl.namespaces[2]
        with pytest.raises(InvalidArgument, match="bad read: offset -1"):
            ns.read(-1, 10)
        assert ns.read(0, 3) == bytes(3)


def test_zero_copy_methods_forward(monkeypatch):
    fake = Fake()
    calls = []

    async def read_into(slba, nlb, ref):
        calls.append(("read_into", slba, nlb, ref))

    async def write_from(slba, nlb, ref):
        calls.append(("write_from", slba, nlb, ref))

    ns = fake.controller.namespaces[1]
    ns.read_into, ns.write_from = read_into, write_from
    with SyncController(options(), connect=fake) as ctrl:
        ctrl.namespaces[1].read_into(3, 2, "ref-a")
        ctrl.namespaces[1].write_from(5, 1, "ref-b")
    assert calls == [("read_into", 3, 2, "ref-a"), ("write_from", 5, 1, "ref-b")]


def test_memory_calls_run_on_the_loop_thread():
    fake = Fake()
    with SyncController(options(), connect=fake) as ctrl:
        buf = bytearray(16)
        assert ctrl.register(buf) == ("region", buf)
        assert ctrl.allocate(4096) == ("allocated", 4096)
        assert ctrl.unregister("r") is None
    assert set(fake.threads) == {"register", "allocate", "unregister"}
    assert threading.get_ident() not in fake.threads.values()


def test_call_runs_any_async_function_in_trio():
    async def where(x):
        await trio.sleep(0)
        return x, trio.lowlevel.current_trio_token() is not None

    with SyncController(options(), connect=Fake()) as ctrl:
        assert ctrl.call(where, 7) == (7, True)


def test_calls_from_many_threads():
    with SyncController(options(), connect=Fake()) as ctrl:
        ns = ctrl.namespaces[1]
        errors = []

        def worker(i):
            try:
                ns.write(i * 512, bytes([i]) * 512)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert not errors
        assert ns.read(0, 8 * 512) == b"".join(bytes([i]) * 512 for i in range(8))


def test_connect_error_is_the_same_exception():
    error = ConnectError("connect to rdma 192.0.2.1:4420 failed: refused")
    fake = Fake(fail=error)
    with pytest.raises(ConnectError) as info:
        with SyncController(options(), connect=fake):
            pytest.fail("entered a controller that did not connect")
    assert info.value is error


def test_connect_error_inside_a_nursery_is_unwrapped():
    error = InvalidArgument("--hostid 'x' is not a UUID")

    @asynccontextmanager
    async def connect(opts):
        async with trio.open_nursery():
            raise error
        yield  # pragma: no cover

    with pytest.raises(InvalidArgument) as info:
        SyncController(options(), connect=connect).__enter__()
    assert info.value is error


def test_after_a_failed_connect_calls_say_closed():
    ctrl = SyncController(options(), connect=Fake(fail=ConnectError("refused")))
    with pytest.raises(ConnectError, match="refused"):
        ctrl.describe()
    with pytest.raises(ConnectError, match=r"stopped: refused"):
        ctrl.describe()
    ctrl.close()  # the error was already reported


def test_close_is_idempotent_and_later_calls_fail_clearly():
    fake = Fake()
    ctrl = SyncController(options(), connect=fake)
    with ctrl:
        ns = ctrl.namespaces[1]
    ctrl.close()
    ctrl.close()
    assert fake.events == ["connect", "exit"]
    message = r"controller rdma 192\.0\.2\.1:4420 \(nqn\.2014-08\.org\.example:sync\) is closed"
    for attempt in (ctrl.describe, lambda: ns.read(0, 1), lambda: ctrl.namespaces,
                    lambda: ctrl.allocate(1), lambda: ctrl.call(trio.sleep, 0)):
        with pytest.raises(ConnectError, match=message):
            attempt()
    with pytest.raises(ConnectError, match="is closed"):
        ctrl.__enter__()


def test_close_without_with_block():
    fake = Fake()
    ctrl = SyncController(options(), connect=fake)
    assert ctrl.namespaces[2].size == 4096 * 16
    ctrl.close()
    assert fake.events == ["connect", "exit"]


def test_close_while_connecting_abandons_the_connect():
    fake = Fake(hang=True)
    ctrl = SyncController(options(), connect=fake)
    assert fake.connecting.wait(WAIT)
    ctrl.close()
    assert fake.events == ["connect", "cancelled", "exit"]
    with pytest.raises(ConnectError, match="is closed"):
        ctrl.describe()


def test_connect_that_never_finishes_times_out():
    fake = Fake(hang=True)
    ctrl = SyncController(options(connect_timeout=0.01, timeout=0.01), connect=fake)
    deadline = time.monotonic() + WAIT
    while "connect" not in fake.events and time.monotonic() < deadline:
        time.sleep(0.001)  # a loaded machine may start the loop thread late
    with pytest.raises(ConnectError, match=r"not connected within 0\.02 s"):
        ctrl.__enter__()
    assert fake.events[-2:] == ["cancelled", "exit"]


def test_controller_failure_after_connect():
    fake = Fake()
    ctrl = SyncController(options(), connect=fake)
    ctrl.__enter__()
    ctrl.call(_set, fake.crash)
    ctrl._thread.join(WAIT)
    assert not ctrl._thread.is_alive()
    with pytest.raises(ConnectError, match="stopped: I/O queue 1: work request failed"):
        ctrl.namespaces[1].read(0, 1)
    with pytest.raises(TransportError, match="work request failed"):
        ctrl.close()
    ctrl.close()


def test_a_call_just_after_the_loop_ends_names_its_error(monkeypatch):
    """The loop has finished but its thread has not yet recorded why: the call waits for it."""
    from nvmeof_fuse.host import sync as sync_module

    recorded = sync_module._unwrap

    def slow_unwrap(exc):
        time.sleep(0.3)  # widens the window the call must not fall into
        return recorded(exc)

    monkeypatch.setattr(sync_module, "_unwrap", slow_unwrap)
    fake = Fake()
    ctrl = SyncController(options(), connect=fake)
    ctrl.__enter__()
    ctrl.call(_set, fake.crash)
    with pytest.raises(ConnectError, match="stopped: I/O queue 1: work request failed"):
        for _ in range(int(WAIT / 0.01)):  # until the loop has ended
            ctrl.describe()
            time.sleep(0.01)
    with pytest.raises(TransportError):
        ctrl.close()


async def _set(event: trio.Event) -> None:
    event.set()


def test_close_lets_running_calls_finish_first():
    fake = Fake()
    started, release = threading.Event(), threading.Event()

    async def slow():
        started.set()
        while not release.is_set():
            await trio.sleep(0.001)
        fake.events.append("call done")
        return "result"

    result = []
    with SyncController(options(), connect=fake) as ctrl:
        caller = threading.Thread(target=lambda: result.append(ctrl.call(slow)))
        caller.start()
        assert started.wait(WAIT)
        closer = threading.Thread(target=ctrl.close)
        closer.start()
        for _ in range(int(WAIT / 0.001)):  # until the loop waits for running calls
            if ctrl._idle is not None:
                break
            threading.Event().wait(0.001)
        release.set()
        caller.join(WAIT)
        closer.join(WAIT)
    assert result == ["result"]
    assert fake.events == ["connect", "call done", "exit"]


def test_default_connect_is_looked_up_at_run_time(monkeypatch):
    fake = Fake()
    monkeypatch.setattr(controller_module, "connect", fake)
    with SyncController(options()) as ctrl:
        assert sorted(ctrl.namespaces) == [1, 2]
    assert fake.events == ["connect", "exit"]


def test_real_connect_errors_reach_the_caller():
    with pytest.raises(InvalidArgument, match="--queue-size 1 must be 2-65536"):
        with SyncController(options(queue_size=1)):
            pytest.fail("entered a controller with bad options")


# -- submit: futures the loop completes ------------------------------------------------------------

async def _echo(value):
    return value


async def _wait_then(event: threading.Event, value):
    while not event.is_set():
        await trio.sleep(0.001)
    return value


def test_submit_returns_a_future_the_loop_completes():
    with SyncController(options(), connect=Fake()) as ctrl:
        futures = [ctrl.submit(_echo, i) for i in range(20)]
        assert [f.result(WAIT) for f in futures] == list(range(20))
        assert all(f.done() for f in futures)


def test_a_call_submitted_while_another_runs_starts_when_the_caller_waits():
    """It is not woken for at submit time; waiting on its future wakes the loop for it."""
    release = threading.Event()
    with SyncController(options(), connect=Fake()) as ctrl:
        first = ctrl.submit(_wait_then, release, "first")
        second = ctrl.submit(_echo, "second")
        assert second.result(WAIT) == "second"  # while the first still runs
        assert not first.done()
        release.set()
        assert first.result(WAIT) == "first"


def test_a_call_submitted_while_another_runs_starts_when_that_one_ends():
    release = threading.Event()
    with SyncController(options(), connect=Fake()) as ctrl:
        first = ctrl.submit(_wait_then, release, "first")
        second = ctrl.submit(_echo, "second")
        release.set()
        assert first.result(WAIT) == "first"
        for _ in range(int(WAIT / 0.001)):  # started by the first one's end, not by a wait
            if second._done:
                break
            time.sleep(0.001)
        assert second.result(0) == "second"


def test_a_future_not_done_in_time_says_so_and_errors_reach_the_caller():
    import concurrent.futures

    release = threading.Event()
    with SyncController(options(), connect=Fake()) as ctrl:
        slow = ctrl.submit(_wait_then, release, "late")
        with pytest.raises(concurrent.futures.TimeoutError):
            slow.result(0.01)
        release.set()
        assert slow.result(WAIT) == "late"

        async def fail():
            raise InvalidArgument("LBA range 9..9 is outside namespace 1")

        with pytest.raises(InvalidArgument, match="outside namespace 1"):
            ctrl.submit(fail).result(WAIT)


def test_submit_after_close_fails_clearly():
    ctrl = SyncController(options(), connect=Fake())
    ctrl.__enter__()
    ctrl.close()
    with pytest.raises(ConnectError, match="is closed"):
        ctrl.submit(_echo, 1)


def test_calls_waiting_to_start_when_the_loop_crashes_end_and_never_hang():
    """Each ends: run as the loop unwinds, or failed with the loop's error."""
    fake = Fake()
    release = threading.Event()
    ctrl = SyncController(options(), connect=fake)
    ctrl.__enter__()
    first = ctrl.submit(_wait_then, release, "first")
    waiting = [ctrl.submit(_echo, i) for i in range(3)]
    ctrl.call(_set, fake.crash)
    with pytest.raises(ConnectError):
        first.result(WAIT)
    for i, future in enumerate(waiting):
        try:
            assert future.result(WAIT) == i
        except ConnectError as exc:
            assert "stopped" in str(exc) or "closed" in str(exc)
    with pytest.raises(TransportError):
        ctrl.close()
    with pytest.raises(ConnectError, match="stopped: I/O queue 1"):
        ctrl.submit(_echo, "late")


def test_many_calls_some_blocked_all_end_and_close_is_clean():
    """Workers are reused: a blocked call holds one, the others go on; parked ones end at close."""
    release = threading.Event()
    fake = Fake()
    with SyncController(options(), connect=fake) as ctrl:
        blocked = [ctrl.submit(_wait_then, release, f"b{i}") for i in range(3)]
        for round_ in range(5):
            futures = [ctrl.submit(_echo, (round_, i)) for i in range(40)]
            assert [f.result(WAIT) for f in futures] == [(round_, i) for i in range(40)]
        assert not any(f.done() for f in blocked)
        release.set()
        assert [f.result(WAIT) for f in blocked] == ["b0", "b1", "b2"]
    assert fake.events[-1] == "exit"
