"""Benchmark: upload lag of a job store's remote tier at one delta per iteration.

Starts moto's S3 server on 127.0.0.1 (as bench_remote.py), then, ``--rounds`` times, rotating,
a real gloo job of ``--ranks`` ranks training bench_multirank's model (bench_delta.py's GPT at 4
layers, dim 256, vocab 8192, AdamW) under DistributedDataParallel with a Checkpointer writing an
exact delta every iteration, each one durable (``group_commit=1``: one global commit per
iteration) on a job store:

* ``local``: without a remote tier;
* ``remote``: with ``remote="s3://..."`` (each rank uploads its own stream, rank 0 writes a job
  HEAD every ``--head-interval`` seconds for what the ranks' stream HEADs cover).

Rank 0 samples, after every step, the job's newest globally committed iteration; a thread of this
process polls the newest job HEAD every 50 ms. **Lag** of iteration i: from the first sample on
rank 0 that sees i committed to the first poll whose job HEAD holds i (what survives losing the
machines). Reported: median and max lag over the iterations, the step time of both strategies
(median), the final job HEAD's iteration after close, and bytes uploaded per iteration.

moto is a Python server sharing this machine's cores with the ranks: the lag includes its CPU.

    python tools/bench_remote_job.py [--ranks 2] [--iters 30] [--rounds 2] [--head-interval 1]
                                     [--json OUT] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import ckptstore  # noqa: E402
from harness import (Stats, add_standard_args, header, interleave, machine, parser,  # noqa: E402
                     quick, write_json)


def rank_main(rank: int, world: int, args: argparse.Namespace, work: str, url: str | None,
              opts: dict) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench_delta import build
    from ckptstore.torch import Checkpointer

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    model, opt = build(args)
    ddp = DDP(model)
    store = ckptstore.open(os.path.join(work, "job"), "a", process_group=dist.group.WORLD,
                           commit_timeout=600, remote=url,
                           remote_options=opts if url is not None else None)
    ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=10**9, group_commit=1)
    steps, seen = [], []
    for it in range(1, args.iters + 1):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(10_000 * rank + it)
        idx = torch.randint(0, args.vocab, (args.batch, args.ctx), generator=g)
        logits = ddp(idx[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab),
                                          idx[:, 1:].reshape(-1)).backward()
        ck.step(it)
        opt.zero_grad()
        steps.append(time.perf_counter() - t0)
        seen.append((time.time(), store.latest()))
    t0 = time.perf_counter()
    store.close()
    close_s = time.perf_counter() - t0
    if rank == 0:
        with open(os.path.join(work, "result.json"), "w") as f:
            json.dump({"steps": steps, "seen": seen, "close_s": close_s}, f)
    dist.destroy_process_group()


def run(args: argparse.Namespace, work: str, url: str | None, opts: dict) -> dict:
    import torch.multiprocessing as mp

    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    polls: list[tuple[float, int | None]] = []
    stop = threading.Event()

    def poll() -> None:
        from ckptstore.remote.client import ObjectStore
        from ckptstore.remote.job_head import newest_job_head

        root = ObjectStore(url, opts) if url is not None else None
        while root is not None and not stop.wait(0.05):
            try:
                polls.append((time.time(), newest_job_head(root).latest))
            except ckptstore.CkptStoreError:
                pass  # no job HEAD yet
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, args, work, url, opts))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(3600)
    stop.set()
    poller.join()
    with open(os.path.join(work, "result.json")) as f:
        out = json.load(f)
    out["polls"] = polls
    return out


def lags(result: dict) -> list[float]:
    committed: dict[int, float] = {}
    for t, latest in result["seen"]:
        for i in range(1, (latest or 0) + 1):
            committed.setdefault(i, t)
    remote: dict[int, float] = {}
    for t, latest in result["polls"]:
        for i in range(1, (latest or 0) + 1):
            remote.setdefault(i, t)
    return [remote[i] - committed[i] for i in committed if i in remote]


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--head-interval", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp/bench_remote_job")
    from bench_delta import add_model_args, build
    from bench_remote import moto_s3

    add_model_args(ap)
    ap.set_defaults(layers=4, dim=256, vocab=8192)  # bench_multirank's model
    add_standard_args(ap, rounds=2, rounds_help="rounds of local and remote, the order rotated "
                      "each round", quick_help="a smoke run: 8 iterations, 1 round, a 2-layer "
                      "model of dim 64")
    args = ap.parse_args()
    quick(args, ap, iters=8, rounds=1, layers=2, dim=64, vocab=1024)
    from ckptstore.remote.client import ObjectStore
    from ckptstore.remote.job_head import newest_job_head

    os.makedirs(args.dir, exist_ok=True)
    with moto_s3(args.dir, bucket=None) as (s3, _, opts, _):
        opts["head_interval"] = args.head_interval
        model, _ = build(args)
        n = sum(p.numel() for p in model.parameters())
        mach = machine()
        print(header(f"bench_remote_job: GPT {args.layers} layers, dim {args.dim}, vocab "
                     f"{args.vocab}: {n / 1e6:.1f}M parameters, AdamW, DDP over gloo, "
                     f"{args.ranks} ranks; one durable exact delta per iteration; head_interval "
                     f"{args.head_interval} s", mach), flush=True)

        def one(name: str, r: int) -> dict:
            url = None
            if name == "remote":
                bucket = f"bench-{os.getpid()}-{r}"
                s3.create_bucket(Bucket=bucket)
                url = f"s3://{bucket}/job"
            res = run(args, os.path.join(args.dir, name), url, opts)
            if url is not None:
                res["final"] = newest_job_head(ObjectStore(url, opts)).latest
                objs = s3.list_objects_v2(Bucket=bucket).get("Contents", [])
                res["remote_bytes"] = sum(o["Size"] for o in objs)
                res["lags"] = lags(res)
            res["seconds"] = res["steps"][2:]  # (the first 2 steps left out)
            print(f"  round {r + 1} {name} done (load average {os.getloadavg()[0]:.1f})",
                  flush=True)
            return res

        samples = interleave(("local", "remote"), args.rounds, one)
        rows = samples.rows
        step = {k: samples.stats(k) for k in rows}
        all_lags = samples.values("remote", "lags")
        print(f"\nstep (first 2 left out): local {step['local'].show(1e3, '.0f', ' ms')}, remote "
              f"{step['remote'].show(1e3, '.0f', ' ms')} (ratio of the medians "
              f"{step['remote'].median / step['local'].median:.2f})")
        print(f"upload lag, committed -> in a job HEAD: median "
              f"{statistics.median(all_lags):.2f} s, max {max(all_lags):.2f} s over "
              f"{len(all_lags)} iterations")
        for x in rows["remote"]:
            lx = x["lags"]
            half = len(lx) // 2
            if half:  # a lag that grows means the upload falls behind
                print(f"  lag, first half of the iterations: median "
                      f"{statistics.median(lx[:half]):.2f} s; second half: "
                      f"{statistics.median(lx[half:]):.2f} s")
        for x in rows["remote"]:
            print(f"  close {x['close_s']:.2f} s (local: "
                  f"{statistics.median(y['close_s'] for y in rows['local']):.2f} s); final job "
                  f"HEAD iteration {x['final']} of {args.iters}; remote bytes "
                  f"{x['remote_bytes'] / 2**20:.1f} MiB "
                  f"({x['remote_bytes'] / args.iters / 2**20:.2f} MiB per iteration, the base "
                  "included)")
        write_json(args.json, "bench_remote_job", args, mach, samples,
                   {"step": {k: v.as_dict() for k, v in step.items()},
                    "lag": Stats.of(all_lags).as_dict()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
