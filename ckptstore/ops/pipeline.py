"""Asynchronous checkpointing: snapshot into pooled host buffers now, persist in the background.

One ``Store.save_async(iteration, state)`` (or ``save_delta_async``) goes through two phases:

Foreground, in the caller (its duration is the *stall* training sees):
  1. check the iteration order, flatten the state (every non-tensor value is captured here);
  2. take a slot (at most ``max_inflight`` checkpoints snapshotted but not yet persisted) and host
     memory from the :class:`HostPool` (at most ``host_budget`` bytes of staging buffers). When
     either is full the caller waits: *backpressure*, reported as ``wait_s``;
  3. copy every tensor into one reused host arena (CPU tensors: one batched ``_foreach_copy_`` into
     destination views cached per arena and state structure, so a repeated structure costs no
     per-tensor Python work beyond flattening; CUDA tensors: a pinned arena, copies issued on a
     side stream after it waits for the training stream, which then waits for the copies on the
     GPU, not on the CPU; the persister synchronises on the copy event before reading). CPU
     tensors the caller defers (``deferred``) only get their place in the arena: their copy runs
     on a background thread while the caller goes on (:mod:`ckptstore.ops.deferred_copy`: the
     Checkpointer's overlapped snapshots), and the persister waits for it before reading. A
     snapshot's CPU tensors are copied into chunk images (:attr:`Pipeline.snapshot_images`), so
     the persister writes their records from the arena without another copy;
  4. enqueue the job and return a :class:`~ckptstore.ops.deferred_copy.SaveFuture` (a
     ``concurrent.futures.Future`` whose ``copied()`` waits for the deferred copy).

Background, one persister thread, FIFO (so commits happen in iteration order):
  5. hash, compress and append (the engine's write path, under the engine's lock), then fsync and
     COMMIT (a snapshot, or a delta that ends its group) or leave it pending (a delta with
     ``commit=False``, committed with the next group);
  6. release the arena to the pool; resolve the future of every checkpoint now committed;
  7. after a snapshot committed: call ``after_snapshot(iteration)`` when set (the store's automatic
     retention, ckptstore/store.py), before the next job starts: between saves, never inside one.

Invariants:
  * A future resolves successfully only after its checkpoint's COMMIT record is fsynced: whatever a
    resolved future names survives a crash.
  * Nothing the caller does to its tensors after ``submit`` returns reaches the store: every tensor
    leaf is copied, except leaves that already live in an arena handed over with ``owned`` (the
    Checkpointer's gradient captures, whose ownership passes to the job). Deferred tensors: after
    the future's ``copied()`` returns; a change seen before (their version counters) fails the
    checkpoint with LiveStateChangedError instead of writing a torn state.
  * Tensors are always copied. Skipping the copy of a tensor whose ``_version`` and ``data_ptr`` are
    unchanged since the previous snapshot is NOT done: writes through ``.data``, numpy or DLPack
    aliases do not bump ``_version``, so it cannot prove the bytes unchanged. Unchanged bytes are
    still not *written* twice: content addressing deduplicates them.
  * A background failure (I/O error, a refused iteration) rolls back the failed checkpoint, every
    appended-but-uncommitted delta and every queued job (their futures raise
    :class:`~ckptstore.errors.CheckpointAbortedError`), so the store holds exactly its earlier
    commits. The failure is raised by the failed job's future, once by the next call on the store,
    and by flush/close if no call reported it; after that the store accepts saves again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import (CheckpointAbortedError, DeltaChainError, GlobalCommitAbortedError,
                      IterationOrderError, LoanWithdrawnError)
from ..format.image import ChunkImage
from ..format.state import flatten
from ..tensors import leaf_hook
from ..engine.write_path import SaveStats, flatten_meta
from . import shutdown
from .deferred_copy import Copier, DeferredCopy, SaveFuture
from .loan import Loan
from .host_staging import Arena, ArenaLayout, HostPool, default_host_budget, snapshot_leaves

if TYPE_CHECKING:
    from ..engine.writer_engine import WriterEngine

#: Name of the manifest field that records a pipeline checkpoint's statistics (format.md section 10).
STATS_FIELD = "pipeline"
DEFAULT_MAX_INFLIGHT = 4
#: how often a persister waiting for a loan's decision asks whether the lent tensors became
#: unreachable (ckptstore/ops/loan.py): the latency it adds to a lent delta's durability
LOAN_POLL_S = 0.01


@dataclass
class AsyncStats:
    """What one asynchronous checkpoint cost (``Future.result()`` and ``Store.stats()``).

    ``stall_s``: time the submitting call blocked training (includes ``wait_s`` and
    ``snapshot_s``); ``wait_s``: part of it spent waiting for a slot or host memory
    (backpressure); ``snapshot_s``: copying tensors into host buffers; ``queue_depth``: checkpoints
    in flight ahead of this one when it was submitted; ``persist_s``: from the start of its
    background work until it was durable (for a delta in a group: until the group's commit);
    ``write_s``: hashing, compressing and appending (before the manifest); ``cpu_s``: CPU time
    the background thread spent on it (``time.thread_time``; its share of a group's commit
    included, and an overlapped copy's time), the cost per iteration that competes with training
    for the cores; ``overlap_bytes``: bytes whose copy was deferred (:mod:`ckptstore.ops.deferred_copy`),
    ``overlap_s``: how long that copy ran, after the submitting call returned (not in ``stall_s``).
    """

    iteration: int
    kind: str
    stall_s: float
    wait_s: float
    snapshot_s: float
    queue_depth: int
    snapshot_bytes: int
    persist_s: float = 0.0
    write_s: float = 0.0
    logical_bytes: int = 0
    written_bytes: int = 0
    dedup_bytes: int = 0
    cpu_s: float = 0.0
    overlap_bytes: int = 0
    overlap_s: float = 0.0
    save: SaveStats | None = None

    def to_manifest(self) -> dict:
        """The part known before the manifest is written (format.md section 10, "pipeline")."""
        out = {"stall_s": round(self.stall_s, 6), "wait_s": round(self.wait_s, 6),
               "snapshot_s": round(self.snapshot_s, 6), "queue_depth": self.queue_depth,
               "snapshot_bytes": self.snapshot_bytes}
        if self.overlap_bytes:
            out["overlap_s"] = round(self.overlap_s, 6)
        return out


@dataclass
class _Job:
    kind: str  # "snapshot" | "delta" | "flush" | "stop" | "vote-failed"
    iteration: int = -1
    skeleton: Any = None
    meta: Any = None
    leaves: list = field(default_factory=list)
    commit: bool = True
    arenas: list = field(default_factory=list)
    events: list = field(default_factory=list)
    future: SaveFuture = field(default_factory=SaveFuture)
    #: the overlapped part of its copy (None: everything was copied by submit)
    copy: DeferredCopy | None = None
    stats: AsyncStats | None = None
    t_start: float = 0.0
    #: "vote-failed": why the caller's submit failed (this rank's vote in that job's round)
    error: BaseException | None = None
    #: the gate of tensors lent to the job (ckptstore/ops/loan.py: read only once confirmed)
    loan: Loan | None = None


class Pipeline:
    """The snapshot-then-persist pipeline of one writer (see the module docstring). It writes
    only through the writer engine's public saves, under the engine's lock."""

    def __init__(self, engine: "WriterEngine", *, host_budget: int | None = None,
                 max_inflight: int | None = None,
                 commit_round: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        """``commit_round``: runs each job that commits (a snapshot, a delta that ends its group,
        a flush) as one round of an outer commit (a multi-rank store's global commit round,
        ckptstore/multirank/committer.py); every rank then runs the same rounds in the same order,
        so a flush always queues its job, even with nothing pending."""
        if max_inflight is not None and (type(max_inflight) is not int or max_inflight < 1):
            raise ValueError("max_inflight must be a positive int")
        if host_budget is not None and (type(host_budget) is not int or host_budget < 1):
            raise ValueError("host_budget must be a positive int (bytes)")
        self.engine = engine
        self.commit_round = commit_round
        self.pool = HostPool(host_budget or default_host_budget(),
                             pin=torch.cuda.is_available())
        self.max_inflight = max_inflight or DEFAULT_MAX_INFLIGHT
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._inflight = 0  # submitted checkpoints not yet persisted (queued or running)
        self._uncommitted: list[_Job] = []  # appended deltas waiting for their group's commit
        self._error: BaseException | None = None
        self._reported = True
        self._tail: int | None = None  # last iteration accepted (None: ask the store)
        self._tail_known = False
        self._history: deque[AsyncStats] = deque(maxlen=10_000)
        self._streams: dict = {}
        self._layouts: dict[tuple, ArenaLayout] = {}  # snapshot layouts by structure (snapshot_leaves)
        #: a snapshot's CPU tensors are staged in chunk images (host_staging) of the engine's
        #: image stride, written by the persister with no staging copy; False: plain slices,
        #: whose bytes the log copies into its aligned staging buffer (the path before images,
        #: kept for tools/bench_snapshot.py's side-by-side runs; both write valid v1 records)
        self.snapshot_images = True
        #: called by the persister with the iteration of each snapshot once it is committed and
        #: its future resolved, before the next job (automatic retention); must not raise
        self.after_snapshot: Callable[[int], None] | None = None
        #: the job the persister is running (None between jobs); set and cleared under _cond
        self._current: _Job | None = None
        #: stopped at interpreter exit (stop_at_exit): nothing is queued or run any more
        self._abandoned = False
        self._copier = Copier(f"ckptstore-copy:{engine.path}")
        self._thread = threading.Thread(target=self._run, name=f"ckptstore-persist:{engine.path}",
                                        daemon=True)
        self._thread.start()
        shutdown.track(self, shutdown.PERSISTERS)

    # ---- foreground -------------------------------------------------------------------------
    def submit(self, kind: str, iteration: int, state: Any, meta: dict | None = None, *,
               commit: bool = True, owned: list[Arena] | None = None,
               deferred: Callable[[torch.Tensor], bool] | None = None,
               loan: Loan | None = None) -> SaveFuture:
        """Snapshot ``state`` and queue it; see the module docstring. ``owned``: arenas holding
        tensors of ``state`` already copied by the caller; they pass to the job (released by the
        pipeline whatever happens). ``deferred``: CPU tensors for which it returns True are copied
        in the background (:mod:`ckptstore.ops.deferred_copy`); the caller changes them only after
        the future's ``copied()``. ``loan``: the gate of the :class:`~ckptstore.tensors.LentTensor`
        leaves of ``state`` (:mod:`ckptstore.ops.loan`): the persister reads them once the lender
        confirmed it; a withdrawn loan drops the job unwritten (its future raises
        LoanWithdrawnError) and takes the pipeline's tail back to the iteration before it."""
        try:
            return self._submit(kind, iteration, state, meta, commit, owned, deferred, loan)
        except BaseException as e:
            if loan is not None:  # (no job will read it: its lender must not wait for that)
                loan.withdraw(f"iteration {iteration} was not submitted ({e})")
                loan.give_back()
            if kind != "delta" or commit:
                self.fail_round(e)
            raise

    def fail_round(self, error: BaseException) -> None:
        """This rank's next commit could not even be submitted (``error``): when the other
        ranks run a round for it (a job store's stream), this rank votes in it too (FAILED), so
        they abort at once instead of waiting for its vote."""
        if self.commit_round is not None:
            self._queue_job(_Job("vote-failed", error=error))

    def _queue_job(self, job: _Job) -> bool:
        """Queue ``job``; False (not queued) once the pipeline was stopped at exit."""
        with self._cond:
            if self._abandoned:
                return False
            self._queue.append(job)
            self._cond.notify_all()
        return True

    def _submit(self, kind: str, iteration: int, state: Any, meta: dict | None, commit: bool,
                owned: list[Arena] | None,
                deferred: Callable[[torch.Tensor], bool] | None,
                loan: Loan | None) -> SaveFuture:
        t0 = time.perf_counter()
        owned = list(owned or [])
        try:
            self.settle_loans()  # (a withdrawal moves the tail back: decided before this one)
            self.check()
            if type(iteration) is not int or iteration < (1 if kind == "delta" else 0) \
                    or iteration >= 1 << 63:
                raise ValueError(f"iteration must be a {'positive' if kind == 'delta' else 'non-negative'}"
                                 f" int, not {iteration!r}")
            skeleton, leaves = flatten(state, leaf_hook)
            meta_skeleton = flatten_meta(meta)
            tail = self.engine.tail() if not self._tail_known else None
            wait = 0.0
            with self._cond:
                if self._abandoned:
                    raise CheckpointAbortedError(f"{self.engine.path}: the store's async saves "
                                                 "were stopped at interpreter exit")
                if not self._tail_known:
                    self._tail, self._tail_known = tail, True
                prev = self._tail
                self._check_order(kind, iteration, prev)
                tw = time.perf_counter()
                while self._inflight >= self.max_inflight and self._error is None:
                    self._cond.wait()
                wait += time.perf_counter() - tw
                depth = self._inflight
                self._inflight += 1
                self._tail = iteration
        except BaseException:
            for a in owned:
                self.pool.release(a)
            raise
        job = _Job(kind, iteration, skeleton, meta_skeleton, commit=commit, arenas=owned,
                   loan=loan)
        if loan is not None:
            job.future.loan = loan
            loan.on_withdraw = lambda: self._untail(iteration, prev)
        try:
            ts = time.perf_counter()
            own = sum(a.capacity for a in owned)
            stride = ChunkImage.stride_for(self.engine.chunk_size) \
                if kind == "snapshot" and self.snapshot_images else 0
            staged = snapshot_leaves(leaves, owned, self.pool, own, self._streams, self._layouts,
                                     deferred, stride)
            job.leaves, job.events = leaves, staged.events
            if staged.arena is not None:
                job.arenas.append(staged.arena)
            wait += staged.waited
            snap = time.perf_counter() - ts - staged.waited
        except BaseException:
            for a in job.arenas:
                self.pool.release(a)
            with self._cond:
                self._inflight -= 1
                if self._tail == iteration:
                    self._tail = prev
                self._cond.notify_all()
            raise
        job.future.set_running_or_notify_cancel()
        job.stats = AsyncStats(iteration, kind, time.perf_counter() - t0, wait, snap, depth,
                               staged.copied)
        if staged.deferred:
            job.copy = job.future.deferred = DeferredCopy(iteration, staged.deferred)
            job.stats.overlap_bytes = job.copy.nbytes
            self._copier.put(job.copy)
        if not self._queue_job(job):  # stopped at exit meanwhile
            self._drop([job], "the store's async saves were stopped at interpreter exit")
        return job.future

    def _untail(self, iteration: int, prev: int | None) -> None:
        """A job's loan was withdrawn (it will not be written): the tail goes back to ``prev``,
        what preceded it (nothing was accepted after it: loans are decided before the next
        submit)."""
        with self._cond:
            if self._tail == iteration:
                self._tail = prev

    def settle_loans(self) -> None:
        """Decide the loans of the queued jobs that the calling thread lent (each lender decides
        its own, :meth:`ckptstore.ops.loan.Loan.settle`): before anything that waits for the
        persister, which waits for those decisions."""
        with self._cond:
            loans = [j.loan for j in self._queue if j.loan is not None and not j.loan.decided]
        for loan in loans:
            loan.settle()

    def _check_order(self, kind: str, iteration: int, prev: int | None) -> None:
        where = self.engine.path
        if kind == "delta":
            if prev is None:
                raise DeltaChainError(f"delta for iteration {iteration} refused: {where} holds no "
                                      "base snapshot (a delta chain must start from a snapshot)")
            if iteration <= prev:
                raise IterationOrderError(f"iteration {iteration} is not after the latest iteration "
                                          f"{prev} in {where}")
            if iteration != prev + 1:
                raise DeltaChainError(f"delta for iteration {iteration} refused: the latest iteration "
                                      f"is {prev}; a delta must follow its predecessor without a gap")
        elif prev is not None and iteration <= prev:
            raise IterationOrderError(f"iteration {iteration} is not after the latest iteration "
                                      f"{prev} saved to {where}")

    def tail(self) -> int | None:
        """The last iteration accepted (queued, pending or committed)."""
        if not self._tail_known:
            t = self.engine.tail()
            with self._cond:
                if not self._tail_known:
                    self._tail, self._tail_known = t, True
        return self._tail

    def check(self) -> None:
        """Raise a background failure that no store call has reported yet (then forget it)."""
        if self._error is None or self._reported:
            return
        self.settle_loans()
        with self._cond:
            while self._inflight or self._queue:
                self._cond.wait()
            err = self._error
            if err is None or self._reported:
                return
            self._reported = True
            self._error = None
            self._tail_known = False
        raise err

    def flush(self) -> None:
        """Wait until every submitted checkpoint is persisted and every async delta committed;
        raise a failure not reported yet. With ``commit_round`` the flush's round is queued even
        when a failure is pending (this rank then votes FAILED in it: the others run it too)."""
        self.settle_loans()
        if self.commit_round is None:
            self.check()
        with self._cond:
            idle = not self._inflight and not self._queue and not self._uncommitted
        if (not idle or self.commit_round is not None) and not self._abandoned:
            marker = _Job("flush")
            if not self._queue_job(marker):
                return
            try:
                marker.future.result()
            except BaseException:  # noqa: BLE001 - the failure is raised by check() below
                pass
        self.check()

    def request_flush(self) -> None:
        """Queue a commit of the pending deltas without waiting for it (the group timer,
        :mod:`ckptstore.ops.grouptimer`): it runs after the jobs already queued, and its failure is
        reported like any background failure (the rolled-back deltas' futures, then the next call,
        flush or close)."""
        self._queue_job(_Job("flush"))

    def wait(self) -> None:
        """Wait until every submitted checkpoint is persisted (snapshots committed, async deltas
        appended); unlike :meth:`flush` this does not commit a group early."""
        self.settle_loans()
        with self._cond:
            while self._inflight or any(j.kind != "stop" for j in self._queue):
                self._cond.wait()

    def drain(self) -> None:
        """Before a synchronous write: flush, and re-read the store's tail afterwards."""
        self.flush()
        self._tail_known = False

    def close(self) -> None:
        """Flush, then stop the persister thread (also when the flush raises) and join it."""
        try:
            self.flush()
        finally:
            shutdown.forget(self)
            self._queue_job(_Job("stop"))  # (not queued once stopped at exit: it has ended)
            self._thread.join()
            self._copier.stop()

    def stop_at_exit(self) -> str | None:
        """Stop as a crash would, the interpreter exiting with the store open
        (:mod:`ckptstore.ops.shutdown`): the job the persister is running finishes (a commit round
        in flight completes or fails on every rank: a rank that stopped before the round closes
        its group, which fails the round at once on the others); every queued job is dropped, its
        future raising CheckpointAbortedError; the thread is joined. Appended deltas left
        without their commit stay uncommitted on disk, exactly as after a crash (the next open
        recovers them away); nothing committed is touched. Returns the warning's text when
        anything was abandoned or the persister was busy, else None."""
        why = "the store's async saves were stopped at interpreter exit (the store was not closed)"
        with self._cond:
            if self._abandoned or not self._thread.is_alive():
                return None
            self._abandoned = True
            running = self._current
            dropped = [j for j in self._queue if j is not running]
            self._queue = deque([running] if running is not None else [])
            self._cond.notify_all()
        self._drop(dropped, why)
        self._thread.join()
        self._copier.stop()
        with self._cond:
            lost, self._uncommitted = self._uncommitted, []
        self._drop(lost, why + " before their group's commit", queued=False)
        saves = [j for j in dropped + lost if j.kind in ("snapshot", "delta")]
        if running is None and not saves:
            return None
        return (f"ckptstore: store {self.engine.path} was left open at interpreter exit: its "
                f"async saves were stopped; {len(saves)} checkpoint(s) not committed were "
                "abandoned (as in a crash: committed ones are kept; close() the store to commit "
                "them)" + (f": iterations {[j.iteration for j in saves]}" if saves else ""))

    def _release_arenas(self, job: _Job) -> None:
        """Give ``job``'s arenas back to the pool, keeping no name bound to one (the persister's
        loop outlives its jobs: a loop variable would keep the last arena alive after the pool
        dropped it), once the device-to-host copies into them have ended (a job that failed
        before its persist never waited for them)."""
        for ev in job.events:
            ev.synchronize()
        while job.arenas:
            self.pool.release(job.arenas.pop())

    def _drop(self, jobs: list[_Job], why: str, queued: bool = True) -> None:
        """Fail jobs that will never run (their futures raise CheckpointAbortedError);
        ``queued``: they were still counted in flight (not yet persisted)."""
        for j in jobs:
            if j.loan is not None:
                j.loan.withdraw(why)  # (never read now)
                j.loan.give_back()
            if j.copy is not None:
                j.copy.wait()  # (no arena is released while a copy into it may run)
            self._release_arenas(j)
            j.leaves = []
            if queued and j.kind in ("snapshot", "delta"):
                with self._cond:
                    self._inflight -= 1
                    self._cond.notify_all()
            if j.future.done():
                continue
            if j.kind == "vote-failed":
                j.future.set_result(None)
            else:
                j.future.set_exception(CheckpointAbortedError(f"{self._what(j)}: {why}"))

    def pending_deltas(self) -> list[int]:
        with self._cond:
            return [j.iteration for j in list(self._uncommitted) + list(self._queue)
                    if j.kind == "delta"]

    def stats(self) -> list[AsyncStats]:
        with self._cond:
            return list(self._history)

    def set_limits(self, host_budget: int | None, max_inflight: int | None) -> None:
        if host_budget is not None:
            self.pool.set_budget(host_budget)
        if max_inflight is not None:
            with self._cond:
                self.max_inflight = max_inflight
                self._cond.notify_all()

    # ---- background -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._abandoned:
                    self._cond.wait()
                if self._abandoned:
                    return
                job = self._current = self._queue[0]
            if job.kind == "stop":
                with self._cond:
                    self._queue.popleft()
                    self._current = None
                    self._cond.notify_all()
                return
            if job.kind == "vote-failed":
                self._vote_failed(job)
                continue

            def attempt(job: _Job = job) -> list[_Job]:
                earlier = self._error
                if earlier is not None:
                    # (from: a round's FAILED vote describes the root error, errors.describe)
                    raise CheckpointAbortedError(
                        f"{self._what(job)} was not written: an earlier checkpoint failed "
                        f"({earlier})") from earlier
                try:
                    return self._persist(job)
                except BaseException as e:
                    # kept before commit_round re-raises it: the round has told the other ranks
                    # already (a FAILED vote), they may stop, and this rank's training loop,
                    # seeing them gone, asks check() why: it must get this rank's own failure
                    self._record(e)
                    raise

            try:
                if job.loan is not None and not job.loan.wait(lambda: self._abandoned, LOAN_POLL_S):
                    # (not a failure: the lender records the state another way; nothing
                    # appended is rolled back)
                    raise LoanWithdrawnError(f"{self._what(job)} was not written: {job.loan.why}")
                if self.commit_round is not None and (job.kind != "delta" or job.commit):
                    # this rank votes in the round, also on failure; futures resolve only once
                    # the round is over (a caller woken earlier could start a collective of its
                    # own while this thread is still in the round's)
                    done = self.commit_round(attempt)
                else:
                    done = attempt()
                self._resolve(job, done)
            except LoanWithdrawnError as e:
                job.future.set_exception(e)
            except BaseException as e:  # noqa: BLE001 - handed to the future and the store
                self._fail(job, e)
            finally:
                if job.loan is not None:
                    job.loan.give_back()
                if job.copy is not None:
                    job.copy.wait()  # (a job failed before its copy ended: not released under it)
                self._release_arenas(job)
                job.leaves = []
                with self._cond:
                    self._queue.popleft()
                    self._current = None
                    if job.kind in ("snapshot", "delta"):
                        self._inflight -= 1
                    self._cond.notify_all()
            hook = self.after_snapshot
            if hook is not None and job.kind == "snapshot" and job.future.done() and \
                    not job.future.cancelled() and job.future.exception() is None:
                try:
                    hook(job.iteration)
                except Exception:  # noqa: BLE001 - a hook failure must not stop the persister
                    logging.getLogger("ckptstore").exception("ckptstore: after-snapshot hook failed")

    def _vote_failed(self, job: _Job) -> None:
        """The round of a job whose submit failed on this rank: vote FAILED (the caller already
        has the error)."""
        err = job.error
        assert err is not None and self.commit_round is not None

        def fail() -> None:
            raise err

        try:
            self.commit_round(fail)
        except BaseException:  # noqa: BLE001 - reported by submit already
            pass
        with self._cond:
            self._queue.popleft()
            self._current = None
            self._cond.notify_all()
        job.future.set_result(None)

    @staticmethod
    def _what(job: _Job) -> str:
        return f"iteration {job.iteration} ({job.kind})" if job.kind in ("snapshot", "delta") \
            else "the flush"

    def _persist(self, job: _Job) -> list[_Job]:
        """Write ``job`` (and commit it when it commits); returns the jobs now committed, whose
        futures :meth:`_resolve` sets."""
        job.t_start = time.perf_counter()
        cpu0 = time.thread_time()
        for ev in job.events:
            ev.synchronize()
        copy = job.copy
        if copy is not None:
            copy.wait()
            if copy.error is not None:
                raise copy.error
            if job.stats is not None:
                job.stats.overlap_s = copy.seconds
        engine = self.engine
        committed = True
        save: SaveStats | None = None
        extra = {STATS_FIELD: job.stats.to_manifest()} if job.stats is not None else None
        if job.kind == "snapshot":
            save = engine.save_snapshot(job.iteration, job.skeleton, job.meta, job.leaves,
                                        extra=extra, stats_field=STATS_FIELD, background=True)
        elif job.kind == "delta":
            save = engine.append_delta(job.iteration, job.skeleton, job.meta, job.leaves,
                                       job.commit, extra=extra, stats_field=STATS_FIELD)
            committed = job.commit
        else:
            engine.commit_group()
        if save is not None and job.stats is not None:
            s = job.stats
            s.save, s.logical_bytes, s.written_bytes = save, save.logical_bytes, save.written_bytes
            s.dedup_bytes, s.write_s = save.dedup_bytes, save.seconds
            s.cpu_s = time.thread_time() - cpu0 + (copy.seconds if copy is not None else 0.0)
        with self._cond:
            if job.kind != "flush":
                self._uncommitted.append(job)
            done = self._uncommitted if committed else []
            if committed:
                self._uncommitted = []
        return done

    def _resolve(self, job: _Job, done: list[_Job]) -> None:
        now = time.perf_counter()
        for j in done:
            assert j.stats is not None  # a save job gets its stats before it is queued (submit)
            j.stats.persist_s = now - j.t_start
            with self._cond:
                self._history.append(j.stats)
            j.future.set_result(j.stats)
        if job.kind == "flush":
            job.future.set_result(None)

    def _record(self, err: BaseException) -> bool:
        """Keep ``err`` as the failure check() reports (the first one only), unless it only
        aborts a job queued behind an earlier failure (that one is reported); a global round's
        abort is a failure of its own on this rank, as on every other. Returns whether ``err``
        is a failure of its own. Called by the persister while the failed job is still queued,
        so check() (which waits for the queue) cannot report it before the job is settled."""
        if isinstance(err, CheckpointAbortedError) and not isinstance(err, GlobalCommitAbortedError):
            return False
        with self._cond:
            if self._error is None:
                self._error, self._reported = err, False
        return True

    def _fail(self, job: _Job, err: BaseException) -> None:
        with self._cond:
            lost, self._uncommitted = self._uncommitted, []
        if self._record(err):
            self.engine.abandon_group()
        for j in lost:
            e = CheckpointAbortedError(f"{self._what(j)} was rolled back before its commit: "
                                       f"{self._what(job)} failed ({err})")
            e.__cause__ = err
            j.future.set_exception(e)
        job.future.set_exception(err)
