"""A reader's warm index: the writer's LMDB index read at one MVCC snapshot, plus what the log
holds after that snapshot's position (format-spec/format.md §16 "Readers", §18).

Invariants:

* A reader never creates, truncates or writes a file of the store. The LMDB environment is opened
  ``readonly=True, lock=True`` only when ``index/data.mdb`` and ``index/lock.mdb`` already exist
  and the filesystem is writable (LMDB's read-only mode still registers the reader in the reader
  table of ``lock.mdb``, which is what keeps a concurrent writer from reusing the snapshot's pages;
  on a read-only filesystem LMDB silently runs without locks, so a reader does not use the index
  there). Any doubt makes :meth:`IndexSnapshot.open` return None: the reader scans the log.
* The snapshot is one read transaction: its meta values (position, last commit, segments) and its
  entries describe one state the writer committed, so ``snapshot + scan after its position`` is
  what a full scan would build (§16 validation decides whether that state matches the log).
* Index values are checked on use: shapes by the ``unpack_*`` functions, every commit entry taken
  from the snapshot against the COMMIT record its location names in the log (cached), chunk and
  tree locations by the read path (record header, address, root). A mismatch raises
  IndexUnusable; the store then scans the log into memory and retries (never wrong bytes).
* py-lmdb refuses a second environment on the same files in one process. A reader therefore uses
  the index only when no other environment of this process has it open, and a writer that opens
  an index a reader of its own process holds revokes the reader's snapshot first (that reader falls
  back to a scan on its next index use).
"""

from __future__ import annotations

import bisect
import os
import struct
import threading
from typing import Any, Callable, Iterable

import lmdb

from ..errors import FormatError, IndexUnusable
from ..format.commit import decode_commit
from .index import (INDEX_FORMAT, ChunkRef, CommitEntry, Index, IndexBatch, MemoryIndex, Position,
                    check_commit_entry, commit_count, commit_key, sealed_commit_kinds,
                    unpack_chunk, unpack_commit, unpack_loc, unseal)
from .lmdb_pages import check_data_file
from .segments import Loc

_BE64 = struct.Struct(">Q")
_POS = struct.Struct("<QQ")
#: Virtual address space reserved for a reader's map (a read-only mapping beyond the end of the
#: file costs nothing; it only has to cover what the writer may grow the file to).
_READER_MAP = 1 << 40

_registry_lock = threading.Lock()
_registry: list["IndexSnapshot"] = []


def _file_keys(path: str) -> set[tuple[int, int]]:
    keys = set()
    for name in ("data.mdb", "lock.mdb"):
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:
            continue
        keys.add((st.st_dev, st.st_ino))
    return keys


def revoke_readers(path: str) -> None:
    """Close every reader snapshot of this process on the index files at ``path`` (a writer of
    this process is about to open them; LMDB allows one environment per file per process)."""
    keys = _file_keys(path)
    with _registry_lock:
        hit = [s for s in _registry if s.keys & keys]
        for s in hit:
            _registry.remove(s)
            s._shut()


class _View:
    """One read transaction and the meta values it shows."""

    def __init__(self, txn: Any, position: Position, last: CommitEntry,
                 segments: tuple[int, ...], commits: int) -> None:
        self.txn = txn
        self.position = position
        self.last = last
        self.segments = segments
        #: the number of commit entries the writer recorded with this state
        self.commits = commits


class IndexSnapshot:
    """The writer's LMDB index, opened read-only, seen through one read transaction at a time."""

    def __init__(self, path: str, env: Any, keys: set[tuple[int, int]]) -> None:
        self.path = path
        self.env = env
        self.keys = keys
        self._lock = threading.Lock()
        self.revoked = False
        self._meta = env.open_db(b"meta", create=False)
        self._chunks = env.open_db(b"chunks", create=False)
        self._trees = env.open_db(b"trees", create=False)
        self._commits = env.open_db(b"commits", create=False)
        self.view: _View | None = None

    @classmethod
    def open(cls, path: str, store_id: bytes) -> "IndexSnapshot | None":
        """The index at ``path`` with a first view, or None when it cannot be used read-only
        without creating or changing anything (missing files, a read-only filesystem, no
        permission to register as a reader, another environment of this process on it, a foreign
        or truncated or empty index, a missing position)."""
        data, lock = os.path.join(path, "data.mdb"), os.path.join(path, "lock.mdb")
        try:
            if not (os.path.isfile(data) and os.path.isfile(lock)):
                return None  # LMDB would create them
            if not os.access(lock, os.R_OK | os.W_OK) or not os.access(data, os.R_OK):
                return None
            if os.statvfs(path).f_flag & os.ST_RDONLY:
                return None  # LMDB would run without the reader table: unsafe next to a writer
            check_data_file(data)  # never hand LMDB pages that lead outside the file
            with _registry_lock:
                keys = _file_keys(path)
                env = lmdb.open(path, readonly=True, lock=True, create=False, subdir=True,
                                max_dbs=8, readahead=False, map_size=_READER_MAP)
                try:
                    _check_size(env, data)
                    snap = cls(path, env, keys)
                except BaseException:
                    env.close()
                    raise
                _registry.append(snap)
        except (lmdb.Error, OSError, IndexUnusable):
            return None
        try:
            view = snap._begin(store_id)
        except (lmdb.Error, IndexUnusable):
            view = None
        if view is None:
            snap.close()
            return None
        snap.view = view
        return snap

    def _begin(self, store_id: bytes) -> _View | None:
        """A new read transaction and its meta values; None when the index has no position yet."""
        txn = self.env.begin(buffers=False)
        try:
            _check_size(self.env, os.path.join(self.path, "data.mdb"))
            raw = lambda k: txn.get(k, db=self._meta)  # noqa: E731
            if raw(b"format") != INDEX_FORMAT or raw(b"store_id") != store_id:
                raise IndexUnusable(f"index at {self.path} belongs to another store or format")
            g = lambda k: unseal(b"meta", k, raw(k))  # noqa: E731
            pos, last, segs = g(b"position"), g(b"last_commit"), g(b"segments")
            if pos is None or last is None or segs is None:
                txn.abort()
                return None
            if len(pos) != _POS.size or len(segs) % 8:
                raise IndexUnusable(f"index at {self.path}: malformed meta values")
            return _View(txn, Position(*_POS.unpack(pos)), unpack_commit(last),
                         tuple(struct.unpack(f"<{len(segs) // 8}Q", segs)), commit_count(raw))
        except BaseException:
            txn.abort()
            raise

    def next_view(self, store_id: bytes) -> _View | None:
        """A fresh view (a second read transaction); the current one stays until :meth:`swap`."""
        with self._lock:
            if self.revoked:
                return None
            try:
                return self._begin(store_id)
            except (lmdb.Error, IndexUnusable):
                return None

    def swap(self, view: _View | None) -> None:
        """Make ``view`` current and end the old transaction (None: just end ``view``)."""
        with self._lock:
            if self.revoked:
                return
            if view is None:
                return
            old, self.view = self.view, view
            if old is not None:
                old.txn.abort()

    def drop(self, view: _View) -> None:
        with self._lock:
            if not self.revoked:
                view.txn.abort()

    def get(self, key: bytes, db: str) -> bytes | None:
        """The value under ``key`` in database ``db`` ("chunks", "trees", "commits"), its seal
        checked (IndexUnusable when it fails)."""
        with self._lock:
            if self.revoked or self.view is None:
                raise IndexUnusable(f"index snapshot at {self.path} was closed")
            try:
                stored = self.view.txn.get(key, db=getattr(self, "_" + db))
            except lmdb.Error as e:
                raise IndexUnusable(f"index read failed at {self.path}: {e}") from e
        return unseal(db.encode(), key, stored)

    def commit_items(self) -> list[tuple[bytes, bytes]]:
        """Every (key, sealed packed commit entry) of the view, in key order."""
        with self._lock:
            if self.revoked or self.view is None:
                raise IndexUnusable(f"index snapshot at {self.path} was closed")
            try:
                return list(self.view.txn.cursor(db=self._commits).iternext(keys=True, values=True))
            except lmdb.Error as e:
                raise IndexUnusable(f"index read failed at {self.path}: {e}") from e

    def _shut(self) -> None:
        with self._lock:
            if not self.revoked:
                self.revoked = True
                self.view = None
                self.env.close()  # ends the transactions too

    def close(self) -> None:
        with _registry_lock:
            if self in _registry:
                _registry.remove(self)
        self._shut()


def _check_size(env: Any, data: str) -> None:
    """Refuse a data.mdb shorter than the pages its newest meta page names (reading a page past
    the end of the mapped file would fault)."""
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    if os.path.getsize(data) < need:
        raise IndexUnusable(f"index data file {data} is shorter than its pages need ({need} bytes)")


class ReaderIndex(Index):
    """Snapshot entries below the snapshot's position, an in-memory overlay for what a scan of
    the log after it applies. Lookups try the overlay first (later locations replace earlier
    ones, as in every index)."""

    def __init__(self, snap: IndexSnapshot, store_id: bytes,
                 read_commit: Callable[[Loc], bytes | memoryview]) -> None:
        assert snap.view is not None
        self._snap = snap
        self._store_id = store_id
        self._read_commit = read_commit
        self._base = snap.view.position
        self._base_last = snap.view.last
        self._base_segments = snap.view.segments
        self._snap_commits = snap.view.commits
        self._over = MemoryIndex()
        self._its: list[int] | None = None
        self._verified: dict[int, CommitEntry] = {}
        self._chains = None
        #: snapshot commit entries checked against the log (instrumentation for tests)
        self.commits_checked = 0

    # ---- validation (format-spec §16) ---------------------------------------------------------
    def validate(self, live: list[int]) -> bool:
        """Whether the snapshot's state is a state of this log: the live segments up to its
        position are the ones it was built from, and the COMMIT record at its last commit's
        location is valid, holds that commit and ends at its position."""
        v = self._snap.view
        assert v is not None
        pos, last = v.position, v.last
        if tuple(s for s in live if s <= pos.seq) != v.segments or pos.seq not in live:
            return False
        if last.loc.seq != pos.seq or last.loc.end != pos.offset:
            return False
        try:
            return decode_commit(self._read_commit(last.loc)) == last.commit
        except (FormatError, OSError):
            return False

    def renew(self, live: list[int]) -> None:
        """Move to the writer's newest index state when it adds nothing this view lacks (its
        position lies between the snapshot's and this view's, in the same segments, and its last
        commit is one this view holds), so a reader does not pin old pages of the writer's index
        for long. Otherwise keep the current snapshot."""
        pos = self.position()
        if pos is None or pos == self._base or self._snap.revoked:
            return
        new = self._snap.next_view(self._store_id)
        if new is None:
            return
        p = new.position
        ok = (self._base.seq, self._base.offset) <= (p.seq, p.offset) <= (pos.seq, pos.offset) \
            and new.segments == tuple(s for s in live if s <= p.seq)
        if ok:
            try:
                ok = self.get_commit(new.last.commit.iteration) == new.last
            except (IndexUnusable, FormatError, OSError):
                ok = False
        if not ok:
            self._snap.drop(new)
            return
        self._snap.swap(new)
        self._base, self._base_last, self._base_segments = p, new.last, new.segments
        self._snap_commits = new.commits

    @property
    def revoked(self) -> bool:
        """The snapshot was closed under this view (a writer of this process opened the index)."""
        return self._snap.revoked

    def lmdb_source(self) -> tuple[Any, Any] | None:
        return None if self._snap.revoked else (self._snap.env, self._snap._meta)

    # ---- lookups ------------------------------------------------------------------------------
    def get_chunk(self, address: bytes) -> ChunkRef | None:
        ref = self._over.get_chunk(address)
        if ref is not None:
            return ref
        v = self._snap.get(address, "chunks")
        return None if v is None else unpack_chunk(v)

    def chunk_alternatives(self, address: bytes) -> list[ChunkRef]:
        """Earlier records of a chunk the scan after the snapshot found replaced (the snapshot,
        like the writer's index, keeps one location per chunk)."""
        return self._over.chunk_alternatives(address)

    def get_tree(self, root: bytes) -> Loc | None:
        loc = self._over.get_tree(root)
        if loc is not None:
            return loc
        v = self._snap.get(root, "trees")
        return None if v is None else unpack_loc(v)

    def get_commit(self, iteration: int) -> CommitEntry | None:
        e = self._over.get_commit(iteration)
        if e is not None:
            return e
        e = self._verified.get(iteration)
        if e is not None:
            return e
        if not 0 <= iteration < 1 << 63:
            return None
        key = commit_key(iteration)
        v = self._snap.get(key, "commits")
        if v is None:
            return None
        check_commit_entry(key, v)
        e = unpack_commit(v)
        self.commits_checked += 1
        where = f"segment {e.loc.seq} offset {e.loc.offset}"
        try:
            record = decode_commit(self._read_commit(e.loc))
        except FormatError as err:
            bad = IndexUnusable(f"index entry of iteration {iteration} names the COMMIT record at "
                                f"{where}, which is unreadable: {err}")
            bad.log_damage = f"iteration {iteration}: its COMMIT record at {where} is damaged: {err}"
            raise bad from err
        if e.commit.iteration != iteration or record != e.commit:
            raise IndexUnusable(f"index entry of iteration {iteration} does not match the COMMIT "
                                f"record at {where}")
        self._verified[iteration] = e
        return e

    def iterations(self) -> list[int]:
        if self._its is None:
            its = [it for it, _ in self.kinds()]
            self._its = its
        return list(self._its)

    def latest(self) -> int | None:
        its = self._its if self._its is not None else self.iterations()
        return its[-1] if its else None

    def kinds(self) -> Iterable[tuple[int, int]]:
        """One pass over the snapshot's commits (each entry's seal, key and kind checked, and
        their number against the count the writer recorded), then the overlay's."""
        assert self._snap.view is not None
        snapshot = sealed_commit_kinds(self._snap.commit_items())
        if len(snapshot) != self._snap_commits:
            raise IndexUnusable(f"index at {self._snap.path} holds {len(snapshot)} commit entries, "
                                f"its count says {self._snap_commits}")
        kinds = dict(snapshot)
        kinds.update(self._over.kinds())
        return sorted(kinds.items())

    def verify_complete(self) -> None:
        self.kinds()

    def position(self) -> Position | None:
        return self._over.position() or self._base

    def last_commit(self) -> CommitEntry | None:
        return self._over.last_commit() or self._base_last

    def segments(self) -> tuple[int, ...] | None:
        return self._over.segments() or self._base_segments

    # ---- updates (from a scan of the log after the snapshot) -----------------------------
    def apply(self, batch: IndexBatch) -> None:
        self._over.apply(batch)
        if self._its is not None:
            for e in batch.commits:
                it = e.commit.iteration
                if not self._its or it > self._its[-1]:
                    self._its.append(it)
                else:
                    i = bisect.bisect_left(self._its, it)
                    if i == len(self._its) or self._its[i] != it:
                        self._its.insert(i, it)
        self._note_commits(batch.commits)

    def clear(self) -> None:
        raise IndexUnusable("a reader's warm index is replaced, not cleared")

    def close(self) -> None:
        self._snap.close()
