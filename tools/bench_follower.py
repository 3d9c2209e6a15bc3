"""Benchmark: the shadow follower (ckptstore/follow.py, format-spec/follower.md).

An MLP (``--width`` x ``--layers``, AdamW, exact codec, async Checkpointer, group commit 10)
trained ``--iters`` iterations three ways, each in a fresh store:

1. ``bases``:    ``base_every=K``, no follower (the trainer writes a base every K iterations);
2. ``follower``: ``base_every=None`` and a follower process (``Follower(every=K)``, spawned)
                 writing a base every K iterations into ``<store>/follower/``;
3. ``deltas``:   ``base_every=None``, no follower (base 0 and deltas only: the floor of the
                 trainer's own cost, and the worst restore).

With ``--rounds N`` the three runs repeat N times, the order rotated each round. Reported: the
trainer's step time (forward + backward + ``ckpt.step``: median, mean, min-max) and its median's
ratio to ``deltas``'s; the follower's lag at steady state (the primary's durable iteration minus the
replica's iteration, sampled at every step after the first quarter; the follower publishes its
iteration after each ``step_once``, which replays what is committed in runs that end at each
base, so a catch-up shows as one jump); and the
restore time of the last iteration (a fresh read-only open + ``store.load``, median of 3, page
cache warm) and of the newest iteration K - 1 deltas past a base (the worst case), with the
base each started from.

Trainer and follower each run with one torch thread. On a machine with fewer free cores than two
the follower competes with the trainer for CPU: the step-time ratio then measures that
contention, not what a follower on its own hardware costs.

    python tools/bench_follower.py [--iters 200] [--every 50] [--width 512] [--layers 4] [--dir /tmp/bench_follower]
                                   [--rounds 1] [--json OUT] [--quick]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckptstore  # noqa: E402
from harness import (add_standard_args, header, interleave, machine, parser, quick,  # noqa: E402
                     table, write_json)
from ckptstore.follow import Follower  # noqa: E402
from ckptstore.torch import Checkpointer  # noqa: E402


def build(args):
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return model, opt


def follower_main(path: str, every: int, progress, stop) -> None:
    torch.set_num_threads(1)
    with Follower(path, every=every, poll_s=0.005, wait=True) as f:
        while not stop.is_set():
            n = f.step_once()
            if f.iteration is not None:
                progress.value = f.iteration
            if n == 0:
                time.sleep(0.005)
        f.flush()
        progress.value = f.iteration if f.iteration is not None else -1


def train(args, mode: str) -> dict:
    path = os.path.join(args.dir, mode)
    shutil.rmtree(path, ignore_errors=True)
    torch.set_num_threads(1)
    model, opt = build(args)
    store = ckptstore.open(path)
    ck = Checkpointer(store, model, opt, policy="every-iteration",
                      base_every=args.every if mode == "bases" else None,
                      codec="exact", group_commit=10)
    ck.restore()
    proc = progress = stop = None
    if mode == "follower":
        ctx = mp.get_context("spawn")
        progress, stop = ctx.Value("q", -1), ctx.Event()
        proc = ctx.Process(target=follower_main, args=(path, args.every, progress, stop))
        proc.start()
        while progress.value < 0:  # started (torch imported, replica built from base 0)
            time.sleep(0.01)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(args.batch, args.width, generator=g) for _ in range(8)]
    ys = [torch.randn(args.batch, 16, generator=g) for _ in range(8)]
    times, lags = [], []
    for it in range(1, args.iters + 1):
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(xs[it % 8]), ys[it % 8])
        loss.backward()
        ck.step(it)
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if progress is not None and it > args.iters // 4:
            durable = store.durable_iteration() or 0
            lags.append(max(0, durable - progress.value))
    ck.flush()
    wait_s = 0.0
    if proc is not None:
        assert progress is not None and stop is not None
        t0 = time.perf_counter()
        while progress.value < args.iters and time.perf_counter() - t0 < 600:
            time.sleep(0.005)
        wait_s = time.perf_counter() - t0  # the follower's tail after training ended
        stop.set()
        proc.join(600)
    ck.close()
    store.close()
    out: dict = {"seconds": times, "lags": lags, "tail_s": wait_s}
    for key, t in (("latest", args.iters), ("worst", worst_iteration(args))):
        restores = []
        for _ in range(3):
            t0 = time.perf_counter()
            with ckptstore.open(path, "r") as r:
                r.load(t)
                restores.append(time.perf_counter() - t0)
                where = r.load_base(t)
        out[key] = {"iteration": t, "seconds": statistics.median(restores), "from": list(where)}
    shutil.rmtree(path, ignore_errors=True)  # (the 4.2 M-parameter runs leave ~3 GiB each)
    return out


def worst_iteration(args) -> int:
    """The newest iteration <= --iters just before a multiple of K (K - 1 deltas past a base)."""
    return max(args.every - 1, (args.iters + 1) // args.every * args.every - 1)


MODES = ("deltas", "bases", "follower")


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--every", type=int, default=50, help="K: base interval (trainer or follower)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dir", default="/tmp/bench_follower")
    add_standard_args(p, rounds=1, rounds_help="rounds over the three modes, the order rotated "
                      "each round", quick_help="a smoke run: 24 iterations, K=8, a 2x64 MLP")
    args = p.parse_args(argv)
    quick(args, p, iters=24, every=8, width=64, layers=2, batch=8)
    os.makedirs(args.dir, exist_ok=True)
    model, _ = build(args)
    n = sum(q.numel() for q in model.parameters())
    mach = machine()
    print(header(f"bench_follower: MLP {args.layers}x{args.width}: {n / 1e6:.2f} M parameters "
                 f"(base ~{n * 12 / 2**20:.0f} MiB with AdamW state), {args.iters} iterations, "
                 f"K={args.every}, {args.rounds} round(s)", mach))
    res = interleave(MODES, args.rounds, lambda mode, r: train(args, mode))
    step = {m: res.stats(m) for m in MODES}
    floor = step["deltas"].median
    rows = []
    for m in MODES:
        lags = res.values(m, "lags")
        restore = {key: [row[key] for row in res.rows[m]] for key in ("latest", "worst")}
        rows.append([m, f"{step[m].median * 1e3:.2f}", f"{step[m].mean * 1e3:.2f}",
                     f"{step[m].min * 1e3:.2f}-{step[m].max * 1e3:.2f}",
                     f"{step[m].median / floor:.2f}",
                     f"{statistics.median(lags):.1f}" if lags else "-",
                     f"{max(lags)}" if lags else "-",
                     f"{statistics.median(res.values(m, 'tail_s')):.2f}",
                     *(f"{x[0]['iteration']}: {statistics.median(y['seconds'] for y in x):.3f} "
                       f"({x[-1]['from'][0]} {x[-1]['from'][1]})"
                       for x in (restore["latest"], restore["worst"]))])
    print(table(["mode", "step ms", "mean ms", "min-max ms", "ratio", "lag med", "lag max",
                 "tail s", "restore latest (s, from)", "restore worst (s, from)"], rows))
    write_json(args.json, "bench_follower", args, mach, res, res.aggregates())
    return 0


if __name__ == "__main__":
    sys.exit(main())
