"""The Store: one directory of versioned checkpoints with a single writer and any number of readers.

Lifecycle of a writer (mode "a"): take the lock -> create or read STORE -> finish an interrupted gc
-> open (or rebuild) the index -> replay the log from the index's position -> cut the uncommitted
tail -> append. Readers (mode "r") build an in-memory index by replaying the log and never write
anything under the store directory.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .errors import (CkptStoreError, DeltaChainError, FormatError, IterationOrderError, NotFoundError,
                     ReadOnlyStoreError, StoreClosedError, StoreIOError, StoreLockedError,
                     StoreNotFoundError, UnsupportedTypeError)
from .format.header import (FORMAT_VERSION, STORE_HEADER_SIZE, StoreHeader, decode_store_header,
                            encode_store_header)
from .format.chunk import MAX_CHUNK_SIZE
from .format import records as rec
from .format.commit import KIND_DELTA, KIND_NAMES, KIND_SNAPSHOT, encode_commit
from .format.manifest import Manifest
from .format.state import flatten, path_name
from .reader import StateReader, read_manifest, read_tree
from .storage.fileops import FileOps, io_errors
from .storage.index import CommitEntry, Index, IndexBatch, MemoryIndex, Position
from .storage.layout import Layout
from .storage.lmdb_index import IndexUnusable, LmdbIndex
from .storage.log import Log, ReplayReport
from .tensors import leaf_hook, no_leaves
from .writer import SaveStats, write_snapshot

DEFAULT_CHUNK_SIZE = 4 << 20
DEFAULT_SEGMENT_SIZE = 1 << 30


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
                 load_threads: int = 2) -> None:
        if mode not in ("r", "a"):
            raise ValueError(f'mode must be "r" or "a", not {mode!r}')
        self.path = os.fspath(path)
        self.mode = mode
        self.layout = Layout(self.path)
        self._ops = file_ops or FileOps()
        self._lock_fd: int | None = None
        self._closed = False
        self._mutex = threading.RLock()
        self._needs_recovery = False
        self.last_replay: ReplayReport | None = None
        # group commit of deltas (format-spec/deltas.md): appended, not yet committed
        self._pending: list[tuple[IndexBatch, int]] = []  # (batch with loc-less commit, base)
        self._pending_start: Position | None = None
        self._pending_since = 0.0
        self._load_threads = load_threads
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
        self._replay_for_reader(None)

    def _replay_for_reader(self, start: Position | None) -> None:
        """Replay into the reader's index; a gc in the writer may delete a segment mid-scan, in
        which case the scan starts over once on the new segment set."""
        try:
            self.last_replay = self.log.replay(self.index, start)
        except (FileNotFoundError, StoreIOError) as e:
            if not _caused_by_missing_file(e):
                raise
            self.index.clear()
            self.last_replay = self.log.replay(self.index, None)

    def _open_writer(self, chunk_size: int | None, segment_size: int | None) -> None:
        with io_errors("create store directory", self.path):
            os.makedirs(self.path, exist_ok=True)
        self._take_lock()
        if not os.path.exists(self.layout.store_file):
            self._create(chunk_size or DEFAULT_CHUNK_SIZE, segment_size or DEFAULT_SEGMENT_SIZE)
        self.header = self._read_header()
        self.chunk_size = chunk_size or self.header.chunk_size
        self.segment_size = segment_size or self.header.segment_size
        if not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK_SIZE}")
        self.log = Log(self.layout, self.header.store_id, self._ops)
        self._finish_interrupted_gc()
        self.index = self._open_index()
        self._recover()

    def _take_lock(self) -> None:
        with io_errors("open lock file", self.layout.lock_file):
            fd = os.open(self.layout.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
        with io_errors("create segment directory", self.layout.segment_dir):
            os.makedirs(self.layout.segment_dir, exist_ok=True)
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
            return LmdbIndex(self.layout.index_dir, self.header.store_id)
        except IndexUnusable:
            LmdbIndex.destroy(self.layout.index_dir)
            return LmdbIndex(self.layout.index_dir, self.header.store_id)

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

    def _recover_if_needed(self) -> None:
        if self._needs_recovery:
            self._recover()

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

    def _check_writable(self) -> None:
        self._check_open()
        if self.mode != "a":
            raise ReadOnlyStoreError(f'store {self.path} is open read-only (mode="r")')

    def close(self) -> None:
        """Release the writer lock and every file. Idempotent."""
        with self._mutex:
            if not self._closed:
                try:
                    if self._pending:
                        self._flush_locked()
                finally:
                    self._closed = True
                    self._release()

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
        with self._mutex:
            self._check_writable()
            if type(iteration) is not int or iteration < 0 or iteration >= 1 << 63:
                raise ValueError(f"iteration must be a non-negative int, not {iteration!r}")
            if self._pending:
                self._flush_locked()
            latest = self.index.latest()
            if latest is not None and iteration <= latest:
                raise IterationOrderError(
                    f"iteration {iteration} is not after the latest committed iteration {latest} "
                    f"in {self.path}")
            skeleton, leaves = flatten(state, leaf_hook)
            if meta is not None and type(meta) is not dict:
                raise UnsupportedTypeError(f"meta must be a dict, not {type(meta).__name__}")
            meta_skeleton, _ = flatten(meta, no_leaves)
            self._recover_if_needed()
            start = self.index.position()
            try:
                batch, stats = write_snapshot(self.log, self.index, iteration, skeleton, meta_skeleton,
                                              leaves, chunk_size=self.chunk_size,
                                              segment_size=self.segment_size, progress=progress)
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
        with self._mutex:
            self._check_writable()
            if type(iteration) is not int or iteration < 1 or iteration >= 1 << 63:
                raise ValueError(f"delta iteration must be a positive int, not {iteration!r}")
            self._recover_if_needed()
            if self._pending:
                prev = self._pending[-1][0].commits[0].commit.iteration
                base = self._pending[-1][1]
            else:
                prev = self.index.latest()
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
            skeleton, leaves = flatten(record, leaf_hook)
            if meta is not None and type(meta) is not dict:
                raise UnsupportedTypeError(f"meta must be a dict, not {type(meta).__name__}")
            meta_skeleton, _ = flatten(meta, no_leaves)
            w = self.log.writer
            start = self.index.position() if not self._pending or w is None else Position(w.seq, w.offset)
            try:
                batch, stats = write_snapshot(self.log, self.index, iteration, skeleton, meta_skeleton,
                                              leaves, chunk_size=self.chunk_size,
                                              segment_size=self.segment_size, kind="delta",
                                              extra={"prev": prev, "base": base}, defer_commit=True)
            except BaseException:
                self._rollback(start)
                raise
            if not self._pending:
                self._pending_start = start
                self._pending_since = time.monotonic()
            self._pending.append((batch, base))
            if durable:
                self._flush_locked()
            return stats

    def flush(self) -> int | None:
        """Commit every pending delta: fsync their records, append their COMMIT records, fsync
        (the group's commit point). Returns :meth:`durable_iteration`."""
        with self._mutex:
            self._check_writable()
            self._flush_locked()
            return self._recoverable_latest()

    def pending(self) -> list[int]:
        """Deltas appended with durable=False and not yet committed (lost on a crash)."""
        return [b.commits[0].commit.iteration for b, _ in self._pending]

    def pending_age(self) -> float:
        """Seconds since the oldest pending delta was appended (0 when none is pending)."""
        return time.monotonic() - self._pending_since if self._pending else 0.0

    def _flush_locked(self) -> None:
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

    def _kind(self, iteration: int) -> int | None:
        e = self.index.get_commit(iteration)
        return None if e is None else e.commit.kind

    def _chain_base(self, iteration: int) -> int:
        """The base snapshot the chain ending at committed ``iteration`` starts from; raises
        DeltaChainError when the chain is broken (a predecessor is missing)."""
        it = iteration
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
        self._entry(iteration)
        return self._chain_base(iteration)

    def kind(self, iteration: int) -> str:
        """"snapshot" (a base) or "delta"."""
        return KIND_NAMES.get(self._entry(iteration).commit.kind, "unknown")

    def _recoverable(self) -> list[int]:
        """Committed iterations that can be loaded: snapshots, and deltas whose every predecessor
        back to a snapshot is committed (the chain rule of format-spec/deltas.md)."""
        out: list[int] = []
        ok: set[int] = set()
        for it in self.index.iterations():
            k = self._kind(it)
            if k == KIND_SNAPSHOT or (k == KIND_DELTA and it - 1 in ok):
                ok.add(it)
                out.append(it)
        return out

    def _recoverable_latest(self) -> int | None:
        latest = self.index.latest()
        if latest is None or self._kind(latest) == KIND_SNAPSHOT:
            return latest
        its = self._recoverable()
        return its[-1] if its else None

    def durable_iteration(self) -> int | None:
        """The newest iteration that survives a crash right now: committed (fsynced) and
        recoverable. Pending deltas (durable=False, not yet flushed) are not counted."""
        self._sync_view()
        return self._recoverable_latest()

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    into: Callable[[Any], Any] | None = None) -> Any:
        """The state stored for ``iteration`` as written: for a delta, its delta record (not the
        replayed state). Same as :meth:`load` for a snapshot. ``into``: see
        :meth:`ckptstore.reader.StateReader.load` (read tensors into existing ones)."""
        reader = StateReader(self.log, self.index, threads=self._load_threads)
        return self._retry_after_gc(lambda: reader.load(self._entry(iteration), keys, None, into))

    def replay(self, start: int, stop: int, **options: Any):
        """Yield ``(iteration, state)`` for every iteration in ``start..stop`` (inclusive), each
        reconstructed from the nearest base at or before ``start`` plus the deltas after it.
        See :func:`ckptstore.replay.replay_range` for options and reports."""
        from .replay import replay_range

        return replay_range(self, start, stop, **options)

    def _rollback(self, start: Position | None) -> None:
        """Cut the log back to ``start`` after a failed save; on failure, recover before next save."""
        try:
            self.log.discard_after(start, quarantine=False)
            if self.log.writer is None or (start is not None and self.log.writer.seq != start.seq):
                self.log.open_writer(start, self.segment_size)
        except (CkptStoreError, OSError):
            self._needs_recovery = True

    # ---- reading ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Readers: pick up checkpoints committed since open (and follow a gc). Writers: no-op."""
        with self._mutex:
            self._check_open()
            if self.mode == "a":
                return
            pos = self.index.position()
            live = self.log.refresh_segments()
            segs = self.index.segments()
            if pos is not None and (segs is None or tuple(s for s in live if s <= pos.seq) != segs):
                self.index.clear()
                pos = None
            self._replay_for_reader(pos)

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
        its = self.index.iterations()
        if not its or all(self._kind(i) == KIND_SNAPSHOT for i in its):
            return its
        return self._recoverable()

    def latest(self) -> int | None:
        """The newest committed recoverable iteration, or None for an empty store."""
        self._sync_view()
        return self._recoverable_latest()

    def _entry(self, iteration: int) -> CommitEntry:
        self._check_open()
        e = self.index.get_commit(iteration) if type(iteration) is int else None
        if e is None and self.mode == "r":
            self.refresh()
            e = self.index.get_commit(iteration)
        if e is None:
            raise NotFoundError(f"iteration {iteration!r} is not committed in {self.path}")
        return e

    def info(self, iteration: int) -> CheckpointInfo:
        c = self._entry(iteration).commit
        return CheckpointInfo(c.iteration, c.created_ns, c.logical_bytes, c.written_bytes,
                              c.snapshot_root.hex(), KIND_NAMES.get(c.kind, "unknown"))

    def manifest(self, iteration: int) -> Manifest:
        """The decoded, verified manifest of a committed iteration."""
        return self._retry_after_gc(lambda: read_manifest(self.log, self._entry(iteration)))

    def meta(self, iteration: int) -> Any:
        from .format.state import unflatten

        return unflatten(self.manifest(iteration).meta, lambda i, p: None)

    def load(self, iteration: int, keys: Sequence[Any] | None = None,
             progress: Callable[[int], None] | None = None) -> Any:
        """The state saved at ``iteration``, bit-exact. ``keys`` selects top-level dict keys and
        reads only their tensors. Raises NotFoundError, DamagedCheckpointError.

        A delta iteration is reconstructed: its chain's base snapshot, then every delta after it
        replayed (:mod:`ckptstore.replay`; DeltaChainError, ReplayDivergenceError)."""
        if self._entry(iteration).commit.kind == KIND_DELTA:
            from .replay import replay_to

            state = self._retry_after_gc(lambda: replay_to(self, iteration))
            if keys is not None:
                missing = [k for k in keys if k not in state]
                if missing:
                    raise NotFoundError(f"iteration {iteration}: keys {missing} are not in the "
                                        f"state (it has {list(state)})")
                state = {k: state[k] for k in keys}
            return state
        reader = StateReader(self.log, self.index, threads=self._load_threads)
        return self._retry_after_gc(lambda: reader.load(self._entry(iteration), keys, progress))

    def _retry_after_gc(self, fn: Callable[[], Any]) -> Any:
        """Readers: a gc in the writer may delete segments under us; refresh once and retry."""
        try:
            return fn()
        except CkptStoreError as e:
            if self.mode != "r" or not _caused_by_missing_file(e):
                raise
            self.refresh()
            return fn()

    def diff(self, a: int, b: int) -> list[TensorDiff]:
        """Compare the tensors of two checkpoints by Merkle roots, then chunk addresses."""
        ma, mb = self.manifest(a), self.manifest(b)
        ta = {t.path: t for t in ma.tensors}
        tb = {t.path: t for t in mb.tensors}
        out: list[TensorDiff] = []
        for path in list(ta) + [p for p in tb if p not in ta]:
            ea, eb = ta.get(path), tb.get(path)
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
        """Apply a retention policy, then compact. See :mod:`ckptstore.gc`."""
        from .gc import collect

        with self._mutex:
            self._check_writable()
            return collect(self, keep_last=keep_last, keep_every=keep_every, progress=progress)


def _caused_by_missing_file(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, FileNotFoundError) or (isinstance(e, StoreIOError) and e.errno == 2):
            return True
        e = e.__cause__
    return False
