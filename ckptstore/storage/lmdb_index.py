"""The persistent index: the same content as MemoryIndex, kept in LMDB for the writer.

Layout (named databases, all keys and values little-endian structs unless noted)::

    meta     b"format" -> b"1"; b"store_id" -> 16 bytes; b"position" -> u64 seq, u64 offset;
             b"last_commit" -> packed CommitEntry; b"segments" -> u64 array of segment seqs
    chunks   address (16) -> u64 seq, u64 offset, u64 length, u8 codec
    trees    root (16)    -> u64 seq, u64 offset, u64 length
    commits  iteration (u64 big-endian, so keys sort numerically) -> packed CommitEntry

The index is a cache: it is validated against the log on every writer open and rebuilt from the
log when missing, unreadable, foreign or stale. Writes use ``sync=True`` so a committed index
transaction survives power loss; even so nothing depends on it for correctness.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
from typing import Any, Callable

import lmdb

from ..errors import CkptStoreError, StoreIOError
from .fileops import FileOps, wrap_os_error
from .index import (ChunkRef, CommitEntry, Index, IndexBatch, Position, pack_chunk, pack_commit,
                    pack_loc, unpack_chunk, unpack_commit, unpack_loc)
from .segments import Loc

INDEX_FORMAT = b"1"
_INITIAL_MAP = 64 << 20
_BE64 = struct.Struct(">Q")
_POS = struct.Struct("<QQ")


class IndexUnusable(CkptStoreError):
    """The LMDB environment cannot be opened or read; the caller deletes and rebuilds it."""


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
        self.ops.makedirs(path)
        self.env: Any = None
        try:
            self._open_env()
        except BaseException:
            if self.env is not None:  # one environment per path per process: never leak one
                self.env.close()
            raise

    def _open_env(self) -> None:
        path = self.path
        try:
            map_size = max(_INITIAL_MAP, _file_size(os.path.join(path, "data.mdb")) * 2)
            self.env = self.ops.index_open(path, map_size=map_size, max_dbs=8, subdir=True, sync=True,
                                           metasync=True, readahead=False, lock=True)
            self._meta = self.env.open_db(b"meta")
            self._chunks = self.env.open_db(b"chunks")
            self._trees = self.env.open_db(b"trees")
            self._commits = self.env.open_db(b"commits")
            with self.env.begin() as txn:
                fmt = txn.get(b"format", db=self._meta)
                sid = txn.get(b"store_id", db=self._meta)
        except lmdb.Error as e:
            if lmdb_errno(e) in _ENVIRONMENT_ERRNOS:
                raise wrap_lmdb_error("open index", path, e) from e
            raise IndexUnusable(f"index at {path} cannot be opened: {e}") from e
        if fmt is None and sid is None:
            self._init_meta()
        elif fmt != INDEX_FORMAT or sid != self.store_id:
            raise IndexUnusable(f"index at {path} belongs to another store or format")

    @staticmethod
    def destroy(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def _write(self, fill: Callable[[Any], None]) -> None:
        """Run ``fill(txn)`` in one write transaction and commit it through the FileOps seam.

        MapFullError propagates (the caller grows the map); any other LMDB failure becomes a
        StoreIOError naming the index. On failure nothing of the transaction is applied.
        """
        try:
            txn = self.env.begin(write=True)
            try:
                fill(txn)
            except BaseException:
                txn.abort()
                raise
            self.ops.index_commit(txn, self.path)
        except lmdb.MapFullError:
            raise
        except lmdb.Error as e:
            raise wrap_lmdb_error("index write", self.path, e) from e

    def _init_meta(self) -> None:
        def fill(txn: Any) -> None:
            txn.put(b"format", INDEX_FORMAT, db=self._meta)
            txn.put(b"store_id", self.store_id, db=self._meta)

        self._write(fill)

    def _get(self, key: bytes, db) -> bytes | None:
        try:
            with self.env.begin(buffers=False) as txn:
                return txn.get(key, db=db)
        except lmdb.Error as e:
            raise IndexUnusable(f"index read failed: {e}") from e

    def get_chunk(self, address: bytes) -> ChunkRef | None:
        v = self._get(address, self._chunks)
        return None if v is None else unpack_chunk(v)

    def get_tree(self, root: bytes) -> Loc | None:
        v = self._get(root, self._trees)
        return None if v is None else unpack_loc(v)

    def get_commit(self, iteration: int) -> CommitEntry | None:
        if not 0 <= iteration < 1 << 63:
            return None
        v = self._get(_BE64.pack(iteration), self._commits)
        return None if v is None else unpack_commit(v)

    def iterations(self) -> list[int]:
        if self._cache_sorted is None:
            with self.env.begin() as txn:
                cur = txn.cursor(db=self._commits)
                self._cache_sorted = [_BE64.unpack(k)[0] for k in cur.iternext(keys=True, values=False)]
        return list(self._cache_sorted)

    def latest(self) -> int | None:
        if self._cache_sorted is not None:
            return self._cache_sorted[-1] if self._cache_sorted else None
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._commits)
            return _BE64.unpack(cur.key())[0] if cur.last() else None

    def position(self) -> Position | None:
        v = self._get(b"position", self._meta)
        return None if v is None else Position(*_POS.unpack(v))

    def last_commit(self) -> CommitEntry | None:
        v = self._get(b"last_commit", self._meta)
        return None if v is None else unpack_commit(v)

    def segments(self) -> tuple[int, ...] | None:
        v = self._get(b"segments", self._meta)
        if v is None:
            return None
        return tuple(struct.unpack(f"<{len(v) // 8}Q", v))

    def apply(self, batch: IndexBatch) -> None:
        while True:
            try:
                self._apply_once(batch)
                break
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
        if self._cache_sorted is not None:
            for e in batch.commits:
                it = e.commit.iteration
                if not self._cache_sorted or it > self._cache_sorted[-1]:
                    self._cache_sorted.append(it)
                elif it not in self._cache_sorted:
                    self._cache_sorted = None
                    break

    def _apply_once(self, batch: IndexBatch) -> None:
        self._write(lambda txn: self._fill(txn, batch))

    def _fill(self, txn: Any, batch: IndexBatch) -> None:
        for addr, ref in batch.chunks.items():
            txn.put(addr, pack_chunk(ref), db=self._chunks)
        for root, loc in batch.trees.items():
            txn.put(root, pack_loc(loc), db=self._trees)
        for e in batch.commits:
            txn.put(_BE64.pack(e.commit.iteration), pack_commit(e), db=self._commits)
            txn.put(b"last_commit", pack_commit(e), db=self._meta)
        if batch.position is not None:
            txn.put(b"position", _POS.pack(batch.position.seq, batch.position.offset), db=self._meta)
        if batch.segments is not None:
            txn.put(b"segments", struct.pack(f"<{len(batch.segments)}Q", *batch.segments),
                    db=self._meta)

    def clear(self) -> None:
        self._cache_sorted = None

        def fill(txn: Any) -> None:
            for db in (self._chunks, self._trees, self._commits, self._meta):
                txn.drop(db, delete=False)
            txn.put(b"format", INDEX_FORMAT, db=self._meta)
            txn.put(b"store_id", self.store_id, db=self._meta)

        self._write(fill)

    def close(self) -> None:
        self.env.close()


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
