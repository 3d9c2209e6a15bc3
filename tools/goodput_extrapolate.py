"""The simulator swept on costs measured end to end (``tools/goodput.py --sweep-e2e FILE``).

tools/bench_goodput.py runs every strategy with real SIGKILLs at failure rates of a few hundred
per hour (MTBF 6-20 s), and ``--from-e2e`` (tools/goodput_e2e.py) shows the simulator replays
those jobs within ~0.01 with their measured costs. This module takes those same costs to the
rates a run here cannot reach: a Poisson sweep from 0.01 failures per hour to the measured ones,
each strategy's interval chosen again at each rate, on the run's own model and machine. What each
figure assumes:

* **All-in cost per checkpoint** (:func:`all_in_cost_s`): per job, the stall plus the excess of
  its mean step over its plain step (:func:`goodput_e2e.plain_reference`) times the steps it
  ran per checkpoint (for a fixed interval N: a period of N steps costs ``N x step + stall``;
  for ``policy="auto"`` its measuring steps and snapshots are in it). It holds the background
  work's contention with training (ckptstore's persister, PCcheck-style's writer, DCP's thread)
  for every strategy alike, and is assumed to be a cost per checkpoint, independent of the
  interval (the background work of one checkpoint is the same whether the next comes 6 or 600
  steps later). The slower first steps after a restart are in it too (torch.save, with no
  background work, shows them: its steps ran ~0.5% above plain), charged per checkpoint instead
  of per restart: a small overstatement for every strategy. The median over a strategy's jobs.
* **Interval**: Young/Daly on the all-in cost for torch.save, DCP, PCcheck-style and ckptstore's
  snapshots; ``plan()`` of ckptstore for ``policy="auto"`` (its snapshots' all-in cost from its
  own jobs, measuring phases included, so pessimistic for long jobs; the deltas' overhead from
  the ckpt-deltas jobs, the step ratio less one; their replay from the fitted restores). Deltas
  every iteration keep the measured configuration (a base every ``--base-every``).
* **Persist, load, replay, restart, in flight**: the pooled medians of
  :func:`goodput_e2e.e2e_costs`. The restart is bench_goodput's (a fork of a pre-imported
  process and the model's build, ~0.1 s): a real job's rescheduling costs every strategy the
  same more (``--restart-s`` adds it).
* **Not extrapolated**: the model's size (the run's own model, step and bytes), the machine
  (2 CPU cores, no GPU).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from goodput import (SWEEP_PER_HOUR, RunResult, Scenario, Strategy, apply_mode,  # noqa: E402
                     job_iterations, run_scenario, young_daly_every)
from goodput_e2e import E2ECosts, e2e_costs, plain_reference  # noqa: E402

#: bench_goodput's strategies -> the sweep's names (the simulator's strategies of the same kind)
AS_SWEEP = {"torch.save": "torch.save", "dcp-async": "dcp-async", "pccheck": "pccheck",
            "ckpt-snapshots": "ckptstore-snapshots", "ckpt-deltas": "ckptstore",
            "ckpt-auto": "ckptstore-auto"}
#: the measured rates join the sweep's: up to MTBF 6 s (600 per hour)
EXTRA_PER_HOUR = (100.0, 300.0, 600.0)


def all_in_cost_s(job: dict) -> float | None:
    """A job's cost per checkpoint, all in: ``stall + (steps / checkpoints) x (step - plain)``,
    with ``steps`` every step it ran (its iterations and those a failure made it run again),
    ``step`` the mean of those that wrote no checkpoint (a checkpointing step took ``step +
    stall``). None: no checkpoint was told apart from the other steps (none, or one every step:
    deltas, whose cost is their step's)."""
    if not job.get("checkpoints"):
        return None
    steps = job["iterations"] + job["failures"] * job["lost_it_per_failure"]
    return job["stall_s"] + steps / job["checkpoints"] * (job["step_s"] - plain_reference(job)[0])


@dataclass(frozen=True)
class MeasuredStrategy:
    """One strategy's figures from a bench_goodput run: the pooled costs and the all-in cost
    per checkpoint (median over its jobs; None for deltas every iteration)."""

    name: str
    costs: E2ECosts
    all_in_s: float | None
    jobs: int


def measured(doc: dict) -> dict[str, MeasuredStrategy]:
    """Every strategy of a bench_goodput JSON that the sweep knows and whose steps were timed
    (runs of 2026-11-28 and before timed no delta step: left out), with its measured figures.
    ValueError: a negative all-in cost (steps faster than the plain reference: a run without
    the jobs' own plain steps, before 2026-11-29, against the plain runs beside them)."""
    out: dict[str, MeasuredStrategy] = {}
    for name in dict.fromkeys(j["strategy"] for j in doc["jobs"]):
        if name not in AS_SWEEP:
            continue
        c = e2e_costs(doc, name)
        if not math.isfinite(c.step_ratio):
            continue
        jobs = [j for j in doc["jobs"] if j["strategy"] == name]
        costs = [x for x in map(all_in_cost_s, jobs) if x is not None and math.isfinite(x)]
        all_in = statistics.median(costs) if costs else None
        if all_in is not None and all_in < 0:
            raise ValueError(f"{name}: all-in cost {all_in * 1e3:.1f} ms per checkpoint, below "
                             f"0: its steps ran faster than the plain step they are measured "
                             f"against (a run without the jobs' own plain steps?)")
        out[name] = MeasuredStrategy(name, c, all_in, len(jobs))
    return out


def auto_delta_overhead_s(auto_all_in_s: float, deltas: MeasuredStrategy | None,
                          plain_s: float) -> float | None:
    """What a delta step costs auto's deltas mode: the ckpt-deltas jobs' step ratio less one,
    less the bases they wrote every B steps (priced at auto's snapshot cost: plan() adds its
    own bases back); None without ckpt-deltas jobs or a finite figure."""
    if deltas is None or not deltas.costs.base_every:
        return None
    d = plain_s * (deltas.costs.step_ratio - 1.0) - auto_all_in_s / deltas.costs.base_every
    return max(0.0, d) if math.isfinite(d) else None


def step_plain_s(doc: dict) -> float:
    """The run's plain step: the median of its jobs' plain references."""
    return statistics.median(plain_reference(j)[0] for j in doc["jobs"])


def sweep_strategy(m: MeasuredStrategy, mtbf_s: float, plain_s: float, *,
                   deltas: MeasuredStrategy | None = None, restart_s: float = 0.0) -> Strategy:
    """``m`` at a failure rate of one per ``mtbf_s``: its interval chosen for that rate (see the
    module docstring), its other costs as measured, ``restart_s`` added to its restart. For
    ckpt-auto, ``deltas`` (the ckpt-deltas jobs) gives what its deltas mode would cost: the
    overhead of a delta step (their step ratio less one, less the bases they wrote every B steps,
    which the plan adds back at auto's own snapshot cost), the persist, base load and replay."""
    c = m.costs
    name = AS_SWEEP[m.name]
    base = Strategy(name, 1, plain_s, persist_s=c.persist_s, max_inflight=c.inflight,
                    load_s=c.load_s, restart_s=c.restart_s + restart_s)
    if m.all_in_s is None:  # deltas every iteration, as measured (bases every base_every)
        st = replace(base, step_s=plain_s * c.step_ratio, replay_s=c.replay_s)
        return apply_mode(st, "deltas", c.base_every, delta_inflight=c.inflight)
    snap = replace(base, stall_s=m.all_in_s)
    if m.name != "ckpt-auto":
        return replace(snap, every=young_daly_every(snap.stall_s, mtbf_s, plain_s))
    from ckptstore.torch import plan as ckplan  # (its package imports torch: only when asked)
    overhead = auto_delta_overhead_s(snap.stall_s, deltas, plain_s)
    pc = ckplan.Costs(step_s=plain_s, snapshot_stall_s=snap.stall_s,
                      snapshot_persist_s=snap.persist_s, delta_overhead_s=overhead,
                      replay_s=deltas.costs.replay_s if deltas else 0.0, load_s=snap.load_s,
                      restart_s=snap.restart_s, group_commit=1)
    p = ckplan.plan(pc, mtbf_s)
    if p.mode == "snapshots" or deltas is None:
        return apply_mode(snap, p.mode, p.chosen.interval)
    return apply_mode(snap, p.mode, p.chosen.interval, delta_step_s=plain_s + (overhead or 0.0),
                      delta_persist_s=deltas.costs.persist_s, delta_inflight=deltas.costs.inflight,
                      delta_replay_s=deltas.costs.replay_s, delta_load_s=deltas.costs.load_s)


def rates_per_hour() -> tuple[float, ...]:
    return tuple(sorted(set(SWEEP_PER_HOUR) | set(EXTRA_PER_HOUR)))


def sweep(doc: dict, hours: float, runs: int, seed: int, restart_s: float = 0.0
          ) -> tuple[dict[str, list[tuple[float, RunResult]]], dict[str, list[tuple[float, Strategy]]]]:
    """The Poisson sweep on ``doc``'s measured costs: per sweep strategy, (rate, totals over
    ``runs`` runs of ``hours`` of useful work) and (rate, the strategy simulated there)."""
    ms = measured(doc)
    plain = step_plain_s(doc)
    iterations = job_iterations(hours, plain)
    results: dict[str, list[tuple[float, RunResult]]] = {AS_SWEEP[n]: [] for n in ms}
    chosen: dict[str, list[tuple[float, Strategy]]] = {AS_SWEEP[n]: [] for n in ms}
    for per_hour in rates_per_hour():
        sc = Scenario("sweep", rate_per_hour=per_hour)
        for n, m in ms.items():
            st = sweep_strategy(m, sc.mtbf_s, plain, deltas=ms.get("ckpt-deltas"),
                                restart_s=restart_s)
            results[st.name].append((per_hour, run_scenario(sc, st, iterations, plain, runs, seed)))
            chosen[st.name].append((per_hour, st))
    return results, chosen


def measured_points(doc: dict) -> dict[str, list[tuple[str, float, RunResult]]]:
    """The run's measured goodput per scenario and strategy (means over its repeats; lost work
    per failure over its failures) for the plot's markers, each at the failure rate its jobs
    met (failures over their wall time: a 10 s job at MTBF 6 s meets 0 to 3 failures, so the
    scenario's nominal rate says little). A group without a failure has no rate: left out."""
    out: dict[str, list[tuple[str, float, RunResult]]] = {}
    groups: dict[tuple[str, str], list[dict]] = {}
    for j in doc["jobs"]:
        if j["strategy"] in AS_SWEEP:
            groups.setdefault((j["scenario"], j["strategy"]), []).append(j)
    for (scenario, strategy), js in groups.items():
        # (a kill as the job started, from a schedule before 2026-11-30, is not the job's failure)
        failures = sum(1 for j in js for f in j["failures_detail"] if f["t"] > 0)
        wall = sum(j["wall_s"] for j in js)
        if not failures or not wall > 0:
            continue
        goodput = sum(plain_reference(j)[1] for j in js) / len(js)
        lost = sum(f["lost_s"] for j in js for f in j["failures_detail"] if f["t"] > 0)
        out.setdefault(AS_SWEEP[strategy], []).append(
            (scenario, 3600.0 * failures / wall, RunResult(goodput, 1.0, failures, lost)))
    return out


def report(doc: dict, hours: float, runs: int,
           results: dict[str, list[tuple[float, RunResult]]],
           chosen: dict[str, list[tuple[float, Strategy]]]) -> str:
    """The measured figures, then per rate each strategy's interval and goodput."""
    import harness  # tools/harness.py (tables)
    ms = measured(doc)
    plain = step_plain_s(doc)
    lines = [f"the simulator on the costs bench_goodput measured end to end ({doc.get('date', '?')}, "
             f"{doc.get('machine', '?')}; model {doc['args'].get('model', '?')}): plain step "
             f"{plain * 1e3:.1f} ms, {hours:g} h of useful work, {runs} runs per point, Poisson "
             f"failures; every figure is a median over the strategy's jobs "
             f"(tools/goodput_extrapolate.py says what each assumes)", "", "measured:"]
    for m in ms.values():
        c = m.costs
        cost = (f"all-in {m.all_in_s * 1e3:.1f} ms per checkpoint" if m.all_in_s is not None
                else f"step x{c.step_ratio:.3f} (a delta every step, a base every {c.base_every}), "
                     f"replay {c.replay_s * 1e3:.0f} ms per delta")
        lines.append(f"  {AS_SWEEP[m.name]} ({m.name}, {m.jobs} jobs): {cost}, persist "
                     f"{c.persist_s * 1e3:.0f} ms, load {c.load_s:.3f} s, restart "
                     f"{c.restart_s:.3f} s, in flight {c.inflight}")
    left = [n for n in dict.fromkeys(j["strategy"] for j in doc["jobs"]) if n not in ms]
    if left:
        lines.append(f"  left out: {', '.join(left)} (not a strategy the sweep knows, or no "
                     f"step time in this run)")
    auto, deltas = ms.get("ckpt-auto"), ms.get("ckpt-deltas")
    overhead = None if auto is None or auto.all_in_s is None else \
        auto_delta_overhead_s(auto.all_in_s, deltas, plain)
    if overhead is not None and deltas is not None:
        lines.append(f"  ckptstore-auto's deltas mode: +{overhead * 1e3:.2f} ms a step "
                     f"(ckpt-deltas' step less its bases, every {deltas.costs.base_every}, at "
                     f"auto's snapshot cost: plan() adds its own bases back), base load "
                     f"{deltas.costs.load_s:.3f} s, replay {deltas.costs.replay_s * 1e3:.0f} ms "
                     f"per delta")
    names = list(results)
    peers = [s for s in names if s in ("torch.save", "dcp-async", "pccheck")]
    rows = []
    for k, (rate, _) in enumerate(next(iter(results.values()))):
        row = [f"{rate:.3g}"]
        for s in names:
            st, r = chosen[s][k][1], results[s][k][1]
            every = f"{st.every}" + (f"/b{st.base_every}" if st.base_every else "")
            row.append(f"{r.goodput:.4f} ({every})")
        if "ckptstore-auto" in results and peers:
            best = max(peers, key=lambda s: results[s][k][1].goodput)
            row.append(f"{results['ckptstore-auto'][k][1].goodput - results[best][k][1].goodput:+.4f}"
                       f" ({best})")
        rows.append(row)
    auto = ["auto - best peer"] if "ckptstore-auto" in results and peers else []
    lines += ["", "goodput (every: iterations between checkpoints; /bB: deltas, a base every B):",
              harness.table(["failures/h", *names, *auto], rows, left=None)]
    return "\n".join(lines)
