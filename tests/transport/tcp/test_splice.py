"""Splicing user memory into a socket (transport/splice.py), on a socket pair."""

import ctypes
import errno
import os
import socket

import pytest

from nvmeof_fuse.transport.tcp import splice as splicing
from nvmeof_fuse.transport.tcp.splice import Spliced, open_splicer


def test_a_buffer_reaches_the_peer_whole_and_in_order():
    data = bytearray(os.urandom(300 * 1024))
    a, b = socket.socketpair()
    splicer = open_splicer()
    assert splicer is not None
    try:
        a.setblocking(False)
        b.setblocking(False)
        out = Spliced(memoryview(data)[1:])  # not page aligned
        got = bytearray()
        while len(out):
            try:
                splicer.send(a.fileno(), out)
            except BlockingIOError:
                pass
            try:
                got += b.recv(1 << 20)
            except BlockingIOError:
                pass
        b.setblocking(True)
        while len(got) < len(data) - 1:
            got += b.recv(1 << 20)
        assert got == data[1:]
    finally:
        splicer.close()
        a.close()
        b.close()


@pytest.mark.parametrize("result, message", [
    (0, "vmsplice moved nothing into an empty pipe"),
    (-1, "vmsplice: " + os.strerror(errno.EFAULT)),
])
def test_a_failing_vmsplice_is_named(result, message, monkeypatch):
    splicer = open_splicer()
    assert splicer is not None

    def failing(fd, iov, count, flags):
        ctypes.set_errno(errno.EFAULT)
        return result

    monkeypatch.setattr(splicer, "_vmsplice", failing)
    a, b = socket.socketpair()
    try:
        with pytest.raises(OSError, match=message):
            splicer.send(a.fileno(), Spliced(memoryview(bytearray(8192))))
    finally:
        splicer.close()
        a.close()
        b.close()


def test_no_splicer_where_the_system_has_no_splice(monkeypatch):
    monkeypatch.delattr(splicing.os, "splice")
    assert open_splicer() is None
