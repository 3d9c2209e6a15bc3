"""Benchmark: the remote tier against DCP through fsspec, on the same S3 server and the same state.

Starts moto's S3 server (``python -m moto.server``) on a free port of 127.0.0.1, builds one state
of ``--mib`` MiB (random float32 tensors of a model-like shape mix: nothing deduplicates or
compresses), and measures, median of ``--reps`` runs each, every run into a fresh prefix:

* upload: ``ckptstore push`` of a local store holding the state (the background uploader's code
  path) -> MB/s;  ``store.save`` + ``store.remote_flush`` on a writer with ``remote=`` (local
  save, then the upload) -> s;  ``torch.distributed.checkpoint.save`` with
  ``FsspecWriter("s3://...")`` (s3fs) -> s and MB/s;
* restore from the server alone into an empty directory / fresh tensors:
  ``ckptstore pull`` + ``store.load`` -> s;  ``ckptstore.open("s3://...", "r")`` + ``load``
  (the lazy remote reader: metadata, then range GETs of what the load reads) -> s and bytes
  fetched;  ``dcp.load`` with ``FsspecReader`` into preallocated tensors -> s.

moto is a Python server sharing this machine's cores: the numbers measure the clients' overheads
plus moto's, not a network. Needs the ``bench-remote`` extra (boto3, moto[server], s3fs).

    python tools/bench_remote.py [--mib 128] [--reps 3] [--dir /tmp/bench_remote]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ckptstore  # noqa: E402
from ckptstore.remote import pull, push  # noqa: E402

MiB = 1 << 20


def start_moto(log_path: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(endpoint + "/", timeout=1).close()
            return proc, endpoint
        except urllib.error.HTTPError:
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto server did not start")


def make_state(mib: int) -> dict:
    """Random float32 tensors, a transformer-like mix of shapes, ``mib`` MiB in all."""
    g = torch.Generator().manual_seed(0)
    state: dict = {}
    left, i = mib * MiB // 4, 0
    shapes = [(1024, 1024), (4096, 1024), (1024, 4096), (1024,), (3072, 1024)]
    while left > 0:
        shape = shapes[i % len(shapes)]
        n = min(left, int(torch.Size(shape).numel()))
        state[f"layer{i // len(shapes)}.p{i % len(shapes)}"] = torch.randn(n, generator=g)
        left -= n
        i += 1
    return {"model": state, "step": 1000}


def clear(s3, bucket: str) -> None:
    while True:
        keys = [{"Key": o["Key"]} for o in s3.list_objects_v2(Bucket=bucket).get("Contents", ())]
        if not keys:
            return
        s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--dcp-threads", type=int, default=1, help="FsspecWriter thread_count")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import boto3
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    work = args.dir or tempfile.mkdtemp(prefix="bench_remote-")
    os.makedirs(work, exist_ok=True)
    proc, endpoint = start_moto(os.path.join(work, "moto.log"))
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
        s3.create_bucket(Bucket="bench")
        opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
                "region_name": "us-east-1"}
        fs_opts = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        state = make_state(args.mib)
        nbytes = sum(t.numel() * 4 for t in state["model"].values())
        mb = nbytes / 1e6
        local = os.path.join(work, "local")
        shutil.rmtree(local, ignore_errors=True)
        with ckptstore.open(local, "a") as s:
            s.save(1000, state)
        res: dict[str, list[float]] = {k: [] for k in (
            "push", "save+upload", "pull+load", "lazy open+load", "dcp save", "dcp load")}
        fetched: list[int] = []
        for rep in range(args.reps):
            # ckptstore push (the uploader's code path) of the existing local store
            t0 = time.perf_counter()
            push(local, f"s3://bench/push{rep}", opts)
            res["push"].append(time.perf_counter() - t0)
            # a writer with remote=: local save, then the upload (remote_flush)
            w = os.path.join(work, f"w{rep}")
            shutil.rmtree(w, ignore_errors=True)
            t0 = time.perf_counter()
            with ckptstore.open(w, "a", remote=f"s3://bench/writer{rep}",
                                remote_options=dict(opts, head_interval=3600)) as s:
                s.save(1000, state)
                s.remote_flush(600)
            res["save+upload"].append(time.perf_counter() - t0)
            shutil.rmtree(w, ignore_errors=True)
            # restore from the server alone: pull into an empty directory, then load
            dest = os.path.join(work, f"pulled{rep}")
            shutil.rmtree(dest, ignore_errors=True)
            t0 = time.perf_counter()
            pull(f"s3://bench/push{rep}", dest, opts)
            with ckptstore.open(dest, "r") as s:
                got = s.load(1000)
            res["pull+load"].append(time.perf_counter() - t0)
            assert same(state, got)
            del got
            shutil.rmtree(dest, ignore_errors=True)
            # restore from the server alone: the lazy remote reader (range GETs)
            t0 = time.perf_counter()
            with ckptstore.open(f"s3://bench/push{rep}", "r", storage_options=opts) as s:
                got = s.load(1000)
                fetched.append(s.remote_bytes_read)
            res["lazy open+load"].append(time.perf_counter() - t0)
            assert same(state, got)
            del got
            # DCP through fsspec (s3fs) on the same server
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=FsspecWriter(f"s3://bench/dcp{rep}",
                                                        thread_count=args.dcp_threads,
                                                        **fs_opts))
            res["dcp save"].append(time.perf_counter() - t0)
            target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
                      "step": 0}
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=FsspecReader(f"s3://bench/dcp{rep}", **fs_opts))
            res["dcp load"].append(time.perf_counter() - t0)
            assert same(state, target)
            del target
            clear(s3, "bench")
            print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in res.items()),
                  flush=True)
        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"\nstate {mb:.0f} MB ({args.mib} MiB, {len(state['model'])} float32 tensors), "
              f"moto S3 on 127.0.0.1, median of {args.reps}:")
        rows = [
            ("upload", "ckptstore push (local store -> S3)", med["push"]),
            ("upload", "ckptstore save + remote_flush", med["save+upload"]),
            ("upload", f"DCP save, FsspecWriter (s3fs, {args.dcp_threads} thread)",
             med["dcp save"]),
            ("restore", "ckptstore pull + load (empty dir)", med["pull+load"]),
            ("restore", "ckptstore open(s3://) + load (lazy)", med["lazy open+load"]),
            ("restore", "DCP load, FsspecReader (s3fs)", med["dcp load"]),
        ]
        for kind, name, sec in rows:
            print(f"  {kind:8s} {name:48s} {sec:7.2f} s  {mb / sec:7.1f} MB/s")
        print(f"  lazy reader fetched {statistics.median(fetched) / 1e6:.1f} MB for the "
              f"{mb:.0f} MB state")
    finally:
        proc.terminate()
        proc.wait(10)
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
