"""The persistent index: the same content as MemoryIndex, kept in LMDB by the writer (readers
open it read-only: storage/reader_index.py).

Layout (format "2"; named databases, all keys and values little-endian structs unless noted; every
value except ``format`` and ``store_id`` ends with its 8-byte seal, :func:`~.index.seal`)::

    meta     b"format" -> b"2"; b"store_id" -> 16 bytes; b"position" -> u64 seq, u64 offset;
             b"last_commit" -> packed CommitEntry; b"segments" -> u64 array of segment seqs;
             b"commits" -> u64 number of entries in ``commits``
    chunks   address (16) -> u64 seq, u64 offset, u64 length, u8 codec
    trees    root (16)    -> u64 seq, u64 offset, u64 length
    commits  iteration (u64 big-endian, so keys sort numerically) -> packed CommitEntry

The index is a cache: it is validated against the log on every writer open (and reader open) and
rebuilt from the log by the writer when missing, unreadable, foreign or stale; every value read
is checked against its seal and every commit-list pass against the count, so a damaged index is
detected and rebuilt (writer) or bypassed (reader), never trusted. Writes use ``sync=True`` so a
committed index transaction survives power loss; even so nothing depends on it for correctness.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import lmdb

from ..errors import FormatError, IndexUnusable, StoreIOError
from .fileops import FileOps, wrap_os_error
from .reader_index import revoke_readers
from .index import (COMMIT_COUNT, INDEX_FORMAT, ChunkRef, CommitEntry, Index, IndexBatch,
                    Position, check_commit_entry, commit_count, commit_key, pack_chunk,
                    pack_commit, pack_loc, seal, sealed_commit_kinds, unpack_chunk, unpack_commit,
                    unpack_loc, unseal)
from .lmdb_pages import check_data_file
from .segments import Loc

_INITIAL_MAP = 64 << 20
_BE64 = struct.Struct(">Q")
_POS = struct.Struct("<QQ")


__all__ = ["INDEX_FORMAT", "IndexUnusable", "LmdbIndex"]  # IndexUnusable lives in errors.py; kept importable here


#: LMDB failures that say the disk or its permissions, not the index, are at fault: rebuilding
#: the index would not help, so they surface as StoreIOError / DiskFullError.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
_STRERROR = {os.strerror(n): n for n in errno.errorcode}


def lmdb_errno(e: lmdb.Error) -> int | None:
    """The OS errno behind an lmdb error, when it has one (py-lmdb keeps only the message)."""
    if isinstance(e, lmdb.DiskError):
        return errno.ENOSPC
    if isinstance(e, lmdb.ReadonlyError):
        return errno.EACCES
    text = str(e)
    for msg, n in _STRERROR.items():
        if text.endswith(msg):
            return n
    return None


def wrap_lmdb_error(operation: str, path: str, e: lmdb.Error) -> StoreIOError:
    """A typed I/O error for a failed LMDB call, naming the operation and the index directory."""
    n = lmdb_errno(e)
    return wrap_os_error(operation, path, OSError(n if n is not None else errno.EIO, str(e)))


class LmdbIndex(Index):
    def __init__(self, path: str, store_id: bytes, ops: FileOps | None = None) -> None:
        self.path = path
        self.store_id = store_id
        self.ops = ops or FileOps()
        self._cache_sorted: list[int] | None = None
        self.env: Any = None
        self.ops.makedirs(path)
        revoke_readers(path)  # a reader of this process holding these files would make LMDB refuse
        try:
            data = os.path.join(path, "data.mdb")
            if _file_size(data):
                check_data_file(data)  # never hand LMDB pages that lead outside the file
            map_size = max(_INITIAL_MAP, _file_size(data) * 2)
            self.env = self.ops.index_open(path, map_size=map_size, max_dbs=8, subdir=True,
                                           sync=True, metasync=True, readahead=False, lock=True)
            self._check_size()  # before anything reads a page past the meta pages
            self._meta = self.env.open_db(b"meta")
            self._chunks = self.env.open_db(b"chunks")
            self._trees = self.env.open_db(b"trees")
            self._commits = self.env.open_db(b"commits")
            with self.env.begin() as txn:
                fmt = txn.get(b"format", db=self._meta)
                sid = txn.get(b"store_id", db=self._meta)
            if fmt is None and sid is None:
                self._init_meta()
            elif fmt != INDEX_FORMAT or sid != store_id:
                raise IndexUnusable(f"index at {path} belongs to another store or format")
        except lmdb.Error as e:
            self._close_quietly()  # one environment per path per process: never leak one
            if lmdb_errno(e) in _ENVIRONMENT_ERRNOS:
                raise wrap_lmdb_error("open index", path, e) from e
            raise IndexUnusable(f"index at {path} cannot be opened: {e}") from e
        except BaseException:
            self._close_quietly()
            raise

    def _check_size(self) -> None:
        """A data.mdb shorter than the pages its meta page names (a truncated copy, a cut file)
        would fault (SIGBUS) on the first read of a missing page: refuse it instead."""
        info, psize = self.env.info(), self.env.stat()["psize"]
        need = (info["last_pgno"] + 1) * psize
        have = _file_size(os.path.join(self.path, "data.mdb"))
        if have < need:
            raise IndexUnusable(f"index at {self.path} is truncated: data.mdb holds {have} bytes, "
                                f"its pages need {need}")

    def _close_quietly(self) -> None:
        env = getattr(self, "env", None)
        if env is not None:
            env.close()

    def _write(self, fill: Callable[[Any], None]) -> None:
        """Run ``fill(txn)`` in one write transaction, committed through the FileOps seam; grow
        the map (doubling) while it is full. On failure nothing of the transaction is applied:
        a disk or permission failure becomes StoreIOError/DiskFullError naming the index (a
        rebuild would not help), any other LMDB failure IndexUnusable (the caller rebuilds)."""
        while True:
            try:
                txn = self.env.begin(write=True)
                try:
                    fill(txn)
                except BaseException:
                    txn.abort()
                    raise
                self.ops.index_commit(txn, self.path)
                return
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
            except lmdb.Error as e:
                if lmdb_errno(e) in _ENVIRONMENT_ERRNOS:
                    raise wrap_lmdb_error("index write", self.path, e) from e
                raise IndexUnusable(f"index write failed at {self.path}: {e}") from e

    @staticmethod
    def destroy(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def _init_meta(self) -> None:
        def put(txn: Any) -> None:
            txn.put(b"format", INDEX_FORMAT, db=self._meta)
            txn.put(b"store_id", self.store_id, db=self._meta)

        self._write(put)

    def _get(self, key: bytes, db: Any, name: bytes) -> bytes | None:
        """The value under ``key``, its seal checked (IndexUnusable when it fails)."""
        try:
            with self.env.begin(buffers=False) as txn:
                stored = txn.get(key, db=db)
        except lmdb.Error as e:
            raise IndexUnusable(f"index read failed: {e}") from e
        return unseal(name, key, stored)

    def get_chunk(self, address: bytes) -> ChunkRef | None:
        v = self._get(address, self._chunks, b"chunks")
        return None if v is None else unpack_chunk(v)

    def get_tree(self, root: bytes) -> Loc | None:
        v = self._get(root, self._trees, b"trees")
        return None if v is None else unpack_loc(v)

    def get_commit(self, iteration: int) -> CommitEntry | None:
        if not 0 <= iteration < 1 << 63:
            return None
        key = commit_key(iteration)
        v = self._get(key, self._commits, b"commits")
        if v is None:
            return None
        check_commit_entry(key, v)
        return unpack_commit(v)

    def iterations(self) -> list[int]:
        if self._cache_sorted is None:
            self._cache_sorted = [it for it, _ in self.kinds()]
        return list(self._cache_sorted)

    def latest(self) -> int | None:
        if self._cache_sorted is None:
            self.iterations()
        assert self._cache_sorted is not None
        return self._cache_sorted[-1] if self._cache_sorted else None

    def kinds(self) -> Iterable[tuple[int, int]]:
        """One cursor pass over the commits: every entry's seal, key and kind checked, and their
        number against the recorded count (a lost entry is detected too)."""
        try:
            with self.env.begin() as txn:
                out = sealed_commit_kinds(txn.cursor(db=self._commits).iternext(keys=True, values=True))
                count = commit_count(lambda k: txn.get(k, db=self._meta))
        except lmdb.Error as e:
            raise IndexUnusable(f"index read failed at {self.path}: {e}") from e
        if len(out) != count:
            raise IndexUnusable(f"index at {self.path} holds {len(out)} commit entries, its count "
                                f"says {count}")
        self._cache_sorted = [it for it, _ in out]  # the same pass answers iterations()/latest()
        return out

    def verify_complete(self) -> None:
        self.kinds()

    def position(self) -> Position | None:
        v = self._get(b"position", self._meta, b"meta")
        if v is None:
            return None
        if len(v) != _POS.size:
            raise IndexUnusable(f"index at {self.path}: position value of {len(v)} bytes")
        return Position(*_POS.unpack(v))

    def last_commit(self) -> CommitEntry | None:
        v = self._get(b"last_commit", self._meta, b"meta")
        return None if v is None else unpack_commit(v)

    def segments(self) -> tuple[int, ...] | None:
        v = self._get(b"segments", self._meta, b"meta")
        if v is None:
            return None
        if len(v) % 8:
            raise IndexUnusable(f"index at {self.path}: segments value of {len(v)} bytes")
        return tuple(struct.unpack(f"<{len(v) // 8}Q", v))

    def apply(self, batch: IndexBatch) -> None:
        self._write(lambda txn: self._put_batch(txn, batch))
        self._note_commits(batch.commits)
        if self._cache_sorted is not None:
            for e in batch.commits:
                it = e.commit.iteration
                if not self._cache_sorted or it > self._cache_sorted[-1]:
                    self._cache_sorted.append(it)
                elif it not in self._cache_sorted:
                    self._cache_sorted = None
                    break

    def _put_batch(self, txn: Any, batch: IndexBatch) -> None:
        def put(db: Any, name: bytes, key: bytes, value: bytes) -> None:
            txn.put(key, seal(name, key, value), db=db)

        for addr, ref in batch.chunks.items():
            put(self._chunks, b"chunks", addr, pack_chunk(ref))
        for root, loc in batch.trees.items():
            put(self._trees, b"trees", root, pack_loc(loc))
        if batch.commits:
            count = commit_count(lambda k: txn.get(k, db=self._meta))
            for e in batch.commits:
                key = commit_key(e.commit.iteration)
                count += txn.get(key, db=self._commits) is None
                put(self._commits, b"commits", key, pack_commit(e))
            put(self._meta, b"meta", b"last_commit", pack_commit(batch.commits[-1]))
            put(self._meta, b"meta", b"commits", COMMIT_COUNT.pack(count))
        if batch.position is not None:
            put(self._meta, b"meta", b"position", _POS.pack(batch.position.seq, batch.position.offset))
        if batch.segments is not None:
            put(self._meta, b"meta", b"segments",
                struct.pack(f"<{len(batch.segments)}Q", *batch.segments))

    def clear(self) -> None:
        def drop(txn: Any) -> None:
            for db in (self._chunks, self._trees, self._commits, self._meta):
                txn.drop(db, delete=False)

        self._write(drop)
        self._init_meta()
        self._cache_sorted = None
        self._chains = None

    def close(self) -> None:
        self.env.close()

    def lmdb_source(self) -> tuple[Any, Any] | None:
        return (self.env, self._meta) if self.env is not None else None


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


@dataclass
class IndexContents:
    """Every entry of a persistent index that passes its checks, and how many did not."""

    store_id: bytes
    commits: dict[int, CommitEntry] = field(default_factory=dict)
    chunks: dict[bytes, ChunkRef] = field(default_factory=dict)
    trees: dict[bytes, Loc] = field(default_factory=dict)
    #: entries whose seal, key or value fails its check (a damaged index)
    damaged: int = 0
    #: the number of commit entries the writer recorded (differs from len(commits) + the damaged
    #: ones when entries were lost)
    recorded_commits: int = 0


def read_index_unlocked(path: str) -> IndexContents | None:
    """The entries of the index at ``path``, read without LMDB's lock file and without writing
    anything; None when it is unreadable, of another index format or has no store id. An entry
    that fails its checks is counted in ``damaged`` (no evidence of anything else). Safe only
    while no writer runs: the caller holds :func:`ckptstore.storage.lock.no_writer` (fsck)."""
    try:
        env = lmdb.open(path, readonly=True, lock=False, max_dbs=8, subdir=True)
        try:
            dbs = {name: env.open_db(name, create=False)
                   for name in (b"meta", b"commits", b"chunks", b"trees")}
            with env.begin() as txn:
                meta = lambda k: txn.get(k, db=dbs[b"meta"])  # noqa: E731
                store_id = meta(b"store_id")
                if meta(b"format") != INDEX_FORMAT or store_id is None:
                    return None
                out = IndexContents(store_id)
                try:
                    out.recorded_commits = commit_count(meta)
                except IndexUnusable:
                    out.damaged += 1
                decoders: dict[bytes, Callable[[bytes, bytes], None]] = {
                    b"commits": lambda k, v: out.commits.__setitem__(
                        _BE64.unpack(k)[0], _checked_commit(k, v)),
                    b"chunks": lambda k, v: out.chunks.__setitem__(bytes(k), unpack_chunk(v)),
                    b"trees": lambda k, v: out.trees.__setitem__(bytes(k), unpack_loc(v)),
                }
                for name, decode in decoders.items():
                    for k, stored in txn.cursor(db=dbs[name]):
                        try:
                            v = unseal(name, k, stored)
                            assert v is not None
                            decode(k, v)
                        except (IndexUnusable, FormatError, struct.error):
                            out.damaged += 1
            return out
        finally:
            env.close()
    except lmdb.Error:
        return None


def _checked_commit(key: bytes, value: bytes) -> CommitEntry:
    check_commit_entry(key, value)
    return unpack_commit(value)
