"""The Checkpointer: a checkpoint every iteration for the price of its gradients.

    ckpt = Checkpointer(store, model, optimizer, scheduler, policy="every-iteration",
                        base_every=200, codec="exact")
    start = ckpt.restore()
    for it in range(start + 1, n + 1):
        loss = model(batch(it)).loss; loss.backward()
        ckpt.step(it, meta={"loss": loss.item()})   # optimizer.step(), scheduler.step(), logging
        optimizer.zero_grad()

``step(it)`` calls ``optimizer.step()`` and ``scheduler.step()`` itself, then appends the delta
record of iteration ``it`` (gradients as applied, hyperparameters, scheduler and RNG states,
non-parameter model state, meta) or, when due, a base snapshot. A loop that applies the
optimizer step itself (a framework's trainer) calls the two halves instead,
``before_step(it)``, its own ``optimizer.step()`` / ``scheduler.step()``, ``after_step(meta)``,
and gets the same record. Deltas are group-committed: one fsync pair per ``group_commit``
deltas or once the oldest uncommitted delta is ``group_seconds`` old, whichever comes first.
The time bound holds without further steps (an eval loop, a data stall): ``group_seconds``
starts the store's group-commit timer (``Store.set_group_seconds``, :mod:`ckptstore.ops.grouptimer`),
which commits from a background thread. ``store.durable_iteration()`` says what survives a crash
now.

By default (``asynchronous=True``) every record goes through the store's pipeline
(:mod:`ckptstore.ops.pipeline`): ``step`` only snapshots into host buffers and returns a future; the
write, fsync and commit run in the background. With the exact codec the gradients are captured
layer by layer while backward runs (``register_post_accumulate_grad_hook`` copies each parameter's
gradient into a pooled host buffer as soon as it is accumulated), so ``step`` copies only what
was not captured or changed since (checked by the gradient tensor's identity and ``_version``:
in-place changes such as ``clip_grad_norm_`` are seen and recopied; writes through ``.data`` or
numpy aliases are not, and the recorded fingerprints then make replay fail loudly). Once the
loop is seen to drop its gradients after each step (``zero_grad()``'s default), the large ones
are not copied at all but lent to the record and written from their own memory once the loop
has dropped them unchanged (``capture="lend"``, :mod:`ckptstore.torch.grad_capture`).
Under DistributedDataParallel, :func:`ddp_comm_hook` captures the all-reduced buckets instead.

What to write is the ``policy`` (:mod:`ckptstore.torch.plan` holds the model): "every-iteration"
(a delta every iteration, above), "snapshots" (an asynchronous snapshot every ``snapshot_every``
iterations, nothing in between: any optimizer, no replay) or "auto" (costs measured over the
first steps, then whichever of the two the goodput model prefers for the failure rate, re-planned
when the costs drift, within a disk budget). The default: "auto", for any number of ranks; the
example above writes a delta every iteration with ``policy="every-iteration"``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from ..engine.engine import DEFAULT_CHUNK_SIZE
from ..errors import (CheckpointPlanError, CkptStoreError, DeltaChainError, NotFoundError,
                      RankFailureError, UnreplayableOptimizerError)
from ..format.delta import OPTIMIZER_NAMES
from ..multirank.job_store import JobStore
from ..ops.retention import Policy
from ..replay.gradcodecs import parse_codec
from .arguments import check_policy_args, check_step_args, is_replayable
from .async_steps import begin_async, end_async
from .auto_policy import AutoPolicy, default_budget, default_policy
from .plan_history import PLAN_KEY, job_restarts
from .failure_policy import CheckpointerStats, CheckpointHealth, FailurePolicy
from .grad_capture import GradCapture
from .param_layout import ParamLayout
from .plan import DELTAS, SNAPSHOTS, CostMeter, Plan
from .plan_agreement import RankAgreement
from .plan_retention import PlanRetention
from .records import RecordBuilder
from .restore import restore_live
from .step_writer import Step, StepWriter

log = logging.getLogger("ckptstore")


class _Forward:
    """A Checkpointer attribute kept by one of its parts (``part``: the attribute holding it),
    read and set there: one copy of each setting."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.part), self.name, value)


class Checkpointer:
    """Per-iteration checkpoints of ``model`` + ``optimizer`` (+ ``scheduler``) in ``store``.

    ``base_every``: an int (a base snapshot every that many iterations) or "auto" (chosen from the
    measured base-write and per-delta replay costs so the worst-case recovery time, base load plus
    replay of every delta since, stays under ``target_recovery_s``), or None (also spelled
    "follower"): no periodic bases, only the chain's first one (iteration 0 of an empty store)
    and the base a chain restart needs (after a failure); a shadow follower (``ckptstore
    follow``, :mod:`ckptstore.follow`) writes the others into its own store, and restores start
    from them (format-spec/follower.md).
    ``codec``: "exact" | "bf16" | "fp16" | "topk:F" | "int8" (ckptstore.replay.gradcodecs).
    ``apply_decoded``: with a lossy codec, train on the decoded gradient (it is copied into
    ``p.grad`` before ``optimizer.step()``), so replay is exact again.
    ``fingerprint_every``: record an xxh3 fingerprint of the parameters every k iterations (0: never);
    replay checks it and raises ReplayDivergenceError on a mismatch.
    ``asynchronous``: write through the store's async pipeline (default); ``step`` and
    ``save_base`` then return futures resolved when the record is durable. A background failure is
    raised by the next ``step`` (before ``optimizer.step()``); the step after it restarts the chain
    with a base snapshot of the live state when deltas were lost. The synchronous path does the
    same after a failed write or commit (see :meth:`step`).
    ``capture`` (exact codec, asynchronous): "lend" (default): once the training loop is seen
    to drop its gradients after each step (``zero_grad()``'s default ``set_to_none=True``), the
    large CPU gradients that own their memory are not copied: the persister writes them from
    their own memory (:mod:`ckptstore.torch.grad_capture`, "Lending"; a gradient changed in
    place stops lending for good and that iteration is written as a base instead); until
    then, and for the rest, as "hooks": copy gradients during backward; "step": copy them at
    ``step``. A lent record is written once its gradients cannot change: the loop dropped them
    unchanged (seen by the persister itself), or its next backward, step, flush, close, or
    ``result()``/``exception()``/``done()`` on the step's future confirmed them (not
    ``concurrent.futures.wait``, which none of these sees). Lending is off on multi-rank job
    stores, under DDP (buckets are captured) and with ``group_seconds`` (its time bound must
    hold while training pauses, with no step to confirm a loan).
    ``partition``: on a multi-rank job store, each rank writes only its share (default): whole
    parameters for data parallelism (format-spec/deltas.md, "Partitioned states"); for DTensor
    parameters its local shards, each box several ranks hold written by one of them ("Sharded
    states"). False: every rank writes everything it holds. True: partition (refused for
    DTensor parameters, which are always written as local shards).
    ``on_failure``: "raise" (default) or "retry": keep training through storage failures, logged
    and counted, until ``max_failures`` in a row or no durable checkpoint for ``max_lag_s``
    seconds (:mod:`ckptstore.torch.failure_policy`; :meth:`health` says how it is going,
    :meth:`stats` says it beside the store's per-checkpoint statistics).

    ``policy``: what to write (:mod:`ckptstore.torch.plan`). "every-iteration": the delta records
    above. "snapshots": an asynchronous snapshot (``store.save_async``; ``store.save`` when not
    ``asynchronous``) every ``snapshot_every`` iterations (None: the planner's interval, chosen
    after ``measure_steps`` steps and ``auto_policy.MEASURE_WINDOWS`` snapshots measured its
    costs), nothing in between (a step's ``meta`` is stored only when it snapshots; ``step``
    returns None then). "auto": ``measure_steps`` plain steps with a snapshot every
    ``auto_policy.MEASURE_SNAPSHOT_GAP`` steps or more (the interval the snapshots measured so
    far plan, up to ``2 * measure_steps``) until ``MEASURE_WINDOWS`` snapshots' costs are
    measured (one is too noisy to plan from); then, only where deltas could beat that snapshot
    plan at the least a delta is predicted to cost (:mod:`ckptstore.torch.delta_forecast`, from
    the snapshots' measured cost per byte), ``measure_steps`` delta steps (from
    ``auto_policy.EARLY_STOP_SAMPLES`` on, fewer once they clearly lose); then the plan with the
    better expected goodput (:meth:`plan` says which and why, and why deltas were not measured;
    logged, logger "ckptstore", INFO, whenever it changes); costs keep being measured and a
    drift of more than 30%, or a new ``mtbf_s`` (:meth:`replan`), re-plans. In the deltas
    mode of "auto" the base interval is the plan's. Every base carries the plan's inputs
    (format-spec/deltas.md, "Persisted plan"): a Checkpointer that restores from such a base
    plans at once from them, without measuring again. On a multi-rank job
    store every rank plans from the costs of all (the largest of each, the smallest MTBF and
    disk budget, split over the ranks: :mod:`ckptstore.torch.plan_agreement`), so all write the
    same plan; every rank must then step the same iterations and call :meth:`replan` together.
    None (default): "auto", so that a run given nothing is bounded by the default disk budget
    (its first plan is logged, INFO, saying it is the default), for any number of ranks (on a
    multi-rank job store the plan's retention is the job's collective gc).
    An optimizer replay does not know (Lion, 8-bit Adam, a custom one) is always checkpointed by
    snapshots; ``policy="every-iteration"`` with one raises UnreplayableOptimizerError.
    ``mtbf_s``: the mean time between failures (seconds) the plan assumes; None: learned from a
    job store's restarts (its epochs), or from a single store's restarts its persisted plans
    count, when there are any, else 24 h, and the plan says so.
    ``disk_budget``: bytes the checkpoints may take; None: half the free space of the store's
    filesystem at open (:data:`ckptstore.torch.auto_policy.DEFAULT_DISK_SHARE`). The plan keeps
    each interval within it and says how many checkpoints fit (``plan().retention``); unless
    ``retention`` is given, the Checkpointer applies a retention
    that keeps the store within it (the newest quarter of ``plan().retention`` kept by a gc before
    80% of it is written). Policy "every-iteration" makes
    no plan and applies none: pass ``retention`` to bound it.
    ``retention``: a retention policy (:mod:`ckptstore.ops.retention`, e.g.
    ``KeepLast(50) | KeepEvery(500)``) the store applies after every ``retention_every``-th
    base this Checkpointer writes (:meth:`ckptstore.Store.set_retention`; on a job store
    :meth:`ckptstore.JobStore.set_retention`, the job's collective gc), so that a run's disk use
    stays bounded: what it keeps loads bit for bit, delta chains included.
    ``overlap``: an asynchronous base (a snapshot) copies the parameters and the optimizer
    state in the background while the next step's forward and backward run, and the next
    ``optimizer.step()`` (``step`` or ``before_step``) first waits for that copy (CheckFreq's
    rule, :mod:`ckptstore.ops.deferred_copy`): the stall is the rest of the state (buffers, RNG,
    scheduler) plus whatever of the copy is left then. Between steps, change the parameters and
    the optimizer state only through the step (an in-place change the tensors' version counters
    see fails that checkpoint with LiveStateChangedError; a write through ``.data`` is not seen).
    False: everything is copied before ``step`` returns.
    Bad values raise CheckpointPlanError (a ValueError) naming the argument, before anything is
    written.
    """

    # (the arguments live in the part that uses them; these read and set them there)
    policy = _Forward("_writer", "failures")  # the FailurePolicy
    asynchronous = _Forward("_writer", "asynchronous")
    base_every = _Forward("_writer", "base_every")
    group_commit = _Forward("_writer", "group_commit")
    group_seconds = _Forward("_writer", "group_seconds")
    target_recovery_s = _Forward("_writer", "target_recovery_s")
    model = _Forward("_records", "model")
    optimizer = _Forward("_records", "optimizer")
    scheduler = _Forward("_records", "scheduler")
    codec = _Forward("_records", "codec")
    apply_decoded = _Forward("_records", "apply_decoded")
    fingerprint_every = _Forward("_records", "fingerprint_every")

    def __init__(self, store, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, *, base_every: int | str | None = 200, codec: str = "exact",
                 apply_decoded: bool = False, group_commit: int = 1, group_seconds: float | None = None,
                 fingerprint_every: int = 10, target_recovery_s: float = 30.0,
                 asynchronous: bool = True, capture: str = "lend",
                 partition: bool | None = None, on_failure: str = "raise",
                 max_failures: int = 3, max_lag_s: float | None = 3600.0,
                 policy: str | None = None, snapshot_every: int | None = None,
                 mtbf_s: float | None = None, disk_budget: int | None = None,
                 measure_steps: int = 8, retention: Policy | None = None,
                 retention_every: int = 1, overlap: bool = True) -> None:
        check_policy_args(policy, snapshot_every, mtbf_s, disk_budget, measure_steps)
        if type(overlap) is not bool:
            raise CheckpointPlanError(f"overlap must be True or False, not {overlap!r}")
        replayable = is_replayable(optimizer)
        if not replayable:
            why = (f"optimizer {type(optimizer).__qualname__} is not replayable; supported: "
                   f"{', '.join('torch.optim.' + n for n in OPTIMIZER_NAMES)}")
            if policy == "every-iteration":
                raise UnreplayableOptimizerError(
                    f'policy="every-iteration": {why} (policy="snapshots" or "auto" checkpoints '
                    f"it with snapshots)")
            log.warning("Checkpointer: %s: deltas are off, checkpoints are snapshots", why)
        job = isinstance(store, JobStore)
        defaulted = policy is None
        if policy is None:
            policy = default_policy(replayable, job and (store.world_size or 1) > 1)
        base_every = check_step_args(base_every, group_commit, group_seconds, capture)
        failures = FailurePolicy(on_failure, max_failures=max_failures, max_lag_s=max_lag_s)
        self.store = store
        grad_codec = parse_codec(codec)
        #: which parameters are logged and which this rank writes (param_layout.py)
        self._layout = ParamLayout(store, model, optimizer, partition)
        self._records = RecordBuilder(model, optimizer, scheduler, self._layout, grad_codec,
                                      bool(apply_decoded), fingerprint_every)
        self._lock = threading.Lock()
        self._peer_error: CkptStoreError | None = None  # (peer_failure: counted once)
        #: a step begun with before_step() and not yet ended with after_step()
        self._open: Step | None = None
        # ---- the checkpoint policy (ckptstore/torch/auto_policy.py, plan.py) --------------------
        self.checkpoint_policy = policy
        self.replayable = replayable
        self.snapshot_every = snapshot_every
        self.measure_steps = measure_steps
        budget_source = "given"
        if disk_budget is None:
            disk_budget, budget_source = default_budget(str(store.path))
        if retention is not None:
            # after every argument is checked (a constructor that raises leaves the store as it
            # was), before anything is written; on a job store every rank sets the same
            store.set_retention(retention, retention_every)
        #: the retention this Checkpointer derives from the plan (unless the user's)
        self._retention = PlanRetention(store, enabled=retention is None)
        self._auto = AutoPolicy(policy, replayable, snapshot_every, mtbf_s, disk_budget,
                                measure_steps, group_commit, budget_source=budget_source,
                                job_history=(lambda: job_restarts(store.view)) if job else None,
                                switch=self._switch, snapshot_now=self._snapshot_now,
                                planned=self._retention.planned, where=str(store.path),
                                defaulted=defaulted,
                                agreement=RankAgreement(store) if self._layout.world > 1
                                else None, grad_bytes=self._layout.grad_bytes())
        # ---- the write path (grad_capture.py, step_writer.py, async_steps.py) -------------------
        capture_grads = bool(asynchronous) and not self.codec.lossy and policy != "snapshots"
        auto = self._auto
        self._capture = GradCapture(store, self._layout,
                                    getattr(store, "chunk_size", None) or DEFAULT_CHUNK_SIZE,
                                    active=lambda: capture_grads and auto.mode == DELTAS,
                                    lend=capture_grads and capture == "lend" and not job
                                    and group_seconds is None)
        self._writer = StepWriter(store, self._records, self._capture, self._auto, failures,
                                  asynchronous=bool(asynchronous), base_every=base_every,
                                  group_commit=group_commit, group_seconds=group_seconds,
                                  target_recovery_s=target_recovery_s,
                                  capture_grads=capture_grads, overlap=overlap)
        if capture_grads:
            self.store.pipeline  # noqa: B018 - start it now: hooks need its pool
            if capture in ("hooks", "lend"):
                self._capture.install_hooks()
        if group_seconds is not None:
            # the time bound holds between steps too (the store's timer stays set after close)
            self.store.set_group_seconds(group_seconds)

    # ---- state ----------------------------------------------------------------------------
    def state(self, iteration: int) -> dict:
        """The live state as base snapshot ``iteration`` holds it (this rank's share of it)."""
        return self._records.base_state(iteration, self._auto.persisted())

    def save_base(self, iteration: int, meta: dict | None = None):
        """Write a base snapshot of the live state as ``iteration`` (flushes pending deltas).
        Asynchronous: returns the future of :meth:`ckptstore.Store.save_async`. (Written between
        steps, it has no step of its own: no cost sample for the checkpoint policy.)"""
        return self._writer.save_base(iteration, meta, measured=False)

    @property
    def last_stats(self) -> Any:
        """What the last record written returned (SaveStats, or a future when asynchronous)."""
        return self._writer.last_stats

    @property
    def capture_counts(self) -> dict[str, int]:
        """Gradients captured during backward ("hook"), from DDP buckets ("ddp"), at step
        ("step")."""
        return self._capture.counts

    @property
    def capture_wait_s(self) -> float:
        """Seconds of backpressure met while capturing gradients."""
        return self._capture.wait_s

    def health(self) -> CheckpointHealth:
        """How checkpointing is going: failures (total, in a row, the last), seconds since the
        last durable checkpoint, low-space warnings (:class:`~ckptstore.torch.failure_policy.
        CheckpointHealth`)."""
        return self.policy.health()

    def stats(self) -> CheckpointerStats:
        """:meth:`health` with the store's durable iteration and its per-checkpoint statistics
        (``store.stats()``), in one :class:`~ckptstore.torch.failure_policy.CheckpointerStats`."""
        return CheckpointerStats(self.policy.health(), self.store.durable_iteration(),
                                 self.store.stats())

    def peer_failure(self, cause: BaseException) -> CkptStoreError:
        """The typed error for a collective of the training job that failed under the DDP comm
        hook (``cause``: torch's error, e.g. gloo's "connection closed" after a rank died): the
        store's own background failure when it has one (a round in which another rank voted
        FAILED: GlobalCommitAbortedError naming that rank and its error), else RankFailureError
        naming this rank and ``cause``. A job store is marked broken with it, so
        ``store.check()`` reports it and close() runs no round that the dead rank would never
        join. (DDP re-raises a hook's error as RuntimeError with this error's type and message
        in its text: torch's reducer keeps no Python type. A training loop that wants the type
        back calls this method again with the RuntimeError of ``loss.backward()``: it returns
        the same error.)

        The store's error keeps its own ``__cause__`` (the failing rank's error); a new
        RankFailureError has ``cause``. The first call counts the failure in :meth:`health`;
        every later call returns the first call's error (the store may have learnt of another
        failure meanwhile, e.g. its persister's next round failing on the dead peer: this rank
        still reports the failure it reported first)."""
        with self._lock:
            if self._peer_error is not None:
                return self._peer_error
        error: CkptStoreError | None = None
        try:
            self.store.check()
        except CkptStoreError as e:
            error = e
        store = self.store
        if error is None:
            rank = store.rank if isinstance(store, JobStore) else None
            error = RankFailureError(
                f"{store.path}: the gradient all-reduce of ckptstore's DDP comm hook failed on "
                f"rank {rank}: another rank of the job died or stopped answering "
                f"({type(cause).__name__}: {cause})")
            error.__cause__ = cause
        with self._lock:
            first = self._peer_error is None
            if first:
                self._peer_error = error
            kept = self._peer_error
        assert kept is not None
        if first:
            last = self._writer.last
            self.policy.count(kept, last + 1 if last is not None else 0)
        if isinstance(store, JobStore):
            store.mark_broken(kept)
        return kept

    def capture_bucket(self, params: list[torch.Tensor], flat: torch.Tensor) -> None:
        """Copy an all-reduced DDP bucket (``flat``: the bucket's gradients of ``params``, in
        order) into the gradient slots (called by :func:`ddp_comm_hook`)."""
        self._capture.capture_bucket(params, flat)

    def close(self) -> None:
        """Remove the gradient hooks and give the capture buffer back (the store stays open)."""
        self._capture.settle()  # (the last step's lent gradients: decided while still here)
        self._writer.rebase_withdrawn()
        self._writer.await_copy()
        self._capture.remove_hooks()
        self._drop_open_step()
        self._auto.close()
        self._capture.release(self.store.running_pipeline)

    def restore(self, iteration: int | None = None, *, state: dict | None = None) -> int:
        """Load ``iteration`` (default: the latest recoverable one) into the live model, optimizer,
        scheduler and RNGs and return its number. On an empty store, write the live (initial)
        state as base snapshot 0 and return 0. ``state``: the state of ``iteration`` as
        ``store.load(iteration)`` returned it, when the caller has read it already (it is not
        read again; ``iteration`` is then required). A step left open by :meth:`before_step` is
        dropped."""
        if state is not None and iteration is None:
            raise ValueError("restore(state=...) needs the iteration the state is of")
        self._drop_open_step()
        self._writer.await_copy()  # (the live objects are about to change)
        self.store.flush() if self.store.pending() or self.store.running_pipeline is not None else None
        self._capture.forget()
        w = self._writer
        w.resync = False
        self._auto.forget_step()  # (no step-time sample across a restore)
        its = self.store.iterations()
        if not its:
            if iteration not in (None, 0) or state is not None:
                raise NotFoundError(f"iteration {iteration} is not in the empty store {self.store.path}")
            fut = self.save_base(0)
            if self.asynchronous:
                fut.result()  # the chain's first base is durable when restore returns
            return 0
        target = its[-1] if iteration is None else iteration
        t0 = time.perf_counter()
        restore_live(self.store, target, its, state, self.model, self.optimizer, self.scheduler,
                     self._layout)
        # (what loading a snapshot costs a resume; a delta's restore also replays: no sample)
        restore_s = time.perf_counter() - t0 \
            if state is None and self.store.kind(target) == "snapshot" else None
        w.continue_chain(target)
        self._auto.resume(lambda: self.store.load_record(self.store.base_of(target),
                                                         keys=[PLAN_KEY])[PLAN_KEY], target,
                          restore_s)
        return target

    # ---- training ---------------------------------------------------------------------------
    def interval(self) -> int | None:
        """The current base interval (fixed, or chosen from measured costs for "auto"); None with
        ``base_every=None`` (no periodic bases: a follower writes them)."""
        return self._writer.interval()

    def step(self, iteration: int, meta: dict | None = None):
        """Apply the optimizer step for ``iteration`` (gradients must be in ``p.grad``), step the
        scheduler, and log the iteration: a delta record, or a base snapshot when due.
        Returns SaveStats, or with ``asynchronous`` a future resolved when the record is durable.

        Failures (both paths): an error met before ``optimizer.step()`` (an earlier background
        failure, a refused iteration) leaves the live objects untouched: retry ``iteration``.
        An error met after it (the record of ``iteration`` could not be written or committed)
        is raised once the store is back to its last committed state; the live objects did take
        the step, so continue with ``iteration + 1``, whose step first writes a base snapshot of
        the live state (the chain restarts) when records were lost."""
        self._refuse_open_step(f"step({iteration})")
        self._tick(iteration)
        st = self._begin(iteration, own_grads=False)
        if not st.recorded:
            self._apply_step()  # the "retry" policy trains on without a record
            return self._tock(st, self._end(st, meta))
        try:
            t0 = time.perf_counter()
            self._apply_step()
            self.meter.add("optimizer", time.perf_counter() - t0)
        except BaseException as e:
            return self._writer.failed(st, e)
        return self._tock(st, self._end(st, meta))

    def before_step(self, iteration: int) -> None:
        """First half of :meth:`step`, for a training loop that applies the optimizer step itself
        (a framework's trainer: :mod:`ckptstore.hf`)::

            loss.backward(); clip_grad_norm_(...)   # gradients final
            ckpt.before_step(it)
            optimizer.step(); scheduler.step()      # the caller's own step
            optimizer.zero_grad()                   # allowed here: the gradients were taken
            ckpt.after_step(meta)                   # logs iteration ``it``: a delta, or a base when due

        ``before_step`` does what :meth:`step` does before ``optimizer.step()``: the checks (a
        refused iteration raises here and leaves everything untouched: retry it) and it takes
        what the record holds from before the step: the gradients (copied or, once the loop is
        seen to free them, lent; either way the caller may zero or free them before
        ``after_step``: a lent gradient zeroed in place has its iteration written as a base), the
        hyperparameters in effect and the RNG states. ``after_step`` takes the rest from after
        it (parameter groups, scheduler state, buffers, fingerprint) and writes the record with
        the same failure handling as :meth:`step` (an error there means the step was applied
        but its record is lost: continue with ``it + 1``, whose record starts a new chain with a
        base).

        Between the two the caller applies exactly one ``optimizer.step()`` of the optimizer
        given to the Checkpointer, with the gradients it had at ``before_step``, and nothing else
        that changes the parameters or the optimizer state (replay would diverge from the live
        state; the recorded fingerprints detect a changed parameter). Stepping the scheduler
        (or not), and changing hyperparameters between steps, is recorded as it happens:
        ``hyper`` at ``before_step``, parameter groups and scheduler state at ``after_step``.
        One step at a time: :meth:`step`, :meth:`before_step` and :meth:`restore` raise
        DeltaChainError while a step is open; :meth:`close` drops an open step."""
        self._refuse_open_step(f"before_step({iteration})")
        self._tick(iteration)
        self._open = self._begin(iteration, own_grads=True)

    def after_step(self, meta: dict | None = None):
        """Second half of :meth:`before_step`: log the step the caller applied since then.
        Returns what :meth:`step` returns (None when the record could not be written and the
        failure policy keeps training)."""
        st, self._open = self._open, None
        if st is None:
            raise DeltaChainError("Checkpointer.after_step() without before_step()")
        return self._tock(st, self._end(st, meta))

    def flush(self) -> int | None:
        """Commit pending deltas now; returns store.durable_iteration()."""
        if self._open is None:
            self._capture.settle()
            self._writer.rebase_withdrawn()
        return self.store.flush()

    def base_due(self, iteration: int) -> bool:
        """Whether the record of ``iteration``, the next step, will be a base snapshot rather
        than a delta (the base interval, or a chain that must restart with a base). A step whose
        chain is restarted after a failure first writes a base of ``iteration - 1``; this says
        nothing about that one."""
        return self._writer.base_due(iteration)

    # ---- the checkpoint policy (ckptstore/torch/auto_policy.py) ------------------------------
    def plan(self) -> Plan | None:
        """The current checkpoint plan (:class:`ckptstore.torch.plan.Plan`: the mode, its interval,
        the expected goodput of each mode compared, bytes per hour, retention, the costs and the
        failure rate it assumed; ``str()`` explains it), or None: policy "every-iteration" (no
        planner), or the costs are still being measured (a store without a persisted plan:
        ``measure_steps`` plain steps and ``MEASURE_WINDOWS`` snapshots' windows, the
        snapshots spaced up to ``2 * measure_steps`` steps apart where failures are rare:
        up to ``auto_policy.measuring_steps_max(measure_steps)`` steps, ~40 by default)."""
        return self._auto.plan

    @property
    def mode(self) -> str:
        """What the steps write now: "deltas" or "snapshots"."""
        return self._auto.mode

    @property
    def meter(self) -> CostMeter:
        """The costs measured so far (:class:`ckptstore.torch.plan.CostMeter`)."""
        return self._auto.meter

    @property
    def mtbf_s(self) -> float | None:
        return self._auto.mtbf_s

    @property
    def disk_budget(self) -> int | None:
        """Bytes the checkpoints may take (given, or the default share of the free space)."""
        return self._auto.disk_budget

    def replan(self, mtbf_s: float | None = None) -> None:
        """Plan again at the next step, from the costs measured so far (it does when they drift
        by itself), e.g. with a new failure rate ``mtbf_s`` (None: keep the current one).
        CheckpointPlanError for a bad ``mtbf_s``, or with policy "every-iteration"."""
        if self.checkpoint_policy == "every-iteration":
            raise CheckpointPlanError('replan: policy="every-iteration" has no plan')
        check_policy_args(self.checkpoint_policy, self.snapshot_every, mtbf_s, self.disk_budget,
                          self.measure_steps)
        self._auto.replan_soon(mtbf_s)

    # ---- one step (step_writer.py, async_steps.py) --------------------------------------------
    def _tick(self, iteration: int) -> None:
        """A step's start: the policy samples the previous step and moves on, which may switch
        the mode before this step."""
        self._writer.wrote = "plain"
        self._auto.tick(iteration)

    def _tock(self, st: Step, out: Any) -> Any:
        """A step that ended (it may have written nothing): remembered for the next sample."""
        self._auto.tock(st.iteration, self._writer.wrote if st.recorded else "base")
        return out

    def _snapshot_now(self) -> None:
        self._writer.force_base = True

    def _switch(self, mode: str, iteration: int, resumed: bool) -> None:
        self._writer.switch(mode, iteration, resumed)

    def _refuse_open_step(self, what: str) -> None:
        if self._open is not None:
            raise DeltaChainError(f"Checkpointer.{what}: step {self._open.iteration} was begun with "
                                  "before_step() and not ended with after_step()")

    def _drop_open_step(self) -> None:
        st, self._open = self._open, None
        if st is not None:
            st.release()

    def _begin(self, iteration: int, own_grads: bool) -> Step:
        """What a step does before ``optimizer.step()``, on the path of the current mode; it
        ends with the overlapped copy of any base written so far complete, also when it fails
        (the caller may step the optimizer after an error)."""
        try:
            self._capture.settle()  # (the last step's lent gradients: see grad_capture.py)
            if self._auto.mode == SNAPSHOTS:
                return self._writer.snap_begin(iteration)
            if self.asynchronous:
                return begin_async(self._writer, iteration, own_grads)
            return self._writer.begin_sync(iteration, own_grads)
        finally:
            self._writer.await_copy()

    def _end(self, st: Step, meta: dict | None) -> Any:
        """What a step does after ``optimizer.step()`` and ``scheduler.step()``: write its record
        on the path its begin took."""
        if st.snap:
            return self._writer.snap_end(st, meta)
        if not st.recorded:
            return self._writer.unrecorded(st)
        if self.asynchronous:
            return end_async(self._writer, st, meta)
        return self._writer.end_sync(st, meta)

    def _apply_step(self) -> None:
        """The optimizer's and the scheduler's step (what :meth:`step` applies itself)."""
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
