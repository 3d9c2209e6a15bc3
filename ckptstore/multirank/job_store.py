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
import struct
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

from ..errors import (CkptStoreError, DamagedCheckpointError, FormatError, NotFoundError,
                      RankMismatchError, ReadOnlyStoreError, StoreClosedError, StoreFeaturesError,
                      StoreLockedError, StoreNotFoundError)
from ..engine.engine import DEFAULT_CHUNK_SIZE, DEFAULT_SEGMENT_SIZE
from ..engine.writer_engine import WriterEngine, check_features
from ..format.delta import REPLAY_KEY
from ..format.header import feature_names
from ..format.job import Epoch, GlobalCommit
from ..tensors.inplace import copy_into
from ..replay.partition import merge_parts, partition_of
from ..replay.shards import assemble_parts, shards_of
from ..storage.fileops import FileOps
from ..storage.layout import Layout
from ..storage.job_log import (EpochLog, JobLayout, JobView, claim_next_epoch, create_job_store,
                               quarantine_tail, read_job_header, read_job_view,
                               tail_is_suspicious)
from ..storage.store_file import read_store_header
from ..store import CheckpointInfo, SaveStats, Store, select_keys
from .committer import GlobalCommitter
from .group import RankGroup
from .prepared import PreparedCommits

T = TypeVar("T")

#: default bound on how long a rank waits for the others in a commit round (seconds)
DEFAULT_COMMIT_TIMEOUT = 300.0
_OPENED = struct.Struct("<QQB")  # epoch, adopted latest + 1 (0: none), ok


class JobStore:
    """A multi-rank job store. Use ``ckptstore.open(path, mode, process_group=pg)``."""

    def __init__(self, path: str | os.PathLike, mode: str = "a", *, process_group: Any = None,
                 commit_timeout: float = DEFAULT_COMMIT_TIMEOUT, chunk_size: int | None = None,
                 segment_size: int | None = None, file_ops: FileOps | None = None,
                 load_threads: int = 2, evict_written: bool = True,
                 direct_io: bool | str = "deltas",
                 host_budget: int | None = None, max_inflight: int | None = None,
                 features: str = "current") -> None:
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
        #: readers of rank streams, by (epoch, rank)
        self._readers: dict[tuple[int, int], Store] = {}
        self._own: Store | None = None
        self._group: RankGroup | None = None
        self._committer: GlobalCommitter | None = None
        self._epoch_log: EpochLog | None = None
        #: DCP's commit variant: this rank's prepared commit awaiting its outcome (.prepared)
        self._prepared: PreparedCommits | None = None
        self.epoch: int | None = None
        #: this process's rank (None: a reader opened without a process group)
        self.rank: int | None = None
        if mode == "a":
            if process_group is None:
                raise ValueError("writing a multi-rank store needs process_group=...")
            self._open_writer(process_group, commit_timeout, chunk_size, segment_size,
                              evict_written, direct_io, host_budget, max_inflight, features)
        else:
            if not os.path.exists(self.layout.store_file):
                raise StoreNotFoundError(f"no store at {self.path}")
            self.header = read_job_header(self.layout)
            if process_group is not None:
                import torch.distributed as dist
                self.rank = dist.get_rank(process_group)
            self._view = read_job_view(self.layout, self.header.store_id)

    # ---- opening ------------------------------------------------------------------------------
    def _open_writer(self, process_group: Any, timeout: float, chunk_size: int | None,
                     segment_size: int | None, evict_written: bool, direct_io: bool | str,
                     host_budget: int | None, max_inflight: int | None,
                     features: str) -> None:
        group = self._group = RankGroup(process_group, timeout, label=self.path)
        self.rank = group.rank
        try:
            if group.rank == 0:
                try:
                    epoch, adopted = self._claim(group.world_size, chunk_size, segment_size)
                    msg = _OPENED.pack(epoch, 0 if adopted is None else adopted + 1, 1)
                except Exception as e:  # every rank learns of it (none waits for a broadcast)
                    group.broadcast(_OPENED.pack(0, 0, 0) + f"{type(e).__name__}: {e}".encode(),
                                    "the store's open")
                    raise
                group.broadcast(msg, "the store's open")
            else:
                msg = group.broadcast(None, "the store's open")
                if msg[_OPENED.size - 1] != 1:
                    raise CkptStoreError(f"{self.path}: rank 0 could not open the store for "
                                         f"writing: {msg[_OPENED.size:].decode(errors='replace')}")
            epoch, adopted_plus, _ = _OPENED.unpack_from(msg)
            self.epoch = epoch
            committer = GlobalCommitter(group, epoch, self._epoch_log, self.path)
            committer.adopted_latest = adopted_plus - 1 if adopted_plus else None
            committer.on_commit = self.learn
            self._committer = committer
            error = b""
            own_error: BaseException | None = None
            try:
                self.header = read_job_header(self.layout)
                features = self._stream_features(epoch, features)
                self._own = Store(self.layout.stream_dir(epoch, group.rank), "a",
                                  chunk_size=chunk_size or self.header.chunk_size,
                                  segment_size=segment_size or self.header.segment_size,
                                  file_ops=self._ops, load_threads=self._load_threads,
                                  evict_written=evict_written, direct_io=direct_io,
                                  host_budget=host_budget, features=features,
                                  max_inflight=max_inflight, commit_round=committer.around)
            except Exception as e:  # noqa: BLE001 - told to every rank below, then raised
                error = f"rank {group.rank}: {type(e).__name__}: {e}".encode()
                own_error = e
            ids = group.all_gather(error or self.header.store_id, "the streams' open")
            failed = [m.decode(errors="replace") for m in ids if len(m) != 16]
            if failed:
                message = f"{self.path}: a rank could not open its stream: " + "; ".join(failed)
                if isinstance(own_error, StoreFeaturesError):
                    raise StoreFeaturesError(message) from own_error
                raise CkptStoreError(message)
            if any(m != ids[0] for m in ids):
                raise RankMismatchError(f"{self.path}: the ranks see different stores (store ids "
                                        f"{[m.hex() for m in ids]}): is the directory shared?")
            assert self._own is not None and isinstance(self._own.engine, WriterEngine)
            self._own.engine.commit_hook = committer.hook
            with self._view_lock:
                self._view = read_job_view(self.layout, self.header.store_id)
        except BaseException:
            self._release()
            raise

    def _stream_features(self, epoch: int, requested: str) -> str:
        """The ``features`` of the stream this rank creates for ``epoch``: those of the job's
        oldest earlier stream that has a readable STORE file (a store keeps the features it was
        created with: a job that began compatible stays readable by older releases), else
        ``requested``. StoreFeaturesError when ``requested`` is "compatible" and the earlier
        streams have features."""
        try:
            names = sorted(os.listdir(self.layout.streams_dir))
        except FileNotFoundError:
            names = []
        for name in names:
            head, _, _ = name.partition("-")
            if not head.isdigit() or not 0 < int(head) < epoch:
                continue
            try:
                flags = read_store_header(Layout(os.path.join(self.layout.streams_dir, name))).flags
            except (CkptStoreError, OSError):
                continue  # a stream whose open failed, or damaged: the next one says
            if flags and requested == "compatible":
                raise StoreFeaturesError(
                    f"{self.path}: its streams were created with format features "
                    f"{', '.join(feature_names(flags))} (stream {name}; format-spec/format.md §4), "
                    "which ckptstore releases without them cannot read; features are chosen when "
                    "a store is created and never removed")
            return "current" if flags else "compatible"
        return requested

    def _claim(self, world_size: int, chunk_size: int | None, segment_size: int | None
               ) -> tuple[int, int | None]:
        """The coordinator's part of opening: create the store if needed, claim the next epoch
        and write its EPOCH record. Returns (epoch, the latest iteration it continues from)."""
        if not os.path.exists(self.layout.store_file):
            if os.path.exists(os.path.join(self.path, "segments")):
                raise FormatError(f"{self.path} holds segments but no STORE file: not a job store")
            self._ops.makedirs(self.path)
            create_job_store(self.layout, self._ops, chunk_size or DEFAULT_CHUNK_SIZE,
                             segment_size or DEFAULT_SEGMENT_SIZE)
        header = read_job_header(self.layout)
        view = read_job_view(self.layout, header.store_id)
        log = claim_next_epoch(self.layout, self._ops, view.highest_claimed)
        number = log.number
        try:
            # what this epoch continues is read after the claim is durable: an older job's
            # coordinator that commits after this point sees the claim and reports its commit
            # as not known to be kept (format §22, "Epochs and fencing")
            view = read_job_view(self.layout, header.store_id)
            prev = view.chain[-1] if view.chain else 0
            end = view.logs[prev].valid_end if prev else 0
            if prev and tail_is_suspicious(view.logs[prev]):
                quarantine_tail(self.layout, self._ops, view.logs[prev])  # kept, never adopted
            log.write_epoch(Epoch(number, world_size, header.store_id, prev, end, time.time_ns()))
        except BaseException:
            log.close()
            raise
        self._epoch_log = log
        return number, view.latest

    def _release(self) -> None:
        for s in [self._own, *self._readers.values()]:
            if s is not None:
                try:
                    s.close()
                except CkptStoreError:
                    pass
        self._readers.clear()
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
        except BaseException as e:  # noqa: BLE001 - raised after the files are released
            err = e
        finally:
            self._closed = True
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
        own, _ = self._writer()
        if self._async():
            return self.save_async(iteration, state, meta).result().save
        self._round(own.flush)
        return self._round(lambda: own.save(iteration, state, meta))

    def fail_save(self, error: BaseException) -> None:
        """This rank's part of a collective :meth:`save` failed before ``save`` could be called
        (making its state: ``error``): run the rounds ``save`` runs on the other ranks (the
        commit of pending deltas, then the save's own, voting FAILED with ``error``), so they
        abort at once instead of waiting for this rank's vote until ``commit_timeout``. Raises
        only what ``save`` raises before any round (a closed or read-only store), or ValueError
        while the async pipeline runs (its persister runs this rank's rounds); the caller raises
        ``error``."""
        own, committer = self._writer()
        if self._async():
            raise ValueError("fail_save() while the async pipeline runs this rank's rounds")

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

    def save_async(self, iteration: int, state: Any, meta: dict | None = None) -> Any:
        """:meth:`ckptstore.Store.save_async` on every rank: the future resolves once the
        iteration is committed globally (its round runs in the background)."""
        return self._pipe().submit("snapshot", iteration, state, meta)

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
            for s in self._readers.values():
                s.refresh()

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
        r = self._rank(rank, g)
        where = self.layout.stream_dir(g.epoch, r)
        store = self._open_stream(g.epoch, r, where)
        expected = g.ranks[r]
        for attempt in range(2):
            try:
                # the own stream: its persister learns a global commit inside the stream's
                # transaction, before that transaction indexes it; the engine's lock waits for it
                with store.engine.locked():
                    entry = store.engine.entry(iteration)
            except NotFoundError:
                if attempt == 0 and store.mode == "r":
                    store.refresh()
                    continue
                raise DamagedCheckpointError(
                    f"{self.path}: iteration {iteration} is committed globally, but rank {r}'s "
                    f"stream {where} holds no commit of it") from None
            if entry.commit != expected.commit or (entry.loc.seq, entry.loc.offset) != \
                    (expected.commit_seq, expected.commit_offset):
                raise DamagedCheckpointError(
                    f"{self.path}: rank {r}'s stream {where} commits iteration {iteration} "
                    f"differently from the global commit (segment {entry.loc.seq} offset "
                    f"{entry.loc.offset}, expected segment {expected.commit_seq} offset "
                    f"{expected.commit_offset})")
            break
        return store

    def _rank(self, rank: int | None, g: GlobalCommit) -> int:
        r = self.rank if rank is None else rank
        if r is None:
            if g.world_size == 1:
                return 0
            raise ValueError(f"{self.path} holds {g.world_size} ranks' states at iteration "
                             f"{g.iteration}: pass rank= (0..{g.world_size - 1})")
        if type(r) is not int or not 0 <= r < g.world_size:
            raise RankMismatchError(f"rank {r!r} is not among the {g.world_size} ranks that "
                                    f"committed iteration {g.iteration} in {self.path}")
        return r

    def _open_stream(self, epoch: int, rank: int, where: str) -> Store:
        if self._own is not None and (epoch, rank) == (self.epoch, self.rank):
            return self._own
        store = self._readers.get((epoch, rank))
        if store is None:
            if not os.path.isdir(where):
                raise DamagedCheckpointError(f"{self.path}: rank {rank}'s stream {where} "
                                             f"(epoch {epoch}) is missing")
            try:
                store = Store(where, "r", load_threads=self._load_threads)
            except CkptStoreError as e:
                raise DamagedCheckpointError(f"{self.path}: rank {rank}'s stream {where} "
                                             f"cannot be opened: {e}") from e
            self._readers[(epoch, rank)] = store
        return store

    def load(self, iteration: int, keys: Sequence[Any] | None = None, *,
             rank: int | None = None, into: Any = None) -> Any:
        """The state at ``iteration``, bit-exact (a delta is replayed within its stream).
        ``into``: tensors to fill, as in :meth:`ckptstore.Store.load` (here always copied into
        once the state is merged).

        With ``rank``: what that rank saved (its part, for a partitioned Checkpointer state).
        Without: the job's state. When the ranks' states are parts of one data-parallel state
        (:mod:`ckptstore.replay.partition`) or sharded parts (FSDP2: every tensor assembled
        whole from its shards, :mod:`ckptstore.replay.shards`), every part is loaded and they
        are merged, with this
        rank's own RNG and scheduler states (rank 0's for a reader without a group); otherwise
        this process's rank's state."""
        state = self._load(iteration, keys, rank)
        return state if into is None else copy_into(state, into)

    def _load(self, iteration: int, keys: Sequence[Any] | None, rank: int | None) -> Any:
        if rank is not None:
            return self.stream(iteration, rank).load(iteration, keys)
        g = self.global_commit(iteration)
        mine = self.rank if self.rank is not None and self.rank < g.world_size else None
        first = self.stream(iteration, mine if mine is not None else 0).load(iteration)
        section = partition_of(first)
        if section is None and shards_of(first) is not None:
            # sharded (FSDP2) parts: every tensor assembled from every rank's shards
            parts = [first if r == (mine or 0) else self.stream(iteration, r).load(iteration)
                     for r in range(g.world_size)]
            return select_keys(assemble_parts(parts, mine or 0), keys, iteration)
        if section is None:
            if mine is None and g.world_size > 1:
                self._rank(None, g)  # raises: which rank's state?
            return select_keys(first, keys, iteration)
        parts = [first if r == (mine or 0) else self.stream(iteration, r).load(iteration)
                 for r in range(g.world_size)]
        return select_keys(merge_parts(parts, mine or 0), keys, iteration)

    def shard_sections(self, iteration: int) -> list[dict] | None:
        """Every rank's ``shards`` section (rank order) when ``iteration`` holds sharded
        (FSDP2 / DTensor) Checkpointer parts (format-spec/deltas.md, "Sharded states"), else
        None. A delta records no section: its base's (in the same rank stream, so the same
        layout) is read. Reads each part's replay section only, no tensor; raises
        DamagedCheckpointError when rank 0 saved a sharded part and another rank did not."""
        sections = []
        for r in range(self.global_commit(iteration).world_size):
            base = self.base_of(iteration, rank=r)
            try:
                section = shards_of(self.load_record(base, keys=[REPLAY_KEY], rank=r))
            except NotFoundError:  # a state without a replay section: not a Checkpointer's
                section = None
            if section is None:
                if r == 0:
                    return None
                raise DamagedCheckpointError(f"{self.path}: iteration {iteration}: rank 0 saved "
                                             f"a sharded part, rank {r} (base {base}) did not")
            sections.append(section)
        return sections

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    rank: int | None = None) -> Any:
        return self.stream(iteration, rank).load_record(iteration, keys)

    def info(self, iteration: int, *, rank: int | None = None) -> CheckpointInfo:
        return self.stream(iteration, rank).info(iteration)

    def kind(self, iteration: int) -> str:
        return "delta" if self.global_commit(iteration).kind == 1 else "snapshot"

    def meta(self, iteration: int, *, rank: int | None = None) -> Any:
        return self.stream(iteration, rank).meta(iteration)

    def base_of(self, iteration: int, *, rank: int | None = None) -> int:
        return self.stream(iteration, rank).base_of(iteration)

    # ---- maintenance ------------------------------------------------------------------------
    def gc(self, keep_last: int | None = None, keep_every: int | None = None,
           progress: Callable[[int], None] | None = None, *, policy: Any = None,
           dry_run: bool = False, now_ns: int | None = None) -> Any:
        """gc of the job store (:mod:`ckptstore.multirank.job_gc`, format-spec/format.md §22.7):
        the policy (the union of ``KeepLast(keep_last)``, ``KeepEvery(keep_every)`` and
        ``policy``) selects among the job's iterations; kept: those, the latest, and every
        iteration a kept delta needs on any rank; each is kept or removed on every rank
        together. Runs offline: on a store opened with mode "r" while no job writes it
        (StoreLockedError on a writer, or when a job on this machine holds the store; a writer
        elsewhere is fenced by the epoch gc claims). ``dry_run``: the plan and an estimate,
        nothing written (``report.why`` says why each iteration beyond the policy is kept).
        Returns a :class:`~ckptstore.multirank.job_gc.JobGcReport`; RetentionError (nothing
        removed) when the policy selects nothing."""
        from ..ops.gc import gc_policy
        from .job_gc import collect_job, dry_run_job

        self._check()
        pol = gc_policy(keep_last, keep_every, policy)
        if self._own is not None:
            raise StoreLockedError(
                f"{self.path}: gc of a job store runs offline; close this job (every rank) and "
                "run ckptstore.open(path, \"r\").gc(...) or `ckptstore gc`")
        self.refresh()
        if dry_run:
            return dry_run_job(self, pol, now_ns)
        try:
            return collect_job(self.path, pol, lambda p: JobStore(p, "r"), file_ops=self._ops,
                               now_ns=now_ns, progress=progress)
        finally:
            self._reopen_view()

    def _reopen_view(self) -> None:
        """Readers: drop the streams read so far and read the global logs again (after a gc
        the old epochs' streams are gone)."""
        for s in self._readers.values():
            try:
                s.close()
            except CkptStoreError:
                pass
        self._readers.clear()
        view = read_job_view(self.layout, self.header.store_id)
        with self._view_lock:
            self._view = view

    def bisect(self, predicate: Any, start: int | None = None, end: int | None = None, *,
               rank: int | None = None) -> Any:
        """:meth:`ckptstore.Store.bisect` over the job's global commits. States are those
        :meth:`load` returns (with ``rank``: that rank's part); meta conditions read ``rank``'s
        meta (default: this process's rank, else rank 0). A job store has no ``replay``: each
        iteration of the one interval walked is loaded on its own (:mod:`ckptstore.ops.bisect`)."""
        from ..ops.bisect import bisect

        meta_rank = rank if rank is not None else (self.rank or 0)
        return bisect(self, predicate, start, end,
                      meta=lambda it: self.meta(it, rank=meta_rank),
                      load=lambda it: self.load(it, rank=rank))

