"""The malloc thresholds that keep FUSE write payloads from being page-faulted in anew."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")

# How many chunks glibc serves with mmap of their own (mallinfo2().hblks) grows by one for
# a 1 MiB bytes object, as pyfuse3 makes for each 1 MiB write, unless the threshold applies.
PROBE = """
import ctypes, sys
from nvmeof_fuse.fs.heap import keep_write_buffers

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "raise":
    assert keep_write_buffers() is True
before = libc.mallinfo2().hblks
payload = bytes(1 << 20)
print(libc.mallinfo2().hblks - before)
"""


def mmapped_chunks_for_one_write(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         timeout=60, check=True)
    return int(out.stdout)


def test_a_write_payload_comes_from_the_heap_once_raised():
    assert mmapped_chunks_for_one_write("default") == 1, "the probe no longer sees mmap chunks"
    assert mmapped_chunks_for_one_write("raise") == 0
