"""The safetensors header, parsed and checked with no I/O (files/safetensors_header.py); its
refusals, each one line, are tested through load_safetensors (test_safetensors_load.py)."""

from __future__ import annotations

import json

from nvmeof_fuse.companion.files import safetensors_header as sth


def test_offsets_are_absolute_and_in_file_order():
    header = json.dumps({"b": {"dtype": "U8", "shape": [3], "data_offsets": [4, 7]},
                         "a": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]},
                         "__metadata__": {"x": "y"}}).encode()
    found, meta = sth.parse_header(header, 8 + len(header) + 7)
    assert meta == {"x": "y"}
    assert [(t.name, t.start, t.nbytes) for t in found] == [
        ("a", 8 + len(header), 4), ("b", 8 + len(header) + 4, 3)]
