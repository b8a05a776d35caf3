"""The safetensors file format's header, parsed and checked, with no I/O.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
"__metadata__": {...}}``), then the tensors' bytes, offsets counted from the end of
the header.  Every check here ends in one :class:`HeaderError` line naming the
tensor and what is wrong with it.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, NamedTuple

MAX_HEADER_BYTES = 100_000_000  # as the safetensors library
MAX_DIMS = 64  # numpy's and torch's limit on an array's dimensions
MAX_ELEMENT_BYTES = (1 << 63) - 1  # no array (even one with a zero dimension) may span more
PREFIX = 8

ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
            "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
            "C64": 8}
NUMPY = {"BOOL": "bool", "U8": "<u1", "I8": "<i1", "I16": "<i2", "U16": "<u2", "F16": "<f2",
         "I32": "<i4", "U32": "<u4", "F32": "<f4", "I64": "<i8", "U64": "<u8", "F64": "<f8",
         "C64": "<c8"}
TORCH = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
         "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
         "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
         "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64"}


class HeaderError(ValueError):
    """A malformed safetensors header (one line, naming what is wrong)."""


class Tensor(NamedTuple):
    """One tensor of the file: its bytes are ``[start, start+nbytes)`` of the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


def header_length(prefix: bytes, file_size: int) -> int:
    """The JSON header's length from the file's first 8 bytes, bounded."""
    if len(prefix) < PREFIX:
        raise HeaderError(f"file of {file_size} bytes is too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix[:PREFIX])
    if length > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {length} exceeds the limit of {MAX_HEADER_BYTES} "
                          "bytes")
    if PREFIX + length > file_size:
        raise HeaderError(f"header length {length} runs past the end of the "
                          f"{file_size}-byte file")
    return length


def parse_header(header: bytes, file_size: int) -> tuple[list[Tensor], dict[str, str]]:
    """The tensors (in file order) and ``__metadata__`` of a JSON header read from a file of
    ``file_size`` bytes."""
    try:
        doc = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise HeaderError(f"header is not valid JSON: {_first_line(exc)}") from None
    if not isinstance(doc, dict):
        raise HeaderError(f"header is a JSON {type(doc).__name__}, not an object")
    base = PREFIX + len(header)
    data_size = file_size - base
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise HeaderError("__metadata__ must map strings to strings")
    tensors = [_tensor(name, entry, base, data_size) for name, entry in doc.items()]
    tensors.sort(key=lambda t: (t.start, t.nbytes))
    for before, after in zip(tensors, tensors[1:], strict=False):
        if after.start < before.start + before.nbytes:
            raise HeaderError(f"tensor {after.name!r} at data offset {after.start - base} "
                              f"overlaps tensor {before.name!r}")
    return tensors, metadata


def _tensor(name: str, entry: Any, base: int, data_size: int) -> Tensor:
    if not isinstance(entry, dict):
        raise HeaderError(f"tensor {name!r}: entry is not an object")
    dtype = entry.get("dtype")
    if dtype not in ITEMSIZE:
        raise HeaderError(f"tensor {name!r}: unknown dtype {dtype!r}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(
            type(d) is int and d >= 0 for d in shape):
        raise HeaderError(f"tensor {name!r}: shape {shape!r} is not a list of "
                          "non-negative integers")
    if len(shape) > MAX_DIMS:
        raise HeaderError(f"tensor {name!r}: shape has {len(shape)} dimensions, more than "
                          f"{MAX_DIMS}")
    if math.prod(d for d in shape if d) * ITEMSIZE[dtype] > MAX_ELEMENT_BYTES:
        raise HeaderError(f"tensor {name!r}: shape {shape} of {dtype} is too large for an "
                          "array")
    offsets = entry.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)):
        raise HeaderError(f"tensor {name!r}: data_offsets {offsets!r} is not two "
                          "non-negative integers")
    begin, end = offsets
    if end < begin:
        raise HeaderError(f"tensor {name!r}: data_offsets {offsets} end before they begin")
    if end > data_size:
        raise HeaderError(f"tensor {name!r}: data_offsets {offsets} run past the end of the "
                          f"file ({data_size} data bytes)")
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if end - begin != nbytes:
        raise HeaderError(f"tensor {name!r}: data_offsets {offsets} hold {end - begin} bytes,"
                          f" shape {shape} of {dtype} needs {nbytes}")
    return Tensor(name, dtype, tuple(shape), base + begin, nbytes)


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
