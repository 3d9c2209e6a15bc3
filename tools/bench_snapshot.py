#!/usr/bin/env python3
"""bench_snapshot: what a snapshot every N steps costs training, ckptstore beside the PCcheck- and
CheckFreq-style baselines, interleaved in one process (issue 30, item 4).

One GPT-style model (tools/bench_delta.py's, random weights, on the CPU or ``--device cuda``)
trains; every strategy takes a snapshot of parameters + AdamW state every ``--every`` steps and
persists it durably in the background:

=================  ===============================================================================
plain              no checkpoint (the reference step)
pccheck            tools/goodput_peers.py's PCcheck-style baseline: the optimizer step, then a copy
                   into one of K reused staging buffers in the step (the stall), one writer thread
                   (O_DIRECT + fsync, atomically renamed metadata)
checkfreq          the same, but the copy runs on a thread while the next forward and backward run
                   and the next optimizer step waits for it (CheckFreq's snapshot rule)
ckpt               ``Checkpointer(policy="snapshots", snapshot_every=N)``: the overlapped snapshot
                   (the default, ``overlap=True``: the same rule as checkfreq), then hashing, lz4,
                   dedup and the append + fsync + commit in the store's persister
ckpt-copy          the same with ``overlap=False`` (the copy is done before ``step`` returns)
ckpt-plain         ``ckpt`` with the store's older snapshot staging (``--strategies`` only; not
                   in the default set): plain arena slices, whose bytes the log copies into its
                   O_DIRECT staging buffer, and an lz4 trial of every chunk (the path before
                   snapshots were staged in chunk images), for before/after runs side by side
=================  ===============================================================================

Rounds rotate the order; in each, every strategy trains ``--block`` steps (several snapshots) and
then waits until its last snapshot is durable. Per strategy:

* step: mean wall time of a step (forward, backward and the strategy's ``step``) over its blocks,
  and its ratio to plain's mean in the same round (median and min-max of the rounds);
* per snapshot: (mean step - plain mean step) x N, what one snapshot costs training in all (stall,
  waits and contention with the background work on the same cores);
* stall: the median over snapshots of the snapshot step's time plus the next step's, less two
  plain median steps (where a copy shows up: its own step, or the next step's wait);
* background CPU per MB: CPU seconds of every thread but the training thread (process CPU time
  less the training thread's ``time.thread_time``, from the block's start until its last snapshot
  is durable), per MB of state snapshotted. Training runs ``--threads`` torch threads (1 by
  default: a core is left for the background work, a stand-in for a GPU node's idle host cores).

    python tools/bench_snapshot.py                 # ~3 min on the project's 2-core VM
    python tools/bench_snapshot.py --json /tmp/snap.json
    python tools/bench_snapshot.py --quick         # a smoke run: a tiny model, 1 round of 8 steps
    python tools/bench_snapshot.py --strategies pccheck,ckpt,ckpt-plain   # before/after staging
"""

from __future__ import annotations

import argparse

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from bench_delta import add_model_args, build, fwd_bwd, settle  # noqa: E402
from goodput_peers import PCcheck, adam_state_tensors  # noqa: E402
from harness import (add_standard_args, header, machine, parser, quick, rotated,  # noqa: E402
                     table, write_json)

STRATEGIES = ("plain", "pccheck", "checkfreq", "ckpt", "ckpt-copy")


def _quiet(*_a: Any, **_k: Any) -> None:
    pass


class CheckFreq(PCcheck):
    """PCcheck-style staging and writer, with the copy overlapped with the next forward and
    backward: the next ``step`` waits for it before the optimizer changes what it copies."""

    copying: threading.Thread | None = None

    def step(self, it: int) -> bool:
        if self.copying is not None:
            self.copying.join()
            self.copying = None
        self.opt.step()
        if it % self.every:
            return False
        k, slot = self.reserve()
        self.copying = threading.Thread(target=self.copy, args=(it, k, slot), daemon=True)
        self.copying.start()
        return True

    def drain(self) -> None:
        if self.copying is not None:
            self.copying.join()
            self.copying = None


class Runner:
    """One strategy's checkpointing on the shared model: ``step()`` applies the optimizer step
    (and snapshots when due, by the strategy's own step count); ``drain()`` waits until every
    snapshot is durable."""

    def __init__(self, name: str, model, opt, every: int, directory: str) -> None:
        self.name, self.opt = name, opt
        self.pc: PCcheck | None = None
        self.ck: Any = None
        self.last: Any = None
        self.done = threading.Event()
        self.durable = 0
        os.makedirs(directory, exist_ok=True)
        if name in ("pccheck", "checkfreq"):
            cls = CheckFreq if name == "checkfreq" else PCcheck
            self.pc = cls({"dir": directory, "every": every, "inflight": 4}, model, opt, self._emit)
        elif name.startswith("ckpt"):
            import ckptstore
            from ckptstore.torch import Checkpointer
            self.store = ckptstore.open(os.path.join(directory, "store"))
            self.ck = Checkpointer(self.store, model, opt, policy="snapshots", snapshot_every=every,
                                   mtbf_s=3600.0, overlap=name != "ckpt-copy")
            if name == "ckpt-plain":
                self.store.pipeline.snapshot_images = False
                self.store.engine.snapshot_trials = None
            self.ck.restore()  # an empty store: base 0 of the live state
        self.submitted = 0
        #: this strategy's own iteration count (the Checkpointer's iterations follow each other)
        self.it = 0

    def _emit(self, ev: str, **_kw: Any) -> None:
        if ev == "durable":
            self.durable += 1

    def step(self) -> bool:
        self.it += 1
        it = self.it
        if self.pc is not None:
            snap = self.pc.step(it)
        elif self.ck is not None:
            fut = self.ck.step(it)
            snap = fut is not None
            if snap:
                self.last = fut
        else:
            self.opt.step()
            snap = False
        self.submitted += snap
        return snap

    def drain(self) -> None:
        if isinstance(self.pc, CheckFreq):
            self.pc.drain()
        if self.pc is not None:
            while self.durable < self.submitted:
                time.sleep(0.001)
        if self.ck is not None:
            self.ck.flush()
            if self.last is not None:
                self.last.result()


def run_block(runner: Runner, model, margs, first_it: int, steps: int) -> dict:
    times, snaps = [], []
    cpu0, thr0 = time.process_time(), time.thread_time()
    for k in range(steps):
        it = first_it + k
        t0 = time.perf_counter()
        fwd_bwd(model, margs, it)  # (the batch: by the global count)
        snaps.append(runner.step())
        runner.opt.zero_grad()
        settle(margs)  # (a GPU's step timed to the end of its kernels)
        times.append(time.perf_counter() - t0)
    runner.drain()
    background = (time.process_time() - cpu0) - (time.thread_time() - thr0)
    return {"times": times, "snaps": snaps, "background_cpu_s": background}


def summarise(blocks: dict[str, list[dict]], every: int, nbytes: int) -> dict[str, dict]:
    plain_means = [statistics.fmean(b["times"]) for b in blocks["plain"]]
    plain_medians = [statistics.median(b["times"]) for b in blocks["plain"]]
    out = {}
    for name, bl in blocks.items():
        means = [statistics.fmean(b["times"]) for b in bl]
        ratios = [m / p for m, p in zip(means, plain_means)]
        stalls = []
        for b, pm in zip(bl, plain_medians):
            for i, snap in enumerate(b["snaps"][:-1]):
                if snap:
                    stalls.append(b["times"][i] + b["times"][i + 1] - 2 * pm)
        n_snaps = sum(sum(b["snaps"]) for b in bl)
        cpu = sum(b["background_cpu_s"] for b in bl)
        out[name] = {
            "step_ms_mean": 1e3 * statistics.fmean(means),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "per_snapshot_ms": 1e3 * statistics.median(
                [(m - p) * every for m, p in zip(means, plain_means)]) if name != "plain" else 0.0,
            "stall_ms_median": 1e3 * statistics.median(stalls) if stalls else 0.0,
            "snapshots": n_snaps,
            "background_cpu_ms_per_mb": 1e3 * cpu / (n_snaps * nbytes / 1e6) if n_snaps else 0.0,
        }
    return out


def model_parser(doc: str) -> argparse.ArgumentParser:
    """The snapshot tools' parser: bench_delta's model flags, defaulting to bench_goodput's model
    (4.5M parameters, 53.7 MB of model + AdamW state, 1 training thread)."""
    ap = parser(doc)
    add_model_args(ap)
    ap.set_defaults(layers=3, dim=256, heads=4, vocab=8192, ctx=32, batch=4, threads=1)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = model_parser(__doc__)
    ap.add_argument("--every", type=int, default=4, help="steps between snapshots (default 4)")
    ap.add_argument("--device", default="cpu",
                    help="where the model trains: cpu, or cuda (the snapshot is a copy to host "
                         "memory; each step timed to the end of its kernels on the training "
                         "stream; tools/device_check.sh)")
    ap.add_argument("--block", type=int, default=24, help="steps per strategy per round")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--dir", default=None, help="parent of the temp dir (default: the system's)")
    add_standard_args(ap, rounds=6, rounds_help="rounds, the order rotated each round (after an "
                      "uncounted warm-up round)", quick_help="a smoke run: a 1-layer model of dim "
                      "64, 1 round of 8 steps")
    a = ap.parse_args(argv)
    quick(a, ap, layers=1, dim=64, heads=2, vocab=1024, rounds=1, block=8)
    names = a.strategies.split(",")
    if "plain" not in names:
        names.insert(0, "plain")
    torch.set_num_threads(a.threads)
    work = tempfile.mkdtemp(prefix="bench-snapshot-", dir=a.dir)
    try:
        model, opt = build(a)
        nbytes = sum(t.numel() * t.element_size() for t in adam_state_tensors(model, opt))
        runners = {n: Runner(n, model, opt, a.every, os.path.join(work, n)) for n in names}
        mach = machine()
        on = "" if a.device == "cpu" else f" on {torch.cuda.get_device_name()}"
        print(header(f"bench_snapshot: {a.threads} training thread(s){on}; {nbytes / 1e6:.1f} MB of "
                     f"parameters + AdamW state, a snapshot every {a.every} steps, {a.rounds} "
                     f"rounds of {a.block} steps per strategy", mach))
        blocks: dict[str, list[dict]] = {n: [] for n in names}
        it = 1
        for r in range(a.rounds + 1):  # round 0 warms every strategy up and is not counted
            for n in rotated(names, r):
                b = run_block(runners[n], model, a, it, a.block)
                it += a.block
                if r:
                    blocks[n].append(b)
        res = summarise(blocks, a.every, nbytes)
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
        print(table(["strategy", "step ms (mean)", "x plain (median, min-max)", "per snapshot ms",
                     "stall ms (median)", "background CPU ms/MB"],
                    [[n, f"{s['step_ms_mean']:.1f}",
                      f"{s['ratio_median']:.3f} ({s['ratio_min']:.3f}-{s['ratio_max']:.3f})",
                      f"{s['per_snapshot_ms']:.1f}", f"{s['stall_ms_median']:.1f}",
                      f"{s['background_cpu_ms_per_mb']:.2f}"] for n, s in
                     ((n, res[n]) for n in names)]))
        write_json(a.json, "bench_snapshot", a, mach, blocks, res, bytes=nbytes)
        for rn in runners.values():
            if rn.ck is not None:
                rn.ck.close()
                rn.store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
