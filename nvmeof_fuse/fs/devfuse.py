"""/dev/fuse and fusermount3: a new mount's descriptor, and more descriptors on its connection.

:func:`mount_fd` mounts as libfuse does, through the setuid fusermount3 (so that users can
mount too); :func:`clone_fd` gives another descriptor on a mount's connection, which a FUSE
worker process reads (``FUSE_DEV_IOC_CLONE``).  The session that reads them is
:mod:`.session`.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import subprocess

FUSERMOUNT = "fusermount3"
FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t): <linux/fuse.h>
DEV_FUSE = "/dev/fuse"


def clone_fd(session_fd: int) -> int:
    """Another /dev/fuse descriptor on ``session_fd``'s connection (FUSE_DEV_IOC_CLONE): the
    kernel hands each request to whichever descriptor reads it, and a request read from a
    descriptor must be answered on that one.  Raises OSError (an old kernel: ENOTTY)."""
    fd = os.open(DEV_FUSE, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("I", session_fd))
    except BaseException:
        os.close(fd)
        raise
    return fd



class FuseMountError(Exception):
    """fusermount3 could not mount (its message), or sent no /dev/fuse descriptor."""



def mount_fd(path: str, options: list[str]) -> int:
    """Mount a FUSE file system at ``path`` with fusermount3 and return the /dev/fuse fd.

    fusermount3 (setuid root, so this works for users too) opens /dev/fuse, mounts it and
    passes the descriptor back over the socket named by ``_FUSE_COMMFD``, as libfuse does.
    Blocking: call it in a thread.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        try:
            result = subprocess.run([FUSERMOUNT, "-o", ",".join(options), "--", path], env=env,
                                    pass_fds=(theirs.fileno(),), capture_output=True, text=True,
                                    timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FuseMountError(f"cannot run {FUSERMOUNT}: {exc}") from None
        theirs.close()
        if result.returncode != 0:
            msg = result.stderr.strip().removeprefix(f"{FUSERMOUNT}: ")
            raise FuseMountError(msg or f"{FUSERMOUNT} failed with status {result.returncode}")
        ours.setblocking(False)
        try:
            _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        except BlockingIOError:
            fds = []
        if not fds:
            raise FuseMountError(f"{FUSERMOUNT} mounted but passed no /dev/fuse descriptor")
        for extra in fds[1:]:
            os.close(extra)
        return fds[0]


