"""Where a Checkpointer's chain stands in the store and how each step extends it (the
synchronous delta path, the snapshots mode, base snapshots, failure handling); the asynchronous
delta path is :mod:`ckptstore.torch.async_steps`.

Call sequence of one step (:class:`StepWriter`):

1. :meth:`StepWriter.begin_sync` (before ``optimizer.step()``): resynchronise with the store after a
   failure or on the first step (a base of the live state restarts the chain when records were
   lost), check the iteration, take what the record holds from before the step (RNG states,
   hyperparameters, gradients). An error here leaves the live objects untouched;
2. the caller applies ``optimizer.step()`` and ``scheduler.step()``;
3. :meth:`StepWriter.end_sync`: write the record (a base when due, else a delta; in the snapshots
   mode a snapshot when due, else nothing), or :meth:`StepWriter.failed` when the step failed.
4. Before the next ``optimizer.step()`` (and before a restore changes the live objects):
   :meth:`StepWriter.await_copy`. An asynchronous base is an *overlapped* snapshot
   (:mod:`ckptstore.ops.deferred_copy`): the parameters and the optimizer state are copied in the
   background while the next forward and backward run, which do not change them.

The snapshots mode's pair is :meth:`StepWriter.snap_begin` / :meth:`StepWriter.snap_end`, the
asynchronous delta path's :func:`ckptstore.torch.async_steps.begin_async` / ``end_async``; the
Checkpointer picks one pair per step.

Invariants: ``last`` is the iteration of the live objects once a step ended (None before the
first); ``resync`` is set whenever records may have been lost, and the next step then restarts
the chain from what the store holds, so nothing committed is lost and no chain has a gap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import CkptStoreError, DeltaChainError
from ..multirank.job_store import JobStore
from .auto_policy import AutoPolicy
from .failure_policy import FailurePolicy
from .grad_capture import GradCapture
from .live_state import capture_rng, hyperparameters, tensor_bytes
from .plan import SNAPSHOTS
from .records import RecordBuilder


@dataclass
class Step:
    """One step between its begin and its end (:class:`StepWriter`; for
    :meth:`Checkpointer.before_step`, between the two halves): what the record takes from before
    ``optimizer.step()``."""

    iteration: int
    #: False: the store could not take a record and the failure policy trains on without one
    recorded: bool
    t0: float = 0.0
    rng: Any = None
    hyper: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    err: dict = field(default_factory=dict)
    #: the host arena holding the captured gradients (owned until the record is submitted)
    arena: Any = None
    pipe: Any = None
    #: a step of the snapshots mode (writes a snapshot when due, else nothing)
    snap: bool = False

    def release(self) -> None:
        """Give the captured gradients' arena back (the record will not take it)."""
        if self.arena is not None and self.pipe is not None:
            self.pipe.pool.release(self.arena)
            self.arena = None


class StepWriter:
    """The records of a Checkpointer's steps in ``store`` (see the module docstring).
    ``base_every``: an int, "auto" or None (``Checkpointer``'s argument, checked);
    ``capture_grads``: the asynchronous path takes gradients from ``capture``."""

    def __init__(self, store: Any, records: RecordBuilder, capture: GradCapture,
                 auto: AutoPolicy, failures: FailurePolicy, *, asynchronous: bool,
                 base_every: int | str | None, group_commit: int, group_seconds: float | None,
                 target_recovery_s: float, capture_grads: bool, overlap: bool = True) -> None:
        self.store = store
        #: asynchronous bases copy the parameters and optimizer state while the next step runs
        self.overlap = overlap
        #: the last overlapped base's future and its submit stall, until :meth:`await_copy`
        self.pending_copy: tuple[Any, float] | None = None
        self.records = records
        self.capture = capture
        self.auto = auto
        self.failures = failures
        self.asynchronous = asynchronous
        self.base_every = base_every
        self.group_commit = group_commit
        self.group_seconds = group_seconds
        self.target_recovery_s = target_recovery_s
        self.capture_grads = capture_grads
        #: the live objects' iteration (None: not known before the first step or restore)
        self.last: int | None = None
        #: the base of the chain the next delta extends
        self.base: int | None = None
        #: the next step writes a base (a job store's new epoch starts its own chain)
        self.force_base = False
        #: records were lost (a failure): the next step restarts the chain
        self.resync = False
        self.group_n = 0  # deltas of the open group (asynchronous path)
        self.group_t0 = 0.0  # when the open group's first delta was submitted
        #: what the current step wrote: "plain" (nothing), "delta" or "base"
        self.wrote = "plain"
        self.last_stats: Any = None
        # cost model for base_every="auto" (exponential moving averages, seconds)
        self.base_cost: float | None = None
        self.delta_cost: float | None = None

    # ---- costs and the base interval --------------------------------------------------------
    def ema(self, attr: str, v: float) -> None:
        old = getattr(self, attr)
        setattr(self, attr, v if old is None else 0.8 * old + 0.2 * v)

    def cost_callback(self, attr: str, foreground: float) -> Any:
        def done(fut) -> None:
            if not fut.cancelled() and fut.exception() is None:
                st = fut.result()
                self.ema(attr, foreground + st.stall_s + st.write_s)
        return done

    def durable_callback(self, fut: Any) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.failures.succeeded()

    def interval(self) -> int | None:
        """The current base interval (fixed, or chosen from measured costs for "auto"); None with
        ``base_every=None`` (no periodic bases: a follower writes them)."""
        planned = self.auto.base_every()
        if planned is not None:
            return planned  # (the deltas mode of policy="auto")
        if self.base_every is None:
            return None
        if self.base_every != "auto":
            assert isinstance(self.base_every, int)  # checked: a positive int or "auto"
            return self.base_every
        if self.base_cost is None or not self.delta_cost:
            return 50
        # worst-case recovery ~ base load (~ base write) + interval * per-delta replay
        n = int((self.target_recovery_s - self.base_cost) / self.delta_cost)
        return max(1, min(n, 100_000))

    def base_due(self, iteration: int) -> bool:
        """Whether the record of ``iteration``, the next step, will be a base snapshot rather
        than a delta (the base interval, or a chain that must restart with a base)."""
        interval = self.interval()
        return self.force_base or (interval is not None and
                                   iteration - (self.base if self.base is not None else 0) >= interval)

    # ---- base snapshots ----------------------------------------------------------------------
    def save_base(self, iteration: int, meta: dict | None = None, measured: bool = True) -> Any:
        """Write a base snapshot of the live state as ``iteration`` (flushes pending deltas).
        Asynchronous: returns the future of :meth:`ckptstore.Store.save_async`. ``measured``
        False: a chain's first base, whose window is no cost sample
        (:meth:`AutoPolicy.snapshot_submitted`)."""
        t0 = time.perf_counter()
        state = self.records.base_state(iteration, self.auto.persisted())
        self.failures.check_space(self.store.path, tensor_bytes(state), iteration)
        if self.asynchronous:
            deferred = self.records.changed_only_by_step() if self.overlap else None
            fut = self.store.save_async(iteration, state, meta=meta, deferred=deferred)
            self.auto.snapshot_submitted(measured)  # (before the callback reporting it durable)
            if fut.deferred is not None:  # (something was deferred: AsyncStats.overlap_bytes)
                self.pending_copy = (fut, time.perf_counter() - t0)
            fut.add_done_callback(self.cost_callback("base_cost", 0.0))
            fut.add_done_callback(self.durable_callback)
            fut.add_done_callback(self.auto.observe_snapshot)
            self.wrote = "base"
            self.last = self.base = iteration
            self.group_n = 0  # the base commits every pending delta
            self.force_base = False
            return fut
        stats = self.store.save(iteration, state, meta=meta)
        self.ema("base_cost", time.perf_counter() - t0)
        self.wrote = "base"
        self.auto.observe_sync_snapshot(time.perf_counter() - t0, stats, measured)
        self.last = self.base = iteration
        self.force_base = False
        self.failures.succeeded()
        return stats

    def await_copy(self) -> None:
        """Step 4: the overlapped copy of the last base is complete, so ``optimizer.step()`` (or
        a restore) may change what it copies. Its stall (the submit plus this wait) is the
        snapshot's stall sample (AutoPolicy leaves an overlapped one's AsyncStats out)."""
        pending, self.pending_copy = self.pending_copy, None
        if pending is not None:
            fut, submit_s = pending
            self.auto.meter.add("stall", submit_s + fut.copied())

    # ---- where the chain stands ----------------------------------------------------------------
    def check_follows(self, iteration: int, top: int | None) -> None:
        """Refuse ``iteration`` unless it follows the last logged iteration and the store holds
        nothing at or after it (``top``: its newest committed or pending iteration). Checked
        before ``optimizer.step()``, so a refused step leaves the live objects untouched."""
        assert self.last is not None  # both callers resynchronise (setting it) before this check
        if iteration != self.last + 1:
            raise DeltaChainError(f"Checkpointer.step({iteration}): the last logged iteration is "
                                  f"{self.last}; iterations must follow each other")
        if top is not None and top >= iteration:
            raise DeltaChainError(f"Checkpointer.step({iteration}): {self.store.path} already holds "
                                  f"iteration {top} (restored {self.last}); iterations must increase")

    def check_resumes(self, iteration: int) -> None:
        """Before a chain restart: ``iteration`` must follow the live objects' iteration, or the
        base written for ``iteration - 1`` would be labelled with the wrong iteration."""
        if self.last is not None and iteration != self.last + 1:
            raise DeltaChainError(f"Checkpointer.step({iteration}): the live state is that of "
                                  f"iteration {self.last}; iterations must follow each other")

    def continue_chain(self, latest: int) -> None:
        """The live state is that of ``latest``, the store's newest iteration: the next step
        extends its chain, or, on a job store reopened by a new job (whose streams hold no chain
        yet), starts one with a base (format-spec/format.md §22.4)."""
        if isinstance(self.store, JobStore) and \
                self.store.global_commit(latest).epoch != self.store.epoch:
            self.last, self.base, self.force_base = latest, latest, True
        else:
            self.last, self.base = latest, self.store.base_of(latest)

    def restart_sync(self, iteration: int) -> None:
        """Synchronous path, before the first step or after a failure (``resync``): find where
        the store's chain ends. Unless it ends at ``iteration - 1`` (a first step resumes from
        the latest iteration instead), the live state, that of ``iteration - 1``, starts a new
        chain as a base snapshot. Raises before ``optimizer.step()``; ``resync`` stays set."""
        self.check_resumes(iteration)
        latest = self.store.latest()  # after a failed rollback this recovers (cuts pending deltas)
        if self.resync and self.store.pending():
            # deltas appended before the failed one are intact: commit them (chain continuity)
            self.store.flush()
            latest = self.store.latest()
        if latest is None or (self.resync and latest != iteration - 1):
            self.save_base(iteration - 1, measured=False)
        else:
            self.continue_chain(latest)
        self.resync = False

    def rebase_withdrawn(self) -> None:
        """A withdrawn loan (:mod:`ckptstore.torch.grad_capture`, "Lending") left the chain one
        iteration short of the live state, and no delta step follows to restart it (a flush, a
        close, a switch to snapshots): write the live state, that iteration's, as a base now.
        Called between steps only."""
        owed, self.capture.withdrawn = self.capture.withdrawn, None
        pipe = self.store.running_pipeline if self.asynchronous else None
        if owed is None or pipe is None or owed != self.last:
            return
        tail = pipe.tail()
        if tail is None or tail < owed:
            self.save_base(owed, measured=False)

    # ---- failures ------------------------------------------------------------------------------
    def policy_failed(self, error: BaseException, iteration: int) -> None:
        """The failure policy's verdict on ``error`` (returns to keep training). When it raises,
        this rank stops: a job store is marked broken first, so close() runs no commit round
        that the other ranks, blocked in the training job's own collectives while they wait
        for this rank, would never join (each waited ``commit_timeout`` before); they learn of
        the failure from their own round's outcome or when this rank's process ends."""
        try:
            self.failures.failed(error, iteration)
        except BaseException as raised:
            if isinstance(self.store, JobStore) and isinstance(raised, CkptStoreError):
                self.store.mark_broken(raised)
            raise

    def failed(self, st: Step, e: BaseException) -> None:
        """The step of ``st`` failed after ``optimizer.step()`` began: the store rolled the failed
        record (or group) back, the live objects may hold the state of ``st.iteration``: the next
        step re-reads the store and restarts the chain with a base when records were lost."""
        st.release()
        self.capture.forget()  # (gradients lent for the record that failed: let go of them)
        self.last = st.iteration
        self.resync = True
        self.policy_failed(e, st.iteration)  # raises unless the policy keeps training
        return None

    def switch(self, mode: str, iteration: int, resumed: bool = False) -> None:
        """Write ``mode`` from step ``iteration`` on. To snapshots: this step snapshots (which
        commits the pending deltas). To deltas: every save in flight is made durable first,
        then the delta path restarts its chain at the live state (a base of ``iteration - 1``),
        or, when the store's newest iteration is that already (a snapshot of the step before,
        written before the switch), this step writes a base instead of its delta: either way
        the chain's base is written after the switch and persists the plan in force
        (format-spec/deltas.md, "Persisted plan"); not ``resumed`` right after a restore, whose
        chain's base is the one the plan was read from. Nothing committed is lost either way."""
        if mode == SNAPSHOTS:
            pipe = self.store.running_pipeline
            if pipe is not None:
                self.capture.release(pipe)  # captured for a delta this step will not write
            self.capture.forget()
            self.force_base = True
        else:
            try:
                self.store.flush()
            except BaseException as e:
                self.policy_failed(e, iteration)  # raises unless the policy keeps training
            self.resync = True
            if not resumed and self.store.latest() == iteration - 1:
                self.force_base = True

    # ---- the steps -----------------------------------------------------------------------------
    def begin_sync(self, iteration: int, own_grads: bool) -> Step:
        """What a step of the synchronous delta path does before ``optimizer.step()``:
        resynchronise with the store after a failure, check ``iteration``, take RNG states,
        hyperparameters and gradients. ``own_grads``: the gradient payloads must not alias the
        live gradients."""
        try:
            if self.resync or self.last is None:
                self.restart_sync(iteration)
            else:
                try:
                    self.store.check()  # a failed group-timer commit, before optimizer.step
                except BaseException:
                    self.resync = True
                    raise
        except BaseException as e:
            self.policy_failed(e, iteration)  # raises unless the policy keeps training
            return Step(iteration, recorded=False)
        self.check_follows(iteration, self.store.tail())
        t0 = time.perf_counter()
        rng = capture_rng()
        hyper = hyperparameters(self.records.optimizer)
        grads, err = self.records.encode_grads()
        if own_grads:
            grads = self.records.own_payloads(grads)
        return Step(iteration, True, t0, rng, hyper, grads, err)

    def unrecorded(self, st: Step) -> None:
        """The end of a delta step the store could not take a record of (the "retry" policy):
        training went on; the next step restarts the chain with a base."""
        self.last = st.iteration
        self.resync = True
        self.capture.forget()

    def end_sync(self, st: Step, meta: dict | None) -> Any:
        """What a step of the synchronous delta path does after ``optimizer.step()`` and
        ``scheduler.step()``: write the record of ``st.iteration`` (a base when due, else a
        delta)."""
        iteration = st.iteration
        try:
            if self.base_due(iteration):
                stats = self.save_base(iteration, meta)
            else:
                record = self.records.delta_record(iteration, st.grads, st.hyper, st.rng, st.err)
                stats = self.store.save_delta(iteration, record, meta, durable=False)
                self.last = iteration
                self.wrote = "delta"
                self.auto.observe_sync_delta(stats)
                if len(self.store.pending()) >= self.group_commit or (
                        self.group_seconds is not None and
                        self.store.pending_age() >= self.group_seconds):
                    self.store.flush()
                    self.failures.succeeded()
                # replaying a delta costs about its read (~ its write) plus the optimizer step
                self.ema("delta_cost", time.perf_counter() - st.t0)
        except BaseException as e:
            return self.failed(st, e)
        self.last_stats = stats
        return stats

    # ---- the snapshots mode ----------------------------------------------------------------
    def snap_begin(self, iteration: int) -> Step:
        """A step of the snapshots mode, before ``optimizer.step()``: an earlier background
        failure is reported (the failed snapshot is written again at this step when the policy
        keeps training), the first step finds where the store ends, ``iteration`` is checked."""
        pipe = None
        try:
            if self.asynchronous:
                pipe = self.store.pipeline
                pipe.check()
            else:
                self.store.check()
        except BaseException as e:
            self.force_base = True
            self.policy_failed(e, iteration)  # raises unless the policy keeps training
            pipe = self.store.running_pipeline if self.asynchronous else None
        if self.capture.withdrawn is not None:  # (a delta step would restart the chain itself)
            try:
                self.rebase_withdrawn()
            except BaseException as e:
                self.force_base = True
                self.policy_failed(e, iteration)  # raises unless the policy keeps training
        if self.last is None:
            try:
                latest = self.store.latest()
                if latest is None:
                    # an empty store: the live state first
                    self.save_base(iteration - 1, measured=False)
                else:
                    self.continue_chain(latest)
            except BaseException as e:
                self.policy_failed(e, iteration)
                return Step(iteration, recorded=False, snap=True)
        self.check_follows(iteration, pipe.tail() if pipe is not None else self.store.tail())
        return Step(iteration, True, snap=True)

    def snap_end(self, st: Step, meta: dict | None) -> Any:
        """A step of the snapshots mode, after ``optimizer.step()``: a snapshot of the live
        state when due (the interval, or one forced), else nothing (returns None)."""
        iteration = st.iteration
        self.last = iteration
        if not st.recorded:
            self.force_base = True
            return None
        every = self.auto.snapshot_every()
        since = iteration - (self.base if self.base is not None else iteration)
        if not (self.force_base or (every is not None and since >= every)):
            return None
        try:
            out = self.save_base(iteration, meta)
        except BaseException as e:
            self.force_base = True
            self.policy_failed(e, iteration)  # raises unless the policy keeps training
            return None
        self.last_stats = out
        return out
