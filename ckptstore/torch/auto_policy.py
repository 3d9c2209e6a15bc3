"""The Checkpointer's checkpoint policy: measure costs, plan, re-plan (issue 30).

:class:`AutoPolicy` is the state machine behind ``Checkpointer(policy="auto")`` (and the planned
interval of ``policy="snapshots"`` without ``snapshot_every``); the Checkpointer owns one and
calls it at fixed points of a step. :mod:`ckptstore.torch.plan` holds the model (pure
arithmetic); this module decides *when* to plan and what to plan from. Call sequence per step:

1. ``tick(iteration)``: the previous step's wall time becomes a cost sample under what it wrote;
   the phases move on (:meth:`AutoPolicy.advance`), which may switch the mode or ask for a
   snapshot (through the Checkpointer's callbacks) before this step writes anything;
2. the Checkpointer writes what ``mode`` says and feeds the meter (``observe_*``);
3. ``tock(iteration, wrote)``: remembered for the next sample.

Phases without a persisted plan: ``measure_steps`` plain steps with a snapshot every
:data:`MEASURE_SNAPSHOT_GAP` of them or more (the first after as many, the next ones at the
interval a plan from the windows measured so far would choose, up to ``2 * measure_steps``)
until :data:`MEASURE_WINDOWS` snapshots' costs are measured, for at most
:func:`measuring_steps_max` steps; then, with policy "auto" and an optimizer replay knows,
deltas are measured (``measure_steps`` delta steps outside snapshots' windows) only if they
could pay (:func:`~ckptstore.torch.delta_forecast.forecast_deltas`: the snapshot plan's goodput
against deltas at a cost predicted from the snapshots'; most plans never use deltas, and
measuring them costs every measured step their overhead), and no longer than it takes to see
them lose (a sequential test: from :data:`EARLY_STOP_SAMPLES` delta steps on, the measurement
stops once the plan would choose snapshots even at the optimistic end of their measured cost);
then "planned": the costs are compared with the plan's every 16 steps and a drift, or a new
MTBF, re-plans, which asks the forecast again while deltas are unmeasured; a drift switches
modes only for a gain of :data:`~ckptstore.torch.plan.MODE_SWITCH_MARGIN` goodput or more. A snapshot's cost
is measured over the steps it overlaps (:class:`~ckptstore.torch.plan.SnapshotWindow`); a delta
step is a cost sample only while measuring (in the deltas mode no plain step runs to compare it
with).

**Persisted plan** (format-spec/deltas.md, "Base snapshot written by the Checkpointer"): every
base the Checkpointer writes carries :meth:`AutoPolicy.persisted` under
:data:`~ckptstore.torch.plan_history.PLAN_KEY` (read back by
:func:`~ckptstore.torch.plan_history.parse_persisted`): the measured cost medians and the
failure history (restarts, since when). A restarted process
(:meth:`AutoPolicy.resume`, from the base of the iteration it restored) seeds its meter with the
medians and plans at once: no measuring phase, so a process with a short life between failures
does not spend it measuring; its first :data:`RESUME_WARMUP_STEPS` steps are no samples (a
fresh process's warm-up would outvote the persisted medians at the first drift check). The plan
is re-derived from the persisted inputs (a pure function of them), so the persisted field holds
no decision a reader must trust. A field that does not validate is ignored with a WARNING
(logger "ckptstore") and the costs are measured again.

**Several ranks** (a multi-rank job store): every decision (a phase's end, a plan, a drift)
is made from inputs every rank agreed on (:mod:`ckptstore.torch.plan_agreement`: a collective
at steps every rank counts alike), so every rank plans the same at the same iteration and
persists the same field; :meth:`AutoPolicy.resume` plans on every rank, whatever it read.

**Failure rate** (:func:`~ckptstore.torch.plan_history.learned_mtbf`, one implementation for
both kinds of store): restarts over the time they happened in; a job store's restarts are its
epochs (:func:`~ckptstore.torch.plan_history.job_restarts`), a single store's the resumes its
persisted plans count (each :meth:`AutoPolicy.resume` from a base carrying one is one restart; a
process killed before it wrote a base is not counted: the count errs low, the MTBF high).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable

from .delta_forecast import DeltaForecast, forecast_deltas
from .plan import (DEFAULT_MTBF_S, DELTAS, MODE_SWITCH_MARGIN, SNAPSHOTS, CostMeter, Plan,
                   SnapshotWindow, drifted, keep_mode, plan as make_plan)
from .plan_agreement import RankAgreement, Shared
from .plan_history import PLAN_VERSION, learned_mtbf, parse_persisted

log = logging.getLogger("ckptstore")

#: the share of the store's filesystem's free space (at open) the default disk budget is
DEFAULT_DISK_SHARE = 0.5
#: snapshot windows (``snapshot_cost`` samples) the first plan waits for: one window's slowdown
#: measured 0 to 62 ms for a real ~10-30 ms here (two steps' noise), and a 0 planned a snapshot
#: every 2-3 iterations where 5-9 was best
MEASURE_WINDOWS = 3
#: the fewest steps from one measuring snapshot to the next (room for its window and a plain
#: step or two); the next also waits for the last one's window to give its sample
MEASURE_SNAPSHOT_GAP = 4
#: the delta/plain ratio's relative standard error assumed when fewer than 3 samples of a kind
#: give no spread (``measure_steps`` < 3): a single step's spread on the 2-core VM, ~10%
UNMEASURED_RATIO_REL_SE = 0.1
#: steps after a resume whose times are no samples: a fresh process's first steps and snapshot
#: windows run slow (its allocator, page cache and staging arena warm up), and one such window
#: outvotes the one persisted sample of each cost. Measured (tools/bench_goodput.py,
#: 2026-11-30): the drift check 16 steps after a restart saw the snapshot slowdown jump (3.1 ->
#: 12.1, 7.0 -> 10.7, 2.8 -> 8.7 ms) and re-planned; 16 steps later it was back down
RESUME_WARMUP_STEPS = 16
#: delta steps measured before the deltas phase may stop early (a sequential test, see
#: :meth:`AutoPolicy.advance`): a spread is measured from 3, but the standard error of 3 is rough
#: (the median absolute deviation of 3 samples is one sample's distance from the median); half
#: the default ``measure_steps`` (with ``measure_steps`` <= 4 the phase never stops early)
EARLY_STOP_SAMPLES = 4


def measure_gap_max(measure_steps: int) -> int:
    """The most steps from one measuring snapshot to the next: ``2 * measure_steps``, at
    least :data:`MEASURE_SNAPSHOT_GAP`."""
    return max(MEASURE_SNAPSHOT_GAP, 2 * measure_steps)


def measuring_steps_max(measure_steps: int) -> int:
    """The steps the plain measuring phase may last before it plans with what it measured:
    ``4 * measure_steps`` for the plain steps, plus room for :data:`MEASURE_WINDOWS` windows at
    the widest gap (:func:`measure_gap_max`; a window's sample waits for its snapshot to be
    durable, so the last window needs its gap and its snapshot's persist time)."""
    return 4 * measure_steps + MEASURE_WINDOWS * measure_gap_max(measure_steps)


def default_policy(replayable: bool, multirank: bool) -> str:
    """The policy of ``Checkpointer(policy=None)``: "auto", for any number of ranks: a plan
    within the default disk budget, kept by the retention the Checkpointer derives from it, so
    that no default run fills a disk. On a multi-rank job store every rank plans alike (one plan,
    agreed by every rank: :mod:`ckptstore.torch.plan_agreement`) and the retention is the job's
    collective gc (:mod:`ckptstore.torch.plan_retention`). (``multirank`` is kept for callers:
    until 2026-11-29 a multi-rank job defaulted to "every-iteration", when no plan drove a job's
    gc.)"""
    del replayable, multirank
    return "auto"


class AutoPolicy:
    """The policy's state (see the module docstring). ``policy``: "auto", "snapshots" or
    "every-iteration" (no planner: :meth:`tick` only samples). ``grad_bytes``: what a delta of
    this rank reads (its gradients' bytes; 0: unknown), for the forecast of what deltas would
    cost (:func:`~ckptstore.torch.delta_forecast.forecast_deltas`). ``switch(mode, iteration,
    resumed)``: the Checkpointer's write-path change (may raise: the mode is then unchanged;
    ``resumed``: right after a restore, whose base already persists the plan);
    ``snapshot_now()``: the next record is a snapshot; ``planned(plan)``: a new plan is in force.
    Invariants: :attr:`mode` is what the steps write; :attr:`plan` is None until the first plan
    (measured, or resumed from a persisted one), then always the plan in force; ``mode`` is the
    plan's except while deltas are measured (:attr:`phase` "deltas")."""

    def __init__(self, policy: str, replayable: bool, snapshot_every: int | None,
                 mtbf_s: float | None, disk_budget: int | None, measure_steps: int,
                 group_commit: int, *, budget_source: str = "given",
                 job_history: Callable[[], tuple[int, int]] | None = None,
                 switch: Callable[[str, int, bool], None], snapshot_now: Callable[[], None],
                 planned: Callable[[Plan], None], where: str = "",
                 defaulted: bool = False, agreement: RankAgreement | None = None,
                 grad_bytes: int = 0) -> None:
        self.policy = policy
        self.grad_bytes = grad_bytes
        self.replayable = replayable
        self.snapshot_every_fixed = snapshot_every
        self.mtbf_s = mtbf_s
        self.disk_budget = disk_budget
        self.budget_source = budget_source
        self.measure_steps = measure_steps
        self.group_commit = group_commit
        self.meter = CostMeter()
        #: turns the steps snapshots overlap into "snapshot_cost" samples
        self.window = SnapshotWindow()
        #: plain steps timed (the plain measuring phase's count: a step in a snapshot's window
        #: counts, though its time is part of the snapshot's cost, not a sample)
        self._plain_seen = 0
        self._in_step = False
        self.plan: Plan | None = None
        #: the cost medians ``plan`` was made from (what a base persists with it)
        self._plan_costs: dict[str, float] = {}
        self._job_history = job_history
        self._switch, self._snapshot_now, self._planned = switch, snapshot_now, planned
        self._where = where
        #: the user passed no policy (the first plan's log line says so)
        self._defaulted = defaulted
        #: a multi-rank job store's: every decision from inputs every rank agreed on
        self._agreement = agreement
        self._history_shared = False  # restarts/since_ns are the agreed ones (multi-rank)
        self._mtbf: tuple[float, str] | None = None  # (seconds, where it comes from), once known
        #: the failure history this store's persisted plans carry (single stores)
        self.restarts = 0
        self.since_ns = time.time_ns()
        self._resumed = False
        #: the last iteration of a resumed process's warm-up (RESUME_WARMUP_STEPS): until then
        #: no step or snapshot window is a sample
        self._warm_until: int | None = None
        self._iteration = 0  # the step in progress (tick's)
        #: what the steps write now: DELTAS or SNAPSHOTS
        self.mode = DELTAS if policy == "every-iteration" else SNAPSHOTS
        #: "plain" (measuring steps that write nothing, and snapshots), "deltas" (measuring delta
        #: steps, once the forecast said they could pay), "planned"
        self.phase = "planned" if policy == "every-iteration" else "plain"
        #: (iteration, agreed window count) when the last measuring snapshot was asked for (None:
        #: none yet); the next one waits for both to move on (decisions from agreed inputs only)
        self._measure_asked: tuple[int, int] | None = None
        #: (windows measured, the gap to the next measuring snapshot they give): _measure_gap's
        self._gap: tuple[int, int] | None = None
        self._since_check = 0  # steps since costs were last compared with the plan's
        #: deltas were measured in this process (or their phase was entered): never twice
        self._deltas_tried = False
        #: the forecast that had deltas measured in this process (the plans' notes quote it)
        self._forecast: DeltaForecast | None = None
        #: (delta steps measured, the overhead's optimistic end) when the deltas phase stopped
        #: early (the plan made then says so; taken by it)
        self._stopped_early: tuple[int, float] | None = None
        #: a resumed process' forecast said deltas could pay: the next drift check asks again,
        #: once this process measured its own plain steps (the seeded one is another process')
        self._forecast_due = False
        self._replan_next = False  # replan_soon() asked for a plan at the next step
        #: the last step: (iteration, its start, what it wrote: "plain" | "delta" | "base")
        self._prev: tuple[int, float, str] | None = None
        self._t_step = 0.0

    # ---- what the Checkpointer asks -------------------------------------------------------
    def base_every(self) -> int | None:
        """The plan's base interval in the deltas mode of policy "auto", else None."""
        if self.policy == "auto" and self.plan is not None:
            return self.plan.base_every
        return None

    def snapshot_every(self) -> int | None:
        """Iterations between snapshots: the fixed one, else the plan's (None: not planned yet)."""
        return self.snapshot_every_fixed or (self.plan.snapshot_every if self.plan else None)

    def persisted(self) -> dict | None:
        """What a base written now carries under :data:`~ckptstore.torch.plan_history.PLAN_KEY`
        (None: policy "every-iteration"): the failure history, and with a plan the cost medians
        it was made from, its mode and interval (JSON-safe: ints, floats, strings). Planning
        again from these medians with the same MTBF and budget gives the same plan."""
        if self.policy == "every-iteration":
            return None
        if self._agreement is not None and not self._history_shared:
            self._shared("a base")  # (every rank writes every base: the field is the same on all)
        out: dict[str, Any] = {"v": PLAN_VERSION, "restarts": self.restarts,
                               "since_ns": self.since_ns}
        if self.plan is not None:
            out.update(mode=self.plan.mode, interval=self.plan.chosen.interval,
                       costs=dict(self._plan_costs))
        return out

    # ---- a restarted process --------------------------------------------------------------
    def resume(self, read: Callable[[], Any], iteration: int,
               restore_s: float | None = None) -> None:
        """Once per process, after it restored ``iteration``: ``read()`` returns the persisted
        field of the base ``iteration`` is built on (KeyError, e.g. NotFoundError: it has none).
        A valid field counts this process as one restart and, when it holds costs, seeds the
        meter and plans now; an invalid one is logged (WARNING) and ignored: costs are measured
        as for a new store. ``restore_s``: the seconds this process's restore of a snapshot
        took, a ``"restore"`` sample (the load time plans use from then on, instead of a
        snapshot's write time). No-op for policy "every-iteration" and after the first call. On
        a multi-rank job store every rank plans now, whatever it read (a collective: the ranks
        plan from what they read together, and measure again together when none holds costs)."""
        if self._resumed or self.policy == "every-iteration":
            return
        self._resumed = True
        costs = self._read_persisted(read, iteration)
        if costs is not None:
            self.meter.seed(costs)
            if self._agreement is None and self._costs(self.meter.medians()) is None:
                self.meter = CostMeter()  # (valid numbers, but too few to plan from)
                costs = None
        if restore_s is not None:
            self.meter.add("restore", restore_s)
        if self._agreement is None and costs is None:
            return
        try:
            self._replan(iteration + 1, resumed=True)
            if self.phase == "planned":  # (planned from persisted costs: no hurry to sample)
                self._warm_until = iteration + RESUME_WARMUP_STEPS
        except (ValueError, ArithmeticError) as e:  # (numbers in range that the model rejects)
            log.warning("Checkpointer %s: the persisted plan of iteration %d does not plan "
                        "(%s); measuring costs again", self._where, iteration, e)
            self.meter, self.plan, self.phase = CostMeter(), None, "plain"

    def _read_persisted(self, read: Callable[[], Any], iteration: int) -> dict | None:
        """The cost medians of the persisted field ``read()`` returns (None: none, or a field
        that does not validate, logged); a valid field's failure history, one restart more, is
        taken."""
        try:
            field = read()
        except KeyError:
            return None  # an older store, or a base written by another policy: measure
        except Exception as e:  # noqa: BLE001 - a damaged field costs a re-measure, not the run
            log.warning("Checkpointer %s: the persisted plan of iteration %d cannot be read "
                        "(%s: %s); measuring costs again", self._where, iteration,
                        type(e).__name__, e)
            return None
        try:
            restarts, since, costs = parse_persisted(field)
        except ValueError as e:
            log.warning("Checkpointer %s: ignoring the persisted plan of iteration %d (%s); "
                        "measuring costs again", self._where, iteration, e)
            return None
        self.restarts, self.since_ns = restarts + 1, since
        self._history_shared = False
        return costs

    # ---- the step ---------------------------------------------------------------------------
    def tick(self, iteration: int) -> None:
        """A step's start: the previous step's wall time (to this start) becomes a cost sample
        under what it wrote, or part of a snapshot's cost while one is in flight
        (:class:`~ckptstore.torch.plan.SnapshotWindow`); then the phases move on."""
        now = time.perf_counter()
        prev, self._prev = self._prev, None
        if prev is not None and prev[0] == iteration - 1:
            # A delta step is a sample only while measuring: in the deltas mode no plain step
            # runs, so the plain median would be older than the delta one and the difference,
            # the delta's overhead, would follow the machine's drift (a fresh process' warm-up
            # alone moved it 10-20% here): the overhead stays the one measured alongside plain steps
            self.window.step(prev[2], now - prev[1], self.meter,
                             sample=(prev[2] != "delta" or self.phase != "planned" or
                                     self.policy != "auto") and not self._warming(prev[0]))
            if prev[2] == "plain":
                self._plain_seen += 1
        else:
            self.window.interrupt()
        self._t_step = now
        self._in_step = True
        self._iteration = iteration
        if self.policy != "every-iteration":
            self.advance(iteration)

    def _warming(self, iteration: int) -> bool:
        """Whether ``iteration`` is in a resumed process's warm-up (no sample)."""
        return self._warm_until is not None and iteration <= self._warm_until

    def tock(self, iteration: int, wrote: str) -> None:
        """A step that ended (it may have written nothing): remembered for the next sample."""
        self._prev = (iteration, self._t_step, wrote)
        self._in_step = False

    def forget_step(self) -> None:
        """No step-time sample across this point (a restore)."""
        self._prev = None
        self._in_step = False
        self.window.interrupt()

    def replan_soon(self, mtbf_s: float | None) -> None:
        """Plan again at the next step (checked arguments), e.g. with a new ``mtbf_s``."""
        if mtbf_s is not None:
            self.mtbf_s = mtbf_s
        if self.phase == "planned":
            self._replan_next = True

    def advance(self, iteration: int) -> None:
        """The phases: measure ``measure_steps`` steps that write nothing and
        :data:`MEASURE_WINDOWS` snapshot windows (a measuring snapshot every
        :data:`MEASURE_SNAPSHOT_GAP` to :func:`measure_gap_max` steps, the interval the windows
        so far plan; beyond :func:`measuring_steps_max` steps in
        all, with what was measured), then plan (:meth:`_replan`, which may first measure
        ``measure_steps`` delta steps outside snapshots' windows, for at most
        ``4 * measure_steps`` steps, fewer once deltas clearly lose: from
        :data:`EARLY_STOP_SAMPLES` delta samples on, when the plan would choose snapshots even
        at the optimistic end of the overhead measured so far, and plan again);
        once planned, compare the costs with the plan's every 16 steps and re-plan when one
        drifted (:func:`ckptstore.torch.plan.drifted`).
        Every decision is made from :meth:`_shared` inputs, taken (on a multi-rank job store:
        agreed) at steps every rank counts alike: each step of a measuring phase, every 16th
        planned one, a replan asked."""
        self._since_check += 1
        if self.phase == "planned" and self._since_check < 16 and not self._replan_next:
            return
        if self.phase != "planned":
            kind = "delta" if self.phase == "deltas" else "plain"
            # (the delta phase counts samples: it waits for them until its time is up)
            if (kind == "plain" and self._plain_seen >= self.measure_steps) or \
                    self._since_check > 4 * self.measure_steps:
                # (every such step ran while a snapshot was in flight: its time, slowed as it is,
                # is all there is to plan from)
                self.window.bootstrap(kind, self.meter)
        shared = self._shared(f"iteration {iteration}, " + (
            "replan" if self._replan_next else
            "drift check" if self.phase == "planned" else "measuring"))
        counts = shared.counts
        if self.phase == "deltas":
            if counts["delta"] >= self.measure_steps or \
                    self._since_check > 4 * self.measure_steps or \
                    self._early_stop(iteration, shared):
                self._keep_delta_ratio(shared)
                self._replan(iteration, shared=shared)
                if self.phase == "planned" and self.mode == DELTAS:
                    # (the chain's base predates the plan: a base now persists it, so that a
                    # restart resumes the plan instead of measuring again)
                    self._snapshot_now()
        elif self.phase == "plain":
            fixed = self.snapshot_every_fixed is not None  # (its snapshots are the windows)
            windows = fixed or counts["windows"] >= MEASURE_WINDOWS
            timeout = self._since_check > measuring_steps_max(self.measure_steps)
            if counts["stall"] and ((counts["plain"] >= self.measure_steps and windows) or timeout):
                self._keep_delta_ratio(shared)
                self._replan(iteration, shared=shared)
            elif fixed:
                pass
            elif self._measure_asked is None:
                if counts["plain"] >= MEASURE_SNAPSHOT_GAP or timeout:
                    # the first snapshot to measure, once plain steps give its window a median
                    self._measure_asked = (iteration, counts["windows"])
                    self._snapshot_now()
            elif not windows and not timeout and \
                    counts["windows"] > self._measure_asked[1] and \
                    iteration - self._measure_asked[0] >= self._measure_gap(shared):
                # another window, once the last one gave its sample on every rank (a snapshot
                # still in flight would join its window: one sample counted twice)
                self._measure_asked = (iteration, counts["windows"])
                self._snapshot_now()
        elif self._replan_next:
            self._replan_next = False
            self._replan(iteration, shared=shared)
        else:
            self._since_check = 0
            costs = self._costs(shared.medians)
            # (a forecast due asks with plain steps of this process's own: after its warm-up)
            forecast_due = self._forecast_due and not self._warming(iteration - 1)
            if costs is not None and (self.plan is None or forecast_due or
                                      drifted(self.plan.costs, costs)):
                # (a drift keeps the mode in force unless the other gains MODE_SWITCH_MARGIN)
                sticky = self.plan is not None and not forecast_due
                if forecast_due:
                    self._forecast_due = False  # (asked now; one still warming up stays due)
                self._replan(iteration, shared=shared, sticky=sticky)

    def _measure_gap(self, shared: Shared) -> int:
        """Steps from one measuring snapshot to the next, once a window gave its sample: the
        interval of the snapshot plan the windows measured so far give (``shared``'s medians),
        within [:data:`MEASURE_SNAPSHOT_GAP`, :func:`measure_gap_max`];
        :data:`MEASURE_SNAPSHOT_GAP` while no plan can be made. Measuring snapshots thus cost
        about what the plan's own will where the plan wants them rarer (they were one every
        :data:`MEASURE_SNAPSHOT_GAP` steps: 3 snapshots in 13 steps where the plan then wrote
        one every 10-14). Computed once per window count, at the step every rank first sees that
        count, from agreed inputs: every rank waits the same gap."""
        windows = shared.counts["windows"]
        widest = measure_gap_max(self.measure_steps)
        if self._gap is None or self._gap[0] != windows:
            gap = MEASURE_SNAPSHOT_GAP
            costs = self._costs(shared.medians) if widest > gap else None
            if costs is not None:
                try:
                    interval = make_plan(costs, shared.mtbf_s, shared.budget,
                                         modes=(SNAPSHOTS,)).chosen.interval
                except (ValueError, ArithmeticError):
                    interval = gap  # (numbers the model rejects: the plan will say so)
                gap = min(max(gap, interval), widest)
            self._gap = (windows, gap)
        return self._gap[1]

    def _early_stop(self, iteration: int, shared: Shared) -> bool:
        """While deltas are measured: True when they lose already, so that measuring more of
        them would only cost more delta steps (a sequential test). Needs
        :data:`EARLY_STOP_SAMPLES` delta samples and a measured standard error of the
        delta/plain ratio on every rank (``counts["ratio_se"]``: 3 samples of each kind, not
        the assumed :data:`UNMEASURED_RATIO_REL_SE`); then the overhead's optimistic end,
        the overhead less its margin (both as :class:`~ckptstore.torch.plan.CostMeter` derives
        them from the ratio and its standard error, for the plan made after the phase), is
        handed to the planner as if measured exactly: if even then it plans snapshots, the plan
        made next, which costs deltas at the overhead plus its margin, plans snapshots too,
        as it would after ``measure_steps`` samples unless the later ones moved the median down
        by more than that. From ``shared`` (agreed) inputs only, each the slowest rank's (the
        job's deltas cost what its slowest rank's do): every rank stops at the same step."""
        delta, plain = shared.medians.get("delta"), shared.medians.get("plain")
        if shared.counts["delta"] < EARLY_STOP_SAMPLES or not shared.counts.get("ratio_se") \
                or not delta or not plain:
            return False
        # (the costs of the plan after this phase: the ratio _keep_delta_ratio keeps)
        costs = self._costs({**shared.medians, "delta_ratio": delta / plain})
        if costs is None or costs.delta_overhead_s is None:
            return False
        low = costs.delta_overhead_s - costs.delta_overhead_margin_s
        optimistic = dataclasses.replace(costs, delta_overhead_s=max(0.0, low),
                                         delta_overhead_margin_s=0.0)
        try:
            mode = make_plan(optimistic, shared.mtbf_s, shared.budget, modes=(SNAPSHOTS, DELTAS),
                             fixed=self._fixed()).mode
        except (ValueError, ArithmeticError):
            return False  # (the phase runs its course; the plan after it says what is wrong)
        if mode != SNAPSHOTS:
            return False
        self._stopped_early = (shared.counts["delta"], low)
        log.info("Checkpointer %s, iteration %d: deltas measured on %d steps only: even at "
                 "+%.1f ms a step (the optimistic end) the plan is of snapshots", self._where,
                 iteration, shared.counts["delta"], 1e3 * low)
        return True

    def _keep_delta_ratio(self, shared: Shared) -> None:
        """At the end of the measuring phases: the delta step's time over the plain step's, both
        just measured (agreed on every rank), becomes a ``"delta_ratio"`` sample, from which the
        delta overhead is derived from then on (plain x (ratio - 1)). Neither mode runs both kinds
        of step: the other kind's median goes stale, and the difference of a fresh median and a
        stale one follows the machine's drift (measured: a plain median 30% up after the machine
        slowed, a delta overhead of 0 and a plan for deltas). Its standard error, from the two
        kinds' spread (``"delta_ratio_se"``, the largest over the ranks), is kept with it."""
        delta, plain = shared.medians.get("delta"), shared.medians.get("plain")
        if self.meter.count("delta_ratio") or delta is None or not plain:
            return
        shared.medians["delta_ratio"] = delta / plain
        self.meter.add("delta_ratio", delta / plain)
        se = shared.medians.get("delta_ratio_se")
        if se is not None:  # (the planner adds a margin of it: deltas must win at its far end)
            self.meter.add("delta_ratio_se", se)

    def _fixed(self) -> dict[str, int] | None:
        """The planner's ``fixed`` argument: the explicit ``snapshot_every``, else None."""
        return {SNAPSHOTS: self.snapshot_every_fixed} if self.snapshot_every_fixed else None

    def _costs(self, medians: dict[str, float]):
        frozen = CostMeter()
        frozen.seed(medians)
        return frozen.costs(self.replayable and self.policy == "auto", self.group_commit)

    def _shared(self, when: str) -> Shared:
        """What a decision is made from: this process's sample counts, cost medians (once:
        samples from the pipeline's threads may land meanwhile), failure rate, disk budget and
        failure history; on a multi-rank job store every rank's, combined
        (:mod:`ckptstore.torch.plan_agreement`: a collective, the same result on every rank),
        whose failure history is then this process's too."""
        m = self.meter
        mtbf, source = self.failure_rate()
        # (delta steps: the samples, steps outside snapshots' windows; the switch to deltas writes
        # a base whose window takes the first ones, and the ratio needs a median of its own)
        seen = {"plain": self._plain_seen, "delta": m.count("delta"),
                # (min over the ranks: once any rank measured deltas, none measures them again)
                "deltas_untried": 0 if self._deltas_tried else 1}
        medians = m.medians()
        se_measured = 0
        if not m.count("delta_ratio"):  # (what _keep_delta_ratio keeps at the phases' end)
            se = m.ratio_standard_error("delta", "plain")
            se_measured = int(se is not None)
            delta, plain = medians.get("delta"), medians.get("plain")
            if se is None and delta is not None and plain:
                # (under 3 samples of a kind: no spread to measure; one step's own spread here)
                se = UNMEASURED_RATIO_REL_SE * delta / plain
            if se is not None:
                medians["delta_ratio_se"] = se
        local = Shared({**seen, "stall": m.count("stall"), "windows": m.count("snapshot_cost"),
                        "ratio_se": se_measured},
                       medians,
                       mtbf, source, self.disk_budget, self.budget_source, self.restarts,
                       self.since_ns)
        if self._agreement is None:
            return local
        shared = self._agreement.agree(local, when)
        self.restarts, self.since_ns = shared.restarts, shared.since_ns
        self._history_shared = True
        return shared

    def _replan(self, iteration: int, resumed: bool = False, shared: Shared | None = None,
                sticky: bool = False) -> None:
        """Plan from ``shared`` (None: taken now, :meth:`_shared`); a changed plan is logged
        (INFO); a plan whose mode differs from what the steps write is applied from this step
        on. With policy "auto", an optimizer replay knows and no delta measured, the plan is of
        snapshots, and its notes say what :func:`~ckptstore.torch.delta_forecast.forecast_deltas`
        found; when deltas could pay (once per job: no rank has measured them in this process)
        the "deltas" phase then measures them (logged, INFO) under this plan, which its bases
        persist (a process killed meanwhile resumes it), and :meth:`advance` plans again from
        both modes after it. A ``resumed`` plan does not measure at once: its plain median is
        the persisted one, and the delta/plain ratio must come from steps measured together;
        the first drift check asks the forecast again. A ``sticky`` plan (a drift check's)
        keeps the mode in force unless the other gains
        :data:`~ckptstore.torch.plan.MODE_SWITCH_MARGIN` goodput
        (:func:`~ckptstore.torch.plan.keep_mode`; its notes say so); a resumed process plans
        afresh from the persisted costs."""
        if shared is None:
            shared = self._shared(f"iteration {iteration}, "
                                  f"{'resume' if resumed else 'plan'}")
        costs = self._costs(shared.medians)
        if costs is None:
            return
        modes = (SNAPSHOTS, DELTAS) if self.policy == "auto" else (SNAPSHOTS,)
        fixed = self._fixed()
        notes: tuple[str, ...] = ()
        forecast = None
        if DELTAS in modes and self.replayable and costs.delta_overhead_s is None:
            forecast = forecast_deltas(costs, shared.medians.get("delta_share"), shared.mtbf_s,
                                       shared.budget, fixed=fixed,
                                       measure_steps=self.measure_steps)
            if forecast.pays and not shared.counts.get("deltas_untried", 1):
                forecast = None  # (measured once in this process, without a sample to plan from)
                notes = ("deltas not planned: their measurement gave no delta step to compare",)
            elif forecast.pays and resumed:
                self._forecast_due, forecast = True, None
                notes = ("deltas could pay: they are measured once this process has measured its "
                         "own plain steps",)
            else:
                notes = (str(forecast),)
            modes = (SNAPSHOTS,)
        elif self._forecast is not None and costs.delta_overhead_s is not None:
            # (what the forecast predicted beside what was measured: the forecast's check)
            notes = (f"{self._forecast}; measured: +{1e3 * costs.delta_overhead_s:.1f} ms",)
            if self._stopped_early is not None:  # (said by the plan made then, not later ones)
                (n, low), self._stopped_early = self._stopped_early, None
                notes += (f"deltas measured on {n} steps only: even at +{1e3 * low:.1f} ms (the "
                          f"optimistic end) the plan was of snapshots",)
        new = make_plan(costs, shared.mtbf_s, shared.budget, modes=modes, fixed=fixed,
                        mtbf_source=shared.mtbf_source, budget_source=shared.budget_source)
        kept = keep_mode(new, self.plan.mode) if sticky and self.plan is not None else None
        if kept is not None:
            gain = new.chosen.goodput - kept.goodput
            notes += (f"kept {kept.mode}: {new.mode} would gain {gain:+.4f} goodput, under the "
                      f"{MODE_SWITCH_MARGIN} a re-plan on drifted costs must gain to switch "
                      f"modes",)
            new = make_plan(costs, shared.mtbf_s, shared.budget, modes=(kept.mode,), fixed=fixed,
                            mtbf_source=shared.mtbf_source, budget_source=shared.budget_source)
        if notes:
            new = dataclasses.replace(new, notes=new.notes + notes)
        old, self.plan, self._plan_costs = self.plan, new, dict(shared.medians)
        self.phase, self._since_check = "planned", 0
        if old is None or (old.mode, old.chosen.interval) != (new.mode, new.chosen.interval):
            log.info("Checkpointer %s, from iteration %d on%s%s: %s", self._where, iteration,
                     " (resumed from the persisted plan)" if resumed else "",
                     ' (policy="auto", the default: pass policy= to choose)'
                     if self._defaulted and old is None else "", new)
        self._planned(new)  # (the plan is in force even if the switch below raises)
        if forecast is not None and forecast.pays:
            self._measure_deltas(iteration, forecast)
        elif new.mode != self.mode:
            self._apply(new.mode, iteration, resumed)

    def _measure_deltas(self, iteration: int, forecast: DeltaForecast) -> None:
        """The "deltas" phase, from this step on: ``measure_steps`` delta steps beside the plain
        steps just measured (:meth:`advance` plans again after them), the plan in force
        unchanged meanwhile (its snapshots are not written: the steps write deltas). Once per
        process (a switch that raises is not tried again: the plan stays snapshots)."""
        self._deltas_tried = True
        self._apply(DELTAS, iteration)  # (raises: the mode and the phase stay)
        self._forecast = forecast
        log.info("Checkpointer %s, from iteration %d on: %s", self._where, iteration, forecast)
        self.phase, self._since_check = "deltas", 0

    def _apply(self, mode: str, iteration: int, resumed: bool = False) -> None:
        """Write ``mode`` from ``iteration`` on. Right after a restore (``resumed``) the snapshots
        mode needs no switch: the restored checkpoint is the last one, nothing is captured yet,
        and a snapshot now would only repeat it."""
        if not (resumed and mode == SNAPSHOTS):
            self._switch(mode, iteration, resumed)  # (raises: the mode stays)
        self.mode = mode

    def close(self) -> None:
        """Let the agreement's rank group go (multi-rank job stores)."""
        if self._agreement is not None:
            self._agreement.close()

    def failure_rate(self) -> tuple[float, str]:
        """(MTBF seconds, where it comes from): ``mtbf_s`` when given; else learned
        (:func:`~ckptstore.torch.plan_history.learned_mtbf`) from a job store's epochs, or from
        the restarts this store's persisted plans count; else
        :data:`~ckptstore.torch.plan.DEFAULT_MTBF_S`, assumed."""
        if self.mtbf_s is not None:
            return float(self.mtbf_s), "given"
        if self._mtbf is None:
            if self._job_history is not None:
                restarts, since_ns = self._job_history()
                learned = learned_mtbf(restarts, since_ns, "the job store")
            else:
                learned = learned_mtbf(self.restarts, self.since_ns, "this store (persisted plans)")
            self._mtbf = learned or (DEFAULT_MTBF_S, "assumed: the 24 h default, no failure "
                                                     "history to learn from; pass mtbf_s=")
        return self._mtbf

    # ---- cost samples -------------------------------------------------------------------------
    def snapshot_submitted(self, measured: bool = True) -> None:
        """An asynchronous snapshot was handed to the pipeline (its future then reaches
        :meth:`observe_snapshot`); ``measured`` False: its window is no cost sample (a chain's
        first base, written in a process' first step: that step's time is its warm-up)."""
        self.window.submitted(self._in_step and measured and not self._warming(self._iteration))

    def observe_snapshot(self, fut) -> None:
        """A snapshot's AsyncStats, once it is durable: stall, persist, bytes, write time."""
        self.window.durable()
        if fut.cancelled() or fut.exception() is not None:
            return
        st = fut.result()
        if not getattr(st, "overlap_bytes", 0):  # (overlapped: sampled by StepWriter.await_copy)
            self.meter.add("stall", getattr(st, "stall_s", 0.0))
        self.meter.add("persist", getattr(st, "persist_s", 0.0))
        self.meter.add("snapshot_bytes", getattr(st, "written_bytes", 0) or
                       getattr(st, "snapshot_bytes", 0))
        self.meter.add("load", getattr(st, "write_s", 0.0))
        self._observe_share(getattr(st, "logical_bytes", 0))

    def observe_delta(self, fut) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        st = fut.result()
        self.meter.add("delta_bytes", getattr(st, "written_bytes", 0) or
                       getattr(st, "snapshot_bytes", 0))
        self.meter.add("delta_write", getattr(st, "write_s", 0.0))

    def observe_sync_snapshot(self, stall_s: float, stats: Any, measured: bool = True) -> None:
        """A synchronous snapshot: the whole save stalled training; durable when it returned
        (``measured``: as in :meth:`snapshot_submitted`)."""
        self.window.submitted(self._in_step and measured and not self._warming(self._iteration))
        self.window.durable()
        self.meter.add("stall", stall_s)
        self.meter.add("persist", 0.0)
        self.meter.add("snapshot_bytes", stats.written_bytes)
        self.meter.add("load", stats.seconds)
        self._observe_share(stats.logical_bytes)

    def _observe_share(self, snapshot_logical_bytes: int) -> None:
        """A ``"delta_share"`` sample: the gradients' bytes over a snapshot's logical bytes (what
        each reads), for the forecast of what a delta would cost; only while deltas could be
        planned (policy "auto", an optimizer replay knows)."""
        if self.grad_bytes > 0 and snapshot_logical_bytes > 0 and self.policy == "auto" and \
                self.replayable:
            self.meter.add("delta_share", self.grad_bytes / snapshot_logical_bytes)

    def observe_sync_delta(self, stats: Any) -> None:
        self.meter.add("delta_bytes", stats.written_bytes)
        self.meter.add("delta_write", stats.seconds)


def default_budget(path: str, share: float | None = None) -> tuple[int | None, str]:
    """(bytes, where it comes from): ``share`` (default :data:`DEFAULT_DISK_SHARE`) of the free
    space of ``path``'s filesystem now, or (None, why) when it cannot be read."""
    import shutil
    share = DEFAULT_DISK_SHARE if share is None else share
    try:
        free = shutil.disk_usage(path).free
    except OSError as e:
        return None, f"none: the free space of {path} is unknown ({e})"
    budget = max(1, math.floor(free * share))
    return budget, f"default: {100 * share:.0f}% of the free space at open"
