"""Whether deltas could pay, before one is measured (issue 30).

Measuring deltas costs training: ``measure_steps`` delta steps, each slower than a plain one by
the very overhead being measured (+10 to +35 ms a step on a 2-core VM, 1.5-2.5% of a 9-second
job end to end), and two switches of the write path. Most plans never use them: a delta every
iteration pays only where failures are frequent and a delta is cheap. So
:class:`~ckptstore.torch.auto_policy.AutoPolicy` measures snapshots first and asks
:func:`forecast_deltas` whether deltas could beat the snapshot plan at all:

* **break-even**: the largest delta overhead (seconds a step) at which the deltas option's best
  goodput still reaches the snapshot plan's, by bisection (each interval's goodput falls as the
  overhead grows, so their best does too; only the persist bound on the interval,
  ``ceil(persist / step)``, loosens as the step grows, and where it binds the bisection finds a
  crossing, not necessarily the last); 0 when even free deltas lose;
* **floor**: the least a delta step is predicted to cost, from what a snapshot was measured to
  cost training (its stall plus slowdown, :attr:`~ckptstore.torch.plan.Costs.snapshot_cost_s`)
  per byte it reads, times the bytes a delta reads (the gradients: ``delta_share``, their bytes
  over a snapshot's logical bytes), times :data:`DELTA_FLOOR_PER_BYTE`.

Deltas are measured only when ``floor < break-even`` and the measurement would pay for itself
within one MTBF (the expected life of this process: the measurement is persisted with the plan
after it, so the real horizon is longer): deltas at the floor must gain, over ``mtbf_s``
seconds, more than measuring them costs, ``measure_steps`` delta steps at the floor plus the two
switches of the write path (a base to start the chain, a snapshot to leave it), each a
snapshot's cost, less the snapshots the plan would have written in those steps. Where the floor
sits far below the break-even the gain is large and the rule measures; it skips the measurements
whose best case gains less than they cost.

The floor's assumption is that a delta's background work per gradient byte (capture, hash,
compress, append: a lossy codec encodes every byte first) costs training at least half what a
snapshot's costs per state byte. Measured on the 2-core VM (bench_goodput, AdamW, 2026-11-29):
with a 27M GPT a snapshot cost 12-61 ms all in for ~3x the gradients' bytes and deltas +10 to
+35 ms a step; with the 4.5M one, in 14 jobs that measured both, the delta overhead was 1.4 to
7.8 times the floor (0.7 to 3.9 times a snapshot's cost per byte), and once +0.2 ms, a noisy
measurement whose margin held it to snapshots. A floor above the truth would leave deltas
unmeasured where they pay; the factor keeps it below what was seen.

Pure arithmetic on :class:`~ckptstore.torch.plan.Costs`; no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .plan import DELTAS, SNAPSHOTS, Costs, plan

#: a delta step costs training at least this share of a snapshot's cost per byte, per gradient byte
DELTA_FLOOR_PER_BYTE = 0.5
#: bisection steps for the break-even overhead (its bracket halves each time)
_BISECTIONS = 40


@dataclass(frozen=True)
class DeltaForecast:
    """What :func:`forecast_deltas` found. ``pays``: deltas are worth measuring
    (``floor_s < breakeven_s`` and ``gain_s > measure_cost_s``); ``floor_s``: the least a delta
    step is predicted to cost beyond a plain one; ``breakeven_s``: the most it may cost and still
    reach the snapshot plan's goodput (0: deltas lose even free); ``delta_share``: the gradients'
    bytes over a snapshot's (None: not measured, the floor is then 0); ``gain_s``: the training
    time deltas at the floor would gain over one MTBF (0 when they would not);
    ``measure_cost_s``: what measuring them is predicted to cost training."""

    pays: bool
    floor_s: float
    breakeven_s: float
    delta_share: float | None
    gain_s: float = 0.0
    measure_cost_s: float = 0.0

    def __str__(self) -> str:
        if self.breakeven_s <= 0:
            why = "they would lose to snapshots even at no cost"
        else:
            why = f"they would pay only under +{1e3 * self.breakeven_s:.2f} ms a step"
        floor = ("" if self.delta_share is None else
                 f", and a delta is predicted to cost at least +{1e3 * self.floor_s:.2f} ms "
                 f"({DELTA_FLOOR_PER_BYTE:g} x a snapshot's cost per byte x the gradients' "
                 f"{100 * self.delta_share:.0f}% of its bytes)")
        if self.floor_s < self.breakeven_s:
            floor += (f"; at {'that cost' if self.delta_share is not None else 'no cost'} "
                      f"they would gain {1e3 * self.gain_s:.0f} ms per MTBF "
                      f"{'over' if self.pays else 'under'} the "
                      f"{1e3 * self.measure_cost_s:.0f} ms measuring them costs")
        verdict = "measuring deltas" if self.pays else "deltas not measured"
        return f"{verdict}: {why}{floor}"


def with_deltas(costs: Costs, share: float, overhead_s: float) -> Costs:
    """``costs`` with deltas costing ``overhead_s`` a step, their bytes and replay estimated from
    the snapshot's (a delta holds ``share`` of a snapshot's bytes; replaying one reads that much
    on top of an optimizer step)."""
    return replace(costs, delta_overhead_s=overhead_s, delta_overhead_margin_s=0.0,
                   delta_bytes=int(share * costs.snapshot_bytes),
                   replay_s=costs.replay_s + share * costs.load_s)


def forecast_deltas(costs: Costs, delta_share: float | None, mtbf_s: float,
                    disk_budget: int | None = None, *, fixed: dict[str, int] | None = None,
                    measure_steps: int = 8) -> DeltaForecast:
    """Whether deltas could beat the snapshot plan for ``costs`` (whose deltas are unmeasured:
    ``delta_overhead_s`` is ignored) under failures every ``mtbf_s`` seconds, by more than
    measuring them (``measure_steps`` delta steps) costs (see the module docstring). ``fixed``:
    as for :func:`~ckptstore.torch.plan.plan` (an explicit ``snapshot_every``). Pure;
    ValueError for bad costs or MTBF, as :func:`plan` raises."""
    base = replace(costs, delta_overhead_s=None, delta_overhead_margin_s=0.0)
    snaps = plan(base, mtbf_s, disk_budget, modes=(SNAPSHOTS,), fixed=fixed)
    share = max(0.0, delta_share) if delta_share is not None else 0.0

    def gain(overhead_s: float) -> float:
        """Goodput deltas at ``overhead_s`` gain over the snapshot plan (<= 0: none)."""
        option = plan(with_deltas(base, share, overhead_s), mtbf_s, disk_budget,
                      modes=(DELTAS,)).chosen
        if not (option.fits or not snaps.chosen.fits):
            return 0.0
        return option.goodput - snaps.goodput

    floor = DELTA_FLOOR_PER_BYTE * base.snapshot_cost_s * share
    # (the two switches write a snapshot each, less those the plan writes in the steps measured)
    extra_snapshots = max(0.0, 2.0 - measure_steps / snaps.chosen.interval)
    measure_cost = measure_steps * floor + extra_snapshots * base.snapshot_cost_s
    if gain(0.0) <= 0:
        return DeltaForecast(False, floor, 0.0, delta_share, 0.0, measure_cost)
    lo, hi = 0.0, base.step_s
    while gain(hi) > 0 and hi < 1e3 * base.step_s:
        lo, hi = hi, 2 * hi
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
    gained = max(0.0, gain(floor)) * mtbf_s if floor < lo else 0.0
    return DeltaForecast(floor < lo and gained > measure_cost, floor, lo, delta_share, gained,
                         measure_cost)
