"""Chunk records: content-addressed pieces of tensor bytes.

Chunk payload::

    0   16  address     xxh3_128 of the raw (uncompressed) bytes, canonical big-endian digest
    16  1   codec       0 = raw, 1 = lz4 block (no size prefix)
    17  7   reserved    0
    24  8   raw_length  u64, bytes after decoding (<= the payload's MAX_PAYLOAD)
    32  .   data        raw bytes, or the lz4 block

Invariant: decoding ``data`` with ``codec`` yields exactly ``raw_length`` bytes whose xxh3_128 is
``address``. A reader MUST check the address before using the bytes.

Compression policy (writer side, not part of the format): lz4 is tried on a sample (``SAMPLES``
pieces of ``SAMPLE_PIECE`` bytes spread evenly over the chunk) and the whole chunk is compressed only
when the sample shrinks by at least ``MIN_SAVING``; the result is kept only when the whole chunk
shrinks by as much. Float weights and gradients do not compress, so most chunks stay raw and cost
16 KiB of trial compression each (a contiguous 64 KiB prefix cost 4x that, and missed chunks whose
head differs from the rest).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Iterable

import lz4.block
import xxhash

from ..errors import ChecksumMismatch, CorruptRecordError, FormatError

ADDRESS_SIZE = 16
CHUNK_HEADER_SIZE = 32
_HEAD = struct.Struct("<16sB7sQ")
_ZERO7 = bytes(7)

#: Largest chunk a v1 writer may use; a decoder refuses larger raw lengths.
MAX_CHUNK_SIZE = 256 << 20
#: lz4 expands at most ~255x; a raw_length beyond this bound for the data given is corrupt.
_LZ4_MAX_RATIO = 255

SAMPLE_PIECE = 4 * 1024
SAMPLES = 4
MIN_SAVING = 0.10


class Codec(enum.IntEnum):
    RAW = 0
    LZ4 = 1


def address_of(data: bytes | memoryview) -> bytes:
    """The content address of raw chunk bytes: xxh3_128, 16 bytes."""
    return xxhash.xxh3_128_digest(data)


@dataclass(frozen=True)
class ChunkHeader:
    address: bytes
    codec: Codec
    raw_length: int


def encode_chunk_header(address: bytes, codec: Codec, raw_length: int) -> bytes:
    return _HEAD.pack(address, int(codec), _ZERO7, raw_length)


def decode_chunk_header(buf: bytes | memoryview) -> ChunkHeader:
    if len(buf) < CHUNK_HEADER_SIZE:
        raise CorruptRecordError(f"chunk payload of {len(buf)} bytes is shorter than its header")
    address, codec, reserved, raw_length = _HEAD.unpack(bytes(buf[:CHUNK_HEADER_SIZE]))
    if reserved != _ZERO7:
        raise FormatError("chunk header reserved bytes are not zero")
    try:
        codec = Codec(codec)
    except ValueError:
        raise FormatError(f"unknown chunk codec {codec}") from None
    if raw_length > MAX_CHUNK_SIZE:
        raise FormatError(f"chunk raw length {raw_length} exceeds {MAX_CHUNK_SIZE}")
    return ChunkHeader(address, codec, raw_length)


def max_raw_length(codec: int, payload_length: int) -> int:
    """The most raw bytes a CHUNK payload of ``payload_length`` bytes with ``codec`` can decode
    to (§8 C2): what its record can justify allocating before it is read. 0 for a payload
    shorter than the chunk header or an unknown codec (no chunk decodes from either)."""
    data = payload_length - CHUNK_HEADER_SIZE
    if data < 0:
        return 0
    if codec == Codec.RAW:
        return min(data, MAX_CHUNK_SIZE)
    if codec == Codec.LZ4:
        return min(_LZ4_MAX_RATIO * data + 64, MAX_CHUNK_SIZE)
    return 0


def lz4_bound(raw_length: int) -> int:
    """The most bytes lz4's block format takes for ``raw_length`` bytes (LZ4_COMPRESSBOUND): a
    longer lz4 chunk payload is damaged, whatever it holds."""
    return raw_length + raw_length // 255 + 16


def choose_encoding(raw: memoryview) -> tuple[Codec, bytes | memoryview]:
    """Return (codec, data) for a raw chunk: lz4 only when it saves at least MIN_SAVING."""
    n = len(raw)
    if n < 256:
        return Codec.RAW, raw
    if n > SAMPLES * SAMPLE_PIECE:
        stride = (n - SAMPLE_PIECE) // (SAMPLES - 1)
        sample: bytes | memoryview = b"".join(
            raw[i * stride:i * stride + SAMPLE_PIECE] for i in range(SAMPLES))
    else:
        sample = raw
    if len(lz4.block.compress(sample, store_size=False)) > len(sample) * (1 - MIN_SAVING):
        return Codec.RAW, raw
    packed = lz4.block.compress(raw, store_size=False)
    if len(packed) > n * (1 - MIN_SAVING):
        return Codec.RAW, raw
    return Codec.LZ4, packed


def decode_chunk_data(header: ChunkHeader, data: bytes | memoryview) -> memoryview:
    """Decode ``data`` and verify it against ``header.address``; return the verified raw bytes.

    For RAW chunks the returned view *is* ``data`` (no copy), so a reader can read a chunk straight
    into its destination and verify it in place. Raises CorruptRecordError / ChecksumMismatch.
    """
    if header.codec is Codec.RAW:
        if len(data) != header.raw_length:
            raise CorruptRecordError(
                f"raw chunk holds {len(data)} bytes but declares {header.raw_length}")
        raw = memoryview(data)
    else:
        if header.raw_length > _LZ4_MAX_RATIO * len(data) + 64:
            raise CorruptRecordError(
                f"lz4 chunk of {len(data)} bytes cannot decode to {header.raw_length} bytes")
        try:
            raw = memoryview(lz4.block.decompress(data, uncompressed_size=header.raw_length))
        except (lz4.block.LZ4BlockError, ValueError, MemoryError) as e:
            raise CorruptRecordError(f"lz4 chunk does not decompress: {e}") from e
        if len(raw) != header.raw_length:
            raise CorruptRecordError(
                f"lz4 chunk decompressed to {len(raw)} bytes, declared {header.raw_length}")
    actual = address_of(raw)
    if actual != header.address:
        raise ChecksumMismatch("chunk address", header.address.hex(), actual.hex())
    return raw


def verify_chunk_blocks(header: ChunkHeader, data_length: int,
                        blocks: Iterable[bytes | memoryview]) -> None:
    """Verify a chunk whose ``data_length`` bytes of data arrive as ``blocks``, in order (a
    reader streaming a record from a file): raw data is hashed block by block, never held
    whole; lz4 data, at most lz4's worst case for ``raw_length`` (checked before any block is
    taken), is joined and decoded. Raises CorruptRecordError / ChecksumMismatch as
    :func:`decode_chunk_data` does, and CorruptRecordError when the blocks end short."""
    if header.codec is Codec.RAW:
        if data_length != header.raw_length:
            raise CorruptRecordError(
                f"raw chunk holds {data_length} bytes but declares {header.raw_length}")
        h = xxhash.xxh3_128()
        got = 0
        for block in blocks:
            h.update(block)
            got += len(block)
        if got != data_length:
            raise CorruptRecordError(f"chunk data ends after {got} of {data_length} bytes")
        if h.digest() != header.address:
            raise ChecksumMismatch("chunk address", header.address.hex(), h.hexdigest())
        return
    if data_length > lz4_bound(header.raw_length):
        raise CorruptRecordError(f"lz4 chunk of {data_length} bytes is longer than lz4 makes "
                                 f"{header.raw_length} bytes")
    data = b"".join(blocks)
    if len(data) != data_length:
        raise CorruptRecordError(f"chunk data ends after {len(data)} of {data_length} bytes")
    decode_chunk_data(header, data)


def decode_chunk(payload: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    """Decode a whole chunk payload; return its header and the verified raw bytes."""
    view = memoryview(payload)
    header = decode_chunk_header(view)
    return header, decode_chunk_data(header, view[CHUNK_HEADER_SIZE:])
