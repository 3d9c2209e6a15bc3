"""Benchmark: a multi-rank job store under data-parallel training, beside torch.distributed.checkpoint.

For each world size (default 1, 2, 4) a real gloo job is spawned on this machine; every rank
trains the GPT-style model of bench_delta.py under DistributedDataParallel (AdamW) and measures,
in one process per rank, interleaved where it matters:

1. step time without checkpoints, and with a ckptstore Checkpointer on a job store writing an exact
   delta every iteration (the default async path, group commit ``--group``; each rank writes only
   its share of the parameters) -> the step-time ratio, and bytes each rank writes per iteration;
2. a full checkpoint of model + optimizer: ``Checkpointer.save_base`` (a global commit) against
   ``torch.distributed.checkpoint.save`` (its default planner also writes replicated tensors once,
   split among the ranks) -> seconds, bytes per rank;
3. restoring it into the live model and optimizer: ``Checkpointer.restore`` (every rank reads
   every rank's part and merges) against ``dcp.load`` in place; and restoring a delta iteration
   (base + ``--k`` deltas replayed).

Times are medians over ``--rounds`` (``--repeat``) repeats; each collective operation is timed on
rank 0 between two barriers. On a 2-core machine 2 and 4 ranks oversubscribe the cores (each rank gets
max(1, cores // world) torch threads): the ratios say how the store's costs compare with the
job's own at the same contention, not how a real cluster scales.

    python tools/bench_multirank.py [--ranks 1,2,4] [--iters 8] [--k 8] [--rounds 3] [--json OUT] [--quick]
                                    [--dir /tmp/bench_multirank] [--layers 4 --dim 256 --vocab 8192]
"""

from __future__ import annotations

import argparse
import datetime
import json
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
from harness import (add_standard_args, dir_bytes, header, machine, parser, quick,  # noqa: E402
                     table, timed_between, write_json)


def rank_main(rank: int, world: int, args: argparse.Namespace, work: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench_delta import build
    from ckptstore.torch import Checkpointer

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    barrier = dist.barrier
    torch.manual_seed(0)
    model, opt = build(args)
    ddp = DDP(model)

    def batch(it: int):
        g = torch.Generator().manual_seed(10_000 * rank + it)
        return torch.randint(0, args.vocab, (args.batch, args.ctx), generator=g)

    def train_step(it: int, ck=None) -> float:
        t0 = time.perf_counter()
        idx = batch(it)
        logits = ddp(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab),
                                                 idx[:, 1:].reshape(-1))
        loss.backward()
        if ck is not None:
            ck.step(it)
        else:
            opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    out: dict = {"world": world}
    it = 0
    for _ in range(2):  # warm-up
        it += 1
        train_step(it)
    plain = []
    for _ in range(args.iters):
        it += 1
        plain.append(train_step(it))

    store_path = os.path.join(work, "job")
    store = ckptstore.open(store_path, "a", process_group=dist.group.WORLD, commit_timeout=600)
    ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=10**9,
                      group_commit=args.group)
    ck.save_base(it).result()  # the chain's base (partitioned)
    ckpt = []
    first_delta = it + 1
    for _ in range(args.iters):
        it += 1
        ckpt.append(train_step(it, ck))
    plain2 = []
    # plain steps after the checkpointed ones (interleaving: the machine may drift); the
    # Checkpointer's chain ends here, so the next save below is a base again
    ck.flush()
    last_delta = it
    for _ in range(args.iters):
        it += 1
        plain2.append(train_step(it))
    written = [store.info(i, rank=rank).written_bytes for i in range(first_delta, last_delta + 1)]
    out["plain_step"] = statistics.median(plain + plain2)
    out["ckpt_step"] = statistics.median(ckpt)
    out["delta_bytes_rank"] = statistics.median(written)

    # full checkpoints: ckptstore (a partitioned base, one global commit) vs DCP
    saves, dcp_saves, dcp_bytes = [], [], 0
    base_bytes = []
    for r in range(args.rounds):
        it += 1
        train_step(it)  # every tensor changes: each save below writes a whole base
        it += 1
        saves.append(timed_between(lambda: ck.save_base(it).result(), barrier))  # durable
        base_bytes.append(store.info(it, rank=rank).written_bytes)
        d = os.path.join(work, f"dcp-{r}")
        dcp_saves.append(timed_between(lambda: dcp.save({"model": model.state_dict(),
                                                  "optim": opt.state_dict()}, checkpoint_id=d),
                                barrier))
        if rank == 0:
            dcp_bytes = dir_bytes(d)
    base_it = it
    out["save_s"] = statistics.median(saves)
    out["dcp_save_s"] = statistics.median(dcp_saves)
    out["base_bytes_rank"] = statistics.median(base_bytes)
    out["dcp_bytes_total"] = dcp_bytes

    # restore into the live objects: ckptstore (reads every part, merges) vs dcp.load in place
    loads, dcp_loads = [], []
    for r in range(args.rounds):
        loads.append(timed_between(lambda: ck.restore(base_it), barrier))
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}

        def dcp_restore() -> None:
            dcp.load(sd, checkpoint_id=os.path.join(work, f"dcp-{r}"))
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])

        dcp_loads.append(timed_between(dcp_restore, barrier))
    out["load_s"] = statistics.median(loads)
    out["dcp_load_s"] = statistics.median(dcp_loads)
    out["samples"] = {"plain_step": plain + plain2, "ckpt_step": ckpt, "save_s": saves,
                      "dcp_save_s": dcp_saves, "load_s": loads, "dcp_load_s": dcp_loads}
    # a delta iteration: the live state is base_it's again; the first step after a restore
    # writes a base (a new chain), then k deltas; restoring the last replays all k
    for _ in range(args.k + 1):
        it += 1
        train_step(it, ck)
    ck.flush()
    out["k"] = args.k
    out["delta_restore_s"] = timed_between(lambda: ck.restore(it), barrier)
    store.close()
    with open(os.path.join(work, f"result-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    os._exit(0)


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--k", type=int, default=8, help="deltas replayed by the delta restore")
    ap.add_argument("--group", type=int, default=10, help="deltas per group commit")
    ap.add_argument("--dir", default="/tmp/bench_multirank")
    from bench_delta import add_model_args, build

    add_model_args(ap)  # the model of bench_delta.py, smaller by default (ranks share 2 cores)
    ap.set_defaults(layers=4, dim=256, vocab=8192)
    add_standard_args(ap, rounds=3, aliases=("--repeat",),
                      rounds_help="repeats of the full save and restore, ckptstore and DCP in turn",
                      quick_help="a smoke run: 1 and 2 ranks, a 2-layer model of dim 64, 3 "
                                 "iterations, k 2, 1 repeat")
    args = ap.parse_args()
    quick(args, ap, ranks="1,2", iters=3, k=2, rounds=1, layers=2, dim=64, vocab=1024)
    import torch.multiprocessing as mp

    model, _ = build(args)
    n = sum(p.numel() for p in model.parameters())
    mach = machine()
    print(header(f"bench_multirank: GPT {args.layers} layers, dim {args.dim}, vocab {args.vocab}: "
                 f"{n / 1e6:.1f}M parameters, AdamW, DDP over gloo; medians of {args.rounds}",
                 mach), flush=True)
    rows = []
    for world in [int(w) for w in args.ranks.split(",")]:
        work = os.path.join(args.dir, f"w{world}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, world, args, work)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(3600)
        per_rank = []
        for r in range(world):
            with open(os.path.join(work, f"result-{r}.json")) as f:
                per_rank.append(json.load(f))
        row = dict(per_rank[0])  # times: rank 0's (collectives are timed between barriers)
        for key in ("delta_bytes_rank", "base_bytes_rank"):
            row[key] = max(p[key] for p in per_rank)
            row[key.replace("_rank", "_mean")] = statistics.mean(p[key] for p in per_rank)
        rows.append(row)
        shutil.rmtree(work, ignore_errors=True)
        print(f"  {world} ranks done (load average {os.getloadavg()[0]:.1f})", flush=True)
    mib = 2**20
    print()
    print(table(["ranks", "plain step", "ckpt step", "ratio", "delta/rank max (mean)",
                 "base/rank max (mean)", "save", "DCP save", "load", "DCP load",
                 "restore base+k"],
                [[r["world"], f"{r['plain_step'] * 1e3:.0f} ms", f"{r['ckpt_step'] * 1e3:.0f} ms",
                  f"{r['ckpt_step'] / r['plain_step']:.2f}",
                  f"{r['delta_bytes_rank'] / mib:.2f} ({r['delta_bytes_mean'] / mib:.2f}) MiB",
                  f"{r['base_bytes_rank'] / mib:.1f} ({r['base_bytes_mean'] / mib:.1f}) MiB",
                  f"{r['save_s']:.2f} s", f"{r['dcp_save_s']:.2f} s", f"{r['load_s']:.2f} s",
                  f"{r['dcp_load_s']:.2f} s", f"{r['delta_restore_s']:.2f} s"] for r in rows],
                left=0))
    print(f"(DCP checkpoint size, all ranks: {rows[-1]['dcp_bytes_total'] / mib:.1f} MiB; "
          f"restore base+k: k = {rows[-1]['k']} deltas; whole parameters are owned by one rank, "
          "so the largest parameter bounds how evenly bytes split)")
    write_json(args.json, "bench_multirank", args, mach,
               {r["world"]: r.pop("samples") for r in rows}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
