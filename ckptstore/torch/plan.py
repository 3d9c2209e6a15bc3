"""Which checkpoints to write, chosen from measured costs and the failure rate (issue 30).

Two ways to checkpoint a training job, one failure model:

* **snapshots**: an asynchronous snapshot (``store.save_async``) every ``N`` iterations. Each one
  stalls training ``stall_s`` (the copy into host buffers), slows the steps its background work
  overlaps by ``slowdown_s`` in all (the persister's CPU and memory traffic, taken from the same
  cores as training) and becomes durable ``persist_s`` later; nothing is written in between.
  ``C = stall_s + slowdown_s`` is what one snapshot costs training.
* **deltas**: a gradient delta every iteration (``Checkpointer`` with ``policy="every-iteration"``)
  and a base snapshot every ``B`` iterations. Every step costs ``delta_overhead_s`` more; a
  failure loses at most the uncommitted part of a delta group, but a restore replays the deltas
  since the newest base.

The model (first order, in the manner of Young and Daly; every time is wall-clock seconds):
failures arrive at rate ``1 / mtbf_s``; each one costs the work done since the last durable
checkpoint (``lost_s``) plus the time to resume (``resume_s``). Goodput, useful training time over
wall time, is then::

    goodput = useful / (useful + checkpoint overhead)  x  max(0, 1 - (lost_s + resume_s) / mtbf_s)

snapshots, N:  an interval takes W = N*step + C; useful N*step; lost W/2 + persist (the last
               durable snapshot is on average half an interval and one persist old); resume
               restart + load.
deltas, B:     an interval takes W = B*(step + delta_overhead) + C (its base); useful B*step;
               lost half a group-commit window, group_commit*(step + delta_overhead)/2; resume
               restart + load + (B-1)/2 * replay (the deltas since the base, on average).
               ``delta_overhead`` is the measured one plus its margin (below).

**Deltas must win at the pessimistic end of their measurement.** The delta overhead is a
difference of two noisy step times measured a few steps each (see
:class:`~ckptstore.torch.auto_policy.AutoPolicy`); snapshots' goodput does not depend on it.
Choosing deltas on an overhead measured too low costs every step of the run, choosing snapshots
wrongly costs little, so deltas are planned at ``delta_overhead + margin``, the margin
:data:`DELTA_MARGIN_Z` standard errors of the measurement (``Costs.delta_overhead_margin_s``;
measured on a 2-core VM: first plans saw +0 to +28 ms for a real 15-25 ms, and chose deltas that
lost 8% with no failure).

Both goodputs are log-concave in the interval (a product of x/(x+c) and a decreasing linear
factor), so the best real interval has a closed form, ``x = sqrt(c*(c+b)) - c`` for
``x*(b-x)/(x+c)``; for snapshots that is about ``sqrt(2*C*mtbf*A) - C`` seconds of training,
with ``A = 1 - (persist + resume)/mtbf``: Young/Daly's ``sqrt(2*C*MTBF)`` corrected for the resume
and the cost itself. ``C`` includes the slowdown: a planner that charged the stall alone
checkpointed too often wherever the persister shares the training's cores (end to end on 2 cores:
every 2-4 iterations, against 7-20 for the peers). The best whole interval is one of its two integer neighbours, clamped to the bounds:

* at least ``persist`` seconds of training between snapshots (bases), so snapshots never queue up
  behind each other in the pipeline;
* at most ``max_interval`` iterations;
* with a disk budget, room for the retained checkpoints plus the one being written (below).

**Disk.** A snapshot takes ``snapshot_bytes``; a delta chain ``snapshot_bytes + (B-1)*delta_bytes``.
``retention`` is how many of them (bases, each with its chain) to keep: the most such that
``(retention + 1) * unit <= disk_budget`` (the newest is written before an older one can go). An
option with ``retention < 1`` does not fit and is chosen only when nothing fits.

Everything here is plain arithmetic on floats: no torch, no I/O; :func:`plan` is a pure function.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

#: the failure rate assumed when none is given and the store's history teaches none
DEFAULT_MTBF_S = 24 * 3600.0
SNAPSHOTS = "snapshots"
DELTAS = "deltas"
MODES = (SNAPSHOTS, DELTAS)


@dataclass(frozen=True)
class Costs:
    """Measured costs, seconds and bytes (all >= 0; ``step_s`` > 0).

    ``delta_overhead_s`` None: deltas are not possible (an optimizer replay does not know)."""

    #: one training step without checkpoints
    step_s: float
    #: what one asynchronous snapshot blocks training
    snapshot_stall_s: float
    #: from a snapshot's stall to its durability (background)
    snapshot_persist_s: float = 0.0
    snapshot_bytes: int = 0
    #: how much longer a step takes when it writes a delta (None: no deltas)
    delta_overhead_s: float | None = None
    delta_bytes: int = 0
    #: replaying one delta at restore
    replay_s: float = 0.0
    #: loading a base snapshot at restore
    load_s: float = 0.0
    #: rescheduling, process start, rendezvous: the same for both modes
    restart_s: float = 0.0
    #: deltas per commit (a failure loses half a group on average)
    group_commit: int = 1
    #: beyond the stall, the training time one snapshot's background work takes from the steps
    #: it overlaps (from its submit to its durability)
    snapshot_slowdown_s: float = 0.0
    #: the delta overhead's uncertainty: deltas are planned at ``delta_overhead_s`` plus this
    #: (:data:`DELTA_MARGIN_Z` standard errors of its measurement; 0: none known)
    delta_overhead_margin_s: float = 0.0

    @property
    def snapshot_cost_s(self) -> float:
        """What one snapshot costs training: its stall plus the slowdown it causes."""
        return self.snapshot_stall_s + self.snapshot_slowdown_s

    @property
    def delta_step_extra_s(self) -> float:
        """What the planner charges a delta step beyond a plain one: the overhead plus its
        margin (0 when deltas are impossible). The deltas option is costed at it throughout:
        its interval, bounds, goodput and bytes per hour are those of the pessimistic end."""
        if self.delta_overhead_s is None:
            return 0.0
        return self.delta_overhead_s + self.delta_overhead_margin_s

    def check(self) -> None:
        """Raise ValueError naming the first field that is not a finite number in range."""
        for name in ("step_s", "snapshot_stall_s", "snapshot_slowdown_s", "snapshot_persist_s",
                     "replay_s", "load_s", "restart_s", "snapshot_bytes", "delta_bytes",
                     "delta_overhead_margin_s"):
            _check_number(name, getattr(self, name), positive=name == "step_s")
        if self.delta_overhead_s is not None:
            _check_number("delta_overhead_s", self.delta_overhead_s)
        if type(self.group_commit) is not int or self.group_commit < 1:
            raise ValueError(f"group_commit must be a positive int, not {self.group_commit!r}")


def _check_number(name: str, v: object, positive: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
            v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, "
                         f"not {v!r}")


@dataclass(frozen=True)
class Option:
    """One (mode, interval) under the model. ``interval``: iterations between snapshots
    (snapshots) or between bases (deltas). ``goodput`` in [0, 1]; ``fits``: the disk budget
    holds ``retention >= 1`` of them (always True without a budget)."""

    mode: str
    interval: int
    goodput: float
    #: fraction of wall time spent on checkpoint overhead in steady state (no failures)
    overhead: float
    #: expected work lost per failure
    lost_s: float
    #: expected time to resume after a failure
    resume_s: float
    bytes_per_hour: float
    #: how many snapshots (bases with their chain) to keep; None: no budget, keep all
    retention: int | None
    fits: bool

    def describe(self) -> str:
        what = (f"a snapshot every {self.interval} iterations" if self.mode == SNAPSHOTS else
                f"a delta every iteration, a base every {self.interval}")
        return (f"{what}: goodput {self.goodput:.4f} (overhead {100 * self.overhead:.2f}%, "
                f"{self.lost_s:.2f} s lost + {self.resume_s:.2f} s to resume per failure)")


@dataclass(frozen=True)
class Plan:
    """What to write, and why. ``chosen`` is the best option that fits (the best overall when
    none fits); ``options`` every option compared (the chosen one first), each at its own best
    interval. ``mtbf_source`` says where the failure rate came from ("given", "learned ...",
    "assumed ...")."""

    chosen: Option
    options: tuple[Option, ...]
    mtbf_s: float
    mtbf_source: str
    costs: Costs
    disk_budget: int | None = None
    notes: tuple[str, ...] = field(default=())
    #: where ``disk_budget`` came from ("given", or the Checkpointer's default share of free space)
    budget_source: str = "given"

    @property
    def mode(self) -> str:
        return self.chosen.mode

    @property
    def snapshot_every(self) -> int | None:
        """Iterations between snapshots (snapshots mode), else None."""
        return self.chosen.interval if self.chosen.mode == SNAPSHOTS else None

    @property
    def base_every(self) -> int | None:
        """Iterations between bases (deltas mode), else None."""
        return self.chosen.interval if self.chosen.mode == DELTAS else None

    @property
    def goodput(self) -> float:
        return self.chosen.goodput

    @property
    def bytes_per_hour(self) -> float:
        return self.chosen.bytes_per_hour

    @property
    def retention(self) -> int | None:
        return self.chosen.retention

    def goodputs(self) -> dict[str, float]:
        """``{mode: goodput}`` of every option compared."""
        return {o.mode: o.goodput for o in self.options}

    def __str__(self) -> str:
        c = self.costs
        lines = [f"checkpoint plan: {self.chosen.describe()}"]
        for o in self.options[1:]:
            lines.append(f"  instead of {o.describe()}" + ("" if o.fits else " [does not fit the disk budget]"))
        margin = (f" (planned at +{1e3 * c.delta_step_extra_s:.1f}: the pessimistic end of its "
                  f"measurement)" if c.delta_overhead_margin_s > 0 else "")
        delta = ("no delta cost (unmeasured or impossible: see the notes)"
                 if c.delta_overhead_s is None else
                 f"delta +{1e3 * c.delta_overhead_s:.1f} ms/step{margin} "
                 f"({_size(c.delta_bytes)}), "
                 f"replay {1e3 * c.replay_s:.1f} ms/delta")
        lines.append(f"  costs: step {1e3 * c.step_s:.1f} ms; snapshot stall {1e3 * c.snapshot_stall_s:.1f} ms "
                     f"+ slowdown {1e3 * c.snapshot_slowdown_s:.1f} ms, persist {c.snapshot_persist_s:.2f} s ({_size(c.snapshot_bytes)}), load "
                     f"{c.load_s:.2f} s; {delta}")
        lines.append(f"  failures: MTBF {_duration(self.mtbf_s)} ({self.mtbf_source})")
        disk = f"  disk: {_size(self.chosen.bytes_per_hour)}/h"
        if self.disk_budget is not None:
            kept = ("the newest " + str(self.chosen.retention) if self.chosen.retention is not None
                    else "all the")  # (None: sizes not measured yet)
            disk += (f"; the budget of {_size(self.disk_budget)} ({self.budget_source}) keeps "
                     f"{kept} {'snapshots' if self.mode == SNAPSHOTS else 'chains'}")
        lines.append(disk)
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _duration(s: float) -> str:
    """Seconds as ``"12.0 s"`` below a tenth of an hour (short MTBFs printed in hours read
    "0.00 h"), else as hours."""
    return f"{s:.1f} s" if s < 360 else f"{s / 3600:.2f} h"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # (unreachable)


def evaluate(costs: Costs, mode: str, interval: int, mtbf_s: float,
             disk_budget: int | None = None) -> Option:
    """The model's verdict on writing ``mode`` with ``interval`` (see the module docstring).
    Pure; defined for every interval >= 1 (bounds are :func:`bounds`'s business)."""
    s, cost = costs.step_s, costs.snapshot_cost_s
    if mode == SNAPSHOTS:
        k = s
        lost = (interval * s + cost) / 2 + costs.snapshot_persist_s
        resume = costs.restart_s + costs.load_s
        unit = costs.snapshot_bytes
        per_interval = costs.snapshot_bytes
    elif mode == DELTAS:
        if costs.delta_overhead_s is None:
            raise ValueError("deltas are not possible with these costs (delta_overhead_s is None)")
        k = s + costs.delta_step_extra_s
        lost = costs.group_commit * k / 2
        resume = costs.restart_s + costs.load_s + (interval - 1) / 2 * costs.replay_s
        unit = costs.snapshot_bytes + (interval - 1) * costs.delta_bytes
        per_interval = unit
    else:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    wall = interval * k + cost
    useful = interval * s
    goodput = useful / wall * max(0.0, 1.0 - (lost + resume) / mtbf_s)
    retention = None  # (no budget, or sizes not measured: keep everything)
    if disk_budget is not None and unit > 0:
        retention = disk_budget // unit - 1
    return Option(mode, interval, goodput, 1.0 - useful / wall, lost, resume,
                  per_interval * 3600.0 / wall, retention, retention is None or retention >= 1)


def bounds(costs: Costs, mode: str, disk_budget: int | None = None,
           max_interval: int = 100_000) -> tuple[int, int] | None:
    """The intervals ``mode`` may use: ``(lo, hi)``, both inclusive, or None when none is
    allowed (a disk budget that no interval fits). ``lo``: enough training to cover one
    snapshot's persist time (never below 1); ``hi``: ``max_interval``, and for deltas the longest
    chain the budget holds twice. ``lo > max_interval`` is kept (persisting must not queue)."""
    k = costs.step_s + (costs.delta_step_extra_s if mode == DELTAS else 0.0)
    lo = max(1, math.ceil(costs.snapshot_persist_s / k - 1e-12))
    hi = max(lo, max_interval)
    if disk_budget is not None:
        if costs.snapshot_bytes * 2 > disk_budget:
            return None
        if mode == DELTAS and costs.delta_bytes > 0:
            # (retention + 1) * (S + (B-1)*delta) <= budget with retention >= 1
            hi = min(hi, (disk_budget // 2 - costs.snapshot_bytes) // costs.delta_bytes + 1)
            if hi < lo:
                return None
    return lo, hi


def best_interval(costs: Costs, mode: str, mtbf_s: float, lo: int, hi: int) -> int:
    """The interval in ``[lo, hi]`` with the highest goodput under :func:`evaluate`: the closed
    form's integer neighbours, clamped (the goodput is unimodal in the interval)."""
    s, cost = costs.step_s, costs.snapshot_cost_s
    if mode == SNAPSHOTS:
        a = 1.0 - (costs.snapshot_persist_s + costs.restart_s + costs.load_s) / mtbf_s
        # goodput ~ x*(b - x)/(x + c) in x = N*s seconds of training per interval
        b, c, scale = 2 * mtbf_s * a - cost, cost, s
    else:
        assert costs.delta_overhead_s is not None
        k = s + costs.delta_step_extra_s
        a = 1.0 - (costs.group_commit * k / 2 + costs.restart_s + costs.load_s
                   - costs.replay_s / 2) / mtbf_s
        # goodput ~ B*(b - B)/(B + c) in B
        c, scale = cost / k, 1.0
        b = 2 * mtbf_s * a / costs.replay_s if costs.replay_s > 0 else math.inf
    if b <= 0:
        x = 0.0  # every interval loses everything: the shortest
    elif math.isinf(b):
        x = math.inf  # longer is always better (no replay cost)
    else:
        x = math.sqrt(c * (c + b)) - c
    n = x / scale
    if not math.isfinite(n) or n >= hi:
        return hi
    cands = {min(hi, max(lo, m)) for m in (math.floor(n), math.ceil(n))}
    return max(sorted(cands), key=lambda m: evaluate(costs, mode, m, mtbf_s).goodput)


def plan(costs: Costs, mtbf_s: float, disk_budget: int | None = None, *,
         modes: tuple[str, ...] = MODES, fixed: dict[str, int] | None = None,
         mtbf_source: str = "given", max_interval: int = 100_000,
         budget_source: str = "given") -> Plan:
    """The best plan for ``costs`` under failures every ``mtbf_s`` seconds on average.

    ``modes``: the modes to consider (deltas are left out when ``costs.delta_overhead_s`` is
    None); ``fixed``: ``{mode: interval}`` for a mode whose interval is given instead of chosen
    (an explicit ``snapshot_every``); ``disk_budget``: bytes the checkpoints may take (None: unbounded).
    Invariants: ``plan.chosen`` has the highest goodput of the options that fit (of all options
    when none fits), and each option's interval is the best within its :func:`bounds` (or the
    ``fixed`` one). Raises ValueError for a bad argument."""
    costs.check()
    _check_number("mtbf_s", mtbf_s, positive=True)
    if disk_budget is not None and (type(disk_budget) is not int or disk_budget <= 0):
        raise ValueError(f"disk_budget must be a positive int (bytes) or None, not {disk_budget!r}")
    for mode, n in (fixed or {}).items():
        if mode not in MODES or type(n) is not int or n < 1:
            raise ValueError(f"fixed must map modes to positive ints, not {fixed!r}")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes must be some of {MODES}, not {modes!r}")
    notes: list[str] = []
    options: list[Option] = []
    for mode in modes:
        if mode == DELTAS and costs.delta_overhead_s is None:
            notes.append("deltas are off: the optimizer cannot be replayed")
            continue
        if fixed and mode in fixed:
            options.append(evaluate(costs, mode, fixed[mode], mtbf_s, disk_budget))
            continue
        bound = bounds(costs, mode, disk_budget, max_interval)
        if bound is None:  # nothing fits: the best interval regardless, marked as not fitting
            notes.append(f"{mode}: the disk budget holds no {mode} checkpoint with room for the next")
            bound = bounds(costs, mode, None, max_interval)
            assert bound is not None  # (always some interval without a budget)
        n = best_interval(costs, mode, mtbf_s, *bound)
        options.append(evaluate(costs, mode, n, mtbf_s, disk_budget))
    if not options:
        raise ValueError("no mode left to plan: deltas are impossible and snapshots were not asked for")
    fitting = [o for o in options if o.fits] or options
    chosen = max(fitting, key=lambda o: o.goodput)
    rest = sorted((o for o in options if o is not chosen), key=lambda o: -o.goodput)
    return Plan(chosen, (chosen, *rest), float(mtbf_s), mtbf_source, costs, disk_budget,
                tuple(notes), budget_source)


#: standard errors of the delta ratio's measurement added to the delta overhead when planning
#: (one-sided: about 98% of measurements of a stable overhead fall below it)
DELTA_MARGIN_Z = 2.0

#: the kinds of sample a :class:`CostMeter` keeps (and a persisted plan may carry)
COST_KINDS = ("plain", "delta", "delta_ratio", "delta_ratio_se", "stall", "snapshot_cost",
              "persist", "snapshot_bytes", "load", "delta_bytes", "delta_write", "optimizer",
              "delta_share", "restore")


class CostMeter:
    """The costs :func:`plan` needs, measured online by a Checkpointer: fed numbers, no I/O.

    Each cost is the median of its last ``window`` samples (a step slowed by an evaluation pass
    or a neighbour's burst moves a median little). Step samples are the wall time from one
    step's start to the next one's, by what the first step wrote: ``"plain"`` (nothing),
    ``"delta"``, taken only while no snapshot is in flight; the steps from a snapshot's own to
    the one during which it became durable are one ``"snapshot_cost"`` sample instead (their
    time beyond as many plain or delta steps: the stall plus the slowdown, see
    :class:`SnapshotWindow`). ``"stall"`` is measured apart.
    Invariant: :meth:`costs` is None until at least one plain step and one snapshot were seen."""

    def __init__(self, window: int = 32) -> None:
        self._s: dict[str, deque[float]] = {k: deque(maxlen=window) for k in COST_KINDS}

    def add(self, kind: str, value: float) -> None:
        """One sample of ``kind`` (one of :data:`COST_KINDS`)."""
        self._s[kind].append(float(value))

    def count(self, kind: str) -> int:
        return len(self._s[kind])

    def median(self, kind: str) -> float | None:
        v = sorted(self._s[kind])
        if not v:
            return None
        m = len(v) // 2
        return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2

    def standard_error(self, kind: str) -> float | None:
        """The standard error of ``kind``'s median, from the spread of its samples (robust:
        1.4826 x their median absolute deviation, times 1.2533 / sqrt(n) for a median); None
        below 3 samples."""
        m, v = self.median(kind), list(self._s[kind])
        if m is None or len(v) < 3:
            return None
        dev = sorted(abs(x - m) for x in v)
        h = len(dev) // 2
        mad = dev[h] if len(dev) % 2 else (dev[h - 1] + dev[h]) / 2
        return 1.2533 * 1.4826 * mad / math.sqrt(len(v))

    def ratio_standard_error(self, num: str, den: str) -> float | None:
        """The standard error of ``median(num) / median(den)`` (first order: their relative
        errors add in quadrature); None without 3 samples of each or positive medians."""
        a, b = self.median(num), self.median(den)
        ea, eb = self.standard_error(num), self.standard_error(den)
        if not a or not b or ea is None or eb is None:
            return None
        return a / b * math.hypot(ea / a, eb / b)

    def medians(self) -> dict[str, float]:
        """``{kind: median}`` of every kind with samples (what a persisted plan keeps)."""
        out = {k: self.median(k) for k in self._s}
        return {k: v for k, v in out.items() if v is not None}

    def seed(self, medians: object) -> None:
        """Start from ``medians`` (as :meth:`medians` returned them, e.g. read back from a store):
        one sample of each kind, which new samples outvote. Raises ValueError, and takes nothing,
        unless ``medians`` is a dict of known kinds to finite numbers >= 0."""
        if type(medians) is not dict:
            raise ValueError(f"costs must be a dict, not {type(medians).__name__}")
        for k, v in medians.items():
            if k not in self._s:
                raise ValueError(f"unknown cost {k!r}")
            _check_number(k, v)
        for k, v in medians.items():
            self.add(k, v)

    def costs(self, replayable: bool, group_commit: int = 1) -> Costs | None:
        """The current estimate (see :class:`Costs`), or None before enough samples. The delta
        overhead is the delta step's median minus the plain step's (None when deltas are off or
        none were measured), or with a ``"delta_ratio"`` sample the plain step times that ratio
        less one, with a margin of :data:`DELTA_MARGIN_Z` times the plain step times the
        ratio's standard error (``"delta_ratio_se"``); replaying a delta is estimated as an
        optimizer step plus reading the delta (about its write); loading a base is what a
        restarted process's restore of one took (``"restore"``), and before any was measured
        estimated as writing one; a snapshot's slowdown as its measured cost beyond its stall
        (0 before a snapshot was seen through)."""
        plain, stall = self.median("plain"), self.median("stall")
        if plain is None or stall is None or plain <= 0:
            return None
        delta, ratio = self.median("delta"), self.median("delta_ratio")
        overhead, margin = None, 0.0
        if replayable and ratio is not None:  # (measured once beside plain steps, see AutoPolicy)
            overhead = plain * max(0.0, ratio - 1.0)
            margin = DELTA_MARGIN_Z * plain * (self.median("delta_ratio_se") or 0.0)
        elif replayable and delta is not None:
            overhead = max(0.0, delta - plain)
        med = self.median
        cost = med("snapshot_cost")
        return Costs(step_s=plain, snapshot_stall_s=stall,
                     snapshot_slowdown_s=max(0.0, cost - stall) if cost is not None else 0.0,
                     snapshot_persist_s=med("persist") or 0.0,
                     snapshot_bytes=int(med("snapshot_bytes") or 0),
                     delta_overhead_s=overhead, delta_overhead_margin_s=margin,
                     delta_bytes=int(med("delta_bytes") or 0),
                     replay_s=(med("optimizer") or 0.0) + (med("delta_write") or 0.0),
                     load_s=med("restore") or med("load") or 0.0, group_commit=group_commit)


class SnapshotWindow:
    """What snapshots cost the steps they overlap: turns step times into the
    :class:`CostMeter`'s samples (thread-safe: durability is reported from the pipeline's thread).

    A *window* opens when a snapshot is submitted and closes at the first step start at which no
    snapshot is in flight any more; its steps are the snapshots' own (the stall of an overlapped
    copy is in them: the submit, and the next step's wait for the copy) up to the one during which
    the last became durable. Closed, it is one ``"snapshot_cost"`` sample per snapshot in it::

        (sum of its steps' times - each step's median by its kind) / snapshots

    the stall plus the slowdown the persister's work on the same cores caused. Steps outside a
    window are the plain and delta samples. Call sequence:

    1. :meth:`submitted` (the step thread) when a snapshot is handed over; ``whole`` False: a
       snapshot with no step of its own to charge (written at restore, or the chain's first base
       in a process' first step, whose time is the warm-up's): its window gives no sample;
    2. :meth:`durable` (any thread) when it is durable, or failed;
    3. :meth:`step` at each step's start, with the previous step's kind and wall time;
    4. :meth:`interrupt` when steps stop following each other (a restore): the open window
       gives no sample.

    A window longer than :attr:`MAX_STEPS` steps (snapshots submitted faster than they become
    durable, back to back) gives no sample either: its steps are dropped, not kept for ever.

    Invariant: a window's sample is taken only with a median for every kind of step in it;
    until then it waits (at most ``pending`` of them, the oldest dropped). Where snapshots are so
    frequent that no step runs without one in flight, the plain and delta medians would never
    exist: :meth:`bootstrap` then makes the last :attr:`BOOTSTRAP` such steps of a kind in windows
    its samples, slowed as they are (later ones outvote them). Only when a plan is due and no
    sample exists: a slowed plain median would hide the very slowdown a window measures."""

    BOOTSTRAP = 3
    MAX_STEPS = 256

    def __init__(self, pending: int = 4) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self._open = False
        self._whole = True
        self._snapshots = 0
        self._steps: list[tuple[str, float]] = []
        #: the last steps of each kind that ran in windows (what :meth:`bootstrap` may take)
        self._recent: dict[str, deque[float]] = {
            k: deque(maxlen=self.BOOTSTRAP) for k in ("plain", "delta")}
        self._pending: deque[tuple[int, list[tuple[str, float]]]] = deque(maxlen=pending)

    def submitted(self, whole: bool) -> None:
        """A snapshot was handed over (opens a window, or joins the open one)."""
        with self._lock:
            self._inflight += 1
            self._snapshots += 1
            self._open = True
            self._whole = self._whole and whole

    def durable(self) -> None:
        """A submitted snapshot is durable, or failed: once per :meth:`submitted`."""
        with self._lock:
            assert self._inflight > 0, "SnapshotWindow.durable() without submitted()"
            self._inflight -= 1

    def interrupt(self) -> None:
        """Steps stop following each other: the open window gives no sample."""
        with self._lock:
            if self._open:
                self._whole = False
                if not self._inflight:
                    self._open, self._whole, self._snapshots, self._steps = False, True, 0, []

    def bootstrap(self, kind: str, meter: CostMeter) -> None:
        """No step of ``kind`` ("plain" or "delta") ran outside a window and a plan is due: the
        last ones that ran in windows become ``meter``'s samples (none: nothing happens)."""
        with self._lock:
            if meter.count(kind) == 0:
                for dt in self._recent[kind]:
                    meter.add(kind, dt)
        self._resolve(meter)  # (windows that waited for this median)

    def step(self, kind: str, dt: float, meter: CostMeter, sample: bool = True) -> None:
        """The previous step took ``dt`` seconds and wrote ``kind`` ("plain", "delta", or
        anything else: a snapshot, or no record, charged in a window as a plain step). Feeds
        ``meter``; ``sample`` False: the step's kind has no current median to compare it with
        (the deltas mode's delta steps): no sample outside a window, and a window it is in gives
        none either."""
        with self._lock:
            if not self._open:
                if sample and kind in ("plain", "delta"):
                    meter.add(kind, dt)
            else:
                self._steps.append(("delta" if kind == "delta" else "plain", dt))
                if kind in self._recent:
                    self._recent[kind].append(dt)
                if not sample or len(self._steps) > self.MAX_STEPS:
                    self._whole, self._steps = False, []
                if not self._inflight:
                    if self._whole and self._snapshots:
                        self._pending.append((self._snapshots, self._steps))
                    self._open, self._whole, self._snapshots, self._steps = False, True, 0, []
        self._resolve(meter)

    def _resolve(self, meter: CostMeter) -> None:
        """Closed windows whose step kinds all have a median now become samples."""
        with self._lock:
            if not self._pending:
                return
            pending, self._pending = list(self._pending), deque(maxlen=self._pending.maxlen)
        for snapshots, steps in pending:
            found = {k: meter.median(k) for k, _ in steps}
            medians = {k: m for k, m in found.items() if m is not None}
            if len(medians) < len(found):
                with self._lock:
                    self._pending.append((snapshots, steps))
                continue
            extra = sum(dt - medians[k] for k, dt in steps)
            for _ in range(snapshots):
                meter.add("snapshot_cost", max(0.0, extra / snapshots))


def drifted(old: Costs, new: Costs, tolerance: float = 0.3, floor_s: float = 2e-3) -> bool:
    """Whether a cost the plan depends on moved by more than ``tolerance`` (relative) and more
    than ``floor_s`` seconds (timer noise on tiny costs is no drift); deltas becoming measurable
    or not counts as drift."""
    if (old.delta_overhead_s is None) != (new.delta_overhead_s is None):
        return True
    pairs = [(old.step_s, new.step_s), (old.snapshot_cost_s, new.snapshot_cost_s),
             (old.snapshot_persist_s, new.snapshot_persist_s), (old.replay_s, new.replay_s)]
    if old.delta_overhead_s is not None and new.delta_overhead_s is not None:
        pairs.append((old.delta_overhead_s, new.delta_overhead_s))
    return any(abs(b - a) > floor_s and abs(b - a) > tolerance * max(abs(a), 1e-12)
               for a, b in pairs)


#: the goodput another mode must gain over the one in force before a re-plan on drifted costs
#: switches to it. A switch writes a base (or a snapshot) and runs steps whose cost is an
#: estimate until measured, and a drift re-plan follows samples as noisy as a fresh process's
#: first snapshot windows: measured (tools/bench_goodput.py, 2026-11-30, MTBF 6 s), a re-plan 16
#: steps after a restart, on windows slowed 12.1 against 3.1 ms, chose deltas by 0.0010 and went
#: back 112 steps later; that round the policy trailed fixed-interval snapshots by 0.016
MODE_SWITCH_MARGIN = 0.005


def keep_mode(new: Plan, current: str, margin: float = MODE_SWITCH_MARGIN) -> Option | None:
    """The option of mode ``current`` in ``new`` when ``new`` chose another mode by less than
    ``margin`` goodput and ``current``'s option fits the disk budget: the mode to keep. None:
    ``new`` keeps ``current`` already, ``current`` is not among its options or does not fit, or
    the other mode gains at least ``margin`` (switch)."""
    if new.mode == current:
        return None
    kept = next((o for o in new.options if o.mode == current), None)
    if kept is None or not kept.fits or new.chosen.goodput - kept.goodput >= margin:
        return None
    return kept

