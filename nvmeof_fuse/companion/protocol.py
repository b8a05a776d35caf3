"""The companion socket's wire format and the read/write plans, with no I/O.

Each message is one ``SOCK_SEQPACKET`` record: a 4-byte big-endian header
length, a JSON header, then an optional binary payload (only the few bytes of a
write's partial edge LBAs ever travel this way; data moves by RDMA).  File
descriptors (memfd or dma-buf) ride along as ``SCM_RIGHTS``.

Requests carry ``op`` and ``id``; replies echo ``id`` with ``ok`` and either the
result fields or ``error`` (one line) and ``errno``.
"""

from __future__ import annotations

import errno as _errno
import json
import struct
from dataclasses import dataclass

from ..errors import InvalidArgument, NVMeoFError

VERSION = 1
MAX_MESSAGE = 64 << 10  # bytes; the largest payload is two partial LBAs
MAX_FDS = 4
MAX_NAMED_NAMESPACES = 1024
"""NSIDs a ``lease`` request names at most, and namespaces a FUSE worker's lease or a
``namespaces`` event names at most, as ``[nsid, lba_size, nlb, generation]`` (any values fit
MAX_MESSAGE); past them the workers are sent none."""
NAMESPACES_BUDGET = MAX_MESSAGE - (16 << 10)
"""Bytes the namespaces of a ``hello`` or ``lease`` reply that asked for all of them may
take: a hello names the one it wants (``nsid``) and a lease those it wants (``nsids``); one
that asks for none gets all while they fit, else none (never some)."""
_HEADER = struct.Struct("!I")

OPS = ("hello", "register", "unregister", "read", "write", "stats", "lease", "unlease",
       "lock", "unlock", "report")


class ProtocolError(NVMeoFError):
    """A malformed message on the companion socket."""

    errno = _errno.EPROTO


class CompanionError(NVMeoFError):
    """The mount daemon refused or failed a request; ``errno`` is the daemon's."""

    def __init__(self, message: str, errno: int = _errno.EIO) -> None:
        super().__init__(message)
        self.errno = errno


class PlacementRefused(CompanionError):
    """The daemon cannot place data in this memory (a dma-buf its transport refused): an
    expected answer, counted apart from errors; the client stages instead."""

    def __init__(self, message: str) -> None:
        super().__init__(message, _errno.EOPNOTSUPP)


class NoAnswer(CompanionError):
    """The mount daemon did not answer in time (ETIMEDOUT): it may still act on the request,
    with memory the request named."""

    def __init__(self, message: str) -> None:
        super().__init__(message, _errno.ETIMEDOUT)


def encode(header: dict, payload: bytes | memoryview = b"") -> bytes:
    """One message: header length, JSON header, payload."""
    body = json.dumps(header, separators=(",", ":")).encode()
    message = _HEADER.pack(len(body)) + body + bytes(payload)
    if len(message) > MAX_MESSAGE:
        raise InvalidArgument(f"companion message of {len(message)} bytes exceeds "
                              f"{MAX_MESSAGE} bytes")
    return message


def decode(message: bytes) -> tuple[dict, bytes]:
    """``(header, payload)`` of one message; raises :class:`ProtocolError` when malformed."""
    if len(message) < _HEADER.size:
        raise ProtocolError(f"companion message of {len(message)} bytes is too short")
    (size,) = _HEADER.unpack_from(message)
    end = _HEADER.size + size
    if end > len(message):
        raise ProtocolError(f"companion header of {size} bytes overruns its "
                            f"{len(message)}-byte message")
    try:
        header = json.loads(message[_HEADER.size:end])
    except ValueError as exc:
        raise ProtocolError(f"companion header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("companion header is not a JSON object")
    return header, message[end:]


def reply_ok(request_id: int, **fields: object) -> bytes:
    return encode({"id": request_id, "ok": True, **fields})


def reply_error(request_id: int, exc: BaseException) -> bytes:
    code = getattr(exc, "errno", None) or _errno.EIO
    text = " ".join(str(exc).split()) or type(exc).__name__
    return encode({"id": request_id, "ok": False, "error": text, "errno": code})


def raise_for_reply(header: dict) -> dict:
    """The reply's fields, or :class:`CompanionError` carrying the daemon's message."""
    if not header.get("ok"):
        raise CompanionError(str(header.get("error", "the mount daemon failed the request")),
                             int(header.get("errno") or _errno.EIO))
    return header


def field(header: dict, name: str, kind: type = int) -> object:
    """A required header field of type ``kind`` (bool is not an int here)."""
    value = header.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"companion request {header.get('op')!r}: field {name!r} "
                            f"must be {kind.__name__}, got {value!r}")
    return value


def generation_field(header: dict) -> int:
    """The ``generation`` of a ``namespaces`` event (a rescan's sizes, counted from 1 by the
    main process), or of a FUSE worker's ``fuse`` request of kind ``namespaces`` that says it
    took them; raises :class:`ProtocolError` in one line when it is not one."""
    value = header.get("generation")
    if type(value) is not int or not 0 < value < 1 << 63:
        raise ProtocolError(f"companion message {header.get('op') or header.get('event')!r}: "
                            f"field 'generation' must be a count from 1, got "
                            f"{repr(value)[:20]}")
    return value


def fits_budget(value: object) -> bool:
    """Whether ``value`` encodes within :data:`NAMESPACES_BUDGET` bytes."""
    return len(json.dumps(value, separators=(",", ":"))) <= NAMESPACES_BUDGET


def nsids_field(header: dict) -> list[int] | None:
    """The ``nsids`` a request names (at most :data:`MAX_NAMED_NAMESPACES` NSIDs), or None
    when it names none; raises :class:`ProtocolError` in one line when malformed."""
    value = header.get("nsids")
    if value is None:
        return None
    why = ""
    if not isinstance(value, list):
        why = f"got {type(value).__name__}"
    elif len(value) > MAX_NAMED_NAMESPACES:
        why = f"got {len(value)}"
    else:
        bad = [v for v in value if type(v) is not int or not 0 < v < 0xFFFFFFFF]
        if bad:
            why = f"got {repr(bad[0])[:20]}"
    if why:
        raise ProtocolError(f"companion request {header.get('op')!r}: field 'nsids' must be a "
                            f"list of at most {MAX_NAMED_NAMESPACES} NSIDs (1 to 0xFFFFFFFE), "
                            f"{why}")
    return value


# -- read and write plans ------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Whole LBAs ``[slba, slba + nlb)`` placed at ``offset`` of registered region ``region``."""

    slba: int
    nlb: int
    region: int
    offset: int

    def to_list(self) -> list[int]:
        return [self.slba, self.nlb, self.region, self.offset]

    @classmethod
    def from_list(cls, value: object) -> Piece:
        if (not isinstance(value, list) or len(value) != 4
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise ProtocolError(f"a read piece is [slba, nlb, region, offset], got {value!r}")
        return cls(*value)


@dataclass(frozen=True)
class EdgeCopy:
    """After the read, copy ``length`` bytes from ``staging`` offset to caller offset ``dest``."""

    staging: int
    dest: int
    length: int


@dataclass(frozen=True)
class ReadPlan:
    """How one byte range reaches caller memory: LBA pieces, then small edge copies."""

    pieces: list[Piece]
    edges: list[EdgeCopy]


def plan_read(offset: int, length: int, lba_size: int, dest_region: int, dest_offset: int,
              edge_region: int, edge_offset: int) -> ReadPlan:
    """Place ``[offset, offset + length)`` of a namespace at ``dest_offset`` of a region.

    Whole LBAs inside the range go straight to the destination.  The partial
    LBAs at either end would spill outside the caller's bytes, so they land in
    the edge buffer (``2 * lba_size`` bytes at ``edge_offset`` of
    ``edge_region``) and the caller copies the wanted bytes from there.
    """
    from ..host.namespace.byterange import split_range

    sp = split_range(offset, length, lba_size)
    pieces, edges = [], []
    for slot, edge in enumerate(sp.edges()):
        at = edge_offset + slot * lba_size
        pieces.append(Piece(edge.lba, 1, edge_region, at))
        edges.append(EdgeCopy(at + edge.start, edge.data.start, edge.data.stop - edge.data.start))
    if sp.middle_nlb:
        pieces.append(Piece(sp.middle_slba, sp.middle_nlb, dest_region,
                            dest_offset + sp.middle.start))
    return ReadPlan(pieces, edges)


@dataclass(frozen=True)
class WritePlan:
    """A byte-range write: the edge bytes travel in the message, the middle by RDMA."""

    head: slice  # caller bytes of the partial first LBA (may be empty)
    middle: slice  # caller bytes of the whole LBAs
    tail: slice  # caller bytes of the partial last LBA (may be empty)


def plan_write(offset: int, length: int, lba_size: int) -> WritePlan:
    from ..host.namespace.byterange import split_range

    sp = split_range(offset, length, lba_size)
    head = sp.head.data if sp.head else slice(0, 0)
    tail = sp.tail.data if sp.tail else slice(length, length)
    return WritePlan(head, sp.middle, tail)


def chunks(offset: int, length: int, lba_size: int, chunk: int):
    """``(offset, length)`` pieces of at most ``chunk`` bytes, cut at LBA boundaries."""
    if chunk < lba_size:
        raise InvalidArgument(f"chunk of {chunk} bytes is smaller than an LBA ({lba_size})")
    per = chunk // lba_size  # LBAs a chunk may touch
    pos, end = offset, offset + length
    while pos < end:
        stop = min(end, (pos // lba_size + per) * lba_size)
        yield pos, stop - pos
        pos = stop
