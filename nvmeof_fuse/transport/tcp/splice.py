"""Send user memory into a socket without copying it: ``vmsplice`` into a pipe, ``splice`` out.

``sendmsg`` copies every byte into socket buffers.  A pipe filled by ``vmsplice`` holds
references to the caller's pages instead, and ``splice`` hands those pages to the socket
(as the kernel's own NVMe/TCP host sends bio pages), so the one copy left is the
receiver's.  The memory must not change until the peer has the bytes: for an NVMe write
that holds, since the caller waits for the command's completion, which the controller
sends only after it received all the data (a later TCP retransmission of the same bytes
is discarded by the receiver).

Linux only; :func:`open_splicer` returns None where pipes, ``vmsplice`` or ``os.splice``
are missing, and the caller sends with ``sendmsg`` instead.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os

PIPE_BYTES = 1 << 20
"""Pipe capacity asked for (the default ``/proc/sys/fs/pipe-max-size``)."""
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
SPLICE_F_NONBLOCK = getattr(os, "SPLICE_F_NONBLOCK", 2)
SPLICE_F_MORE = getattr(os, "SPLICE_F_MORE", 4)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_vmsplice = None


def _libc_vmsplice():
    global _vmsplice
    if _vmsplice is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.vmsplice
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_size_t, ctypes.c_uint]
        fn.restype = ctypes.c_ssize_t
        _vmsplice = fn
    return _vmsplice


class Spliced:
    """Bytes to be sent by splicing (a writable buffer); ``view`` is what is still unsent."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __len__(self) -> int:
        return len(self.view)


class Splicer:
    """One pipe, moving the head of a :class:`Spliced` buffer into a socket."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self.capacity = fcntl.fcntl(self._write, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            self.capacity = 1 << 16
        self._vmsplice = _libc_vmsplice()
        self._piped = 0  # bytes at the head of the current buffer already in the pipe

    def send(self, fd: int, data: Spliced, more: bool = False) -> int:
        """Move bytes from the head of ``data`` into socket ``fd``; how many went.
        ``more``: more follows ``data`` at once (SPLICE_F_MORE, the socket's MSG_MORE).

        Raises BlockingIOError when the socket takes nothing now, OSError on failure.
        """
        if not self._piped:
            view = data.view[:self.capacity]
            base = (ctypes.c_char * len(view)).from_buffer(view)
            iov = _IoVec(ctypes.addressof(base), len(view))
            n = self._vmsplice(self._write, ctypes.byref(iov), 1, SPLICE_F_NONBLOCK)
            del base
            if n < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"vmsplice: {os.strerror(err)}")
            if n == 0:  # an empty pipe takes at least a page: never spin on it
                raise OSError(errno.EIO, "vmsplice moved nothing into an empty pipe")
            self._piped = n
        flags = SPLICE_F_NONBLOCK | (SPLICE_F_MORE if more else 0)
        sent = os.splice(self._read, fd, self._piped, flags=flags)
        self._piped -= sent
        data.view = data.view[sent:]
        return sent

    def close(self) -> None:
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._read = self._write = -1


def open_splicer() -> Splicer | None:
    """A :class:`Splicer`, or None where this system cannot splice user memory."""
    if not hasattr(os, "splice") or not hasattr(os, "pipe2"):
        return None
    try:
        _libc_vmsplice()
        return Splicer()
    except (OSError, AttributeError):
        return None
