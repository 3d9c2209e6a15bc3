"""Benchmark: the remote tier's two S3 clients (obstore, boto3) side by side on one moto server.

Starts moto's S3 server (``python -m moto.server``) on a free port of 127.0.0.1, builds one local
store of ``--mib`` MiB (``--iters`` snapshots of random float32: nothing deduplicates or
compresses) and runs, ``--rounds`` times, each client in turn (the order alternates every round,
so a change in the machine's load hits both alike):

* push: ``ckptstore.remote.push`` of the store into a fresh prefix (the uploader's code path:
  8 MiB parts, 64 MiB objects) -> MB/s;
* pull: ``ckptstore.remote.pull`` of that prefix into an empty directory (every byte verified
  against the HEAD) -> MB/s;
* lazy load: ``ckptstore.open("s3://...", "r")`` + ``load`` of one iteration (the lazy reader's
  range GETs, 8 load threads) -> s;
* ranges: ``--ranges`` range GETs of 64 KiB at random offsets of the pushed objects, from
  ``--threads`` threads through ``ObjectStore.get`` (what the lazy reader's block cache does) ->
  ranges/s; moto reads the whole object for each range, so these mostly measure moto;
* small ranges: the same, ``4 * --ranges`` of them, on 16 objects of 1 MiB (moto's part small).

For each it reports the median and the spread (min-max) over rounds, the CPU seconds this
(client) process and the moto server process spent, and the load average. Then the install size
(site-packages of each client and its dependencies) and the import time (``import`` + the
client's construction, after ckptstore's own import, in a fresh interpreter each time, median of
``--imports``, 7).

moto is a Python server on the same cores: its CPU time usually dominates the wall time, so the
wall-clock ratios understate the difference between the clients; the client-CPU column is what
each client itself costs. Needs boto3, obstore and moto[server] (the ``remote-test`` extra).

    python tools/bench_objstore.py [--mib 256] [--iters 4] [--rounds 5] [--ranges 400] [--json OUT] [--quick]
"""

from __future__ import annotations

import importlib.metadata
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ckptstore  # noqa: E402
from ckptstore.remote import pull, push  # noqa: E402
from ckptstore.remote.client import ObjectStore  # noqa: E402
from bench_remote import moto_s3  # noqa: E402
from harness import (Stats, add_standard_args, header, load_summary, machine, median,  # noqa: E402
                     parser, quick, rotated, table, write_json)

MiB = 1 << 20
CLIENTS = ("obstore", "boto3")


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_store(path: str, mib: int, iters: int) -> dict:
    each = mib * MiB // iters
    saved = {}
    with ckptstore.open(path, "a") as s:
        for i in range(iters):
            g = torch.Generator().manual_seed(i)
            saved[i] = {"w": torch.randn(each // 4, generator=g), "step": i}
            s.save(i, saved[i])
    return saved


def dist_size(names: list[str]) -> int:
    """Bytes on disk of the installed files of the distributions ``names``."""
    total = 0
    for name in names:
        for f in importlib.metadata.distribution(name).files or ():
            p = f.locate()
            if os.path.isfile(p):
                total += os.path.getsize(p)
    return total


def import_time(client: str, endpoint: str) -> float:
    code = ("import time; from ckptstore.remote.client import ObjectStore; "
            "t=time.perf_counter(); ObjectStore('s3://bench/x', {'client': "
            f"{client!r}, "
            f"'endpoint_url': {endpoint!r}, 'key': 'k', 'secret': 's'}}); "
            "print(time.perf_counter()-t)")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    return float(out.stdout.strip())


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--ranges", type=int, default=400)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--imports", type=int, default=7, help="import-time samples per client")
    ap.add_argument("--dir", default=None)
    add_standard_args(ap, rounds=5, rounds_help="rounds, the clients' order rotated each round",
                      quick_help="a smoke run: 16 MiB in 2 iterations, 2 rounds, 20 ranges, "
                                 "2 import samples")
    args = ap.parse_args()
    quick(args, ap, mib=16, iters=2, rounds=2, ranges=20, imports=2)
    mach = machine()

    work = args.dir or tempfile.mkdtemp(prefix="bench_objstore-")
    os.makedirs(work, exist_ok=True)
    try:
        with moto_s3(work) as (s3, endpoint, base, proc):
            local = os.path.join(work, "local")
            shutil.rmtree(local, ignore_errors=True)
            saved = make_store(local, args.mib, args.iters)
            nbytes = sum(os.path.getsize(os.path.join(local, "segments", f))
                         for f in os.listdir(os.path.join(local, "segments")))
            mb = nbytes / 1e6
            ops = ("push", "pull", "lazy load", "ranges", "small ranges")
            wall = {c: {o: [] for o in ops} for c in CLIENTS}
            cpu = {c: {o: [] for o in ops} for c in CLIENTS}
            srv = {c: {o: [] for o in ops} for c in CLIENTS}
            loads: list[float] = []
            rng = random.Random(0)
            for rnd in range(args.rounds):
                for client in CLIENTS:
                    up = ObjectStore(f"s3://bench/{client}{rnd}", dict(base, client="boto3"))
                    for i in range(16):
                        up.put(f"small/{i}", rng.randbytes(MiB))

            def timed(client: str, op: str, fn):
                c0, s0, t0 = time.process_time(), cpu_of(proc.pid), time.perf_counter()
                out = fn()
                wall[client][op].append(time.perf_counter() - t0)
                cpu[client][op].append(time.process_time() - c0)
                srv[client][op].append(cpu_of(proc.pid) - s0)
                return out

            for rnd in range(args.rounds):
                for client in rotated(CLIENTS, rnd):
                    opts = dict(base, client=client)
                    url = f"s3://bench/{client}{rnd}"
                    loads.append(os.getloadavg()[0])
                    head = timed(client, "push", lambda: push(local, url, opts)).head
                    dest = os.path.join(work, f"pulled-{client}{rnd}")
                    timed(client, "pull", lambda: pull(url, dest, opts))
                    shutil.rmtree(dest, ignore_errors=True)
                    it = rnd % args.iters

                    def lazy() -> None:
                        with ckptstore.open(url, "r", storage_options=opts) as r:
                            got = r.load(it)
                        assert torch.equal(got["w"], saved[it]["w"])

                    timed(client, "lazy load", lazy)
                    store = ObjectStore(url, opts)
                    extents = [e for e in head.extents() if e.length > 64 << 10]
                    picks = [(e.name, rng.randrange(0, e.length - (64 << 10)))
                             for e in (rng.choice(extents) for _ in range(args.ranges))]

                    def ranges() -> None:
                        with ThreadPoolExecutor(args.threads) as pool:
                            got = list(pool.map(lambda p: store.get(p[0], p[1], 64 << 10), picks))
                        assert all(len(g) == 64 << 10 for g in got)

                    timed(client, "ranges", ranges)
                    small = [(f"small/{i}", rng.randrange(0, MiB - (64 << 10)))
                             for i in rng.choices(range(16), k=4 * args.ranges)]

                    def small_ranges() -> None:
                        with ThreadPoolExecutor(args.threads) as pool:
                            got = list(pool.map(lambda p: store.get(p[0], p[1], 64 << 10), small))
                        assert all(len(g) == 64 << 10 for g in got)

                    timed(client, "small ranges", small_ranges)
                    loads.append(os.getloadavg()[0])
                for client in CLIENTS:  # this round's objects: moto holds them in memory
                    cleanup = ObjectStore(f"s3://bench/{client}{rnd}", dict(base, client="boto3"))
                    cleanup.delete(list(cleanup.list_objects()))
                print(f"round {rnd + 1}: " + "; ".join(
                    f"{c} " + ", ".join(f"{o} {wall[c][o][-1]:.2f}s" for o in ops) for c in CLIENTS),
                    flush=True)

            def rate(op: str, v: float) -> str:
                if op in ("push", "pull"):
                    return f"{mb / v:6.1f} MB/s"
                if op == "ranges":
                    return f"{args.ranges / v:6.0f} GET/s"
                if op == "small ranges":
                    return f"{4 * args.ranges / v:6.0f} GET/s"
                return f"{v:6.2f} s   "

            mach["load average during"] = load_summary(loads)
            print()
            print(header(f"bench_objstore: store {mb:.0f} MB ({args.iters} iterations of random "
                         f"float32), moto S3 on 127.0.0.1, {args.rounds} rounds rotating the client "
                         "order", mach))
            print(f"ranges: {args.ranges} x 64 KiB range GETs from {args.threads} threads of the "
                  f"pushed objects; small ranges: {4 * args.ranges} of 16 objects of 1 MiB\n")
            rows = []
            for op in ops:
                for c in CLIENTS:
                    w = Stats.of(wall[c][op])
                    rows.append([op, c, f"{w.median:.2f} s", f"{w.spread('.2f')} s",
                                 rate(op, w.median).strip(), f"{median(cpu[c][op]):.2f} s",
                                 f"{median(srv[c][op]):.2f} s"])
            print(table(["op", "client", "wall median", "(min-max)", "throughput", "client CPU",
                         "moto CPU"], rows, left=2))
            # (the client's own distributions, then what it pulls in besides)
            sizes = {"obstore": (["obstore"], ["typing-extensions"]),
                     "boto3": (["boto3", "botocore", "s3transfer"],
                               ["jmespath", "python-dateutil", "urllib3", "six"])}
            print()
            times: dict[str, list[float]] = {c: [] for c in CLIENTS}
            for r in range(args.imports):
                for c in rotated(CLIENTS, r):
                    times[c].append(import_time(c, endpoint))
            for c in CLIENTS:
                own, deps = sizes[c]
                vers = ", ".join(f"{n} {importlib.metadata.version(n)}" for n in own)
                t = times[c]
                print(f"{c:8s} install {dist_size(own) / 1e6:5.1f} MB ({vers}), "
                      f"{dist_size(own + deps) / 1e6:5.1f} MB with its dependencies "
                      f"({', '.join(deps)}); import + client: median "
                      f"{median(t) * 1e3:4.0f} ms ({Stats.of(t).spread('.3f')} s)")
            write_json(args.json, "bench_objstore", args, mach,
                       {"wall_s": wall, "client_cpu_s": cpu, "moto_cpu_s": srv, "import_s": times,
                        "loadavg": loads},
                       {c: {op: Stats.of(wall[c][op]).as_dict() for op in ops} for c in CLIENTS},
                       store_mb=mb)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
