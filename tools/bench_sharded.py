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

    python tools/bench_sharded.py                            # 1, 2, 4 ranks, 144 MiB, 3 repeats
    python tools/bench_sharded.py --vocab 2048 --layers 1 --repeat 1   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

MiB = 1 << 20
SIDES = ("ckptstore", "dcp")
DEFAULT_PAIRS = "1:1,2:2,4:4,1:4,4:1,2:4,4:2"


# ---- the state ---------------------------------------------------------------------------------

def build_state(world: int, args: argparse.Namespace) -> tuple[Any, Any, dict]:
    """The FSDP2 model + AdamW over a mesh of ``world`` ranks, every value set to its expected
    one; returns (model, optimizer, DCP state dict)."""
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(),
                            nn.Linear(4 * args.dim, args.dim)) for _ in range(args.layers)]
    model = nn.Sequential(nn.Embedding(args.vocab, args.dim), *blocks)
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step makes AdamW's state; no forward pass needed
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    fill(state, world)
    return model, opt, state


def _leaves(x: Any, prefix: str = ""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{prefix}.{i}")
    else:
        yield prefix, x


def _expected_local(name: str, t: Any, world: int, rank: int) -> Any:
    """The expected values of this rank's part of tensor ``name`` (global values: a cheap pure
    function of the name and the flat index; a DTensor Shard(0)'s local part as torch.chunk)."""
    import torch
    from torch.distributed.tensor import DTensor

    seed = sum(name.encode()) % 9973 + 1
    shape = tuple(t.shape)
    n = 1
    for d in shape:
        n *= d
    glob = ((torch.arange(n, dtype=torch.int64) * seed) % 65521).to(t.dtype).reshape(shape) / 65521
    if isinstance(t, DTensor):
        local = t.to_local()
        if local.numel() == 0:
            return local.clone()
        return torch.chunk(glob, world, dim=0)[rank]
    return glob


def fill(state: dict, world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    with torch.no_grad():
        for name, t in _leaves(state):
            if isinstance(t, DTensor):
                t.to_local().copy_(_expected_local(name, t, world, rank))
            elif isinstance(t, torch.Tensor):
                t.copy_(_expected_local(name, t, world, rank))


def zero(state: dict) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for _, t in _leaves(state):
            if isinstance(t, DTensor):
                t.to_local().zero_()
            elif isinstance(t, torch.Tensor):
                t.zero_()


def check(state: dict, world: int) -> list[str]:
    """The names of tensors whose part on this rank is not the expected one, bit for bit."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank, bad = dist.get_rank(), []
    for name, t in _leaves(state):
        if isinstance(t, torch.Tensor):
            got = t.to_local() if isinstance(t, DTensor) else t
            want = _expected_local(name, t, world, rank)
            if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(
                    got.reshape(-1).view(torch.uint8),
                    want.contiguous().reshape(-1).view(torch.uint8)):
                bad.append(name)
    return bad


def ideal_bytes(state: dict) -> int:
    """The bytes of the shards this rank's destination holds."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0
    for _, t in _leaves(state):
        if isinstance(t, DTensor):
            loc = t.to_local()
            total += loc.numel() * loc.element_size()
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# ---- one rank of a job -------------------------------------------------------------------------

def _timed(fn, barrier) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


def save_job(rank: int, world: int, args: argparse.Namespace, work: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import ckptstore
    import ckptstore.dcp as cdcp
    from bench_core import fsync_path

    _, _, state = build_state(world, args)
    out: dict = {"ckptstore": [], "dcp": [], "state_bytes": None}
    base = os.path.join(work, f"save{world}")
    for rep in range(args.repeat):
        order = SIDES if rep % 2 == 0 else SIDES[::-1]
        for side in order:
            target = os.path.join(base, f"{side}-{rep}")
            if side == "ckptstore":
                js = ckptstore.open(target, "a", process_group=dist.group.WORLD,
                                    commit_timeout=600.0)
                s = _timed(lambda: dcp.save(state, storage_writer=cdcp.StorageWriter(js, 1)),
                           dist.barrier)
                js.close()
            else:
                def save() -> None:
                    dcp.save(state, storage_writer=FileSystemWriter(target, sync_files=True))
                    if rank == 0:
                        fsync_path(target)
                        fsync_path(os.path.dirname(target))
                s = _timed(save, dist.barrier)
            out[side].append(s)
        dist.barrier()
        if rank == 0:
            out.setdefault("disk", {})
            for side in SIDES:
                out["disk"][side] = _dir_bytes(os.path.join(base, f"{side}-{rep}"))
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
    from bench_core import evict_files

    _, _, state = build_state(world, args)
    ideal = ideal_bytes(state)
    out: dict = {"ideal": ideal, "pairs": {}}
    for n in args.sources[world]:
        base = os.path.join(work, f"save{n}")
        src = {side: os.path.join(base, f"{side}-{args.repeat - 1}") for side in SIDES}
        res: dict = {side: {"s": [], "rchar": [], "tensor_bytes": [], "bad": []} for side in SIDES}
        for rep in range(args.repeat):
            order = SIDES if rep % 2 == 0 else SIDES[::-1]
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
                s = _timed(load, dist.barrier)
                res[side]["s"].append(s)
                res[side]["rchar"].append(rchar() - r0)
                res[side]["tensor_bytes"].append(holder.get("tensor_bytes"))
                res[side]["bad"] += check(state, world)
        out["pairs"][n] = res
    return out


def _rank_main(rank: int, world: int, init: str, job: str, args: argparse.Namespace,
               work: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    fn = save_job if job == "save" else load_job
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


# ---- the report --------------------------------------------------------------------------------

def loadavg() -> float:
    return os.getloadavg()[0]


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> int:
    import torch

    from bench_core import table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--pairs", default=DEFAULT_PAIRS, help="N:M pairs: saved at N, loaded at M")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write every sample to this file")
    args = p.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    pairs = [tuple(int(v) for v in x.split(":")) for x in args.pairs.split(",")]
    pairs = [(n, m) for n, m in pairs if n in ranks and m in ranks]
    args.sources = {m: [n for n, mm in pairs if mm == m] for m in ranks}

    work = tempfile.mkdtemp(prefix="bench_sharded-", dir=args.dir)
    loads = [loadavg()]
    try:
        saves = {}
        for n in ranks:
            saves[n] = run_job("save", n, args, work)
            loads.append(loadavg())
        loaded = {}
        for m in ranks:
            if args.sources[m]:
                loaded[m] = run_job("load", m, args, work)
                loads.append(loadavg())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    loads.append(loadavg())

    state_bytes = sum(r["ideal"] for r in saves[ranks[0]])
    print(f"bench_sharded: {os.cpu_count()} CPUs, load average (1 min) before {loads[0]:.2f}, "
          f"during max {max(loads[1:-1] or loads):.2f}, after {loads[-1]:.2f}; torch "
          f"{torch.__version__}; state {state_bytes / MiB:.1f} MiB (FSDP2 model "
          f"vocab={args.vocab} dim={args.dim} layers={args.layers} + AdamW, DTensors Shard(0)); "
          f"{args.repeat} repeats, medians; loads cold")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"saves": saves, "loads": loaded, "loadavg": loads,
                       "args": {k: v for k, v in vars(args).items() if k != "sources"}}, f)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
