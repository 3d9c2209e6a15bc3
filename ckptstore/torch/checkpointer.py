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
numpy aliases are not, and the recorded fingerprints then make replay fail loudly). Under
DistributedDataParallel, :func:`ddp_comm_hook` captures the all-reduced buckets instead.

What to write is the ``policy`` (:mod:`ckptstore.torch.plan` holds the model): "every-iteration"
(a delta every iteration, above), "snapshots" (an asynchronous snapshot every ``snapshot_every``
iterations, nothing in between: any optimizer, no replay) or "auto" (costs measured over the
first steps, then whichever of the two the goodput model prefers for the failure rate, re-planned
when the costs drift, within a disk budget). The default: "auto" (on a multi-rank job store
"every-iteration" for an optimizer replay knows, else "snapshots"); the example above writes a
delta every iteration with ``policy="every-iteration"``.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import (CheckpointPlanError, CkptStoreError, DeltaChainError, NotFoundError,
                      RankFailureError, UnreplayableOptimizerError)
from ..multirank.job_store import JobStore
from ..engine.engine import DEFAULT_CHUNK_SIZE
from ..format.image import BLOCK as IMAGE_BLOCK, ChunkImage
from ..format.manifest import INLINE_MAX
from ..ops.pipeline import ALIGN
from ..ops.retention import KeepLast, Policy
from ..tensors import ImageTensor
from ..replay.gradcodecs import parse_codec
from ..format.delta import OPTIMIZER_NAMES, REPLAY_KEY, REPLAY_VERSION
from ..replay.partition import Partition, split_state
from ..replay.shards import is_dtensor, local, localize
from .dp_restore import can_load_in_parallel, load_in_parallel
from .failure_policy import CheckpointerStats, FailurePolicy
from .auto_policy import PLAN_KEY, AutoPolicy, default_budget, default_policy, job_restarts
from .plan import DELTAS, SNAPSHOTS, CostMeter, Plan
from .plan_agreement import RankAgreement
from .sharded import check_meshes, copy_into_live, load_sharded, replicas_of
from ..replay.replayer import fingerprint, fingerprint_digest


def capture_rng() -> dict:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                           "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def plain_counters(state: Any) -> Any:
    """``state`` (a scheduler's ``state_dict()``) with every ``collections.Counter`` in it (dicts,
    lists, tuples; MultiStepLR's ``milestones``) turned into a plain dict of the same items, in the
    same order: the state encoding holds no Counter (format-spec/deltas.md, "Scheduler state").
    Containers on the way are copied; everything else is shared."""
    t = type(state)
    if t is Counter:
        return dict(state)
    if t is dict:
        return {k: plain_counters(v) for k, v in state.items()}
    if t is list:
        return [plain_counters(v) for v in state]
    if t is tuple:
        return tuple(plain_counters(v) for v in state)
    return state


def counters_like(loaded: Any, live: Any) -> Any:
    """Undo :func:`plain_counters` for a state read back: where the live scheduler's state holds a
    Counter at the same place and ``loaded`` holds a plain dict, make that dict a Counter again
    (missing keys then read as 0, ``elements()`` works), keeping its item order."""
    if type(live) is Counter and type(loaded) is dict:
        return Counter(loaded)
    if type(live) is dict and type(loaded) is dict:
        return {k: counters_like(v, live[k]) if k in live else v for k, v in loaded.items()}
    if type(live) in (list, tuple) and type(loaded) is type(live) and len(loaded) == len(live):
        return type(loaded)(counters_like(a, b) for a, b in zip(loaded, live))
    return loaded


@dataclass
class _Step:
    """One step between :meth:`Checkpointer._begin` and :meth:`Checkpointer._end` (for
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


#: the Checkpointer's policies (what it writes; :mod:`ckptstore.torch.plan`)
POLICIES = ("auto", "every-iteration", "snapshots")
log = logging.getLogger("ckptstore")


def _replayable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether replay knows ``optimizer``'s step: one of torch.optim's, not a subclass."""
    name = type(optimizer).__name__
    return name in OPTIMIZER_NAMES and type(optimizer) is getattr(torch.optim, name, None)


def _check_policy_args(policy: str | None, snapshot_every: int | None, mtbf_s: float | None,
                       disk_budget: int | None, measure_steps: int) -> None:
    """CheckpointPlanError naming the first bad argument (before anything is written)."""
    if policy is not None and policy not in POLICIES:
        raise CheckpointPlanError(f"policy must be one of {', '.join(map(repr, POLICIES))} "
                                  f"(or None: the default), not {policy!r}")
    if mtbf_s is not None and (isinstance(mtbf_s, bool) or not isinstance(mtbf_s, (int, float))
                               or not math.isfinite(mtbf_s) or mtbf_s <= 0):
        raise CheckpointPlanError(f"mtbf_s must be a finite number of seconds > 0 or None, "
                                  f"not {mtbf_s!r}")
    if disk_budget is not None and (type(disk_budget) is not int or disk_budget <= 0):
        raise CheckpointPlanError(f"disk_budget must be a positive int (bytes) or None, "
                                  f"not {disk_budget!r}")
    if snapshot_every is not None and (type(snapshot_every) is not int or snapshot_every < 1):
        raise CheckpointPlanError(f"snapshot_every must be a positive int or None, "
                                  f"not {snapshot_every!r}")
    if snapshot_every is not None and policy == "every-iteration":
        raise CheckpointPlanError('snapshot_every: policy="every-iteration" writes no periodic '
                                  'snapshots (use policy="snapshots" or "auto")')
    if type(measure_steps) is not int or measure_steps < 1:
        raise CheckpointPlanError(f"measure_steps must be a positive int, not {measure_steps!r}")


def _json_defaults(defaults: dict) -> dict:
    return {k: v for k, v in defaults.items()
            if v is None or type(v) in (bool, int, float, str, tuple)}


def _storage_key(v: torch.Tensor) -> tuple | None:
    """What two tied entries share: the (local, for a DTensor) storage address, shape and dtype.
    None for an empty DTensor shard (its address says nothing: ties are then found by identity)."""
    t = local(v)
    if is_dtensor(v) and t.numel() == 0:
        return None
    return (t.data_ptr(), tuple(t.shape), t.dtype, is_dtensor(v))


def _tied_entries(model: torch.nn.Module, param_names: set[str]) -> dict[str, str]:
    """``{state_dict key: parameter name}`` for every model entry that is not one of the
    optimizer's parameters but is one of them under another name (a tied weight: the same object,
    or the same storage, shape and dtype; for a DTensor, of its local shard). The same on every
    rank: ties are structural."""
    by_id: dict[int, str] = {}
    by_key: dict[tuple, str] = {}
    for n, p in model.named_parameters():  # (a tied parameter once, under its first name)
        by_id[id(p)] = n
        key = _storage_key(p)
        if key is not None:
            by_key[key] = n
    out: dict[str, str] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if k in param_names or not isinstance(v, torch.Tensor):
            continue
        key = _storage_key(v)
        tie = by_id.get(id(v)) or (by_key.get(key) if key is not None else None)
        if tie is not None and tie in param_names:
            out[k] = tie
    return out


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
    ``capture``: "hooks" (default: copy gradients during backward, exact codec only) or "step".
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
    after ``measure_steps`` steps measured its costs; until then only the first snapshot), nothing
    in between (a step's ``meta`` is stored only when it snapshots; ``step`` returns None then).
    "auto": ``measure_steps`` delta steps, one snapshot, ``measure_steps`` plain steps, then the
    plan with the better expected goodput (:meth:`plan` says which and why; logged, logger
    "ckptstore", INFO, whenever it changes); costs keep being measured and a drift of more than
    30% re-plans. In the deltas mode of "auto" the base interval is the plan's. Every base carries
    the plan's inputs (format-spec/deltas.md, "Persisted plan"): a Checkpointer that restores
    from such a base plans at once from them, without measuring again. On a multi-rank job
    store every rank plans from the costs of all (the largest of each, the smallest MTBF and
    disk budget, split over the ranks: :mod:`ckptstore.torch.plan_agreement`), so all write the
    same plan; every rank must then step the same iterations and call :meth:`replan` together.
    None (default): "auto", so that a run given nothing is bounded by the default disk budget
    (its first plan is logged, INFO, saying it is the default); on a multi-rank job store
    "every-iteration" when replay knows the optimizer, else "snapshots" (a job's retention is
    its collective gc, which the plan does not drive: pass ``retention``).
    An optimizer replay does not know (Lion, 8-bit Adam, a custom one) is always checkpointed by
    snapshots; ``policy="every-iteration"`` with one raises UnreplayableOptimizerError.
    ``mtbf_s``: the mean time between failures (seconds) the plan assumes; None: learned from a
    job store's restarts (its epochs), or from a single store's restarts its persisted plans
    count, when there are any, else 24 h, and the plan says so.
    ``disk_budget``: bytes the checkpoints may take; None: half the free space of the store's
    filesystem at open (:data:`ckptstore.torch.auto_policy.DEFAULT_DISK_SHARE`). The plan keeps
    each interval within it and says how many checkpoints fit (``plan().retention``); unless
    ``retention`` is given (or the store is a job store), the Checkpointer applies a retention
    that keeps the store within it (the newest quarter of ``plan().retention`` kept by a gc before
    80% of it is written). Policy "every-iteration" makes
    no plan and applies none: pass ``retention`` to bound it.
    ``retention``: a retention policy (:mod:`ckptstore.ops.retention`, e.g.
    ``KeepLast(50) | KeepEvery(500)``) the store applies after every ``retention_every``-th
    base this Checkpointer writes (:meth:`ckptstore.Store.set_retention`; on a job store
    :meth:`ckptstore.JobStore.set_retention`, the job's collective gc), so that a run's disk use
    stays bounded: what it keeps loads bit for bit, delta chains included.
    Bad values raise CheckpointPlanError (a ValueError) naming the argument, before anything is
    written.
    """

    def __init__(self, store, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, *, base_every: int | str | None = 200, codec: str = "exact",
                 apply_decoded: bool = False, group_commit: int = 1, group_seconds: float | None = None,
                 fingerprint_every: int = 10, target_recovery_s: float = 30.0,
                 asynchronous: bool = True, capture: str = "hooks",
                 partition: bool | None = None, on_failure: str = "raise",
                 max_failures: int = 3, max_lag_s: float | None = 3600.0,
                 policy: str | None = None, snapshot_every: int | None = None,
                 mtbf_s: float | None = None, disk_budget: int | None = None,
                 measure_steps: int = 8, retention: Policy | None = None,
                 retention_every: int = 1) -> None:
        _check_policy_args(policy, snapshot_every, mtbf_s, disk_budget, measure_steps)
        if retention is not None:
            # before anything is written; on a job store every rank sets the same (collective)
            store.set_retention(retention, retention_every)
        replayable = _replayable(optimizer)
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
        if base_every == "follower":
            base_every = None  # the same: the follower writes the periodic bases
        if base_every is not None and base_every != "auto" and \
                (type(base_every) is not int or base_every < 1):
            raise ValueError('base_every must be a positive int, "auto", None or "follower"')
        if type(group_commit) is not int or group_commit < 1:
            raise ValueError("group_commit must be a positive int")
        if group_seconds is not None and (isinstance(group_seconds, bool) or
                                          not isinstance(group_seconds, (int, float)) or
                                          not group_seconds >= 0):
            raise ValueError("group_seconds must be a non-negative number or None")
        if capture not in ("hooks", "step"):
            raise ValueError('capture must be "hooks" or "step"')
        self.policy = FailurePolicy(on_failure, max_failures=max_failures, max_lag_s=max_lag_s)
        self.store = store
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.codec = parse_codec(codec)
        self.apply_decoded = bool(apply_decoded)
        self.base_every = base_every
        self.group_commit = group_commit
        self.group_seconds = group_seconds
        self.fingerprint_every = fingerprint_every
        self.target_recovery_s = target_recovery_s
        names = {id(p): n for n, p in model.named_parameters()}
        self._groups: list[list[str]] = []
        self._params: list[torch.nn.Parameter] = []
        for g in optimizer.param_groups:
            gn = []
            for p in g["params"]:
                if id(p) not in names:
                    raise ValueError("the optimizer holds a parameter that is not in the model")
                gn.append(names[id(p)])
                self._params.append(p)
            self._groups.append(gn)
        self._param_names = {n for gn in self._groups for n in gn}
        #: data parallelism on a multi-rank store: the parameters this rank writes (replay/partition.py)
        self._partition: Partition | None = None
        self._rank = 0
        self._world = store.world_size if job and store.world_size else 1
        #: the next step writes a base (a job store's new epoch starts its own chain)
        self._force_base = False
        ordered = [n for gn in self._groups for n in gn]
        #: FSDP2 / DTensor parameters: every rank writes its local shards (replay/shards.py)
        self._sharded = any(is_dtensor(p) for p in self._params)
        if self._sharded:
            if partition:
                raise ValueError("partition=True: sharded (DTensor) parameters are written as "
                                 "each rank's local shards, not partitioned")
            dts: list[Any] = [p for p in self._params if is_dtensor(p)]
            meshes = [p.device_mesh for p in dts]
            if not job and any(m.size() > 1 for m in meshes):
                raise ValueError("sharded (DTensor) parameters over several ranks need a multi-rank "
                                 "job store (ckptstore.open(path, process_group=...)) on every rank")
            if job:
                assert store.rank is not None
                self._rank = store.rank
                check_meshes(store, [n for n, p in zip(ordered, self._params) if is_dtensor(p)],
                             dts)
        elif job and store.world_size > 1 and partition is not False:
            assert store.rank is not None and store.world_size is not None
            self._rank = store.rank
            self._partition = Partition.balanced(
                [(n, p.numel() * p.element_size()) for n, p in zip(ordered, self._params)],
                store.world_size)
        #: tied entries: {state_dict key: the parameter it is} (plain tensors and DTensors)
        self._aliases = _tied_entries(model, self._param_names)
        #: sharded parameters whose box other ranks hold too: {name: the rank that writes it}
        self._replicas: dict[str, int] = {}
        if self._sharded and job and self._world > 1 and partition is not False:
            self._replicas = replicas_of(store, ordered, self._params, self._rank, self._world)
        self._owned = [(self._partition is None or self._partition.owner[n] == self._rank)
                       and self._replicas.get(n, self._rank) == self._rank for n in ordered]
        dev = {p.device.type for p in self._params}
        self._device = dev.pop() if len(dev) == 1 else "mixed"
        self._last: int | None = None
        self._base: int | None = None
        # cost model for base_every="auto" (exponential moving averages, seconds)
        self._base_cost: float | None = None
        self._delta_cost: float | None = None
        self.last_stats = None
        # ---- asynchronous path -------------------------------------------------------------
        self.asynchronous = bool(asynchronous)
        self._resync = False  # a background failure lost records: restart the chain at next step
        self._group_n = 0
        self._group_t0 = 0.0
        self._lock = threading.Lock()
        self._peer_error: CkptStoreError | None = None  # (peer_failure: counted once)
        self._arena = None  # host arena of this iteration's gradient slots (pipeline pool)
        self._captured: list[Any] = [None] * len(self._params)
        self._layout_slots(getattr(store, "chunk_size", None) or DEFAULT_CHUNK_SIZE)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._ddp = False
        #: gradients captured during backward ("hook"), from DDP buckets ("ddp"), at step ("step")
        self.capture_counts = {"hook": 0, "ddp": 0, "step": 0}
        self.capture_wait_s = 0.0  # backpressure met while capturing gradients
        self._hooks: list[Any] = []
        #: a step begun with before_step() and not yet ended with after_step()
        self._open: _Step | None = None
        # ---- the checkpoint policy (ckptstore/torch/auto_policy.py, plan.py) --------------------
        self.checkpoint_policy = policy
        self.replayable = replayable
        self.snapshot_every = snapshot_every
        self.measure_steps = measure_steps
        budget_source = "given"
        if disk_budget is None:
            disk_budget, budget_source = default_budget(str(store.path))
        #: the retention this Checkpointer derives from the plan (None: the user's, or none yet)
        self._own_retention = retention is None and not job
        self._retention_applied: tuple[int, int] | None = None
        self._auto = AutoPolicy(policy, replayable, snapshot_every, mtbf_s, disk_budget,
                                measure_steps, group_commit, budget_source=budget_source,
                                job_history=(lambda: job_restarts(store.view)) if job else None,
                                switch=self._switch, snapshot_now=self._snapshot_now,
                                planned=self._planned, where=str(store.path),
                                defaulted=defaulted,
                                agreement=RankAgreement(store) if self._world > 1 else None)
        self._wrote = "plain"
        self._capture_grads = self.asynchronous and not self.codec.lossy and policy != "snapshots"
        if self._capture_grads:
            self.store.pipeline  # noqa: B018 - start it now: hooks need its pool
            if capture == "hooks":
                for i, p in enumerate(self._params):
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i)))
        if group_seconds is not None:
            # the time bound holds between steps too (the store's timer stays set after close)
            self.store.set_group_seconds(group_seconds)

    # ---- state ----------------------------------------------------------------------------
    def _replay_info(self) -> dict:
        return {"v": REPLAY_VERSION, "optimizer": type(self.optimizer).__name__,
                "defaults": _json_defaults(self.optimizer.defaults), "groups": self._groups,
                "aliases": self._aliases, "codec": self.codec.name, "device": self._device,
                "torch": str(torch.__version__), "scheduler": self.scheduler is not None}

    def state(self, iteration: int) -> dict:
        st: dict[str, Any] = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scheduler is not None:
            st["scheduler"] = plain_counters(self.scheduler.state_dict())
        st["rng"] = capture_rng()
        st["iteration"] = iteration
        st[REPLAY_KEY] = self._replay_info()
        persisted = self._auto.persisted()
        if persisted is not None:
            st[PLAN_KEY] = persisted  # (several ranks: the same on each, plan_agreement.py)
        if self._partition is not None:
            return split_state(st, self._partition, self._rank)
        if self._sharded:
            return localize(st, self._rank, self._world, self._replicas)
        return st

    def save_base(self, iteration: int, meta: dict | None = None):
        """Write a base snapshot of the live state as ``iteration`` (flushes pending deltas).
        Asynchronous: returns the future of :meth:`ckptstore.Store.save_async`."""
        t0 = time.perf_counter()
        state = self.state(iteration)
        self.policy.check_space(self.store.path, _tensor_bytes(state), iteration)
        if self.asynchronous:
            fut = self.store.save_async(iteration, state, meta=meta)
            fut.add_done_callback(self._cost_callback("_base_cost", 0.0))
            fut.add_done_callback(self._durable_callback)
            fut.add_done_callback(self._auto.observe_snapshot)
            self._wrote = "base"
            self._last = self._base = iteration
            self._group_n = 0  # the base commits every pending delta
            self._force_base = False
            return fut
        stats = self.store.save(iteration, state, meta=meta)
        self._ema("_base_cost", time.perf_counter() - t0)
        self._wrote = "base"
        self._auto.observe_sync_snapshot(time.perf_counter() - t0, stats)
        self._last = self._base = iteration
        self._force_base = False
        self.policy.succeeded()
        return stats

    def health(self):
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
            self.policy.count(kept, self._last + 1 if self._last is not None else 0)
        if isinstance(store, JobStore):
            store.mark_broken(kept)
        return kept

    def _durable_callback(self, fut) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.policy.succeeded()

    def _cost_callback(self, attr: str, foreground: float):
        def done(fut) -> None:
            if not fut.cancelled() and fut.exception() is None:
                st = fut.result()
                self._ema(attr, foreground + st.stall_s + st.write_s)
        return done

    # ---- gradient capture (asynchronous path) -----------------------------------------------
    def _ensure_arena(self):
        with self._lock:
            if self._arena is None:
                # the running pipeline (started in __init__), not the property, which would
                # raise a background failure inside backward (the next step raises it instead)
                pipe = self.store.running_pipeline
                assert pipe is not None
                self._arena, waited = pipe.pool.acquire(self._slot_bytes)
                self.capture_wait_s += waited
            return self._arena

    def _layout_slots(self, chunk_size: int) -> None:
        """Where each parameter's captured gradient lies in an arena. Large CPU gradients get a
        chunk image each (ckptstore/format/image.py: the store writes their records straight
        from the arena, no staging copy), laid end to end from the arena's first page boundary;
        the rest get plain ALIGN-aligned slots after them. ``_slots[i]``: (offset from that
        boundary, bytes, whether it is an image)."""
        self._stride = ChunkImage.stride_for(chunk_size)
        self._slots: list[tuple[int, int, bool]] = [(0, 0, False)] * len(self._params)
        off = 0
        rest = []
        for i, (p, owned) in enumerate(zip(self._params, self._owned)):
            p = local(p)  # a DTensor's gradient is captured as its local shard
            n = p.numel() * p.element_size() if owned else 0  # (others' gradients: never captured)
            if n > INLINE_MAX and p.device.type == "cpu" and ImageTensor.fits(p.dtype, n, self._stride):
                self._slots[i] = (off, n, True)
                off += ChunkImage(n, self._stride).size
            else:
                rest.append((i, n))
        for i, n in rest:
            self._slots[i] = (off, n, False)
            off += (n + ALIGN - 1) // ALIGN * ALIGN
        self._slot_bytes = off + IMAGE_BLOCK  # + room to start at a page boundary in any arena
        self._slot_views: dict[int, tuple[Any, list[Any]]] = {}

    def _slot(self, i: int, arena) -> Any:
        """Parameter ``i``'s gradient slot in ``arena``: a tensor view, or an ImageTensor."""
        cached = self._slot_views.get(id(arena))
        if cached is None or cached[0] is not arena:
            if len(self._slot_views) >= 8:
                self._slot_views.clear()
            shift = -arena.buf.data_ptr() % IMAGE_BLOCK
            views: list[Any] = []
            for p, (off, n, image) in zip(self._params, self._slots):
                p = local(p)
                if n == 0 and p.numel() > 0:
                    views.append(None)  # another rank's gradient: never captured here
                elif image:
                    views.append(ImageTensor(arena.buf, shift + off, p.dtype, tuple(p.shape),
                                             self._stride))
                else:
                    views.append(arena.slice(shift + off, n).view(p.dtype).view(p.shape))
            cached = self._slot_views[id(arena)] = (arena, views)
        return cached[1][i]

    def _capturable(self, i: int, g: torch.Tensor | None) -> bool:
        p = local(self._params[i])
        return g is not None and g.layout == torch.strided and g.device.type == "cpu" and \
            g.dtype == p.dtype and g.shape == p.shape

    def _hook(self, i: int):
        def on_grad(p: torch.Tensor) -> None:
            g = local(p.grad)
            if self._ddp or g is None or not self._owned[i] or self._auto.mode != DELTAS or \
                    not self._capturable(i, g):
                return
            self._slot(i, self._ensure_arena()).copy_(g)
            self._captured[i] = (weakref.ref(g), g._version)
            self.capture_counts["hook"] += 1
        return on_grad

    def capture_bucket(self, params: list[torch.Tensor], flat: torch.Tensor) -> None:
        """Copy an all-reduced DDP bucket (``flat``: the bucket's gradients of ``params``, in
        order) into the gradient slots (called by :func:`ddp_comm_hook`)."""
        self._ddp = True
        if not self._capture_grads or self._auto.mode != DELTAS:
            return
        if sum(p.numel() for p in params) != flat.numel() or flat.device.type != "cpu":
            return  # an unexpected layout: the step copies p.grad instead
        arena = self._ensure_arena()
        off = 0
        for p in params:
            n = p.numel()
            i = self._index.get(id(p))
            if i is not None and self._owned[i] and flat.dtype == p.dtype:
                self._slot(i, arena).copy_(flat[off:off + n].view(p.shape))
                self._captured[i] = "ddp"
                with self._lock:
                    self.capture_counts["ddp"] += 1
            off += n

    def _check_follows(self, iteration: int, top: int | None) -> None:
        """Refuse ``iteration`` unless it follows the last logged iteration and the store holds
        nothing at or after it (``top``: its newest committed or pending iteration). Checked
        before ``optimizer.step()``, so a refused step leaves the live objects untouched."""
        assert self._last is not None  # both callers resynchronise (setting it) before this check
        if iteration != self._last + 1:
            raise DeltaChainError(f"Checkpointer.step({iteration}): the last logged iteration is "
                                  f"{self._last}; iterations must follow each other")
        if top is not None and top >= iteration:
            raise DeltaChainError(f"Checkpointer.step({iteration}): {self.store.path} already holds "
                                  f"iteration {top} (restored {self._last}); iterations must increase")

    def _encode_grads(self) -> tuple[list[Any], dict[str, Any]]:
        """Every parameter's gradient through the codec (None where a parameter has none), and
        the encoding error the record states for a lossy codec. With ``apply_decoded`` the
        decoded gradient replaces ``p.grad``, so training applies exactly what is logged."""
        grads: list[Any] = []
        max_err: list[float] = []
        err_l2 = g_l2 = 0.0
        todo = [g if g is not None and (owned or self.apply_decoded and self.codec.lossy) else None
                for g, owned in ((local(p.grad), owned) for p, owned in zip(self._params, self._owned))]
        for grad, encoded in zip(todo, self.codec.encode_many(todo, self.apply_decoded)):
            if grad is None or encoded is None:
                grads.append(None)  # (not owned: dropped from the record below)
                max_err.append(0.0)
                continue
            payload, dec, st = encoded
            grads.append(payload)
            if st is not None:
                max_err.append(st.max_abs_error)
                err_l2 += st.l2_error ** 2
                g_l2 += st.l2_grad ** 2
                if self.apply_decoded:
                    assert dec is not None  # a lossy codec asked for its decode returns it
                    grad.copy_(dec)
            else:
                max_err.append(0.0)
        return grads, {"max_abs": max_err, "l2": err_l2 ** 0.5, "grad_l2": g_l2 ** 0.5}

    def _delta_record(self, iteration: int, grads: list[Any], hyper: list[dict], rng: Any,
                      err: dict[str, Any]) -> dict[str, Any]:
        """The delta record of ``iteration`` (format-spec/deltas.md), built after
        ``optimizer.step()`` and ``scheduler.step()``: ``hyper`` and ``rng`` were taken before."""
        if not all(self._owned):  # a partition, or replicated shards other ranks write
            grads = [g for g, owned in zip(grads, self._owned) if owned]
            if self.codec.lossy:
                err = dict(err, max_abs=[e for e, owned in zip(err["max_abs"], self._owned) if owned])
        record: dict[str, Any] = {
            "v": REPLAY_VERSION, "codec": self.codec.name, "lossy": self.codec.lossy,
            "applied": self.apply_decoded and self.codec.lossy, "grads": grads, "hyper": hyper,
            "groups": [{k: v for k, v in g.items() if k != "params"}
                       for g in self.optimizer.param_groups],
            "rng": rng,
            "buffers": {k: local(v) for k, v in self.model.state_dict().items()
                        if k not in self._param_names and k not in self._aliases},
        }
        if self.scheduler is not None:
            record["scheduler"] = plain_counters(self.scheduler.state_dict())
        if self.codec.lossy:
            record["err"] = err
        if self.fingerprint_every and iteration % self.fingerprint_every == 0:
            # the norm serves only replays that cannot compare bits (deltas.md, "fp")
            params = [local(p) for p, owned in zip(self._params, self._owned) if owned]
            if self.codec.lossy or self._device != "cpu":
                digest, norm = fingerprint(params)
                record["fp"] = {"xxh3": digest, "norm": norm}
            else:
                record["fp"] = {"xxh3": fingerprint_digest(params)}
        return record

    def _apply_step(self) -> None:
        """The optimizer's and the scheduler's step (what :meth:`step` applies itself)."""
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def base_due(self, iteration: int) -> bool:
        """Whether the record of ``iteration``, the next step, will be a base snapshot rather
        than a delta (the base interval, or a chain that must restart with a base). A step whose
        chain is restarted after a failure first writes a base of ``iteration - 1``; this says
        nothing about that one."""
        interval = self.interval()
        return self._force_base or (interval is not None and
                                    iteration - (self._base if self._base is not None else 0) >= interval)

    def _take_grads(self, own: bool = False) -> tuple[list[Any], Any]:
        """Gradient payloads for the delta record, in slots of a host arena (ownership passes to
        the caller, who hands it to the pipeline). ``own``: copy the gradients that cannot go to
        a slot too (else the payload is the live gradient, copied when the record is submitted)."""
        grads: list[Any] = []
        arena = None
        for i, p in enumerate(self._params):
            g = local(p.grad)
            if g is None or not self._owned[i]:  # (not owned: dropped from the record)
                grads.append(None)
                continue
            if not self._capturable(i, g):
                grads.append({"g": g.detach().clone() if own else g.detach()})  # (else copied
                continue                                 # by the pipeline's snapshot)
            arena = arena or self._ensure_arena()
            slot = self._slot(i, arena)
            c = self._captured[i]
            if c == "ddp":
                ok = _same_bits(slot, g) if g.is_contiguous() else False
            else:
                ok = c is not None and c[0]() is g and c[1] == g._version
            if not ok:
                slot.copy_(g)
                self.capture_counts["step"] += 1
            grads.append({"g": slot})
        with self._lock:
            if arena is not None:
                self._arena = None
            self._captured = [None] * len(self._params)
        return grads, arena

    def close(self) -> None:
        """Remove the gradient hooks and give the capture buffer back (the store stays open)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._drop_open_step()
        self._auto.close()
        with self._lock:
            pipe = self.store.running_pipeline
            if self._arena is not None and pipe is not None:
                pipe.pool.release(self._arena)
            self._arena = None

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
        self.store.flush() if self.store.pending() or self.store.running_pipeline is not None else None
        self._captured = [None] * len(self._params)
        self._resync = False
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
        if (state is not None or self._sharded) and target not in its:
            raise NotFoundError(f"iteration {target} is not in {self.store.path}")
        if self._sharded:
            # each rank its own part (replayed) at the saved world size, else the whole state
            if state is None:
                state = load_sharded(self.store, target, self._rank, self._world)
            copy_into_live(state, self.model, self.optimizer, self._params,
                           [n for gn in self._groups for n in gn], self._world)
        elif state is not None:
            pass
        elif can_load_in_parallel(self.store, target):
            state = load_in_parallel(self.store, target)  # each rank replays its own part
        elif self._partition is None:
            # straight into the live parameters and optimizer state: no allocation, and
            # load_state_dict below then copies nothing (optimizer) or onto itself (model)
            live = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            state = self.store.load(target, into=live)
        else:
            state = self.store.load(target)
        if not self._sharded:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(counters_like(state["scheduler"],
                                                         self.scheduler.state_dict()))
        restore_rng(state["rng"])
        self._continue_chain(target)
        self._auto.resume(lambda: self.store.load_record(self.store.base_of(target),
                                                         keys=[PLAN_KEY])[PLAN_KEY], target)
        return target

    # ---- training ---------------------------------------------------------------------------
    def interval(self) -> int | None:
        """The current base interval (fixed, or chosen from measured costs for "auto"); None with
        ``base_every=None`` (no periodic bases: a follower writes them)."""
        planned = self._auto.base_every()
        if planned is not None:
            return planned  # (the deltas mode of policy="auto")
        if self.base_every is None:
            return None
        if self.base_every != "auto":
            assert isinstance(self.base_every, int)  # __init__ admits a positive int or "auto"
            return self.base_every
        if self._base_cost is None or not self._delta_cost:
            return 50
        # worst-case recovery ~ base load (~ base write) + interval * per-delta replay
        n = int((self.target_recovery_s - self._base_cost) / self._delta_cost)
        return max(1, min(n, 100_000))

    def _ema(self, attr: str, v: float) -> None:
        old = getattr(self, attr)
        setattr(self, attr, v if old is None else 0.8 * old + 0.2 * v)

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
            return self._failed(st, e)
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
        what the record holds from before the step: the gradients (copied, so the caller may
        zero or free them before ``after_step``), the hyperparameters in effect and the RNG
        states. ``after_step`` takes the rest from after it (parameter groups, scheduler state,
        buffers, fingerprint) and writes the record with the same failure handling as
        :meth:`step` (an error there means the step was applied but its record is lost: continue
        with ``it + 1``, whose record starts a new chain with a base).

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

    # ---- the checkpoint policy (ckptstore/torch/auto_policy.py) ------------------------------
    def plan(self) -> Plan | None:
        """The current checkpoint plan (:class:`ckptstore.torch.plan.Plan`: the mode, its interval,
        the expected goodput of each mode compared, bytes per hour, retention, the costs and the
        failure rate it assumed; ``str()`` explains it), or None: policy "every-iteration" (no
        planner), or the costs are still being measured (the first ``2 * measure_steps`` steps
        of a store without a persisted plan)."""
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
        _check_policy_args(self.checkpoint_policy, self.snapshot_every, mtbf_s, self.disk_budget,
                           self.measure_steps)
        self._auto.replan_soon(mtbf_s)

    def _tick(self, iteration: int) -> None:
        """A step's start: the policy samples the previous step and moves on, which may switch
        the mode before this step."""
        self._wrote = "plain"
        self._auto.tick(iteration)

    def _tock(self, st: _Step, out: Any) -> Any:
        """A step that ended (it may have written nothing): remembered for the next sample."""
        self._auto.tock(st.iteration, self._wrote if st.recorded else "base")
        return out

    def _snapshot_now(self) -> None:
        self._force_base = True

    def _planned(self, plan: Plan) -> None:
        """A plan is in force: unless the user set a retention (or the store is a job's, whose
        retention is collective), keep the store within the disk budget by the plan's retention
        ``R`` (checkpoints that fit with room for the next): ``KeepLast`` of the newest
        ``K = max(1, R // 4)`` snapshots (chains: ``(K - 1) * interval + 1`` iterations, their
        bases closed over) after every ``E = max(1, floor(0.8 * R) - K)``-th base. The store then
        holds at most ``K + E`` of them (``<= 0.8 * R`` from ``R = 3`` on) plus the one being
        written (the 20% margin
        covers record framing, manifests and the index, which the measured sizes leave out),
        and each gc, which copies what it keeps, copies ``K`` per ``E`` written (about 0.45x)."""
        r = plan.retention
        if not self._own_retention or r is None or r < 1:
            return
        k = max(1, r // 4)
        keep = k if plan.mode == SNAPSHOTS else (k - 1) * plan.chosen.interval + 1
        every = max(1, math.floor(0.8 * r) - k)
        applied = self._retention_applied
        # (set_retention restarts its count of bases: a plan whose sizes jitter must not keep
        # postponing the gc, so a change of less than 10% keeps the retention in force)
        if applied is None or abs(keep - applied[0]) > 0.1 * applied[0] or \
                (applied[0] != keep and r < 10):
            try:
                self.store.set_retention(KeepLast(keep), every)
            except CkptStoreError as e:  # (a store that refuses retention: the plan still holds)
                log.warning("Checkpointer %s: the disk budget's retention cannot be set (%s); "
                            "the store is not bounded", self.store.path, e)
                self._own_retention = False
                return
            self._retention_applied = (keep, every)

    def _switch(self, mode: str, iteration: int) -> None:
        """Write ``mode`` from step ``iteration`` on. To snapshots: this step snapshots (which
        commits the pending deltas). To deltas: every save in flight is made durable first,
        then the delta path restarts its chain at the live state (a base of ``iteration - 1``
        unless the store's newest iteration is that). Nothing committed is lost either way."""
        if mode == SNAPSHOTS:
            pipe = self.store.running_pipeline
            if pipe is not None:
                self._release_captures(pipe)  # captured for a delta this step will not write
            self._captured = [None] * len(self._params)
            self._force_base = True
        else:
            try:
                self.store.flush()
            except BaseException as e:
                self._policy_failed(e, iteration)  # raises unless the policy keeps training
            self._resync = True

    def _snap_begin(self, iteration: int) -> _Step:
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
            self._force_base = True
            self._policy_failed(e, iteration)  # raises unless the policy keeps training
            pipe = self.store.running_pipeline if self.asynchronous else None
        if self._last is None:
            try:
                latest = self.store.latest()
                if latest is None:
                    self.save_base(iteration - 1)  # an empty store: the live state first
                else:
                    self._continue_chain(latest)
            except BaseException as e:
                self._policy_failed(e, iteration)
                return _Step(iteration, recorded=False, snap=True)
        self._check_follows(iteration, pipe.tail() if pipe is not None else self.store.tail())
        return _Step(iteration, True, snap=True)

    def _snap_end(self, st: _Step, meta: dict | None):
        """A step of the snapshots mode, after ``optimizer.step()``: a snapshot of the live
        state when due (the interval, or one forced), else nothing (returns None)."""
        iteration = st.iteration
        self._last = iteration
        if not st.recorded:
            self._force_base = True
            return None
        every = self._auto.snapshot_every()
        since = iteration - (self._base if self._base is not None else iteration)
        if not (self._force_base or (every is not None and since >= every)):
            return None
        try:
            out = self.save_base(iteration, meta)
        except BaseException as e:
            self._force_base = True
            self._policy_failed(e, iteration)  # raises unless the policy keeps training
            return None
        self.last_stats = out
        return out

    def _refuse_open_step(self, what: str) -> None:
        if self._open is not None:
            raise DeltaChainError(f"Checkpointer.{what}: step {self._open.iteration} was begun with "
                                  "before_step() and not ended with after_step()")

    def _drop_open_step(self) -> None:
        st, self._open = self._open, None
        if st is not None and st.arena is not None and st.pipe is not None:
            st.pipe.pool.release(st.arena)

    def _begin(self, iteration: int, own_grads: bool) -> _Step:
        """What a step does before ``optimizer.step()``: resynchronise with the store after a
        failure, check ``iteration``, take RNG states, hyperparameters and gradients.
        ``own_grads``: the gradient payloads must not alias the live gradients."""
        if self._auto.mode == SNAPSHOTS:
            return self._snap_begin(iteration)
        if self.asynchronous:
            return self._begin_async(iteration, own_grads)
        try:
            if self._resync or self._last is None:
                self._restart_sync(iteration)
            else:
                try:
                    self.store.check()  # a failed group-timer commit, before optimizer.step
                except BaseException:
                    self._resync = True
                    raise
        except BaseException as e:
            self._policy_failed(e, iteration)  # raises unless the policy keeps training
            return _Step(iteration, recorded=False)
        self._check_follows(iteration, self.store.tail())
        t0 = time.perf_counter()
        rng = capture_rng()
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        grads, err = self._encode_grads()
        if own_grads:
            grads = self._own_payloads(grads)
        return _Step(iteration, True, t0, rng, hyper, grads, err)

    def _own_payloads(self, grads: list[Any]) -> list[Any]:
        """``grads`` (payloads from :meth:`_encode_grads`) with every tensor that shares memory
        with its parameter's live gradient copied (the exact codec's payload is the gradient)."""
        out: list[Any] = []
        for p, payload in zip(self._params, grads):
            g = local(p.grad)
            if payload is not None and g is not None:
                ptr = g.untyped_storage().data_ptr()
                payload = {k: v.clone() if isinstance(v, torch.Tensor) and
                           v.untyped_storage().data_ptr() == ptr else v for k, v in payload.items()}
            out.append(payload)
        return out

    def _end(self, st: _Step, meta: dict | None):
        """What a step does after ``optimizer.step()`` and ``scheduler.step()``: write the record
        of ``st.iteration`` (a base when due, else a delta)."""
        if st.snap:
            return self._snap_end(st, meta)
        iteration = st.iteration
        if not st.recorded:
            # the "retry" policy's step when the store could not take a record: training went
            # on; the next step restarts the chain with a base
            self._last = iteration
            self._resync = True
            self._captured = [None] * len(self._params)
            return None
        if self.asynchronous:
            return self._end_async(st, meta)
        try:
            if self.base_due(iteration):
                stats = self.save_base(iteration, meta)
            else:
                record = self._delta_record(iteration, st.grads, st.hyper, st.rng, st.err)
                stats = self.store.save_delta(iteration, record, meta, durable=False)
                self._last = iteration
                self._wrote = "delta"
                self._auto.observe_sync_delta(stats)
                if len(self.store.pending()) >= self.group_commit or (
                        self.group_seconds is not None and
                        self.store.pending_age() >= self.group_seconds):
                    self.store.flush()
                    self.policy.succeeded()
                # replaying a delta costs about its read (~ its write) plus the optimizer step
                self._ema("_delta_cost", time.perf_counter() - st.t0)
        except BaseException as e:
            return self._failed(st, e)
        self.last_stats = stats
        return stats

    def _failed(self, st: _Step, e: BaseException) -> None:
        """The step of ``st`` failed after ``optimizer.step()`` began: the store rolled the failed
        record (or group) back, the live objects may hold the state of ``st.iteration``: the next
        step re-reads the store and restarts the chain with a base when records were lost."""
        if st.arena is not None and st.pipe is not None:
            st.pipe.pool.release(st.arena)
            st.arena = None
        self._last = st.iteration
        self._resync = True
        self._policy_failed(e, st.iteration)  # raises unless the policy keeps training
        return None

    def _policy_failed(self, error: BaseException, iteration: int) -> None:
        """The failure policy's verdict on ``error`` (returns to keep training). When it raises,
        this rank stops: a job store is marked broken first, so close() runs no commit round
        that the other ranks, blocked in the training job's own collectives while they wait
        for this rank, would never join (each waited ``commit_timeout`` before); they learn of
        the failure from their own round's outcome or when this rank's process ends."""
        try:
            self.policy.failed(error, iteration)
        except BaseException as raised:
            if isinstance(self.store, JobStore) and isinstance(raised, CkptStoreError):
                self.store.mark_broken(raised)
            raise

    def _check_resumes(self, iteration: int) -> None:
        """Before a chain restart: ``iteration`` must follow the live objects' iteration, or the
        base written for ``iteration - 1`` would be labelled with the wrong iteration."""
        if self._last is not None and iteration != self._last + 1:
            raise DeltaChainError(f"Checkpointer.step({iteration}): the live state is that of "
                                  f"iteration {self._last}; iterations must follow each other")

    def _restart_sync(self, iteration: int) -> None:
        """Synchronous path, before the first step or after a failure (``_resync``): find where
        the store's chain ends. Unless it ends at ``iteration - 1`` (a first step resumes from
        the latest iteration instead), the live state, that of ``iteration - 1``, starts a new
        chain as a base snapshot. Raises before ``optimizer.step()``; ``_resync`` stays set."""
        self._check_resumes(iteration)
        latest = self.store.latest()  # after a failed rollback this recovers (cuts pending deltas)
        if self._resync and self.store.pending():
            # deltas appended before the failed one are intact: commit them (chain continuity)
            self.store.flush()
            latest = self.store.latest()
        if latest is None or (self._resync and latest != iteration - 1):
            self.save_base(iteration - 1)
        else:
            self._continue_chain(latest)
        self._resync = False

    def _continue_chain(self, latest: int) -> None:
        """The live state is that of ``latest``, the store's newest iteration: the next step
        extends its chain, or, on a job store reopened by a new job (whose streams hold no chain
        yet), starts one with a base (format-spec/format.md §22.4)."""
        if isinstance(self.store, JobStore) and \
                self.store.global_commit(latest).epoch != self.store.epoch:
            self._last, self._base, self._force_base = latest, latest, True
        else:
            self._last, self._base = latest, self.store.base_of(latest)

    def flush(self) -> int | None:
        """Commit pending deltas now; returns store.durable_iteration()."""
        return self.store.flush()

    def _begin_async(self, iteration: int, own_grads: bool) -> _Step:
        try:
            pipe = self.store.pipeline  # raises an earlier background failure before any change
            pipe.check()
        except BaseException as e:
            self._resync = True
            self._policy_failed(e, iteration)  # raises unless the policy keeps training
            pipe = self.store.running_pipeline  # reported: the store takes records again
        tail = pipe.tail()
        if self._resync or self._last is None or tail is None or tail < self._last:
            # (a tail behind the last step: a failure reported through another call lost records)
            self._check_resumes(iteration)
            try:
                latest = self.store.latest()
                if latest is None or latest != iteration - 1:
                    # empty store, or records lost to a background failure: the live state (that
                    # of iteration - 1) starts a new chain
                    self.save_base(iteration - 1)
                else:
                    self._continue_chain(latest)
            except BaseException as e:
                self._policy_failed(e, iteration)
                self._release_captures(pipe)
                return _Step(iteration, recorded=False)
            self._resync = False
        self._check_follows(iteration, pipe.tail())
        t0 = time.perf_counter()
        rng = capture_rng()
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        arena = None
        if self._capture_grads:
            grads, arena = self._take_grads(own_grads)
            err = {"max_abs": [], "l2": 0.0, "grad_l2": 0.0}
        else:
            grads, err = self._encode_grads()
            if own_grads:
                grads = self._own_payloads(grads)
        return _Step(iteration, True, t0, rng, hyper, grads, err, arena, pipe)

    def _end_async(self, st: _Step, meta: dict | None):
        iteration, pipe = st.iteration, st.pipe
        try:
            if self.base_due(iteration):
                owned, st.arena = st.arena, None
                if owned is not None:
                    pipe.pool.release(owned)
                self._last = iteration
                fut = self.save_base(iteration, meta)
            else:
                record = self._delta_record(iteration, st.grads, st.hyper, st.rng, st.err)
                now = time.monotonic()
                if self._group_n and not pipe.pending_deltas():
                    self._group_n = 0  # the group timer (or a flush) committed the group
                if self._group_n == 0:
                    self._group_t0 = now
                self._group_n += 1
                commit = self._group_n >= self.group_commit or (
                    self.group_seconds is not None and now - self._group_t0 >= self.group_seconds)
                if commit:
                    self._group_n = 0
                owned, st.arena = st.arena, None
                self._last = iteration
                fut = pipe.submit("delta", iteration, record, meta, commit=commit,
                                  owned=[owned] if owned is not None else None)
                fut.add_done_callback(self._cost_callback("_delta_cost", time.perf_counter() - st.t0))
                fut.add_done_callback(self._durable_callback)
                fut.add_done_callback(self._auto.observe_delta)
                self._wrote = "delta"
        except BaseException as e:
            return self._failed(st, e)
        self.last_stats = fut
        return fut

    def _release_captures(self, pipe) -> None:
        """Give back the gradients captured for a step that records nothing."""
        with self._lock:
            arena, self._arena = self._arena, None
        if arena is not None:
            pipe.pool.release(arena)


def _same_bits(slot: Any, g: torch.Tensor) -> bool:
    """Whether a gradient slot (tensor or ImageTensor) holds exactly ``g``'s bits."""
    if isinstance(slot, ImageTensor):
        return slot.same_bits(g)
    return torch.equal(slot.reshape(-1).view(torch.uint8), g.detach().reshape(-1).view(torch.uint8))


def ddp_comm_hook(checkpointer: Checkpointer | None = None):
    """A DistributedDataParallel communication hook: all-reduce (average) each gradient bucket,
    like DDP's default hook, and hand the reduced bucket to ``checkpointer`` as it completes, so
    the gradient the job exchanges anyway becomes the checkpoint's delta (no second pass over the
    parameters). Ranks without a Checkpointer pass None (a single-writer store written by rank
    0); on a multi-rank store every rank passes its own and captures only the parameters it
    owns. The hook's state is the process group (None: the default group)::

        ddp.register_comm_hook(None, ddp_comm_hook(ckpt if rank == 0 else None))

    At ``ckpt.step`` each captured slot is compared bit for bit with ``p.grad`` (a read; a copy is
    made only if the gradient was changed after the all-reduce, e.g. by clipping)."""
    import torch.distributed as dist

    def hook(state, bucket):  # unannotated: DDP checks annotations against dist.GradBucket
        group = state if state is not None else dist.group.WORLD
        buf = bucket.buffer()
        buf.div_(dist.get_world_size(group))
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        if checkpointer is None:
            return fut.then(lambda f: f.value()[0])
        params = list(bucket.parameters())

        def done(f):
            try:
                out = f.value()[0]
            except Exception as e:  # noqa: BLE001 - re-raised as ckptstore's typed error
                raise checkpointer.peer_failure(e)  # (its __cause__ is the root cause)
            checkpointer.capture_bucket(params, out)
            return out
        return fut.then(done)
    return hook


def _tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state: the size of a base snapshot, about."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0
