"""The store header file (``STORE``) and the segment-header record payload.

STORE file, 64 bytes, little-endian::

    0   8   magic          b"CKPTSTOR"
    8   4   format_version u32 (1)
    12  4   flags          u32: incompatible features, a bit set of KNOWN_FEATURES
    16  16  store_id       random bytes; every segment header repeats it
    32  8   chunk_size     u64, bytes per chunk for new writes (informational for readers)
    40  8   segment_size   u64, soft limit at which a writer rolls to a new segment
    48  8   created_ns     u64, unix time in ns
    56  8   check          xxh3_64(bytes 0..56)

Segment header record payload (record type SEGMENT_HEADER), 48 bytes::

    0   4   format_version u32
    4   4   reserved       0
    8   8   seq            u64, the segment's sequence number (also in its file name)
    16  16  store_id       must equal the STORE file's
    32  8   supersedes     u64: 0, or every segment with seq <= this value is obsolete (gc)
    40  8   reserved       0
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from ..errors import ChecksumMismatch, FormatError, UnsupportedVersionError

FORMAT_VERSION = 1
STORE_MAGIC = b"CKPTSTOR"
STORE_HEADER_SIZE = 64

#: STORE flag: CHUNK records in this store may carry the FRAMING_CHECK record flag (their trailer
#: covers the chunk header; the data is covered by its address, format-spec/format.md §4, §5).
FEATURE_FRAMING_CHECKS = 0x1
#: Every STORE flag this reader knows in a version-1 store (a job store, version 2, has none).
#: Flags are *incompatible* features: a reader refuses a store with a flag it does not know, so an
#: older reader never meets records it cannot check.
KNOWN_FEATURES = FEATURE_FRAMING_CHECKS
#: The flags of a store created now.
NEW_STORE_FEATURES = FEATURE_FRAMING_CHECKS
#: Each feature's name, as errors and ``ckptstore`` options say it.
FEATURE_NAMES = {FEATURE_FRAMING_CHECKS: "FRAMING_CHECKS"}


def feature_names(flags: int) -> list[str]:
    """The names of the features set in ``flags`` (unknown bits as hex)."""
    names = [name for bit, name in FEATURE_NAMES.items() if flags & bit]
    rest = flags & ~sum(FEATURE_NAMES)
    return names + ([f"{rest:#x}"] if rest else [])

_STORE = struct.Struct("<8sII16sQQQ")
_SEGMENT = struct.Struct("<II Q 16s Q Q".replace(" ", ""))


@dataclass(frozen=True)
class StoreHeader:
    """Decoded STORE file."""

    format_version: int
    store_id: bytes
    chunk_size: int
    segment_size: int
    created_ns: int
    flags: int = 0

    @property
    def framing_checks(self) -> bool:
        """Whether this store's writers frame CHUNK records with FRAMING_CHECK trailers."""
        return bool(self.flags & FEATURE_FRAMING_CHECKS)


def encode_store_header(h: StoreHeader) -> bytes:
    body = _STORE.pack(STORE_MAGIC, h.format_version, h.flags, h.store_id, h.chunk_size,
                       h.segment_size, h.created_ns)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def decode_store_header(buf: bytes, versions: tuple[int, ...] = (FORMAT_VERSION,)) -> StoreHeader:
    """Decode the STORE file. Raises FormatError / UnsupportedVersionError on bad bytes, and
    UnsupportedVersionError for a version not in ``versions`` (a single-writer store reads version
    1; a multi-rank job store is version 2, format/job.py)."""
    if len(buf) != STORE_HEADER_SIZE:
        raise FormatError(f"store header is {len(buf)} bytes, expected {STORE_HEADER_SIZE}")
    if buf[:8] != STORE_MAGIC:
        raise FormatError(f"not a ckptstore store header (magic {bytes(buf[:8])!r})")
    body = bytes(buf[:56])
    (check,) = struct.unpack_from("<Q", buf, 56)
    actual = xxhash.xxh3_64_intdigest(body)
    if check != actual:
        raise ChecksumMismatch("store header", f"{check:016x}", f"{actual:016x}")
    _, version, flags, store_id, chunk_size, segment_size, created = _STORE.unpack(body)
    if version not in versions:
        what = ("that of a multi-rank job store, which a single-writer store does not read "
                "(ckptstore.open(path, mode='r') reads a job store, process_group=... writes it)"
                if version == 2 and 2 not in versions else "not supported")
        raise UnsupportedVersionError(
            f"store format version {version} is {what} (this reader takes version "
            f"{', '.join(map(str, versions))})")
    known = KNOWN_FEATURES if version == FORMAT_VERSION else 0  # a job store (v2) has none
    if flags & ~known:
        raise FormatError(f"store header has unknown flags {flags & ~known:#x} (features of a "
                          "newer ckptstore: this reader refuses the store rather than misread "
                          "it)")
    if chunk_size == 0 or segment_size == 0:
        raise FormatError("store header has a zero chunk or segment size")
    return StoreHeader(version, store_id, chunk_size, segment_size, created, flags)


@dataclass(frozen=True)
class SegmentHeader:
    """Payload of the first record of every segment file."""

    format_version: int
    seq: int
    store_id: bytes
    supersedes: int = 0


SEGMENT_HEADER_SIZE = _SEGMENT.size


def encode_segment_header(h: SegmentHeader) -> bytes:
    return _SEGMENT.pack(h.format_version, 0, h.seq, h.store_id, h.supersedes, 0)


def decode_segment_header(buf: bytes | memoryview) -> SegmentHeader:
    if len(buf) != SEGMENT_HEADER_SIZE:
        raise FormatError(f"segment header payload is {len(buf)} bytes, expected {SEGMENT_HEADER_SIZE}")
    version, r0, seq, store_id, supersedes, r1 = _SEGMENT.unpack(bytes(buf))
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(f"segment format version {version} is not supported")
    if r0 or r1:
        raise FormatError("segment header reserved fields are not zero")
    if supersedes >= seq:
        raise FormatError(f"segment {seq} claims to supersede segment {supersedes} (not older)")
    return SegmentHeader(version, seq, store_id, supersedes)
