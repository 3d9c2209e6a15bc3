"""The index: chunk address -> location, tree root -> location, iteration -> commit.

The index is a cache of what the log says. :class:`MemoryIndex` is built by every open in mode "r"
(nothing is written); :class:`~ckptstore.storage.lmdb_index.LmdbIndex` persists the same content
for the writer so reopening does not rescan. Both are filled only through :meth:`Index.apply`,
one batch per commit, so an index never names a chunk or tree that no commit reached.
"""

from __future__ import annotations

import bisect
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ..format.commit import COMMIT_SIZE, Commit, decode_commit, encode_commit
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


_LOC = struct.Struct("<QQQ")
_CHUNK = struct.Struct("<QQQB")


def pack_loc(loc: Loc) -> bytes:
    return _LOC.pack(loc.seq, loc.offset, loc.length)


def unpack_loc(buf: bytes) -> Loc:
    return Loc(*_LOC.unpack(buf))


def pack_chunk(ref: ChunkRef) -> bytes:
    return _CHUNK.pack(ref.loc.seq, ref.loc.offset, ref.loc.length, ref.codec)


def unpack_chunk(buf: bytes) -> ChunkRef:
    seq, off, length, codec = _CHUNK.unpack(buf)
    return ChunkRef(Loc(seq, off, length), codec)


def pack_commit(e: CommitEntry) -> bytes:
    return pack_loc(e.loc) + encode_commit(e.commit)


def unpack_commit(buf: bytes) -> CommitEntry:
    return CommitEntry(decode_commit(buf[_LOC.size:_LOC.size + COMMIT_SIZE]), unpack_loc(buf[:_LOC.size]))


class Index(ABC):
    """What the store asks of an index. Implementations are not thread-safe for writes."""

    @abstractmethod
    def get_chunk(self, address: bytes) -> ChunkRef | None: ...

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


class MemoryIndex(Index):
    """An index held in dicts; what readers build by scanning the log."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._chunks: dict[bytes, ChunkRef] = {}
        self._trees: dict[bytes, Loc] = {}
        self._commits: dict[int, CommitEntry] = {}
        self._sorted: list[int] = []
        self._position: Position | None = None
        self._last: CommitEntry | None = None
        self._segments: tuple[int, ...] | None = None

    def get_chunk(self, address: bytes) -> ChunkRef | None:
        return self._chunks.get(address)

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

    def apply(self, batch: IndexBatch) -> None:
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
