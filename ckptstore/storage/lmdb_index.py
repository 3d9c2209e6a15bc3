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

import os
import shutil
import struct

import lmdb

from ..errors import CkptStoreError
from .index import (ChunkRef, CommitEntry, Index, IndexBatch, Position, pack_chunk, pack_commit,
                    pack_loc, unpack_chunk, unpack_commit, unpack_loc)
from .segments import Loc

INDEX_FORMAT = b"1"
_INITIAL_MAP = 64 << 20
_BE64 = struct.Struct(">Q")
_POS = struct.Struct("<QQ")


class IndexUnusable(CkptStoreError):
    """The LMDB environment cannot be opened or read; the caller deletes and rebuilds it."""


class LmdbIndex(Index):
    def __init__(self, path: str, store_id: bytes) -> None:
        self.path = path
        self.store_id = store_id
        try:
            os.makedirs(path, exist_ok=True)
            map_size = max(_INITIAL_MAP, _file_size(os.path.join(path, "data.mdb")) * 2)
            self.env = lmdb.open(path, map_size=map_size, max_dbs=8, subdir=True, sync=True,
                                 metasync=True, readahead=False, lock=True)
            self._meta = self.env.open_db(b"meta")
            self._chunks = self.env.open_db(b"chunks")
            self._trees = self.env.open_db(b"trees")
            self._commits = self.env.open_db(b"commits")
            with self.env.begin() as txn:
                fmt = txn.get(b"format", db=self._meta)
                sid = txn.get(b"store_id", db=self._meta)
        except lmdb.Error as e:
            raise IndexUnusable(f"index at {path} cannot be opened: {e}") from e
        if fmt is None and sid is None:
            self._init_meta()
        elif fmt != INDEX_FORMAT or sid != store_id:
            raise IndexUnusable(f"index at {path} belongs to another store or format")
        self._cache_sorted: list[int] | None = None

    @staticmethod
    def destroy(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def _init_meta(self) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(b"format", INDEX_FORMAT, db=self._meta)
            txn.put(b"store_id", self.store_id, db=self._meta)

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
        with self.env.begin(write=True) as txn:
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
        with self.env.begin(write=True) as txn:
            for db in (self._chunks, self._trees, self._commits, self._meta):
                txn.drop(db, delete=False)
        self._init_meta()
        self._cache_sorted = None

    def close(self) -> None:
        self.env.close()


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
