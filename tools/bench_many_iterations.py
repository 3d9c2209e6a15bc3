"""Benchmark: a store with very many tiny iterations (issue 5's resource bound).

Builds a store of ``--n`` iterations (default 10**5) whose states are tiny (an int and a 16-float
tensor, stored inline in the manifest), optionally with gradient-delta records between base
snapshots (``--base-every``; deltas use group commit, flushed every 64), then times:

* open in mode "a" with a warm LMDB index (replay starts at the index's position),
* ``iterations()``, ``latest()`` (first call and repeated calls),
* ``load`` of random snapshots and ``load_record`` of random deltas,
* open in mode "r" with the writer's index (warm: validated, nothing replayed), then a reader's
  ``latest()``, ``iterations()`` and random loads,
* open in mode "r" without the index (``use_index=False``: the whole log replayed into memory),
* open in mode "a" after deleting the index (full rebuild from the log).

The build runs on /dev/shm by default (fsync is nearly free there), so the figures are CPU cost of
the store's code, not disk latency. They are noisy on a shared machine: take the median of a few runs.

    python tools/bench_many_iterations.py [--n 100000] [--base-every 100] [--dir /dev/shm/bench_many]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ckptstore  # noqa: E402
from ckptstore.storage.layout import Layout  # noqa: E402


def tiny_state(it: int) -> dict:
    return {"step": it, "w": np.full(16, it, dtype=np.float32)}


def build(path: str, n: int, base_every: int) -> float:
    """Write iterations 1..n; every ``base_every``-th (and the first) is a snapshot, the rest deltas
    (base_every <= 1: snapshots only). Returns seconds."""
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    with ckptstore.open(path, "a", segment_size=64 << 20) as w:
        for it in range(1, n + 1):
            if base_every <= 1 or it % base_every == 1:
                w.save(it, tiny_state(it))
            else:
                w.save_delta(it, {"g": np.full(4, it, dtype=np.float32)}, durable=False)
                if it % 64 == 0:
                    w.flush()
    return time.perf_counter() - t0


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(path: str, n: int, loads: int) -> dict[str, float | int]:
    rng = random.Random(0)
    out: dict[str, float | int | bool] = {}
    t, w = timed(lambda: ckptstore.open(path, "a"))
    out["open_a_warm_s"] = t
    out["open_a_warm_commits_replayed"] = w.last_scan.commits if w.last_scan else -1
    try:
        t, latest = timed(w.latest)
        out["latest_first_s"] = t
        t, _ = timed(lambda: [w.latest() for _ in range(100)])
        out["latest_repeat_s"] = t / 100
        t, its = timed(w.iterations)
        out["iterations_s"] = t
        out["iterations_n"] = len(its)
        assert latest == its[-1] == n, (latest, its[-1:], n)
        sample = rng.sample(its, min(len(its), loads))
        snaps = [i for i in sample if w.kind(i) == "snapshot"]
        snaps += [w.base_of(i) for i in sample if i not in snaps]
        snaps = snaps[:loads]
        deltas = [i for i in sample if w.kind(i) == "delta"]
        if snaps:
            t, _ = timed(lambda: [w.load(i) for i in snaps])
            out["load_snapshot_s"] = t / len(snaps)
        if deltas:
            t, _ = timed(lambda: [w.load_record(i) for i in deltas])
            out["load_record_delta_s"] = t / len(deltas)
        saves = [timed(lambda: w.save(i, tiny_state(i)))[0] for i in range(n + 1, n + 12)]
        out["save_first_after_open_s"] = saves[0]
        out["save_median_s"] = sorted(saves[1:])[5]
    finally:
        w.close()
    t, r = timed(lambda: ckptstore.open(path, "r"))
    out["open_r_warm_s"] = t
    out["open_r_warm_commits_replayed"] = r.last_scan.commits if r.last_scan else -1
    try:
        t, latest = timed(r.latest)
        out["reader_latest_first_s"] = t
        t, _ = timed(lambda: [r.latest() for _ in range(100)])
        out["reader_latest_repeat_s"] = t / 100
        t, its = timed(r.iterations)
        out["reader_iterations_s"] = t
        assert latest == its[-1], (latest, its[-1:])
        sample = rng.sample(its, min(len(its), loads))
        t, _ = timed(lambda: [r.load_record(i) for i in sample])
        out["reader_load_record_random_s"] = t / len(sample)
        snaps = [i for i in sample if r.kind(i) == "snapshot"] or [r.base_of(sample[0])]
        t, _ = timed(lambda: [r.load(i) for i in snaps])
        out["reader_load_snapshot_s"] = t / len(snaps)
        out["reader_index"] = type(r.index).__name__ == "ReaderIndex"
    finally:
        r.close()
    t, r = timed(lambda: ckptstore.open(path, "r", use_index=False))
    out["open_r_no_index_s"] = t
    r.close()
    shutil.rmtree(Layout(path).index_dir)
    t, w = timed(lambda: ckptstore.open(path, "a"))
    out["open_a_rebuild_s"] = t
    w.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--base-every", type=int, default=100, help="1: snapshots only")
    ap.add_argument("--loads", type=int, default=20)
    ap.add_argument("--dir", default="/dev/shm/bench_many" if os.path.isdir("/dev/shm") else
                    "/tmp/bench_many")
    ap.add_argument("--reuse", action="store_true", help="measure an existing store (skip build)")
    args = ap.parse_args()
    if not args.reuse:
        secs = build(args.dir, args.n, args.base_every)
        print(f"build: {args.n} iterations in {secs:.1f} s ({secs / args.n * 1e6:.0f} us each)")
    res = measure(args.dir, args.n, args.loads)
    load = os.getloadavg()[0]
    print(f"n={args.n} base_every={args.base_every} dir={args.dir} (load average {load:.2f})")
    for k, v in res.items():
        print(f"  {k:32s} {v * 1e3:10.2f} ms" if isinstance(v, float) else f"  {k:32s} {v!s:>10}")
    if not args.reuse:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
