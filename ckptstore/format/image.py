"""Chunk images: a tensor's CHUNK records laid out in memory exactly as they lie in a segment.

A delta's gradients are captured into host memory during backward and then written to the log.
Written as ordinary records, every byte is copied once more into an aligned staging buffer (an
O_DIRECT write needs an aligned address, length and file offset; records have none of these).
A *chunk image* removes that copy: the capture writes each gradient chunk where its record's
data will lie, leaving room for the record framing around it, and the persister fills in the
framing (record header, chunk header, trailer) around the data in place and writes the whole
image with O_DIRECT straight from the capture memory.

Geometry (``stride`` S, a multiple of :data:`BLOCK`, and a tensor of ``nbytes`` bytes)::

    record j at offset j*S:  record header (24) | chunk header (32) | data | trailer (8)
    data of every record but the last: S - 64 bytes  (the manifest's ``chunk_size``)
    after the last record:   one pad record, so the image ends on a BLOCK boundary

so every full record spans exactly ``S`` bytes and starts on a block boundary: any record can be
left out of the write (a chunk the store already holds, one that compresses) and the rest stays
aligned. These are ordinary v1 records (format-spec/format.md §5, §8); nothing about the format
changes. A *pad record* is a raw CHUNK record of zero bytes that no manifest references; it is an
unreferenced chunk like any other (gc reclaims it), used only to move the log's end to a block
boundary (format-spec/format.md §8, "Alignment padding").

Everything here is pure: geometry, and functions that write record framing into a caller's
buffer. Nothing touches a file.
"""

from __future__ import annotations

import functools
import mmap
from dataclasses import dataclass
from typing import Any

from . import records as rec
from .chunk import CHUNK_HEADER_SIZE, Codec, address_of, encode_chunk_header

#: Alignment of an image's start, its length, and every full record in it: the page size, a
#: multiple of every logical block size O_DIRECT asks for.
BLOCK = 4096
#: Offset of a record's chunk data from the record's start.
DATA_OFFSET = rec.HEADER_SIZE + CHUNK_HEADER_SIZE
#: Bytes a CHUNK record adds around its data; also the smallest pad record.
RECORD_OVERHEAD = DATA_OFFSET + rec.TRAILER_SIZE


def pad_size(end: int) -> int:
    """Bytes of pad record that bring a log (or an image) ending at ``end`` to a block boundary:
    0 when it is on one, else at least :data:`RECORD_OVERHEAD` (a pad record cannot be smaller)."""
    pad = -end % BLOCK
    return pad + BLOCK if 0 < pad < RECORD_OVERHEAD else pad


@functools.lru_cache(maxsize=64)
def _zeros_address(n: int) -> bytes:
    return address_of(bytes(n))


def pad_payload(size: int) -> bytes:
    """The payload of a pad record of ``size`` bytes (>= :data:`RECORD_OVERHEAD`): the chunk
    header of ``size - 64`` zero bytes, then those bytes."""
    if size < RECORD_OVERHEAD:
        raise ValueError(f"a pad record needs at least {RECORD_OVERHEAD} bytes, not {size}")
    n = size - RECORD_OVERHEAD
    return encode_chunk_header(_zeros_address(n), Codec.RAW, n) + bytes(n)


@functools.lru_cache(maxsize=256)
def _pad_record(size: int, framing_check: bool) -> bytes:
    """The whole pad record of ``size`` bytes (a pure function of its size and flags)."""
    return rec.encode_record(rec.RecordType.CHUNK, pad_payload(size),
                             rec.FRAMING_CHECK if framing_check else 0)


@functools.lru_cache(maxsize=256)
def _chunk_record_header(payload_len: int, flags: int) -> bytes:
    """The record header of a CHUNK record (a pure function of its length and flags: cached,
    as an image's full records all share one)."""
    return rec.encode_header(rec.RecordType.CHUNK, payload_len, flags)


def seal_pad(buf: memoryview, offset: int, size: int, framing_check: bool) -> None:
    """Write a pad record of ``size`` bytes at ``offset`` of ``buf`` (``framing_check``: as in
    :func:`seal_chunk`)."""
    buf[offset:offset + size] = _pad_record(size, framing_check)


def seal_chunk(buf: memoryview, offset: int, address: bytes, data_len: int,
               framing_check: bool) -> None:
    """Frame the raw chunk whose ``data_len`` bytes lie at ``offset + DATA_OFFSET`` of ``buf``
    as one CHUNK record starting at ``offset``: record header, chunk header (``address``, raw
    codec), and the trailer over the payload as it now lies in ``buf`` (with ``framing_check``,
    a FRAMING_CHECK record whose trailer covers the chunk header alone: the data is not read
    again). The data is never written; the caller computed ``address`` over it."""
    payload_len = CHUNK_HEADER_SIZE + data_len
    flags = rec.FRAMING_CHECK if framing_check else 0
    buf[offset:offset + rec.HEADER_SIZE] = _chunk_record_header(payload_len, flags)
    buf[offset + rec.HEADER_SIZE:offset + DATA_OFFSET] = encode_chunk_header(address, Codec.RAW,
                                                                              data_len)
    start = offset + rec.HEADER_SIZE
    buf[start + payload_len:start + payload_len + rec.TRAILER_SIZE] = \
        rec.encode_trailer(*rec.checked_parts(flags, [buf[start:start + payload_len]]))


@dataclass(frozen=True)
class ChunkImage:
    """The layout of one tensor's chunk image: ``nbytes`` of data in records ``stride`` apart.

    Invariants: ``stride`` is a multiple of :data:`BLOCK` larger than :data:`RECORD_OVERHEAD`;
    record ``j`` starts at ``j * stride``; :attr:`size` is a multiple of :data:`BLOCK`; a tensor
    of 0 bytes has no image (its data is inline in the manifest)."""

    nbytes: int
    stride: int

    def __post_init__(self) -> None:
        if self.stride % BLOCK or self.stride <= RECORD_OVERHEAD:
            raise ValueError(f"image stride {self.stride} is not a multiple of {BLOCK} above "
                             f"{RECORD_OVERHEAD}")
        if self.nbytes <= 0:
            raise ValueError("a chunk image holds at least one byte")

    @staticmethod
    def stride_for(chunk_size: int) -> int:
        """The stride a store of ``chunk_size`` uses for its images: ``chunk_size`` rounded up to
        a block, at least two blocks (so most of a record is data)."""
        return max(2 * BLOCK, -(-chunk_size // BLOCK) * BLOCK)

    # The derived sizes below are cached (the write path asks for them per record; the fields
    # are frozen, so they never change).
    @functools.cached_property
    def chunk_size(self) -> int:
        """The data bytes per full record (the manifest's ``chunk_size``)."""
        return self.stride - RECORD_OVERHEAD

    @functools.cached_property
    def n_chunks(self) -> int:
        return -(-self.nbytes // self.chunk_size)

    def data_length(self, j: int) -> int:
        """Data bytes of record ``j``."""
        return min(self.chunk_size, self.nbytes - j * self.chunk_size)

    def record_end(self, j: int) -> int:
        """Offset just past record ``j``."""
        return j * self.stride + RECORD_OVERHEAD + self.data_length(j)

    @functools.cached_property
    def records_end(self) -> int:
        return self.record_end(self.n_chunks - 1)

    @functools.cached_property
    def pad(self) -> int:
        """Bytes of the pad record after the last chunk record (0: none)."""
        return pad_size(self.records_end)

    @functools.cached_property
    def size(self) -> int:
        return self.records_end + self.pad

    def data_offset(self, j: int) -> int:
        return j * self.stride + DATA_OFFSET

    def span(self, j: int) -> tuple[int, int]:
        """The block-aligned byte range that record ``j`` owns in the image: its own ``stride``
        bytes, or for the last record everything to the image's end (its pad record included)."""
        start = j * self.stride
        return start, (self.size if j == self.n_chunks - 1 else start + self.stride)


class LentFramer:
    """CHUNK records whose data stay in their owner's memory (a lent tensor's, no image): each
    record's data is written from that memory, its framing from small page-aligned *gaps*.

    O_DIRECT writes whole blocks from block-aligned memory to block-aligned file offsets. A
    chunk's data lies at an arbitrary address, so each record is placed so that the first block
    boundary inside its data in memory falls on a block boundary in the file: the *middle* of
    its data (whole blocks from that boundary) is written straight from the owner's memory; the
    rest goes through the gap before it (a pad record to place it, the record header and chunk
    header, the data's first bytes up to the boundary) and the gap after it (the data's last
    bytes and the trailer). Written in order, gaps and middles are the records laid end to end,
    with a pad record before each (valid v1 records, as in images; a chunk smaller than about
    two blocks lies whole in a gap). The log must end on a block boundary before the first
    gap (the log appends a pad record first, as for images).

    Call sequence: :meth:`add` per chunk (returns the record's offset in the written bytes),
    then :meth:`buffers` once (the parts to write, in order: gaps copied into one page-aligned
    buffer, middles viewing the owner's memory).
    """

    def __init__(self, framing_check: bool) -> None:
        self.flags = rec.FRAMING_CHECK if framing_check else 0
        self.framing_check = framing_check
        self._parts: list[tuple[bool, Any]] = []  # (is a gap, bytes or a memoryview)
        self._pending = bytearray()  # framing and data bytes since the last middle
        self._out = 0  # bytes in _parts

    @property
    def size(self) -> int:
        """Bytes written so far, the open gap included."""
        return self._out + len(self._pending)

    def add(self, data: memoryview, memory_address: int, address: bytes) -> int:
        """Frame one raw chunk: ``data`` (its bytes, at ``memory_address``) with chunk
        ``address``; returns the offset of its record in the written bytes."""
        n = len(data)
        chunk_header = encode_chunk_header(address, Codec.RAW, n)
        framing = _chunk_record_header(CHUNK_HEADER_SIZE + n, self.flags) + chunk_header
        trailer = rec.encode_trailer(*rec.checked_parts(self.flags, [chunk_header, data]))
        head = -memory_address % BLOCK
        middle = (n - head) // BLOCK * BLOCK if n > head else 0
        pending = self._pending
        if middle == 0:  # too small for a block of its own: whole in the gap
            at = self.size
            pending += framing
            pending += data
            pending += trailer
            return at
        pad = -(len(pending) + DATA_OFFSET + head) % BLOCK
        if 0 < pad < RECORD_OVERHEAD:
            pad += BLOCK
        if pad:
            pending += _pad_record(pad, self.framing_check)
        at = self.size
        pending += framing
        pending += data[:head]
        assert len(pending) % BLOCK == 0
        self._close_gap()
        self._parts.append((False, data[head:head + middle]))
        self._out += middle
        self._pending += data[head + middle:]
        self._pending += trailer
        return at

    def _close_gap(self) -> None:
        if self._pending:
            self._parts.append((True, bytes(self._pending)))
            self._out += len(self._pending)
            self._pending = bytearray()

    def buffers(self) -> list[memoryview]:
        """The parts to write, in order, each page-aligned in memory and whole blocks long (the
        last gap ends with a pad record to a block boundary). The gaps' memory is owned by the
        returned views."""
        pad = pad_size(len(self._pending))
        if pad:
            self._pending += _pad_record(pad, self.framing_check)
        self._close_gap()
        gap_bytes = sum(len(p) for is_gap, p in self._parts if is_gap)
        if not gap_bytes:
            return [p for _, p in self._parts]
        area = mmap.mmap(-1, gap_bytes)  # anonymous: page-aligned
        view = memoryview(area)
        out: list[memoryview] = []
        at = 0
        for is_gap, p in self._parts:
            if is_gap:
                view[at:at + len(p)] = p
                out.append(view[at:at + len(p)])
                at += len(p)
            else:
                out.append(p)
        return out
