"""Bounded disk on a multi-rank job: automatic retention on a job store (issue 31, target 1).

A real gloo job of ``--world`` ranks (spawned processes on this machine) trains an MLP under
DistributedDataParallel (AdamW) with a ckptstore Checkpointer on a job store: an exact delta
every iteration (each rank writes its share), a base every ``--base-every`` iterations and
``retention=KeepLast(--keep-last) | KeepEvery(--keep-every)``, i.e. the job's own gc
right before each base. Rank 0 records, every ``--sample`` iterations, the job store's size on
disk and the wall time, every retention run (iterations removed, seconds training waited for
it), and a SHA-256 of the live model + optimizer state after every iteration. When the job has
ended, the parent opens the store with no process group and checks that the kept iterations are
exactly the ones the policy and the delta chains keep and that each one loads (replayed per
rank, parts merged) to the state the job had at that iteration, bit for bit.

    python tools/bench_job_retention.py [--iterations 5000] [--world 2] [--keep-last 50]
        [--keep-every 500] [--base-every 100] [--retention-every 1] [--dim 256] [--json OUT]
        [--dir DIR] [--quick]

Output: the size over time (a Markdown table), the retention runs summed, the check's result.
Nothing here is a peer comparison: it measures whether the disk stays bounded and what bounding
it costs the job (step time of the steps with and without a retention run).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import ckptstore  # noqa: E402
from ckptstore.multirank.job_gc import job_bytes  # noqa: E402
from ckptstore.ops.retention import KeepEvery, KeepLast  # noqa: E402
from ckptstore.storage.job_log import JobLayout  # noqa: E402
from harness import (Stats, add_standard_args, header, machine, parser, quick, table,  # noqa: E402
                     write_json)


def state_digest(state: Any) -> str:
    """SHA-256 over every tensor of a nested state, in key order (keys as strings), with each
    tensor's dtype and shape: equal for the live state and the same state loaded from a store."""
    h = hashlib.sha256()

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().contiguous().cpu()
            h.update(f"{prefix}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(f"{prefix}/{k}", x[k])
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}/{i}", v)

    walk("", state)
    return h.hexdigest()


def _job_bytes(path: str) -> int:
    # (job_bytes skips files that vanish while it walks: rank 0 empties gc-trash/ in a thread)
    return job_bytes(JobLayout(path))


def _model(dim: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, dim), torch.nn.GELU(),
                                torch.nn.Linear(dim, dim), torch.nn.GELU(),
                                torch.nn.Linear(dim, 16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _rank_main(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptstore.torch import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    model, opt = _model(args.dim)
    ddp = DDP(model)
    store = ckptstore.open(args.store, "a", process_group=dist.group.WORLD, commit_timeout=300.0)
    policy = KeepLast(args.keep_last) | KeepEvery(args.keep_every)
    ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=args.base_every,
                      retention=policy,
                      retention_every=args.retention_every)
    digests, samples, runs, steps = {}, [], [], []
    t_start = time.perf_counter()
    last_run = None
    for it in range(1, args.iterations + 1):
        g = torch.Generator().manual_seed(1000 * rank + it)
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 16, generator=g)
        t0 = time.perf_counter()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ck.step(it)
        opt.zero_grad()
        steps.append(time.perf_counter() - t0)
        run = store.last_retention
        if run is not None and run is not last_run:
            last_run = run
            runs.append({"before_base": run.after, "seconds": run.seconds,
                         "removed": len(run.report.removed) if run.report else 0,
                         "error": None if run.error is None else repr(run.error),
                         "step": it})
        if rank == 0:
            digests[it] = state_digest({"model": model.state_dict(),
                                        "optimizer": opt.state_dict()})
            if it % args.sample == 0 or it == args.iterations:
                samples.append({"iteration": it, "bytes": _job_bytes(args.store),
                                "seconds": time.perf_counter() - t_start})
    store.close()
    result = {"rank": rank, "samples": samples, "runs": runs, "steps": steps,
              "digests": digests if rank == 0 else {}}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def expected_kept(iterations: int, keep_last: int, keep_every: int, base_every: int) -> list[int]:
    """The iterations the policy selects, with what their delta chains need (each selected
    iteration's base, every ``base_every``, and the deltas between): the run's last
    ``keep_last`` and every multiple of ``keep_every``, plus chains (the Checkpointer's first
    base is iteration 0)."""
    its = range(0, iterations + 1)
    selected = set(its[-keep_last:]) | {i for i in its if i % keep_every == 0}
    kept = set()
    for t in selected:
        base = t - t % base_every
        kept.update(range(base, t + 1))
    return sorted(kept)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--iterations", type=int, default=5000)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--keep-last", type=int, default=50)
    ap.add_argument("--keep-every", type=int, default=500)
    ap.add_argument("--base-every", type=int, default=100)
    ap.add_argument("--retention-every", type=int, default=1,
                    help="the job's gc runs before every N-th base")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--sample", type=int, default=250, help="record the size every N iterations")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    add_standard_args(ap, rounds=None, quick_help="a smoke run: 60 iterations, a base every 10, "
                      "KeepLast(5) | KeepEvery(20), an MLP of d=32")
    args = ap.parse_args(argv)
    quick(args, ap, iterations=60, keep_last=5, keep_every=20, base_every=10, sample=10, dim=32)
    mach = machine()
    work = args.dir or tempfile.mkdtemp(prefix="bench_job_retention-")
    os.makedirs(work, exist_ok=True)
    args.store = os.path.join(work, "job")
    if os.path.exists(args.store):
        shutil.rmtree(args.store)
    import torch.multiprocessing as mp

    init = f"file://{os.path.join(work, 'rendezvous')}"
    if os.path.exists(init[7:]):
        os.unlink(init[7:])
    t0 = time.perf_counter()
    mp.start_processes(_rank_main, args=(args.world, init, args, work), nprocs=args.world,
                       start_method="spawn")
    wall = time.perf_counter() - t0
    ranks = [json.load(open(os.path.join(work, f"rank{r}.json"))) for r in range(args.world)]
    r0 = ranks[0]
    with ckptstore.open(args.store, "r") as reader:
        kept = reader.iterations()
        t1 = time.perf_counter()
        bad = [it for it in kept if it > 0 and
               state_digest({k: reader.load(it)[k] for k in ("model", "optimizer")})
               != r0["digests"][str(it)]]
        check_s = time.perf_counter() - t1
    want = expected_kept(args.iterations, args.keep_last, args.keep_every, args.base_every)
    sizes = [s["bytes"] for s in r0["samples"]]
    steps = r0["steps"]
    gc_steps = {run["step"] for run in r0["runs"]}
    plain = [s for i, s in enumerate(steps, 1) if i not in gc_steps]
    with_gc = [s for i, s in enumerate(steps, 1) if i in gc_steps]
    print(header(f"# bench_job_retention: {args.world} ranks, {args.iterations} iterations, exact "
                 f"delta every iteration, base every {args.base_every}, retention before every "
                 f"{args.retention_every}. base, KeepLast({args.keep_last}) | "
                 f"KeepEvery({args.keep_every}); MLP d={args.dim}", mach) + "\n")
    print(table(["iteration", "job store on disk (MB)", "elapsed (s)"],
                [[s["iteration"], f"{s['bytes'] / 1e6:.2f}", f"{s['seconds']:.1f}"]
                 for s in r0["samples"]], left=0))
    half = len(sizes) // 2
    print(f"\nsize: max {max(sizes) / 1e6:.2f} MB over the run, max {max(sizes[:half]) / 1e6:.2f} "
          f"MB in its first half and {max(sizes[half:]) / 1e6:.2f} MB in its second; "
          f"final {sizes[-1] / 1e6:.2f} MB")
    errors = [run for run in r0["runs"] if run["error"]]
    print(f"retention runs: {len(r0['runs'])} ({len(errors)} failed), "
          f"{sum(run['removed'] for run in r0['runs'])} iterations removed, training waited "
          f"{sum(run['seconds'] for run in r0['runs']):.1f} s in all "
          f"(median {statistics.median([run['seconds'] for run in r0['runs']] or [0]) * 1e3:.0f} "
          "ms per run)")
    print(f"step time (rank 0): {Stats.of(plain).show(1e3, '.2f', ' ms')} without a retention "
          f"run, {Stats.of(with_gc).show(1e3, '.1f', ' ms')} with one; whole job {wall:.1f} s")
    print(f"kept: {len(kept)} iterations; expected by the policy and the chains: {len(want)}; "
          f"{'the same' if kept == want else 'DIFFERENT: ' + str(sorted(set(kept) ^ set(want))[:20])}")
    print(f"check: {len(kept)} kept iterations loaded in {check_s:.1f} s, "
          f"{'every one bit-exact' if not bad else f'{len(bad)} DIFFER: {bad[:10]}'}")
    write_json(args.json, "bench_job_retention", args, mach, r0["samples"],
               {"steps_without_retention": Stats.of(plain).as_dict(),
                "steps_with_retention": Stats.of(with_gc).as_dict(), "max_bytes": max(sizes)},
               runs=r0["runs"], kept=kept, expected=want, bad=bad, wall_s=wall)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not bad and kept == want else 1


if __name__ == "__main__":
    sys.exit(main())
