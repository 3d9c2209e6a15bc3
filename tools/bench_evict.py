"""Benchmark: persisting exact gradient deltas with and without page-cache eviction (evict_written).

Each round opens a fresh store, saves a small base snapshot, then persists ``--deltas`` deltas of
``--mb`` MB (float32 noise, different every iteration, so nothing dedups) either with
``store.save_delta`` (synchronous, durable: write + fsync + commit, timed around the call) or with
``store.save_delta_async`` (the pipeline's ``persist_s`` and ``write_s`` from ``store.stats()``).
Rounds alternate evict_written True/False (the order rotated each round) so both see the same
machine state; the store of the
previous round is deleted first (its freed page cache is part of what this measures).

With ``--train N`` it also trains the GPT-style model of tools/bench_delta.py for N iterations
under the async Checkpointer (an exact delta every iteration) in each setting and reports the
pipeline's persist_s/write_s and the step time.

    python tools/bench_evict.py [--deltas 10] [--mb 109] [--rounds 3] [--train 0] [--dir /tmp/bench_evict]
                                [--json OUT] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckptstore  # noqa: E402
from bench_delta import add_model_args  # noqa: E402
from harness import (Samples, Stats, add_standard_args, header, interleave, machine,  # noqa: E402
                     parser, quick, write_json)


def make_delta(mb: float, parts: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = int(mb * 1e6 / 4 / parts)
    return {f"layer{k}.grad": torch.randn(n, generator=g) for k in range(parts)}


def bump(delta: dict[str, torch.Tensor]) -> None:
    """Change every value (in place, reusing the buffers) so no chunk repeats an earlier one."""
    for t in delta.values():
        t.add_(1.0)


def run(path: str, evict: bool, delta: dict, n: int, asynchronous: bool) -> dict[str, list[float]]:
    shutil.rmtree(path, ignore_errors=True)
    out: dict[str, list[float]] = {"call_s": [], "persist_s": [], "write_s": []}
    with ckptstore.open(path, evict_written=evict) as s:
        s.save(0, {"w": torch.zeros(16)})
        t_all = time.perf_counter()
        for i in range(1, n + 1):
            bump(delta)
            t = time.perf_counter()
            if asynchronous:
                s.save_delta_async(i, delta).result()
            else:
                s.save_delta(i, delta)
            out["call_s"].append(time.perf_counter() - t)
        out["total_s"] = [time.perf_counter() - t_all]
        for st in s.stats():
            out["persist_s"].append(st.persist_s)
            out["write_s"].append(st.write_s)
    shutil.rmtree(path, ignore_errors=True)
    return out


def train(path: str, evict: bool, args: argparse.Namespace) -> dict[str, list[float]]:
    from bench_delta import build, fwd_bwd
    from ckptstore.torch import Checkpointer

    shutil.rmtree(path, ignore_errors=True)
    model, opt = build(args)
    steps: list[float] = []
    with ckptstore.open(path, evict_written=evict) as s:
        ck = Checkpointer(s, model, opt, policy="every-iteration", base_every=10**9,
                          fingerprint_every=0)
        ck.restore()
        for it in range(1, args.train + 1):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            fwd_bwd(model, args, it)
            ck.step(it)
            steps.append(time.perf_counter() - t)
        s.flush()
        st = [x for x in s.stats() if x.kind == "delta"]
    shutil.rmtree(path, ignore_errors=True)
    return {"step_s": steps[2:], "persist_s": [x.persist_s for x in st][2:],
            "write_s": [x.write_s for x in st][2:]}


def fmt(xs: list[float]) -> str:
    return Stats.of(xs).show()


SETTINGS = ("evict_written=True", "evict_written=False")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--deltas", type=int, default=10)
    ap.add_argument("--mb", type=float, default=109.0)
    ap.add_argument("--dir", default="/tmp/bench_evict")
    ap.add_argument("--sleep", type=float, default=3.0, help="seconds between rounds")
    ap.add_argument("--train", type=int, default=0, help="Checkpointer iterations per setting")
    add_model_args(ap)
    add_standard_args(ap, rounds=3, rounds_help="rounds per setting, the order rotated each round",
                      quick_help="a smoke run: 3 deltas of 8 MB, 2 rounds, no sleep")
    args = ap.parse_args()
    quick(args, ap, deltas=3, mb=8.0, rounds=2, sleep=0.0, layers=2, dim=128, vocab=2048)
    if args.threads:
        torch.set_num_threads(args.threads)
    delta = make_delta(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in delta.values())
    mach = machine(malloc=f"MALLOC_MMAP_THRESHOLD_="
                          f"{os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}")
    print(header(f"bench_evict: {args.deltas} deltas of {nbytes / 1e6:.0f} MB, {args.rounds} "
                 "rounds per setting", mach))
    results: dict[str, Samples] = {}
    for asynchronous in (False, True):
        def persist(name: str, r: int) -> dict[str, list[float]]:
            time.sleep(args.sleep)
            evict = name == SETTINGS[0]
            got = run(os.path.join(args.dir, "s"), evict, delta, args.deltas, asynchronous)
            print(f"  round {r} {'async' if asynchronous else 'sync '} evict={evict!s:5}: "
                  f"total {got['total_s'][0]:.2f} s, per delta {fmt(got['call_s'])}", flush=True)
            return got

        path = "save_delta_async(...).result()" if asynchronous else "save_delta (durable)"
        res = results[path] = interleave(SETTINGS, args.rounds, persist)
        for name in SETTINGS:
            calls = res.values(name, "call_s")
            rate = nbytes * len(calls) / sum(calls) / 1e9
            print(f"{path:32} {name:19}: per delta {fmt(calls)} s ({rate:.2f} GB/s overall)"
                  + (f"; persist_s {fmt(res.values(name, 'persist_s'))}; write_s "
                     f"{fmt(res.values(name, 'write_s'))}" if res.values(name, "persist_s")
                     else ""))
    if args.train:
        def training(name: str, r: int) -> dict[str, list[float]]:
            time.sleep(args.sleep)
            return train(os.path.join(args.dir, "t"), name == SETTINGS[0], args)

        res = results["Checkpointer"] = interleave(SETTINGS, args.rounds, training)
        for name in SETTINGS:
            print(f"Checkpointer, {args.train} iterations x {args.rounds} {name:19}: "
                  f"step_s {fmt(res.values(name, 'step_s'))}; persist_s "
                  f"{fmt(res.values(name, 'persist_s'))}; write_s "
                  f"{fmt(res.values(name, 'write_s'))}")
    write_json(args.json, "bench_evict", args, mach, {k: v.rows for k, v in results.items()},
               {k: {name: {key: Stats.of(v.values(name, key)).as_dict()
                           for key in ("call_s", "persist_s", "write_s", "step_s")}
                    for name in SETTINGS} for k, v in results.items()})


if __name__ == "__main__":
    main()
