"""JobStore: one store directory written by every rank of a training job (format-spec §22).

Opening for writing (collective: every rank of ``process_group`` opens the store at once):

1. each rank creates the store's dedicated gloo group (:class:`~.group.RankGroup`);
2. the coordinator (rank 0) creates the job store if needed, claims the next writer epoch
   (an exclusively created global log), reads which commits it continues (the latest visible
   one) and writes the epoch's EPOCH record;
3. the epoch is broadcast; each rank opens its own stream for the epoch (a v1 store under
   ``streams/``), and the ranks tell each other that they are ready;
4. each stream's commit hook becomes the rank's :class:`~.committer.GlobalCommitter`: from now
   on every commit of a stream is one global commit round.

Saves (``save``, ``save_delta``, ``flush``, ``close``) are collective too: every rank makes the
same calls with the same iterations. Each commit operation is one round on every rank; a rank
whose operation fails before its records are durable votes FAILED in that round, so the others
abort too instead of waiting (bounded by ``commit_timeout`` for a rank that never answers).

Reading needs no group: ``iterations``/``latest`` come from the global logs; ``load(t)`` reads
this rank's state at ``t`` (``rank=`` another's) from the stream the global commit names, after
checking that the stream's local COMMIT is the one the global commit recorded.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Iterator, Sequence, TypeVar

from ..errors import (CkptStoreError, NotFoundError, ReadOnlyStoreError, RemoteUnsupportedError,
                      StoreClosedError, StoreNotFoundError)
from ..engine.writer_engine import WriterEngine, check_features
from ..format.job import GlobalCommit
from ..storage.fileops import FileOps
from ..storage.job_log import EpochLog, JobLayout, JobView, read_job_header, read_job_view
from ..store import CheckpointInfo, SaveStats, Store
from ..ops.retention import Policy
from ..remote.job_uploader import JobRemote
from .committer import GlobalCommitter
from .dtensor_state import rank_part
from .group import RankGroup
from .job_collect import (GcTrash, JobRetentionRun, RetentionSchedule, check_retention_args,
                          collect_while_writing)
from .job_history import bisect_job, diff_job, replay_job, shard_sections
from .job_load import base_rank, combine_parts, load_job, load_start, reading_rank
from .job_follower import JobFollowerBases
from .job_streams import StreamReaders, check_stream
from .job_open import StreamOptions, agree_epoch, claim_epoch, open_streams
from .prepared import PreparedCommits

T = TypeVar("T")

#: default bound on how long a rank waits for the others in a commit round (seconds)
DEFAULT_COMMIT_TIMEOUT = 300.0


class JobStore:
    """A multi-rank job store. Use ``ckptstore.open(path, mode, process_group=pg)``."""

    def __init__(self, path: str | os.PathLike, mode: str = "a", *, process_group: Any = None,
                 commit_timeout: float = DEFAULT_COMMIT_TIMEOUT, chunk_size: int | None = None,
                 segment_size: int | None = None, file_ops: FileOps | None = None,
                 load_threads: int = 2, evict_written: bool = True,
                 direct_io: bool | str = "async",
                 host_budget: int | None = None, max_inflight: int | None = None,
                 features: str = "current", retention: Policy | None = None,
                 retention_every: int = 1, remote: str | None = None,
                 remote_options: dict | None = None,
                 _streams: Callable[[int, int], Store] | None = None,
                 _read_stats: Callable[[list[Any]], Any] | None = None) -> None:
        if mode not in ("r", "a"):
            raise ValueError(f'mode must be "r" or "a", not {mode!r}')
        check_features(features)
        self.path = os.fspath(path)
        self.mode = mode
        self.layout = JobLayout(self.path)
        self._ops = file_ops or FileOps()
        self._load_threads = load_threads
        self._closed = False
        #: the view is extended by the thread that commits (the async persister) and read by any
        self._view_lock = threading.Lock()
        self._view: JobView
        #: readers of rank streams (the argument _streams opens one: a remote job's lazy reader,
        #: ckptstore/remote/job_pull.py; None: the stream directory under path)
        self._streams = StreamReaders(self.layout, load_threads, _streams)
        #: a job opened from an object store: what it fetched, given its streams' stats
        self._read_stats = _read_stats
        #: the shadow follower's bases (<path>/follower/, format-spec/follower.md §7), read by load
        self._followers = JobFollowerBases(self)
        self._own: Store | None = None
        self._group: RankGroup | None = None
        self._committer: GlobalCommitter | None = None
        self._epoch_log: EpochLog | None = None
        #: DCP's commit variant: this rank's prepared commit awaiting its outcome (.prepared)
        self._prepared: PreparedCommits | None = None
        self.epoch: int | None = None
        #: this process's rank (None: a reader opened without a process group)
        self.rank: int | None = None
        #: automatic retention (set_retention; None: off)
        self._schedule: RetentionSchedule | None = None
        self._last_retention: JobRetentionRun | None = None
        #: rank 0: what the last gc moved to gc-trash/, deleted in a thread
        self._trash = GcTrash(self.layout.gc_trash_dir)
        if retention is not None or retention_every != 1:
            check_retention_args(retention, retention_every)
        #: the remote tier (format-spec/remote.md §8.3; None: opened without remote=)
        self._remote: JobRemote | None = None
        if remote is not None:
            if mode != "a":
                raise ReadOnlyStoreError(f'store {self.path} is open read-only (mode="r"): '
                                         "remote= needs a writer")
            self._remote = JobRemote(remote, remote_options)
        if mode == "a":
            if process_group is None:
                raise ValueError("writing a multi-rank store needs process_group=...")
            self._stream_options = StreamOptions(chunk_size, segment_size, evict_written,
                                                 direct_io, host_budget, max_inflight, features)
            self._open_writer(process_group, commit_timeout)
            if retention is not None:
                self._schedule = RetentionSchedule(retention, retention_every)
        elif retention is not None:
            raise ReadOnlyStoreError(f'store {self.path} is open read-only (mode="r"): no '
                                     "retention")
        else:
            if not os.path.exists(self.layout.store_file):
                raise StoreNotFoundError(f"no store at {self.path}")
            self.header = read_job_header(self.layout)
            if process_group is not None:
                import torch.distributed as dist
                self.rank = dist.get_rank(process_group)
            self._view = read_job_view(self.layout, self.header.store_id)

    # ---- opening ------------------------------------------------------------------------------
    def _open_writer(self, process_group: Any, timeout: float) -> None:
        group = self._group = RankGroup(process_group, timeout, label=self.path)
        self.rank = group.rank
        try:
            self._start_epoch(group)
        except BaseException:
            self._release()
            raise

    def _start_epoch(self, group: RankGroup) -> None:
        """Steps 2-4 of opening (module docstring) over ``group``: claim a new writer epoch,
        open this rank's stream for it, install the committer. Also how a writer goes on after
        its own gc (:meth:`_collect_while_writing`). Collective."""
        opts = self._stream_options
        epoch_log, epoch, adopted = agree_epoch(
            group, self.path,
            lambda: claim_epoch(self.layout, self._ops, group.world_size, opts.chunk_size,
                                opts.segment_size))
        if epoch_log is not None:
            self._epoch_log = epoch_log
        self.epoch = epoch
        committer = GlobalCommitter(group, epoch, self._epoch_log, self.path)
        committer.adopted_latest = adopted
        committer.on_commit = self.learn
        self._committer = committer

        def open_own() -> Store:
            self.header = read_job_header(self.layout)
            remote = (self._remote.stream_options(epoch, group.rank)
                      if self._remote is not None else {})
            return opts.open(self.layout, epoch, group.rank, self.header, self._ops,
                             self._load_threads, committer.around, remote)

        self._own = open_streams(group, self.path, open_own, lambda: self.header.store_id)
        assert self._own is not None and isinstance(self._own.engine, WriterEngine)
        self._own.engine.commit_hook = committer.hook
        with self._view_lock:
            self._view = read_job_view(self.layout, self.header.store_id)
        if self._remote is not None:
            self._remote.started(self.path, epoch, group.rank, self._own)

    def _release(self) -> None:
        if self._remote is not None:
            self._remote.stop()
        if self._own is not None:
            try:
                self._own.close()
            except CkptStoreError:
                pass
        self._streams.close()
        self._followers.close()
        if self._epoch_log is not None:
            self._epoch_log.close()
        if self._group is not None:
            self._group.close()

    # ---- state --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int | None:
        """Ranks of the job that wrote the newest epoch (None: nothing written yet)."""
        if self._group is not None:
            return self._group.world_size
        return self._view.epoch.world_size if self._view.epoch is not None else None

    @property
    def view(self) -> JobView:
        """The committed state from the global logs (as of open, the last refresh, or the last
        commit of this writer; the async persister extends it: read under no assumption that it
        stays still)."""
        return self._view

    @property
    def group(self) -> RankGroup | None:
        """The store's own gloo group over the job's ranks (writers), for collectives such as
        a parallel restore (ckptstore/torch/dp_restore.py)."""
        return self._group

    @property
    def chunk_size(self) -> int:
        """The job's chunk size (its STORE file's; every stream is created with it)."""
        return int(self.header.chunk_size)

    @property
    def segment_size(self) -> int:
        return int(self.header.segment_size)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")
        if self._prepared is not None:
            self._prepared.learn()  # a DCP save committed since: index it (never cuts)

    def _writer(self) -> tuple[Store, GlobalCommitter]:
        self._check()
        if self._own is None or self._committer is None:
            raise ReadOnlyStoreError(f'store {self.path} is open read-only (mode="r")')
        if self._prepared is not None:
            self._prepared.keep()  # another write follows a DCP prepare: never cut it from now
        return self._own, self._committer

    @property
    def prepared(self) -> PreparedCommits:
        """This rank's DCP commits (ckptstore.dcp's writer; format-spec/format.md §22.6)."""
        self._check()
        if self._own is None or self._committer is None:  # (not _writer(): it keeps a held commit)
            raise ReadOnlyStoreError(f'store {self.path} is open read-only (mode="r")')
        if self._prepared is None:
            self._prepared = PreparedCommits(self, self._own, self._committer)
        return self._prepared

    def close(self) -> None:
        """Writers (collective): commit pending deltas (one round), then release everything."""
        if self._closed:
            return
        err: BaseException | None = None
        try:
            if self._own is not None and self._committer is not None and \
                    self._committer.broken is None:
                own = self._own
                if self._async():
                    own.close()  # its pipeline's last flush is the last round
                else:
                    self._round(own.flush)
                if self._remote is not None and self._group is not None:
                    self._remote.finish(own, self._group, self._group.rank)
        except BaseException as e:  # noqa: BLE001 - raised after the files are released
            err = e
        finally:
            self._closed = True
            self._trash.join()
            self._release()
        if err is not None:
            raise err

    def __enter__(self) -> "JobStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<ckptstore.JobStore {self.path!r} mode={self.mode!r} rank={self.rank} "
                f"world_size={self.world_size} epoch={self.epoch}>")

    # ---- writing (collective) -------------------------------------------------------------------
    def learn(self, commits: list[GlobalCommit]) -> None:
        """Add global commits this rank learned to its view: the committer's report of each
        round's (from whichever thread commits), or a DCP save's prepared commit found named in
        the global log (ckptstore/multirank/prepared.py)."""
        with self._view_lock:
            for g in commits:
                self._view.commits[g.iteration] = g

    def _round(self, operation: Callable[[], T]) -> T:
        """Run one synchronous commit operation of this rank's stream as one global round."""
        _, committer = self._writer()
        return committer.around(operation)

    def _async(self) -> bool:
        """Once the async pipeline runs, every commit goes through it (one thread runs rounds)."""
        return self._own is not None and self._own.running_pipeline is not None

    def _pipe(self) -> Any:
        """The pipeline, used directly: its submit and flush queue this rank's round even when a
        background failure is pending (the Store's own methods would raise it first, and the
        other ranks would wait for this rank's vote)."""
        own, _ = self._writer()
        return own.running_pipeline or own.pipeline

    def save(self, iteration: int, state: Any, meta: dict | None = None) -> SaveStats:
        """Every rank saves its own ``state`` as the checkpoint of ``iteration``; it is committed
        on every rank or on none. Pending deltas are committed first (a round of their own)."""
        self._writer()
        if self._async():
            return self.save_async(iteration, state, meta).result().save
        self._before_base(iteration)
        own, _ = self._writer()
        self._round(own.flush)
        # (inside the round: a rank whose state cannot be cut into its part votes FAILED)
        return self._round(lambda: own.save(iteration, rank_part(self, state), meta))

    def fail_save(self, error: BaseException) -> None:
        """This rank's part of a collective :meth:`save` failed before ``save`` could be called
        (making its state: ``error``): run the rounds ``save`` runs on the other ranks (the
        commit of pending deltas, then the save's own, voting FAILED with ``error``), so they
        abort at once instead of waiting for this rank's vote until ``commit_timeout``. Raises
        only what ``save`` raises before any round (a closed or read-only store), or ValueError
        while the async pipeline runs (its persister runs this rank's rounds); the caller raises
        ``error``."""
        self._writer()
        if self._async():
            raise ValueError("fail_save() while the async pipeline runs this rank's rounds")
        self._before_base(None)  # (the other ranks' save runs it first)
        own, committer = self._writer()

        def fail() -> None:
            raise error

        try:
            self._round(own.flush)
            committer.around(fail)
        except BaseException:  # noqa: BLE001 - error itself, or the flush round's (every rank's)
            pass

    def save_delta(self, iteration: int, record: Any, meta: dict | None = None, *,
                   durable: bool = True) -> SaveStats | None:
        """:meth:`ckptstore.Store.save_delta` on every rank; ``durable`` deltas are committed
        globally at once, the others at the next ``flush``/``save``/``close``. Once the async
        pipeline runs, a non-durable delta returns None when it is appended."""
        own, _ = self._writer()
        if self._async():
            fut = self.save_delta_async(iteration, record, meta, durable=durable)
            if not durable:
                self._pipe().wait()
                return None
            return fut.result().save
        if not durable:
            return own.save_delta(iteration, record, meta, durable=False)
        return self._round(lambda: own.save_delta(iteration, record, meta, durable=True))

    def flush(self) -> int | None:
        """Commit every rank's pending deltas (one round). Returns :meth:`durable_iteration`."""
        own, _ = self._writer()
        if self._async():
            self._pipe().flush()
        else:
            self._round(own.flush)
        return self.durable_iteration()

    # ---- asynchronous saves (collective: the same calls on every rank) ----------------------
    @property
    def pipeline(self) -> Any:
        """This rank's async pipeline (started on first use); its persister runs every commit
        round from then on."""
        own, _ = self._writer()
        return own.pipeline

    @property
    def running_pipeline(self) -> Any:
        return self._own.running_pipeline if self._own is not None else None

    def save_async(self, iteration: int, state: Any, meta: dict | None = None, *,
                   deferred: Callable[[Any], bool] | None = None) -> Any:
        """:meth:`ckptstore.Store.save_async` on every rank: the future resolves once the
        iteration is committed globally (its round runs in the background)."""
        self._writer()
        self._before_base(iteration)
        pipe = self._pipe()
        try:
            part = rank_part(self, state)
        except BaseException as e:
            pipe.fail_round(e)  # (as a failed submit does: the other ranks abort at once)
            raise
        return pipe.submit("snapshot", iteration, part, meta, deferred=deferred)

    def set_async_limits(self, host_budget: int | None = None, max_inflight: int | None = None) -> None:
        """:meth:`ckptstore.Store.set_async_limits` of this rank's stream (each rank its own
        host memory; not collective)."""
        own, _ = self._writer()
        own.set_async_limits(host_budget, max_inflight)

    def save_delta_async(self, iteration: int, record: Any, meta: dict | None = None, *,
                         durable: bool = True) -> Any:
        return self._pipe().submit("delta", iteration, record, meta, commit=durable)

    def stats(self) -> list[Any]:
        return self._own.stats() if self._own is not None else []

    def pending(self) -> list[int]:
        return self._own.pending() if self._own is not None else []

    def tail(self) -> int | None:
        """The newest iteration this rank wrote (pending or committed), or the latest global
        commit when later (an earlier epoch's)."""
        own = self._own.tail() if self._own is not None else None
        latest = self.latest()
        return own if latest is None or (own is not None and own > latest) else latest

    def mark_broken(self, error: CkptStoreError) -> None:
        """A collective of this job failed outside a commit round (a parallel restore's
        exchange): no further round may run on the group."""
        if self._committer is not None and self._committer.broken is None:
            self._committer.broken = error

    def check(self) -> None:
        """Raise a background failure not reported yet (the async pipeline's), then why no commit
        round can run any more (a failed rank, a newer job), if so."""
        self._check()
        if self._own is not None:
            self._own.check()
        if self._committer is not None and self._committer.broken is not None:
            raise self._committer.broken

    def pending_age(self) -> float:
        return self._own.pending_age() if self._own is not None else 0.0

    def set_group_seconds(self, seconds: float | None) -> None:
        if seconds is not None:
            raise ValueError("a multi-rank store commits deltas at the same calls on every rank; "
                             "a timer would fire at different moments on each (use "
                             "group_commit counts or flush())")

    # ---- reading ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Readers: pick up global commits made since open."""
        self._check()
        if self._own is None:
            view = read_job_view(self.layout, self.header.store_id)
            with self._view_lock:
                self._view = view
            self._streams.retain(set(view.chain))  # (a gc's: the old epochs' streams are gone)
            self._streams.refresh()

    def iterations(self) -> list[int]:
        self._check()
        with self._view_lock:
            return list(self._view.commits)

    def latest(self) -> int | None:
        self._check()
        with self._view_lock:
            return self._view.latest

    def durable_iteration(self) -> int | None:
        """The newest iteration committed on every rank (the global log's)."""
        return self.latest()

    def global_commit(self, iteration: int) -> GlobalCommit:
        self._check()
        with self._view_lock:
            g = self._view.commits.get(iteration) if type(iteration) is int else None
        if g is None:
            raise NotFoundError(f"iteration {iteration!r} is not committed in {self.path}")
        return g

    def stream(self, iteration: int, rank: int | None = None) -> Store:
        """The store (a v1 stream) holding ``rank``'s records of ``iteration``, checked against
        the global commit: DamagedCheckpointError, naming the rank and the stream, when its
        commit is missing or differs."""
        g = self.global_commit(iteration)
        r = self.reading_rank(rank, g)
        if self._own is not None and (g.epoch, r) == (self.epoch, self.rank):
            store = self._own
        else:
            store = self._streams.open(g.epoch, r)
        return check_stream(store, g, r, self.path, self.layout.stream_dir(g.epoch, r))

    def reading_rank(self, rank: int | None, g: GlobalCommit) -> int:
        """The rank whose records a read of ``g``'s iteration with ``rank=`` reads
        (:func:`~.job_load.reading_rank`)."""
        return reading_rank(self, rank, g)

    def load(self, iteration: int, keys: Sequence[Any] | None = None, *,
             rank: int | None = None, into: Any = None) -> Any:
        """The state at ``iteration``, bit-exact (a delta is replayed within its stream).
        ``into``: tensors to fill, as in :meth:`ckptstore.Store.load` (here always copied into
        once the state is merged).

        With ``rank``: what that rank saved (its part, for a partitioned Checkpointer state).
        Without: the job's state. When the ranks' states are parts of one data-parallel state
        (:mod:`ckptstore.replay.partition`) or sharded parts (FSDP2: every tensor assembled
        whole from its shards, :mod:`ckptstore.replay.shards`), every part is loaded and they
        are merged, with this rank's own RNG and scheduler states (rank 0's for a reader
        without a group); otherwise this process's rank's state (:func:`~.job_load.load_job`)."""
        return load_job(self, iteration, keys, rank, into, self._followers)

    def combine_parts(self, g: GlobalCommit, part: Callable[[int], Any],
                      keys: Sequence[Any] | None) -> Any:
        """The job's state at ``g.iteration`` from its ranks' states (shared by :meth:`load` and
        :meth:`replay`; :func:`~.job_load.combine_parts`)."""
        return combine_parts(self, g, part, keys)

    def replay(self, start: int, stop: int, *, rank: int | None = None
               ) -> Iterator[tuple[int, Any]]:
        """Yield ``(iteration, state)`` for every iteration in ``start..stop`` (inclusive), each
        rank's part replayed within its stream and combined as :meth:`load` combines them (with
        ``rank``: that rank's part only); the range may cross epochs and world sizes
        (:func:`~.job_history.replay_job`)."""
        return replay_job(self, start, stop, rank)

    def manifest(self, iteration: int, *, rank: int | None = None) -> Any:
        """The decoded, verified manifest of ``rank``'s record of ``iteration`` (default: this
        process's rank; a reader of a 1-rank job: rank 0)."""
        return self.stream(iteration, rank).manifest(iteration)

    def diff(self, a: int, b: int, *, rank: int | None = None) -> list[Any]:
        """:meth:`ckptstore.Store.diff` of what ``rank`` stored at ``a`` and ``b``; a reader of a
        job of several ranks without ``rank``: every rank's, paths prefixed ``rank<r>/``
        (:func:`~.job_history.diff_job`)."""
        return diff_job(self, a, b, rank)

    def shard_sections(self, iteration: int) -> list[dict] | None:
        """Every rank's ``shards`` section when ``iteration`` holds sharded (FSDP2 / DTensor)
        Checkpointer parts, else None (:func:`~.job_history.shard_sections`)."""
        return shard_sections(self, iteration)

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    rank: int | None = None) -> Any:
        return self.stream(iteration, rank).load_record(iteration, keys)

    def info(self, iteration: int, *, rank: int | None = None) -> CheckpointInfo:
        return self.stream(iteration, rank).info(iteration)

    def kind(self, iteration: int) -> str:
        return "delta" if self.global_commit(iteration).kind == 1 else "snapshot"

    def meta(self, iteration: int, *, rank: int | None = None) -> Any:
        return self.stream(iteration, rank).meta(iteration)

    def load_base(self, iteration: int, *, rank: int | None = None) -> tuple[str, int]:
        """Where :meth:`load` of ``iteration`` starts (:func:`~.job_load.load_start`)."""
        return load_start(self, iteration, rank, self._followers)

    def base_of(self, iteration: int, *, rank: int | None = None) -> int:
        """The base snapshot ``iteration`` replays from; without ``rank`` any rank answers
        (:func:`~.job_load.base_rank`)."""
        return self.stream(iteration, base_rank(self, iteration, rank)).base_of(iteration)

    # ---- the remote tier (remote=...): ckptstore/remote/job_uploader.py's JobRemote ------------
    def remote_status(self) -> Any:
        """As :meth:`ckptstore.Store.remote_status`, of the job's copy (JobRemote.status)."""
        return JobRemote.of(self._remote, self.path).status(self._own, self.latest())

    def remote_iteration(self) -> int | None:
        """As :meth:`ckptstore.Store.remote_iteration`: the newest iteration of the newest job
        HEAD, what survives losing this job's machines (:meth:`remote_status`)."""
        return self.remote_status().iteration

    def remote_flush(self, timeout: float | None = None) -> int | None:
        """Collective: :meth:`ckptstore.Store.remote_flush` of the job's copy (JobRemote.flush)."""
        return JobRemote.of(self._remote, self.path).flush(self._own, self._group, self.latest(),
                                                           timeout)

    # ---- maintenance ------------------------------------------------------------------------
    def remote_read_stats(self) -> Any:
        """As :meth:`ckptstore.Store.remote_read_stats`, of a job opened from an object store:
        its own objects plus every rank stream read so far (``job_pull.job_read_stats``)."""
        if self._read_stats is None:
            raise RemoteUnsupportedError(f"{self.path} was not opened from an object store")
        return self._read_stats(self._streams.remote_stats())

    @property
    def remote_bytes_read(self) -> int:
        """Bytes fetched from the object store since open (:meth:`remote_read_stats`)."""
        return int(self.remote_read_stats().bytes_read)

    def gc(self, keep_last: int | None = None, keep_every: int | None = None,
           progress: Callable[[int], None] | None = None, *, policy: Any = None,
           dry_run: bool = False, now_ns: int | None = None, follower_bases: bool = False) -> Any:
        """gc of the job store (:mod:`ckptstore.multirank.job_gc`, format-spec/format.md §22.7):
        the policy (the union of ``KeepLast(keep_last)``, ``KeepEvery(keep_every)`` and
        ``policy``) selects among the job's iterations; kept: those, the latest, and every
        iteration a kept delta needs on any rank; each is kept or removed on every rank
        together. Either offline: on a store opened with mode "r" while no job writes it
        (StoreLockedError when a job on this machine holds the store; a writer elsewhere is
        fenced by the epoch gc claims); or by the job itself: on a writer, gc is collective
        (every rank calls it with the same policy, between saves; see
        :meth:`_collect_while_writing`) and the job goes on writing afterwards, in a new epoch.
        ``dry_run``: the plan and an estimate (local, on any rank), nothing written.
        ``follower_bases``: as :meth:`ckptstore.Store.gc`'s, every rank's part of a base verified
        (format-spec/follower.md §7). Returns a :class:`~.job_gc.JobGcReport` (``why`` each
        iteration beyond the policy is kept); RetentionError when the policy selects nothing."""
        from ..ops.gc import gc_policy
        from .job_gc import collect_job, dry_run_job

        self._check()
        pol = gc_policy(keep_last, keep_every, policy)
        if self._own is None:
            self.refresh()
        if dry_run:
            return dry_run_job(self, pol, now_ns, follower_bases)
        if self._own is not None:
            return self._collect_while_writing(pol, now_ns, progress, follower_bases)
        try:
            return collect_job(self.path, pol, lambda p: JobStore(p, "r"), file_ops=self._ops,
                               now_ns=now_ns, progress=progress, follower_bases=follower_bases)
        finally:
            self._reopen_view()

    def _collect_while_writing(self, policy: Policy, now_ns: int | None,
                               progress: Callable[[int], None] | None, rebase: bool = False) -> Any:
        """The job's own gc (collective: every rank, the same policy, between saves; the steps:
        :func:`~.job_collect.collect_while_writing`); the job writes on in a new epoch."""
        _, committer = self._writer()
        if committer.broken is not None:
            raise committer.broken
        group = self._group
        assert group is not None
        return collect_while_writing(self, group, policy, now_ns, progress, trash=self._trash,
                                     close_writer=self._close_writer,
                                     start_epoch=lambda: self._start_epoch(group),
                                     open_reader=lambda p: JobStore(p, "r"), file_ops=self._ops,
                                     follower_bases=rebase)

    def _close_writer(self) -> None:
        """Step 3 of the job's own gc: close this rank's stream (nothing pending: no round) and
        rank 0 its epoch's log; the rank group stays."""
        assert self._own is not None
        self._own.close()
        self._own = None
        self._committer = None
        self._prepared = None
        if self._epoch_log is not None:
            self._epoch_log.close()
            self._epoch_log = None
        self._streams.close()

    # ---- automatic retention ------------------------------------------------------------------
    def set_retention(self, policy: Policy | None, every: int = 1) -> None:
        """Apply ``policy`` automatically (collective: every rank makes the same call): the job
        runs its gc (:meth:`_collect_while_writing`) after every ``every``-th base snapshot it
        saves (counted from this call; ``None`` turns it off).

        When: right before the next base snapshot is saved (``save``/``save_async``), which
        every rank does at the same iteration and which begins the new epoch's streams (each
        must begin with a snapshot). The call commits what is pending, the gc runs when the
        policy removes something, then the base is saved. Training stalls for the gc (unlike a
        single store's, which runs in its persister: a job's gc closes every rank's stream): it
        copies every kept checkpoint, so raise ``every`` to amortise it.

        Never raises into the save: a failed gc (RetentionError when the policy selects
        nothing, a StaleWriterError, damage) is logged (logger ``ckptstore``, WARNING) and kept
        in :attr:`last_retention`; the job writes on. Only what breaks the job itself (a dead
        rank) is raised, as any save would."""
        if policy is None:
            check_retention_args(policy, every)
        schedule = None if policy is None else RetentionSchedule(policy, every)
        self._writer()
        self._schedule = schedule

    @property
    def retention(self) -> Policy | None:
        """The automatic retention policy (None: off)."""
        return None if self._schedule is None else self._schedule.policy

    @property
    def last_retention(self) -> JobRetentionRun | None:
        """The latest automatic retention run of this writer, or None."""
        return self._last_retention

    def _before_base(self, iteration: int | None) -> None:
        """A base snapshot of ``iteration`` is about to be saved (on every rank): run the
        retention due before it (:meth:`set_retention`, :class:`~.job_collect.RetentionSchedule`)."""
        if self._schedule is not None:
            run = self._schedule.before_base(
                iteration, lambda policy: self._collect_while_writing(policy, None, None),
                lambda: self._own is None or self._committer is None or
                bool(self._committer.broken), self.path)
            self._last_retention = run or self._last_retention

    def _reopen_view(self) -> None:
        """Readers: drop the streams read so far and read the global logs again (after a gc
        the old epochs' streams are gone)."""
        self._streams.close()
        view = read_job_view(self.layout, self.header.store_id)
        with self._view_lock:
            self._view = view

    def bisect(self, predicate: Any, start: int | None = None, end: int | None = None, *,
               rank: int | None = None) -> Any:
        """:meth:`ckptstore.Store.bisect` over the job's global commits, states as :meth:`load`
        returns them (with ``rank``: that rank's part; :func:`~.job_history.bisect_job`)."""
        return bisect_job(self, predicate, start, end, rank)
