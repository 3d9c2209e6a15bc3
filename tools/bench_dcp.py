#!/usr/bin/env python3
"""bench_dcp: ``dcp.save`` / ``dcp.load`` through ckptstore's DCP backend against DCP's own files.

The same ``torch.distributed.checkpoint`` calls, the same state, in one process; only the storage
layer differs:

* **ckptstore**: ``ckptstore.dcp.StorageWriter(store, iteration)`` /
  ``ckptstore.dcp.StorageReader(store, iteration)``, every checkpoint an iteration of one store;
* **DCP**: ``FileSystemWriter(dir, thread_count=2, sync_files=True)`` / ``FileSystemReader(dir)``,
  one directory per checkpoint, as users run it.

What is measured (every figure in this run, on this machine; the two sides interleaved ABAB, the
side that goes first alternating, and **medians** quoted):

1. **Full save and full load** (``--rounds`` rounds) of ``{"model": ..., "optim": ...}`` from
   ``get_state_dict`` of a GPT-style model after one AdamW step (parameters and both moments,
   about ``--size`` MiB). Each round saves into a fresh store and a fresh directory (nothing to
   deduplicate against: a full save). Save clock: ``StorageWriter(store, 1)`` + ``dcp.save`` on a
   store opened before the clock (as in a job that keeps its store open), against
   ``FileSystemWriter`` + ``dcp.save`` + an fsync of the checkpoint directory and its parent
   (DCP fsyncs its files and ``.metadata.tmp`` but not the directory after the rename, so its
   checkpoint is not durable without it). Load clock (a restarted job): ``ckptstore.open(mode="r")``
   + ``StorageReader`` + ``dcp.load`` + close, against ``FileSystemReader`` + ``dcp.load``; both
   load into the same preallocated state (``get_state_dict`` of another model + AdamW, zeroed
   before each load, outside the clock). **Cold**: ``os.sync()`` then ``posix_fadvise(DONTNEED)``
   on every file of the checkpoint (bench_core's ``evict_files``; both sides the same way).
   **Warm**: every file of the checkpoint read once, untimed, just before.
2. **Ten successive checkpoints of a training run** (``--checkpoints``): the model trains with
   AdamW on synthetic batches, ``--steps`` optimizer steps before each checkpoint, and each
   checkpoint is saved by both sides (same state dict, order alternating). Reported: the time per
   save (median over the checkpoints, and of the first alone) and the bytes on disk after the
   last (ckptstore: the store directory; DCP: the sum of its directories), so deduplication
   across iterations shows; ckptstore's written bytes are split into what deduplication and
   what lz4 saved. Two variants: ``train`` (every parameter trains: AdamW changes nearly every
   byte each step, so there is little to deduplicate) and ``frozen`` (the embeddings and the
   first ``--freeze-layers`` blocks, default two thirds, frozen as in fine-tuning: the frozen
   parameters repeat in every checkpoint and have no AdamW moments).

The synthetic batches (``--batch`` x ``--ctx`` tokens) touch few rows of the token embedding
per step, so the AdamW moments of the other rows are still exact zeros, which lz4 compresses:
the report prints how many bytes of each state are zeros, so that effect is not mistaken for
deduplication (a large-batch run touches nearly every row and has fewer of them).

Correctness, outside every clock: after each part-1 load the destination is compared with the
saved state bit for bit (tensors as bytes, non-tensor values by type and value), for both sides;
in part 2 every checkpoint's state is fingerprinted when saved (blake2b of each tensor's bytes,
the non-tensor values by type and value), and after the run every iteration of the store is
loaded back through ``StorageReader`` and compared with its fingerprint (and the last one also
bit for bit with the live state, and DCP's last directory too).

Printed: the machine (CPUs, the 1-minute load average before, during and after), the torch
version, the sizes, a table per part with ``ours / DCP`` ratios (time and bytes: < 1 means
ckptstore takes less). ``--json FILE`` writes everything, every sample included. Work files go
in a temporary directory under ``--dir`` (tmpfs refused unless ``--allow-tmpfs``), removed at the
end, also on an error, Ctrl-C or SIGTERM. Like bench_core the tool re-executes itself with
``MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824`` unless they are set or
``--no-malloc-env`` is given.

    python tools/bench_dcp.py                                  # ~160 MiB state, 5 rounds, 10 checkpoints
    python tools/bench_dcp.py --quick     # a smoke run: --size 8 --rounds 2 --checkpoints 3
                                          # --steps 1 --settle 0
    python tools/bench_dcp.py --parts io --size 512 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # ckptstore, if not installed

from harness import (GB, MiB, Stats, add_standard_args, ensure_malloc_env, evict_files,  # noqa: E402
                     filesystem_type, fmt, fsync_path, header, load_average, load_summary, log,
                     machine, median as med, parser, quick, ratio, read_tree, rotated, table,
                     timed, tree_bytes, write_json)
from bench_dcp_state import (diff_fingerprints, diff_states, fingerprint, leaves,  # noqa: E402,F401
                             raw_bytes, state_bytes, tensors_of, zero_bytes, zero_state)

SIDES = ("ckptstore", "dcp")
PARTS = ("io", "train", "frozen")
SEED = 1234

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="torch.distributed is unavailable")


# ================================================================================================
# The model, its training, its state
# ================================================================================================
class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-LN blocks of attention and a 4x MLP,
    a final LayerNorm and an untied output head; the causal mask is a non-persistent buffer (it
    is in no checkpoint)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1),
                             persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = self.get_buffer("mask")[:t, :t]
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def param_count(vocab: int, dim: int, layers: int, ctx: int) -> int:
    block = 12 * dim * dim + 13 * dim  # attention in/out projections, MLP, two LayerNorms
    return layers * block + 2 * vocab * dim + ctx * dim + 2 * dim


def pick_dim(size_mib: float, vocab: int, layers: int, ctx: int) -> int:
    """The model width (a multiple of 32) whose parameters + two AdamW moments come closest to
    ``size_mib`` MiB of float32."""
    target = size_mib * MiB
    best = 32
    for dim in range(32, 16385, 32):
        if abs(12 * param_count(vocab, dim, layers, ctx) - target) < \
                abs(12 * param_count(vocab, best, layers, ctx) - target):
            best = dim
    return best


def heads_for(dim: int) -> int:
    return dim // 64 if dim % 64 == 0 else dim // 32


class Trainer:
    """The model, AdamW over its trainable parameters, and a step on a synthetic batch."""

    def __init__(self, a: argparse.Namespace, seed: int, frozen_layers: int) -> None:
        torch.manual_seed(seed)
        self.a = a
        self.model = GPT(a.vocab, a.dim, a.layers, heads_for(a.dim), a.ctx)
        self.frozen: list[str] = []
        if frozen_layers:
            frozen = [self.model.tok, self.model.pos, *list(self.model.blocks)[:frozen_layers]]
            for m in frozen:
                m.requires_grad_(False)
            self.frozen = [n for n, p in self.model.named_parameters() if not p.requires_grad]
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                     lr=3e-4, weight_decay=0.1)
        self.seed = seed
        self.steps = 0

    def step(self) -> float:
        a = self.a
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.steps)
        x = torch.randint(0, a.vocab, (a.batch, a.ctx + 1), generator=g)
        t0 = time.perf_counter()
        logits = self.model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab), x[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        return time.perf_counter() - t0

    def state(self) -> dict[str, Any]:
        """What users hand to DCP: ``get_state_dict`` of the model and the optimizer (live
        tensors, not copies)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def param_numel(self) -> tuple[int, int]:
        """(all parameters, frozen parameters), in elements."""
        ps = list(self.model.parameters())
        return sum(p.numel() for p in ps), sum(p.numel() for p in ps if not p.requires_grad)


# ================================================================================================
# The two sides
# ================================================================================================
def open_store(path: str, mode: str = "a") -> Any:
    import ckptstore

    return ckptstore.open(path, mode=mode)


def save_ours(store: Any, iteration: int, state: Any) -> Any:
    """One DCP save through ckptstore's backend; durable (committed) when it returns. Returns
    the writer's SaveStats."""
    import torch.distributed.checkpoint as dcp

    import ckptstore.dcp

    writer = ckptstore.dcp.StorageWriter(store, iteration)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer.last_stats


def save_theirs(path: str, state: Any, threads: int) -> None:
    """One DCP save with its own FileSystemWriter, made durable: DCP fsyncs its data files and
    ``.metadata.tmp`` (sync_files=True); the rename to ``.metadata`` and the new directory are
    durable once the directory and its parent are fsynced."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(path, sync_files=True, thread_count=threads)
    dcp.save(state, storage_writer=writer, no_dist=True)
    fsync_path(path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def load_ours(store_path: str, iteration: int, into: Any) -> None:
    """A restarted job's load: open the store read-only, ``dcp.load`` through StorageReader
    into ``into`` (in place), close."""
    import torch.distributed.checkpoint as dcp

    import ckptstore.dcp

    with open_store(store_path, "r") as store:
        dcp.load(into, storage_reader=ckptstore.dcp.StorageReader(store, iteration), no_dist=True)


def load_from_store(store: Any, iteration: int, into: Any) -> None:
    import torch.distributed.checkpoint as dcp

    import ckptstore.dcp

    dcp.load(into, storage_reader=ckptstore.dcp.StorageReader(store, iteration), no_dist=True)


def load_theirs(path: str, into: Any) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(into, storage_reader=dcp.FileSystemReader(path), no_dist=True)


def warm_up(work: str, threads: int) -> None:
    """First calls import modules and build caches: run both sides once on a tiny state."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    path = os.path.join(work, "warmup")
    with open_store(os.path.join(path, "store")) as store:
        save_ours(store, 1, state)
    save_theirs(os.path.join(path, "dcp"), state, threads)
    load_ours(os.path.join(path, "store"), 1, state)
    load_theirs(os.path.join(path, "dcp"), state)
    shutil.rmtree(path)


# ================================================================================================
# Measurement plumbing
# ================================================================================================
class Run:
    """Settings and the load-average samples of this run."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.loads: list[float] = []

    def settle(self) -> None:
        """Before each clock: flush dirty pages, collect garbage, let writeback finish."""
        gc.collect()
        os.sync()
        if self.a.settle > 0:
            time.sleep(self.a.settle)

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        out = timed(fn)
        self.loads.append(os.getloadavg()[0])
        return out


# ================================================================================================
# Part 1: full save, cold and warm full load
# ================================================================================================
def part_io(run: Run, work: str) -> dict[str, Any]:
    a = run.a
    src_t = Trainer(a, SEED, 0)
    src_t.step()  # AdamW has its moments
    src = src_t.state()
    dst_t = Trainer(a, SEED + 1, 0)
    dst_t.step()
    dst = dst_t.state()
    nbytes = state_bytes(src)
    samples: dict[str, list[float]] = {f"{op}:{s}": [] for op in ("save", "load_cold", "load_warm")
                                       for s in SIDES}
    info: dict[str, list[Any]] = {"store_open_s": [], "store_close_s": [], "ours_written": [],
                                  "disk_ckptstore": [], "disk_dcp": [], "order": []}
    checks: list[str] = []
    for r in range(a.rounds):
        rdir = os.path.join(work, f"io-{r}")
        os.makedirs(rdir)
        paths = {"ckptstore": os.path.join(rdir, "store"), "dcp": os.path.join(rdir, "dcp")}
        sides = rotated(SIDES, r)
        info["order"].append(list(sides))
        for side in sides:
            log(f"  io round {r + 1}/{a.rounds}: save {side}")
            if side == "ckptstore":
                t0 = time.perf_counter()
                store = open_store(paths[side])
                info["store_open_s"].append(time.perf_counter() - t0)
                try:
                    run.settle()
                    s, stats = run.timed(partial(save_ours, store, 1, src))
                    info["ours_written"].append(stats.written_bytes)
                finally:
                    t0 = time.perf_counter()
                    store.close()
                    info["store_close_s"].append(time.perf_counter() - t0)
            else:
                run.settle()
                s, _ = run.timed(partial(save_theirs, paths["dcp"], src, a.dcp_threads))
            samples[f"save:{side}"].append(s)
        for side in SIDES:
            info[f"disk_{side}"].append(tree_bytes(paths[side])[0])
        for cache in ("cold", "warm"):
            for side in sides:
                log(f"  io round {r + 1}/{a.rounds}: load {side} ({cache})")
                zero_state(dst)
                run.settle()
                if cache == "cold":
                    evict_files(paths[side])
                else:
                    read_tree(paths[side])
                fn = partial(load_ours, paths[side], 1, dst) if side == "ckptstore" \
                    else partial(load_theirs, paths[side], dst)
                s, _ = run.timed(fn)
                samples[f"load_{cache}:{side}"].append(s)
                bad = diff_states(dst, src)
                if bad:
                    checks.append(f"round {r + 1} {side} {cache} load differs from the saved "
                                  f"state: {bad}")
        shutil.rmtree(rdir)
    return {"state_bytes": nbytes, "zero_bytes": zero_bytes(src), "tensors": len(tensors_of(src)),
            "samples": samples,
            "info": info, "verify_failures": checks,
            "verified": f"{a.rounds * 4} loads (2 sides x cold/warm x {a.rounds} rounds) compared "
                        "bit for bit with the saved state"}


# ================================================================================================
# Part 2: successive checkpoints of a training run
# ================================================================================================
def part_train(run: Run, work: str, variant: str) -> dict[str, Any]:
    a = run.a
    frozen_layers = a.freeze_layers if variant == "frozen" else 0
    tr = Trainer(a, SEED + 7, frozen_layers)
    vdir = os.path.join(work, variant)
    store_path, dcp_root = os.path.join(vdir, "store"), os.path.join(vdir, "dcp")
    os.makedirs(dcp_root)
    samples: dict[str, list[float]] = {s: [] for s in SIDES}
    ours_stats: list[dict[str, int]] = []
    dcp_dir_bytes: list[int] = []
    step_s: list[float] = []
    fps: dict[int, dict[str, Any]] = {}
    orders: list[list[str]] = []
    checks: list[str] = []
    nbytes = zeros = 0
    with open_store(store_path) as store:
        for k in range(1, a.checkpoints + 1):
            for _ in range(a.steps):
                step_s.append(tr.step())
            state = tr.state()
            nbytes, zeros = state_bytes(state), zero_bytes(state)
            fps[k] = fingerprint(state)  # outside the clocks
            sides = rotated(SIDES, k - 1)
            orders.append(list(sides))
            for side in sides:
                log(f"  {variant}: checkpoint {k}/{a.checkpoints}: save {side}")
                run.settle()
                if side == "ckptstore":
                    s, st = run.timed(partial(save_ours, store, k, state))
                    ours_stats.append({"logical": st.logical_bytes, "written": st.written_bytes,
                                       "dedup": st.dedup_bytes})
                else:
                    path = os.path.join(dcp_root, f"ckpt-{k}")
                    s, _ = run.timed(partial(save_theirs, path, state, a.dcp_threads))
                    dcp_dir_bytes.append(tree_bytes(path)[0])
                samples[side].append(s)
    ours_disk = tree_bytes(store_path)
    dcp_disk = tree_bytes(dcp_root)

    # correctness, outside the clocks: every iteration of the store against its fingerprint,
    # the last one and DCP's last directory also bit for bit against the live state
    log(f"  {variant}: verifying {a.checkpoints} checkpoints")
    dst_t = Trainer(a, SEED + 8, frozen_layers)
    dst_t.step()
    dst = dst_t.state()
    with open_store(store_path, "r") as store:
        for k in range(1, a.checkpoints + 1):
            zero_state(dst)
            load_from_store(store, k, dst)
            bad = diff_fingerprints(fingerprint(dst), fps[k])
            if bad:
                checks.append(f"ckptstore iteration {k} differs from what was saved: {bad}")
        bad = diff_states(dst, tr.state())
        if bad:
            checks.append(f"ckptstore iteration {a.checkpoints} differs from the live state: {bad}")
    zero_state(dst)
    load_theirs(os.path.join(dcp_root, f"ckpt-{a.checkpoints}"), dst)
    bad = diff_states(dst, tr.state())
    if bad:
        checks.append(f"DCP checkpoint {a.checkpoints} differs from the live state: {bad}")
    total, frozen = tr.param_numel()
    shutil.rmtree(vdir)
    return {"variant": variant, "frozen_layers": frozen_layers, "frozen_params": frozen,
            "params": total, "state_bytes": nbytes, "zero_bytes_last": zeros, "tensors": len(tensors_of(tr.state())),
            "steps_between": a.steps, "step_s_median": med(step_s), "samples": samples,
            "order": orders, "ours_saves": ours_stats, "dcp_dir_bytes": dcp_dir_bytes,
            "disk": {"ckptstore": {"apparent": ours_disk[0], "allocated": ours_disk[1]},
                     "dcp": {"apparent": dcp_disk[0], "allocated": dcp_disk[1]}},
            "verify_failures": checks,
            "verified": f"{a.checkpoints} ckptstore iterations against their fingerprints, the "
                        "last one and DCP's last bit for bit against the live state"}


# ================================================================================================
# Report
# ================================================================================================
def pct(x: float, total: float) -> str:
    return f"{100 * x / total:.1f}%" if total else "-"


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f} MiB"


def io_table(res: dict[str, Any], n: int) -> str:
    rows = []
    nb = res["state_bytes"]
    for op, label in (("save", "full save (durable)"), ("load_cold", "full load, cold"),
                      ("load_warm", "full load, warm")):
        ours = med(res["samples"][f"{op}:ckptstore"])
        theirs = med(res["samples"][f"{op}:dcp"])
        rows.append([label, fmt(ours, ".3f"), fmt(theirs, ".3f"), ratio(ours, theirs),
                     fmt(nb / ours / GB if ours else None, ".2f"),
                     fmt(nb / theirs / GB if theirs else None, ".2f")])
    d_ours = med(res["info"]["disk_ckptstore"])
    d_theirs = med(res["info"]["disk_dcp"])
    rows.append(["checkpoint size (files)", mib(d_ours), mib(d_theirs), ratio(d_ours, d_theirs),
                 "", ""])
    return table([f"median of {n}", "ckptstore s", "DCP s", "ours/DCP", "ckptstore GB/s",
                  "DCP GB/s"], rows)


def train_table(res: dict[str, Any]) -> str:
    s_ours, s_theirs = res["samples"]["ckptstore"], res["samples"]["dcp"]
    n = len(s_ours)
    rows = [
        [f"save, median of {n}", fmt(med(s_ours), ".3f"), fmt(med(s_theirs), ".3f"),
         ratio(med(s_ours), med(s_theirs))],
        ["save, first checkpoint", fmt(s_ours[0] if s_ours else None, ".3f"),
         fmt(s_theirs[0] if s_theirs else None, ".3f"),
         ratio(s_ours[0] if s_ours else None, s_theirs[0] if s_theirs else None)],
    ]
    if n > 1:
        rows.append([f"save, median of checkpoints 2-{n}", fmt(med(s_ours[1:]), ".3f"),
                     fmt(med(s_theirs[1:]), ".3f"), ratio(med(s_ours[1:]), med(s_theirs[1:]))])
    later_w = [x["written"] for x in res["ours_saves"][1:]]
    later_d = res["dcp_dir_bytes"][1:]
    if later_w:
        rows.append([f"bytes per checkpoint 2-{n} (median)", mib(med(later_w)), mib(med(later_d)),
                     ratio(med(later_w), med(later_d))])
    d = res["disk"]
    rows.append([f"bytes on disk after {n} (files)", mib(d["ckptstore"]["apparent"]),
                 mib(d["dcp"]["apparent"]), ratio(d["ckptstore"]["apparent"], d["dcp"]["apparent"])])
    rows.append([f"bytes on disk after {n} (allocated)", mib(d["ckptstore"]["allocated"]),
                 mib(d["dcp"]["allocated"]),
                 ratio(d["ckptstore"]["allocated"], d["dcp"]["allocated"])])
    return table(["", "ckptstore", "DCP", "ours/DCP"], rows)


def train_heading(res: dict[str, Any], a: argparse.Namespace) -> str:
    n, nb = len(res["samples"]["ckptstore"]), res["state_bytes"]
    logical = sum(x["logical"] for x in res["ours_saves"])
    dedup = sum(x["dedup"] for x in res["ours_saves"])
    written = sum(x["written"] for x in res["ours_saves"])
    squeezed = max(0, logical - dedup - written)
    what = ("every parameter trains" if res["variant"] == "train" else
            f"embeddings + first {res['frozen_layers']} of {a.layers} blocks frozen "
            f"({100 * res['frozen_params'] / res['params']:.1f}% of the parameters, "
            f"{4 * res['frozen_params'] / MiB:.1f} MiB of each checkpoint)")
    return (f"part 2 ({res['variant']}): {n} checkpoints of a training run, {what}; "
            f"{res['steps_between']} AdamW step(s) before each (median step "
            f"{fmt(res['step_s_median'], '.3f')} s); state {nb / MiB:.1f} MiB, "
            f"{res['tensors']} tensors per checkpoint ({res['zero_bytes_last'] / MiB:.1f} MiB of "
            "it exact zeros in the last one)\n"
            f"  ckptstore wrote {written / MiB:.1f} MiB for {logical / MiB:.1f} MiB of state over "
            f"{n} saves: {dedup / MiB:.1f} MiB ({pct(dedup, logical)}) deduplicated (chunks "
            f"already stored), {squeezed / MiB:.1f} MiB ({pct(squeezed, logical)}) saved by lz4")


def report(env: dict[str, Any], a: argparse.Namespace, results: dict[str, Any]) -> str:
    out = [header("bench_dcp: dcp.save / dcp.load through ckptstore.dcp (one store) vs DCP's "
                  f"FileSystemWriter(thread_count={a.dcp_threads}, sync_files=True) / "
                  "FileSystemReader (one directory per checkpoint); one process, sides "
                  "interleaved ABAB (first side alternating), medians; ours/DCP < 1: ckptstore "
                  "takes less time or bytes", env), ""]
    if "io" in results:
        r = results["io"]
        written = med(r["info"]["ours_written"])
        out += [(f"part 1: full save / load of get_state_dict(model, AdamW) after one step, "
                 f"{r['state_bytes'] / MiB:.1f} MiB in {r['tensors']} tensors ("
                 f"{r['zero_bytes'] / MiB:.1f} MiB of it exact zeros; ckptstore wrote "
                 f"{mib(written)}), {a.rounds} rounds (fresh store / directory each); "
                 "cold = os.sync + posix_fadvise(DONTNEED) on the checkpoint's files, warm = files "
                 "read just before; loads into a preallocated state"),
                io_table(r, a.rounds),
                (f"  (info: store open (create) median {fmt(med(r['info']['store_open_s']), '.4f')} s "
                 f"and close {fmt(med(r['info']['store_close_s']), '.4f')} s, outside the save clock; "
                 "the load clock includes opening the store read-only)"), ""]
    for v in ("train", "frozen"):
        if v in results:
            out += [train_heading(results[v], a), train_table(results[v]), ""]
    fails = [f for r in results.values() for f in r["verify_failures"]]
    done = "; ".join(f"{k}: {r['verified']}" for k, r in results.items())
    out.append("correctness (outside the clocks): " + (
        f"{done}: all bit-exact" if not fails else "FAILED:\n  " + "\n  ".join(fails)))
    return "\n".join(out)


# ================================================================================================
# Environment and main
# ================================================================================================
def environment(a: argparse.Namespace, malloc: str, fstype: str) -> dict[str, Any]:
    """The machine header (:func:`harness.machine`) and this run's settings."""
    total = param_count(a.vocab, a.dim, a.layers, a.ctx)
    return machine(**{
        "malloc": malloc, "dir": a.dir, "filesystem": fstype,
        "model": f"GPT {a.layers} layers, dim {a.dim}, {heads_for(a.dim)} heads, vocab {a.vocab}, "
                 f"ctx {a.ctx}, untied head: {total / 1e6:.2f}M parameters "
                 f"({4 * total / MiB:.1f} MiB float32; + 2 AdamW moments = "
                 f"{12 * total / MiB:.1f} MiB; --size {a.size:g})",
        "training": f"AdamW lr 3e-4 wd 0.1, batch {a.batch} x {a.ctx} random tokens",
        "settle": f"gc + os.sync + {a.settle:g} s sleep before each clock",
    })


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--size", type=float, default=160.0,
                   help="MiB of state (parameters + both AdamW moments, float32) the model is "
                        "sized for; the width is picked to come closest (default 160)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (default 8192)")
    p.add_argument("--ctx", type=int, default=64, help="context length (default 64)")
    p.add_argument("--batch", type=int, default=4, help="training batch (default 4)")
    p.add_argument("--dim", type=int, default=None, help="model width (default: from --size)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="comma-separated, of io (full save/load), train (checkpoints of a run "
                        "training every parameter), frozen (the same with the embeddings and "
                        "first blocks frozen); default all")
    add_standard_args(p, rounds=5, rounds_help="part 1 rounds",
                      quick_help="a smoke run: --size 8 --rounds 2 --checkpoints 3 --steps 1 "
                                 "--settle 0")
    p.add_argument("--checkpoints", type=int, default=10, help="part 2 checkpoints (default 10)")
    p.add_argument("--steps", type=int, default=3,
                   help="AdamW steps before each part-2 checkpoint (default 3)")
    p.add_argument("--freeze-layers", type=int, default=None,
                   help="blocks frozen (with the embeddings) in the frozen variant (default: "
                        "two thirds of --layers)")
    p.add_argument("--dcp-threads", type=int, default=2,
                   help="FileSystemWriter thread_count (default 2)")
    p.add_argument("--settle", type=float, default=0.5,
                   help="seconds to sleep before each clock, after gc and os.sync (default 0.5)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--dir", default=os.getcwd(),
                   help="where the temporary work directory goes (default: the current one)")
    p.add_argument("--allow-tmpfs", action="store_true", help="allow --dir on tmpfs/ramfs")
    p.add_argument("--no-malloc-env", action="store_true", help="do not re-exec with MALLOC_* set")
    a = p.parse_args(argv)
    quick(a, p, size=8.0, rounds=2, checkpoints=3, steps=1, settle=0.0)
    a.dir = os.path.abspath(a.dir)
    a.parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    if not a.parts or any(x not in PARTS for x in a.parts):
        p.error(f"--parts takes a comma-separated list of {', '.join(PARTS)}")
    if a.freeze_layers is None:
        a.freeze_layers = a.layers * 2 // 3
    if min(a.rounds, a.checkpoints, a.steps, a.layers, a.vocab, a.ctx, a.batch,
           a.dcp_threads) < 1 or a.size <= 0 or a.settle < 0:
        p.error("sizes and counts must be positive")
    if not 0 <= a.freeze_layers <= a.layers:
        p.error("--freeze-layers must be between 0 and --layers")
    if a.dim is None:
        a.dim = pick_dim(a.size, a.vocab, a.layers, a.ctx)
    elif a.dim < 32 or a.dim % 32:
        p.error("--dim must be a positive multiple of 32")
    return a


def check_space(a: argparse.Namespace) -> None:
    """Refuse to start when the work directory's file system cannot hold the largest part:
    ten checkpoints of each side (part 2) or two full checkpoints (part 1), plus a margin."""
    state = 12 * param_count(a.vocab, a.dim, a.layers, a.ctx)
    need = int(1.2 * state * (2 * a.checkpoints if {"train", "frozen"} & set(a.parts) else 2)) + 64 * MiB
    free = shutil.disk_usage(a.dir).free
    if free < need:
        raise SystemExit(f"bench_dcp: {a.dir} has {free / MiB:.0f} MiB free; this run needs about "
                         f"{need / MiB:.0f} MiB (give --dir elsewhere or a smaller --size)")


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: stores closed, dirs removed


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    malloc = ensure_malloc_env(__file__, a.no_malloc_env)
    os.makedirs(a.dir, exist_ok=True)
    fstype = filesystem_type(a.dir)
    if fstype in ("tmpfs", "ramfs") and not a.allow_tmpfs:
        print(f"bench_dcp: {a.dir} is on {fstype}; give --dir on a real disk (or --allow-tmpfs)",
              file=sys.stderr)
        return 2
    check_space(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    env = environment(a, malloc, fstype)
    run = Run(a)
    results: dict[str, Any] = {}
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    work = tempfile.mkdtemp(prefix="bench_dcp-", dir=a.dir)
    try:
        warm_up(work, a.dcp_threads)
        if "io" in a.parts:
            log("bench_dcp: part 1 (full save / load)")
            results["io"] = part_io(run, work)
        for v in ("train", "frozen"):
            if v in a.parts:
                log(f"bench_dcp: part 2 ({v})")
                results[v] = part_train(run, work, v)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    env["load average after"] = load_average()
    env["load average during"] = load_summary(run.loads)
    print(report(env, a, results))
    failed = any(r["verify_failures"] for r in results.values())
    if a.json:
        summary: dict[str, Any] = {}
        if "io" in results:
            summary["io"] = {op: {s: Stats.of(results["io"]["samples"][f"{op}:{s}"]).as_dict()
                                  for s in SIDES} for op in ("save", "load_cold", "load_warm")}
        for v in ("train", "frozen"):
            if v in results:
                r = results[v]
                summary[v] = {"save_s": {s: Stats.of(r["samples"][s]).as_dict() for s in SIDES},
                              "disk": r["disk"]}
        write_json(a.json, "bench_dcp", a, env, {k: r["samples"] for k, r in results.items()},
                   summary, results=results, load_samples=run.loads, verified=not failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
