"""NVMe/TCP data helpers: gathered sends from the receiver thread."""

import pytest

from nvmeof_fuse.transport.tcp_data import Stalled, send_buffers


class TrickleSocket:
    """Takes at most ``step`` bytes per ``sendmsg``; refuses all once ``full``."""

    def __init__(self, step: int, full_after: int | None = None) -> None:
        self.step = step
        self.full_after = full_after
        self.got = bytearray()

    def sendmsg(self, buffers):
        if self.full_after is not None and len(self.got) >= self.full_after:
            raise BlockingIOError
        taken = b"".join(bytes(b) for b in buffers)[:self.step]
        self.got += taken
        return len(taken)


@pytest.mark.parametrize("step", [1, 3, 7, 100])
def test_send_buffers_sends_every_byte_in_order_across_partial_sends(step):
    sock = TrickleSocket(step)
    buffers = [b"head", b"", bytearray(b"payload"), memoryview(b"digest")]
    send_buffers(sock, buffers)
    assert bytes(sock.got) == b"headpayloaddigest" and buffers == []


def test_send_buffers_that_the_socket_stops_taking_are_stalled():
    with pytest.raises(Stalled):
        send_buffers(TrickleSocket(4, full_after=8), [b"0123456789abcdef"])
