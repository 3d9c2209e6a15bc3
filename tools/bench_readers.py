"""Benchmark: many reader processes beside one writer (saves, group-committed deltas, gc).

The writer runs ``--seconds`` alone, then again with ``--readers`` reader processes that loop:
open (a fresh reader every other round, else a long-lived one that refreshes), list, load the
latest and a random listed iteration, verify it bit for bit against the generator, close. Printed:
the writer's iterations per second alone and with readers (its slowdown), and the readers' verified
loads per second (all together, MB/s of state read), with the machine's core count and load
average. Nothing is asserted: tests/test_concurrency.py checks correctness under the same load.

    python tools/bench_readers.py [--readers 8] [--seconds 10] [--gc-every 6] [--dir /tmp/bench_readers]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ckptstore  # noqa: E402

CHUNK = 64 << 10


def snap(i: int) -> dict:
    r = np.random.default_rng(i)
    return {"w": r.standard_normal(256_000).astype(np.float32), "const": np.arange(64_000),
            "i": i}


def delta(i: int) -> dict:
    return {"g": np.random.default_rng(10_000 + i).standard_normal(64_000).astype(np.float32),
            "i": i}


def writer(path: str, seconds: float, gc_every: int, out) -> None:
    its = gcs = 0
    with ckptstore.open(path, "a", chunk_size=CHUNK) as s:
        it = (s.latest() or 0) + 1
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            if it % 4 == 0:
                s.save(it, snap(it))
            else:
                s.save_delta(it, delta(it), durable=it % 2 == 0)
            if gc_every and it % gc_every == 0:
                s.gc(keep_last=8)
                gcs += 1
            it += 1
            its += 1
        s.flush()
        out.put({"its": its, "seconds": time.monotonic() - t0, "gcs": gcs})


def reader(path: str, stop, seed: int, out) -> None:
    rng = random.Random(seed)
    loads = nbytes = errors = 0
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
                    kind = r.kind(i)
                    got = r.load(i) if kind == "snapshot" else r.load_record(i)
                except ckptstore.NotFoundError:
                    continue  # removed by a gc since the listing
                want = snap(i) if kind == "snapshot" else delta(i)
                for k, v in want.items():
                    if isinstance(v, np.ndarray):
                        if got[k].tobytes() != v.tobytes():
                            errors += 1
                        nbytes += v.nbytes
                loads += 1
        finally:
            if r is not long_lived:
                r.close()
        rounds += 1
    long_lived.close()
    out.put({"loads": loads, "bytes": nbytes, "errors": errors, "seconds": time.monotonic() - t0})


def run(path: str, readers: int, seconds: float, gc_every: int) -> tuple[dict, list[dict]]:
    ctx = mp.get_context("fork")
    out, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=reader, args=(path, stop, j, out)) for j in range(readers)]
    for p in procs:
        p.start()
    w = ctx.Process(target=writer, args=(path, seconds, gc_every, out))
    w.start()
    w.join()
    stop.set()
    results = [out.get() for _ in range(readers + 1)]
    for p in procs:
        p.join()
    wr = next(r for r in results if "its" in r)
    return wr, [r for r in results if "loads" in r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--gc-every", type=int, default=6)
    ap.add_argument("--dir", default="/tmp/bench_readers")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    path = os.path.join(args.dir, "s")
    with ckptstore.open(path, "a", chunk_size=CHUNK) as s:
        s.save(0, snap(0))
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; state "
          f"{snap(0)['w'].nbytes / 2**20:.1f} MiB per snapshot, {delta(1)['g'].nbytes / 2**20:.2f} "
          f"MiB per delta; gc every {args.gc_every} iterations")
    alone, _ = run(path, 0, args.seconds, args.gc_every)
    loaded, rs = run(path, args.readers, args.seconds, args.gc_every)
    a = alone["its"] / alone["seconds"]
    b = loaded["its"] / loaded["seconds"]
    loads = sum(r["loads"] for r in rs)
    secs = max(r["seconds"] for r in rs)
    mb = sum(r["bytes"] for r in rs) / 1e6
    print(f"writer alone: {a:.1f} iterations/s ({alone['gcs']} gcs)")
    print(f"writer beside {args.readers} readers: {b:.1f} iterations/s ({loaded['gcs']} gcs): "
          f"{a / b:.2f}x slower")
    print(f"readers: {loads / secs:.1f} verified loads/s in all ({mb / secs:.0f} MB/s), "
          f"{sum(r['errors'] for r in rs)} wrong; load average {os.getloadavg()[0]:.1f}")
    return 1 if any(r["errors"] for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
