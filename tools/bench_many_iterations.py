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
                                          [--rounds 1] [--json OUT] [--quick]
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckptstore  # noqa: E402
from harness import (Stats, add_standard_args, header, interleave, machine, parser,  # noqa: E402
                     quick, table, timed, write_json)
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


def open_and_list(path: str, mode: str, prefix: str, out: dict) -> tuple[Any, int, list[int]]:
    """Open the store in ``mode`` (its index warm), then time ``latest()`` (first and repeated
    calls) and ``iterations()``; the figures go in ``out`` (``prefix``: the reader's). Returns
    the open store, its latest iteration and its iterations."""
    t, s = timed(lambda: ckptstore.open(path, mode))
    out[f"open_{mode}_warm_s"] = t
    out[f"open_{mode}_warm_commits_replayed"] = s.last_scan.commits if s.last_scan else -1
    try:
        t, latest = timed(s.latest)
        out[f"{prefix}latest_first_s"] = t
        t, _ = timed(lambda: [s.latest() for _ in range(100)])
        out[f"{prefix}latest_repeat_s"] = t / 100
        t, its = timed(s.iterations)
        out[f"{prefix}iterations_s"] = t
    except BaseException:
        s.close()
        raise
    return s, latest, its


def measure(path: str, n: int, loads: int) -> dict[str, float | int]:
    rng = random.Random(0)
    out: dict[str, float | int | bool] = {}
    w, latest, its = open_and_list(path, "a", "", out)
    try:
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
    r, latest, its = open_and_list(path, "r", "reader_", out)
    try:
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
    ap = parser(__doc__)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--base-every", type=int, default=100, help="1: snapshots only")
    ap.add_argument("--loads", type=int, default=20)
    ap.add_argument("--dir", default="/dev/shm/bench_many" if os.path.isdir("/dev/shm") else
                    "/tmp/bench_many")
    ap.add_argument("--reuse", action="store_true", help="measure an existing store (skip build)")
    add_standard_args(ap, rounds=1, rounds_help="measurements of the store (each appends 11 "
                      "iterations)", quick_help="a smoke run: 2000 iterations")
    args = ap.parse_args()
    quick(args, ap, n=2000)
    mach = machine(dir=args.dir)
    if not args.reuse:
        secs = build(args.dir, args.n, args.base_every)
        mach["build"] = f"{args.n} iterations in {secs:.1f} s ({secs / args.n * 1e6:.0f} us each)"
    # (every measure() saves 11 iterations more: round r finds n + 11 r)
    res = interleave(["measure"], args.rounds,
                     lambda name, r: measure(args.dir, args.n + 11 * r, args.loads))
    print(header(f"bench_many_iterations: n={args.n} base_every={args.base_every}, {args.rounds} "
                 "round(s): median (min-max)", mach))
    rows = []
    for k in res.rows["measure"][0]:
        if k == "round":
            continue
        v = res.values("measure", k)
        if isinstance(v[0], float):
            st = Stats.of(v)
            rows.append([k, f"{st.median * 1e3:.2f} ms", f"{st.min * 1e3:.2f}-{st.max * 1e3:.2f}"])
        else:
            rows.append([k, f"{v[0]!s}", ""])
    print(table(["figure", "median", "min-max"], rows))
    write_json(args.json, "bench_many_iterations", args, mach, res,
               {k: Stats.of(res.values("measure", k)).as_dict()
                for k in res.rows["measure"][0] if k.endswith("_s")})
    if not args.reuse:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
