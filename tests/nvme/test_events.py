"""Asynchronous event completions and the Changed Namespace List page."""

from __future__ import annotations

import struct

from nvmeof_fuse.nvme.events import AsyncEvent, AsyncEventType, parse_changed_ns_list


def test_a_namespace_attribute_notice_names_its_log_page():
    event = AsyncEvent.from_dw0(0x04 << 16 | 0x00 << 8 | AsyncEventType.NOTICE)
    assert (event.type, event.info, event.log_page) == (2, 0, 4)
    assert event.namespace_changed
    assert event.describe() == "namespace attribute changed (log page 0x04)"


def test_other_events_are_not_namespace_changes_and_are_named():
    smart = AsyncEvent.from_dw0(0x02 << 16 | 0x01 << 8 | AsyncEventType.SMART)
    assert not smart.namespace_changed
    assert smart.describe() == "smart event, info 0x01 (log page 0x02)"
    assert AsyncEvent.from_dw0(0x05).describe() == "type 5 event, info 0x00 (log page 0x00)"


def test_changed_namespace_list_ends_at_the_first_zero():
    page = struct.pack("<3I", 3, 7, 0) + bytes(4096 - 12)
    assert parse_changed_ns_list(page) == [3, 7]
    assert parse_changed_ns_list(bytes(4096)) == []


def test_an_overflowing_list_means_look_at_everything():
    assert parse_changed_ns_list(struct.pack("<I", 0xFFFFFFFF) + bytes(4092)) is None


def test_an_ana_change_notice_is_recognised():
    event = AsyncEvent.from_dw0(0x0C << 16 | 0x03 << 8 | AsyncEventType.NOTICE)
    assert event.ana_changed and not event.namespace_changed
    assert event.describe() == "ana change (log page 0x0c)"
    assert not AsyncEvent.from_dw0(0x03 << 8 | AsyncEventType.SMART).ana_changed
