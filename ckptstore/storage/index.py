"""The index: chunk address -> location, tree root -> location, iteration -> commit.

The index is a cache of what the log says. :class:`~ckptstore.storage.lmdb_index.LmdbIndex`
persists it for the writer so reopening does not rescan; a reader uses it read-only through
:class:`~ckptstore.storage.reader_index.ReaderIndex` when it validates, else builds a
:class:`MemoryIndex` by scanning the log (nothing is written either way). Both are filled only through :meth:`Index.apply`,
one batch per commit, so an index never names a chunk or tree that no commit reached.
"""

from __future__ import annotations

import bisect
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import xxhash

from ..errors import FormatError, IndexUnusable
from ..format.commit import COMMIT_SIZE, KIND_DELTA, KIND_SNAPSHOT, KINDS as _KINDS, Commit, decode_commit, encode_commit
from ..format.chunk import Codec
from ..format.records import MAX_PAYLOAD
from .segments import Loc


@dataclass(frozen=True)
class ChunkRef:
    """Location of a chunk record and the codec of its data (raw chunks are read in place)."""

    loc: Loc
    codec: int


@dataclass(frozen=True)
class CommitEntry:
    commit: Commit
    loc: Loc  # the commit record itself


@dataclass(frozen=True)
class Position:
    """A point in the log: every record before (seq, offset) has been indexed or judged."""

    seq: int
    offset: int


@dataclass
class IndexBatch:
    chunks: dict[bytes, ChunkRef] = field(default_factory=dict)
    trees: dict[bytes, Loc] = field(default_factory=dict)
    commits: list[CommitEntry] = field(default_factory=list)
    position: Position | None = None
    #: Sequence numbers of segments wholly before ``position`` plus its own (for staleness checks).
    segments: tuple[int, ...] | None = None
    #: (address, location) of chunk records that a later record of the same chunk in this batch
    #: replaced, in log order (kept by MemoryIndex as fallbacks, see chunk_alternatives)
    superseded: list[tuple[bytes, ChunkRef]] = field(default_factory=list)


_LOC = struct.Struct("<QQQ")
_CHUNK = struct.Struct("<QQQB")


def pack_loc(loc: Loc) -> bytes:
    return _LOC.pack(loc.seq, loc.offset, loc.length)


#: Size of a packed commit entry: the COMMIT record's location, then its payload.
PACKED_COMMIT_SIZE = _LOC.size + COMMIT_SIZE
#: Offset of the commit's ``kind`` byte inside a packed commit entry (format/commit.py).
PACKED_KIND_OFFSET = _LOC.size + 88
_SEQ_MAX = 10**10  # segment names have ten digits (storage/layout.py)
_CODECS = frozenset(int(c) for c in Codec)


def _bad_value(what: str, buf: bytes, why: str) -> IndexUnusable:
    return IndexUnusable(f"index {what} value of {len(buf)} bytes is invalid: {why}")


def _check_loc(what: str, buf: bytes, seq: int, length: int) -> None:
    if not 0 < seq < _SEQ_MAX:
        raise _bad_value(what, buf, f"segment {seq} out of range")
    if length > MAX_PAYLOAD:  # also bounds what a read at this location allocates
        raise _bad_value(what, buf, f"record length {length} out of range")


def unpack_loc(buf: bytes) -> Loc:
    """Decode an index location value; raises IndexUnusable when it is malformed (the index is a
    cache: its values are checked, never trusted)."""
    if len(buf) != _LOC.size:
        raise _bad_value("location", buf, f"expected {_LOC.size} bytes")
    seq, off, length = _LOC.unpack(buf)
    _check_loc("location", buf, seq, length)
    return Loc(seq, off, length)


def pack_chunk(ref: ChunkRef) -> bytes:
    return _CHUNK.pack(ref.loc.seq, ref.loc.offset, ref.loc.length, ref.codec)


def unpack_chunk(buf: bytes) -> ChunkRef:
    """Decode an index chunk value; raises IndexUnusable when it is malformed."""
    if len(buf) != _CHUNK.size:
        raise _bad_value("chunk", buf, f"expected {_CHUNK.size} bytes")
    seq, off, length, codec = _CHUNK.unpack(buf)
    _check_loc("chunk", buf, seq, length)
    if codec not in _CODECS:
        raise _bad_value("chunk", buf, f"unknown codec {codec}")
    return ChunkRef(Loc(seq, off, length), codec)


def pack_commit(e: CommitEntry) -> bytes:
    return pack_loc(e.loc) + encode_commit(e.commit)


def unpack_commit(buf: bytes) -> CommitEntry:
    """Decode a packed commit entry; raises IndexUnusable when it is malformed."""
    if len(buf) != PACKED_COMMIT_SIZE:
        raise _bad_value("commit", buf, f"expected {PACKED_COMMIT_SIZE} bytes")
    try:
        c = decode_commit(buf[_LOC.size:])
    except FormatError as e:
        raise _bad_value("commit", buf, e.reason) from None
    loc = unpack_loc(buf[:_LOC.size])
    if loc.length != COMMIT_SIZE or not 0 < c.manifest_seq < _SEQ_MAX:
        raise _bad_value("commit", buf, "location out of range")
    return CommitEntry(c, loc)


#: The persistent index's format (format-spec/format.md §16): "2" seals every value.
INDEX_FORMAT = b"2"
#: Every value the persistent index stores ends with ``xxh3_64(db name, key, value)`` (8 bytes,
#: little-endian), so a damaged key or value (a flipped bit anywhere in it) is detected when it is
#: read, and a value moved under another key or database does not verify either.
SEAL_SIZE = 8
_SEAL = struct.Struct("<Q")


_LEN = struct.Struct("<I")


def _seal_of(db: bytes, key: bytes, value: bytes) -> bytes:
    return _SEAL.pack(xxhash.xxh3_64_intdigest(
        b"".join((_LEN.pack(len(db)), db, _LEN.pack(len(key)), key, value))))


def seal(db: bytes, key: bytes, value: bytes) -> bytes:
    """``value`` with its seal appended (what the persistent index stores under ``key``)."""
    return value + _seal_of(db, key, value)


def unseal(db: bytes, key: bytes, stored: bytes | None) -> bytes | None:
    """The value stored under ``key`` in ``db``, its seal checked; None when absent. Raises
    IndexUnusable when the seal does not match (the index is a cache: it is rebuilt or bypassed,
    never trusted)."""
    if stored is None:
        return None
    value = bytes(stored[:-SEAL_SIZE])
    if len(stored) < SEAL_SIZE or _seal_of(db, key, value) != bytes(stored[-SEAL_SIZE:]):
        raise IndexUnusable(f"index {db.decode()} entry {bytes(key)[:16].hex()} fails its check "
                            "(the index is damaged)")
    return value


def commit_key(iteration: int) -> bytes:
    """The key of an iteration's commit entry (big-endian, so keys sort numerically)."""
    return _BE64.pack(iteration)


def check_commit_entry(key: bytes, value: bytes) -> int:
    """Check an unsealed packed commit entry against its key; returns its commit kind. Raises
    IndexUnusable when the key is malformed, the value has the wrong size or kind, or names
    another iteration than its key."""
    if len(key) != 8 or len(value) != PACKED_COMMIT_SIZE or value[PACKED_KIND_OFFSET] not in _KINDS:
        raise IndexUnusable(f"index commit entry {bytes(key).hex()} is malformed")
    if int.from_bytes(value[_LOC.size:_LOC.size + 8], "little") != int.from_bytes(key, "big"):
        raise IndexUnusable(f"index commit entry {bytes(key).hex()} names another iteration")
    return value[PACKED_KIND_OFFSET]


_BE64 = struct.Struct(">Q")


#: The meta value that counts the commit entries (so a lost entry is detected too).
COMMIT_COUNT = struct.Struct("<Q")


def commit_count(get_meta: Callable[[bytes], bytes | None]) -> int:
    """The recorded number of commit entries, read with ``get_meta(key)`` (raw, sealed values of
    the meta database); 0 when none was recorded (an empty index)."""
    value = unseal(b"meta", b"commits", get_meta(b"commits"))
    if value is None:
        return 0
    if len(value) != COMMIT_COUNT.size:
        raise IndexUnusable(f"index commit count value of {len(value)} bytes")
    return COMMIT_COUNT.unpack(value)[0]


def sealed_commit_kinds(items: Iterable[tuple[bytes, bytes]]) -> list[tuple[int, int]]:
    """(iteration, kind) of every sealed commit entry, each checked (IndexUnusable otherwise)."""
    out: list[tuple[int, int]] = []
    for k, stored in items:
        v = unseal(b"commits", k, stored)
        assert v is not None
        out.append((_BE64.unpack(k)[0], check_commit_entry(k, v)))
    return out


class Chains:
    """Which committed iterations are recoverable, kept up to date as commits are applied.

    The chain rule (format-spec/deltas.md): a snapshot is recoverable; a delta is recoverable iff
    the iteration right before it is committed and recoverable. So a recoverable delta's base is the
    nearest snapshot at or before it. Commits normally arrive in increasing iteration order, which
    costs O(1) each; anything else marks the summary stale and it is recomputed on next use.
    """

    def __init__(self, kinds: Iterable[tuple[int, int]]) -> None:
        self.recoverable: list[int] = []
        self.snapshots: list[int] = []
        self.last: int | None = None
        self.last_kind: int | None = None
        self._last_ok = False
        for it, kind in kinds:
            self.add(it, kind)

    def add(self, it: int, kind: int) -> bool:
        """Record the commit of ``it``; False when it does not extend the summary in order (the
        caller then rebuilds it), except for a repeat of the last commit (a gc copy)."""
        if self.last is not None and it <= self.last:
            return it == self.last and kind == self.last_kind
        ok = kind == KIND_SNAPSHOT or (kind == KIND_DELTA and self.last == it - 1 and self._last_ok)
        if ok:
            self.recoverable.append(it)
        if kind == KIND_SNAPSHOT:
            self.snapshots.append(it)
        self.last, self.last_kind, self._last_ok = it, kind, ok
        return True

    def latest(self) -> int | None:
        return self.recoverable[-1] if self.recoverable else None

    def base(self, it: int) -> int | None:
        """The base snapshot of recoverable ``it`` (itself for a snapshot), None if not recoverable."""
        i = bisect.bisect_left(self.recoverable, it)
        if i == len(self.recoverable) or self.recoverable[i] != it:
            return None
        return self.snapshots[bisect.bisect_right(self.snapshots, it) - 1]


class Index(ABC):
    """What the store asks of an index. Implementations are not thread-safe for writes."""

    @abstractmethod
    def get_chunk(self, address: bytes) -> ChunkRef | None: ...

    def chunk_alternatives(self, address: bytes) -> list[ChunkRef]:
        """Earlier records of chunk ``address`` that a later one replaced, newest first.

        A chunk's payload check is left for the read path (format.md §15), so the record scan
        indexed last may be damaged while an earlier copy (a gc copy's original, a rewrite after
        a failed dedup check) is intact: readers fall back to these. The writer's index keeps
        one location (default: none here)."""
        return []

    @abstractmethod
    def get_tree(self, root: bytes) -> Loc | None: ...

    @abstractmethod
    def get_commit(self, iteration: int) -> CommitEntry | None: ...

    @abstractmethod
    def iterations(self) -> list[int]: ...

    @abstractmethod
    def latest(self) -> int | None: ...

    @abstractmethod
    def position(self) -> Position | None: ...

    @abstractmethod
    def last_commit(self) -> CommitEntry | None:
        """The commit record at ``position`` (the last one applied)."""

    @abstractmethod
    def segments(self) -> tuple[int, ...] | None: ...

    @abstractmethod
    def apply(self, batch: IndexBatch) -> None:
        """Add a batch atomically (all of it or none). Later locations replace earlier ones."""

    @abstractmethod
    def clear(self) -> None: ...

    def close(self) -> None:
        pass

    def lmdb_source(self) -> tuple[Any, Any] | None:
        """(LMDB environment, its ``meta`` database) that this index reads, for a consistent
        copy of its state (the remote tier's index object, format-spec/remote.md §7); None for
        an index that has no LMDB environment (in memory) or no longer holds one."""
        return None

    def verify_complete(self) -> None:
        """Raise IndexUnusable when entries are missing that the index recorded having (a
        persistent index counts its commit entries); an in-memory index is complete."""

    # ---- recoverability (derived from the commits; in memory) --------------------------------
    _chains: Chains | None = None

    @abstractmethod
    def kinds(self) -> Iterable[tuple[int, int]]:
        """(iteration, commit kind) for every commit, ascending."""

    def chains(self) -> Chains:
        """The recoverability summary, built on first use by one pass over :meth:`kinds`."""
        if self._chains is None:
            self._chains = Chains(self.kinds())
        return self._chains

    def _note_commits(self, commits: list[CommitEntry]) -> None:
        """Keep the summary current after ``commits`` were applied (call from :meth:`apply`)."""
        if self._chains is not None:
            for e in commits:
                if not self._chains.add(e.commit.iteration, e.commit.kind):
                    self._chains = None
                    break

    def recoverable(self) -> list[int]:
        """Committed iterations that can be loaded (snapshots and deltas with an intact chain)."""
        return list(self.chains().recoverable)

    def latest_recoverable(self) -> int | None:
        return self.chains().latest()


class MemoryIndex(Index):
    """An index held in dicts; what readers build by scanning the log."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._chunks: dict[bytes, ChunkRef] = {}
        self._older_chunks: dict[bytes, list[ChunkRef]] = {}
        self._trees: dict[bytes, Loc] = {}
        self._commits: dict[int, CommitEntry] = {}
        self._sorted: list[int] = []
        self._position: Position | None = None
        self._last: CommitEntry | None = None
        self._segments: tuple[int, ...] | None = None
        self._chains = None

    def get_chunk(self, address: bytes) -> ChunkRef | None:
        return self._chunks.get(address)

    def chunk_alternatives(self, address: bytes) -> list[ChunkRef]:
        return self._older_chunks.get(address, [])[::-1]

    def get_tree(self, root: bytes) -> Loc | None:
        return self._trees.get(root)

    def get_commit(self, iteration: int) -> CommitEntry | None:
        return self._commits.get(iteration)

    def iterations(self) -> list[int]:
        return list(self._sorted)

    def latest(self) -> int | None:
        return self._sorted[-1] if self._sorted else None

    def position(self) -> Position | None:
        return self._position

    def last_commit(self) -> CommitEntry | None:
        return self._last

    def segments(self) -> tuple[int, ...] | None:
        return self._segments

    def kinds(self) -> Iterable[tuple[int, int]]:
        return [(it, self._commits[it].commit.kind) for it in self._sorted]

    def apply(self, batch: IndexBatch) -> None:
        # oldest first: what the index held, then what the batch itself replaced
        for addr in self._chunks.keys() & batch.chunks.keys():  # iterates the smaller one
            old = self._chunks[addr]
            if old != batch.chunks[addr]:
                self._older_chunks.setdefault(addr, []).append(old)
        for addr, ref in batch.superseded:
            self._older_chunks.setdefault(addr, []).append(ref)
        self._chunks.update(batch.chunks)
        self._trees.update(batch.trees)
        for e in batch.commits:
            if e.commit.iteration not in self._commits:
                bisect.insort(self._sorted, e.commit.iteration)
            self._commits[e.commit.iteration] = e
            self._last = e
        if batch.position is not None:
            self._position = batch.position
        if batch.segments is not None:
            self._segments = batch.segments
        self._note_commits(batch.commits)
