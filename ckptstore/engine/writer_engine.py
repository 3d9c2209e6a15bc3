"""The writer's engine: the writer lock, crash recovery, the one open transaction, saves.

Opening (format-spec/format.md §16-§17): take the writer lock -> create or read STORE -> finish an
interrupted gc -> open (or rebuild) the index -> recover: scan the log from the index's position,
cut the uncommitted tail, reopen the log for appending.

Every durable change goes through :meth:`WriterEngine.begin` (:mod:`ckptstore.engine.transaction`):
a snapshot save is a transaction of one checkpoint; deltas appended without ``durable`` join the
open *group* transaction, committed by :meth:`WriterEngine.commit_group` (format-spec/deltas.md,
"Group commit"); gc installs its compacted segments through :meth:`WriterEngine.install_compaction`.

Failure handling has one path. A failed save rolls its transaction back to where it began
(:meth:`cut_back`). When that cut fails too, the engine is marked *unclean* and remembers where the
cut should have been: before the next write, :meth:`recover_if_needed` retries that cut (so deltas
staged before the failure survive) and otherwise runs the full recovery, which also cuts the
staged deltas; those are then reported once by :meth:`raise_aborted` (CheckpointAbortedError).
Only this module sets or clears the unclean mark.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Callable

from ..errors import (CheckpointAbortedError, CkptStoreError, DamagedCheckpointError,
                      DeltaChainError, FormatError, IndexUnusable, IterationOrderError,
                      StoreFeaturesError)
from ..format.chunk import MAX_CHUNK_SIZE
from ..format.commit import decode_commit
from ..format.header import NEW_STORE_FEATURES, feature_names
from ..storage.fileops import FileOps
from ..storage.index import CommitEntry, Index, IndexBatch, Position
from ..storage.job_log import refuse_job_part
from ..storage.lmdb_index import LmdbIndex
from ..storage.lock import WriterLock
from ..storage.log import Log
from ..storage.store_file import create_store, read_store_header
from ..tensors import ArrayLeaf
from .engine import DEFAULT_CHUNK_SIZE, DEFAULT_SEGMENT_SIZE, Engine
from .transaction import Hold, Transaction
from .write_path import CompressionTrials, SaveStats, append_checkpoint, chunk_size_for


def check_features(features: str) -> None:
    """Refuse (ValueError) a ``features`` option other than "current" (a store created gets
    every format feature this release writes) or "compatible" (none, so releases before them
    read it; opening a store that has some raises StoreFeaturesError). An existing store keeps
    its features either way."""
    if features not in ("current", "compatible"):
        raise ValueError(f'features must be "current" or "compatible", not {features!r}')


class WriterEngine(Engine):
    """The single writer of a store directory (mode "a")."""

    mode = "a"

    def __init__(self, path: str, *, chunk_size: int | None = None, segment_size: int | None = None,
                 file_ops: FileOps | None = None, load_threads: int = 2,
                 evict_written: bool = True, direct_io: bool | str = "async",
                 features: str = "current", job_stream: bool = False) -> None:
        # job_stream: opened by its job store (multirank/job_store.py, multirank/fsck.py), which
        # commits and repairs every rank's stream together; anyone else is refused before
        # anything under the directory is created or locked (JobStreamError)
        if not job_stream:
            refuse_job_part(path, "opening it for writing")
        super().__init__(path, file_ops=file_ops, load_threads=load_threads)
        check_features(features)
        #: see :func:`check_features`
        self.features = features
        #: append through O_DIRECT where the file system takes it (storage/direct.py): True for
        #: every record, "async" for deltas and the asynchronous pipeline's snapshots
        #: (synchronous snapshots buffered), "deltas" for delta checkpoints only, False never
        if direct_io not in (True, False, "async", "deltas"):
            raise ValueError(f'direct_io must be True, False, "async" or "deltas", not {direct_io!r}')
        self.direct_io = direct_io
        #: which chunks of imaged delta tensors skip their compression trial (write_path.py)
        self.delta_trials = CompressionTrials()
        #: the same for the asynchronous pipeline's snapshots (None: every chunk is tried)
        self.snapshot_trials: CompressionTrials | None = CompressionTrials()
        #: advise the kernel to write back and drop the pages of what was written (SegmentWriter)
        self.evict_written = evict_written
        self.lock = WriterLock(self.layout, self.file_ops)
        #: the open transaction: a delta group being filled, or a save in progress
        self._txn: Transaction | None = None
        #: a failed rollback left the log past the last commit in an unknown state
        self._unclean = False
        #: where that failed rollback should have cut (retried before staged deltas commit)
        self._cut_to: Position | None = None
        #: staged deltas a recovery cut, not yet reported (by the next commit_group or delta)
        self._aborted: list[int] = []
        #: the index was rebuilt from the log by this process, so a read that fails now fails
        #: because of the log, not the index (no second rebuild)
        self._index_rebuilt = False
        #: called (under the lock) when a delta opens a new group that stays pending: the group
        #: timer's wake-up (ckptstore/ops/grouptimer.py)
        self.on_new_group: Callable[[], None] | None = None
        #: the outer commit every transaction's commit calls after its local commit point (a
        #: multi-rank job store's global commit; ckptstore/engine/transaction.py)
        self.commit_hook: Callable[[list[CommitEntry]], BaseException | Hold | None] | None = None
        #: called (under the lock, in the committing thread) after each change of what is
        #: durable: a commit indexed (:meth:`apply_committed`) or a gc installed
        #: (:meth:`install_compaction`). A listener must be quick and must not raise (an error
        #: is swallowed: the commit is durable whatever a listener does); the remote tier's
        #: uploader (ckptstore/remote/) only wakes its thread. Not part of the commit protocol.
        self.durable_listeners: list[Callable[[], None]] = []
        try:
            self._open(chunk_size, segment_size)
        except BaseException:
            self._release()
            raise

    # ---- opening -----------------------------------------------------------------------------
    def _open(self, chunk_size: int | None, segment_size: int | None) -> None:
        self.file_ops.makedirs(self.path)
        self.lock.acquire()
        if not os.path.exists(self.layout.store_file):
            create_store(self.layout, self.file_ops, chunk_size or DEFAULT_CHUNK_SIZE,
                         segment_size or DEFAULT_SEGMENT_SIZE,
                         flags=0 if self.features == "compatible" else NEW_STORE_FEATURES)
        self.header = read_store_header(self.layout)
        if self.features == "compatible" and self.header.flags:
            raise StoreFeaturesError(
                f"{self.layout.store_file}: this store was created with format features "
                f"{', '.join(feature_names(self.header.flags))} (format-spec/format.md §4), which "
                "ckptstore releases without them cannot read; features are chosen when a store is "
                "created and never removed: copy the checkpoints into a store created with "
                'features="compatible" instead')
        self.chunk_size = chunk_size or self.header.chunk_size
        self.segment_size = segment_size or self.header.segment_size
        if not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK_SIZE}")
        self.log = Log(self.layout, self.header.store_id, self.file_ops, self.evict_written,
                       bool(self.direct_io), framing_checks=self.header.framing_checks)
        self.finish_interrupted_gc()
        self.index = self._open_index()
        self.recover()

    def _release(self) -> None:
        super()._release()
        self.lock.release()

    def finish_interrupted_gc(self) -> None:
        """Delete gc temp files and segments made obsolete by a completed gc commit."""
        removed = False
        for tmp in self.layout.list_gc_temps():
            self.file_ops.unlink(tmp)
            removed = True
        self.log.refresh_segments()
        for seq in self.log.obsolete_segments():
            self.file_ops.unlink(self.layout.segment_path(seq))
            removed = True
        if removed:
            self.file_ops.fsync_dir(self.layout.segment_dir)
            self.log.refresh_segments()

    def _open_index(self) -> Index:
        try:
            return LmdbIndex(self.layout.index_dir, self.header.store_id, self.file_ops)
        except IndexUnusable:
            LmdbIndex.destroy(self.layout.index_dir)
            return LmdbIndex(self.layout.index_dir, self.header.store_id, self.file_ops)

    def rebuild_index(self) -> None:
        """The index disagreed with the log (a malformed value, a location that does not hold what
        it names): rebuild it from the log. The log is not touched: staged deltas stay staged and
        are indexed when their group commits."""
        with self._mutex:
            self.index.close()
            LmdbIndex.destroy(self.layout.index_dir)
            self.index = self._open_index()
            self._index_rebuilt = True
            self.last_scan = self.log.scan(self.index, None)

    def _index_start(self) -> Position | None:
        """Where the scan can start: the index's position if the index matches the log, else None
        (after clearing the index for a full rebuild)."""
        pos, last, segs = self.index.position(), self.index.last_commit(), self.index.segments()
        if pos is None:
            self.index.clear()
            return None
        live = self.log.refresh_segments()
        ok = segs is not None and tuple(s for s in live if s <= pos.seq) == segs and last is not None
        if ok:
            assert last is not None
            try:
                payload = self.log.read_payload(last.loc)
                ok = decode_commit(payload) == last.commit and last.loc.end == pos.offset \
                    and last.loc.seq == pos.seq
            except (FormatError, OSError):
                ok = False
        if not ok:
            self.index.clear()
            return None
        return pos

    # ---- recovery ------------------------------------------------------------------------------
    def recover(self) -> None:
        """Scan the log into the index, cut the uncommitted tail (with the open transaction, whose
        staged checkpoints are lost) and reopen the log for appending."""
        self._unclean = True  # stays set if anything below fails
        self._txn = None
        try:
            start = self._index_start()
        except IndexUnusable:
            self.index.close()
            LmdbIndex.destroy(self.layout.index_dir)
            self.index = self._open_index()
            start = None
        report = self.log.scan(self.index, start)
        self.last_scan = report
        position = report.position
        if report.tail:
            self.log.discard_after(position, quarantine=report.tail_suspicious)
        self.log.open_writer(position, self.segment_size)
        self._unclean = False
        self._cut_to = None

    @property
    def needs_recovery(self) -> bool:
        """A failure left the log past the last commit in an unknown state: the next write (or
        :meth:`recover_if_needed`) repairs it first."""
        return self._unclean

    def mark_unclean(self) -> None:
        """A component that writes below a transaction (gc's swap, the async pipeline's failure
        path) lost track of the log: recover before the next write."""
        self._unclean = True

    def recover_if_needed(self) -> None:
        """Finish what a failed write left: re-cut to where its rollback should have cut when
        deltas are staged before it (they survive), else recover, which cuts them too; those are
        reported by the next :meth:`raise_aborted`."""
        if not self._unclean:
            return
        txn = self._txn
        if txn is not None and txn.staged and self._cut_to is not None and self._try_cut(self._cut_to):
            self._unclean = False
            self._cut_to = None
            return
        lost = txn.iterations() if txn is not None else []
        self.recover()
        self._aborted.extend(lost)

    def raise_aborted(self) -> None:
        """Raise CheckpointAbortedError for staged deltas a recovery cut since the last call."""
        if self._aborted:
            lost, self._aborted = self._aborted, []
            raise CheckpointAbortedError(
                f"deltas {lost} of {self.path} were appended but not committed: a failed save left "
                "the log past them in an unknown state and cutting it back failed again; recovery "
                "cut them (the latest durable iteration is unchanged)")

    # ---- the transaction host (ckptstore.engine.transaction.TransactionHost) -------------------
    def begin(self) -> Transaction:
        """Open the transaction every durable change goes through (the caller holds the lock;
        at most one is open: a pending delta group must be committed or aborted first)."""
        assert self._txn is None or self._txn.closed, "a transaction is already open"
        self.recover_if_needed()
        self._txn = Transaction(self, self.index.position())
        return self._txn

    def cut_back(self, start: Position | None) -> None:
        """The one rollback: cut the log after ``start`` and put the writer there; when that
        fails, mark the engine unclean (recovered before the next write, see the module doc)."""
        if not self._try_cut(start):
            self._unclean = True
            self._cut_to = start

    def _try_cut(self, start: Position | None) -> bool:
        try:
            self.log.discard_after(start, quarantine=False)
            if self.log.writer is None or (start is not None and self.log.writer.seq != start.seq):
                self.log.open_writer(start, self.segment_size)
        except (CkptStoreError, OSError):
            return False
        return True

    def apply_committed(self, batch: IndexBatch) -> None:
        try:
            self.index.apply(batch)
        except Exception:  # noqa: BLE001 - the commit is durable; only the cache missed it
            # The index's position is still before this commit, so a scan from it finds the
            # commit again. If even that fails, the next write retries the recovery.
            self._unclean = True
            self.recover()
        self.notify_durable()

    def notify_durable(self) -> None:
        """Tell :attr:`durable_listeners` that what is durable changed (never raises)."""
        for listener in list(self.durable_listeners):
            try:
                listener()
            except Exception:  # noqa: BLE001 - a listener never fails a durable commit
                pass

    def transaction_closed(self, txn: Transaction) -> None:
        if self._txn is txn:
            self._txn = None

    # ---- saves -------------------------------------------------------------------------------
    def save_snapshot(self, iteration: int, skeleton: Any, meta: Any, leaves: list[ArrayLeaf], *,
                      progress: Callable[[int], None] | None = None, extra: dict | None = None,
                      stats_field: str | None = None, background: bool = False) -> SaveStats:
        """Commit one snapshot durably (committing a pending delta group first). Raises
        IterationOrderError unless ``iteration`` is after every committed one. ``background``:
        written by the asynchronous pipeline (O_DIRECT under ``direct_io="async"``; chunks of
        its chunk images skip compression trials by :attr:`snapshot_trials`). Leaves in chunk
        images (the pipeline's) are chunked at the images' chunk size, written in place."""
        with self._mutex:
            self.check_open()
            if self.group is not None:
                self.commit_group()
            latest = self.indexed(lambda: self.index.latest())
            if latest is not None and iteration <= latest:
                raise IterationOrderError(
                    f"iteration {iteration} is not after the latest committed iteration {latest} "
                    f"in {self.path}")
            txn = self.begin()
            try:
                self.log.use_direct(self.direct_io is True or
                                    (background and self.direct_io == "async"))
                staged, stats = append_checkpoint(
                    txn, self.index, iteration, skeleton, meta, leaves,
                    chunk_size=chunk_size_for(leaves, self.chunk_size), progress=progress,
                    extra=extra, stats_field=stats_field,
                    trials=self.snapshot_trials if background else None)
                txn.stage(staged)
            except BaseException:
                txn.abort()
                raise
            t0 = time.perf_counter()
            txn.commit()
            return replace(stats, seconds=stats.seconds + time.perf_counter() - t0)

    @property
    def group(self) -> Transaction | None:
        """The open delta group (deltas appended, not committed), if any."""
        txn = self._txn
        return txn if txn is not None and txn.staged else None

    def staged_iterations(self) -> list[int]:
        """Deltas appended without ``durable`` and not yet committed (lost on a crash)."""
        group = self.group
        return group.iterations() if group is not None else []

    def group_since(self) -> float | None:
        """Monotonic time the open delta group's first delta was staged (None: no group)."""
        group = self.group
        return group.staged_since if group is not None else None

    def tail(self) -> int | None:
        """The last iteration written: the newest staged delta, else the latest committed one."""
        with self._mutex:
            staged = self.staged_iterations()
            return staged[-1] if staged else self.index.latest()

    def append_delta(self, iteration: int, skeleton: Any, meta: Any, leaves: list[ArrayLeaf],
                     durable: bool, *, extra: dict | None = None,
                     stats_field: str | None = None) -> SaveStats:
        """Append the delta record of ``iteration`` to the open group (opening one), committing
        the group when ``durable``. Its predecessor must be committed or staged and recoverable."""
        with self._mutex:
            self.check_open()
            self.recover_if_needed()
            self.raise_aborted()
            group = self.group
            if group is not None:
                prev, base = group.staged[-1].iteration, group.staged[-1].base
            else:
                prev = self.indexed(lambda: self.index.latest())
                if prev is None:
                    raise DeltaChainError(
                        f"delta for iteration {iteration} refused: {self.path} holds no base "
                        "snapshot (a delta chain must start from a snapshot)")
                base = self.chain_base(prev)
            if iteration <= prev:
                raise IterationOrderError(f"iteration {iteration} is not after the latest "
                                          f"iteration {prev} in {self.path}")
            if iteration != prev + 1:
                raise DeltaChainError(f"delta for iteration {iteration} refused: the latest "
                                      f"iteration is {prev}; a delta must follow its predecessor "
                                      "without a gap (save a base snapshot first)")
            txn = group if group is not None else self.begin()
            savepoint = txn.savepoint()
            try:
                self.log.use_direct(bool(self.direct_io))
                # chunks and trees of the group's earlier deltas deduplicate too (their records
                # precede this one and are cut only together with it: append_checkpoint's
                # invariant)
                staged, stats = append_checkpoint(
                    txn, self.index, iteration, skeleton, meta, leaves,
                    chunk_size=chunk_size_for(leaves, self.chunk_size),
                    kind="delta", extra={"prev": prev, "base": base, **(extra or {})},
                    stats_field=stats_field, pending=txn.staged, trials=self.delta_trials)
            except BaseException:
                txn.rollback_to(savepoint)
                raise
            staged.base = base
            txn.stage(staged)
            if durable:
                self.commit_group()
            elif group is None and self.on_new_group is not None:
                self.on_new_group()
            return stats

    def commit_group(self) -> None:
        """Commit every staged delta: fsync their records, append their COMMIT records, fsync
        (the group's commit point). Raises CheckpointAbortedError, naming them, when staged
        deltas were cut by a recovery (a failed save's leftovers could not be cut)."""
        with self._mutex:
            self.recover_if_needed()
            self.raise_aborted()
            group = self.group
            if group is not None:
                group.commit()

    def commit_group_begun_at(self, since: float) -> None:
        """Commit the open group if it is the one whose first delta was staged at ``since`` (the
        group timer's commit: a group committed or replaced meanwhile is left alone)."""
        with self._mutex:
            if not self._closed and self.group_since() == since:
                self.commit_group()

    def abandon_group(self) -> None:
        """Cut every staged delta (after a failure in the async pipeline)."""
        with self._mutex:
            group = self.group
            if group is not None:
                group.abort()

    # ---- gc ----------------------------------------------------------------------------------
    def install_compaction(self, copies: list[tuple[int, str]], marker: tuple[int, str]) -> None:
        """gc's commit (format-spec/format.md, "Garbage collection", step 3-4): rename each copy
        into place, each durable before the next; close the log's writer; rename the marker
        segment, whose header supersedes every older segment, and fsync the directory: **the gc
        commit point**; then delete the obsolete segments and rebuild the index by recovery.
        No transaction may be open. A failure anywhere leaves the log consistent (renamed copies
        only duplicate live checkpoints; obsolete segments are deleted by the next open) and the
        engine marked for recovery before its next write."""
        assert self._txn is None or self._txn.closed, "gc with a transaction open"
        ops, layout = self.file_ops, self.layout
        try:
            for seq, tmp in copies:
                ops.rename(tmp, layout.segment_path(seq))
                ops.fsync_dir(layout.segment_dir)
            self.log.close_writer()
            ops.rename(marker[1], layout.segment_path(marker[0]))
            ops.fsync_dir(layout.segment_dir)  # gc commit point
            self.finish_interrupted_gc()
            self.index.clear()
            self.recover()
        except BaseException:
            self._unclean = True
            raise
        self.notify_durable()

    # ---- look-ups ------------------------------------------------------------------------------
    def indexed(self, lookup: Callable[[], Any]) -> Any:
        try:
            return lookup()
        except IndexUnusable as e:
            self.warn_damaged_index(e, "rebuilding it from the log")
            self.rebuild_index()
            return lookup()

    def sync_view(self) -> None:
        self.check_open()
        with self._mutex:
            self.recover_if_needed()

    def read(self, fn: Callable[[], Any]) -> Any:
        """Reads hold the mutex (the async pipeline's thread writes under it); the LMDB index is
        a cache whose values are checked on use: a read that fails on an index value
        (IndexUnusable) or on what it located (DamagedCheckpointError) rebuilds the index from
        the log once per process and retries, so only damage in the log reaches the caller."""
        with self._mutex:
            try:
                return fn()
            except (IndexUnusable, DamagedCheckpointError) as e:
                if self._index_rebuilt:
                    raise
                self.rebuild_index()
                first = e
            out = fn()  # raising here, the damage is the log's: no word about the index
            self.warn_damaged_index(first, "rebuilt it from the log")
            return out
