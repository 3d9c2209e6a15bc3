"""Commit records: the single commit point of a checkpoint.

Commit payload (record type COMMIT), 96 bytes, little-endian::

    0   8   iteration         u64 (< 2**63)
    8   8   manifest_seq      u64, segment holding the manifest record
    16  8   manifest_offset   u64, offset of the manifest record in that segment
    24  8   manifest_length   u64, payload length of the manifest record
    32  16  manifest_digest   xxh3_128 of the manifest payload
    48  16  snapshot_root     format/tree.py snapshot_root
    64  8   created_ns        u64
    72  8   logical_bytes     u64, sum of the checkpoint's tensor bytes
    80  8   written_bytes     u64, bytes of new records this checkpoint appended (0 after gc copy)
    88  1   kind              0 = snapshot; 1 = delta (format-spec/deltas.md)
    89  7   reserved          0

A checkpoint is committed if and only if its commit record is valid (both record checks) and the
manifest it names is valid and has the named digest and the same iteration.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import FormatError

_COMMIT = struct.Struct("<QQQQ16s16sQQQB7s")
COMMIT_SIZE = _COMMIT.size
KIND_SNAPSHOT = 0
KIND_DELTA = 1
KINDS = (KIND_SNAPSHOT, KIND_DELTA)
KIND_NAMES = {KIND_SNAPSHOT: "snapshot", KIND_DELTA: "delta"}


@dataclass(frozen=True)
class Commit:
    iteration: int
    manifest_seq: int
    manifest_offset: int
    manifest_length: int
    manifest_digest: bytes
    snapshot_root: bytes
    created_ns: int
    logical_bytes: int
    written_bytes: int
    kind: int = KIND_SNAPSHOT


def encode_commit(c: Commit) -> bytes:
    return _COMMIT.pack(c.iteration, c.manifest_seq, c.manifest_offset, c.manifest_length,
                        c.manifest_digest, c.snapshot_root, c.created_ns, c.logical_bytes,
                        c.written_bytes, c.kind, bytes(7))


def decode_commit(buf: bytes | memoryview) -> Commit:
    if len(buf) != COMMIT_SIZE:
        raise FormatError(f"commit payload is {len(buf)} bytes, expected {COMMIT_SIZE}")
    (it, seq, off, length, digest, root, created, logical, written, kind,
     reserved) = _COMMIT.unpack(bytes(buf))
    if it >= 1 << 63:
        raise FormatError(f"commit iteration {it} out of range")
    if kind not in KINDS:
        raise FormatError(f"commit kind {kind} is not known")
    if reserved != bytes(7):
        raise FormatError("commit reserved bytes are not zero")
    return Commit(it, seq, off, length, digest, root, created, logical, written, kind)
