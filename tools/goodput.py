#!/usr/bin/env python3
"""goodput: replay failure traces against checkpoint strategies, side by side (issue 17, section 3).

For each failure scenario (public preemption traces, a Poisson failure model) and each strategy the
tool simulates a job of fixed useful work and reports goodput (useful training time / wall time),
the work lost per failure and the time to resume. Costs are measured ones, read from a JSON cost
file (default ``tools/goodput_costs.json``, every figure copied from docs/performance.md with its
source); the tool prints the figures it used and how it derived each strategy's costs from them,
then one Markdown table (a row per scenario and strategy) and, with ``--plot``, a PNG.

    python tools/goodput.py                                  # the default run, table on stdout
    python tools/goodput.py --plot docs/goodput.png          # + goodput and lost work vs failure rate
    python tools/goodput.py --plot docs/goodput.png --e2e tools/data/goodput-e2e-2026-11-28.json
    python tools/goodput.py --gpus 4096 --strategies torch.save,ckptstore --hours 24
    python tools/goodput.py --from-bench core.json           # throughputs from bench_core.py --json
    python tools/goodput.py --from-e2e e2e.json              # calibrate against bench_goodput.py --json
    python tools/goodput.py --sweep-e2e e2e.json --plot p.png  # sweep on that run's measured costs

Model (a discrete-event simulation; every time below is wall-clock seconds)
--------------------------------------------------------------------------
* **Job.** ``I`` iterations of useful work, ``I = ceil(hours * 3600 / step_plain)``, where
  ``step_plain`` is the measured step of training without checkpoints. Useful time is
  ``I * step_plain``; the wall time is when iteration ``I`` completes (there is no final
  checkpoint). Goodput = useful / wall, pooled over the runs (sums of useful over sums of wall).
* **Steps.** Under a strategy an iteration takes ``step_plain * ratio``: ratio 1 for torch.save, DCP
  and PCcheck (their medians in bench_async equal plain training: background work is not charged
  to their steps), the measured ratio for ckptstore (it includes the background persister's
  contention and a base every 30 iterations).
* **Checkpoints.** Requested after every iteration that is a multiple of ``N``, counted from the
  start of the job (so a resumed job keeps the same schedule). At a request: if ``K`` checkpoints
  are requested but not yet durable, training waits until the oldest one is; then training stalls
  ``stall``; then the checkpoint is persisted for ``persist`` seconds of the storage device, which
  persists checkpoints one after another in request order (concurrent checkpoints share one disk's
  bandwidth: no faster in aggregate). A checkpoint is **durable** when its persistence ends; with
  ``persist = 0``, at the end of its stall.

  ===================  =======================  ==========================  ==================  ===
  strategy             N                        stall                       persist             K
  ===================  =======================  ==========================  ==================  ===
  torch.save           Young/Daly on the stall  torch.save + fsync          0                   1
  dcp-async            Young/Daly on the stall  async_save's blocking part  until done          1
  pccheck              Young/Daly on the stall  copy into staging buffers   bytes / disk fsync  4
  ckptstore            group commit (10)        0 (inside the step ratio)   last delta's write  1
  ckptstore+follower   group commit (10)        0                           last delta's write  1
  ckptstore-snapshots  Young/Daly on the stall  pccheck's x measured ratio  bytes / ckptstore   1
  ckptstore-auto       plan() at the MTBF       snapshots: as above         as above            1
                       or deltas: group 1,      0 (a base's spread over B)  last delta's write  4
                       a base every B
  ===================  =======================  ==========================  ==================  ===

  ckptstore-snapshots: ``Checkpointer(policy="snapshots")``'s overlapped async snapshots. Their
  all-in cost per snapshot (stall, waits, the persister's CPU taken from training) was measured
  beside a PCcheck-style baseline on the same model and machine (tools/bench_snapshot.py): the
  stall here is the PCcheck-style stall this tool uses times that ratio. ckptstore-auto:
  ``Checkpointer(policy="auto")``, the mode and interval that ``ckptstore.torch.plan.plan()``
  itself chooses at the scenario's MTBF from the same figures (the delta step without bases,
  the snapshot stall as a base's), as if it had planned from the start (no measuring phase).

  Young/Daly: ``N = max(1, round(sqrt(2 * C * MTBF) / step))`` with ``C`` the strategy's stall and
  MTBF the scenario's mean time between failures (1 / rate; a trace's duration over its failures).
* **Failures.** At a failure at time ``tf`` the job resumes from ``D``, the last checkpoint durable
  at or before ``tf`` (the initial state, iteration 0, counts as durable); checkpoints still in flight are lost (DCP: a failure inside the background
  window loses that checkpoint; ckptstore: one inside a group loses the group). **Lost work** is
  ``tf`` minus the moment training went on after ``D`` (the end of ``D``'s stall, or the end of the
  resume that restored ``D``): computation, stalls and waits thrown away.
* **Resume.** ``restart + load`` (no load when ``D`` is the initial state: the peers load
  nothing then, ckptstore its empty initial base, 0.03-0.05 s in bench_goodput's runs, left
  out), then training continues at iteration ``D + 1``. ``restart``
  (scheduling, process start, rendezvous) is not measured here: ``--restart-s``, 0 by default, the
  same for every strategy. Load: torch.save and PCcheck a torch.load of the full checkpoint (cold);
  DCP its cold load; ckptstore the base load plus ``D mod base_every`` deltas replayed (bases every
  ``base_every`` iterations, durable with the group they fall in); with a follower (a replica that
  replays each committed delta as it lands, on other hardware, at no cost to training), about one
  base load: the follower's state at ``D``. A failure during a resume starts the resume again; it
  counts as a failure that loses no work. Time to resume = the mean of the resume costs charged
  per failure.
* **Scenarios.** Poisson: exponential times between failures at a per-job rate; by default the
  LLaMA 3 rate (419 interruptions in 54 days on 16,384 GPUs) scaled to ``--gpus``. Traces: Bamboo
  (``t_ms,add|remove,nodeN``): each distinct time with a removal is one failure of the job;
  PCcheck (``,Time,GPUs``): each row with fewer GPUs than the row before is one failure. Additions
  are not failures, capacity for the restart is assumed (the job keeps its size; periods with no
  GPUs are ignored), the trace repeats cyclically over its duration (first to last row), and each
  run starts at a random offset in it. Both traces are sampled on a grid (60 s, 63 s): a failure is
  placed uniformly within the grid step before its row (otherwise a checkpoint period that divides
  the grid step would see every failure at the same phase).
* **Determinism.** Runs ``r = 0..runs-1`` draw from ``random.Random(seed * 100003 + r)``; a Poisson
  run scales the same unit-rate draws by the rate, so every rate sees the same failure pattern.
* **Calibration (``--from-e2e FILE``, tools/goodput_e2e.py).** tools/bench_goodput.py trains for real and SIGKILLs the
  trainer on the same scenarios compressed in time; its JSON keeps every job. ``--from-e2e``
  simulates each job again (its iterations, its plain step: the mean of its own steps that ran
  as plain training where it has enough of them, else the plain runs' beside it; the very failure
  schedule it ran under: rebuilt from the seed and checked against the times the job recorded)
  with costs pooled per strategy over its jobs (medians), and prints simulated against measured
  goodput. What each figure assumes:

  - *step*: the job's plain step x the median ratio of the strategy's mean step (steps that wrote
    no checkpoint; deltas are such steps, so their overhead and the background persister's
    contention are in it, as are the slower first steps after a restart) to the plain step;
  - *stall*: the mean checkpointing step minus the mean other step (DCP: the blocking part,
    PCcheck-style: the copy plus any wait for a staging buffer); for deltas the bases' stall is
    spread over the ``base_every`` steps instead (they come every B steps, not every N);
  - *persist*: the median from a checkpointing step's end to its durability event (0 for
    torch.save, synchronous); the disk persists one checkpoint after another;
  - *in flight*: PCcheck-style K (``--inflight``), 4 for ckptstore deltas (its pipeline's
    ``max_inflight``), 1 otherwise;
  - *load*: the median restore time, or for deltas the least-squares fit of
    ``base load + replay x (D mod base_every)`` over the restores (bases assumed at multiples
    of B: a restart continues its chain);
  - *restart*: the median per job of (mean resume per failure - mean load): the kill, a fork of
    the pre-imported zygote (or a cold interpreter with ``--cold``), the model build; a failure
    during a resume restarts it, as below;
  - *ckpt-auto*: the mode and interval of the last plan the job logged, as if it had run from the
    start; its measuring phases (8 plain steps and 3 snapshots, then 8 delta steps only where the
    forecast says deltas could pay, again in every new process that has no persisted plan) are in
    the pooled step ratio only as an average.

  Nothing else is fitted: a gap between the two columns is what the model leaves out.
* **Not modelled.** GPUs (every figure is from a 2-core CPU VM), contention of DCP's and PCcheck's
  background persistence with training (ckptstore's snapshots carry theirs relative to PCcheck's),
  the extra persistence time of a ckptstore base (345 MiB against a 104 MiB delta) before its group
  is durable, what a follower costs, auto's measuring steps, and correlated failures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goodput_plot  # noqa: E402  (tools/goodput_plot.py: the sweep's figure and table)
import harness  # noqa: E402  (tools/harness.py: the benchmarks' tables)
from goodput_traces import (LLAMA3_DAYS, LLAMA3_GPUS, LLAMA3_INTERRUPTIONS,  # noqa: E402,F401
                            Scenario, Trace, TraceFormatError, check_rate, compress_trace,
                            llama3_rate_per_hour, load_trace, load_traces, parse_bamboo_trace,
                            parse_pccheck_trace, poisson_failure_times, trace_failure_times)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_COSTS = Path(__file__).resolve().parent / "goodput_costs.json"
DEFAULT_TRACES = ROOT.parent / "shared" / "traces"


STRATEGIES = ("torch.save", "dcp-async", "pccheck", "ckptstore", "ckptstore+follower",
              "ckptstore-snapshots", "ckptstore-auto")
#: failure rates (per hour) of the plot's Poisson sweep
SWEEP_PER_HOUR = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)


# ---- costs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    source: str


class Costs:
    """The figures of a cost file; records which ones the strategies read (``used``)."""

    def __init__(self, figures: dict[str, Figure], origin: str) -> None:
        self.figures = figures
        self.origin = origin
        self.used: set[str] = set()

    def __getitem__(self, name: str) -> float:
        if name not in self.figures:
            raise ValueError(f"{self.origin}: figure {name!r} is missing")
        self.used.add(name)
        return self.figures[name].value


def load_costs(path: str | os.PathLike) -> Costs:
    """Read a cost file: ``{"figures": {name: {"value": number > 0, "unit": str, "source": str}}}``."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    figs = doc.get("figures") if isinstance(doc, dict) else None
    if not isinstance(figs, dict):
        raise ValueError(f"{path}: no 'figures' object")
    out = {}
    for name, fig in figs.items():
        value = fig.get("value") if isinstance(fig, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf \
                or not isinstance(fig.get("source"), str):
            raise ValueError(f"{path}: figure {name!r} needs a positive numeric 'value' and a 'source'")
        out[name] = Figure(float(value), str(fig.get("unit", "")), fig["source"])
    return Costs(out, str(path))


def costs_from_bench(costs: Costs, path: str | os.PathLike) -> tuple[Costs, list[str]]:
    """Override the throughput figures that ``tools/bench_core.py --json FILE`` measured (save and
    cold-load GB/s of ckptstore, DCP and torch, the disk's fsync'd bandwidth). The other figures
    (step times, ratios, restore) come from benchmarks without a JSON output and stay.
    Returns the new costs and the names of the figures replaced."""
    with open(path) as f:
        try:
            doc = json.load(f)
            agg, ops = doc["aggregate"], doc["aggregate"]["ops"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}: not a bench_core.py --json file (no aggregate.ops)") from None
    env = doc.get("environment")
    version = env.get("ckptstore", "?") if isinstance(env, dict) else "?"
    src = f"{path} (bench_core --json, ckptstore {version})"
    figs = dict(costs.figures)
    changed: list[str] = []

    def gbps(key: str) -> float | None:
        op = ops.get(key) if isinstance(ops, dict) else None
        v = op.get("gbps") if isinstance(op, dict) else None
        return float(v) if isinstance(v, (int, float)) and v > 0 else None

    def put(name: str, value: float, how: str) -> None:
        figs[name] = Figure(value, figs[name].unit if name in figs else "", f"{src}: {how}")
        changed.append(name)

    ck_save, dcp_save = gbps("save:ckptstore"), gbps("save:dcp")
    ck_load, dcp_load = gbps("load:ckptstore:cold"), gbps("load:dcp:cold")
    torch_load = gbps("load:torch:cold")
    if ck_save:
        put("ckptstore_save_gbps", ck_save, "aggregate.ops['save:ckptstore'].gbps")
        if dcp_save:
            put("ckptstore_save_vs_dcp", ck_save / dcp_save, "save:ckptstore / save:dcp gbps")
    if ck_load:
        put("ckptstore_load_cold_gbps", ck_load, "aggregate.ops['load:ckptstore:cold'].gbps")
        if dcp_load:
            put("ckptstore_load_cold_vs_dcp", ck_load / dcp_load, "load:ckptstore:cold / load:dcp:cold gbps")
    if torch_load and "checkpoint_mib" in figs:
        put("torch_load_cold_s", figs["checkpoint_mib"].value * 2**20 / (torch_load * 1e9),
            "checkpoint_mib / aggregate.ops['load:torch:cold'].gbps")
    if isinstance(agg.get("disk_fsync_gbps"), (int, float)) and agg["disk_fsync_gbps"] > 0:
        put("disk_fsync_gbps", float(agg["disk_fsync_gbps"]), "aggregate.disk_fsync_gbps")
    if not changed:
        raise ValueError(f"{path}: no figure this tool uses (save/load GB/s, disk_fsync_gbps)")
    return Costs(figs, f"{costs.origin} + {path}"), changed


# ---- strategies ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Strategy:
    """A checkpointing strategy's costs (see the module docstring for their meaning)."""

    name: str
    every: int                  # N: iterations between checkpoint requests
    step_s: float               # one iteration under this strategy
    stall_s: float = 0.0        # training blocked per request
    persist_s: float = 0.0      # storage time from the end of the stall until durable
    max_inflight: int = 1       # K: requested but not durable before training waits
    load_s: float = 0.0         # load of a full checkpoint, or of a base
    replay_s: float = 0.0       # per delta replayed after the base
    base_every: int = 0         # 0: every checkpoint is a full one
    restart_s: float = 0.0
    derivation: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.every < 1 or self.max_inflight < 1 or self.base_every < 0:
            raise ValueError(f"{self.name}: every and max_inflight must be >= 1, base_every >= 0")
        if not self.step_s > 0:
            raise ValueError(f"{self.name}: step time must be positive, got {self.step_s}")
        for k in ("stall_s", "persist_s", "load_s", "replay_s", "restart_s"):
            if not getattr(self, k) >= 0:
                raise ValueError(f"{self.name}: {k} must be >= 0, got {getattr(self, k)} "
                                 "(check the cost file's figures)")

    def resume_s(self, durable: int) -> float:
        """Restart + load of the checkpoint at iteration ``durable`` (0: the initial state,
        nothing to load)."""
        if durable == 0:
            return self.restart_s
        since_base = durable % self.base_every if self.base_every else 0
        return self.restart_s + self.load_s + since_base * self.replay_s


def apply_mode(st: Strategy, mode: str, interval: int, *, group: int = 1, delta_inflight: int = 4,
               delta_step_s: float | None = None, delta_persist_s: float | None = None,
               delta_replay_s: float | None = None, delta_load_s: float | None = None) -> Strategy:
    """``st``, a strategy of snapshots (its stall a snapshot's), under one of the modes of
    ``ckptstore.torch.plan``: ``"snapshots"``, one every ``interval`` iterations; ``"deltas"``, a
    delta every iteration (steps of ``delta_step_s``, default ``st``'s), durable per group of
    ``group`` after ``delta_persist_s`` (default ``st``'s persist), ``delta_inflight`` groups in
    flight, and a base every ``interval``: its stall is spread over the steps between bases (they
    come every B steps, not every group); a resume loads the base (``delta_load_s``, default
    ``st``'s load) and replays ``delta_replay_s`` per delta since it (default ``st``'s)."""
    if mode == "snapshots":
        return replace(st, every=interval, base_every=0)
    if mode != "deltas":
        raise ValueError(f"{st.name}: unknown mode {mode!r} (snapshots or deltas)")
    step = (st.step_s if delta_step_s is None else delta_step_s) + st.stall_s / interval
    return replace(st, every=group, step_s=step, stall_s=0.0, base_every=interval,
                   max_inflight=delta_inflight,
                   persist_s=st.persist_s if delta_persist_s is None else delta_persist_s,
                   replay_s=st.replay_s if delta_replay_s is None else delta_replay_s,
                   load_s=st.load_s if delta_load_s is None else delta_load_s)


def young_daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's first-order optimal checkpoint interval, sqrt(2 * C * MTBF)."""
    if not (cost_s >= 0 and mtbf_s > 0):
        raise ValueError(f"need a checkpoint cost >= 0 and an MTBF > 0, got {cost_s} and {mtbf_s}")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def young_daly_every(cost_s: float, mtbf_s: float, step_s: float) -> int:
    """The Young/Daly interval in whole iterations (at least 1)."""
    if math.isinf(mtbf_s):
        return sys.maxsize
    return max(1, round(young_daly_interval_s(cost_s, mtbf_s) / step_s))


def make_strategy(name: str, costs: Costs, mtbf_s: float, *, restart_s: float = 0.0,
                  pccheck_inflight: int = 4) -> Strategy:
    """Build strategy ``name`` from the measured ``costs`` for a scenario of mean time between
    failures ``mtbf_s``. ``derivation`` says how each cost follows from the figures."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    if not restart_s >= 0:
        raise ValueError(f"restart time must be >= 0, got {restart_s}")
    plain = costs["step_plain_s"]
    ckpt_bytes = costs["checkpoint_mib"] * 2**20
    mb = ckpt_bytes / 1e6
    if name == "torch.save":
        stall = costs["torch_save_max_step_s"] - plain
        load = costs["torch_load_cold_s"]
        return Strategy(name, young_daly_every(stall, mtbf_s, plain), plain, stall_s=stall, load_s=load,
                        restart_s=restart_s, derivation=(
                            f"stall = torch_save_max_step_s - step_plain_s = {stall:.3f} s",
                            f"load = torch_load_cold_s = {load:.3f} s"))
    if name == "dcp-async":
        block = costs["dcp_async_max_step_s"] - plain
        dcp_save = costs["ckptstore_save_gbps"] / costs["ckptstore_save_vs_dcp"]
        dcp_load = costs["ckptstore_load_cold_gbps"] / costs["ckptstore_load_cold_vs_dcp"]
        persist, load = mb / (dcp_save * 1e3), mb / (dcp_load * 1e3)
        return Strategy(name, young_daly_every(block, mtbf_s, plain), plain, stall_s=block,
                        persist_s=persist, load_s=load, restart_s=restart_s, derivation=(
                            f"stall = dcp_async_max_step_s - step_plain_s = {block:.3f} s (blocking part)",
                            (f"persist = {mb:.1f} MB / (ckptstore_save_gbps / ckptstore_save_vs_dcp = "
                             f"{dcp_save:.3f} GB/s) = {persist:.3f} s (background until done)"),
                            (f"load = {mb:.1f} MB / (ckptstore_load_cold_gbps / ckptstore_load_cold_vs_dcp"
                             f" = {dcp_load:.3f} GB/s) = {load:.3f} s")))
    if name == "pccheck":
        stall = costs["copy_stall_s"]
        persist = mb / (costs["disk_fsync_gbps"] * 1e3)
        load = costs["torch_load_cold_s"]
        return Strategy(name, young_daly_every(stall, mtbf_s, plain), plain, stall_s=stall,
                        persist_s=persist, max_inflight=pccheck_inflight, load_s=load, restart_s=restart_s,
                        derivation=(
                            f"stall = copy_stall_s = {stall * 1e3:.1f} ms (copy into preallocated buffers)",
                            (f"persist = {mb:.1f} MB / disk_fsync_gbps = {persist:.3f} s, "
                             f"at most {pccheck_inflight} in flight, persisted in order"),
                            f"load = torch_load_cold_s = {load:.3f} s"))
    group = int(costs["ckptstore_group_commit"])
    persist = costs["ckptstore_persist_per_delta_s"]
    base_load = mb / (costs["ckptstore_load_cold_gbps"] * 1e3)
    n = costs["restore_deltas"]
    replay = (costs["restore_base_plus_deltas_cold_s"] - base_load) / n
    loads = [f"base load = {mb:.1f} MB / ckptstore_load_cold_gbps = {base_load:.3f} s",
             (f"replay = (restore_base_plus_deltas_cold_s - base load) / restore_deltas ({n:g}) = "
              f"{replay:.4f} s per delta")]
    if name in ("ckptstore-snapshots", "ckptstore-auto"):
        snap = ckptstore_snapshots(name, costs, mtbf_s, load_s=base_load, restart_s=restart_s)
        if name == "ckptstore-snapshots":
            return replace(snap, derivation=(*snap.derivation, loads[0]))
        return ckptstore_auto(snap, costs, mtbf_s, replay_s=replay, delta_persist_s=persist,
                              derivation=loads)
    step = plain * costs["ckptstore_step_ratio"]
    base_every = int(costs["ckptstore_base_every"])
    derivation = [f"step = step_plain_s * ckptstore_step_ratio = {step:.4f} s",
                  (f"every = ckptstore_group_commit = {group} (a group is durable "
                   f"ckptstore_persist_per_delta_s = {persist * 1e3:.1f} ms after its last iteration)"),
                  *loads]
    if name == "ckptstore":
        derivation.append(f"resume = base load + (D mod ckptstore_base_every = {base_every}) x replay")
        return Strategy(name, group, step, persist_s=persist, load_s=base_load, replay_s=replay,
                        base_every=base_every, restart_s=restart_s, derivation=tuple(derivation))
    # the follower must keep up with training for its state to be at D when a failure comes
    if replay > step:
        raise ValueError(f"{costs.origin}: a follower replays a delta in {replay:.3f} s, slower than "
                         f"a training step ({step:.3f} s): it cannot keep up")
    derivation.append("the follower keeps up (replay < step): resume = one base load")
    return Strategy(name, group, step, persist_s=persist, load_s=base_load, restart_s=restart_s,
                    derivation=tuple(derivation))


def ckptstore_snapshots(name: str, costs: Costs, mtbf_s: float, *, load_s: float,
                        restart_s: float) -> Strategy:
    """ckptstore's overlapped async snapshots every N (Young/Daly on the stall, as the peers): the
    stall is PCcheck-style's (copy_stall_s) times the all-in cost per snapshot of ckptstore over
    PCcheck-style's measured side by side; durable after the checkpoint's bytes at ckptstore's
    save bandwidth."""
    plain, copy = costs["step_plain_s"], costs["copy_stall_s"]
    mb = costs["checkpoint_mib"] * 2**20 / 1e6
    ratio = costs["snapshot_cost_ckptstore_ms"] / costs["snapshot_cost_pccheck_style_ms"]
    stall = copy * ratio
    persist = mb / (costs["ckptstore_save_gbps"] * 1e3)
    return Strategy(name, young_daly_every(stall, mtbf_s, plain), plain, stall_s=stall,
                    persist_s=persist, load_s=load_s, restart_s=restart_s, derivation=(
                        (f"stall = copy_stall_s x snapshot_cost_ckptstore_ms / snapshot_cost_pccheck_style_ms"
                         f" = {copy * 1e3:.1f} ms x {ratio:.3f} = {stall * 1e3:.1f} ms (all in: stall, "
                         f"waits, the persister's CPU)"),
                        f"persist = {mb:.1f} MB / ckptstore_save_gbps = {persist:.3f} s"))


def ckptstore_auto(snap: Strategy, costs: Costs, mtbf_s: float, *, replay_s: float,
                   delta_persist_s: float, derivation: Sequence[str] = ()) -> Strategy:
    """``policy="auto"``: what ``ckptstore.torch.plan.plan()`` chooses at ``mtbf_s`` from the
    snapshot costs of ``snap`` and the delta costs (the step without bases, measured with the
    Checkpointer's default group_commit=1, and the replay), applied to ``snap`` by
    :func:`apply_mode` (deltas: 4 in flight, the Checkpointer pipeline's)."""
    from ckptstore.torch import plan as ckplan  # (its package imports torch: only when asked)
    plain = costs["step_plain_s"]
    delta_step = plain * costs["ckptstore_step_ratio_no_bases"]
    pc = ckplan.Costs(step_s=plain, snapshot_stall_s=snap.stall_s, snapshot_persist_s=snap.persist_s,
                      delta_overhead_s=delta_step - plain, replay_s=replay_s, load_s=snap.load_s,
                      restart_s=snap.restart_s, group_commit=1)
    p = ckplan.plan(pc, mtbf_s)
    st = apply_mode(snap, p.mode, p.chosen.interval, delta_step_s=delta_step,
                    delta_persist_s=delta_persist_s, delta_replay_s=replay_s)
    others = "; ".join(f"{o.mode} {o.goodput:.4f}" for o in p.options[1:])
    return replace(st, derivation=(*snap.derivation, *derivation, (
        f"delta step = step_plain_s * ckptstore_step_ratio_no_bases = {delta_step:.4f} s"),
        f"plan() at MTBF {mtbf_s:.0f} s: {p.chosen.describe()} (instead: {others})"))


# ---- simulation ----------------------------------------------------------------------------------
@dataclass
class RunResult:
    useful_s: float
    wall_s: float = 0.0
    failures: int = 0
    lost_s: float = 0.0     # summed over failures
    resume_s: float = 0.0   # summed over failures
    checkpoints: int = 0    # requested

    @property
    def goodput(self) -> float:
        return self.useful_s / self.wall_s

    def add(self, other: RunResult) -> RunResult:
        return RunResult(self.useful_s + other.useful_s, self.wall_s + other.wall_s,
                         self.failures + other.failures, self.lost_s + other.lost_s,
                         self.resume_s + other.resume_s, self.checkpoints + other.checkpoints)

    @property
    def lost_per_failure_s(self) -> float:
        return self.lost_s / self.failures if self.failures else 0.0

    @property
    def resume_per_failure_s(self) -> float:
        return self.resume_s / self.failures if self.failures else 0.0


def simulate(st: Strategy, iterations: int, step_plain_s: float, failures: Iterable[float], *,
             fast_forward: bool = True) -> RunResult:
    """Run a job of ``iterations`` iterations under ``st`` against the sorted failure times
    ``failures`` (s from the job's start) and return its totals. ``fast_forward`` skips whole
    checkpoint periods that no failure reaches in one step (False steps through each; the same
    result up to float rounding)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    res = RunResult(useful_s=iterations * step_plain_s)
    upcoming = iter(failures)

    def next_failure(after: float) -> float:
        for f in upcoming:
            if f > after:
                return f
        return math.inf

    period = st.every * st.step_s + st.stall_s
    # each checkpoint is durable before the next request, so every period looks the same
    steady = st.persist_s <= st.every * st.step_s
    t, i = 0.0, 0
    safe_it, safe_t = 0, 0.0     # last durable checkpoint, and when training went on after it
    inflight: deque[tuple[int, float, float]] = deque()   # (iteration, durable at, went on at)
    device_free = 0.0
    tf = next_failure(0.0)
    while True:
        if fast_forward and steady and device_free <= t + st.every * st.step_s:
            k = (iterations - 1 - i) // st.every
            if tf < math.inf:
                k = min(k, int((tf - t) // period) - 1)
            if k >= 2:
                for j in (k - 1, k):
                    inflight.append((i + j * st.every, t + j * period + st.persist_s, t + j * period))
                i, t = i + k * st.every, t + k * period
                device_free = t + st.persist_s
                res.checkpoints += k
        nxt = min((i // st.every + 1) * st.every, iterations)
        t_next = t + (nxt - i) * st.step_s
        if tf >= t_next:
            t, i = t_next, nxt
            if i >= iterations:
                break
            while inflight and inflight[0][1] <= t:
                safe_it, _, safe_t = inflight.popleft()
            # with K checkpoints not yet durable, training waits for the oldest; then it stalls
            t_wait = inflight[-st.max_inflight][1] if len(inflight) >= st.max_inflight else t
            t_go = t_wait + st.stall_s
            if tf >= t_go:
                device_free = max(t_go, device_free) + st.persist_s
                inflight.append((i, device_free, t_go))
                res.checkpoints += 1
                t = t_go
                continue
        # a failure at tf: back to the last checkpoint durable by then
        while inflight and inflight[0][1] <= tf:
            safe_it, _, safe_t = inflight.popleft()
        inflight.clear()
        res.failures += 1
        res.lost_s += tf - safe_t
        t = tf
        while True:
            r = st.resume_s(safe_it)
            res.resume_s += r
            tf = next_failure(t)
            if tf >= t + r:
                break
            res.failures += 1   # during the resume: nothing more to lose, start it again
            t = tf
        t += r
        i, safe_t, device_free = safe_it, t, t
    res.wall_s = t
    return res


def job_iterations(hours: float, step_plain_s: float) -> int:
    if not hours > 0:
        raise ValueError(f"useful work must be positive, got {hours} h")
    return math.ceil(hours * 3600.0 / step_plain_s)


def run_scenario(scenario: Scenario, strategy: Strategy, iterations: int, step_plain_s: float,
                 runs: int, seed: int) -> RunResult:
    """Totals over ``runs`` runs of ``strategy`` under ``scenario``."""
    total = RunResult(0.0)
    for r in range(runs):
        total = total.add(simulate(strategy, iterations, step_plain_s, scenario.failure_times(seed, r)))
    return total


# ---- output --------------------------------------------------------------------------------------
def _fmt_rate(per_hour: float) -> str:
    return f"{per_hour:.3g}"


# ---- main ----------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--costs", default=str(DEFAULT_COSTS), help="cost file (default tools/goodput_costs.json)")
    p.add_argument("--from-bench", metavar="FILE",
                   help="override throughput figures with those of a `bench_core.py --json FILE` run")
    p.add_argument("--from-e2e", metavar="FILE",
                   help="calibrate against a `bench_goodput.py --json FILE` run: simulate its jobs "
                        "(same schedules, measured costs) and compare goodputs; nothing else runs")
    p.add_argument("--sweep-e2e", metavar="FILE",
                   help="sweep failure rates on the costs a `bench_goodput.py --json FILE` run "
                        "measured end to end (tools/goodput_extrapolate.py); with --plot, its "
                        "measured points on the sweep and, with its traces, the calibration panel")
    p.add_argument("--traces", default=str(DEFAULT_TRACES),
                   help="directory of trace CSVs (default ../shared/traces from the repository root; "
                        "skipped when absent)")
    p.add_argument("--trace", action="append", default=[], metavar="FILE", help="a trace file (repeatable)")
    p.add_argument("--gpus", type=int, default=LLAMA3_GPUS,
                   help="Poisson scenario: GPUs in the job, at LLaMA 3's per-GPU rate (default 16384)")
    p.add_argument("--rate", type=float, help="Poisson scenario: failures per hour (overrides --gpus)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated, of: {', '.join(STRATEGIES)} (default all)")
    p.add_argument("--hours", type=float, default=72.0, help="useful work of the job, hours (default 72)")
    p.add_argument("--runs", type=int, default=16, help="runs per scenario and strategy (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart-s", type=float, default=0.0,
                   help="fixed restart overhead per failure, every strategy (not measured; default 0)")
    p.add_argument("--pccheck-inflight", type=int, default=4,
                   help="PCcheck-style: concurrent checkpoints in flight (default 4)")
    p.add_argument("--plot", metavar="PNG", help="write goodput and lost work vs failure rate here")
    p.add_argument("--e2e", metavar="FILE",
                   help="with --plot: add the jobs of a `bench_goodput.py --json FILE` run, measured "
                        "against simulated goodput (e.g. tools/data/goodput-e2e-2026-11-28.json)")
    a = p.parse_args(argv)
    a.strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    unknown = [s for s in a.strategies if s not in STRATEGIES]
    if unknown or not a.strategies:
        p.error(f"unknown strategy {', '.join(map(repr, unknown)) or '(none given)'}; "
                f"known: {', '.join(STRATEGIES)}")
    try:
        if a.rate is not None:
            check_rate(a.rate)
        else:
            llama3_rate_per_hour(a.gpus)
    except ValueError as e:
        p.error(f"--rate/--gpus: {e}")
    if a.e2e and not a.plot:
        p.error("--e2e needs --plot")
    if a.sweep_e2e and (a.from_e2e or a.e2e or a.from_bench):
        p.error("--sweep-e2e takes its costs from the run: not with --from-e2e, --e2e or --from-bench")
    if not (a.hours > 0 and math.isfinite(a.hours)) or a.runs < 1 or a.pccheck_inflight < 1 \
            or not a.restart_s >= 0:
        p.error("--hours, --runs and --pccheck-inflight must be positive, --restart-s >= 0")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        return run(a)
    except (OSError, ValueError) as e:   # a bad cost, bench or trace file, a figure out of range
        print(f"goodput: {e}", file=sys.stderr)
        return 2


def run(a: argparse.Namespace) -> int:
    if a.sweep_e2e:
        return run_sweep_e2e(a)
    if a.from_e2e or a.e2e:
        import goodput_e2e  # (tools/goodput_e2e.py imports this module: loaded only here)
        with open(a.from_e2e or a.e2e) as f:
            doc = json.load(f)
        rows = goodput_e2e.calibrate_e2e(doc, None if a.from_e2e else a.traces)
        if a.from_e2e:
            print(goodput_e2e.e2e_report(doc, rows))
            return 0
        e2e = goodput_e2e.e2e_means(doc, rows)
        err = sum(abs(g["sim"] - g["e2e"]) for g in e2e) / max(1, len(e2e))
        e2e_title = (f"bench_goodput run of {doc.get('date', '?')}\n(its own model and time-compressed "
                     f"failures): mean |sim - e2e| {err:.3f}")
    else:
        e2e, e2e_title = [], ""
    costs = load_costs(a.costs)
    changed: list[str] = []
    if a.from_bench:
        costs, changed = costs_from_bench(costs, a.from_bench)
    traces = [load_trace(t) for t in a.trace]
    if os.path.isdir(a.traces):
        traces += load_traces(a.traces)
    elif a.traces != str(DEFAULT_TRACES):
        raise ValueError(f"--traces {a.traces}: not a directory")
    rate = a.rate if a.rate is not None else llama3_rate_per_hour(a.gpus)
    poisson = f"Poisson {_fmt_rate(rate)}/h" if a.rate is not None else \
        f"Poisson, LLaMA 3 rate x {a.gpus} GPUs"
    scenarios = [Scenario(poisson, rate_per_hour=rate)]
    scenarios += [Scenario(f"trace {t.name}", trace=t) for t in traces if t.failures]
    step_plain = costs["step_plain_s"]
    iterations = job_iterations(a.hours, step_plain)

    def simulate_all(sc: Scenario) -> list[tuple[Strategy, RunResult]]:
        sts = [make_strategy(s, costs, sc.mtbf_s, restart_s=a.restart_s, pccheck_inflight=a.pccheck_inflight)
               for s in a.strategies]
        return [(st, run_scenario(sc, st, iterations, step_plain, a.runs, a.seed)) for st in sts]

    table = []
    derivations: dict[str, list[str]] = {}
    at_traces: dict[str, list[tuple[str, float, RunResult]]] = {s: [] for s in a.strategies}
    for sc in scenarios:
        per_hour = 3600.0 / sc.mtbf_s
        for st, r in simulate_all(sc):
            seen = derivations.setdefault(st.name, [])
            seen += [line for line in st.derivation if line not in seen]   # (auto: a plan per MTBF)
            if sc.trace is not None:
                at_traces[st.name].append((sc.trace.name, per_hour, r))
            every = f"{st.every}" + (f" (base {st.base_every})" if st.base_every else "")
            table.append([sc.name, _fmt_rate(per_hour), st.name, every, f"{r.goodput:.4f}",
                          f"{r.lost_per_failure_s:.1f}", f"{r.resume_per_failure_s:.2f}",
                          f"{r.failures / a.runs:.1f}"])
    sweep: dict[str, list[tuple[float, RunResult]]] = {s: [] for s in a.strategies}
    if a.plot:
        for per_hour in SWEEP_PER_HOUR:
            for st, r in simulate_all(Scenario("sweep", rate_per_hour=per_hour)):
                sweep[st.name].append((per_hour, r))

    print(f"goodput: a job of {a.hours:g} h of useful work ({iterations} iterations of "
          f"{step_plain * 1e3:.0f} ms), {a.runs} runs per row, seed {a.seed}, "
          f"restart overhead {a.restart_s:g} s")
    print(f"figures used ({costs.origin}):")
    for name in sorted(costs.used):
        fig = costs.figures[name]
        mark = " [from --from-bench]" if name in changed else ""
        print(f"  {name} = {fig.value:g} {fig.unit}{mark}\n      {fig.source}")
    print("derived costs:")
    for name, lines in derivations.items():
        print(f"  {name}: " + "; ".join(lines))
    notes = [f"no trace directory at {a.traces}"] if not (os.path.isdir(a.traces) or a.trace) else []
    notes += [f"trace {t.name} has no failure: skipped" for t in traces if not t.failures]
    print(f"scenarios: {', '.join(s.name for s in scenarios)}" + "".join(f" ({n})" for n in notes))
    print()
    print(harness.table(["scenario", "failures/h", "strategy", "every (it)", "goodput",
                        "lost per failure (s)", "resume (s)", "failures per run"], table, left=None))
    if a.plot:
        print(f"\nPoisson sweep, goodput:\n{goodput_plot.sweep_table(sweep)}")
        return draw(a.plot, sweep, at_traces,
                    f"{a.hours:g} h of useful work, step {step_plain * 1e3:.0f} ms, costs: "
                    f"{os.path.basename(a.costs)}"
                    f"{' + ' + os.path.basename(a.from_bench) if a.from_bench else ''}"
                    f"; {a.runs} runs per point", e2e, e2e_title)
    return 0


def draw(path: str, *args: Any, **kwargs: Any) -> int:
    """:func:`goodput_plot.plot` to ``path``, said on stdout: 0, or 1 without matplotlib."""
    try:
        goodput_plot.plot(path, *args, **kwargs)
    except ImportError:
        print("goodput: matplotlib is not installed (pip install -e '.[plots]'): no plot",
              file=sys.stderr)
        return 1
    print(f"\nplot: {path}")
    return 0


def run_sweep_e2e(a: argparse.Namespace) -> int:
    """``--sweep-e2e FILE``: the Poisson sweep on the run's measured costs (printed), and with
    ``--plot`` drawn with the run's measured points; the calibration panel when the run's traces
    are at ``--traces`` (its jobs' failure schedules are rebuilt from them)."""
    import goodput_e2e  # (both import this module: loaded only here)
    import goodput_extrapolate as gx
    with open(a.sweep_e2e) as f:
        doc = json.load(f)
    results, chosen = gx.sweep(doc, a.hours, a.runs, a.seed, a.restart_s)
    print(gx.report(doc, a.hours, a.runs, results, chosen))
    if not a.plot:
        return 0
    calibration, title = [], ""
    if all((Path(a.traces) / t).is_file() for t in doc["args"]["traces"]):
        calibration = goodput_e2e.e2e_means(doc, goodput_e2e.calibrate_e2e(doc, a.traces))
        err = sum(abs(g["sim"] - g["e2e"]) for g in calibration) / max(1, len(calibration))
        title = (f"the same run's jobs, each simulated on its own failures\nwith the pooled "
                 f"costs: mean |sim - e2e| {err:.3f}")
    else:
        print(f"goodput: the run's traces are not in {a.traces}: no calibration panel",
              file=sys.stderr)
    plain = gx.step_plain_s(doc)
    return draw(a.plot, results, gx.measured_points(doc),
                f"lines: the simulator on the costs bench_goodput measured end to end "
                f"({doc.get('date', '?')}, model {doc['args'].get('model', '?')}, plain "
                f"step {plain * 1e3:.0f} ms), Poisson failures, {a.hours:g} h of useful "
                f"work, {a.runs} runs per point; markers: that run's measured jobs "
                f"(means over its repeats)", calibration, title,
                markers="measured jobs, at the rate they met", marker_prefix="measured: ")


if __name__ == "__main__":
    sys.exit(main())
