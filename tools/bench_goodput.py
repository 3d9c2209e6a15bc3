#!/usr/bin/env python3
"""bench_goodput: end-to-end goodput under real SIGKILLs, checkpointing peers side by side (issue 30).

A small GPT-style model (tools/bench_delta.py's, random weights, CPU, nothing downloaded) trains
in a **child process** that checkpoints per a strategy. The parent SIGKILLs the child's whole
process group at failure times drawn from a scenario, starts a NEW process that restores from
the strategy's last durable checkpoint and trains on, and so on until ``I`` iterations of useful
work are done. Strategies (``--strategies``, default all):

==================  ==========================================================================
torch.save          ``torch.save(model+optimizer)`` to a temp file, fsync, rename, fsync dir,
                    every N (Young/Daly on its measured all-in cost, below)
dcp-async           ``torch.distributed.checkpoint.async_save`` (FileSystemWriter,
                    sync_files, no_dist), every N (Young/Daly on its all-in cost)
pccheck             a PCcheck/CheckFreq-style baseline (below), every N (Young/Daly on its cost)
ckpt-snapshots      ``Checkpointer(policy="snapshots", snapshot_every=N)`` (Young/Daly on its
                    all-in cost)
ckpt-deltas         ``Checkpointer(policy="every-iteration", codec="exact", base_every=B)``
ckpt-topk           the same with ``codec="topk:0.01"`` (training uses the exact gradient; a
                    restore replays the sparsified one: approximate, and reported as such)
ckpt-auto           ``Checkpointer(policy="auto", mtbf_s=<the scenario's MTBF>)``
==================  ==========================================================================

The PCcheck-style baseline (tools/goodput_peers.py, with the other strategies; not ckptstore): ``K`` preallocated, page-aligned staging
buffers; at a checkpoint training waits for a free buffer (at most ``K`` in flight), copies the
parameters and AdamW state into it and hands it to one background writer thread, which writes it
with O_DIRECT to one of two preallocated slot files, fsyncs, then publishes ``{iteration, slot}``
in a small metadata file (temp, fsync, rename, fsync dir). A restore reads the metadata and its slot.

Scenarios: the Bamboo p3 and g4dn spot traces (``../shared/traces``, read in place with their
licence beside them) compressed in time so their MTBF is ``--trace-mtbf`` seconds (burstiness
kept), and Poisson failures at each MTBF of ``--poisson-mtbf``. Failure times come from
tools/goodput.py's scenarios (same seeds), so the simulator can replay the exact same schedule.

Measurement. ``I = round(--work-s / plain step)`` iterations (the plain step from a calibration
child at the start, which also measures the costs Young/Daly needs: for every every-N strategy
its *all-in* cost, the stall plus the slowdown its background work causes the steps it overlaps,
measured the same way for all, tools/goodput_peers.py ``all_in_cost``; nobody's background work
is free). The job's clock starts when
the first child begins training (after the model build and the initial checkpoint of an empty
store); the wall time ends when iteration ``I`` completes (no final checkpoint). Every strategy
runs against the same failure schedule per scenario and round (``--repeats``), in an order rotated
per scenario and round; a plain child (no checkpoints, no failures) of ``I/4`` iterations runs
before the first job and after each one, and a job's plain step is the mean of its two
neighbours' mean steps (each without its first step, a fresh process' warm-up): the machine's load
drifts within minutes. Per job:

* goodput = ``I x plain step / wall``;
* goodput *in job* = ``I x (the job's own plain step) / wall``: the mean of the job's steps
  that ran as plain training (no checkpoint written, none in flight, not a process' first step;
  :func:`clean_plain_steps`; the mean, as the plain runs': an occasional slow step is plain
  training too). The machine's speed drifts ~10% within seconds here (consecutive plain runs
  12 s apart differ by a median 6-10%; so do 24-step windows of one process), so the plain runs
  beside a job put jobs without a failure anywhere in 0.85-1.22; the job's own plain steps ran
  at the same time as its checkpoints. NaN for a strategy that checkpoints every step
  (deltas). It favours a strategy that leaves background work outside its checkpoints' windows
  (after durability); both figures are reported;
* work lost per failure = the failure time minus when training went on after the checkpoint the
  next process restored (a failure while resuming loses nothing more and counts);
* resume = failure to training again: the kill, a new process (a fork of a zygote that imported
  everything once, see :class:`Zygote`; ``--cold`` starts a fresh interpreter instead), the model
  build and the strategy's restore (``load``);
* bytes written = the children's ``wchar`` (/proc/PID/io: every byte passed to write calls);
* the simulator's inputs (step, stall, persist, load, replay, restart), see tools/goodput.py
  ``--from-e2e``.

Verification: a full plain run first records an xxh3 hash of the parameters at every iteration
(outside its timed step); every later plain child must reproduce them (determinism across
processes). Every restore reports the hash of what it restored, which must equal the plain
run's at the restored iteration, and every job's final hash must equal the plain run's at ``I``
(deterministic training: batches are seeded by iteration). ckpt-topk restores are lossy by
design: reported, not failed. A mismatch anywhere else fails the benchmark.

    python tools/bench_goodput.py --quick                     # smoke run, ~2-3 min
    python tools/bench_goodput.py --json /tmp/goodput-e2e.json
    python tools/goodput.py --from-e2e /tmp/goodput-e2e.json  # simulator vs these runs

Everything runs on one machine's cores: training (1 torch thread by default: 2 threads spin
badly on a shared 2-core VM) and every strategy's background work share them.

Every process runs with the same glibc malloc settings (the tool re-executes itself with
``harness.MALLOC_ENV`` unless they are set or ``--no-malloc-env`` is given; the children inherit
them). With glibc's defaults the mmap threshold moves up once a process frees a large block, and
from then on the step's tensors come from the heap without page faults: measured 80-111 ms a
step against 97-144 ms in the same loop. Which process crossed that line depended on what its
strategy happened to free: ``policy="auto"``'s processes (its delta phase) trained at 92-93 ms
a step where the other strategies' and the plain runs beside them ran at 100-115 ms, and its
goodput against those plain runs came out at 0.995-1.106 in jobs with failures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import goodput  # noqa: E402  (tools/goodput.py: scenarios, traces, Young/Daly)
import goodput_targets  # noqa: E402  (tools/goodput_targets.py: issue 30's targets judged)
import harness  # noqa: E402  (tools/harness.py: machine header, tables, fsync)
from goodput_peers import (CHILD_STRATEGIES, Ckpt, DcpAsync, Emitter, PCcheck, Plain,  # noqa: E402,F401
                           TorchSave, adam_state_tensors, all_in_cost, calibrate_main, child_main,
                           params_hash, wchar)

STRATEGIES = ("torch.save", "dcp-async", "pccheck", "ckpt-snapshots", "ckpt-deltas", "ckpt-topk",
              "ckpt-auto")
#: strategies whose checkpoint every N comes from Young/Daly on a cost measured at calibration:
#: each one's all-in cost (its stall plus the slowdown its background work causes the steps it
#: overlaps, goodput_peers.all_in_cost), measured alike for all. Until 2026-11-29 it was the stall
#: alone, which charged nobody's background work and made ckptstore's snapshots (whose persister
#: costs the most CPU) checkpoint every 2-4 iterations against the peers' 7-20.
YOUNG_DALY = {"torch.save": "torch_save_cost_s", "dcp-async": "dcp_cost_s",
              "pccheck": "pccheck_cost_s", "ckpt-snapshots": "ckpt_cost_s"}
LOSSY = {"ckpt-topk"}
#: clean plain steps a job needs for its own plain reference (clean_plain_steps)
MIN_CLEAN_STEPS = 5
MODEL_ARGS = ["--layers", "3", "--dim", "256", "--heads", "4", "--vocab", "8192", "--ctx", "32",
              "--batch", "4"]
DEFAULT_TRACES = ("bamboo-p3-trace.csv", "bamboo-g4dn-trace.csv")


# ---- pure pieces ---------------------------------------------------------------------------------
compress_trace = goodput.compress_trace  # one implementation: the simulator rebuilds our scenarios


def make_scenarios(trace_dir: Path, traces: Sequence[str], trace_mtbf_s: float,
                   poisson_mtbf_s: Sequence[float]) -> list[goodput.Scenario]:
    """The scenarios of a run: each trace compressed to ``trace_mtbf_s``, then Poisson ones."""
    out = []
    for name in traces:
        tr = compress_trace(goodput.load_trace(trace_dir / name), trace_mtbf_s)
        out.append(goodput.Scenario(f"{tr.name} (MTBF {trace_mtbf_s:g} s)", trace=tr))
    for m in poisson_mtbf_s:
        out.append(goodput.Scenario(f"Poisson (MTBF {m:g} s)", rate_per_hour=3600.0 / m))
    return out


def failure_schedule(scenario: goodput.Scenario, seed: int, run: int, horizon_s: float) -> list[float]:
    """The failure times (s from the job's start) of ``scenario``'s run ``run`` up to
    ``horizon_s``: goodput.py's draw for the same (seed, run), so the simulator can replay it."""
    out = []
    for t in scenario.failure_times(seed, run):
        if t > horizon_s:
            break
        out.append(t)
    return out


def goodput_of(iterations: int, step_plain_s: float, wall_s: float) -> float:
    """Useful training time over wall time: ``iterations x step_plain_s / wall_s``."""
    if not (wall_s > 0 and step_plain_s > 0 and iterations >= 0):
        raise ValueError(f"bad goodput inputs: {iterations}, {step_plain_s}, {wall_s}")
    return iterations * step_plain_s / wall_s


def clean_plain_steps(steps: Sequence[tuple[int, float, bool, float, int]],
                      durable: Sequence[tuple[int, float, int]]) -> list[float]:
    """The times of a job's steps that ran as plain training: steps that wrote no checkpoint, are
    not a process' first (its warm-up), and overlapped no checkpoint in flight (from its
    checkpointing step to its durability, or to the end of its process when it never became
    durable). Their mean is the machine's plain speed *while the job ran*: the job's own
    reference, immune to the drift between a job and the plain runs beside it. ``steps``:
    ``(i, dt, checkpointed, end t, incarnation)`` in order; ``durable``: ``(i, t, incarnation)``."""
    done = {(inc, i): t for i, t, inc in durable}
    out: list[float] = []
    inflight: list[float] = []  # durability times of this process' checkpoints so far
    prev_inc = None
    for i, dt, ck, t_end, inc in steps:
        first = inc != prev_inc
        if first:
            inflight, prev_inc = [], inc
        if ck:
            inflight.append(done.get((inc, i), math.inf))
        elif not first and all(t <= t_end - dt for t in inflight):
            out.append(dt)
    return out


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, mean, min, max and count of ``values`` (NaN-free; empty gives NaNs and n 0)."""
    v = [float(x) for x in values if x is not None and not math.isnan(x)]
    if not v:
        return {"median": math.nan, "mean": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(v), "mean": statistics.fmean(v), "min": min(v),
            "max": max(v), "n": len(v)}


def every_for(strategy: str, calib: dict[str, float], mtbf_s: float) -> int:
    """Checkpoint interval (iterations) of an every-N strategy: Young/Daly on its calibrated
    all-in cost, ``max(1, round(sqrt(2 * cost * MTBF) / step))``; 1 for the delta strategies."""
    if strategy in YOUNG_DALY:
        return goodput.young_daly_every(max(calib[YOUNG_DALY[strategy]], 1e-4), mtbf_s,
                                        calib["step_s"])
    return 1




# ---- the parent: jobs, failures, bookkeeping -----------------------------------------------------
@dataclass
class JobResult:
    """One job (a strategy under one failure schedule) from first start to iteration I."""

    strategy: str
    scenario: str
    repeat: int
    iterations: int
    every: int
    wall_s: float = 0.0
    failures: list[dict] = field(default_factory=list)  # per failure: t, lost_s, lost_it, resume_s...
    restores: list[dict] = field(default_factory=list)  # per restore: i, load_s, restart_s, ok
    #: (i, dt, checkpointed, end t, incarnation: the process that ran it, counted from 0)
    steps: list[tuple[int, float, bool, float, int]] = field(default_factory=list)
    persist: list[float] = field(default_factory=list)  # durable t - end of the checkpointing step
    durable: list[tuple[int, float, int]] = field(default_factory=list)  # (i, t, incarnation)
    bytes_written: int = 0
    final_ok: bool | None = None
    plans: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    hashes: dict[int, str] = field(default_factory=dict)  # plain reference only


class Child:
    """A fresh interpreter per incarnation (``--cold``): its own session, so a SIGKILL takes the
    whole group; events arrive on its stdout."""

    def __init__(self, cfg: dict, env: dict, zygote: "Zygote | None" = None) -> None:
        self.spawned = time.monotonic()
        self.events: queue.Queue = queue.Queue()
        if zygote is not None:
            self.pid, stream = zygote.fork(cfg)
            self.proc = None
        else:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child",
                                          json.dumps(cfg)], stdout=subprocess.PIPE, env=env,
                                         start_new_session=True)
            self.pid, stream = self.proc.pid, None
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        if stream is None:
            assert self.proc is not None and self.proc.stdout is not None
            f = self.proc.stdout
        else:
            f = open(stream, "rb")  # a FIFO: EOF once the child (all its threads) is gone
        with f:
            for line in f:
                try:
                    self.events.put(json.loads(line))
                except json.JSONDecodeError:
                    self.events.put({"ev": "junk", "line": line.decode(errors="replace")})
        self.events.put({"ev": "eof", "t": time.monotonic()})

    def kill(self) -> int:
        """SIGKILL the child's process group (and the child itself, should it not have called
        setsid yet); returns the bytes the child had written (wchar) just before."""
        w = wchar(self.pid)
        for kill in (lambda: os.killpg(self.pid, signal.SIGKILL), lambda: os.kill(self.pid, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass
        self.wait()
        return w

    def wait(self) -> None:
        """Until the child is gone (its event stream ended)."""
        if self.proc is not None:
            self.proc.wait()
        else:
            while True:  # the FIFO's EOF: every writer (the child's threads) is gone
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.005)


class Zygote:
    """A process that imported everything once (torch, DCP, ckptstore, the model code) and forks a
    fresh child per incarnation (default): a restart costs a fork, the model build and the
    restore, not the 3-5 s of imports a cold interpreter pays on this VM (``--cold`` pays them).
    Protocol: one JSON request per line on its stdin ``{"cfg": ..., "fifo": path}``; it answers
    ``{"pid": N}`` on its stdout; the child calls setsid and writes its events to the FIFO.
    The zygote builds the model and runs one forward/backward once before forking (library
    initialisation, seconds on this VM); each child builds its own model again."""

    def __init__(self, env: dict, tmp: Path, model: Sequence[str]) -> None:
        self.tmp = tmp
        self.n = 0
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--zygote",
                                      json.dumps({"model": model})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if json.loads(line).get("ev") != "zygote":
            raise RuntimeError(f"zygote did not start: {line!r}")

    def fork(self, cfg: dict) -> tuple[int, str]:
        self.n += 1
        fifo = str(self.tmp / f"events-{self.n}.fifo")
        os.mkfifo(fifo)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"cfg": cfg, "fifo": fifo}) + "\n").encode())
        self.proc.stdin.flush()
        return int(json.loads(self.proc.stdout.readline())["pid"]), fifo

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def zygote_main() -> None:
    """Import what every strategy needs, then fork one child per request (see :class:`Zygote`).
    No thread runs here before a fork (torch's thread pools start in the child)."""
    import warnings
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import xxhash  # noqa: F401
    import bench_delta  # noqa: F401
    import ckptstore  # noqa: F401
    import ckptstore.torch  # noqa: F401
    # warm the libraries' one-time initialisation (the first model build costs seconds on this
    # VM, later ones ~0.1 s); one thread, so no thread pool exists when we fork
    torch.set_num_threads(1)
    from bench_delta import add_model_args, build, fwd_bwd
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    margs = ap.parse_args(json.loads(sys.argv[2]).get("model", MODEL_ARGS))
    model, _ = build(margs)
    fwd_bwd(model, margs, 0)
    del model
    if threading.active_count() != 1:
        raise RuntimeError(f"zygote: {threading.active_count()} threads before fork")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    out = sys.stdout
    out.write(json.dumps({"ev": "zygote"}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                fd = os.open(req["fifo"], os.O_WRONLY)
                os.dup2(fd, 1)
                os.close(fd)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stdin.close()
                child_main(req["cfg"])
            finally:
                os._exit(1)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_job(cfg: dict, failures: Sequence[float], reference: dict[int, str] | None,
            timeout_s: float, zygote: Zygote | None = None) -> JobResult:
    """Run one job to ``cfg["iterations"]``, SIGKILLing at ``failures`` (s on the job's clock,
    which starts when the first child begins training). Every restore's hash is checked against
    ``reference`` (iteration -> hash) when given."""
    env = child_env(cfg["threads"])
    res = JobResult(cfg["strategy"], cfg.get("scenario", ""), cfg.get("repeat", 0),
                    cfg["iterations"], cfg.get("every", 1))
    pending = list(failures)
    t_job: float | None = None
    killed: dict | None = None  # the failure being resumed from
    reach: dict[int, float] = {}  # iteration -> when training went on after it (this incarnation)
    step_end: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    incarnation = -1
    while True:
        child = Child(cfg, env, zygote)
        incarnation += 1
        started = False
        restored_i = None
        t_ready = None
        while True:
            now = time.monotonic()
            if now > deadline:
                res.errors.append(f"timeout after {timeout_s:.0f} s")
                res.bytes_written += child.kill()
                return res
            tf = t_job + pending[0] if (t_job is not None and pending) else math.inf
            try:
                e = child.events.get(timeout=max(0.0, min(tf, deadline) - now))
            except queue.Empty:
                if time.monotonic() < tf:
                    continue
                res.bytes_written += child.kill()
                pending.pop(0)
                last = max(reach) if (started and reach) else None
                # the kill lands after tf: an event the child sent later (read before the kill)
                # moves the failure to it (else the lost work can come out negative)
                at = max([tf, *reach.values()]) if started else tf
                killed = {"t": tf - t_job, "last_it": last, "reach": dict(reach) if started else {},
                          "started": started, "at": at}
                break
            ev = e["ev"]
            if ev == "ready":
                t_ready = e["t"]
            elif ev == "restored":
                restored_i = e["i"]
                if cfg["strategy"] == "plain":
                    res.hashes[e["i"]] = e["hash"]
                ok = reference is None or cfg["strategy"] in LOSSY or \
                    reference.get(e["i"]) == e["hash"]
                res.restores.append({"i": e["i"], "load_s": e["load_s"],
                                     "restart_s": (t_ready or e["t"]) - child.spawned, "ok": ok,
                                     "after_failure": killed is not None})
                if not ok:
                    res.errors.append(f"restore of iteration {e['i']}: hash {e['hash']} != the plain "
                                      f"run's {reference.get(e['i']) if reference else None}")
            elif ev == "start":
                started = True
                if t_job is None:
                    t_job = e["t"]
                if killed is not None:
                    record_failure(res, killed, restored_i, e["t"])
                    killed = None
                reach = {e["i"]: e["t"]}
            elif ev == "it":
                reach[e["i"]] = e["t"]
                step_end[e["i"]] = e["t"]
                res.steps.append((e["i"], e["dt"], bool(e["ck"]), e["t"], incarnation))
                if "hash" in e:
                    res.hashes[e["i"]] = e["hash"]
            elif ev == "durable":
                res.durable.append((e["i"], e["t"], incarnation))
                if e["i"] in step_end:
                    res.persist.append(e["t"] - step_end[e["i"]])
            elif ev == "plan":
                res.plans.append({k: e[k] for k in ("i", "mode", "interval", "goodputs", "text")})
            elif ev == "done":
                res.wall_s = e["t"] - (t_job if t_job is not None else e["t"])
                res.bytes_written += e["wchar"]
                res.final_ok = reference is None or reference.get(e["i"]) == e["hash"]
                if not res.final_ok and cfg["strategy"] not in LOSSY:
                    res.errors.append(f"final hash {e['hash']} != the plain run's")
                child.wait()
                return res
            elif ev == "eof":
                child.wait()
                rc = child.proc.returncode if child.proc is not None else "?"
                res.errors.append(f"child exited ({rc}) before finishing")
                return res


def record_failure(res: JobResult, killed: dict, restored_i: int | None, t_go: float) -> None:
    """Book a failure once the next process trains again: lost work (the failure time minus when
    the killed process went on after the restored iteration; 0 when it had not started) and
    resume time (failure to training again)."""
    lost_s, lost_it = 0.0, 0
    if killed["started"] and restored_i is not None:
        went_on = killed["reach"].get(restored_i)
        if went_on is None:
            earliest = min(killed["reach"])
            if restored_i < earliest:
                res.errors.append(f"restored {restored_i}, older than the killed process' start "
                                  f"{earliest}: a durable checkpoint went missing")
            went_on = killed["at"] if restored_i > max(killed["reach"]) else min(killed["reach"].values())
        lost_s = killed["at"] - went_on
        lost_it = (killed["last_it"] or 0) - restored_i
    res.failures.append({"t": killed["t"], "lost_s": lost_s, "lost_it": lost_it,
                         "resume_s": t_go - killed["at"], "restored": restored_i,
                         "during_resume": not killed["started"]})


def run_calibration(args: argparse.Namespace, tmp: Path) -> dict:
    d = tmp / "calib"
    d.mkdir()
    cfg = {"model": args.model_args, "threads": args.threads, "steps": 8, "reps": 3, "dir": str(d)}
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--calibrate", json.dumps(cfg)],
                       stdout=subprocess.PIPE, env=child_env(args.threads), check=True, timeout=600)
    shutil.rmtree(d, ignore_errors=True)
    for line in p.stdout.decode().splitlines():
        e = json.loads(line)
        if e["ev"] == "calib":
            return {k: v for k, v in e.items() if k not in ("ev", "t")}
    raise RuntimeError("calibration child reported nothing")


# ---- summaries -----------------------------------------------------------------------------------
def job_summary(r: JobResult, step_plain_s: float) -> dict:
    """Per-job figures: goodput and the simulator's inputs (medians/means over the job)."""
    plain_dt = [dt for _, dt, ck, _, _ in r.steps if not ck]
    ck_dt = [dt for _, dt, ck, _, _ in r.steps if ck]
    clean = clean_plain_steps(r.steps, r.durable)
    # (the mean, as the plain runs': a plain step's occasional slow one is plain training too)
    in_job = statistics.fmean(clean) if len(clean) >= MIN_CLEAN_STEPS else math.nan
    if ck_dt and not plain_dt:  # a checkpoint every step (deltas): its cost is in the step
        plain_dt, ck_dt = ck_dt, []
    after = [x for x in r.restores if x["after_failure"]]
    step_mean = statistics.fmean(plain_dt) if plain_dt else math.nan
    return {
        "strategy": r.strategy, "scenario": r.scenario, "repeat": r.repeat, "every": r.every,
        "iterations": r.iterations, "wall_s": r.wall_s,
        "goodput": goodput_of(r.iterations, step_plain_s, r.wall_s) if r.wall_s > 0 else math.nan,
        "step_plain_s": step_plain_s,
        # the same with the job's own plain speed (clean_plain_steps; NaN: too few such steps,
        # a checkpoint every step)
        "goodput_in_job": goodput_of(r.iterations, in_job, r.wall_s)
        if r.wall_s > 0 and in_job > 0 else math.nan,
        "step_plain_in_job_s": in_job, "clean_steps": len(clean),
        "failures": len(r.failures),
        "failure_times_s": [f["t"] for f in r.failures],
        "lost_s_per_failure": statistics.fmean([f["lost_s"] for f in r.failures]) if r.failures else 0.0,
        "lost_it_per_failure": statistics.fmean([f["lost_it"] for f in r.failures]) if r.failures else 0.0,
        "resume_s_per_failure": statistics.fmean([f["resume_s"] for f in r.failures]) if r.failures else 0.0,
        "restart_s": statistics.fmean([x["restart_s"] for x in after]) if after else math.nan,
        "load_s": statistics.fmean([x["load_s"] for x in after]) if after else math.nan,
        "loads": [(x["i"], x["load_s"]) for x in after],
        "step_s": step_mean, "step_median_s": statistics.median(plain_dt) if plain_dt else math.nan,
        "stall_s": (statistics.fmean(ck_dt) - step_mean) if ck_dt and plain_dt else 0.0,
        "checkpoints": len(ck_dt),
        "persist_s": statistics.median(r.persist) if r.persist else 0.0,
        "bytes_written": r.bytes_written,
        "restores_checked": len(r.restores), "restores_ok": sum(x["ok"] for x in r.restores),
        "final_ok": r.final_ok, "plans": r.plans, "errors": r.errors,
        "failures_detail": r.failures,
    }


def aggregate(jobs: list[dict]) -> dict[tuple[str, str], dict]:
    """Per (scenario, strategy): spread over repeats of goodput, lost work, resume, bytes."""
    out: dict[tuple[str, str], dict] = {}
    for j in jobs:
        out.setdefault((j["scenario"], j["strategy"]), {"jobs": []})["jobs"].append(j)
    for key, a in out.items():
        js = a["jobs"]
        lost = [f["lost_s"] for j in js for f in j["failures_detail"]]
        lost_it = [f["lost_it"] for j in js for f in j["failures_detail"]]
        resume = [f["resume_s"] for j in js for f in j["failures_detail"]]
        a.update(goodput=spread([j["goodput"] for j in js]),
                 goodput_in_job=spread([j.get("goodput_in_job", math.nan) for j in js]),
                 lost_s=spread(lost),
                 lost_it=spread(lost_it), resume_s=spread(resume),
                 bytes=spread([j["bytes_written"] for j in js]),
                 failures=sum(j["failures"] for j in js), every=sorted({j["every"] for j in js}))
    return out


def markdown_table(agg: dict[tuple[str, str], dict], order: Sequence[str]) -> str:
    """One row per scenario and strategy: goodput median [min-max] against the plain runs beside
    each job and against the job's own plain steps (:func:`clean_plain_steps`), lost work and
    resume per failure (means), MB written per job (median)."""
    rows = []
    scenarios = list(dict.fromkeys(k[0] for k in agg))
    for sc in scenarios:
        for st in order:
            a = agg.get((sc, st))
            if a is None:
                continue
            g = a["goodput"]
            every = "/".join(map(str, a["every"]))
            if st == "ckpt-auto":
                plans = {f"{p['mode']}:{p['interval']}" for j in a["jobs"] for p in j["plans"]}
                every = ",".join(sorted(plans)) or "?"
            gi = a["goodput_in_job"]
            rows.append([sc, st, every, f"{g['median']:.3f}", f"{g['min']:.3f}-{g['max']:.3f}",
                         f"{gi['median']:.3f}" if gi["n"] else "-",
                         f"{gi['min']:.3f}-{gi['max']:.3f}" if gi["n"] else "-",
                         f"{a['failures']}", f"{a['lost_s']['mean']:.2f}",
                         f"{a['lost_it']['mean']:.1f}", f"{a['resume_s']['mean']:.2f}",
                         f"{a['bytes']['median'] / 1e6:.0f}"])
    return harness.table(["scenario", "strategy", "every", "goodput (median)", "range",
                          "in-job (median)", "in-job range", "failures", "lost s/failure", "lost it/failure",
                          "resume s/failure", "MB written/job"], rows, left=3)


# ---- main ----------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 8 s of work, one Poisson scenario, one repeat (~2-3 min)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--work-s", type=float, default=10.0,
                   help="useful work per job in seconds of plain training (default 10: the "
                        "default run takes about 30 min on the 2-core VM)")
    p.add_argument("--repeats", type=int, default=2, help="rounds over every scenario and strategy")
    p.add_argument("--trace-mtbf", type=float, default=10.0,
                   help="compress the traces in time to this MTBF, seconds (default 10)")
    p.add_argument("--poisson-mtbf", default="6,20", help="Poisson MTBFs, seconds (default 6,20)")
    p.add_argument("--traces", default=",".join(DEFAULT_TRACES), help="trace files in --trace-dir ('' none)")
    p.add_argument("--trace-dir", default=str(goodput.DEFAULT_TRACES))
    p.add_argument("--base-every", type=int, default=30, help="ckpt-deltas/topk base interval")
    p.add_argument("--inflight", type=int, default=4, help="pccheck: checkpoints in flight (K)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cold", action="store_true",
                   help="restart in a fresh interpreter (pays the imports) instead of a fork of a "
                        "pre-imported zygote")
    p.add_argument("--no-malloc-env", action="store_true",
                   help="do not re-execute with harness.MALLOC_ENV set (glibc's defaults)")
    p.add_argument("--dir", default=None, help="parent of the temp dir (default: the system's)")
    p.add_argument("--timeout-factor", type=float, default=15.0,
                   help="a job gives up after this many times --work-s (+120 s): a failure rate "
                        "its restarts cannot outrun never finishes (default 15)")
    p.add_argument("--json", metavar="OUT", help="write every job and the aggregates here")
    p.add_argument("--model", default=" ".join(MODEL_ARGS), help="tools/bench_delta.py model flags")
    a = p.parse_args(argv)
    if a.quick:
        a.work_s, a.repeats, a.traces, a.poisson_mtbf = 8.0, 1, "", "4"
    a.strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    bad = [s for s in a.strategies if s not in STRATEGIES]
    if bad or not a.strategies:
        p.error(f"unknown strategies {bad}; known: {', '.join(STRATEGIES)}")
    a.poisson_mtbf = [float(x) for x in a.poisson_mtbf.split(",") if x.strip()]
    a.traces = [t for t in a.traces.split(",") if t.strip()]
    a.model_args = a.model.split()
    if a.work_s <= 0 or a.repeats < 1 or a.trace_mtbf <= 0 or any(m <= 0 for m in a.poisson_mtbf):
        p.error("--work-s, --repeats, --trace-mtbf and --poisson-mtbf must be positive")
    return a


def machine_line() -> str:
    m = harness.machine()
    return f"{m['cpus']} CPUs, load average {m['load average']}, python {m['python']}, " \
           f"torch {m['torch']}, ckptstore {m['ckptstore']}"


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] in ("--child", "--calibrate", "--zygote"):
        cfg = json.loads(sys.argv[2])
        if sys.argv[1] == "--zygote":
            zygote_main()
        else:
            (child_main if sys.argv[1] == "--child" else calibrate_main)(cfg)
        return 0
    a = parse_args(argv)
    # (re-executes this script: only when run as one, not when main() is called with argv)
    malloc = harness.ensure_malloc_env(__file__, a.no_malloc_env or argv is not None)
    scenarios = make_scenarios(Path(a.trace_dir), a.traces, a.trace_mtbf, a.poisson_mtbf)
    tmp = Path(tempfile.mkdtemp(prefix="bench_goodput-", dir=a.dir))
    t_start = time.time()
    load_before = os.getloadavg()
    zygote = None
    try:
        zygote = None if a.cold else Zygote(child_env(a.threads), tmp, a.model_args)
        print(f"bench_goodput: {machine_line()}; malloc: {malloc}", flush=True)
        calib = run_calibration(a, tmp)
        iterations = max(10, round(a.work_s / calib["step_s"]))
        print("calibration: " + ", ".join(f"{k} {v * 1e3:.1f} ms" if k.endswith("_s") else f"{k} {v}"
                                          for k, v in calib.items()), flush=True)
        print(f"{iterations} iterations per job; scenarios: {', '.join(s.name for s in scenarios)}; "
              f"{a.repeats} round(s)", flush=True)
        jobs: list[dict] = []
        plains: list[dict] = []
        reference: dict[int, str] | None = None
        n = 0  # jobs run
        base = {"model": a.model_args, "threads": a.threads, "iterations": iterations,
                "base_every": a.base_every, "inflight": a.inflight}
        seg = max(8, iterations // 4)

        def plain(its: int, label: str) -> JobResult:
            d = tmp / f"plain-{label}"
            d.mkdir()
            pr = run_job(dict(base, iterations=its, strategy="plain", dir=str(d), scenario="-",
                              every=0), [], None, timeout_s=20 * a.work_s + 120, zygote=zygote)
            shutil.rmtree(d, ignore_errors=True)
            if pr.errors or not pr.hashes:
                raise RuntimeError(f"plain run failed: {pr.errors}")
            bad = [i for i, h in pr.hashes.items() if reference is not None and reference.get(i) != h]
            if bad:
                raise RuntimeError(f"training is not deterministic across processes (iterations "
                                   f"{bad[:5]}): nothing to verify restores against")
            # without its first step: a fresh process' warm-up (the jobs pay theirs, after every
            # start, as part of resuming; it is no part of the plain step)
            step = statistics.fmean(st[1] for st in pr.steps[1:])
            plains.append({"label": label, "iterations": its, "step_plain_s": step,
                           "step_plain_median_s": statistics.median(st[1] for st in pr.steps)})
            return pr

        # the reference: one full plain run (a hash per iteration); then a plain segment of
        # ``seg`` iterations before every job and after the last: a job's plain step is the mean
        # of its two neighbours' (the machine's load drifts: a plain run per round is not enough)
        reference = dict(plain(iterations, "reference").hashes)
        print(f"reference run: plain step {plains[-1]['step_plain_s'] * 1e3:.1f} ms (mean); load "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        plain(seg, "first")
        before = plains[-1]["step_plain_s"]
        for rep in range(a.repeats):
            for si, sc in enumerate(scenarios):
                fails = failure_schedule(sc, a.seed, rep, a.timeout_factor * a.work_s + 120)
                k = (rep + si) % len(a.strategies)
                for st in a.strategies[k:] + a.strategies[:k]:
                    n += 1
                    d = tmp / f"job-{n}"
                    d.mkdir()
                    cfg = dict(base, strategy=st, dir=str(d), scenario=sc.name, mtbf_s=sc.mtbf_s,
                               repeat=rep, every=every_for(st, calib, sc.mtbf_s))
                    r = run_job(cfg, fails, reference, timeout_s=a.timeout_factor * a.work_s + 120,
                                zygote=zygote)
                    shutil.rmtree(d, ignore_errors=True)
                    plain(seg, f"after-{n}")
                    after = plains[-1]["step_plain_s"]
                    step_plain, before = (before + after) / 2, after
                    s = job_summary(r, step_plain)
                    s["mtbf_s"] = sc.mtbf_s
                    s["schedule_s"] = [t for t in fails if t <= r.wall_s]  # (goodput.py rebuilds the rest)
                    s["load_avg"] = os.getloadavg()[0]
                    jobs.append(s)
                    print(f"  {sc.name:24s} {st:15s} every {s['every']:3d}: goodput {s['goodput']:.3f} "
                          f"(in-job {s['goodput_in_job']:.3f}, {s['clean_steps']} clean steps), "
                          f"{s['failures']} failures, lost {s['lost_s_per_failure']:.2f} s, resume "
                          f"{s['resume_s_per_failure']:.2f} s, {s['bytes_written'] / 1e6:.0f} MB; plain "
                          f"{step_plain * 1e3:.0f} ms; load {s['load_avg']:.1f}"
                          + (f"  ERRORS: {r.errors}" if r.errors else ""), flush=True)
        agg = aggregate(jobs)
        print()
        print(f"bench_goodput, {time.strftime('%Y-%m-%d %H:%M')}, {machine_line()} "
              f"(at the start: {load_before[0]:.2f}); {iterations} iterations of "
              f"{statistics.median(j['step_plain_s'] for j in jobs) * 1e3:.0f} ms (median) per job; "
              f"{a.repeats} round(s); every N by Young/Daly on the calibrated all-in cost")
        print(markdown_table(agg, a.strategies))
        verdicts = goodput_targets.judge(jobs)
        if verdicts:
            print("\ntargets (tools/goodput_targets.py):")
            print(goodput_targets.verdict_table(verdicts))
        errors = [(j["scenario"], j["strategy"], j["errors"]) for j in jobs if j["errors"]]
        if a.json:
            doc = {"tool": "bench_goodput", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "machine": machine_line(), "malloc": malloc, "load_at_start": load_before,
                   "duration_s": time.time() - t_start, "args": {k: v for k, v in vars(a).items()},
                   "calibration": calib, "iterations": iterations, "plain": plains,
                   "scenarios": [{"name": s.name, "mtbf_s": s.mtbf_s} for s in scenarios],
                   "jobs": jobs,
                   "aggregate": [{"scenario": k[0], "strategy": k[1],
                                  **{m: v for m, v in a_.items() if m != "jobs"}}
                                 for k, a_ in agg.items()]}
            Path(a.json).write_text(json.dumps(doc, indent=1, default=str))
            print(f"\njson: {a.json}")
        print(f"duration {time.time() - t_start:.0f} s")
        if errors:
            print(f"ERRORS (verification or runs): {errors}", file=sys.stderr)
            return 1
        return 0
    finally:
        if zygote is not None:
            zygote.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
