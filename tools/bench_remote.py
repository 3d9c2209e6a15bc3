"""Benchmark: the remote tier against DCP through fsspec, on the same S3 server and the same state.

Starts moto's S3 server (``python -m moto.server``) on a free port of 127.0.0.1, builds one state
of ``--mib`` MiB (random float32 tensors of a model-like shape mix: nothing deduplicates or
compresses), and measures, median of ``--rounds`` (``--reps``) runs each, every run into a fresh
prefix, ckptstore's operations and DCP's in turn (the side going first rotated each round):

* upload: ``ckptstore push`` of a local store holding the state (the background uploader's code
  path) -> MB/s;  ``store.save`` + ``store.remote_flush`` on a writer with ``remote=`` (local
  save, then the upload) -> s;  ``torch.distributed.checkpoint.save`` with
  ``FsspecWriter("s3://...")`` (s3fs) -> s and MB/s;
* restore from the server alone into an empty directory / fresh tensors:
  ``ckptstore pull`` + ``store.load`` -> s;  ``ckptstore.open("s3://...", "r")`` + ``load``
  (the lazy remote reader: metadata, then range GETs of what the load reads) -> s and bytes
  fetched;  ``dcp.load`` with ``FsspecReader`` into preallocated tensors -> s.

moto is a Python server sharing this machine's cores: the numbers measure the clients' overheads
plus moto's, not a network. Needs the ``bench-remote`` extra (boto3, moto[server], s3fs;
``--skip-dcp``: without s3fs, ckptstore's side only).

    python tools/bench_remote.py [--mib 128] [--rounds 3] [--dir /tmp/bench_remote] [--json OUT] [--quick]
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from typing import Any, Iterator

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckptstore  # noqa: E402
from ckptstore.remote import pull, push  # noqa: E402
from harness import (add_standard_args, header, interleave, machine, median, parser,  # noqa: E402
                     quick, table, timed, write_json)

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


@contextlib.contextmanager
def moto_s3(work: str, bucket: str | None = "bench"
            ) -> Iterator[tuple[Any, str, dict, subprocess.Popen]]:
    """moto's S3 server on 127.0.0.1 for the ``with`` block (its log in ``work``): yields a
    boto3 client, the endpoint, ckptstore's storage options for it and the server's process,
    ``bucket`` created (None: none); the server is stopped at the end."""
    import boto3

    proc, endpoint = start_moto(os.path.join(work, "moto.log"))
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
        if bucket is not None:
            s3.create_bucket(Bucket=bucket)
        yield s3, endpoint, {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
                             "region_name": "us-east-1"}, proc
    finally:
        proc.terminate()
        proc.wait(10)


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
    ap = parser(__doc__)
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--dcp-threads", type=int, default=1, help="FsspecWriter thread_count")
    ap.add_argument("--skip-dcp", action="store_true",
                    help="measure ckptstore's side only (DCP's needs s3fs)")
    add_standard_args(ap, rounds=3, aliases=("--reps",),
                      rounds_help="rounds (ckptstore's operations and DCP's in turn, the side "
                                  "going first rotated)",
                      quick_help="a smoke run: 8 MiB, 1 round")
    args = ap.parse_args()
    quick(args, ap, mib=8, rounds=1)
    mach = machine()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    work = args.dir or tempfile.mkdtemp(prefix="bench_remote-")
    os.makedirs(work, exist_ok=True)
    try:
        with moto_s3(work) as (s3, endpoint, opts, _):
            fs_opts = {"key": "testing", "secret": "testing",
                       "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
            state = make_state(args.mib)
            nbytes = sum(t.numel() * 4 for t in state["model"].values())
            mb = nbytes / 1e6
            local = os.path.join(work, "local")
            shutil.rmtree(local, ignore_errors=True)
            with ckptstore.open(local, "a") as s:
                s.save(1000, state)
            fetched: list[int] = []

            def ours(rep: int) -> dict[str, float]:
                out = {}
                # ckptstore push (the uploader's code path) of the existing local store
                out["push"], _ = timed(lambda: push(local, f"s3://bench/push{rep}", opts))
                # a writer with remote=: local save, then the upload (remote_flush)
                w = os.path.join(work, f"w{rep}")
                shutil.rmtree(w, ignore_errors=True)

                def save_upload() -> None:
                    with ckptstore.open(w, "a", remote=f"s3://bench/writer{rep}",
                                        remote_options=dict(opts, head_interval=3600)) as s:
                        s.save(1000, state)
                        s.remote_flush(600)

                out["save+upload"], _ = timed(save_upload)
                shutil.rmtree(w, ignore_errors=True)
                # restore from the server alone: pull into an empty directory, then load
                dest = os.path.join(work, f"pulled{rep}")
                shutil.rmtree(dest, ignore_errors=True)

                def pull_load() -> dict:
                    pull(f"s3://bench/push{rep}", dest, opts)
                    with ckptstore.open(dest, "r") as s:
                        return s.load(1000)

                out["pull+load"], got = timed(pull_load)
                assert same(state, got)
                del got
                shutil.rmtree(dest, ignore_errors=True)

                # restore from the server alone: the lazy remote reader (range GETs)
                def lazy() -> dict:
                    with ckptstore.open(f"s3://bench/push{rep}", "r", storage_options=opts) as s:
                        got = s.load(1000)
                        fetched.append(s.remote_bytes_read)
                    return got

                out["lazy open+load"], got = timed(lazy)
                assert same(state, got)
                return out

            def theirs(rep: int) -> dict[str, float]:
                # DCP through fsspec (s3fs) on the same server
                out = {}
                out["dcp save"], _ = timed(lambda: dcp.save(state, storage_writer=FsspecWriter(
                    f"s3://bench/dcp{rep}", thread_count=args.dcp_threads, **fs_opts)))
                target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
                          "step": 0}
                out["dcp load"], _ = timed(lambda: dcp.load(
                    target, storage_reader=FsspecReader(f"s3://bench/dcp{rep}", **fs_opts)))
                assert same(state, target)
                return out

            def side(name: str, rep: int) -> dict[str, float]:
                out = (ours if name == "ckptstore" else theirs)(rep)
                clear(s3, "bench")  # (a side's objects serve its own call only; moto holds them)
                print(f"round {rep + 1} {name}: "
                      + ", ".join(f"{k} {v:.2f} s" for k, v in out.items()), flush=True)
                return out

            sides = ("ckptstore",) if args.skip_dcp else ("ckptstore", "dcp")
            res = interleave(sides, args.rounds, side)
            ops = {k: who for k, who in (
                ("push", "ckptstore"), ("save+upload", "ckptstore"), ("pull+load", "ckptstore"),
                ("lazy open+load", "ckptstore"), ("dcp save", "dcp"), ("dcp load", "dcp"))
                if who in sides}
            med = {k: res.stats(who, k).median for k, who in ops.items()}
            print()
            print(header(f"bench_remote: state {mb:.0f} MB ({args.mib} MiB, {len(state['model'])} "
                         f"float32 tensors), moto S3 on 127.0.0.1, median of {args.rounds}", mach))
            rows = [
                ("upload", "ckptstore push (local store -> S3)", "push"),
                ("upload", "ckptstore save + remote_flush", "save+upload"),
                ("upload", f"DCP save, FsspecWriter (s3fs, {args.dcp_threads} thread)", "dcp save"),
                ("restore", "ckptstore pull + load (empty dir)", "pull+load"),
                ("restore", "ckptstore open(s3://) + load (lazy)", "lazy open+load"),
                ("restore", "DCP load, FsspecReader (s3fs)", "dcp load"),
            ]
            rows = [(kind, name, key, med[key]) for kind, name, key in rows if key in ops]
            print(table(["", "operation", "median s", "min-max s", "MB/s"],
                        [[kind, name, f"{sec:.2f}", res.stats(ops[key], key).spread(".2f"),
                          f"{mb / sec:.1f}"] for kind, name, key, sec in rows], left=2))
            print(f"  lazy reader fetched {median(fetched) / 1e6:.1f} MB for the {mb:.0f} MB state")
            write_json(args.json, "bench_remote", args, mach, res,
                       {k: res.stats(who, k).as_dict() for k, who in ops.items()},
                       state_mb=mb, lazy_fetched=fetched)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
