"""Benchmark: many reader processes, loading and replaying, beside one training writer.

The writer trains a model with the Checkpointer (a base snapshot every 4th iteration, exact
gradient deltas between them group-committed by 2 through the async pipeline, gc every
``--gc-every`` iterations) for ``--seconds`` alone, then again with ``--readers`` reader processes
(``--rounds`` times each, the order rotated each round) that loop: open (a fresh reader every
other round, else a long-lived one), list, load the latest
and a random listed iteration (a delta iteration is replayed from its base), then replay a range
of up to 5 iterations (``Store.replay``) from a random listed one; every state is checked bit for
bit (an xxh3 digest of model and optimizer state) against the run computed beforehand in this
process. Printed: the writer's iterations per second alone and with readers (its slowdown), the
readers' verified loads per second (MB/s of state read) and replays per second (ranges, and the
states they yielded), with the machine's core count and load average. Nothing is asserted:
tests/test_concurrency.py checks correctness under the same load.

    python tools/bench_readers.py [--readers 8] [--seconds 10] [--gc-every 6] [--width 256]
                                  [--dir /tmp/bench_readers] [--rounds 1] [--json OUT] [--quick]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import sys
import time
from typing import Any

import numpy as np
import torch
import xxhash

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckptstore  # noqa: E402
from harness import (add_standard_args, header, interleave, machine, parser, quick,  # noqa: E402
                     write_json)
from ckptstore.torch import Checkpointer  # noqa: E402

CHUNK = 64 << 10
#: the writer's iterations per second at most: the reference is computed for every run together
MAX_PER_SECOND = 150


def model(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(width, width)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def set_grads(m: torch.nn.Module, i: int) -> None:
    r = np.random.default_rng(20_000 + i)
    for p in m.parameters():
        p.grad = torch.from_numpy(r.standard_normal(p.numel()).astype(np.float32)).view(p.shape)


def digest(x: Any, h: Any = None) -> str:
    """xxh3 of a state's structure and bits (tensors by their bytes, the rest by repr)."""
    top = h is None
    h = h or xxhash.xxh3_64()
    if isinstance(x, torch.Tensor):
        h.update(str((x.dtype, tuple(x.shape))).encode())
        h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, dict):
        for k, v in x.items():
            h.update(repr(k).encode())
            digest(v, h)
    elif isinstance(x, (list, tuple)):
        for v in x:
            digest(v, h)
    else:
        h.update(repr(x).encode())
    return h.hexdigest() if top else ""


def nbytes(x: Any) -> int:
    """Bytes of the tensors in a (nested) state."""
    if isinstance(x, torch.Tensor):
        return x.nbytes
    if isinstance(x, dict):
        return sum(nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    return 0


def reference(width: int, last: int) -> list[str]:
    """The digest of ``{"model", "optimizer"}`` after every iteration 0..last."""
    m, opt = model(width)
    out = [digest({"model": m.state_dict(), "optimizer": opt.state_dict()})]
    for i in range(1, last + 1):
        set_grads(m, i)
        opt.step()
        out.append(digest({"model": m.state_dict(), "optimizer": opt.state_dict()}))
    return out


def writer(path: str, seconds: float, gc_every: int, width: int, last: int, out) -> None:
    torch.set_num_threads(1)
    its = gcs = 0
    with ckptstore.open(path, "a", chunk_size=CHUNK) as s:
        m, opt = model(width)
        ck = Checkpointer(s, m, opt, policy="every-iteration", base_every=4, group_commit=2)
        it = ck.restore() + 1
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds and it <= last:
            set_grads(m, it)
            ck.step(it)
            if gc_every and it % gc_every == 0:
                s.gc(keep_last=8)
                gcs += 1
            it += 1
            its += 1
        ck.flush()
        ck.close()
        out.put({"its": its, "seconds": time.monotonic() - t0, "gcs": gcs})


def reader(path: str, stop, seed: int, ref: list[str], out) -> None:
    torch.set_num_threads(1)
    rng = random.Random(seed)
    n = {"loads": 0, "bytes": 0, "replays": 0, "replayed": 0, "errors": 0}

    def check(i: int, state: dict) -> None:
        got = digest({"model": state["model"], "optimizer": state["optimizer"]})
        if got != ref[i] or state["iteration"] != i:
            n["errors"] += 1

    long_lived = ckptstore.open(path, "r")
    t0 = time.monotonic()
    rounds = 0
    while not stop.is_set():
        r = ckptstore.open(path, "r") if rounds % 2 == 0 else long_lived
        try:
            if r is long_lived:
                r.refresh()
            its = r.iterations()
            for i in {its[-1], rng.choice(its)}:
                try:
                    state = r.load(i)  # a delta iteration: replayed from its base
                except ckptstore.NotFoundError:
                    continue  # removed by a gc since the listing
                check(i, state)
                n["bytes"] += nbytes(state)
                n["loads"] += 1
            start = rng.choice(its)
            try:
                for i, state in r.replay(start, min(start + 4, its[-1])):
                    check(i, state)
                    n["replayed"] += 1
                n["replays"] += 1
            except ckptstore.NotFoundError:
                pass  # removed by a gc since the listing
        finally:
            if r is not long_lived:
                r.close()
        rounds += 1
    long_lived.close()
    out.put(dict(n, seconds=time.monotonic() - t0))


def run(path: str, readers: int, seconds: float, gc_every: int, width: int,
        ref: list[str]) -> tuple[dict, list[dict]]:
    ctx = mp.get_context("fork")
    out, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=reader, args=(path, stop, j, ref, out)) for j in range(readers)]
    for p in procs:
        p.start()
    w = ctx.Process(target=writer, args=(path, seconds, gc_every, width, len(ref) - 1, out))
    w.start()
    w.join()
    stop.set()
    results = [out.get() for _ in range(readers + 1)]
    for p in procs:
        p.join()
    wr = next(r for r in results if "its" in r)
    return wr, [r for r in results if "loads" in r]


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--readers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--gc-every", type=int, default=6)
    ap.add_argument("--width", type=int, default=256, help="the model: Linear(width, width)")
    ap.add_argument("--dir", default="/tmp/bench_readers")
    add_standard_args(ap, rounds=1, rounds_help="rounds of the writer alone and beside the "
                      "readers, the order rotated each round",
                      quick_help="a smoke run: 2 readers, 2 s per run, Linear(64, 64)")
    args = ap.parse_args()
    quick(args, ap, readers=2, seconds=2.0, width=64)
    torch.set_num_threads(1)  # (as in the forked children: one intra-op thread everywhere)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    path = os.path.join(args.dir, "s")
    t0 = time.monotonic()
    ref = reference(args.width, int(2 * args.rounds * args.seconds * MAX_PER_SECOND))
    ref_s = time.monotonic() - t0
    with ckptstore.open(path, "a", chunk_size=CHUNK) as s:
        Checkpointer(s, *model(args.width), asynchronous=False).restore()  # base 0
    params = (args.width + 1) * args.width * 4
    mach = machine()
    print(header(f"bench_readers: Linear({args.width}, {args.width}) with AdamW: "
                 f"{3 * params / 2**20:.2f} MiB per base, {params / 2**20:.2f} MiB per delta; gc "
                 f"every {args.gc_every} iterations; reference of {len(ref)} iterations computed "
                 f"in {ref_s:.1f} s", mach))
    names = ("alone", f"beside {args.readers} readers")

    def one(name: str, r: int) -> dict:
        wr, rs = run(path, 0 if name == "alone" else args.readers, args.seconds, args.gc_every,
                     args.width, ref)
        return {"writer": wr, "readers": rs}

    res = interleave(names, args.rounds, one)
    writes = {n: [row["writer"] for row in res.rows[n]] for n in names}
    if sum(w["its"] for ws in writes.values() for w in ws) >= len(ref) - 1:
        print(f"(the writer reached the reference's end, iteration {len(ref) - 1}: raise "
              f"MAX_PER_SECOND)")
    a, b = (max(sum(w["its"] for w in writes[n]), 1) / sum(w["seconds"] for w in writes[n])
            for n in names)
    rs = [r for row in res.rows[names[1]] for r in row["readers"]]
    secs = sum(max(r["seconds"] for r in row["readers"]) for row in res.rows[names[1]])

    def total(k: str) -> int:
        return sum(r[k] for r in rs)

    print(f"writer alone: {a:.1f} iterations/s ({sum(w['gcs'] for w in writes[names[0]])} gcs)")
    print(f"writer beside {args.readers} readers: {b:.1f} iterations/s "
          f"({sum(w['gcs'] for w in writes[names[1]])} gcs): {a / b:.2f}x slower")
    print(f"readers: {total('loads') / secs:.1f} verified loads/s in all "
          f"({total('bytes') / 1e6 / secs:.0f} MB/s of state), {total('replays') / secs:.1f} "
          f"replays/s ({total('replayed') / secs:.1f} replayed states/s), {total('errors')} wrong; "
          f"load average {os.getloadavg()[0]:.1f}")
    write_json(args.json, "bench_readers", args, mach, res,
               {"writer_its_per_s": dict(zip(names, (a, b))),
                "reader_loads_per_s": total("loads") / secs, "wrong": total("errors")})
    return 1 if total("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
