"""Records of a multi-rank job store's global log (format-spec/format.md §22). Pure codecs.

A job store (STORE ``format_version`` 2) keeps one *rank stream* per (epoch, rank) -- each a
complete v1 store -- and one *global log* per epoch, ``global/EEEEEEEEEE.log``: a sequence of
records (the framing of :mod:`ckptstore.format.records`, no segment header) whose first record is
an EPOCH record and whose others are GLOBAL_COMMIT records.

EPOCH payload, 64 bytes, little-endian::

    0   8   epoch           u64, >= 1, equals the number in the file name
    8   4   world_size      u32, >= 1: ranks of the job that claimed this epoch
    12  4   reserved        0
    16  16  store_id        equals STORE's
    32  8   adopted_epoch   u64, < epoch: the epoch whose commits this one continues (0: none)
    40  8   adopted_end     u64: byte offset in that epoch's log; its GLOBAL_COMMIT records ending
                            at or before it are adopted, later ones are not (0 when adopted_epoch=0)
    48  8   created_ns      u64 (informational)
    56  8   reserved        0

GLOBAL_COMMIT payload, 40 + 112 x world_size bytes::

    0   8   iteration       u64, < 2**63
    8   8   epoch           u64, equals the log's epoch
    16  4   world_size      u32, equals the epoch's
    20  1   kind            0 snapshot, 1 delta (as in a COMMIT)
    21  3   reserved        0
    24  8   created_ns      u64 (informational)
    32  8   reserved        0
    40  ... one 112-byte entry per rank, in rank order:
        0   8   commit_seq      segment of the rank's local COMMIT record in its stream
        8   8   commit_offset   offset of that record
        16  96  commit          that COMMIT record's payload, byte for byte (format/commit.py)

Invariant: a GLOBAL_COMMIT names, for every rank, a local COMMIT of the same iteration and kind;
decoding refuses anything else, so a decoded record can be checked against each stream by a
byte comparison of the local COMMIT payload.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from ..errors import FormatError
from .commit import COMMIT_SIZE, KINDS, Commit, decode_commit, encode_commit

#: STORE ``format_version`` of a multi-rank job store.
JOB_FORMAT_VERSION = 2
#: Largest world size a global commit may name (bounds what a decoder allocates).
MAX_WORLD_SIZE = 1 << 16


class JobRecordType(enum.IntEnum):
    """Record types of a global log. They never appear in a segment (there they are damage)."""

    EPOCH = 18
    GLOBAL_COMMIT = 19


JOB_TYPES = frozenset(int(t) for t in JobRecordType)

_EPOCH = struct.Struct("<QII16sQQQQ")
EPOCH_SIZE = _EPOCH.size
_GHEAD = struct.Struct("<QQIB3sQQ")
GLOBAL_HEAD_SIZE = _GHEAD.size
_RANK = struct.Struct("<QQ")
RANK_ENTRY_SIZE = _RANK.size + COMMIT_SIZE


@dataclass(frozen=True)
class Epoch:
    """The claim of one job (one open of a job store for writing) on the store."""

    epoch: int
    world_size: int
    store_id: bytes
    adopted_epoch: int = 0
    adopted_end: int = 0
    created_ns: int = 0


@dataclass(frozen=True)
class RankCommit:
    """One rank's part of a global commit: where its local COMMIT is, and what it says."""

    commit_seq: int
    commit_offset: int
    commit: Commit


@dataclass(frozen=True)
class GlobalCommit:
    iteration: int
    epoch: int
    kind: int
    ranks: tuple[RankCommit, ...]
    created_ns: int = 0

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def encode_epoch(e: Epoch) -> bytes:
    return _EPOCH.pack(e.epoch, e.world_size, 0, e.store_id, e.adopted_epoch, e.adopted_end,
                       e.created_ns, 0)


def decode_epoch(buf: bytes | memoryview) -> Epoch:
    if len(buf) != EPOCH_SIZE:
        raise FormatError(f"epoch payload is {len(buf)} bytes, expected {EPOCH_SIZE}")
    epoch, world, r0, store_id, adopted, end, created, r1 = _EPOCH.unpack(bytes(buf))
    if not 1 <= epoch < 1 << 63:
        raise FormatError(f"epoch {epoch} out of range")
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise FormatError(f"epoch world size {world} out of range")
    if r0 or r1:
        raise FormatError("epoch reserved fields are not zero")
    if adopted >= epoch or (adopted == 0 and end != 0):
        raise FormatError(f"epoch {epoch} adopts epoch {adopted} at {end}: not an earlier epoch")
    return Epoch(epoch, world, store_id, adopted, end, created)


def encode_global_commit(g: GlobalCommit) -> bytes:
    parts = [_GHEAD.pack(g.iteration, g.epoch, len(g.ranks), g.kind, bytes(3), g.created_ns, 0)]
    for r in g.ranks:
        parts.append(_RANK.pack(r.commit_seq, r.commit_offset))
        parts.append(encode_commit(r.commit))
    return b"".join(parts)


def decode_global_commit(buf: bytes | memoryview) -> GlobalCommit:
    data = bytes(buf)
    if len(data) < GLOBAL_HEAD_SIZE:
        raise FormatError(f"global commit payload is {len(data)} bytes, too short")
    iteration, epoch, world, kind, r0, created, r1 = _GHEAD.unpack_from(data)
    if iteration >= 1 << 63:
        raise FormatError(f"global commit iteration {iteration} out of range")
    if not 1 <= epoch < 1 << 63:
        raise FormatError(f"global commit epoch {epoch} out of range")
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise FormatError(f"global commit world size {world} out of range")
    if kind not in KINDS:
        raise FormatError(f"global commit kind {kind} is not known")
    if r0 != bytes(3) or r1:
        raise FormatError("global commit reserved fields are not zero")
    if len(data) != GLOBAL_HEAD_SIZE + world * RANK_ENTRY_SIZE:
        raise FormatError(f"global commit payload is {len(data)} bytes, expected "
                          f"{GLOBAL_HEAD_SIZE + world * RANK_ENTRY_SIZE} for {world} ranks")
    ranks = []
    for r in range(world):
        at = GLOBAL_HEAD_SIZE + r * RANK_ENTRY_SIZE
        seq, off = _RANK.unpack_from(data, at)
        commit = decode_commit(data[at + _RANK.size:at + RANK_ENTRY_SIZE])
        if commit.iteration != iteration or commit.kind != kind:
            raise FormatError(f"global commit of iteration {iteration} names rank {r}'s commit "
                              f"of iteration {commit.iteration} (kind {commit.kind})")
        ranks.append(RankCommit(seq, off, commit))
    return GlobalCommit(iteration, epoch, kind, tuple(ranks), created)
