"""Benchmark: the shadow follower of a multi-rank job store (format-spec/follower.md §7).

A real gloo job of ``--ranks`` ranks (spawned here) trains an MLP (``--width`` x ``--layers``,
AdamW, DDP, exact codec) for ``--iters`` iterations with ``Checkpointer(base_every=None)``: base 0
and a partitioned delta every iteration. Then, in this process:

1. a ``Follower(every=K)`` catches up with the whole job (seconds, deltas replayed per second:
   every rank's part of each delta), writing a base every K iterations;
2. restores, interleaved, with and without the follower store (a copy of the job without
   ``follower/``): a reader's merged ``load(t)`` of the newest iteration K - 1 deltas past a
   follower base (the worst case with the follower) and of the newest iteration, median of
   ``--repeat``, each from a fresh read-only open (page cache warm). Reported: seconds, where the
   load started (``load_base``), and the ratio without / with.

    python tools/bench_job_follower.py [--ranks 2] [--iters 100] [--every 25] [--width 256]
                                       [--layers 4] [--repeat 3] [--dir /tmp/bench_job_follower]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import ckptstore  # noqa: E402
from bench_follower import build  # noqa: E402  (the same MLP)
from ckptstore.follow import Follower  # noqa: E402


def rank_main(rank: int, world: int, args: argparse.Namespace, init: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptstore.torch import Checkpointer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model, opt = build(args)
    ddp = DDP(model)
    with ckptstore.open(args.path, "a", process_group=dist.group.WORLD) as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=None,
                          codec="exact", group_commit=10)
        ck.restore()
        g = torch.Generator().manual_seed(rank)
        for it in range(1, args.iters + 1):
            x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 16,
                                                                                generator=g)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            ck.step(it)
            opt.zero_grad()
        ck.close()
    dist.destroy_process_group()


def timed_load(path: str, t: int) -> tuple[float, tuple[str, int]]:
    t0 = time.perf_counter()
    with ckptstore.open(path, "r") as r:
        r.load(t)
        took = time.perf_counter() - t0
        return took, r.load_base(t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--every", type=int, default=25, help="K: the follower's base interval")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default="/tmp/bench_job_follower")
    args = p.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    args.path = os.path.join(args.dir, "job")
    model, _ = build(args)
    n = sum(q.numel() for q in model.parameters())
    print(f"MLP {args.layers}x{args.width}: {n / 1e6:.2f} M parameters, {args.ranks} ranks, "
          f"{args.iters} iterations, K={args.every}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    init = f"file://{os.path.join(args.dir, 'rendezvous')}"
    t0 = time.perf_counter()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, args, init))
             for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(3600)
        assert proc.exitcode == 0, proc.exitcode
    print(f"job trained in {time.perf_counter() - t0:.1f} s")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with Follower(args.path, every=args.every) as f:
        f.run(until=args.iters)
        stats = f.stats
    took = time.perf_counter() - t0
    print(f"follower caught up in {took:.2f} s: {stats.applied} deltas x {args.ranks} parts "
          f"({stats.applied / took:.1f} deltas/s), bases {stats.bases}")
    bare = os.path.join(args.dir, "bare")
    shutil.copytree(args.path, bare, ignore=lambda d, names: ["follower"] if d == args.path else [])
    worst = max(args.every - 1, args.iters // args.every * args.every - 1)
    torch.set_num_threads(os.cpu_count() or 1)
    for t in (worst, args.iters):
        runs: dict[str, list[float]] = {"follower": [], "none": []}
        where = {}
        for _ in range(args.repeat):  # interleaved
            for name, path in (("follower", args.path), ("none", bare)):
                s, where[name] = timed_load(path, t)
                runs[name].append(s)
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(f"load({t}): with follower {med['follower']:.3f} s (from {where['follower']}), "
              f"without {med['none']:.3f} s (from {where['none']}): "
              f"{med['none'] / med['follower']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
