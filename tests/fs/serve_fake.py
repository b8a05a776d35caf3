"""Mount a fake controller: ``serve_fake.py MOUNTPOINT [--read-only] [--hold-reads]
[--fuse=SERVER]`` (builtin, the default, or pyfuse3).

Prints ``READY`` once mounted and, after unmount or SIGTERM/SIGINT, a JSON line
with the namespaces' flush counts. SIGUSR1 changes n2's first 4 KiB behind FUSE
(prints ``CHANGED``); SIGUSR2 then drops the kernel's cached pages of n2 (prints
``DROPPED``).  Used by the host-side mount tests.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fakes import make_controller  # noqa: E402

from nvmeof_fuse.fs.mount import MountOptions, serve  # noqa: E402


async def main(mountpoint: str, read_only: bool, hold_reads: bool, fuse: str) -> None:
    ctrl = make_controller((1, 512, 8192), (2, 4096, 64))
    ctrl.namespaces[2].device.data[:] = bytes(range(256)) * (4096 * 64 // 256)
    release = trio.Event()
    if hold_reads:  # n2 reads block until a signal arrives: tests draining on stop
        n2 = ctrl.namespaces[2]
        plain_read = n2.read_lent

        async def held_read(offset: int, length: int) -> bytes | memoryview:
            print("INFLIGHT", flush=True)
            await release.wait()
            return await plain_read(offset, length)

        n2.read_lent = held_read
    opts = MountOptions(read_only=read_only, mode=0o640, fuse=fuse)
    stops = (signal.SIGTERM, signal.SIGINT)
    with trio.open_signal_receiver(*stops, signal.SIGUSR1, signal.SIGUSR2) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for signum in signals:
                    if signum == signal.SIGUSR1:
                        ctrl.namespaces[2].device.data[:4096] = b"\xab" * 4096
                        print("CHANGED", flush=True)
                    elif signum == signal.SIGUSR2:
                        await fs.drop_cached(2)
                        print("DROPPED", flush=True)
                    else:
                        release.set()
                        nursery.cancel_scope.cancel()

            async def serve_then_stop(task_status=trio.TASK_STATUS_IGNORED) -> None:
                await serve(ctrl, mountpoint, opts, task_status=task_status)
                nursery.cancel_scope.cancel()  # unmounted from outside

            fs = await nursery.start(serve_then_stop)
            nursery.start_soon(on_signal)
            print("READY", flush=True)
    print(json.dumps({f"n{n}": ns.flushes for n, ns in ctrl.namespaces.items()}), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="serve_fake: %(levelname)s: %(message)s")
    fuse = next((a.partition("=")[2] for a in sys.argv[2:] if a.startswith("--fuse=")), "builtin")
    trio.run(main, sys.argv[1], "--read-only" in sys.argv[2:], "--hold-reads" in sys.argv[2:], fuse)
