"""Run a function on N ranks of a real gloo process group (spawned processes), with a deadline.

Each rank runs ``scenario(rank, world, path, **kwargs)`` (a module-level function of the calling
test module, found by name in the child) after ``init_process_group("gloo")`` over a file://
rendezvous. What it returns (JSON-able) or raises comes back per rank as a dict:
``{"ok": value}`` or ``{"error": class name, "message": str}``; a rank that died or never
finished, or died of a crash signal even after it wrote its result, comes back as
``{"died": exitcode}``. A run never outlives its deadline: stragglers are killed.

A rank that dies of a crash signal (SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE) leaves two traces on
the test's stderr: faulthandler's tracebacks of its Python threads (from the rank itself) and,
where the system lets a core file land in a directory (``kernel.core_pattern`` a path, not a
pipe) and gdb is installed, every thread's native stack from that core (:func:`native_stacks`):
a fault in a thread without Python frames (a gloo worker, an OpenMP thread) shows only there.
The core is then moved into the run's ``work`` directory (so no test run leaves one in the
directory it ran from).

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
import shutil
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

import pytest
import torch


#: marks a test (or a module, as its ``pytestmark``) that needs real gloo process groups: skipped
#: where torch.distributed or its gloo backend is not built in
needs_gloo = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

#: modules the forkserver imports once; each rank is forked from it with them loaded
PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "torch.distributed.checkpoint",
           "torch._dynamo", "pytest", "ckptstore", "ckptstore.torch", "ckptstore.dcp",
           "ckptstore.remote", "ckptstore.cli"]


def _rank_main(rank: int, world: int, init: str, path: str, module: str, scenario: str,
               out_dir: str, kwargs: dict, pg_timeout: float, environ: dict[str, str]) -> None:
    import faulthandler

    os.environ.clear()
    os.environ.update(environ)  # the caller's environment now, not the forkserver's at its start

    import torch.distributed as dist

    faulthandler.enable()  # a rank that dies of a signal leaves its threads' tracebacks on stderr
    _allow_core(out_dir, rank)
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


#: the signals whose default action dumps core: a rank dead of one of them crashed
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}
#: how long gdb may take to read one core (torch's symbols: ~10-30 s on 2 busy cores)
GDB_TIMEOUT_S = 180.0


def _allow_core(out_dir: str, rank: int) -> None:
    """Let this rank dump core (soft limit raised to the hard one; a hard limit of 0 leaves it
    off) and note where a relative ``core_pattern`` would put the file: the rank's working
    directory, the forkserver's, not necessarily the test's."""
    import resource

    try:
        _, hard = resource.getrlimit(resource.RLIMIT_CORE)
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
    except (ValueError, OSError):
        return
    with open(os.path.join(out_dir, f"rank{rank}.cwd"), "w") as f:
        f.write(os.getcwd())


def file_core_pattern() -> str | None:
    """``kernel.core_pattern`` when it names a file (``core``, ``core.%p`` and the like,
    relative to the crashing process's working directory, or absolute); None when it is a pipe
    (apport, systemd-coredump), empty or unreadable."""
    try:
        with open("/proc/sys/kernel/core_pattern") as f:
            pattern = f.read().strip()
    except OSError:
        return None
    return pattern if pattern and not pattern.startswith("|") else None


def _core_file(work: str, rank: int, pid: int) -> str | None:
    """The core file rank ``rank`` (process ``pid``) left where :func:`file_core_pattern` puts
    it; None when the pattern is no file's or no file is there."""
    pattern = file_core_pattern()
    if pattern is None:
        return None
    try:
        with open(os.path.join(work, f"rank{rank}.cwd")) as f:
            cwd = f.read()
    except OSError:
        return None
    name = pattern.replace("%p", str(pid)).replace("%%", "%")
    if "%" in name:  # other specifiers (%e, %t, ...): not guessed
        return None
    found = os.path.join(cwd, name)
    if os.path.exists(found + f".{pid}"):  # kernel.core_uses_pid
        found += f".{pid}"
    return found if os.path.isfile(found) else None


def native_stacks(work: str, rank: int, pid: int, exitcode: int | None) -> str:
    """For a rank dead of a crash signal: every thread's native stack read by gdb from its core
    (moved into ``work``), or one line saying why there is none; "" for any other end."""
    if exitcode is None or exitcode >= 0 or -exitcode not in CRASH_SIGNALS:
        return ""
    what = f"rank {rank} (pid {pid}) died of {signal.Signals(-exitcode).name}"
    core = _core_file(work, rank, pid)
    if core is None:
        return f"{what}: no core file (core_pattern a pipe or core dumps off)"
    kept = os.path.join(work, f"core.rank{rank}.{pid}")
    shutil.move(core, kept)
    gdb = shutil.which("gdb")
    if gdb is None:
        return f"{what}: core kept as {kept}; no gdb to read it"
    try:
        run = subprocess.run([gdb, "-batch", "-nx", "-ex", "info threads", "-ex",
                              "thread apply all bt 40", sys.executable, kept],
                             capture_output=True, text=True, timeout=GDB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{what}: core kept as {kept}; gdb took over {GDB_TIMEOUT_S:g} s"
    return f"{what}: core kept as {kept}; native stacks (gdb):\n{run.stdout}{run.stderr}"


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
        stacks = native_stacks(work, r, p.pid, p.exitcode)
        if stacks:
            print(stacks, file=sys.stderr, flush=True)
        if stacks or not os.path.exists(f):
            # a crash after the rank wrote its result (tearing its group down) is a crash too
            out.append({"died": p.exitcode})
        else:
            with open(f) as fh:
                out.append(json.load(fh))
    return out
