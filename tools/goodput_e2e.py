"""Calibration of the goodput simulator against end-to-end runs (``tools/goodput.py --from-e2e
FILE``): tools/bench_goodput.py trains for real and SIGKILLs the trainer; its JSON keeps every
job. Each job is simulated (:func:`goodput.simulate`) on the very failure schedule it ran
under, with its strategy's costs pooled over its jobs and with its own, and the report sets the
simulated goodput beside the measured one (tools/goodput.py's docstring, "Calibration").
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (tools/harness.py: tables)
from goodput import (DEFAULT_TRACES, Scenario, Strategy, apply_mode, compress_trace,  # noqa: E402
                     load_trace, simulate)

#: PCcheck-style and ckptstore pipelines: checkpoints in flight before training waits
E2E_INFLIGHT = {"pccheck": None, "ckpt-deltas": 4, "ckpt-topk": 4, "ckpt-snapshots": 1}


def e2e_scenarios(doc: dict, trace_dir: str | os.PathLike | None = None) -> dict[str, Scenario]:
    """bench_goodput's scenarios, rebuilt from its JSON's arguments (by name): each trace
    compressed to ``trace_mtbf``, Poisson at each of ``poisson_mtbf``. Same names, same draws."""
    args = doc["args"]
    tdir = Path(trace_dir or args["trace_dir"])
    out: dict[str, Scenario] = {}
    for name in args["traces"]:
        tr = compress_trace(load_trace(tdir / name), args["trace_mtbf"])
        sc = Scenario(f"{tr.name} (MTBF {args['trace_mtbf']:g} s)", trace=tr)
        out[sc.name] = sc
    for m in args["poisson_mtbf"]:
        sc = Scenario(f"Poisson (MTBF {m:g} s)", rate_per_hour=3600.0 / m)
        out[sc.name] = sc
    return out


def _median(xs: Iterable[float]) -> float:
    v = sorted(x for x in xs if x is not None and math.isfinite(x))
    if not v:
        return math.nan
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


def fit_replay(loads: Sequence[tuple[int, float]], base_every: int) -> tuple[float, float]:
    """Least-squares ``load = base + replay * (D mod base_every)`` over measured restores
    ``(D, seconds)``; both clamped at >= 0. One distinct D: (its mean, 0)."""
    pts = [(d % base_every, s) for d, s in loads]
    if not pts:
        return 0.0, 0.0
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return max(0.0, my), 0.0
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / sxx)
    return max(0.0, my - slope * mx), slope


@dataclass(frozen=True)
class E2ECosts:
    """One strategy's costs as bench_goodput measured them, pooled over its jobs (medians):
    step ratio to each job's plain step (:func:`plain_reference`), stall per checkpoint, persist
    (end of the checkpointing step to durable), load (or base load + replay per delta), restart
    (failure to training again, minus the load)."""

    strategy: str
    step_ratio: float
    stall_s: float
    persist_s: float
    load_s: float
    replay_s: float
    restart_s: float
    base_every: int
    inflight: int


def plain_reference(job: dict) -> tuple[float, float]:
    """A job's plain step and its goodput against it: the job's own plain steps where it has
    enough of them (bench_goodput's ``step_plain_in_job_s``, since 2026-11-29: immune to the
    machine's drift between the job and the plain runs beside it), else those plain runs'."""
    own = job.get("step_plain_in_job_s")
    if isinstance(own, (int, float)) and math.isfinite(own) and own > 0:
        return own, job["goodput_in_job"]
    return job["step_plain_s"], job["goodput"]


def e2e_costs(doc: dict, strategy: str, job: dict | None = None) -> E2ECosts:
    """Pool the jobs of ``strategy`` in a bench_goodput JSON into :class:`E2ECosts` (medians);
    with ``job``, that job's own figures instead wherever it has them (a job without failures
    has no load or restart of its own: the pooled ones)."""
    jobs = [j for j in doc["jobs"] if j["strategy"] == strategy]
    if not jobs:
        raise ValueError(f"no job of strategy {strategy!r} in the e2e file")
    args = doc["args"]
    deltas = strategy in ("ckpt-deltas", "ckpt-topk")
    base_every = int(args["base_every"]) if deltas else 0
    own = [job] if job is not None else jobs

    def pooled_or_own(fn, pick):
        v = fn([j for j in own if pick(j)])
        return v if not math.isnan(v) or job is None else fn([j for j in jobs if pick(j)])

    def fit(js):
        # (a restore of iteration 0, before anything was durable, loads nothing or next to it:
        # ~0 s that would pull a median of real loads towards 0; none left: the pooled load)
        loads = [(d, s) for j in js for d, s in j["loads"] if d > 0]
        if not loads:
            return math.nan, math.nan
        return fit_replay(loads, base_every) if deltas else (_median(s for _, s in loads), 0.0)

    load, replay = fit(own)
    if math.isnan(load):
        load, replay = fit(jobs)
    restart = pooled_or_own(lambda js: _median(j["resume_s_per_failure"] - j["load_s"] for j in js),
                            lambda j: j["failures"])
    stall = pooled_or_own(lambda js: _median(j["stall_s"] for j in js), lambda j: j["checkpoints"])
    inflight = E2E_INFLIGHT.get(strategy, 1) or int(args["inflight"])
    return E2ECosts(strategy, _median(j["step_s"] / plain_reference(j)[0] for j in own),
                    0.0 if math.isnan(stall) else max(0.0, stall),
                    max(0.0, _median(j["persist_s"] for j in own)),
                    0.0 if math.isnan(load) else load, 0.0 if math.isnan(replay) else replay,
                    0.0 if math.isnan(restart) else max(0.0, restart), base_every, inflight)


def e2e_strategy(c: E2ECosts, job: dict) -> Strategy:
    """The simulator's strategy for one e2e job: its N (ckpt-auto: the mode and interval of the
    last plan the job logged), the pooled costs of its strategy, its own plain step
    (:func:`plain_reference`)."""
    st = Strategy(c.strategy, job["every"] or 1, plain_reference(job)[0] * c.step_ratio,
                  stall_s=c.stall_s, persist_s=c.persist_s, max_inflight=c.inflight,
                  load_s=c.load_s, replay_s=c.replay_s, base_every=c.base_every,
                  restart_s=c.restart_s)
    if c.strategy == "ckpt-auto" and job["plans"]:
        last = job["plans"][-1]
        return apply_mode(st, last["mode"], int(last["interval"]))
    if st.every == 1 and st.base_every:
        return apply_mode(st, "deltas", st.base_every, delta_inflight=c.inflight)
    return st


def calibrate_e2e(doc: dict, trace_dir: str | os.PathLike | None = None) -> list[dict]:
    """Simulate every job of a bench_goodput JSON with its strategy's pooled measured costs,
    its own plain step and iterations, and the very failure schedule it ran under (rebuilt from
    the seed; checked against the times the job recorded). One dict per job: e2e and simulated
    goodput, lost work and resume per failure, failures."""
    scenarios = e2e_scenarios(doc, trace_dir)
    seed = int(doc["args"]["seed"])
    costs = {s: e2e_costs(doc, s) for s in dict.fromkeys(j["strategy"] for j in doc["jobs"])}
    unmeasured = [s for s, c in costs.items() if not math.isfinite(c.step_ratio)]
    if unmeasured:  # (bench_goodput JSON of 2026-11-28 and before: no step time for deltas)
        print(f"goodput: left out, no step time measured in the e2e file: {', '.join(unmeasured)}",
              file=sys.stderr)
    out = []
    for j in doc["jobs"]:
        if j["strategy"] in unmeasured:
            continue
        sc = scenarios[j["scenario"]]
        # (a run before 2026-11-30 may hold a time at or before 0, a kill as the job started,
        # which failure_times no longer gives: the simulation leaves it out)
        recorded = [t for t in j["schedule_s"] if t > 0]
        times = list(itertools.islice(sc.failure_times(seed, j["repeat"]), len(recorded)))
        if len(times) != len(recorded) or any(abs(a - b) > 1e-6 for a, b in zip(times, recorded)):
            raise ValueError(f"{j['scenario']}, repeat {j['repeat']}: the rebuilt failure schedule "
                             f"differs from the one the job recorded")
        st = e2e_strategy(costs[j["strategy"]], j)
        plain, e2e = plain_reference(j)
        r = simulate(st, j["iterations"], plain, sc.failure_times(seed, j["repeat"]))
        own = simulate(e2e_strategy(e2e_costs(doc, j["strategy"], j), j), j["iterations"],
                       plain, sc.failure_times(seed, j["repeat"]))
        # where in its checkpoint interval a failure lands is a draw of its own (uniform over
        # W = every x step + stall, sd W / sqrt(12)); the e2e run made one draw per failure, the
        # simulation another: the goodputs differ by about this much from that alone
        w = st.every * st.step_s + st.stall_s
        phase = math.sqrt(2 * max(1, j["failures"])) * w / math.sqrt(12) / (j["wall_s"] or math.inf)
        out.append({"scenario": j["scenario"], "strategy": j["strategy"], "repeat": j["repeat"],
                    "e2e": e2e, "sim": r.goodput, "sim_own": own.goodput, "phase_sd": phase,
                    "e2e_failures": j["failures"],
                    "killed_at_start": len(j["schedule_s"]) - len(recorded),
                    "sim_failures": r.failures, "e2e_lost_s": j["lost_s_per_failure"],
                    "sim_lost_s": r.lost_per_failure_s, "e2e_resume_s": j["resume_s_per_failure"],
                    "sim_resume_s": r.resume_per_failure_s, "strategy_costs": st})
    return out


def e2e_means(doc: dict, rows: list[dict]) -> list[dict]:
    """:func:`calibrate_e2e`'s rows grouped per scenario and strategy (scenarios in the order of
    the rows, strategies in the file's order): the means over repeats of the measured ("e2e"),
    simulated ("sim": pooled costs) and "own" (each job's own costs) goodput, and the rows."""
    groups: dict[tuple[str, str], list[dict]] = {}
    order = {s: k for k, s in enumerate(doc.get("args", {}).get("strategies", []))}
    scen = {s: k for k, s in enumerate(dict.fromkeys(r["scenario"] for r in rows))}
    for r in sorted(rows, key=lambda r: (scen[r["scenario"]], order.get(r["strategy"], 99))):
        groups.setdefault((r["scenario"], r["strategy"]), []).append(r)
    return [{"scenario": sc, "strategy": st, "rows": rs,
             **{k: sum(r[k] for r in rs) / len(rs) for k in ("e2e", "sim", "sim_own")}}
            for (sc, st), rs in groups.items()]


def e2e_report(doc: dict, rows: list[dict]) -> str:
    """The calibration table: per scenario and strategy, mean e2e and simulated goodput over the
    repeats and their difference, then the costs used per strategy."""
    table = []
    for g in e2e_means(doc, rows):
        rs, e2e, sim, own = g["rows"], g["e2e"], g["sim"], g["sim_own"]
        phase = math.sqrt(sum(r["phase_sd"] ** 2 for r in rs)) / len(rs)
        table.append([g["scenario"], g["strategy"], f"{e2e:.3f}", f"{sim:.3f}", f"{sim - e2e:+.3f}",
                      f"{own:.3f}", f"{own - e2e:+.3f}", f"{phase:.3f}",
                      f"{sum(r['e2e_failures'] for r in rs)}/{sum(r['sim_failures'] for r in rs)}",
                      f"{sum(r['e2e_lost_s'] for r in rs) / len(rs):.2f}/"
                      f"{sum(r['sim_lost_s'] for r in rs) / len(rs):.2f}",
                      f"{sum(r['e2e_resume_s'] for r in rs) / len(rs):.2f}/"
                      f"{sum(r['sim_resume_s'] for r in rs) / len(rs):.2f}"])
    errs = [abs(float(t[4])) for t in table]
    errs_own = [abs(float(t[6])) for t in table]
    lines = [f"simulator vs bench_goodput ({doc.get('date', '?')}, {doc.get('machine', '?')}): the "
             f"same jobs, failure schedules and plain steps (each job's own plain steps where "
             f"it has them, else the plain runs beside it), means over repeats; 'sim': costs "
             f"pooled per strategy (medians over its jobs), 'own': each job's own costs; 'phase "
             f"sd': how far apart the two would be from where failures land in a checkpoint "
             f"interval alone (sd of the difference of two uniform draws per failure)", "",
             harness.table(["scenario", "strategy", "e2e goodput", "sim", "sim - e2e", "own",
                           "own - e2e", "phase sd", "failures e2e/sim", "lost s e2e/sim", "resume s e2e/sim"],
                          table, left=None), "",
             f"|sim - e2e|: mean {sum(errs) / len(errs):.3f}, max {max(errs):.3f}, within 0.01: "
             f"{sum(e <= 0.01 for e in errs)} of {len(errs)}; |own - e2e|: mean "
             f"{sum(errs_own) / len(errs_own):.3f}, max {max(errs_own):.3f}, within 0.01: "
             f"{sum(e <= 0.01 for e in errs_own)} of {len(errs_own)}"]
    at_start = sum(r["killed_at_start"] for r in rows)
    if at_start:
        lines.append(f"{at_start} job(s) were killed as they started (a failure the schedule "
                     f"placed before the job's start, given until 2026-11-30): counted in "
                     f"'failures e2e', left out of the simulation")
    lines += ["", "pooled costs per strategy:"]
    seen = set()
    for r in rows:
        c = e2e_costs(doc, r["strategy"])
        if c.strategy in seen:
            continue
        seen.add(c.strategy)
        lines.append(f"  {c.strategy}: step x{c.step_ratio:.3f}, stall {c.stall_s * 1e3:.1f} ms, "
                     f"persist {c.persist_s * 1e3:.0f} ms, load {c.load_s:.3f} s"
                     + (f" + {c.replay_s * 1e3:.0f} ms/delta (base every {c.base_every})"
                        if c.base_every else "")
                     + f", restart {c.restart_s:.3f} s, in flight {c.inflight}")
    return "\n".join(lines)
