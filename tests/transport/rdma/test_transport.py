"""Pure parts of the NVMe/RDMA transport: CM private data, command slots, data pointers."""

import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest
import trio

from nvmeof_fuse.errors import ConnectError, DeviceMismatch, TransportError
from nvmeof_fuse.nvme import Completion
from nvmeof_fuse.nvme.sgl import NULL_SGL, in_capsule_data, keyed_data_block
from nvmeof_fuse.transport.base import LocalDevice
from nvmeof_fuse.transport.rdma import transport as rdma
from nvmeof_fuse.transport.rdma.transport import (
    CommandSlots,
    RdmaQueue,
    cm_request,
    parse_cm_accept,
)
from nvmeof_fuse.transport.region import Region


def completion(cid: int) -> Completion:
    return Completion(result=0, sq_head=0, sq_id=1, command_id=cid, status=0, phase=True)


# --- RDMA-CM private data -------------------------------------------------------------------------


def test_import_needs_no_ibverbs():
    code = ("import sys; sys.modules['ibverbs'] = None\n"
            "import nvmeof_fuse.transport.rdma.transport as r\n"
            "assert r.cm_request(0, 32)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cm_request_layout():
    data = cm_request(qid=3, size=128, cntlid=0x1234)
    assert len(data) == 32
    recfmt, qid, hrqsize, hsqsize, cntlid = struct.unpack_from("<5H", data)
    assert (recfmt, qid, hrqsize, hsqsize, cntlid) == (0, 3, 128, 127, 0x1234)
    assert data[10:] == bytes(22)


def test_cm_request_admin_defaults():
    assert cm_request(0, 32) == struct.pack("<5H", 0, 0, 32, 31, 0) + bytes(22)


def test_parse_cm_accept():
    assert parse_cm_accept(struct.pack("<HH", 0, 127) + bytes(28)) == 127


def test_parse_cm_accept_ignores_trailing_bytes():
    assert parse_cm_accept(struct.pack("<HH", 0, 31) + bytes(60)) == 31


@pytest.mark.parametrize("length", [0, 4, 31])
def test_parse_cm_accept_short(length):
    with pytest.raises(ConnectError, match=rf"carried {length} bytes .* expected 32"):
        parse_cm_accept(bytes(length))


def test_parse_cm_accept_bad_recfmt():
    with pytest.raises(ConnectError, match="record format 1, expected 0"):
        parse_cm_accept(struct.pack("<HH", 1, 127) + bytes(28))


# --- command slots --------------------------------------------------------------------------------


def test_slots_hold_size_minus_one():
    slots = CommandSlots(4)
    assert slots.available == 3
    requests = [slots.allocate(None) for _ in range(3)]
    assert {r.slot for r in requests} == {0, 1, 2}
    assert all(r.cid & slots.mask == r.slot for r in requests)
    assert slots.available == 0
    with pytest.raises(IndexError):
        slots.allocate(None)


def test_send_then_response_finishes():
    slots = CommandSlots(8)
    request = slots.allocate(None)
    slots.send_completed(request.slot)
    assert request.sent and not request.finished
    assert slots.available == 6
    slots.response(completion(request.cid))
    assert request.finished and request.completion.command_id == request.cid
    assert request.error is None
    assert slots.available == 7 and not slots.pending


def test_response_finishes_before_send_but_keeps_the_slot():
    slots = CommandSlots(8)
    request = slots.allocate(None)
    slots.response(completion(request.cid))
    assert request.finished  # the caller may go on: the target answered
    assert slots.available == 6 and slots.awaiting_send == 1  # the SEND still owns the slot
    slots.send_completed(request.slot)
    assert slots.available == 7 and slots.awaiting_send == 0 and not slots.pending


def test_in_capsule_data_waits_for_its_send():
    slots = CommandSlots(8)
    request = slots.allocate(None)
    request.inline = True  # the HCA reads the caller's memory until the SEND completes
    slots.response(completion(request.cid))
    assert not request.finished and slots.awaiting_send == 1
    slots.send_completed(request.slot)
    assert request.finished and slots.available == 7 and slots.awaiting_send == 0


def test_second_response_is_a_transport_error():
    slots = CommandSlots(8)
    request = slots.allocate(None)
    slots.response(completion(request.cid))
    with pytest.raises(TransportError, match="second response for command ID"):
        slots.response(completion(request.cid))


def test_finished_slot_is_reused():
    slots = CommandSlots(2)
    first = slots.allocate(None)
    slots.send_completed(first.slot)
    slots.response(completion(first.cid))
    second = slots.allocate(None)
    assert second.slot == first.slot and second is not first
    assert second.cid != first.cid  # a new generation of the slot


def test_late_response_of_an_earlier_generation_is_not_in_flight():
    # The kernel's nvme_cid: a duplicate answer after the slot was reused must never
    # complete the command using it now.
    slots = CommandSlots(2)
    first = slots.allocate(None)
    slots.send_completed(first.slot)
    slots.response(completion(first.cid))
    second = slots.allocate(None)
    with pytest.raises(TransportError, match=f"command ID {first.cid}, which is not in flight"):
        slots.response(completion(first.cid))
    assert not second.finished and second.completion is None


def test_every_generation_of_a_slot_differs_until_the_counter_wraps():
    slots = CommandSlots(128)  # 7 bits of slot, 9 of generation
    seen = []
    for _ in range(512):
        request = slots.allocate(None)
        seen.append(request.cid)
        slots.send_completed(request.slot)
        slots.response(completion(request.cid))
    assert len(set(seen)) == 512 and all(cid < 1 << 16 for cid in seen)


def test_release_returns_unsent_slot():
    slots = CommandSlots(3)
    request = slots.allocate(None)
    slots.release(request)
    assert slots.available == 2 and not slots.pending
    assert not request.finished


def test_fail_all_finishes_everything_with_the_error():
    slots = CommandSlots(8)
    requests = [slots.allocate(None) for _ in range(3)]
    slots.send_completed(requests[0].slot)
    error = TransportError("gone")
    slots.fail_all(error)
    assert all(r.finished and r.error is error for r in requests)
    assert slots.available == 7 and not slots.pending and slots.awaiting_send == 0


def test_unknown_cid_is_a_transport_error():
    slots = CommandSlots(8)
    with pytest.raises(TransportError, match="send completion for slot 5"):
        slots.send_completed(5)
    with pytest.raises(TransportError, match="response for command ID 6, which is not in flight"):
        slots.response(completion(6))


def test_late_completion_after_finish_is_rejected():
    slots = CommandSlots(8)
    request = slots.allocate(None)
    slots.fail_all(TransportError("gone"))
    with pytest.raises(TransportError):
        slots.response(completion(request.cid))


# --- data pointers --------------------------------------------------------------------------------


class FakeSGE:
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.fields = (addr, length, lkey)


@pytest.fixture
def queue():
    """An RdmaQueue with no verbs objects: enough for ``data_pointer``."""
    q = RdmaQueue.__new__(RdmaQueue)
    q._ib = SimpleNamespace(SGE=FakeSGE)
    q.pd = object()
    q.in_capsule_bytes = 4096
    return q


def region() -> Region:
    keys = SimpleNamespace(lkey=0x11, rkey=0x22)
    return Region(0x10000, 1 << 20, SimpleNamespace(keys=lambda pd: keys, close=lambda: None))


def test_no_data_is_a_null_keyed_sgl(queue):
    assert queue.data_pointer(None, to_controller=False) == (NULL_SGL, [])
    assert queue.data_pointer(region().ref(0, 0), to_controller=True) == (NULL_SGL, [])


def test_small_write_goes_in_capsule(queue):
    sgl, extra = queue.data_pointer(region().ref(512, 4096), to_controller=True)
    assert sgl == in_capsule_data(0, 4096)
    assert [sge.fields for sge in extra] == [(0x10000 + 512, 4096, 0x11)]


def test_large_write_is_keyed(queue):
    sgl, extra = queue.data_pointer(region().ref(0, 4097), to_controller=True)
    assert sgl == keyed_data_block(0x10000, 4097, 0x22) and extra == []


def test_read_is_always_keyed(queue):
    sgl, extra = queue.data_pointer(region().ref(8, 16), to_controller=False)
    assert sgl == keyed_data_block(0x10008, 16, 0x22) and extra == []


def test_no_in_capsule_data_when_controller_offers_none(queue):
    queue.in_capsule_bytes = 0
    sgl, extra = queue.data_pointer(region().ref(0, 64), to_controller=True)
    assert sgl == keyed_data_block(0x10000, 64, 0x22) and extra == []


class _BoundCM:
    def __init__(self, device: str) -> None:
        self.context = SimpleNamespace(name=device)
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _resolve_to(monkeypatch, device: str, **kw):
    cm = _BoundCM(device)
    monkeypatch.setattr(rdma, "_verbs", lambda: SimpleNamespace(
        CMID=SimpleNamespace(resolve=lambda *a, **k: cm)))
    transport = rdma.RdmaTransport("10.0.1.1", 4420, **kw)
    return transport, cm, trio.run(transport._resolve)


def test_the_rdma_device_rdma_cm_bound_is_known(monkeypatch):
    transport, cm, got = _resolve_to(monkeypatch, "mlx5_3")
    assert got is cm and transport.local_device == LocalDevice("infiniband", "mlx5_3")
    transport, cm, got = _resolve_to(monkeypatch, "mlx5_3", host_iface="mlx5_3")
    assert got is cm and not cm.closed


def test_a_route_bound_to_another_device_than_host_iface_is_refused_naming_both(monkeypatch):
    with pytest.raises(DeviceMismatch) as info:
        _resolve_to(monkeypatch, "mlx5_0", host_iface="mlx5_3")
    assert str(info.value) == ("RDMA-CM bound the route to 10.0.1.1:4420 to mlx5_0, not to "
                               "mlx5_3 (host_iface): refused")
    assert isinstance(info.value, ConnectError)
