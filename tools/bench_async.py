"""Benchmark: zero-stall checkpointing (issue 4), peers side by side in one run.

The GPT-style model of tools/bench_delta.py (~27M parameters by default) trained with AdamW on CPU:

1. plain training loop, no checkpoints                                   -> step time
2. ckptstore Checkpointer (async pipeline, layer-wise gradient capture): an exact delta every
   iteration + a base snapshot every ``--every`` iterations              -> step time, ratio
3. torch.save(model + optimizer) + fsync every ``--every`` iterations     -> step time, ratio
4. DCP async_save every ``--every`` iterations (no process group)         -> step time, ratio
5. the training stall of a base snapshot (``store.save_async`` of the Checkpointer's state) vs a
   plain copy of the same tensors into preallocated buffers               -> ratio (target <= 1.2)

Step time = forward + backward + checkpoint call + optimizer step, median over the iterations of
``--rounds`` (``--passes``) passes, the peers' order rotated each pass (the checkpointing peers'
medians hide their periodic spikes, so the mean, min-max and stdev are printed too). For ckptstore
also the background persister's CPU per iteration and per MB, and the share of the disk's O_DIRECT write bandwidth its deltas use.

    python tools/bench_async.py [--iters 120] [--every 100] [--rounds 2] [--dir /tmp/bench_async] [--layers 6 --dim 512]
                                [--json OUT] [--quick]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckptstore  # noqa: E402
from bench_delta import add_model_args, build, fwd_bwd, setup  # noqa: E402
from ckptstore.torch import Checkpointer  # noqa: E402
from harness import (Stats, add_standard_args, direct_write_bandwidth, fsync_path,  # noqa: E402
                     interleave, parser, quick, table, write_json)


def loop(args, step_fn, label: str):
    """Train ``args.iters`` iterations; ``step_fn(it, model, opt)`` does the optimizer step and any
    checkpointing. Returns the per-iteration times."""
    model, opt = build(args)
    setup = getattr(step_fn, "setup", None)
    if setup is not None:
        setup(model, opt)
    times = []
    for it in range(1, args.iters + 1):
        t0 = time.perf_counter()
        fwd_bwd(model, args, it)
        step_fn(it, model, opt)
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    fin = getattr(step_fn, "finish", None)
    t_fin = 0.0
    if fin is not None:
        t0 = time.perf_counter()
        fin()
        t_fin = time.perf_counter() - t0
    print(f"  {label}: done ({args.iters} iterations, final drain {t_fin:.2f} s)", flush=True)
    return times


def plain_step(it, model, opt):
    opt.step()


class CkptStep:
    def __init__(self, args) -> None:
        self.args = args
        self.path = os.path.join(args.dir, "ckptstore")
        shutil.rmtree(self.path, ignore_errors=True)

    def setup(self, model, opt) -> None:
        self.store = ckptstore.open(self.path)
        self.ck = Checkpointer(self.store, model, opt, policy="every-iteration",
                               base_every=self.args.every,
                               group_commit=self.args.group_commit, fingerprint_every=0)
        self.ck.restore()

    def __call__(self, it, model, opt) -> None:
        self.ck.step(it)

    def finish(self) -> None:
        self.store.flush()
        self.stats = self.store.stats()
        self.capture = dict(self.ck.capture_counts)
        self.store.close()


class TorchSaveStep:
    def __init__(self, args) -> None:
        self.args = args
        self.path = os.path.join(args.dir, "torch.pt")

    def __call__(self, it, model, opt) -> None:
        opt.step()
        if it % self.args.every == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, self.path)
            fsync_path(self.path)


class DcpAsyncStep:
    def __init__(self, args) -> None:
        self.args = args
        self.fut = None

    def __call__(self, it, model, opt) -> None:
        import torch.distributed.checkpoint as dcp

        opt.step()
        if it % self.args.every == 0:
            if self.fut is not None:
                self.fut.result()  # DCP allows one async save in flight
            path = os.path.join(self.args.dir, f"dcp-{it}")
            shutil.rmtree(path, ignore_errors=True)
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            self.fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                                      no_dist=True)

    def finish(self) -> None:
        if self.fut is not None:
            self.fut.result()


def stall_vs_copy(args, reps: int = 5):
    """Median stall of store.save_async(base state) vs a plain copy of the same tensors into
    preallocated buffers (both warm: buffers already touched)."""
    model, opt = build(args)
    fwd_bwd(model, args, 0)
    opt.step()
    opt.zero_grad()
    path = os.path.join(args.dir, "stall")
    shutil.rmtree(path, ignore_errors=True)
    store = ckptstore.open(path)
    ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=10**9,
                      fingerprint_every=0)
    tensors = [t for t in _tensors(ck.state(0))]
    dst = [torch.empty_like(t) for t in tensors]
    copies, stalls = [], []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors):
            d.copy_(s)
        c = time.perf_counter() - t0
        st = ck.state(r + 1)
        t0 = time.perf_counter()
        fut = store.save_async(r + 1, st)
        s = time.perf_counter() - t0
        fut.result()
        if r:  # the first round touches fresh memory (arena allocation): warm-up
            copies.append(c)
            stalls.append(s)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    store.close()
    return statistics.median(copies), statistics.median(stalls), nbytes


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--iters", type=int, default=120)
    ap.add_argument("--every", type=int, default=100, help="base / full checkpoint interval")
    ap.add_argument("--group-commit", type=int, default=10, help="deltas per fsync group")
    ap.add_argument("--dir", default="/tmp/bench_async")
    add_model_args(ap)
    ap.add_argument("--skip-dcp", action="store_true")
    add_standard_args(ap, rounds=2, aliases=("--passes",),
                      rounds_help="passes over the peers, the order rotated each pass",
                      quick_help="a smoke run: a 2-layer model of dim 128, 12 iterations, a "
                                 "checkpoint every 5, 1 pass")
    args = ap.parse_args()
    quick(args, ap, layers=2, dim=128, vocab=2048, iters=12, every=5, rounds=1)
    mach = setup(args, "bench_async")
    print(f"{args.iters} iterations per peer; checkpoint interval {args.every}; ckptstore group "
          f"commit {args.group_commit}", flush=True)

    peers = [("no checkpointing", lambda: plain_step, "plain"),
             ("ckptstore: delta/iter + base/N (async)", lambda: CkptStep(args), "ckptstore"),
             (f"torch.save every {args.every}", lambda: TorchSaveStep(args), "torch.save")]
    if not args.skip_dcp:
        peers.append((f"DCP async_save every {args.every}", lambda: DcpAsyncStep(args), "dcp"))
    makers = {name: (make, label) for name, make, label in peers}
    ck_steps: list[CkptStep] = []

    def one(name: str, p: int) -> list[float]:
        make, label = makers[name]
        step = make()
        times = loop(args, step, f"{label} (pass {p + 1})")
        if isinstance(step, CkptStep):
            ck_steps.append(step)
        return times

    # the peers' order rotated each pass: a shared machine's drift hits every peer alike
    res = interleave(list(makers), args.rounds, one)
    runs = {name: res.values(name) for name in makers}
    ck = ck_steps[-1]
    ck_stats = [st for step in ck_steps for st in step.stats]

    base = statistics.median(runs["no checkpointing"])
    stats = {name: Stats.of(ts) for name, ts in runs.items()}
    print()
    print(table(["peer", "median ms", "mean ms", "min-max ms", "sd ms", "ratio (median)"],
                [[name, f"{st.median * 1e3:.0f}", f"{st.mean * 1e3:.0f}",
                  f"{st.min * 1e3:.0f}-{st.max * 1e3:.0f}", f"{st.stdev * 1e3:.0f}",
                  f"{st.median / base:.3f}"] for name, st in stats.items()]))
    st = ck_stats
    deltas = [s for s in st if s.kind == "delta"]
    bases = [s for s in st if s.kind == "snapshot"]
    if deltas:
        print(f"ckptstore deltas: median stall {statistics.median(s.stall_s for s in deltas) * 1e3:.1f} ms, "
              f"snapshot {statistics.median(s.snapshot_s for s in deltas) * 1e3:.1f} ms, background "
              f"write {statistics.median(s.write_s for s in deltas) * 1e3:.0f} ms, persist "
              f"{statistics.median(s.persist_s for s in deltas) * 1e3:.0f} ms, written "
              f"{statistics.median(s.written_bytes for s in deltas) / 2**20:.1f} MiB, max queue "
              f"{max(s.queue_depth for s in deltas)}, backpressure wait total "
              f"{sum(s.wait_s for s in deltas):.2f} s; gradient capture {ck.capture}")
    if deltas:
        cpu = statistics.median(s.cpu_s for s in deltas)
        mb = statistics.median(s.written_bytes for s in deltas) / 1e6
        step = statistics.median(runs["ckptstore: delta/iter + base/N (async)"])
        bw = direct_write_bandwidth(args.dir)
        share = f"{100 * mb * 1e6 / step / bw:.1f}% of the disk's O_DIRECT write bandwidth " \
                f"({bw / 1e9:.2f} GB/s)" if bw else "O_DIRECT bandwidth unknown here"
        print(f"ckptstore persister: CPU {cpu * 1e3:.1f} ms/iteration = {cpu * 1e3 / mb:.3f} ms/MB "
              f"(median over deltas; time.thread_time of the background thread); "
              f"{mb / step:.0f} MB/s of deltas = {share}")
    if bases:
        print(f"ckptstore bases: stall {', '.join(f'{s.stall_s * 1e3:.0f}' for s in bases)} ms")

    copy_s, stall_s, nbytes = stall_vs_copy(args)
    print(f"base snapshot stall (save_async of {nbytes / 2**20:.0f} MiB model+optimizer state): "
          f"{stall_s * 1e3:.1f} ms vs plain copy into preallocated buffers {copy_s * 1e3:.1f} ms: "
          f"ratio {stall_s / copy_s:.2f} (target <= 1.2)")
    write_json(args.json, "bench_async", args, mach, res,
               {name: st.as_dict() for name, st in stats.items()},
               stall={"copy_s": copy_s, "stall_s": stall_s, "bytes": nbytes})
    print("CAVEAT: this machine has 2 cores shared by training, the background persister "
          "(hashing, lz4 probes, writes) and other processes; on 2 cores the persister competes "
          "with training's own threads, so the step-time ratio here bounds from above what a "
          "machine with spare cores would see. Timings are noisy (load average printed above).")


if __name__ == "__main__":
    main()
