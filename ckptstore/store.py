"""The Store: one directory of versioned checkpoints with a single writer and any number of readers.

Lifecycle of a writer (mode "a"): take the lock -> create or read STORE -> finish an interrupted gc
-> open (or rebuild) the index -> replay the log from the index's position -> cut the uncommitted
tail -> append. Readers (mode "r") never write anything under the store directory: they read the
writer's index read-only when it validates against the log and replay only the log after it, or
else build an in-memory index by replaying the whole log (format-spec/format.md §16, §18).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .errors import (CheckpointAbortedError, CkptStoreError, DamagedCheckpointError,
                     DeltaChainError, FormatError, IndexUnusable, IterationOrderError,
                     NotFoundError, ReadOnlyStoreError, StoreClosedError, StoreIOError,
                     StoreLockedError, StoreNotFoundError, UnsupportedTypeError)
from .format.header import (FORMAT_VERSION, STORE_HEADER_SIZE, StoreHeader, decode_store_header,
                            encode_store_header)
from .format.chunk import MAX_CHUNK_SIZE
from .format import records as rec
from .format.commit import KIND_DELTA, KIND_NAMES, encode_commit
from .format.manifest import Manifest
from .format.state import flatten, format_path, leaf_paths, path_name
from .engine.read_path import StateReader, read_manifest, read_tree
from .storage.fileops import FileOps, io_errors
from .storage.index import CommitEntry, Index, IndexBatch, MemoryIndex, Position
from .storage.layout import Layout
from .storage.lmdb_index import LmdbIndex
from .storage.reader_index import IndexSnapshot, ReaderIndex
from .storage.log import Log, ReplayReport
from .tensors import leaf_hook, no_leaves
from .engine.write_path import SaveStats, write_snapshot

DEFAULT_CHUNK_SIZE = 4 << 20
DEFAULT_SEGMENT_SIZE = 1 << 30
#: Scans a reader starts over when a concurrent gc deletes a segment under it.
_READER_RETRIES = 3


@dataclass(frozen=True)
class CheckpointInfo:
    """Summary of one committed checkpoint (from its commit record; no manifest read)."""

    iteration: int
    created_ns: int
    logical_bytes: int
    written_bytes: int
    snapshot_root: str
    kind: str


@dataclass(frozen=True)
class TensorDiff:
    """One tensor path compared between two checkpoints (Merkle comparison)."""

    path: str
    status: str  # "added" | "removed" | "changed" | "unchanged"
    nbytes_a: int
    nbytes_b: int
    bytes_changed: int


class Store:
    """A checkpoint store. Use :func:`ckptstore.open` to create one."""

    def __init__(self, path: str | os.PathLike, mode: str = "a", *, chunk_size: int | None = None,
                 segment_size: int | None = None, file_ops: FileOps | None = None,
                 load_threads: int = 2, host_budget: int | None = None,
                 max_inflight: int | None = None, use_index: bool = True,
                 evict_written: bool = True) -> None:
        if mode not in ("r", "a"):
            raise ValueError(f'mode must be "r" or "a", not {mode!r}')
        self.path = os.fspath(path)
        self.mode = mode
        self.layout = Layout(self.path)
        self._ops = file_ops or FileOps()
        #: writers: advise the kernel to write back and drop the pages of what was written
        #: (SegmentWriter); readers never advise
        self.evict_written = evict_written
        self._lock_fd: int | None = None
        self._closed = False
        self._mutex = threading.RLock()
        self._needs_recovery = False
        #: where a failed rollback should have cut the log (retried before pending deltas commit)
        self._rollback_to: Position | None = None
        #: pending deltas a recovery cut, not yet reported (by the next flush or save_delta)
        self._aborted: list[int] = []
        self.last_replay: ReplayReport | None = None
        # group commit of deltas (format-spec/deltas.md): appended, not yet committed
        self._pending: list[tuple[IndexBatch, int]] = []  # (batch with loc-less commit, base)
        self._pending_start: Position | None = None
        self._pending_since = 0.0
        self._load_threads = load_threads
        #: readers: start from the writer's index when it validates (False: always replay the log)
        self._use_index = use_index
        #: readers: iterations a warm view held that the replay after its fallback does not commit
        #: (their records in the log are damaged or cut): reported as damaged, not as missing
        self._index_only: set[int] = set()
        #: the writer's index was rebuilt from the log by this process, so a read that fails now
        #: fails because of the log, not the index (no second rebuild)
        self._index_rebuilt = False
        # the asynchronous pipeline (ckptstore/pipeline.py), started by the first async save
        self._pipeline: Any = None
        self._async_limits = (host_budget, max_inflight)
        # the group-commit timer (ckptstore/grouptimer.py), started by set_group_seconds
        self._timer: Any = None
        try:
            if mode == "a":
                self._open_writer(chunk_size, segment_size)
            else:
                self._open_reader()
        except BaseException:
            self._release()
            raise

    # ---- opening ------------------------------------------------------------------------------
    def _open_reader(self) -> None:
        if not os.path.exists(self.layout.store_file):
            raise StoreNotFoundError(f"no ckptstore store at {self.path} (missing {self.layout.store_file})")
        self.header = self._read_header()
        self.chunk_size = self.header.chunk_size
        self.segment_size = self.header.segment_size
        self.log = Log(self.layout, self.header.store_id)
        self.index: Index = MemoryIndex()
        self._replay_for_reader(reset=True)

    def _reader_view(self, live: list[int]) -> tuple[Index, Position | None]:
        """A new view for a reader: the writer's index read-only when it validates against the
        segments ``live`` (replay then starts at its position), else an empty MemoryIndex (full
        replay). Never creates or changes a file (format-spec §16 "Readers")."""
        snap = IndexSnapshot.open(self.layout.index_dir, self.header.store_id) \
            if self._use_index else None
        if snap is not None:
            index = ReaderIndex(snap, self.header.store_id,
                                lambda loc: self.log.read_payload(loc))
            if index.validate(live):
                return index, index.position()
            index.close()
        return MemoryIndex(), None

    def _replay_for_reader(self, reset: bool = False) -> None:
        """Catch the reader's index up with the log (``reset``: build a new view first).

        One directory listing decides both whether a gc happened (the live segments up to the
        index's position differ from those the index was built from: start over) and what is
        replayed, so a gc completing in between cannot mix two segment sets. A gc that deletes a
        segment after that listing makes the scan fail with ENOENT; the scan then starts over on
        a fresh listing (a few times: each retry needs another gc to race it). A warm view whose
        index turns out unusable is replaced by a full replay into memory."""
        for attempt in range(_READER_RETRIES):
            try:
                live = self.log.refresh_segments()
                start = self.index.position()
                if isinstance(self.index, ReaderIndex) and self.index.revoked:
                    reset = True  # try a new warm view (the writer that revoked it may be gone)
                if not reset and start is not None:
                    segs = self.index.segments()
                    reset = segs is None or tuple(s for s in live if s <= start.seq) != segs
                if reset:
                    self._index_only = set()
                    self.index.close()
                    self.index = MemoryIndex()  # never left pointing at a closed view
                    self.index, start = self._reader_view(live)
                    reset = False
                try:
                    self.last_replay = self.log.replay(self.index, start, live=live)
                except IndexUnusable:
                    self._cold_reader_index()
                    self.last_replay = self.log.replay(self.index, None, live=live)
                if isinstance(self.index, ReaderIndex):
                    self.index.renew(live)
                return
            except (FileNotFoundError, StoreIOError) as e:
                if not _caused_by_missing_file(e) or attempt == _READER_RETRIES - 1:
                    raise
                reset = True

    def _cold_reader_index(self) -> None:
        """Drop a reader's warm view for an empty MemoryIndex (the caller replays the log)."""
        self.index.close()
        self.index = MemoryIndex()

    def _reader_fallback(self) -> bool:
        """A reader's warm view failed a check: replay the whole log into memory. False when the
        reader had no warm view (the failure is not the index's)."""
        with self._mutex:
            if not isinstance(self.index, ReaderIndex):
                return False
            try:
                held = set(self.index.iterations())
            except (CkptStoreError, OSError):
                held = set()
            self._cold_reader_index()
            self._replay_for_reader()
            self._index_only = held - set(self.index.iterations())
            return True

    def _open_writer(self, chunk_size: int | None, segment_size: int | None) -> None:
        self._ops.makedirs(self.path)
        self._take_lock()
        if not os.path.exists(self.layout.store_file):
            self._create(chunk_size or DEFAULT_CHUNK_SIZE, segment_size or DEFAULT_SEGMENT_SIZE)
        self.header = self._read_header()
        self.chunk_size = chunk_size or self.header.chunk_size
        self.segment_size = segment_size or self.header.segment_size
        if not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK_SIZE}")
        self.log = Log(self.layout, self.header.store_id, self._ops, self.evict_written)
        self._finish_interrupted_gc()
        self.index = self._open_index()
        self._recover()

    def _take_lock(self) -> None:
        fd = self._ops.open_lock(self.layout.lock_file)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLockedError(
                f"{self.path} is already open for writing by another process (lock {self.layout.lock_file}); "
                'open it with mode="r" to read while that writer runs') from None
        self._lock_fd = fd

    def _create(self, chunk_size: int, segment_size: int) -> None:
        if not 0 < chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK_SIZE}")
        self._ops.makedirs(self.layout.segment_dir)
        h = StoreHeader(FORMAT_VERSION, secrets.token_bytes(16), chunk_size, segment_size, time.time_ns())
        self._ops.fsync_dir(self.layout.segment_dir)
        self._ops.write_file_atomic(self.layout.store_file, encode_store_header(h))
        self._ops.fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def _read_header(self) -> StoreHeader:
        with io_errors("read", self.layout.store_file):
            with open(self.layout.store_file, "rb") as f:
                buf = f.read(STORE_HEADER_SIZE + 1)
        try:
            return decode_store_header(buf)
        except FormatError as e:
            raise e.located(self.layout.store_file, 0) from None

    def _finish_interrupted_gc(self) -> None:
        """Delete gc temp files and segments made obsolete by a completed gc commit."""
        removed = False
        for tmp in self.layout.list_gc_temps():
            self._ops.unlink(tmp)
            removed = True
        self.log.refresh_segments()
        for seq in self.log.obsolete_segments():
            self._ops.unlink(self.layout.segment_path(seq))
            removed = True
        if removed:
            self._ops.fsync_dir(self.layout.segment_dir)
            self.log.refresh_segments()

    def _open_index(self) -> Index:
        try:
            return LmdbIndex(self.layout.index_dir, self.header.store_id, self._ops)
        except IndexUnusable:
            LmdbIndex.destroy(self.layout.index_dir)
            return LmdbIndex(self.layout.index_dir, self.header.store_id, self._ops)

    def _rebuild_index(self) -> None:
        """The index disagreed with the log (a malformed value, a location that does not hold what
        it names): rebuild it from the log (writer only). The log is not touched: uncommitted
        pending deltas stay pending and are indexed when flushed."""
        with self._mutex:
            self.index.close()
            LmdbIndex.destroy(self.layout.index_dir)
            self.index = self._open_index()
            self._index_rebuilt = True
            self.last_replay = self.log.replay(self.index, None)

    def _indexed(self, fn: Callable[[], Any]) -> Any:
        """Run an index lookup; an index that turns out unusable is rebuilt (writer) or replaced
        by a replay into memory (reader with a warm view), and the lookup retried."""
        try:
            return fn()
        except IndexUnusable as err:
            if self.mode == "a":
                self._rebuild_index()
                return fn()
            if not self._reader_fallback():
                raise
            out = fn()
            damage = getattr(err, "log_damage", None)
            if out is None and damage is not None:
                # the index names a commit whose record the log holds damaged: a replay does not
                # commit it, but the caller asked for a checkpoint that was written
                raise DamagedCheckpointError(damage) from err
            return out

    def _index_start(self) -> Position | None:
        """Where replay can start: the index's position if the index matches the log, else None
        (after clearing the index for a full rebuild)."""
        pos, last, segs = self.index.position(), self.index.last_commit(), self.index.segments()
        if pos is None:
            self.index.clear()
            return None
        live = self.log.refresh_segments()
        ok = segs is not None and tuple(s for s in live if s <= pos.seq) == segs and last is not None
        if ok:
            try:
                payload = self.log.read_payload(last.loc)
                from .format.commit import decode_commit

                ok = decode_commit(payload) == last.commit and last.loc.end == pos.offset \
                    and last.loc.seq == pos.seq
            except (FormatError, OSError):
                ok = False
        if not ok:
            self.index.clear()
            return None
        return pos

    def _recover(self) -> None:
        """Replay the log into the index and cut the uncommitted tail (writer only)."""
        self._needs_recovery = True  # stays set if anything below fails
        self._pending = []  # uncommitted deltas are cut with the tail
        try:
            start = self._index_start()
        except IndexUnusable:
            self.index.close()
            LmdbIndex.destroy(self.layout.index_dir)
            self.index = self._open_index()
            start = None
        report = self.log.replay(self.index, start)
        self.last_replay = report
        position = report.position
        if report.tail:
            self.log.discard_after(position, quarantine=report.tail_suspicious)
        self.log.open_writer(position, self.segment_size)
        self._needs_recovery = False
        self._rollback_to = None

    def _recover_if_needed(self) -> None:
        """Finish what a failed save left: re-cut to the end of the pending deltas when that is
        where the failed rollback should have cut (they survive), else recover, which cuts them
        too; those are reported by the next flush or save_delta (:meth:`_raise_aborted`)."""
        if not self._needs_recovery:
            return
        if self._pending and self._recut_pending():
            return
        lost = [b.commits[0].commit.iteration for b, _ in self._pending]
        self._recover()
        self._aborted.extend(lost)

    def _raise_aborted(self) -> None:
        """Raise CheckpointAbortedError for pending deltas a recovery cut since the last call."""
        if self._aborted:
            lost, self._aborted = self._aborted, []
            raise CheckpointAbortedError(
                f"deltas {lost} of {self.path} were appended but not committed: a failed save left "
                "the log past them in an unknown state and cutting it back failed again; recovery "
                "cut them (the latest durable iteration is unchanged)")

    def _release(self) -> None:
        log = getattr(self, "log", None)
        if log is not None:
            log.close()
        index = getattr(self, "index", None)
        if index is not None:
            index.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None

    # ---- state --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")
        if self._pipeline is not None:
            self._pipeline.check()  # a background failure not yet reported is raised here, once
        if self._timer is not None and self._timer.error is not None:
            err = self._timer.take_error()  # a failed timer commit (no pipeline), once
            if err is not None:
                raise err

    def _check_writable(self) -> None:
        self._check_open()
        if self.mode != "a":
            raise ReadOnlyStoreError(f'store {self.path} is open read-only (mode="r")')

    def close(self) -> None:
        """Wait for in-flight async saves, commit pending deltas, release the writer lock and every
        file. Idempotent. Raises a background failure not reported before (after releasing)."""
        err: BaseException | None = None
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.stop()  # before the mutex: a timer commit in progress finishes first
            err = timer.take_error()
        if self._pipeline is not None and not self._closed:
            try:
                self._pipeline.close()
            except BaseException as e:  # noqa: BLE001 - re-raised once the files are released
                err = err or e
        with self._mutex:
            if not self._closed:
                try:
                    if self._pending and err is None:
                        self._flush_locked()
                finally:
                    self._closed = True
                    self._release()
        if err is not None:
            raise err

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ckptstore.Store {self.path!r} mode={self.mode!r}>"

    # ---- writing ------------------------------------------------------------------------------
    def save(self, iteration: int, state: Any, meta: dict | None = None,
             progress: Callable[[int], None] | None = None) -> SaveStats:
        """Write ``state`` as the checkpoint of ``iteration`` and commit it durably.

        When this returns, the checkpoint survives a crash. Raises IterationOrderError unless
        ``iteration`` is greater than every committed one, UnsupportedTypeError for a state the
        format cannot hold (nothing is written then), and StoreIOError subclasses on I/O failure
        (everything committed before stays intact; the next save retries cleanly).
        """
        self._drain_async()
        with self._mutex:
            self._check_writable()
            if type(iteration) is not int or iteration < 0 or iteration >= 1 << 63:
                raise ValueError(f"iteration must be a non-negative int, not {iteration!r}")
            skeleton, leaves = flatten(state, leaf_hook)
            meta_skeleton = flatten_meta(meta)
            return self._save_flat(iteration, skeleton, meta_skeleton, leaves, progress=progress)

    def _save_flat(self, iteration: int, skeleton: Any, meta_skeleton: Any, leaves: list,
                   progress: Callable[[int], None] | None = None, extra: dict | None = None,
                   stats_field: str | None = None) -> SaveStats:
        """The body of :meth:`save` for a flattened state; the caller holds the mutex."""
        if self._pending:
            self._flush_locked()
        latest = self._indexed(lambda: self.index.latest())
        if latest is not None and iteration <= latest:
            raise IterationOrderError(
                f"iteration {iteration} is not after the latest committed iteration {latest} "
                f"in {self.path}")
        self._recover_if_needed()
        start = self.index.position()
        try:
            batch, stats = write_snapshot(self.log, self.index, iteration, skeleton, meta_skeleton,
                                          leaves, chunk_size=self.chunk_size,
                                          segment_size=self.segment_size, progress=progress,
                                          extra=extra, stats_field=stats_field)
        except BaseException:
            self._rollback(start)
            raise
        batch.segments = tuple(s for s in self.log.refresh_segments() if s <= batch.position.seq)
        try:
            self.index.apply(batch)
        except Exception:  # noqa: BLE001 - the commit is durable; only the cache missed it
            # The index's position is still before this commit, so replaying from it finds
            # the commit again. If even that fails, the next call retries the recovery.
            self._needs_recovery = True
            self._recover()
        return stats

    # ---- deltas (format-spec/deltas.md) ---------------------------------------------------------
    def save_delta(self, iteration: int, record: Any, meta: dict | None = None, *,
                   durable: bool = True) -> SaveStats:
        """Append the delta record of ``iteration`` (what turns state ``iteration - 1`` into state
        ``iteration``; see :mod:`ckptstore.replay`). The predecessor must be committed or pending
        and recoverable (a chain back to a base snapshot): otherwise DeltaChainError.

        With ``durable=False`` the delta is appended but not committed: it becomes visible and
        crash-safe at the next :meth:`flush` (group commit; one fsync pair per group), or at the
        next snapshot save or close. Until then it is not in :meth:`iterations`.
        """
        self._drain_async()
        with self._mutex:
            self._check_writable()
            if type(iteration) is not int or iteration < 1 or iteration >= 1 << 63:
                raise ValueError(f"delta iteration must be a positive int, not {iteration!r}")
            skeleton, leaves = flatten(record, leaf_hook)
            meta_skeleton = flatten_meta(meta)
            return self._save_delta_flat(iteration, skeleton, meta_skeleton, leaves, durable)

    def _save_delta_flat(self, iteration: int, skeleton: Any, meta_skeleton: Any, leaves: list,
                         durable: bool, extra: dict | None = None,
                         stats_field: str | None = None) -> SaveStats:
        """The body of :meth:`save_delta` for a flattened record; the caller holds the mutex."""
        self._recover_if_needed()
        self._raise_aborted()
        if self._pending:
            prev = self._pending[-1][0].commits[0].commit.iteration
            base = self._pending[-1][1]
        else:
            prev = self._indexed(lambda: self.index.latest())
            if prev is None:
                raise DeltaChainError(
                    f"delta for iteration {iteration} refused: {self.path} holds no base "
                    "snapshot (a delta chain must start from a snapshot)")
            base = self._chain_base(prev)
        if iteration <= prev:
            raise IterationOrderError(f"iteration {iteration} is not after the latest iteration "
                                      f"{prev} in {self.path}")
        if iteration != prev + 1:
            raise DeltaChainError(f"delta for iteration {iteration} refused: the latest iteration "
                                  f"is {prev}; a delta must follow its predecessor without a gap "
                                  "(save a base snapshot first)")
        w = self.log.writer
        start = self.index.position() if not self._pending or w is None else Position(w.seq, w.offset)
        try:
            # chunks and trees of the group's earlier deltas deduplicate too (their records
            # precede this one and are cut only together with it: write_snapshot's invariant)
            batch, stats = write_snapshot(self.log, self.index, iteration, skeleton, meta_skeleton,
                                          leaves, chunk_size=self.chunk_size,
                                          segment_size=self.segment_size, kind="delta",
                                          extra={"prev": prev, "base": base, **(extra or {})},
                                          defer_commit=True, stats_field=stats_field,
                                          pending=[b for b, _ in self._pending])
        except BaseException:
            self._rollback(start)
            raise
        new_group = not self._pending
        if new_group:
            self._pending_start = start
            self._pending_since = time.monotonic()
        self._pending.append((batch, base))
        if durable:
            self._flush_locked()
        elif new_group and self._timer is not None:
            self._timer.poke()
        return stats

    def flush(self) -> int | None:
        """Commit every pending delta: fsync their records, append their COMMIT records, fsync
        (the group's commit point). Also waits for every in-flight async save (and commits async
        deltas). Returns :meth:`durable_iteration`. Raises CheckpointAbortedError, naming them,
        when pending deltas cannot be committed because a failed save's leftovers could not be cut
        (recovery then cut the pending deltas too; what was durable stays durable)."""
        if self._pipeline is not None:
            self._pipeline.flush()
        with self._mutex:
            self._check_writable()
            self._flush_locked()
            return self._recoverable_latest()

    def pending(self) -> list[int]:
        """Deltas appended with durable=False, or saved asynchronously, and not yet committed
        (lost on a crash)."""
        its = [b.commits[0].commit.iteration for b, _ in list(self._pending)]
        if self._pipeline is not None:
            its = sorted(set(its).union(self._pipeline.pending_deltas()))
        return its

    def pending_age(self) -> float:
        """Seconds since the oldest pending delta was appended (0 when none is pending)."""
        return time.monotonic() - self._pending_since if self._pending else 0.0

    def set_group_seconds(self, seconds: float | None) -> None:
        """Bound how long a pending delta stays uncommitted: once the oldest pending delta
        (``save_delta(durable=False)``, or an async delta that does not end its group) is
        ``seconds`` old, a background timer commits the group without waiting for another save,
        flush or close; :meth:`durable_iteration` then includes it. ``None`` turns the timer off.
        With an async pipeline the commit is queued behind the submitted jobs (iteration order);
        a failure of a timer commit is raised like a background failure: by the rolled-back
        deltas' futures, then once by the next call on the store, or by flush/close. See
        :mod:`ckptstore.ops.grouptimer`. Not under the mutex: stopping joins the timer thread."""
        from .ops.grouptimer import GroupTimer

        if seconds is not None and (isinstance(seconds, bool) or
                                    not isinstance(seconds, (int, float)) or not seconds >= 0):
            raise ValueError(f"group_seconds must be a non-negative number or None, not {seconds!r}")
        self._check_writable()
        timer = self._timer
        if seconds is None:
            if timer is not None:
                self._timer = None
                timer.stop()
                err = timer.take_error()
                if err is not None:
                    raise err
        elif timer is not None:
            timer.set_seconds(float(seconds))
        else:
            self._timer = GroupTimer(self, float(seconds))

    def _flush_locked(self) -> None:
        self._recover_if_needed()
        self._raise_aborted()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        assert self.log.writer is not None
        merged = IndexBatch()
        try:
            self.log.writer.sync()  # every record of the group is durable before any commit
            cloc = None
            for batch, _ in pending:
                c = batch.commits[0].commit
                cloc = self.log.append(rec.RecordType.COMMIT, [encode_commit(c)], self.segment_size)
                merged.chunks.update(batch.chunks)
                merged.trees.update(batch.trees)
                merged.commits.append(CommitEntry(c, cloc))
            self.log.writer.sync()  # the group's commit point
        except BaseException:
            self._rollback(self._pending_start)
            raise
        assert cloc is not None
        merged.position = Position(cloc.seq, cloc.end)
        merged.segments = tuple(s for s in self.log.refresh_segments() if s <= cloc.seq)
        try:
            self.index.apply(merged)
        except Exception:  # noqa: BLE001 - durable; the index catches up by replay
            self._needs_recovery = True
            self._recover()

    def _abandon_pending(self) -> None:
        """Cut every appended, uncommitted delta (after a failure in the async pipeline); the
        caller holds the mutex."""
        if self._pending:
            self._pending = []
            self._rollback(self._pending_start)

    # ---- asynchronous saves (ckptstore/pipeline.py) ---------------------------------------------
    @property
    def pipeline(self) -> Any:
        """The snapshot-then-persist pipeline of this writer (started on first use)."""
        self._check_writable()
        if self._pipeline is not None:  # no mutex: the persister holds it while it writes
            return self._pipeline
        with self._mutex:
            if self._pipeline is None:
                from .ops.pipeline import Pipeline

                budget, inflight = self._async_limits
                self._pipeline = Pipeline(self, host_budget=budget, max_inflight=inflight)
            return self._pipeline

    def save_async(self, iteration: int, state: Any, meta: dict | None = None):
        """Snapshot ``state`` into host buffers and return a ``concurrent.futures.Future`` at once;
        hashing, compression, writing, fsync and commit run in a background thread, in iteration
        order. The future's result (an :class:`ckptstore.ops.pipeline.AsyncStats`) is set when the
        checkpoint is durable. Mutating the live tensors after this returns does not affect what
        is stored. A background failure is raised by the future, by the next call on the store
        and by flush/close; the failed checkpoint (and anything queued after it) is rolled back.
        See :mod:`ckptstore.ops.pipeline`."""
        return self.pipeline.submit("snapshot", iteration, state, meta)

    def save_delta_async(self, iteration: int, record: Any, meta: dict | None = None, *,
                         durable: bool = True):
        """:meth:`save_delta` through the pipeline: returns a future resolved once the delta is
        committed (with ``durable=False``: by a later durable save, :meth:`flush` or close)."""
        return self.pipeline.submit("delta", iteration, record, meta, commit=durable)

    def stats(self) -> list:
        """Per-checkpoint statistics of this writer's async saves (stall, snapshot, persist
        times, bytes, queue depth), oldest first (the last 10,000)."""
        return [] if self._pipeline is None else self._pipeline.stats()

    def set_async_limits(self, host_budget: int | None = None, max_inflight: int | None = None) -> None:
        """Change the host-memory budget (bytes) and/or the maximum of checkpoints in flight."""
        budget, inflight = self._async_limits
        self._async_limits = (host_budget or budget, max_inflight or inflight)
        if self._pipeline is not None:
            self._pipeline.set_limits(host_budget, max_inflight)

    def _await_inflight(self, iteration: Any) -> None:
        """Writers: a read of an iteration still in the async pipeline waits until it is
        committed (flushing its delta group). Never called with the mutex held."""
        p = self._pipeline
        if p is not None and type(iteration) is int and self.index.get_commit(iteration) is None:
            tail = p.tail()
            if tail is not None and iteration <= tail:
                p.flush()

    def _drain_async(self) -> None:
        """Before a synchronous write: wait for the pipeline (and raise its failure)."""
        if self._pipeline is not None:
            self._pipeline.drain()

    def _kind(self, iteration: int) -> int | None:
        e = self._indexed(lambda: self.index.get_commit(iteration))
        return None if e is None else e.commit.kind

    def _chain_base(self, iteration: int) -> int:
        """The base snapshot the chain ending at committed ``iteration`` starts from; raises
        DeltaChainError when the chain is broken (a predecessor is missing)."""
        base = self._indexed(lambda: self.index.chains().base(iteration))
        if base is not None:
            return base
        it = iteration  # not recoverable: find where the chain breaks, for the message
        while True:
            k = self._kind(it)
            if k is None:
                raise DeltaChainError(f"iteration {iteration} is not recoverable: the delta chain is "
                                      f"broken at iteration {it} (missing)")
            if k != KIND_DELTA:
                return it
            it -= 1

    def base_of(self, iteration: int) -> int:
        """The base snapshot iteration that ``iteration`` is reconstructed from (itself for a
        snapshot). Raises NotFoundError / DeltaChainError."""
        self._await_inflight(iteration)
        self._entry(iteration)
        return self._chain_base(iteration)

    def kind(self, iteration: int) -> str:
        """"snapshot" (a base) or "delta"."""
        self._await_inflight(iteration)
        return KIND_NAMES.get(self._entry(iteration).commit.kind, "unknown")

    def _recoverable_latest(self) -> int | None:
        """The newest recoverable iteration (the chain rule of format-spec/deltas.md), O(1) from
        the index's recoverability summary."""
        return self._indexed(lambda: self.index.latest_recoverable())

    def durable_iteration(self) -> int | None:
        """The newest iteration that survives a crash right now: committed (fsynced) and
        recoverable. Pending deltas (durable=False, not yet flushed) are not counted."""
        self._sync_view()
        return self._recoverable_latest()

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    into: Callable[[Any], Any] | None = None) -> Any:
        """The state stored for ``iteration`` as written: for a delta, its delta record (not the
        replayed state). Same as :meth:`load` for a snapshot. ``into``: see
        :meth:`ckptstore.engine.read_path.StateReader.load` (read tensors into existing ones)."""
        self._await_inflight(iteration)
        return self._read_retrying(
            lambda: self._state_reader().load(self._entry(iteration), keys, None, into))

    def _load_record_in_replay(self, iteration: int, into: Callable[[Any], Any] | None) -> Any:
        """:meth:`load_record` for :func:`ckptstore.replay.replay_to` running inside :meth:`load`,
        which holds the writer's mutex and retries the whole replay: no lock and no retry here,
        because the replay's read-ahead thread taking the mutex again would deadlock."""
        return self._state_reader().load(self._entry(iteration), None, None, into)

    def replay(self, start: int, stop: int, **options: Any):
        """Yield ``(iteration, state)`` for every iteration in ``start..stop`` (inclusive), each
        reconstructed from the nearest base at or before ``start`` plus the deltas after it.
        See :func:`ckptstore.replay.replay_range` for options and reports."""
        from .replay.replayer import replay_range

        return replay_range(self, start, stop, **options)

    def _rollback(self, start: Position | None) -> None:
        """Cut the log back to ``start`` after a failed save; on failure, recover before next save
        (or, with deltas pending before ``start``, retry the cut first: see :meth:`_recut_pending`)."""
        if not self._cut_back(start):
            self._needs_recovery = True
            self._rollback_to = start

    def _cut_back(self, start: Position | None) -> bool:
        """Cut the log after ``start`` and put the writer there; False when that failed."""
        try:
            self.log.discard_after(start, quarantine=False)
            if self.log.writer is None or (start is not None and self.log.writer.seq != start.seq):
                self.log.open_writer(start, self.segment_size)
        except (CkptStoreError, OSError):
            return False
        return True

    def _recut_pending(self) -> bool:
        """After a failed rollback with deltas pending before it: the log past them holds whatever
        the failed save left, so no COMMIT may follow it. Retry the cut back to the end of the
        pending deltas (where the failed save started); True when it worked (the pending deltas
        may commit). format-spec/deltas.md, "Group commit"."""
        if self._rollback_to is None or not self._cut_back(self._rollback_to):
            return False
        self._needs_recovery = False
        self._rollback_to = None
        return True

    # ---- reading ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Readers: pick up checkpoints committed since open (and follow a gc). Writers: no-op."""
        with self._mutex:
            self._check_open()
            if self.mode == "a":
                return
            self._replay_for_reader()

    def _sync_view(self) -> None:
        """Readers: catch up with the log. Writers: finish a recovery a failure left pending."""
        self._check_open()
        if self.mode == "r":
            self.refresh()
        else:
            with self._mutex:
                self._recover_if_needed()

    def iterations(self) -> list[int]:
        """Committed, recoverable iterations (snapshots and deltas with an intact chain), ascending."""
        self._sync_view()
        return self._indexed(lambda: self.index.recoverable())

    def latest(self) -> int | None:
        """The newest committed recoverable iteration, or None for an empty store."""
        self._sync_view()
        return self._recoverable_latest()

    def _entry(self, iteration: int) -> CommitEntry:
        self._check_open()
        e = self._indexed(lambda: self.index.get_commit(iteration)) if type(iteration) is int else None
        if e is None and self.mode == "r":
            self.refresh()
            e = self._indexed(lambda: self.index.get_commit(iteration))
        if e is None and iteration in self._index_only:
            raise DamagedCheckpointError(
                f"iteration {iteration}: the index names it committed, but the log in {self.path} "
                "holds no valid commit of it (its records are damaged or cut)")
        if e is None:
            raise NotFoundError(f"iteration {iteration!r} is not committed in {self.path}")
        return e

    def info(self, iteration: int) -> CheckpointInfo:
        self._await_inflight(iteration)
        c = self._entry(iteration).commit
        return CheckpointInfo(c.iteration, c.created_ns, c.logical_bytes, c.written_bytes,
                              c.snapshot_root.hex(), KIND_NAMES.get(c.kind, "unknown"))

    def manifest(self, iteration: int) -> Manifest:
        """The decoded, verified manifest of a committed iteration."""
        self._await_inflight(iteration)
        return self._read_retrying(lambda: read_manifest(self.log, self._entry(iteration)))

    def meta(self, iteration: int) -> Any:
        from .format.state import unflatten

        return unflatten(self.manifest(iteration).meta, lambda i, p: None)

    def load(self, iteration: int, keys: Sequence[Any] | None = None,
             progress: Callable[[int], None] | None = None) -> Any:
        """The state saved at ``iteration``, bit-exact. ``keys`` selects top-level dict keys and
        reads only their tensors. Raises NotFoundError, DamagedCheckpointError.

        A delta iteration is reconstructed: its chain's base snapshot, then every delta after it
        replayed (:mod:`ckptstore.replay`; DeltaChainError, ReplayDivergenceError).
        Writers: an iteration still in flight in the async pipeline is waited for."""
        self._await_inflight(iteration)
        if self._entry(iteration).commit.kind == KIND_DELTA:
            from .replay.replayer import replay_to

            state = self._read_retrying(lambda: replay_to(self, iteration))
            if keys is not None:
                missing = [k for k in keys if k not in state]
                if missing:
                    raise NotFoundError(f"iteration {iteration}: keys {missing} are not in the "
                                        f"state (it has {list(state)})")
                state = {k: state[k] for k in keys}
            return state
        return self._read_retrying(
            lambda: self._state_reader().load(self._entry(iteration), keys, progress))

    def _state_reader(self) -> StateReader:
        return StateReader(self.log, self.index, threads=self._load_threads)

    def _read_retrying(self, fn: Callable[[], Any]) -> Any:
        """Run a read of checkpoint data, retrying once where the failure may not be the log's.

        Readers: a gc in the writer may delete segments under us; refresh and retry. Writers: reads
        hold the mutex (the async pipeline's thread writes under it); the LMDB index is a cache
        whose values are checked on use; a read that fails on an index value (IndexUnusable) or on
        what it located (DamagedCheckpointError) rebuilds the index from the log once per process
        and retries, so only damage in the log itself reaches the caller.
        """
        if self.mode == "r":
            return self._read_retrying_reader(fn)
        with self._mutex:
            return self._read_retrying_writer(fn)

    def _read_retrying_writer(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except CkptStoreError as e:
            if isinstance(e, (IndexUnusable, DamagedCheckpointError)) and not self._index_rebuilt:
                self._rebuild_index()
            else:
                raise
            return fn()

    def _read_retrying_reader(self, fn: Callable[[], Any]) -> Any:
        """Readers: a read that fails because gc deleted a segment refreshes and retries; one that
        fails on a warm index's value, or on what it located, drops the warm view for a full
        replay into memory and retries (once), so only damage in the log reaches the caller."""
        fell_back = False
        damage: DamagedCheckpointError | None = None
        for attempt in range(_READER_RETRIES):
            try:
                return fn()
            except CkptStoreError as e:
                if isinstance(e, NotFoundError) and damage is not None:
                    # the index named a checkpoint whose records the log holds damaged (a full
                    # replay does not commit it): report the damage, not a missing iteration
                    raise damage from e
                if attempt == _READER_RETRIES - 1:
                    raise
                if _caused_by_missing_file(e):
                    self.refresh()
                elif isinstance(e, (IndexUnusable, DamagedCheckpointError)) and not fell_back:
                    fell_back = True
                    if isinstance(e, DamagedCheckpointError):
                        damage = e
                    if not self._reader_fallback():
                        raise
                else:
                    raise
        raise AssertionError("unreachable")

    def diff(self, a: int, b: int) -> list[TensorDiff]:
        """Compare the tensors of two checkpoints by Merkle roots, then chunk addresses.

        Tensors are matched by their structured path (typed keys: ``{"a/b": x}`` is not
        ``{"a": {"b": x}}``, the key ``1`` is not ``"1"``). ``TensorDiff.path`` is the usual
        ``a/b`` display, or ``state['a/b']`` where two paths of the diff would display alike."""
        ta, tb = _tensors_by_path(self.manifest(a)), _tensors_by_path(self.manifest(b))
        keys = list(ta) + [k for k in tb if k not in ta]
        names: dict[str, int] = {}
        for k in keys:
            names[_display(k, False)] = names.get(_display(k, False), 0) + 1
        out: list[TensorDiff] = []
        for key in keys:
            ea, eb = ta.get(key), tb.get(key)
            path = _display(key, names[_display(key, False)] > 1)
            if eb is None:
                out.append(TensorDiff(path, "removed", ea.nbytes, 0, 0))
            elif ea is None:
                out.append(TensorDiff(path, "added", 0, eb.nbytes, eb.nbytes))
            elif ea.root == eb.root and ea.dtype == eb.dtype and ea.shape == eb.shape:
                out.append(TensorDiff(path, "unchanged", ea.nbytes, eb.nbytes, 0))
            else:
                out.append(TensorDiff(path, "changed", ea.nbytes, eb.nbytes, self._changed_bytes(ea, eb)))
        return out

    def _changed_bytes(self, ea: Any, eb: Any) -> int:
        if ea.inline is not None or eb.inline is not None or ea.nbytes != eb.nbytes:
            return eb.nbytes
        try:
            tree_a, tree_b = read_tree(self.log, self.index, ea), read_tree(self.log, self.index, eb)
        except (FormatError, OSError):
            return eb.nbytes
        if tree_a.chunk_size != tree_b.chunk_size:
            return eb.nbytes
        return sum(e - s for (s, e, addr), a in zip(tree_b.chunk_spans(), tree_a.addresses) if addr != a)

    # ---- maintenance ------------------------------------------------------------------------
    def gc(self, keep_last: int, keep_every: int | None = None,
           progress: Callable[[int], None] | None = None):
        """Apply a retention policy, then compact. See :mod:`ckptstore.ops.gc`."""
        from .ops.gc import collect

        self._drain_async()
        with self._mutex:
            self._check_writable()
            if self._pending:  # gc rebuilds the writer: commit pending deltas first, never drop them
                self._flush_locked()
            self._recover_if_needed()
            return self._read_retrying(
                lambda: collect(self, keep_last=keep_last, keep_every=keep_every, progress=progress))


#: A diff key: a tensor's structured path and its occurrence number among equal paths of one
#: manifest (0 unless the manifest is odd); tensors no state node names are keyed by display path.
_DiffKey = tuple[Any, ...]


def _tensors_by_path(m: Manifest) -> dict[_DiffKey, Any]:
    paths = leaf_paths(m.state)
    out: dict[_DiffKey, Any] = {}
    for i, t in enumerate(m.tensors):
        p = paths.get(i)
        key: _DiffKey = ("path", p, 0) if p is not None else ("unreferenced", t.path, 0)
        while key in out:
            key = (key[0], key[1], key[2] + 1)
        out[key] = t
    return out


def _display(key: _DiffKey, unambiguous: bool) -> str:
    kind, p, n = key
    if kind != "path":
        name = p
    else:
        name = format_path(p) if unambiguous else path_name(p)
    return f"{name} #{n + 1}" if n else name


def flatten_meta(meta: Any) -> Any:
    """The skeleton of the user's meta (a dict of JSON-like values, or None)."""
    if meta is not None and type(meta) is not dict:
        raise UnsupportedTypeError(f"meta must be a dict, not {type(meta).__name__}")
    return flatten(meta, no_leaves)[0]


def _caused_by_missing_file(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, FileNotFoundError) or (isinstance(e, StoreIOError) and e.errno == 2):
            return True
        e = e.__cause__
    return False
