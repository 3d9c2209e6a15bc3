"""Run a function on N ranks of a real gloo process group (spawned processes), with a deadline.

Each rank runs ``scenario(rank, world, path, **kwargs)`` (a module-level function of the calling
test module, found by name in the child) after ``init_process_group("gloo")`` over a file://
rendezvous. What it returns (JSON-able) or raises comes back per rank as a dict:
``{"ok": value}`` or ``{"error": class name, "message": str}``; a rank that died or never
finished comes back as ``{"died": exitcode}``. A run never outlives its deadline: stragglers are
killed.

Ranks are forked from a forkserver that imported torch, torch's DCP and dynamo (which DDP,
FSDP2 and DCP import on first use) and ckptstore once (``PRELOAD``): a spawned rank spent ~2.7 s
of CPU importing torch, and each rank forked with torch alone another ~2-4 s importing the rest,
most of a short multi-rank test on 2 cores (tests/test_multirank.py, one worker, a loaded
machine: 261 s with torch alone preloaded, 53 s with this list). Heavy optional libraries
(transformers, lightning, boto3, matplotlib) are not preloaded: few ranks use them. The test
module imports fresh in each rank, and each rank takes the caller's environment as it is at the
call (the forkserver's own is from its start; nothing in ckptstore reads the environment at
import).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import time
import traceback
from typing import Any


#: modules the forkserver imports once; each rank is forked from it with them loaded
PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "torch.distributed.checkpoint",
           "torch._dynamo", "pytest", "ckptstore", "ckptstore.torch", "ckptstore.dcp",
           "ckptstore.remote", "ckptstore.cli"]


def _rank_main(rank: int, world: int, init: str, path: str, module: str, scenario: str,
               out_dir: str, kwargs: dict, pg_timeout: float, environ: dict[str, str]) -> None:
    import faulthandler

    os.environ.clear()
    os.environ.update(environ)  # the caller's environment now, not the forkserver's at its start

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a rank that dies of a signal leaves its threads' tracebacks on stderr
    torch.set_num_threads(1)
    result: dict[str, Any]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        fn = getattr(importlib.import_module(module), scenario)
        result = {"ok": fn(rank, world, path, **kwargs)}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = {"error": type(e).__name__, "message": str(e),
                  "mro": [c.__name__ for c in type(e).__mro__],
                  "trace": traceback.format_exc()}
    tmp = os.path.join(out_dir, f"rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)  # skip interpreter teardown (gloo threads of a failed group can hang it)


def run_ranks(world: int, module: str, scenario: str, path: str, work: str, *,
              deadline: float = 120.0, pg_timeout: float = 60.0,
              **kwargs: Any) -> list[dict[str, Any]]:
    """Run ``module.scenario`` on ``world`` ranks; results in rank order. A rank that crashed
    (SIGSEGV, SIGABRT, ...) comes back as ``{"died": -signal}``: never rerun, never hidden."""
    return _run_ranks_once(world, module, scenario, path, work, deadline, pg_timeout, kwargs)


def _run_ranks_once(world: int, module: str, scenario: str, path: str, work: str, deadline: float,
                    pg_timeout: float, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    os.makedirs(work, exist_ok=True)
    init = f"file://{os.path.join(work, 'rendezvous')}"
    if os.path.exists(init[7:]):
        os.unlink(init[7:])
    for r in range(world):
        if os.path.exists(os.path.join(work, f"rank{r}.json")):
            os.unlink(os.path.join(work, f"rank{r}.json"))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    environ = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, args=(r, world, init, path, module, scenario, work,
                                                  kwargs, pg_timeout, environ), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.1, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    out = []
    for r, p in enumerate(procs):
        f = os.path.join(work, f"rank{r}.json")
        if os.path.exists(f):
            with open(f) as fh:
                out.append(json.load(fh))
        else:
            out.append({"died": p.exitcode})
    return out
