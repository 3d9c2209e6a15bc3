"""The Store: the public API over one directory of versioned checkpoints.

A thin facade. The work is done below it, each piece in one place:

* :mod:`ckptstore.engine` -- the writer lock, crash recovery, the commit protocol (one
  :class:`~ckptstore.engine.transaction.Transaction` type), the read path and the reader's view;
* :mod:`ckptstore.ops` -- the async pipeline and the group-commit timer (both held for the
  Store by :mod:`ckptstore.ops.background`), automatic retention
  (:mod:`ckptstore.ops.autoretention`), gc, fsck, diff;
* :mod:`ckptstore.replay` -- rebuilding delta iterations by re-executing optimizer steps.

The Store adds argument checks, flattening of user states, the ordering between the async
pipeline and synchronous calls, and reporting of background failures (raised once by the next
call on the store). A writer (mode "a") holds the single-writer lock; readers (mode "r") never
write under the directory and may run beside the writer.

Automatic retention (:meth:`Store.set_retention`, or ``retention=`` / ``retention_every=`` at
open) runs gc with a retention policy right after every ``every``-th base snapshot this writer
commits: never inside a save (a base commit also commits every pending delta, so no transaction
is open then), in the thread that committed the base (the async pipeline's persister, or the
caller of a synchronous :meth:`Store.save`). It compacts only when the policy removes something,
and a failure is logged and kept in :attr:`Store.last_retention`, never raised into training.
"""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .errors import NotFoundError, RankMismatchError, ReadOnlyStoreError, StoreClosedError
from .errors import RemoteUnsupportedError
from .format.commit import KIND_DELTA, KIND_NAMES
from .format.header import StoreHeader
from .format.manifest import Manifest
from .format.state import flatten, unflatten
from .tensors.inplace import copy_into
from .engine.engine import Engine
from .engine.reader_engine import ReaderEngine
from .engine.write_path import SaveStats, flatten_meta
from .engine.writer_engine import WriterEngine, check_features
from .ops.autoretention import AutoRetention, RetentionRun, check_every, check_retention
from .ops.bisect import BisectResult, Predicate, bisect as bisect_range
from .ops.diff import TensorDiff, diff_manifests
from .ops.gc import GcReport, collect, dry_run as gc_dry_run, gc_policy
from .ops.background import BackgroundWork, check_group_seconds
from .ops.pipeline import AsyncStats, Pipeline
from .ops.retention import Policy
from .remote.uploader import RemoteStatus, Uploader
from .replay.follower import FollowerBases, FollowerRebaser, dropped_by_rebase
from .replay.replayer import replay_range, replay_to
from .storage.fileops import FileOps
from .storage.index import Index
from .storage.job_log import refuse_job_part
from .storage.layout import Layout
from .storage.log import Log, ScanReport
from .tensors import leaf_hook

__all__ = ["CheckpointInfo", "RetentionRun", "Store", "TensorDiff", "flatten_meta", "select_keys"]


@dataclass(frozen=True)
class CheckpointInfo:
    """Summary of one committed checkpoint (from its commit record; no manifest read)."""

    iteration: int
    created_ns: int
    logical_bytes: int
    written_bytes: int
    snapshot_root: str
    kind: str
    #: xxh3-128 (hex) of the manifest the commit names (kept by gc; what identifies the commit)
    manifest_digest: str = ""


class Store:
    """A checkpoint store. Use :func:`ckptstore.open` to create one."""

    def __init__(self, path: str | os.PathLike, mode: str = "a", *, chunk_size: int | None = None,
                 segment_size: int | None = None, file_ops: FileOps | None = None,
                 load_threads: int = 2, host_budget: int | None = None,
                 max_inflight: int | None = None, use_index: bool = True,
                 evict_written: bool = True, direct_io: bool | str = "async",
                 commit_round: Callable[[Callable[[], Any]], Any] | None = None,
                 retention: Policy | None = None, retention_every: int = 1,
                 remote: str | None = None, remote_options: dict | None = None,
                 features: str = "current", _engine: ReaderEngine | None = None) -> None:
        if mode not in ("r", "a"):
            raise ValueError(f'mode must be "r" or "a", not {mode!r}')
        check_features(features)
        check_every(retention_every)  # (retention itself: below, before anything is opened)
        if retention is not None:
            check_retention(retention, os.fspath(path), mode, commit_round)
        self.path = os.fspath(path)
        self.mode = mode
        self.engine: Engine
        self._writer: WriterEngine | None = None
        if mode == "a":
            self._writer = WriterEngine(self.path, chunk_size=chunk_size,
                                        segment_size=segment_size, file_ops=file_ops,
                                        load_threads=load_threads, evict_written=evict_written,
                                        direct_io=direct_io, features=features,
                                        job_stream=commit_round is not None)
            self.engine = self._writer
        else:
            # _engine: a reader ckptstore.open("s3://...", "r") built (ckptstore/remote/reader.py)
            self.engine = _engine if _engine is not None else \
                ReaderEngine(self.path, load_threads=load_threads, use_index=use_index)
        self._closed = False
        #: the follower store's bases, read by load (format-spec/follower.md); opened lazily
        self._followers: FollowerBases | None = None
        #: how the async pipeline runs a committing job (a multi-rank store's global round)
        self._commit_round = commit_round
        # the async pipeline, started by the first async save, and the group-commit timer,
        # started by set_group_seconds (ckptstore/ops/background.py)
        self._bg = BackgroundWork(self.path, host_budget, max_inflight, commit_round,
                                  self._after_base)
        self._meta_cache: dict[int, Any] = {}
        # automatic retention (set_retention; ckptstore/ops/autoretention.py)
        self._auto = AutoRetention(self.path, self._meta_cache)
        if retention is not None:
            self._auto.set(retention, retention_every)
        # the remote tier (ckptstore/remote/): uploads commits in the background
        self._remote: Uploader | None = None
        if remote is not None:
            if self._writer is None:
                self.close()
                raise RemoteUnsupportedError(
                    f"{self.path}: remote= needs a writer (mode=\"a\"); to read a remote copy, "
                    "open its URL: ckptstore.open(\"s3://...\", mode=\"r\")")
            try:
                self._remote = Uploader(self._writer, remote, remote_options)
            except BaseException:
                self.close()
                raise

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
        self._bg.check()

    def _writable(self) -> WriterEngine:
        self.check()
        if self._writer is None:
            raise ReadOnlyStoreError(f'store {self.path} is open read-only (mode="r")')
        return self._writer

    def close(self) -> None:
        """Wait for in-flight async saves, commit pending deltas, release the writer lock and every
        file. Idempotent. Raises a background failure not reported before (after releasing)."""
        # before the lock: a timer commit in progress finishes first; in-flight saves end
        err = self._bg.stop(self._closed)
        if self._remote is not None and not self._closed:
            # the final upload: pending deltas committed first, so the remote copy ends where
            # the local store does (bounded by close_timeout; a remote failure is only logged)
            try:
                with self.engine.locked():
                    if self._writer is not None and self._writer.group is not None and err is None:
                        self._writer.commit_group()
            except BaseException as e:  # noqa: BLE001 - re-raised once the files are released
                err = err or e
            self._remote.close()
        if self._followers is not None:
            self._followers.close()
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
            stats = engine.save_snapshot(iteration, skeleton, flatten_meta(meta), leaves,
                                         progress=progress)
        self._after_base(iteration)  # committed: automatic retention, when due
        return stats

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
        self._bg.flush()
        engine = self._writable()
        with engine.locked():
            self.check()
            engine.commit_group()
            return engine.recoverable_latest()

    def pending(self) -> list[int]:
        """Deltas appended with durable=False, or saved asynchronously, and not yet committed
        (lost on a crash)."""
        return self._bg.pending(self._writer.staged_iterations() if self._writer is not None
                                else [])

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
        check_group_seconds(seconds)
        self._bg.set_group_seconds(self._writable(), None if seconds is None else float(seconds))

    # ---- asynchronous saves (ckptstore/ops/pipeline.py) -----------------------------------------
    @property
    def pipeline(self) -> Pipeline:
        """The snapshot-then-persist pipeline of this writer (started on first use)."""
        return self._bg.pipeline_of(self._writable())

    @property
    def running_pipeline(self) -> Pipeline | None:
        """The async pipeline if an async save started it, else None (never starts it)."""
        return self._bg.running

    def save_async(self, iteration: int, state: Any, meta: dict | None = None, *,
                   deferred: Callable[[Any], bool] | None = None):
        """Snapshot ``state`` into host buffers and return a ``concurrent.futures.Future`` at once;
        hashing, compression, writing, fsync and commit run in a background thread, in iteration
        order. The future's result (an :class:`ckptstore.ops.pipeline.AsyncStats`) is set when the
        checkpoint is durable. Mutating the live tensors after this returns does not affect what
        is stored. A background failure is raised by the future, by the next call on the store
        and by flush/close; the failed checkpoint (and anything queued after it) is rolled back.
        See :mod:`ckptstore.ops.pipeline`.

        ``deferred`` (an overlapped snapshot, CheckFreq's rule): CPU tensors for which it returns
        True are copied by a background thread after this returns; the caller must not change
        them until the future's ``copied()`` returns (a change seen meanwhile fails the
        checkpoint with LiveStateChangedError). :mod:`ckptstore.ops.deferred_copy`."""
        return self.pipeline.submit("snapshot", iteration, state, meta, deferred=deferred)

    def save_delta_async(self, iteration: int, record: Any, meta: dict | None = None, *,
                         durable: bool = True):
        """:meth:`save_delta` through the pipeline: returns a future resolved once the delta is
        committed (with ``durable=False``: by a later durable save, :meth:`flush` or close)."""
        return self.pipeline.submit("delta", iteration, record, meta, commit=durable)

    def stats(self) -> list[AsyncStats]:
        """Per-checkpoint statistics of this writer's async saves (stall, snapshot, persist
        times, bytes, queue depth), oldest first (the last 10,000)."""
        return self._bg.stats()

    def set_async_limits(self, host_budget: int | None = None, max_inflight: int | None = None) -> None:
        """Change the host-memory budget (bytes) and/or the maximum of checkpoints in flight
        (writers; ReadOnlyStoreError on a reader, which has no pipeline)."""
        self._writable()
        self._bg.set_limits(host_budget, max_inflight)

    def _await_inflight(self, iteration: Any) -> None:
        """Writers: a read of an iteration still in the async pipeline waits until it is
        committed (flushing its delta group). Never called with the engine lock held."""
        self._bg.await_inflight(self.engine, iteration)

    def _drain_async(self) -> None:
        """Before a synchronous write: wait for the pipeline (and raise its failure)."""
        self._bg.drain()

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

    @property
    def world_size(self) -> int | None:
        """1: a single store is the one-rank case of :attr:`ckptstore.JobStore.world_size` (a
        writer, or a store holding a committed iteration); None: a reader of an empty store."""
        return 1 if self._writer is not None or self.latest() is not None else None

    def stream(self, iteration: int, rank: int | None = None) -> "Store":
        """This store, once ``iteration`` is committed in it (NotFoundError otherwise) and
        ``rank`` is None or 0 (RankMismatchError otherwise): the one-rank case of
        :meth:`ckptstore.JobStore.stream`, the store holding ``rank``'s records of ``iteration``."""
        self._await_inflight(iteration)
        self._entry(iteration)
        if rank is not None and (type(rank) is not int or rank != 0):
            raise RankMismatchError(f"rank {rank!r} is not among the 1 ranks that committed "
                                    f"iteration {iteration} in {self.path}")
        return self

    # ---- the remote tier (remote="s3://...", ckptstore/remote/) -------------------------------
    @property
    def uploader(self) -> Uploader | None:
        """The background uploader (None: opened without ``remote=``)."""
        return self._remote

    def _remote_tier(self) -> Uploader:
        if self._remote is None:
            raise RemoteUnsupportedError(f"{self.path} was opened without remote=")
        return self._remote

    def remote_iteration(self) -> int | None:
        """The newest iteration that survives losing this machine: the newest recoverable
        iteration of the remote HEAD (None while the remote copy holds none). The remote copy
        follows the local log (at most one HEAD per ``head_interval`` seconds):
        :meth:`remote_flush` waits for it. RemoteUnsupportedError without ``remote=``."""
        head = self._remote_tier().head
        return None if head is None else head.recoverable

    def remote_status(self) -> RemoteStatus:
        """Where the remote copy stands: its iteration and HEAD generation, whether it is behind
        the local store, bytes sent, and the last upload failure (a typed RemoteError, retried
        with backoff; training is never interrupted by it). Also after close."""
        return self._remote_tier().status()

    def remote_flush(self, timeout: float | None = None) -> int | None:
        """Wait until the remote copy holds every iteration durable locally now (without waiting
        for ``head_interval``); returns :meth:`remote_iteration`. Raises the uploader's last
        RemoteError when that does not happen within ``timeout`` seconds (local data is never
        affected), RemoteConflictError at once when the URL holds another or a newer store."""
        head = self._remote_tier().flush(timeout)
        return head.recoverable

    def remote_read_stats(self) -> Any:
        """What a store opened from an object store (``ckptstore.open("s3://...", "r")``) has
        fetched since it opened: bytes, requests, cache hits, whether it reads byte ranges or
        fetched the segments whole, and whether the remote index serves it
        (:class:`ckptstore.remote.reader.RemoteReadStats`). RemoteUnsupportedError otherwise."""
        stats = getattr(self.engine, "remote_stats", None)
        if stats is None:
            raise RemoteUnsupportedError(f"{self.path} was not opened from an object store")
        return stats()

    @property
    def remote_bytes_read(self) -> int:
        """Bytes fetched from the object store since open (:meth:`remote_read_stats`)."""
        return int(self.remote_read_stats().bytes_read)

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
                              c.snapshot_root.hex(), KIND_NAMES.get(c.kind, "unknown"),
                              c.manifest_digest.hex())

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
        TargetMismatchError before any target is written (:mod:`ckptstore.tensors.inplace`).

        A delta iteration is reconstructed: its chain's base snapshot, then every delta after it
        replayed (:mod:`ckptstore.replay`; DeltaChainError, ReplayDivergenceError); when a
        follower store (``<path>/follower/``, format-spec/follower.md) holds a newer base of the
        same history, from that base instead (one that does not match or fails is skipped with a
        FollowerWarning). Writers: an iteration still in flight in the async pipeline is waited
        for."""
        self._await_inflight(iteration)
        try:
            entry = self._entry(iteration)
        except NotFoundError as e:
            dropped = dropped_by_rebase(self, iteration)
            if dropped is None:
                raise
            raise dropped from e
        if entry.commit.kind != KIND_DELTA:
            return self.engine.read(lambda: self.engine.load_entry(iteration, keys, progress,
                                                                   target=into))
        # the whole replay is retried (a writer holds its lock throughout): its read-ahead thread
        # reads records with no lock and no retry of its own, else it would wait on that lock
        def replay(source: Any) -> Any:
            return self.engine.read(lambda: replay_to(
                source, iteration, read_record=lambda it, into: self.engine.load_entry(it, into=into)))

        state = self._follower_bases().replay(iteration, replay)
        if state is None:
            state = replay(self)
        state = select_keys(state, keys, iteration)
        return state if into is None else copy_into(state, into)

    def _follower_bases(self) -> FollowerBases:
        if self._followers is None:
            self._followers = FollowerBases(self, lambda path: Store(path, "r"))
        return self._followers

    def load_base(self, iteration: int) -> tuple[str, int]:
        """Where :meth:`load` of ``iteration`` starts: ``("follower", b)`` when the follower store
        holds a base ``b`` of this history with ``base_of(iteration) < b <= iteration`` (the
        newest; format-spec/follower.md), else ``("primary", base_of(iteration))``. Reads
        identities only: a follower base that then fails to read is skipped by the load."""
        self._await_inflight(iteration)
        self._entry(iteration)
        if self.kind(iteration) == "delta":
            found = self._follower_bases().candidates(iteration)
            if found:
                return "follower", found[0]
        return "primary", self.base_of(iteration)

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
    def gc(self, keep_last: int | None = None, keep_every: int | None = None,
           progress: Callable[[int], None] | None = None, *, policy: Policy | None = None,
           dry_run: bool = False, now_ns: int | None = None,
           follower_bases: bool = False) -> GcReport:
        """Apply a retention policy, then compact (:mod:`ckptstore.ops.gc`).

        The policy is the union of ``KeepLast(keep_last)``, ``KeepEvery(keep_every)`` and
        ``policy`` (any of :mod:`ckptstore.ops.retention`; at least one is needed). Kept: what it
        selects, the latest iteration, and every base and delta a kept delta needs. A policy that
        selects no iteration raises RetentionError and nothing is removed. ``now_ns``: the time
        ``KeepNewerThan`` measures ages from (default: now).

        ``follower_bases`` (opt-in): a kept delta's chain may end at a delta for which the
        shadow follower's store (``<path>/follower/``) holds a base that passes every check
        (identity, chunks, the delta's fingerprint, its scheduler/RNG/buffer states, and an exact
        replay up to the next fingerprinted delta): gc copies that base into this store as a
        snapshot of that iteration and drops the deltas before it that the policy does not keep.
        The result needs nothing of the follower store. Iterations dropped so are gone like any
        gc-removed one (NotFoundError). ``report.rebased`` lists the deltas replaced,
        ``report.rebase_skipped`` the follower bases refused and why (format-spec/follower.md §6).

        ``dry_run``: plan only and return the report gc would give, ``bytes_after`` estimated
        (``report.estimated``) from the index; nothing is removed or compacted (follower bases
        are verified as gc would). Works on readers (mode "r": nothing under the directory is
        written). On a writer it first commits what is pending, as gc does, so it reports what
        gc would do now."""
        pol = gc_policy(keep_last, keep_every, policy)
        # a rank's stream (also the job writer's own, which JobStore.stream hands out) lies
        # under <job>/streams/: JobStreamError
        refuse_job_part(self.path, "gc")
        rebase = self._rebaser() if follower_bases else None
        try:
            if dry_run and self._writer is None:
                with self.engine.locked():
                    self._sync_view()
                    engine = self.engine
                    return engine.read(lambda: gc_dry_run(engine, pol, now_ns, rebase=rebase))
            self._drain_async()
            writer = self._writable()
            with writer.locked():
                self.check()
                writer.commit_group()  # gc rebuilds the log's writer: commit pending deltas, never drop them
                writer.recover_if_needed()
                if dry_run:
                    return writer.read(lambda: gc_dry_run(writer, pol, now_ns, self._meta_cache,
                                                          rebase))
                return writer.read(lambda: collect(writer, policy=pol, progress=progress,
                                                   now_ns=now_ns, meta_cache=self._meta_cache,
                                                   rebase=rebase))
        finally:
            if rebase is not None:
                rebase.close()

    def _rebaser(self) -> FollowerRebaser:
        return FollowerRebaser(self, lambda path: Store(path, "r"))

    # ---- automatic retention ------------------------------------------------------------------
    def set_retention(self, policy: Policy | None, every: int = 1) -> None:
        """Apply ``policy`` automatically: a gc runs right after every ``every``-th base snapshot
        this writer commits (counted from this call; ``None`` turns it off).

        When: a base commit also commits every pending delta, so no transaction is open and no
        save is in progress; the gc runs in the thread that committed the base. With async saves
        (the Checkpointer's default) that is the pipeline's persister: training goes on and
        waits only when it fills ``max_inflight`` / ``host_budget`` while the gc runs, or calls
        a synchronous store method. With synchronous saves :meth:`save` returns after the gc.
        A gc copies every kept checkpoint, so it costs about the kept bytes (each unique chunk
        once): raise ``every`` to amortise it. A run whose policy removes nothing writes nothing.

        Never raises into the save: a failure (RetentionError when the policy selects nothing,
        an I/O error, damage) is logged (logger ``ckptstore``, WARNING) and kept in
        :attr:`last_retention`; nothing is removed then. A rank's stream of a job store is
        refused (RetentionError): its retention is the job's (:meth:`JobStore.set_retention`)."""
        check_every(every)
        if policy is not None:
            check_retention(policy, self.path, self.mode, self._commit_round)
        self._writable()
        self._auto.set(policy, every)

    @property
    def retention(self) -> Policy | None:
        """The automatic retention policy (None: off)."""
        return self._auto.policy

    @property
    def last_retention(self) -> RetentionRun | None:
        """The latest automatic retention run of this writer, or None."""
        return self._auto.last

    def _after_base(self, iteration: int) -> None:
        """Called once base snapshot ``iteration`` is committed (by :meth:`save`, or by the
        pipeline's persister between jobs): run the automatic gc when due. Never raises."""
        if self._writer is not None:
            self._auto.after_base(self._writer, iteration, lambda: self._closed)


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
