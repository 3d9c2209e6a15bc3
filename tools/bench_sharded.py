#!/usr/bin/env python3
"""bench_sharded: sharded DCP saves and resharding loads, ckptstore.dcp against DCP's own files.

The state: a GPT-like model (token embedding ``--vocab`` x ``--dim``, ``--layers`` MLP blocks
``dim -> 4 dim -> dim``) sharded by FSDP2 (``fully_shard`` on a CPU gloo DeviceMesh, every
parameter a DTensor ``Shard(0)``) and its AdamW state (``exp_avg``, ``exp_avg_sq``: DTensors
``Shard(0)``; ``step``: a plain tensor), taken with ``get_state_dict``: 144 MiB in all at the
defaults. Every value is a pure function of the tensor's name and global index (set after one
AdamW step made the state), so a job at any world size knows what every shard must hold.

For each world size N in ``--ranks`` a real gloo job of N spawned processes saves the state
``--repeat`` times with both sides, interleaved, the side going first alternating:

* **ckptstore**: ``dcp.save(state, storage_writer=ckptstore.dcp.StorageWriter(js, 1))`` into a
  fresh job store opened before the clock (one global commit; durable when it returns);
* **DCP**: ``dcp.save(state, storage_writer=FileSystemWriter(dir, sync_files=True))`` into a
  fresh directory, then an fsync of the directory and its parent by rank 0 (DCP does not fsync
  the directory after renaming ``.metadata``), inside the clock.

Then for each pair N->M in ``--pairs`` a job of M ranks loads the last checkpoint saved at N into
its own state (the same model sharded over M ranks: resharding), ``--repeat`` times per side,
interleaved, **cold**: before every load rank 0 syncs and drops the page cache of both sides'
files (posix_fadvise DONTNEED). ckptstore's clock holds ``ckptstore.open(path, "r")`` +
``StorageReader`` + ``dcp.load`` + close, DCP's ``FileSystemReader`` + ``dcp.load``. Each
collective operation is timed on rank 0 between two barriers.

Bytes read per rank: ``rchar`` of /proc/self/io around the load (every byte the process read
through read/pread: tensor data, metadata, ckptstore's manifests and index), and for ckptstore
also the tensor bytes its reader read (``StorageReader.last_read_bytes``: whole store chunks);
against the ideal, the bytes of the shards that rank's destination holds (its DTensors' local
shards, the plain tensors whole). Checked outside the clocks after every load: each destination
shard equals the expected values bit for bit, on both sides.

Printed: the machine (CPUs, the 1-minute load average before, during and after), torch's
version, the state's size, one table of saves and one of loads with ``ckptstore / DCP`` ratios
(< 1: ckptstore takes less) and the read/ideal ratios per rank. On 2 cores, 2 and 4 ranks oversubscribe the
CPUs (each rank gets max(1, cores // N) torch threads): the figures compare the two storage layers
at the same contention, not how a cluster scales. Work files go under ``--dir`` (a temporary
directory, removed at the end).

``--deltas``: per-iteration sharded training through the Checkpointer instead (issue 14). For
each world size N in ``--ranks`` a gloo job of N ranks trains a small FSDP2 MLP language model
(``--vocab`` 4096, ``--dim`` 256, ``--layers`` 2, an untied head: 3.2M parameters; AdamW; each
rank its own ``--batch`` x ``--ctx`` tokens) twice, in alternating blocks of ``--block`` timed
steps for ``--rounds`` rounds, the side going first alternating: plain, and through a
Checkpointer on a job store (exact codec, asynchronous, group_commit=1: a delta of the rank's
local gradient shards every step on base 0; each checkpointed block ends with an untimed flush
whose duration is reported). Reported: the median step time (rank 0) of each and their ratio,
the bytes written per iteration per rank (``AsyncStats.written_bytes``) against the rank's local
gradient bytes, the persister's CPU per iteration. Then one more step T + 1 (a base by the
schedule) and a DCP checkpoint of the same state. For each pair N->M in ``--delta-pairs`` a job
of M ranks restores into fresh FSDP2 objects, cold, ``--repeat`` times each, interleaved: the
newest iteration (a base: each rank its own part at M == N, else assembled from every part and
resharded), iteration T (base 0 + T replayed deltas), and DCP's get_state_dict + ``dcp.load`` +
set_state_dict; each restored state is gathered and checked bit for bit outside the clock. The
machine's limits (CPUs, MemAvailable, the work directory's O_DIRECT write bandwidth, load
averages) head the report.

    python tools/bench_sharded.py                            # 1, 2, 4 ranks, 144 MiB, 3 repeats
    python tools/bench_sharded.py --quick                    # a smoke run: 1 and 2 ranks, small
                                                             # model (vocab 2048, 1 layer), 1 repeat
    python tools/bench_sharded.py --deltas                   # per-iteration deltas, ~2-3 min
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
from statistics import median as med
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from harness import (MiB, Stats, add_standard_args, dir_bytes, direct_write_bandwidth,  # noqa: E402
                     evict_files, fsync_path, header, load_summary, machine, parser, quick,
                     rotated, table, timed_between, write_json)
from bench_sharded_state import build_state, check, fill, ideal_bytes, rchar, zero  # noqa: E402,F401

SIDES = ("ckptstore", "dcp")
DEFAULT_PAIRS = "1:1,2:2,4:4,1:4,4:1,2:4,4:2"
DEFAULT_DELTA_PAIRS = "1:1,2:2,4:4,1:2,2:4,4:1"
RESTORES = ("base", "deltas", "dcp")  # --deltas: the restores compared (restore_job)


# ---- one rank of a job -------------------------------------------------------------------------

def save_job(rank: int, world: int, args: argparse.Namespace, work: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import ckptstore
    import ckptstore.dcp as cdcp

    _, _, state = build_state(world, args)
    out: dict = {"ckptstore": [], "dcp": [], "state_bytes": None}
    base = os.path.join(work, f"save{world}")
    for rep in range(args.repeat):
        order = rotated(SIDES, rep)
        for side in order:
            target = os.path.join(base, f"{side}-{rep}")
            if side == "ckptstore":
                js = ckptstore.open(target, "a", process_group=dist.group.WORLD,
                                    commit_timeout=600.0)
                s = timed_between(lambda: dcp.save(state, storage_writer=cdcp.StorageWriter(js, 1)),
                           dist.barrier)
                js.close()
            else:
                def save() -> None:
                    dcp.save(state, storage_writer=FileSystemWriter(target, sync_files=True))
                    if rank == 0:
                        fsync_path(target)
                        fsync_path(os.path.dirname(target))
                s = timed_between(save, dist.barrier)
            out[side].append(s)
        dist.barrier()
        if rank == 0:
            out.setdefault("disk", {})
            for side in SIDES:
                out["disk"][side] = dir_bytes(os.path.join(base, f"{side}-{rep}"))
            if rep < args.repeat - 1:  # keep the last repeat's checkpoints for the loads
                for side in SIDES:
                    shutil.rmtree(os.path.join(base, f"{side}-{rep}"))
        dist.barrier()
    out["ideal"] = ideal_bytes(state)
    return out


def load_job(rank: int, world: int, args: argparse.Namespace, work: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    import ckptstore
    import ckptstore.dcp as cdcp

    _, _, state = build_state(world, args)
    ideal = ideal_bytes(state)
    out: dict = {"ideal": ideal, "pairs": {}}
    for n in args.sources[world]:
        base = os.path.join(work, f"save{n}")
        src = {side: os.path.join(base, f"{side}-{args.repeat - 1}") for side in SIDES}
        res: dict = {side: {"s": [], "rchar": [], "tensor_bytes": [], "bad": []} for side in SIDES}
        for rep in range(args.repeat):
            order = rotated(SIDES, rep)
            for side in order:
                zero(state)
                if rank == 0:
                    evict_files(*src.values())
                dist.barrier()
                r0 = rchar()
                holder: dict = {}
                if side == "ckptstore":
                    def load() -> None:
                        with ckptstore.open(src[side], "r") as js:
                            reader = cdcp.StorageReader(js, 1)
                            dcp.load(state, storage_reader=reader)
                            holder["tensor_bytes"] = reader.last_read_bytes
                else:
                    def load() -> None:
                        dcp.load(state, storage_reader=FileSystemReader(src[side]))
                s = timed_between(load, dist.barrier)
                res[side]["s"].append(s)
                res[side]["rchar"].append(rchar() - r0)
                res[side]["tensor_bytes"].append(holder.get("tensor_bytes"))
                res[side]["bad"] += check(state, world)
        out["pairs"][n] = res
    return out


# ---- per-iteration sharded deltas through the Checkpointer (--deltas) -------------------------

def build_lm(world: int, args: argparse.Namespace) -> tuple[Any, Any]:
    """The --deltas model: a small MLP language model (token embedding, ``--layers`` blocks
    ``dim -> 4 dim -> dim``, an untied output head), every module sharded by FSDP2 over a CPU
    mesh of ``world`` ranks, and AdamW. The same initial values at every world size."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(),
                            nn.Linear(4 * args.dim, args.dim)) for _ in range(args.layers)]
    model = nn.Sequential(nn.Embedding(args.vocab, args.dim), *blocks,
                          nn.Linear(args.dim, args.vocab, bias=False))
    for m in model:
        if any(True for _ in m.parameters()):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def lm_step(model: Any, opt: Any, ck: Any, it: int, rank: int, args: argparse.Namespace) -> Any:
    """One training step of rank ``rank`` on its own batch (``--batch`` sequences of ``--ctx``
    tokens): forward, backward, then ``ck.step`` (its future) or the plain optimizer step."""
    import torch

    g = torch.Generator().manual_seed(100_000 * rank + it)
    x = torch.randint(0, args.vocab, (args.batch, args.ctx + 1), generator=g)
    logits = model(x[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), x[:, 1:].reshape(-1)).backward()
    fut = ck.step(it) if ck is not None else opt.step()
    opt.zero_grad()
    return fut


def full_state(model: Any, opt: Any) -> dict:
    """Every DTensor of the model and optimizer state gathered whole (collective)."""
    from torch.distributed.tensor import DTensor

    def full(v: Any) -> Any:
        return v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return {"model": {k: full(v) for k, v in model.state_dict().items()},
            "optimizer": {i: {k: full(v) for k, v in s.items()}
                          for i, s in opt.state_dict()["state"].items()}}


def same_state(a: Any, b: Any) -> bool:
    """Tensors nested in dicts equal bit for bit (dtype, shape, bytes)."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                        b.contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same_state(a[k], b[k]) for k in a)
    return bool(a == b)


class _Run:
    """One of the two interleaved trainings of --deltas: plain, or through a Checkpointer on a
    job store (exact codec, asynchronous, a base at iteration 0 and every ``base_every``, a delta
    at every other step)."""

    def __init__(self, world: int, args: argparse.Namespace, store_path: str | None,
                 base_every: int = 100_000) -> None:
        import torch.distributed as dist

        import ckptstore
        from ckptstore.torch import Checkpointer

        self.model, self.opt = build_lm(world, args)
        self.store = self.ck = None
        if store_path is not None:
            self.store = ckptstore.open(store_path, "a", process_group=dist.group.WORLD,
                                        commit_timeout=600.0)
            self.ck = Checkpointer(self.store, self.model, self.opt, policy="every-iteration",
                                   base_every=base_every,
                                   codec="exact", asynchronous=True)
            self.ck.restore()  # base snapshot 0
        self.it = 0
        self.times: list[float] = []
        self.flushes: list[float] = []
        self.futures: list = []

    def block(self, n: int, rank: int, args: argparse.Namespace, timed: bool) -> None:
        """``n`` steps (each timed on its own), then an untimed flush (a checkpointed block's
        backlog stays out of the next block; its duration is kept)."""
        import torch.distributed as dist

        dist.barrier()
        for _ in range(n):
            self.it += 1
            t0 = time.perf_counter()
            fut = lm_step(self.model, self.opt, self.ck, self.it, rank, args)
            if timed:
                self.times.append(time.perf_counter() - t0)
                if self.ck is not None:
                    self.futures.append(fut)
        if self.ck is not None:
            t0 = time.perf_counter()
            self.ck.flush()
            if timed:
                self.flushes.append(time.perf_counter() - t0)


def train_job(rank: int, world: int, args: argparse.Namespace, work: str) -> dict:
    """Plain training and training through the Checkpointer, in alternating blocks: iterations
    1..T (2 warm-up steps, then the timed ones) are deltas on base 0. Then one more step, T + 1,
    a base by the schedule; a DCP checkpoint of the state of T + 1; rank 0 keeps the gathered
    full states of T and T + 1 (the restores' expected values)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor


    base = os.path.join(work, f"deltas{world}")
    last = 2 + args.rounds * args.block  # T
    runs = [_Run(world, args, None),
            _Run(world, args, os.path.join(base, "store"), base_every=last + 1)]
    for r in runs:  # warm-up, untimed
        r.block(2, rank, args, timed=False)
    for rnd in range(args.rounds):
        for r in rotated(runs, rnd):
            r.block(args.block, rank, args, timed=True)
    plain, ckr = runs
    assert ckr.ck is not None and ckr.store is not None
    stats = [f.result() for f in ckr.futures]
    assert ckr.it == last
    full = full_state(ckr.model, ckr.opt)
    if rank == 0:
        torch.save(full, os.path.join(base, f"full-{last}.pt"))
    ckr.block(1, rank, args, timed=False)  # T + 1: a base
    ckr.ck.close()
    ckr.store.close()
    msd, osd = get_state_dict(ckr.model, ckr.opt)
    dcp.save({"model": msd, "optim": osd},
             storage_writer=FileSystemWriter(os.path.join(base, "dcp"), sync_files=True))
    dist.barrier()
    if rank == 0:
        fsync_path(os.path.join(base, "dcp"))
    full = full_state(ckr.model, ckr.opt)
    if rank == 0:
        torch.save(full, os.path.join(base, f"full-{last + 1}.pt"))
    local = [p.to_local() if isinstance(p, DTensor) else p for p in ckr.model.parameters()]
    return {"plain": plain.times, "ckpt": ckr.times, "flush": ckr.flushes,
            "kinds": sorted({s.kind for s in stats}),
            "written": [s.written_bytes for s in stats], "cpu": [s.cpu_s for s in stats],
            "grad_bytes": sum(t.numel() * t.element_size() for t in local),
            "params": sum(p.numel() for p in ckr.model.parameters()), "iteration": last,
            "store_bytes": dir_bytes(os.path.join(base, "store")) if rank == 0 else 0,
            "dcp_bytes": dir_bytes(os.path.join(base, "dcp")) if rank == 0 else 0}


def _restore_ckptstore(path: str, model: Any, opt: Any, iteration: int | None = None) -> int:
    """A restart's restore: open the job store, a Checkpointer, ``restore(iteration)`` (default
    the newest; each rank loads, replaying, its own part at the saved world size, else the
    state assembled from every part)."""
    import torch.distributed as dist

    import ckptstore
    from ckptstore.torch import Checkpointer

    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=600.0)
    ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=100_000,
                      codec="exact", asynchronous=True)
    it = ck.restore(iteration)
    ck.close()
    store.close()
    return it


def _restore_dcp(path: str, model: Any, opt: Any) -> None:
    """DCP's restore of the same state: get_state_dict, dcp.load, set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, storage_reader=FileSystemReader(path))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def restore_job(rank: int, world: int, args: argparse.Namespace, work: str) -> dict:
    """Cold restores at ``world`` ranks of what was trained at each source world size N, into
    fresh FSDP2 objects, the three kinds interleaved (RESTORES): ckptstore's newest iteration
    T + 1 (a base), ckptstore's iteration T (base 0 + T deltas) and DCP's checkpoint of T + 1.
    Each restored state is gathered and checked bit for bit (outside the clock)."""
    import torch
    import torch.distributed as dist


    last = 2 + args.rounds * args.block
    first = os.path.join(work, f"deltas{args.delta_sources[world][0]}")
    model, opt = build_lm(world, args)  # warm-up, untimed: imports, first-call costs of each side
    _restore_ckptstore(os.path.join(first, "store"), model, opt, last)
    _restore_dcp(os.path.join(first, "dcp"), *build_lm(world, args))
    out: dict = {}
    for n in args.delta_sources[world]:
        base = os.path.join(work, f"deltas{n}")
        store, ckpt = os.path.join(base, "store"), os.path.join(base, "dcp")
        want = {it: torch.load(os.path.join(base, f"full-{it}.pt")) if rank == 0 else None
                for it in (last, last + 1)}
        runs: dict[str, tuple[Any, int]] = {  # kind: (restore(model, opt), its iteration)
            "base": (functools.partial(_restore_ckptstore, store), last + 1),
            "deltas": (functools.partial(_restore_ckptstore, store, iteration=last), last),
            "dcp": (functools.partial(_restore_dcp, ckpt), last + 1)}
        res: dict = {kind: {"s": [], "bad": 0} for kind in RESTORES}
        for rep in range(args.repeat):
            for kind in rotated(RESTORES, rep):
                fn, it = runs[kind]
                model, opt = build_lm(world, args)
                if rank == 0:
                    evict_files(store, ckpt)
                res[kind]["s"].append(timed_between(functools.partial(fn, model, opt),
                                                    dist.barrier))
                got = full_state(model, opt)
                res[kind]["bad"] += int(rank == 0 and not same_state(want[it], got))
        out[str(n)] = res
    return out


def _rank_main(rank: int, world: int, init: str, job: str, args: argparse.Namespace,
               work: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    fn = {"save": save_job, "load": load_job, "train": train_job, "restore": restore_job}[job]
    result = fn(rank, world, args, work)
    with open(os.path.join(out_dir, f"{job}{world}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_job(job: str, world: int, args: argparse.Namespace, work: str) -> list[dict]:
    import torch.multiprocessing as mp

    rdv = os.path.join(work, f"rdv-{job}{world}")
    if os.path.exists(rdv):
        os.unlink(rdv)
    mp.start_processes(_rank_main, args=(world, f"file://{rdv}", job, args, work, work),
                       nprocs=world, join=True, start_method="spawn")
    out = []
    for r in range(world):
        with open(os.path.join(work, f"{job}{world}-rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def run_jobs(args: argparse.Namespace, pair_spec: str, sources: str, jobs: tuple[str, str],
             prefix: str, before: Callable[[str], Any] | None = None
             ) -> tuple[list[int], list[tuple[int, ...]], dict, dict, list[float], Any]:
    """The two phases of a run, in a temporary work directory (removed after):

    1. ``before(work)`` (a machine limit measured there), when given;
    2. job ``jobs[0]`` (a save, a training) at every world size N of ``--ranks``;
    3. job ``jobs[1]`` (the loads, the restores) at every world size M that a pair N:M of
       ``pair_spec`` names, reading what each N wrote (``args.<sources>``: M -> those Ns).

    Returns (ranks, pairs, phase 2's results and phase 3's by world size, the 1-minute load
    averages sampled before, between and after the jobs, ``before``'s result)."""
    ranks = [int(x) for x in args.ranks.split(",")]
    pairs = [tuple(int(v) for v in x.split(":")) for x in pair_spec.split(",")]
    pairs = [(n, m) for n, m in pairs if n in ranks and m in ranks]
    setattr(args, sources, {m: [n for n, mm in pairs if mm == m] for m in ranks})
    work = tempfile.mkdtemp(prefix=prefix, dir=args.dir)
    loads = [os.getloadavg()[0]]
    try:
        limit = before(work) if before is not None else None
        first, second = {}, {}
        for n in ranks:
            first[n] = run_job(jobs[0], n, args, work)
            loads.append(os.getloadavg()[0])
        for m in ranks:
            if getattr(args, sources)[m]:
                second[m] = run_job(jobs[1], m, args, work)
                loads.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    loads.append(os.getloadavg()[0])
    return ranks, pairs, first, second, loads, limit


# ---- the report --------------------------------------------------------------------------------

def main_deltas(args: argparse.Namespace, mach: dict) -> int:
    """--deltas: per-iteration training cost, bytes per iteration and restores (see the module
    docstring); prints the machine's limits and two tables."""
    ranks, pairs, trained, restored, loads, bandwidth = run_jobs(
        args, args.delta_pairs, "delta_sources", ("train", "restore"), "bench_sharded-deltas-",
        direct_write_bandwidth)
    t0 = trained[ranks[0]][0]
    mach["disk O_DIRECT write+fsync"] = (f"{bandwidth / 1e9:.2f} GB/s" if bandwidth
                                         else "unknown (O_DIRECT refused)")
    mach["load average during"] = load_summary(loads)
    mach["load average after"] = f"{loads[-1]:.2f} (1 min)"
    print(header("bench_sharded --deltas", mach))
    print(f"model: FSDP2 MLP LM vocab={args.vocab} dim={args.dim} layers={args.layers} "
          f"(untied head), {t0['params'] / 1e6:.2f}M parameters, AdamW; per rank "
          f"{args.batch}x{args.ctx} tokens per step; {args.rounds} rounds x {args.block} steps per "
          f"side, interleaved, medians of rank 0; Checkpointer: exact codec, async, group_commit=1, "
          f"a delta every step on base 0; each rank gets max(1, CPUs // ranks) torch threads")
    rows = []
    for n in ranks:
        res = trained[n]
        plain, ck = med(res[0]["plain"]), med(res[0]["ckpt"])
        written = [med(r["written"]) for r in res]
        rows.append([f"{n}", f"{plain * 1e3:.1f}", f"{ck * 1e3:.1f}", f"{ck / plain:.2f}",
                     f"{med(res[0]['flush']) * 1e3:.1f}",
                     " ".join(f"{w / 1024:.0f}" for w in written),
                     " ".join(f"{r['grad_bytes'] / 1024:.0f}" for r in res),
                     f"{med(res[0]['cpu']) * 1e3:.1f}",
                     f"{res[0]['store_bytes'] / MiB:.1f} / {res[0]['dcp_bytes'] / MiB:.1f}"])
    print(table(["ranks", "plain step ms", "+Checkpointer ms", "ratio", "block-end flush ms",
                 "written KiB/iter per rank", "local grad KiB per rank", "persister CPU ms/iter",
                 "store / DCP MiB"], rows))
    print()
    rows, bad = [], []
    for n, m in pairs:
        res = restored[m][0][str(n)]  # rank 0's clock
        base, deltas, dcp_s = (med(res[k]["s"]) for k in RESTORES)
        rows.append([f"{n} -> {m}", "own part" if n == m else "assembled, resharded",
                     f"{base:.3f}", f"{deltas:.3f}", f"{dcp_s:.3f}", f"{base / dcp_s:.2f}",
                     f"{deltas / dcp_s:.2f}"])
        bad += [f"{n}->{m} {k}" for k in RESTORES if res[k]["bad"]]
    k = trained[ranks[0]][0]["iteration"]
    print(table(["restore (trained at N -> M ranks)", "ckptstore reads", "base s",
                 f"base 0 + {k} deltas s", "DCP s", "base / DCP", "deltas / DCP"], rows))
    print("ckptstore: open + Checkpointer + restore(it) + close, of the newest iteration (a base) "
          f"and of iteration {k} (base 0 + {k} replayed deltas); DCP: get_state_dict + dcp.load + "
          f"set_state_dict of the newest state; cold page cache, {args.repeat} repeats interleaved, "
          "medians of rank 0")
    print("correctness: every restored state (gathered) bit-exact with the trained one"
          if not bad else "MISMATCHES: " + "; ".join(bad))
    write_json(args.json, "bench_sharded --deltas",
               {k: v for k, v in vars(args).items() if k != "delta_sources"}, mach,
               {"trained": trained, "restored": restored},
               {"steps": {n: {k: Stats.of(trained[n][0][k]).as_dict() for k in ("plain", "ckpt")}
                          for n in ranks},
                "restores": {f"{n}->{m}": {k: Stats.of(restored[m][0][str(n)][k]["s"]).as_dict()
                                           for k in RESTORES} for n, m in pairs}},
               loadavg=loads)
    return 1 if bad else 0


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--pairs", default=DEFAULT_PAIRS, help="N:M pairs: saved at N, loaded at M")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--vocab", type=int, default=None, help="default 16384 (4096 with --deltas)")
    p.add_argument("--dim", type=int, default=None, help="default 512 (256 with --deltas)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--deltas", action="store_true",
                   help="per-iteration sharded training through the Checkpointer instead")
    p.add_argument("--delta-pairs", default=DEFAULT_DELTA_PAIRS,
                   help="--deltas: N:M pairs: trained at N, restored at M")
    add_standard_args(p, rounds=6, rounds_help="--deltas: interleaved rounds",
                      quick_help="a smoke run: 1 and 2 ranks, a small model, 1 repeat (with "
                                 "--deltas: 2 rounds of 2 steps)")
    p.add_argument("--block", type=int, default=5, help="--deltas: timed steps per side per round")
    p.add_argument("--batch", type=int, default=4, help="--deltas: sequences per rank per step")
    p.add_argument("--ctx", type=int, default=64, help="--deltas: tokens per sequence")
    args = p.parse_args()
    quick(args, p, ranks="1,2", pairs="1:1,2:2,1:2,2:1", delta_pairs="1:1,2:2,1:2,2:1",
          repeat=1, layers=1, rounds=2, block=2)
    if args.quick and args.vocab is None:
        args.vocab = 2048
    if args.vocab is None:
        args.vocab = 4096 if args.deltas else 16384
    if args.dim is None:
        args.dim = 256 if args.deltas else 512
    mach = machine()
    if args.deltas:
        return main_deltas(args, mach)
    ranks, pairs, saves, loaded, loads, _ = run_jobs(args, args.pairs, "sources",
                                                     ("save", "load"), "bench_sharded-")

    state_bytes = sum(r["ideal"] for r in saves[ranks[0]])
    mach["load average during"] = load_summary(loads)
    mach["load average after"] = f"{loads[-1]:.2f} (1 min)"
    print(header(f"bench_sharded: state {state_bytes / MiB:.1f} MiB (FSDP2 model "
                 f"vocab={args.vocab} dim={args.dim} layers={args.layers} + AdamW, DTensors "
                 f"Shard(0)); {args.repeat} repeats, medians; loads cold", mach))
    rows = []
    for n in ranks:
        r0 = saves[n][0]
        a, b = med(r0["ckptstore"]), med(r0["dcp"])
        rows.append([f"save at {n}", f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}",
                     f"{r0['disk']['ckptstore'] / MiB:.1f}", f"{r0['disk']['dcp'] / MiB:.1f}"])
    print(table(["", "ckptstore s", "DCP s", "ratio", "ckptstore MiB", "DCP MiB"], rows))
    print()
    rows = []
    bad = []
    for n, m in pairs:
        per_rank = [r["pairs"][str(n)] if str(n) in r["pairs"] else r["pairs"][n]
                    for r in loaded[m]]
        ideal = [r["ideal"] for r in loaded[m]]
        a = med(per_rank[0]["ckptstore"]["s"])
        b = med(per_rank[0]["dcp"]["s"])
        ck_t = [med(x["ckptstore"]["tensor_bytes"]) / i for x, i in zip(per_rank, ideal)]
        ck_r = [med(x["ckptstore"]["rchar"]) / i for x, i in zip(per_rank, ideal)]
        dc_r = [med(x["dcp"]["rchar"]) / i for x, i in zip(per_rank, ideal)]
        rows.append([f"{n} -> {m}", f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}",
                     f"{med(ideal) / MiB:.1f}",
                     " ".join(f"{x:.2f}" for x in ck_t), " ".join(f"{x:.2f}" for x in ck_r),
                     " ".join(f"{x:.2f}" for x in dc_r)])
        for r, x in enumerate(per_rank):
            for side in SIDES:
                if x[side]["bad"]:
                    bad.append(f"{n}->{m} rank {r} {side}: {sorted(set(x[side]['bad']))[:3]}")
    print(table(["load (saved at N -> M ranks)", "ckptstore s", "DCP s", "ratio",
                 "ideal MiB/rank", "ckptstore tensor read/ideal per rank",
                 "ckptstore rchar/ideal", "DCP rchar/ideal"], rows))
    print("correctness: every destination shard bit-exact on both sides" if not bad
          else "MISMATCHES: " + "; ".join(bad))
    write_json(args.json, "bench_sharded", {k: v for k, v in vars(args).items() if k != "sources"},
               mach, {"saves": saves, "loads": loaded},
               {"saves": {n: {side: Stats.of(saves[n][0][side]).as_dict() for side in SIDES}
                          for n in ranks},
                "loads": {f"{n}->{m}": {side: Stats.of(
                    loaded[m][0]["pairs"][str(n)][side]["s"]).as_dict() for side in SIDES}
                    for n, m in pairs}},
               loadavg=loads)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
