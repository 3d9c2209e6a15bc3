"""The Store: the public API over one directory of versioned checkpoints.

A thin facade. The work is done below it, each piece in one place:

* :mod:`ckptstore.engine` -- the writer lock, crash recovery, the commit protocol (one
  :class:`~ckptstore.engine.transaction.Transaction` type), the read path and the reader's view;
* :mod:`ckptstore.ops` -- the async pipeline, the group-commit timer, gc, fsck, diff;
* :mod:`ckptstore.replay` -- rebuilding delta iterations by re-executing optimizer steps.

The Store adds argument checks, flattening of user states, the ordering between the async
pipeline and synchronous calls, and reporting of background failures (raised once by the next
call on the store). A writer (mode "a") holds the single-writer lock; readers (mode "r") never
write under the directory and may run beside the writer.
"""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .errors import NotFoundError, ReadOnlyStoreError, StoreClosedError
from .format.commit import KIND_DELTA, KIND_NAMES
from .format.header import StoreHeader
from .format.manifest import Manifest
from .format.state import flatten, unflatten
from .inplace import copy_into
from .engine.engine import Engine
from .engine.reader_engine import ReaderEngine
from .engine.write_path import SaveStats, flatten_meta
from .engine.writer_engine import WriterEngine
from .ops.bisect import BisectResult, Predicate, bisect as bisect_range
from .ops.diff import TensorDiff, diff_manifests
from .ops.gc import GcReport, collect
from .ops.grouptimer import GroupTimer
from .ops.pipeline import AsyncStats, Pipeline
from .replay.replayer import replay_range, replay_to
from .storage.fileops import FileOps
from .storage.index import Index
from .storage.layout import Layout
from .storage.log import Log, ScanReport
from .tensors import leaf_hook

__all__ = ["CheckpointInfo", "Store", "TensorDiff", "flatten_meta", "select_keys"]


@dataclass(frozen=True)
class CheckpointInfo:
    """Summary of one committed checkpoint (from its commit record; no manifest read)."""

    iteration: int
    created_ns: int
    logical_bytes: int
    written_bytes: int
    snapshot_root: str
    kind: str


class Store:
    """A checkpoint store. Use :func:`ckptstore.open` to create one."""

    def __init__(self, path: str | os.PathLike, mode: str = "a", *, chunk_size: int | None = None,
                 segment_size: int | None = None, file_ops: FileOps | None = None,
                 load_threads: int = 2, host_budget: int | None = None,
                 max_inflight: int | None = None, use_index: bool = True,
                 evict_written: bool = True, direct_io: bool | str = "deltas",
                 commit_round: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        if mode not in ("r", "a"):
            raise ValueError(f'mode must be "r" or "a", not {mode!r}')
        self.path = os.fspath(path)
        self.mode = mode
        self.engine: Engine
        self._writer: WriterEngine | None = None
        if mode == "a":
            self._writer = WriterEngine(self.path, chunk_size=chunk_size,
                                        segment_size=segment_size, file_ops=file_ops,
                                        load_threads=load_threads, evict_written=evict_written,
                                        direct_io=direct_io)
            self.engine = self._writer
        else:
            self.engine = ReaderEngine(self.path, load_threads=load_threads, use_index=use_index)
        self._closed = False
        # the asynchronous pipeline (ckptstore/ops/pipeline.py), started by the first async save
        self._pipeline: Pipeline | None = None
        self._async_limits = (host_budget, max_inflight)
        #: how the async pipeline runs a committing job (a multi-rank store's global round)
        self._commit_round = commit_round
        # the group-commit timer (ckptstore/ops/grouptimer.py), started by set_group_seconds
        self._timer: GroupTimer | None = None

    # ---- what the engine holds --------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self.engine.layout

    @property
    def header(self) -> StoreHeader:
        return self.engine.header

    @property
    def chunk_size(self) -> int:
        return self.engine.chunk_size

    @property
    def segment_size(self) -> int:
        return self.engine.segment_size

    @property
    def log(self) -> Log:
        return self.engine.log

    @property
    def index(self) -> Index:
        """The current index (a cache of the log; replaced when it is rebuilt)."""
        return self.engine.index

    @property
    def last_scan(self) -> ScanReport | None:
        """What the last scan of the log found (at open, on refresh or recovery)."""
        return self.engine.last_scan

    @property
    def evict_written(self) -> bool:
        return self._writer.evict_written if self._writer is not None else False

    # ---- state ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def check(self) -> None:
        """Raise a background failure not reported yet (a failed async save or group-timer
        commit: then it is forgotten); StoreClosedError once closed."""
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")
        if self._pipeline is not None:
            self._pipeline.check()
        if self._timer is not None and self._timer.error is not None:
            err = self._timer.take_error()
            if err is not None:
                raise err

    def _writable(self) -> WriterEngine:
        self.check()
        if self._writer is None:
            raise ReadOnlyStoreError(f'store {self.path} is open read-only (mode="r")')
        return self._writer

    def close(self) -> None:
        """Wait for in-flight async saves, commit pending deltas, release the writer lock and every
        file. Idempotent. Raises a background failure not reported before (after releasing)."""
        err: BaseException | None = None
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.stop()  # before the lock: a timer commit in progress finishes first
            err = timer.take_error()
        if self._pipeline is not None and not self._closed:
            try:
                self._pipeline.close()
            except BaseException as e:  # noqa: BLE001 - re-raised once the files are released
                err = err or e
        with self.engine.locked():
            if not self._closed:
                try:
                    if self._writer is not None and self._writer.group is not None and err is None:
                        self._writer.commit_group()
                finally:
                    self._closed = True
                    self.engine.close()
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
        engine = self._writable()
        with engine.locked():
            self.check()
            _check_iteration(iteration, 0, "iteration must be a non-negative int")
            skeleton, leaves = flatten(state, leaf_hook)
            return engine.save_snapshot(iteration, skeleton, flatten_meta(meta), leaves,
                                        progress=progress)

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
        engine = self._writable()
        with engine.locked():
            self.check()
            _check_iteration(iteration, 1, "delta iteration must be a positive int")
            skeleton, leaves = flatten(record, leaf_hook)
            return engine.append_delta(iteration, skeleton, flatten_meta(meta), leaves, durable)

    def flush(self) -> int | None:
        """Commit every pending delta: fsync their records, append their COMMIT records, fsync
        (the group's commit point). Also waits for every in-flight async save (and commits async
        deltas). Returns :meth:`durable_iteration`. Raises CheckpointAbortedError, naming them,
        when pending deltas cannot be committed because a failed save's leftovers could not be cut
        (recovery then cut the pending deltas too; what was durable stays durable)."""
        if self._pipeline is not None:
            self._pipeline.flush()
        engine = self._writable()
        with engine.locked():
            self.check()
            engine.commit_group()
            return engine.recoverable_latest()

    def pending(self) -> list[int]:
        """Deltas appended with durable=False, or saved asynchronously, and not yet committed
        (lost on a crash)."""
        its = self._writer.staged_iterations() if self._writer is not None else []
        if self._pipeline is not None:
            its = sorted(set(its).union(self._pipeline.pending_deltas()))
        return its

    def tail(self) -> int | None:
        """The newest iteration written by this writer: the newest pending delta, else the latest
        committed iteration (None for an empty store). Readers: the latest committed one."""
        if self._writer is not None:
            return self._writer.tail()
        return self.latest()

    def pending_age(self) -> float:
        """Seconds since the oldest pending delta was appended (0 when none is pending)."""
        since = self._writer.group_since() if self._writer is not None else None
        return time.monotonic() - since if since is not None else 0.0

    def set_group_seconds(self, seconds: float | None) -> None:
        """Bound how long a pending delta stays uncommitted: once the oldest pending delta
        (``save_delta(durable=False)``, or an async delta that does not end its group) is
        ``seconds`` old, a background timer commits the group without waiting for another save,
        flush or close; :meth:`durable_iteration` then includes it. ``None`` turns the timer off.
        With an async pipeline the commit is queued behind the submitted jobs (iteration order);
        a failure of a timer commit is raised like a background failure: by the rolled-back
        deltas' futures, then once by the next call on the store, or by flush/close. See
        :mod:`ckptstore.ops.grouptimer`. Not under the engine lock: stopping joins the timer."""
        if seconds is not None and (isinstance(seconds, bool) or
                                    not isinstance(seconds, (int, float)) or not seconds >= 0):
            raise ValueError(f"group_seconds must be a non-negative number or None, not {seconds!r}")
        engine = self._writable()
        timer = self._timer
        if seconds is None:
            if timer is not None:
                self._timer = None
                engine.on_new_group = None
                timer.stop()
                err = timer.take_error()
                if err is not None:
                    raise err
        elif timer is not None:
            timer.set_seconds(float(seconds))
        else:
            self._timer = GroupTimer(engine.group_since, self._commit_due_group, float(seconds),
                                     name=self.path)
            engine.on_new_group = self._timer.poke

    def _commit_due_group(self, since: float) -> None:
        """The group timer's commit of the group begun at ``since``: queued behind the async
        pipeline's jobs when it runs (iteration order), else committed here under the lock."""
        assert self._writer is not None
        with self._writer.locked():
            if self._pipeline is not None:
                self._pipeline.request_flush()
            else:
                self._writer.commit_group_begun_at(since)

    # ---- asynchronous saves (ckptstore/ops/pipeline.py) -----------------------------------------
    @property
    def pipeline(self) -> Pipeline:
        """The snapshot-then-persist pipeline of this writer (started on first use)."""
        engine = self._writable()
        if self._pipeline is not None:  # no lock: the persister holds it while it writes
            return self._pipeline
        with engine.locked():
            if self._pipeline is None:
                budget, inflight = self._async_limits
                self._pipeline = Pipeline(engine, host_budget=budget, max_inflight=inflight,
                                          commit_round=self._commit_round)
            return self._pipeline

    @property
    def running_pipeline(self) -> Pipeline | None:
        """The async pipeline if an async save started it, else None (never starts it)."""
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

    def stats(self) -> list[AsyncStats]:
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
        committed (flushing its delta group). Never called with the engine lock held."""
        p = self._pipeline
        if p is not None and type(iteration) is int and self.engine.index.get_commit(iteration) is None:
            tail = p.tail()
            if tail is not None and iteration <= tail:
                p.flush()

    def _drain_async(self) -> None:
        """Before a synchronous write: wait for the pipeline (and raise its failure)."""
        if self._pipeline is not None:
            self._pipeline.drain()

    # ---- reading ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Readers: pick up checkpoints committed since open (and follow a gc). Writers: no-op."""
        self.check()
        if isinstance(self.engine, ReaderEngine):
            self.engine.refresh()

    def _sync_view(self) -> None:
        self.check()
        self.engine.sync_view()

    def iterations(self) -> list[int]:
        """Committed, recoverable iterations (snapshots and deltas with an intact chain), ascending."""
        self._sync_view()
        return self.engine.recoverable()

    def latest(self) -> int | None:
        """The newest committed recoverable iteration, or None for an empty store."""
        self._sync_view()
        return self.engine.recoverable_latest()

    def durable_iteration(self) -> int | None:
        """The newest iteration that survives a crash right now: committed (fsynced) and
        recoverable. Pending deltas (durable=False, not yet flushed) are not counted."""
        self._sync_view()
        return self.engine.recoverable_latest()

    def _entry(self, iteration: Any) -> Any:
        self.check()
        return self.engine.entry(iteration)

    def base_of(self, iteration: int) -> int:
        """The base snapshot iteration that ``iteration`` is reconstructed from (itself for a
        snapshot). Raises NotFoundError / DeltaChainError."""
        self._await_inflight(iteration)
        self._entry(iteration)
        return self.engine.chain_base(iteration)

    def kind(self, iteration: int) -> str:
        """"snapshot" (a base) or "delta"."""
        self._await_inflight(iteration)
        return KIND_NAMES.get(self._entry(iteration).commit.kind, "unknown")

    def info(self, iteration: int) -> CheckpointInfo:
        self._await_inflight(iteration)
        c = self._entry(iteration).commit
        return CheckpointInfo(c.iteration, c.created_ns, c.logical_bytes, c.written_bytes,
                              c.snapshot_root.hex(), KIND_NAMES.get(c.kind, "unknown"))

    def manifest(self, iteration: int) -> Manifest:
        """The decoded, verified manifest of a committed iteration."""
        self._await_inflight(iteration)
        self.check()
        return self.engine.manifest(iteration)

    def meta(self, iteration: int) -> Any:
        return unflatten(self.manifest(iteration).meta, lambda i, p: None)

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    into: Callable[[Any], Any] | None = None) -> Any:
        """The state stored for ``iteration`` as written: for a delta, its delta record (not the
        replayed state). Same as :meth:`load` for a snapshot. ``into``: see
        :meth:`ckptstore.engine.read_path.StateReader.load` (read tensors into existing ones)."""
        self._await_inflight(iteration)
        self.check()
        return self.engine.read(lambda: self.engine.load_entry(iteration, keys, None, into))

    def load(self, iteration: int, keys: Sequence[Any] | None = None,
             progress: Callable[[int], None] | None = None, *, into: Any = None) -> Any:
        """The state saved at ``iteration``, bit-exact. ``keys`` selects top-level dict keys and
        reads only their tensors. Raises NotFoundError, DamagedCheckpointError.

        ``into``: tensors to load into instead of fresh ones, in a structure shaped like the
        state (``{"model": model.state_dict(), "optim": opt.state_dict()}``): each stored tensor
        whose path holds a tensor there is read straight into that tensor's memory (a snapshot)
        or copied into it (a replayed delta), and the returned state holds the caller's tensor.
        Paths it lacks are allocated. A dtype or shape mismatch raises
        TargetMismatchError before any target is written (:mod:`ckptstore.inplace`).

        A delta iteration is reconstructed: its chain's base snapshot, then every delta after it
        replayed (:mod:`ckptstore.replay`; DeltaChainError, ReplayDivergenceError).
        Writers: an iteration still in flight in the async pipeline is waited for."""
        self._await_inflight(iteration)
        if self._entry(iteration).commit.kind != KIND_DELTA:
            return self.engine.read(lambda: self.engine.load_entry(iteration, keys, progress,
                                                                   target=into))
        # the whole replay is retried (a writer holds its lock throughout): its read-ahead thread
        # reads records with no lock and no retry of its own, else it would wait on that lock
        state = self.engine.read(lambda: replay_to(
            self, iteration, read_record=lambda it, into: self.engine.load_entry(it, into=into)))
        state = select_keys(state, keys, iteration)
        return state if into is None else copy_into(state, into)

    def replay(self, start: int, stop: int, **options: Any):
        """Yield ``(iteration, state)`` for every iteration in ``start..stop`` (inclusive), each
        reconstructed from the nearest base at or before ``start`` plus the deltas after it.
        See :func:`ckptstore.replay.replay_range` for options and reports."""
        return replay_range(self, start, stop, **options)

    def consistent_reads(self) -> AbstractContextManager[Any]:
        """Held by a thread that reads ahead for :meth:`replay` (readers: one index view per
        read, so the loop body's calls cannot swap it mid-read; writers take their lock per read
        and must not hold it across a wait for the async pipeline)."""
        return self.engine.locked() if self.mode == "r" else nullcontext()

    def diff(self, a: int, b: int) -> list[TensorDiff]:
        """Compare the tensors of two checkpoints by Merkle roots, then chunk addresses (see
        :func:`ckptstore.ops.diff.diff_manifests`)."""
        return diff_manifests(self.manifest(a), self.manifest(b), self.engine.tree_of)

    def bisect(self, predicate: Predicate, start: int | None = None,
               end: int | None = None) -> BisectResult:
        """The first iteration in ``start..end`` (default: every committed one) where
        ``predicate`` holds: "nan", "inf", a meta condition such as "loss > 10", "module:function"
        or a callable taking the state. Assumes that once it holds it keeps holding; loads only
        base snapshots, then replays the one base interval where it flips (meta conditions load
        no tensor). See :mod:`ckptstore.ops.bisect` (BisectError, BisectPredicateError)."""
        return bisect_range(self, predicate, start, end)

    # ---- maintenance ------------------------------------------------------------------------
    def gc(self, keep_last: int, keep_every: int | None = None,
           progress: Callable[[int], None] | None = None) -> GcReport:
        """Apply a retention policy, then compact. See :mod:`ckptstore.ops.gc`."""
        self._drain_async()
        engine = self._writable()
        with engine.locked():
            self.check()
            engine.commit_group()  # gc rebuilds the log's writer: commit pending deltas, never drop them
            engine.recover_if_needed()
            return engine.read(lambda: collect(engine, keep_last=keep_last, keep_every=keep_every,
                                               progress=progress))


def select_keys(state: Any, keys: Sequence[Any] | None, iteration: int) -> Any:
    """The top-level ``keys`` of a loaded ``state`` (all of it for None); NotFoundError names
    the keys it lacks."""
    if keys is None:
        return state
    missing = [k for k in keys if k not in state]
    if missing:
        raise NotFoundError(f"iteration {iteration}: keys {missing} are not in the state (it has "
                            f"{list(state)})")
    return {k: state[k] for k in keys}


def _check_iteration(iteration: Any, low: int, what: str) -> None:
    if type(iteration) is not int or iteration < low or iteration >= 1 << 63:
        raise ValueError(f"{what}, not {iteration!r}")
