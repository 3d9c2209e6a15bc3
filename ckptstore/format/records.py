"""Record framing: the unit of every segment file (format-spec/format.md, "Records").

A record is::

    offset  size  field
    0       4     magic          b"CSR1"
    4       1     type           RecordType
    5       1     flags          0, or FRAMING_CHECK on a CHUNK record
    6       2     reserved       0
    8       8     length         payload length N, u64 LE, <= MAX_PAYLOAD
    16      8     header_check   xxh3_64(bytes 0..16), u64 LE
    24      N     payload
    24+N    8     payload_check  xxh3_64(payload), or with FRAMING_CHECK xxh3_64(payload[:32])

Invariants: the header check lets a scanner trust ``length`` before reading the payload (a
garbage length can never make a reader allocate), and a record is valid if and only if both checks
match. A CHUNK record with FRAMING_CHECK (allowed only in a store whose STORE header has the
framing-checked-chunks feature, format/header.py) has a trailer over its 32-byte chunk header
alone: its data is covered by the chunk's xxh3-128 address, which every reader verifies before
using a byte (format-spec/format.md §5, §8), so a writer hashes the data once instead of twice.
Records carry no alignment padding.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Sequence

import xxhash

from ..errors import ChecksumMismatch, CorruptRecordError

MAGIC = b"CSR1"
HEADER_SIZE = 24
TRAILER_SIZE = 8
OVERHEAD = HEADER_SIZE + TRAILER_SIZE
#: Largest payload a v1 record may carry. Chunks are far smaller; this bounds what a reader allocates.
MAX_PAYLOAD = 1 << 30
#: Record flag: the trailer covers the payload's first :data:`FRAMED_BYTES` bytes only (CHUNK
#: records: the chunk header; the data is covered by the chunk's address).
FRAMING_CHECK = 0x01
#: Bytes of payload a FRAMING_CHECK trailer covers: a CHUNK payload's chunk header.
FRAMED_BYTES = 32

_HEAD = struct.Struct("<4sBBHQ")  # magic, type, flags, reserved, length (16 bytes)
_U64 = struct.Struct("<Q")


class RecordType(enum.IntEnum):
    """Record types. Values are stable across format versions; new types get new values."""

    SEGMENT_HEADER = 1
    CHUNK = 2
    TREE = 3
    MANIFEST = 4
    COMMIT = 5
    #: Reserved: marks a committed iteration deleted (retention without compaction).
    TOMBSTONE = 6
    #: Reserved for per-iteration gradient-delta records (write-ahead deltas).
    GRAD_DELTA = 16
    #: Reserved for per-rank streams of a multi-rank job.
    RANK_STREAM = 17


#: Types a v1 reader skips (they are self-delimiting) instead of treating as corruption.
RESERVED_TYPES = frozenset({RecordType.TOMBSTONE, RecordType.GRAD_DELTA, RecordType.RANK_STREAM})
KNOWN_TYPES = frozenset(int(t) for t in RecordType)


@dataclass(frozen=True)
class RecordHeader:
    """A decoded, checked record header."""

    type: int
    length: int
    flags: int = 0

    @property
    def framing_checked(self) -> bool:
        """Whether the trailer covers only the payload's first :data:`FRAMED_BYTES` bytes (the
        rest, a chunk's data, is then verified by its address, never by the trailer)."""
        return bool(self.flags & FRAMING_CHECK)

    @property
    def total_size(self) -> int:
        """Bytes the whole record occupies: header + payload + trailer."""
        return OVERHEAD + self.length


def may_frame(record_type: int, length: int) -> bool:
    """Whether a record of ``record_type`` with a ``length``-byte payload may carry
    FRAMING_CHECK: a CHUNK record of at least FRAMED_BYTES bytes."""
    return record_type == RecordType.CHUNK and length >= FRAMED_BYTES


def encode_header(record_type: int, length: int, flags: int = 0) -> bytes:
    """Return the 24-byte header of a record of ``record_type`` with a ``length``-byte payload;
    ``flags`` is 0 or FRAMING_CHECK (a CHUNK record of at least FRAMED_BYTES bytes only)."""
    if not 0 <= length <= MAX_PAYLOAD:
        raise ValueError(f"record payload of {length} bytes exceeds the {MAX_PAYLOAD}-byte limit")
    if flags and (flags != FRAMING_CHECK or not may_frame(record_type, length)):
        raise ValueError(f"record flags {flags:#x} are not allowed on a record of type "
                         f"{int(record_type)} with a {length}-byte payload")
    head = _HEAD.pack(MAGIC, int(record_type), flags, 0, length)
    return head + _U64.pack(xxhash.xxh3_64_intdigest(head))


def decode_header(buf: bytes | bytearray | memoryview,
                  known: frozenset[int] = KNOWN_TYPES) -> RecordHeader:
    """Decode and check a record header from the first 24 bytes of ``buf``; ``known`` is the set
    of types assigned where the record is read (segments by default; a job store's global log has
    its own, format/job.py).

    Raises CorruptRecordError when the bytes are not a valid header (short, bad magic, bad header
    check, unknown flags, or a length above MAX_PAYLOAD).
    """
    if len(buf) < HEADER_SIZE:
        raise CorruptRecordError(f"truncated record header: {len(buf)} of {HEADER_SIZE} bytes")
    head = bytes(buf[:16])
    magic, rtype, flags, reserved, length = _HEAD.unpack(head)
    if magic != MAGIC:
        raise CorruptRecordError(f"bad record magic {magic!r}")
    (check,) = _U64.unpack_from(buf, 16)
    actual = xxhash.xxh3_64_intdigest(head)
    if check != actual:
        raise ChecksumMismatch("record header", f"{check:016x}", f"{actual:016x}")
    if flags not in (0, FRAMING_CHECK) or reserved != 0:
        raise CorruptRecordError(f"record header has unknown flags {flags:#x}/{reserved:#x}")
    if length > MAX_PAYLOAD:
        raise CorruptRecordError(f"record length {length} exceeds the {MAX_PAYLOAD}-byte limit")
    if rtype not in known:
        raise CorruptRecordError(f"unknown record type {rtype}")
    if flags and not may_frame(rtype, length):
        raise CorruptRecordError(
            f"record flag {flags:#x} on a record of type {rtype} with a {length}-byte payload "
            f"(only a CHUNK record of at least {FRAMED_BYTES} bytes carries it)")
    return RecordHeader(rtype, length, flags)


def payload_check(*parts: bytes | memoryview) -> int:
    """xxh3_64 over the concatenation of ``parts`` (the payload, possibly in pieces; for a
    FRAMING_CHECK record, its first FRAMED_BYTES bytes)."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


def encode_trailer(*payload_parts: bytes | memoryview) -> bytes:
    """Return the 8-byte trailer for a payload given in one or more parts."""
    return _U64.pack(payload_check(*payload_parts))


def encode_check(check: int) -> bytes:
    """Return the 8-byte trailer holding ``check`` (a :func:`payload_check` computed elsewhere,
    e.g. over staged bytes piece by piece)."""
    return _U64.pack(check)


def framed_parts(parts: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """The first :data:`FRAMED_BYTES` bytes of a payload given in ``parts`` (in order), as parts:
    what a FRAMING_CHECK trailer covers."""
    out: list[bytes | memoryview] = []
    need = FRAMED_BYTES
    for part in parts:
        if need <= 0:
            break
        piece = memoryview(part).cast("B")[:need]
        out.append(piece)
        need -= len(piece)
    return out


def checked_parts(flags: int, parts: Sequence[bytes | memoryview]) -> Sequence[bytes | memoryview]:
    """The parts of a payload that the trailer of a record with ``flags`` covers: all of them,
    or with FRAMING_CHECK the first FRAMED_BYTES bytes."""
    return framed_parts(parts) if flags & FRAMING_CHECK else parts


def check_trailer(payload: bytes | memoryview, trailer: bytes | memoryview,
                  header: RecordHeader | None = None) -> None:
    """Raise ChecksumMismatch unless ``trailer`` is the check of ``payload`` (of the part its
    ``header``'s flags say the trailer covers)."""
    if len(trailer) != TRAILER_SIZE:
        raise CorruptRecordError(f"truncated record trailer: {len(trailer)} of {TRAILER_SIZE} bytes")
    (expected,) = _U64.unpack(bytes(trailer))
    actual = payload_check(*checked_parts(0 if header is None else header.flags, [payload]))
    if expected != actual:
        raise ChecksumMismatch("record payload", f"{expected:016x}", f"{actual:016x}")


def encode_record(record_type: int, payload: bytes, flags: int = 0) -> bytes:
    """Return a whole record (header, payload, trailer) as one bytes object. For small records."""
    header = encode_header(record_type, len(payload), flags)
    return header + payload + encode_trailer(*checked_parts(flags, [payload]))


def decode_record(buf: bytes | memoryview,
                  known: frozenset[int] = KNOWN_TYPES) -> tuple[RecordHeader, memoryview]:
    """Decode a whole record at the start of ``buf``; return its header and a view of its payload.

    Raises CorruptRecordError (or ChecksumMismatch) when the record is short or fails a check.
    A FRAMING_CHECK (CHUNK) record is checked up to its chunk header: its data is not verified
    here, and the caller verifies it against the chunk's address (chunk.decode_chunk_data).
    """
    view = memoryview(buf)
    header = decode_header(view, known)
    end = HEADER_SIZE + header.length
    if len(view) < end + TRAILER_SIZE:
        raise CorruptRecordError(
            f"truncated record: {len(view)} of {end + TRAILER_SIZE} bytes present")
    payload = view[HEADER_SIZE:end]
    check_trailer(payload, view[end:end + TRAILER_SIZE], header)
    return header, payload
