"""Benchmark: per-iteration checkpoints as gradient deltas (ckptstore.torch.Checkpointer).

A GPT-style model (~25M parameters by default) trained with AdamW on the CPU (``--device cuda``:
on a GPU, each step timed to the end of its kernels on the training stream; the step and
restore measurements only; tools/device_check.sh):

1. plain training and a Checkpointer every iteration (codecs exact and topk:0.01), interleaved in
   blocks (``--rounds`` x ``--block`` iterations each)         -> step-time ratio (medians; and the
   mean with the untimed flush at each block's end counted, which charges a variant for work it
   deferred: a block no longer than the pipeline's ``max_inflight`` (4) could hide a persister
   that never keeps up, hence blocks of 15 by default), the
   persister's CPU ms per iteration and per MB, bytes per delta, the share of the disk's O_DIRECT
   write bandwidth the deltas use
3. a full checkpoint (model + optimizer) with torch.save        -> its size and torch.load time
4. restore of base + K deltas (K=50) via store.load             -> vs torch.load of the full file,
   both from a warm page cache and from a cold one (files evicted first, as after a crash)

    python tools/bench_delta.py [--rounds 4 --block 15] [--k 50] [--dir /tmp/bench_delta] [--layers 6 --dim 512]
                                [--restore-only] [--codecs exact,topk:0.01] [--json OUT] [--quick]

``--memory`` measures instead each variant's resident memory (issue 30): plain training and a
Checkpointer per codec each train ``--memory-steps`` iterations in a fresh process (``--rounds``
rounds, the order rotated), which then reports its peak (VmHWM) and final (VmRSS) resident
memory after a flush, and the bytes the store's host pool keeps cached; medians with the range.

    python tools/bench_delta.py --memory [--codecs exact,exact@hooks] [--memory-steps 40]

``--restore-vs-recompute`` (issue 17) measures instead what restoring base+k costs against the
honest alternative, recomputing: torch.load of the full base checkpoint + k real training steps
of the same model from it. For each k of ``--ks`` (default 10,50,200), page cache warm and cold:

* restore = a fresh read-only open + ``store.load(k)`` (exact codec, base 0 + k deltas, chain
  from a base whose optimizer state is steady: ``--warmup`` plain steps before base 0), checked
  bit for bit against the training run's state at k;
* recompute = torch.load of the base's full checkpoint (median of 3, same cache state) +
  ``load_state_dict`` + the first k of ``--recompute-steps`` measured training steps (forward,
  backward, ``optimizer.step()``) from it, on the same batches; for k beyond the measured steps
  their time is scaled by k / measured (said so in the output);

then, with ``--follower-every K`` (default 50; 0: skip), a shadow follower replays the chain and
writes its bases, and the restore of the newest iteration (a follower base) and of the one before
it (K - 1 deltas past the previous base) is compared with torch.load of a full checkpoint. Every
figure is printed with the machine's load average. The store holds ``max(ks)`` deltas of 104 MiB.

    python tools/bench_delta.py --restore-vs-recompute [--ks 10,50,200] [--recompute-steps 50]
                                [--warmup 3] [--follower-every 50] [--reps 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckptstore  # noqa: E402
from ckptstore.torch import Checkpointer  # noqa: E402
from bench_core_state import proc_status  # noqa: E402
from harness import (Stats, add_standard_args, dir_bytes, direct_write_bandwidth,  # noqa: E402
                     evict_files as evict, header, load_average, machine, median, mem_available,
                     parser, quick, read_tree, rotated, table, write_json)


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(ctx, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def build(args):
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.ctx).to(device_of(args))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    return model, opt


def batch(args, it):
    g = torch.Generator().manual_seed(it)
    x = torch.randint(0, args.vocab, (args.batch, args.ctx + 1), generator=g).to(device_of(args))
    return x[:, :-1], x[:, 1:]


def device_of(args) -> str:
    """Where the model trains (``--device``; the CPU for callers whose arguments lack it)."""
    return getattr(args, "device", "cpu")


def settle(args) -> None:
    """Wait for the training stream's queued kernels (a GPU's steps are timed to their end, as
    a loop that reads its loss does; the side streams that copy snapshots are not waited for)."""
    if device_of(args).startswith("cuda"):
        torch.cuda.current_stream().synchronize()


def forward(model, args, it):
    x, y = batch(args, it)
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))


def fwd_bwd(model, args, it):
    loss = forward(model, args, it)
    loss.backward()
    return loss.item()


def seg_bytes(path):
    return dir_bytes(os.path.join(path, "segments")) if os.path.isdir(os.path.join(path, "segments")) \
        else dir_bytes(path)


def run_plain(args):
    model, opt = build(args)
    fwd_bwd(model, args, 0)
    opt.step()
    opt.zero_grad()
    times = []
    for it in range(1, args.iters + 1):
        t0 = time.perf_counter()
        fwd_bwd(model, args, it)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return median(times), model, opt


def run_ckpt(args, codec, path, iters, group_commit=1):
    shutil.rmtree(path, ignore_errors=True)
    model, opt = build(args)
    store = ckptstore.open(path)
    ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=10_000, codec=codec,
                      group_commit=group_commit,
                      fingerprint_every=10)
    ck.restore()
    base_bytes = seg_bytes(path)
    times, futs = [], []
    for it in range(1, iters + 1):
        t0 = time.perf_counter()
        fwd_bwd(model, args, it)
        futs.append(ck.step(it))  # asynchronous Checkpointer: a future of AsyncStats
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    ck.flush()
    written = [f.result().written_bytes for f in futs]
    store.close()
    return median(times), written, base_bytes, (model, opt)


class _Variant:
    """One training run of the interleaved step measurement: its own model, optimizer and (for a
    codec) store and Checkpointer."""

    def __init__(self, args, codec: str | None, path: str) -> None:
        self.codec = codec
        self.model, self.opt = build(args)
        self.ck = self.store = None
        hows: set[str] = set()
        if codec is not None:
            shutil.rmtree(path, ignore_errors=True)
            # "exact@buffered": appends without O_DIRECT; "exact@hooks": gradients copied
            # during backward (the capture before lending); "@twopart": the two-part step of a
            # framework's trainer (before_step, optimizer step, zero_grad, after_step); "@sync":
            # the synchronous Checkpointer (the delta written in the step, no persister thread);
            # "+" joins them ("@buffered+hooks")
            name, _, how = codec.partition("@")
            hows = set(how.split("+")) if how else set()
            self.store = ckptstore.open(path, direct_io="buffered" not in hows)
            self.ck = Checkpointer(self.store, self.model, self.opt, policy="every-iteration",
                                   base_every=10_000, codec=name, fingerprint_every=10,
                                   capture="hooks" if "hooks" in hows else "lend",
                                   asynchronous="sync" not in hows)
            self.ck.restore()
        self.two_part = "twopart" in hows
        self.it = 0
        self.times: list[float] = []
        self.phases: list[tuple[float, float, float]] = []  # (forward, backward, step) per step
        self.futures: list = []
        self.drains: list[float] = []

    def step(self, args, timed: bool) -> None:
        self.it += 1
        t0 = time.perf_counter()
        loss = forward(self.model, args, self.it)
        settle(args)
        t1 = time.perf_counter()
        loss.backward()
        settle(args)
        t2 = time.perf_counter()
        fut = None
        if self.two_part:
            self.ck.before_step(self.it)
            self.opt.step()
            self.opt.zero_grad()
            fut = self.ck.after_step()
        else:
            if self.ck is not None:
                fut = self.ck.step(self.it)
            else:
                self.opt.step()
            self.opt.zero_grad()
        if timed and fut is not None:
            self.futures.append(fut)
        settle(args)
        if timed:
            t3 = time.perf_counter()
            self.times.append(t3 - t0)
            self.phases.append((t1 - t0, t2 - t1, t3 - t2))

    def drain(self) -> None:
        if self.ck is not None:
            t0 = time.perf_counter()
            self.ck.flush()
            self.drains.append(time.perf_counter() - t0)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def interleaved_steps(args, codecs: list[str], rounds: int, block: int) -> list[_Variant]:
    """Plain training and training with a Checkpointer per codec, in blocks of ``block``
    iterations for ``rounds`` rounds, the order rotated each round (a shared machine's drift hits
    every variant alike). Each checkpointed block ends with an untimed flush, so no persister work
    spills into the next variant's block; its duration (the backlog at the block's end) is kept."""
    variants = [_Variant(args, None, "")] + [
        _Variant(args, c, os.path.join(args.dir, f"steps-{c.replace(':', '')}")) for c in codecs]
    for v in variants:  # warm-up, untimed: allocator, first base snapshot
        for _ in range(2):
            v.step(args, timed=False)
        v.drain()
    for v in variants:
        v.drains.clear()
    for r in range(rounds):
        for v in rotated(variants, r):
            for _ in range(block):
                v.step(args, timed=True)
            v.drain()
    for v in variants:
        v.close()
    return variants


def report_steps(variants: list["_Variant"], bandwidth: float | None, full_bytes: int) -> dict:
    """Print step-time ratios, the persister's CPU per iteration and per MB, bytes per iteration and
    the fraction of the disk's O_DIRECT bandwidth the checkpoints use. Returns each variant's
    step-time :class:`~harness.Stats` (for JSON)."""
    plain = median(variants[0].times)
    plain_mean = sum(variants[0].times) / len(variants[0].times)
    print(f"plain step (interleaved): {Stats.of(variants[0].times).show(1e3, '.0f', ' ms')}")

    def phases(v: "_Variant") -> list[float]:
        return [median([p[k] for p in v.phases]) for k in range(3)]

    base = phases(variants[0])
    print("  plain phases (medians): " + ", ".join(
        f"{name} {t * 1e3:.1f} ms" for name, t in zip(("forward", "backward", "step"), base)))
    for v in variants[1:]:
        step = median(v.times)
        # (the asynchronous path's futures give AsyncStats; @sync's steps return SaveStats, the
        # write's wall time in the step instead of the persister's CPU)
        stats = [f.result() if hasattr(f, "result") else f for f in v.futures if f is not None]
        stats = [s for s in stats if s is not None and getattr(s, "kind", "delta") == "delta"]
        cpu = median([s.cpu_s if hasattr(s, "cpu_s") else s.seconds for s in stats])
        what = "persister CPU" if hasattr(stats[0], "cpu_s") else "write in the step (wall)"
        written = median([s.written_bytes for s in stats])
        rate = written / step
        disk = f"{100 * rate / bandwidth:.1f}% of the disk's O_DIRECT bandwidth " \
               f"({bandwidth / 1e9:.2f} GB/s)" if bandwidth else "O_DIRECT bandwidth unknown"
        print(f"[{v.codec}] step with Checkpointer every iteration: {step * 1e3:.0f} ms "
              f"(ratio {step / plain:.3f}x plain, medians of {len(v.times)} interleaved); "
              f"{what} {cpu * 1e3:.1f} ms/iteration = {cpu * 1e3 / (written / 1e6):.3f} ms/MB; "
              f"delta {written / 2**20:.2f} MiB/iteration = {100 * written / full_bytes:.2f}% of a full "
              f"checkpoint; {rate / 1e6:.0f} MB/s written = {disk}; flush at a block's end "
              f"{median(v.drains) * 1e3:.0f} ms", flush=True)
        # the flush at each block's end is untimed above; counting it too charges the variant
        # for work it deferred (a backlog the block's end left to the flush)
        amortized = (sum(v.times) + sum(v.drains)) / len(v.times)
        print(f"  [{v.codec}] with the flushes at the blocks' ends: {amortized * 1e3:.0f} ms per "
              f"iteration (mean) = {amortized / plain_mean:.3f}x plain's mean "
              f"{plain_mean * 1e3:.0f} ms", flush=True)
        print(f"  [{v.codec}] phases against plain (difference of medians): " + ", ".join(
            f"{name} {(t - b) * 1e3:+.1f} ms" for name, t, b in
            zip(("forward", "backward", "step"), phases(v), base)), flush=True)
        print(f"  [{v.codec}] step: {Stats.of(v.times).show(1e3, '.0f', ' ms')}", flush=True)
    return {v.codec or "plain": Stats.of(v.times).as_dict() for v in variants}


MODEL_ARGS = ("layers", "dim", "heads", "vocab", "ctx", "batch", "threads")


def memory_child(args) -> None:
    """--memory's child: variant ``args.memory_child`` ("plain" or a codec) trains
    ``args.memory_steps`` iterations in this fresh process, flushes, and prints one JSON line:
    VmHWM and VmRSS (bytes, with RssFile), and the host pool's cached bytes."""
    codec = None if args.memory_child == "plain" else args.memory_child
    v = _Variant(args, codec, os.path.join(args.dir, "memory"))
    for _ in range(args.memory_steps):
        v.step(args, timed=False)
    v.drain()
    pipe = v.store.running_pipeline if v.store is not None else None
    print(json.dumps({**proc_status(), "pool_cached": pipe.pool.cached if pipe else 0}))
    v.close()


def memory_runs(args, codecs: list[str]) -> dict:
    """--memory: every variant in its own fresh process, ``args.rounds`` rounds in rotated
    order; prints the medians (and ranges) of peak and final resident memory and the pool's
    cache. Returns the samples by variant."""
    variants = ["plain", *codecs]
    samples: dict[str, list[dict]] = {v: [] for v in variants}
    model = [x for k in MODEL_ARGS for x in (f"--{k}", str(getattr(args, k)))]
    for r in range(args.rounds):
        for v in rotated(variants, r):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child", v,
                                  "--memory-steps", str(args.memory_steps), "--dir", args.dir,
                                  *model], capture_output=True, text=True, check=True)
            samples[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
    def mib(v: str, key: str) -> str:
        xs = [s[key] / 2**20 for s in samples[v]]
        return f"{median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"
    rows = [(v, mib(v, "VmHWM"), mib(v, "VmRSS"),
             f"{median([s['pool_cached'] for s in samples[v]]) / 2**20:.0f}") for v in variants]
    print(f"resident memory after {args.memory_steps} iterations and a flush, fresh process per "
          f"run, {args.rounds} rounds (MiB, median (range)):")
    print(table(("variant", "peak (VmHWM)", "final (VmRSS)", "host pool cached"), rows))
    return samples


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The GPT-style model's size and the torch thread count (shared with bench_async.py)."""
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)


def setup(args, title: str) -> dict:
    """Apply the thread count, create ``args.dir``, print the machine header (``title`` first)
    and the model line (shared with bench_async.py). Returns the machine header (for JSON)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.dir, exist_ok=True)
    model, _ = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    on = "" if device_of(args) == "cpu" else f" on {torch.cuda.get_device_name()}"
    mach = machine(model=f"GPT {args.layers} layers, dim {args.dim}, vocab {args.vocab}: "
                         f"{n_params / 1e6:.1f}M parameters; AdamW{on}")
    print(header(title, mach), flush=True)
    return mach


def _same_state(live, st) -> bool:
    """Model and optimizer state of ``st`` equal ``live``'s bit for bit."""
    def same(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
                torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b
    return same(live["model"], dict(st["model"])) and \
        same(live["optimizer"]["state"], st["optimizer"]["state"])


def _timed_load(path: str, it: int):
    """A fresh read-only open + store.load(it): (wall s, process CPU s, state, start)."""
    with ckptstore.open(path, "r") as r, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = r.load_base(it)
        c0, t0 = time.process_time(), time.perf_counter()
        st = r.load(it)
        return time.perf_counter() - t0, time.process_time() - c0, st, start


def restore_vs_recompute(args) -> dict:
    ks = sorted({int(x) for x in args.ks.split(",")})
    kmax = ks[-1]
    model, opt = build(args)
    for it in range(-args.warmup, 0):  # base 0 mid-training: the optimizer state is steady
        fwd_bwd(model, args, it)
        opt.step()
        opt.zero_grad()
    base_pt = os.path.join(args.dir, "base.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, base_pt)
    full_mib = os.path.getsize(base_pt) / 2**20
    path = os.path.join(args.dir, "restore-vs-recompute")
    shutil.rmtree(path, ignore_errors=True)
    store = ckptstore.open(path)
    ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=None, codec="exact",
                      group_commit=10,
                      fingerprint_every=10)
    assert ck.restore() == 0
    live = {}
    t0 = time.perf_counter()
    for it in range(1, kmax + 1):
        fwd_bwd(model, args, it)
        ck.step(it)
        opt.zero_grad()
        if it in ks:
            live[it] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                        "optimizer": copy.deepcopy(opt.state_dict())}
    ck.close()
    store.close()
    print(f"store: base 0 + {kmax} exact deltas, {seg_bytes(path) / 2**30:.1f} GiB, written in "
          f"{time.perf_counter() - t0:.0f} s of training with the Checkpointer ({load_average()}); "
          f"full checkpoint (torch.save of model + optimizer) {full_mib:.0f} MiB", flush=True)

    # ---- recompute: torch.load of the base + load_state_dict + real training steps from it
    loads: dict[str, float] = {}
    for cache in ("warm", "cold"):
        ts = []
        for _ in range(3):
            if cache == "cold":
                evict(base_pt)
            else:
                torch.load(base_pt, weights_only=False)
            t0 = time.perf_counter()
            torch.load(base_pt, weights_only=False)
            ts.append(time.perf_counter() - t0)
        loads[cache] = median(ts)
        print(f"recompute: torch.load of the base checkpoint, {cache}: {loads[cache] * 1e3:.0f} ms "
              f"(median of 3; {load_average()})", flush=True)
    m2, o2 = build(args)
    sd = torch.load(base_pt, weights_only=False)
    t0 = time.perf_counter()
    m2.load_state_dict(sd["model"])
    o2.load_state_dict(sd["optimizer"])
    t_sd = time.perf_counter() - t0
    del sd
    n = min(kmax, args.recompute_steps)
    cum = [0.0]
    for it in range(1, n + 1):
        t0 = time.perf_counter()
        fwd_bwd(m2, args, it)
        o2.step()
        o2.zero_grad()
        cum.append(cum[-1] + time.perf_counter() - t0)
    exact_recompute = n in live and _same_state(live[n], {"model": m2.state_dict(),
                                                           "optimizer": o2.state_dict()})
    print(f"recompute: {n} training steps from the base: {cum[n]:.1f} s ({cum[n] / n * 1e3:.0f} ms "
          f"per step; {load_average()}); load_state_dict {t_sd * 1e3:.0f} ms; iteration {n} "
          f"{'reproduced bit for bit' if exact_recompute else 'not compared'}", flush=True)
    del m2, o2

    def recompute(k: int, cache: str) -> tuple[float, bool]:
        scaled = k > n
        steps = cum[n] * k / n if scaled else cum[k]
        return loads[cache] + t_sd + steps, scaled

    # ---- restore: fresh reader, store.load(k)
    mem = mem_available()
    rows = []
    t0 = time.perf_counter()
    _timed_load(path, ks[0])  # once per process: the native kernel's calibration (untimed)
    print(f"process warm-up: a first restore of {ks[0]} took {time.perf_counter() - t0:.2f} s "
          f"(native Adam kernel calibrated against torch once per process; {load_average()})",
          flush=True)
    for cache in ("warm", "cold"):
        if cache == "warm":
            read_tree(path)  # the writer evicted what it wrote
        for k in ks:
            reps = 1 if k == kmax and k >= 100 else args.reps
            ts, cpu, exact = [], [], True
            for rep in range(reps):
                if cache == "cold":
                    evict(path)
                wall, c, st, _start = _timed_load(path, k)
                if rep == 0:
                    exact = _same_state(live[k], st)
                del st
                ts.append(wall)
                cpu.append(c)
            rc, scaled = recompute(k, cache)
            t = median(ts)
            la = load_average()
            rows.append((k, cache, t, median(cpu), rc, scaled, exact, la, reps))
            print(f"[k={k}, {cache}] restore base+{k}: {t:.2f} s (CPU {median(cpu):.2f} s, "
                  f"{'median of ' + str(reps) if reps > 1 else 'one run'}; "
                  f"{'bit-exact' if exact else 'NOT EXACT'}) vs recompute {rc:.1f} s"
                  f"{' (steps scaled from ' + str(n) + ')' if scaled else ''}: ratio "
                  f"{t / rc:.3f}x ({la})", flush=True)
    store_gib = seg_bytes(path) / 2**30
    print(f"\n(warm: every file read once before; the store is {store_gib:.1f} GiB against "
          f"{mem / 2**30:.1f} GiB available memory, so a warm restore of k deltas finds the "
          "newest ones in the page cache only as far as it holds them)")
    print()
    print(table(["k", "page cache", "restore base+k (store.load)",
                 "recompute (torch.load + k steps)", "ratio", "load avg"],
                [[k, cache, f"{t:.2f} s{'' if exact else ' (NOT EXACT)'}",
                  f"{rc:.1f} s{' (steps scaled)' if scaled else ''}", f"**{t / rc:.3f}x**",
                  la.split(" (")[0]] for k, cache, t, c, rc, scaled, exact, la, reps in rows],
                left=2))

    frows = []
    if args.follower_every:
        from ckptstore.follow import Follower

        K = args.follower_every
        t0 = time.perf_counter()
        with Follower(path, every=K, threads=max(1, torch.get_num_threads())) as f:
            f.run(until=kmax)
            bases = f.stats.bases
        print(f"\nfollower (every {K}): replayed {kmax} deltas and wrote bases {bases} in "
              f"{time.perf_counter() - t0:.0f} s ({load_average()})", flush=True)
        for cache in ("warm", "cold"):
            if cache == "warm":
                read_tree(os.path.join(path, "follower"))
                torch.load(base_pt, weights_only=False)
            for it in (kmax, kmax - 1):
                ts, tl = [], []
                for _ in range(args.reps + 1):
                    if cache == "cold":
                        evict(base_pt)
                    t0 = time.perf_counter()
                    torch.load(base_pt, weights_only=False)
                    tl.append(time.perf_counter() - t0)
                    if cache == "cold":
                        evict(path)
                    wall, _c, st, start = _timed_load(path, it)
                    ts.append(wall)
                exact = it not in live or _same_state(live[it], st)
                del st
                la = load_average()
                frows.append((it, cache, median(ts), median(tl), start, exact, la))
                print(f"[follower, {cache}] restore {it} from {start[0]} base {start[1]}: "
                      f"{median(ts):.2f} s vs torch.load of the full checkpoint "
                      f"{median(tl) * 1e3:.0f} ms (same run): {median(ts) / median(tl):.2f}x "
                      f"({la})", flush=True)
        print()
        print(table(["restore", "page cache", "starts from", "store.load",
                     "torch.load (full checkpoint)", "ratio", "load avg"],
                    [[it, cache, f"{start[0]} base {start[1]} ({it - start[1]} deltas)",
                      f"{t:.2f} s{'' if exact else ' (NOT EXACT)'}", f"{tl * 1e3:.0f} ms",
                      f"**{t / tl:.2f}x**", la.split(" (")[0]]
                     for it, cache, t, tl, start, exact, la in frows], left=3))
    if not args.keep:
        shutil.rmtree(path, ignore_errors=True)
    return {"restores": [dict(zip(("k", "cache", "seconds", "cpu_s", "recompute_s", "scaled",
                                   "exact", "load_average", "reps"), r)) for r in rows],
            "follower": [dict(zip(("iteration", "cache", "seconds", "torch_load_s", "start",
                                   "exact", "load_average"), r)) for r in frows]}


def main():
    ap = parser(__doc__)
    ap.add_argument("--k", type=int, default=50)
    ap.add_argument("--dir", default="/tmp/bench_delta")
    ap.add_argument("--restore-only", action="store_true", help="skip the step-time runs")
    ap.add_argument("--steps-only", action="store_true", help="skip the restore runs")
    ap.add_argument("--codecs", default="exact,topk:0.01",
                    help="comma-separated; a codec@buffered variant appends without O_DIRECT, "
                         "exact@hooks copies the gradients during backward instead of lending "
                         "them, @twopart steps through before_step/after_step, @sync writes "
                         "the delta in the step (asynchronous=False) (joined with +: "
                         "@buffered+hooks; step measurement only)")
    add_standard_args(ap, rounds=4, rounds_help="interleaved rounds of the step measurement",
                      quick_help="a smoke run: a 2-layer model of dim 128, 2 rounds of 3 "
                                 "iterations, k 4 (ks 2,4)")
    ap.add_argument("--block", type=int, default=15, help="iterations per variant and round")
    ap.add_argument("--restore-vs-recompute", action="store_true",
                    help="restore base+k against torch.load + k training steps (module docstring)")
    ap.add_argument("--ks", default="10,50,200", help="--restore-vs-recompute: the ks")
    ap.add_argument("--recompute-steps", type=int, default=50,
                    help="--restore-vs-recompute: training steps measured for the recompute "
                         "(larger ks scale them)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="--restore-vs-recompute: plain steps before base 0")
    ap.add_argument("--follower-every", type=int, default=50,
                    help="--restore-vs-recompute: follower base interval (0: no follower part)")
    ap.add_argument("--reps", type=int, default=2, help="--restore-vs-recompute: restores per cell")
    ap.add_argument("--keep", action="store_true", help="--restore-vs-recompute: keep the store")
    ap.add_argument("--memory", action="store_true",
                    help="resident memory of each variant, a fresh process per run (module docstring)")
    ap.add_argument("--memory-steps", type=int, default=40, help="--memory: iterations per run")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    add_model_args(ap)
    ap.add_argument("--device", default="cpu",
                    help="where the model trains: cpu, or cuda (each step timed to the end of "
                         "its kernels on the training stream; tools/device_check.sh)")
    args = ap.parse_args()
    if args.memory_child is not None:
        if args.threads:
            torch.set_num_threads(args.threads)
        memory_child(args)
        return
    quick(args, ap, layers=2, dim=128, vocab=2048, rounds=2, block=3, k=4, ks="2,4",
          recompute_steps=4, warmup=1, follower_every=2, reps=1, memory_steps=4)
    rvr = args.restore_vs_recompute
    if device_of(args) != "cpu" and (rvr or args.memory):
        ap.error("--device: the step and restore measurements only (not --restore-vs-recompute "
                 "or --memory)")
    mach = setup(args, f"bench_delta{' --restore-vs-recompute' if rvr else ''}")
    if args.restore_vs_recompute:
        rows = restore_vs_recompute(args)
        write_json(args.json, "bench_delta --restore-vs-recompute", args, mach, rows, None)
        return
    if args.memory:
        write_json(args.json, "bench_delta --memory", args, mach,
                   memory_runs(args, args.codecs.split(",")), None)
        return
    samples: dict = {"steps": {}, "restores": []}
    aggregates: dict = {}

    _, model, opt = run_plain(argparse.Namespace(**{**vars(args), "iters": 2}))
    full = os.path.join(args.dir, "full.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, full)
    full_bytes = os.path.getsize(full)
    loads = []
    for _ in range(3):
        t0 = time.perf_counter()
        torch.load(full, weights_only=False)
        loads.append(time.perf_counter() - t0)
    t_load = min(loads)
    print(f"full checkpoint (model+optimizer, torch.save): {full_bytes / 2**20:.1f} MiB, "
          f"torch.load {t_load * 1e3:.0f} ms")
    bandwidth = direct_write_bandwidth(args.dir)
    codecs = args.codecs.split(",")
    if not args.restore_only:
        variants = interleaved_steps(args, codecs, args.rounds, args.block)
        aggregates["steps"] = report_steps(variants, bandwidth, full_bytes)
        samples["steps"] = {v.codec or "plain": {"seconds": v.times, "flush_s": v.drains}
                            for v in variants}
        for v in variants[1:]:
            shutil.rmtree(os.path.join(args.dir, f"steps-{v.codec.replace(':', '')}"),
                          ignore_errors=True)

    for codec in [c for c in codecs if "@" not in c and not args.steps_only]:
        path = os.path.join(args.dir, f"restore-{codec.replace(':', '')}")
        _, _, _, (m, o) = run_ckpt(args, codec, path, args.k, group_commit=10)
        for cache in ("warm", "cold"):
            times, loads, cpu = [], [], []
            if cache == "warm":  # the writer evicted what it wrote: read everything once, untimed
                torch.load(full, weights_only=False)
                with ckptstore.open(path, "r") as r, warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    r.load(args.k)
            for _ in range(3):  # torch.load interleaved with the restores: the machine may be shared
                if cache == "cold":
                    evict(full)
                t0 = time.perf_counter()
                torch.load(full, weights_only=False)
                loads.append(time.perf_counter() - t0)
                if cache == "cold":
                    evict(path)
                with ckptstore.open(path, "r") as r:
                    c0, t0 = time.process_time(), time.perf_counter()
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        st = r.load(args.k)
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
            exact = all(torch.equal(a.cpu(), st["model"][k]) for k, a in m.state_dict().items())
            why = "; ".join((st.get("replay_report") or {}).get("reasons") or ["lossy codec"])
            print(f"[{codec}] restore base+{args.k}, {cache} page cache (store.load, median of 3): "
                  f"{median(times):.2f} s (CPU {median(cpu):.2f} s) = {median(times) / median(loads):.1f}x "
                  f"torch.load of the full checkpoint ({median(loads) * 1e3:.0f} ms, same run, {cache}); "
                  f"{'bit-exact' if exact else f'approximate ({why})'}; store "
                  f"{seg_bytes(path) / 2**20:.0f} MiB", flush=True)
            samples["restores"].append({"codec": codec, "cache": cache, "seconds": times,
                                        "cpu_s": cpu, "torch_load_s": loads, "exact": exact})
        shutil.rmtree(path, ignore_errors=True)
    write_json(args.json, "bench_delta", args, mach, samples, aggregates)


if __name__ == "__main__":
    main()
