"""What the CLI tests (tests/cli/) share: options without the transport check, argv, one-line
error checks, a foreground mount with a fake controller."""

from nvmeof_fuse.cli import entry
from nvmeof_fuse.host.controller import ConnectOptions

STEP = 20  # s: bound on any wait


class FakeConnectOptions(ConnectOptions):
    """The real options without their transport check, so CLI parsing of any -t is testable."""

    def validate(self) -> None:
        pass


MOUNT = ["mount", "-t", "rdma", "-a", "192.0.2.1", "-n", "nqn.2014-08.org.example:s1"]


def one_line_error(capsys, argv, match):
    assert entry.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("nvmeof-fuse: error: ") and match in err, err
    return err


SECRET = "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"


def fake_multipath(connect, state=None):
    """A fake ``nvmeof_fuse.host.multipath.head`` (the daemon connects through it): the first
    path through the fake ``connect``; the policy and further paths go to ``state``."""
    import types

    mod = types.ModuleType("nvmeof_fuse.host.multipath.head")

    def path_options(base, uri):
        return uri

    def multipath_connect(paths, policy="queue-depth"):
        if state is not None:
            state.paths, state.iopolicy = list(paths[1:]), policy
        return connect(paths[0])

    mod.path_options, mod.connect = path_options, multipath_connect
    return mod


# --- the whole mount command through the kernel -------------------------------------------

FOREGROUND = """
import sys, types
sys.path.insert(0, {tests!r})
import cli_fakes, fakes
from nvmeof_fuse.cli import entry
mod = types.ModuleType("nvmeof_fuse.host.controller")
mod.ConnectOptions = cli_fakes.FakeConnectOptions
import contextlib, math, trio
@contextlib.asynccontextmanager
async def connect(opts):
    # Like the real controller: completions are reaped by a task in connect's own
    # nursery, so a flush only completes while that task still runs.
    ctrl = fakes.make_controller((1, 512, 64), (2, 4096, 8))
    send, recv = trio.open_memory_channel(math.inf)

    async def reaper():
        async for done in recv:
            done.set()

    def reaped_flush(ns):
        async def flush():
            done = trio.Event()
            send.send_nowait(done)
            with trio.move_on_after(2):
                await done.wait()
            ns.flushes += done.is_set()
        return flush

    for ns in ctrl.namespaces.values():
        ns.flush = reaped_flush(ns)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reaper)
        try:
            yield ctrl
        finally:
            print("flushes", {{n: ns.flushes for n, ns in ctrl.namespaces.items()}}, flush=True)
            nursery.cancel_scope.cancel()
mod.connect = connect
sys.modules[mod.__name__] = mod
sys.modules["nvmeof_fuse.host.multipath.head"] = cli_fakes.fake_multipath(connect)
sys.exit(entry.main(sys.argv[1:]))
"""

