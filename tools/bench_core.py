#!/usr/bin/env python3
"""bench_core: ckptstore against torch.save, safetensors and DCP, side by side, in one run.

What is measured (every figure is taken in this run, on this machine):

* **Machine limits.** Sequential write + fsync bandwidth of the disk under the benchmark directory
  (the state's byte count written to a new file in 4, 16 and 64 MiB ``write()`` calls from one
  touched buffer, then ``fsync`` of the file and of its directory; the best write size's median is
  "the disk's fsync'd bandwidth"). Each write starts after a 4 s cool-down, because on this VM
  memory freed a few seconds earlier goes back to the host and new page cache then costs ~3x more
  than page cache freed a moment ago: the saves below, each in a fresh process, always get the
  slow kind, so the limit is measured the same way (the write sizes rotate across repeats, and an
  info row shows the "page cache just freed" figure, another an O_DIRECT write). Also: a cold and
  a page-cache sequential read into a reused buffer; memcpy bandwidth (``copy_`` of the state into
  preallocated, already-touched tensors, best of 3) and a copy into fresh allocations (``clone``).
* **Full save**, each one durable when the clock stops: ``ckptstore`` ``Store.save`` (fsyncs
  itself), ``torch.save`` (default, which computes crc32, and with crc32 off), ``safetensors``
  ``save_file`` and ``torch.distributed.checkpoint.save`` with ``FileSystemWriter(sync_files=True)``
  and ``no_dist=True``. For the peers the clock includes an fsync of every file they wrote and of
  the directory.
* **Full load**: ``ckptstore`` (``open(mode="r")`` + ``load`` + ``close``), the same loading
  into preallocated, touched tensors (``load(1, into=...)``), ``torch.load (weights_only=True)``,
  ``safetensors.load_file(backend="pread")`` (the default mmap backend returns lazily mapped tensors
  and reads nothing) and DCP ``load`` into preallocated, touched tensors. "Cold" loads start with
  an empty page cache for the files read: ``echo 3 > /proc/sys/vm/drop_caches`` where the kernel
  allows it, else ``posix_fadvise(DONTNEED)`` on every file of the checkpoint after a sync (the
  same for every engine); loads are also measured without ("warm"). The output says which.
* **Restore into a live model + AdamW** (``--restore-mib`` of parameters, 8 square Linear layers,
  one AdamW step taken): a fresh process builds the model and optimizer with other values and no
  optimizer state, and the clock runs from opening the checkpoint until the live objects hold the
  saved state: ``ckptstore.open`` + ``Checkpointer(...).restore()`` against DCP's
  ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``. Throughput counts parameters and both
  AdamW moments.
* **Incremental save**: after the full save, 10% of the tensors (evenly spaced) get ``add_(1)``
  and ckptstore saves the next iteration; written bytes and seconds are reported as fractions of the
  full save's (per repeat, then the median).
* **Memory**: each measured operation runs in a fresh child process (``bench_core.py --child
  ...``) that builds what it needs, warms its engine up on a tiny state, resets the peak-RSS mark
  (``/proc/self/clear_refs`` = 5) and reads ``VmRSS`` before and ``VmHWM`` after the operation. A
  save reports its peak over the RSS before it; a load reports its peak over the RSS before it
  *minus the state's size* when it allocates the state (DCP fills preallocated tensors, so nothing
  is subtracted). The budget checked for ckptstore is ``4 chunks x worker threads + 16 MiB``
  (threads observed through the ``progress`` callback).

The 1-minute load average is sampled after every child and printed: other processes on these
2-core machines (test suites, other benchmarks) move every number, so a warning is printed when
they were competing. ``--prefault`` touches and frees 2x the state before each clock (it makes
anonymous allocations fast, not new page cache).

Every timed measurement is repeated ``--rounds`` (``--repeat``) times (fresh processes, a fresh
store or file each time, engines in a rotated order) and **medians** are quoted (the JSON also
has min-max and stdev); throughput is logical state bytes / seconds in GB/s (1e9). Ratios
``x peer`` are this row's throughput divided by the peer's (> 1: faster). The tool re-executes itself with ``MALLOC_MMAP_THRESHOLD_=268435456
MALLOC_TRIM_THRESHOLD_=1073741824`` unless they are set or ``--no-malloc-env`` is given (see
shared/MEASUREMENTS.md: this VM's fresh allocations are slow and bimodal) and prints the setting.
Work files live in a temporary directory under ``--dir`` (default: the current directory; tmpfs
is refused) and are removed at the end.

    python tools/bench_core.py                      # ~1 GiB, 100 tensors, 3 repeats
    python tools/bench_core.py --quick              # ~64 MiB, 1 repeat (CI)
    python tools/bench_core.py --json out.json --profile
    python tools/bench_core.py --rounds 5              # (--repeat 5: the same)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness

from harness import (GB, MiB, Stats, add_standard_args, ensure_malloc_env, evict_files,  # noqa: E402
                     filesystem_type, fmt, fsync_path, fsync_tree, header, load_summary, log,
                     machine, parser, quick, read_text, rotated, table, write_json)
from bench_core_report import (COOL_DOWN_S, LOAD_ENGINES, LOAD_LABELS,  # noqa: E402,F401
                               MEM_CHUNKS, MEM_METADATA, PEERS, READ_SIZE, RESTORE_ENGINES,
                               RESULT_PREFIX, SAVE_ENGINES, SAVE_LABELS, SEED, WRITE_SIZES_MIB,
                               aggregate, report, targets)
from bench_core_state import (tensor_specs, make_tensor, make_state, state_bytes, changed_indices,
                              verify_loaded, proc_status, reset_peak_rss, drop_caches, make_cold,
                              ThreadWatch, Measured, prefault, measure)  # noqa: E402,F401



# ---- saves -------------------------------------------------------------------------------------
def save_torch(state: dict[str, Any], path: str, crc32: bool = True) -> None:
    import torch

    torch.serialization.set_crc32_options(crc32)
    torch.save(state, path)
    fsync_tree(path)


def save_safetensors(state: dict[str, Any], path: str) -> None:
    from safetensors.torch import save_file

    save_file(state, path)
    fsync_tree(path)


def save_dcp(state: dict[str, Any], path: str, threads: int) -> None:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(path, sync_files=True, thread_count=threads)
    dcp.save(state, storage_writer=writer, no_dist=True)
    fsync_tree(path)


def peer_saver(engine: str, dcp_threads: int) -> Callable[[dict[str, Any], str], None]:
    return {
        "torch": lambda s, p: save_torch(s, p, crc32=True),
        "torch_nocrc": lambda s, p: save_torch(s, p, crc32=False),
        "safetensors": save_safetensors,
        "dcp": lambda s, p: save_dcp(s, p, dcp_threads),
    }[engine]


# ---- loads -------------------------------------------------------------------------------------
def load_ckptstore(path: str, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    import ckptstore

    s = ckptstore.open(path, mode="r")
    try:
        return s.load(1, progress=progress)
    finally:
        s.close()


def load_torch(path: str) -> dict[str, Any]:
    import torch

    return torch.load(path, weights_only=True)


def load_safetensors(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(path, backend="pread")


def load_ckptstore_into(path: str, into: dict[str, Any],
                        progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    import ckptstore

    with ckptstore.open(path, mode="r") as s:
        return s.load(1, progress=progress, into=into)


def load_dcp(path: str, into: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    dcp.load(into, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return into


# ---- warm-up: first calls import modules and build caches; keep that out of time and memory ----
def warm_up(engine: str, scratch: str, dcp_threads: int) -> None:
    import torch

    tiny = {"a": torch.ones(4096), "b": torch.zeros(3, 5)}
    path = os.path.join(scratch, f"warmup-{engine}")
    if engine in ("ckptstore", "ckptstore_into"):
        import ckptstore

        with ckptstore.open(path, mode="a") as s:
            s.save(1, tiny)
        load_ckptstore(path)
        load_ckptstore_into(path, {k: torch.empty_like(v) for k, v in tiny.items()})
    elif engine == "dcp":
        save_dcp(tiny, path, dcp_threads)
        load_dcp(path, {k: torch.empty_like(v) for k, v in tiny.items()})
    elif engine == "safetensors":
        save_safetensors(tiny, path)
        load_safetensors(path)
    else:
        save_torch(tiny, path)
        load_torch(path)
    torch.serialization.set_crc32_options(True)
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


# ---- child operations --------------------------------------------------------------------------
def child_limits(a: argparse.Namespace) -> dict[str, Any]:
    specs = tensor_specs(a.size_mib, a.tensors)
    state = list(make_state(specs).values())
    total = state_bytes(specs)
    out: dict[str, Any] = {"bytes": total}
    dst = [t.clone().zero_() for t in state]  # allocated and touched before the clock
    copy = lambda: [d.copy_(s) for d, s in zip(dst, state)]  # noqa: E731
    out["memcpy_s"] = min(measure(copy).seconds for _ in range(3))  # the machine's best
    del dst
    gc.collect()
    out["clone_s"] = measure(lambda: [s.clone() for s in state], a.prefault_bytes).seconds
    del state
    gc.collect()
    buf = memoryview(os.urandom(max(WRITE_SIZES_MIB) * MiB))
    path = os.path.join(a.path, "disk")
    for mib in rotated(WRITE_SIZES_MIB, a.round):  # no write size always pays for going first
        cool_down()
        out[f"write_{mib}_s"] = measure(lambda: write_file(path, buf[:mib * MiB], total),
                                        a.prefault_bytes).seconds
        os.unlink(path)
    write_file(path, buf, total)  # (info) the same bytes again at once, onto the page cache just freed
    os.unlink(path)
    out["write_hot_s"] = measure(lambda: write_file(path, buf[:16 * MiB], total)).seconds
    os.unlink(path)
    cool_down()
    direct = measure(lambda: write_direct(path, buf[:16 * MiB], total), a.prefault_bytes)
    if direct.result:
        out["write_direct_s"] = direct.seconds
    else:
        write_file(path, buf, total)
    rbuf = bytearray(READ_SIZE)
    if not direct.result:  # an O_DIRECT-written file is not in the page cache
        make_cold(path)
    out["read_cold_s"] = measure(lambda: read_file(path, rbuf), a.prefault_bytes).seconds
    read_file(path, rbuf)
    out["read_warm_s"] = measure(lambda: read_file(path, rbuf)).seconds
    os.unlink(path)
    return out


def write_direct(path: str, data: memoryview, total: int) -> bool:
    """Like :func:`write_file` but with O_DIRECT from a page-aligned reused buffer (the copy into
    it is timed); False (nothing measured) where the file system refuses O_DIRECT."""
    aligned = mmap.mmap(-1, len(data))
    aligned[:] = data
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        return False
    try:
        done = 0
        while done < total:
            n = min(len(data), total - done)
            aligned[:n] = data[:n]
            done += os.pwrite(fd, memoryview(aligned)[:n], done)
        os.fsync(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
        aligned.close()
    fsync_path(os.path.dirname(path))
    return True


def cool_down() -> None:
    """Wait until memory freed so far has gone back to the host (this VM reports free pages after
    ~2 s), so a disk-limit write gets new page cache as cold as a save in a fresh child does.
    Measured here: 1 GiB write+fsync 0.5 s right after deleting a 1 GiB file, 1.8 s after 8 s."""
    os.sync()
    time.sleep(COOL_DOWN_S)


def write_file(path: str, piece: memoryview, total: int) -> None:
    """Write ``total`` bytes as repeated ``len(piece)``-byte writes, then fsync file and dir."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < total:
            n = min(len(piece), total - done)
            w = 0
            while w < n:
                w += os.write(fd, piece[w:n])
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(os.path.dirname(path))


def read_file(path: str, buf: bytearray) -> int:
    got = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            got += n
    return got


def child_save(a: argparse.Namespace) -> dict[str, Any]:
    specs = tensor_specs(a.size_mib, a.tensors)
    state = make_state(specs)
    warm_up(a.engine, a.scratch, a.dcp_threads)
    if a.engine == "ckptstore":
        return save_ckptstore(a, state)
    fn = peer_saver(a.engine, a.dcp_threads)
    m = measure(lambda: fn(state, a.path), a.prefault_bytes)
    torch_reset_crc()
    return {"bytes": state_bytes(specs), "seconds": m.seconds, "peak_extra": m.peak_extra,
            "rss_before": m.rss_before, "disk_bytes": disk_usage(a.path)}


def torch_reset_crc() -> None:
    import torch

    torch.serialization.set_crc32_options(True)


def save_ckptstore(a: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    import ckptstore

    out: dict[str, Any] = {"bytes": sum(t.numel() * t.element_size() for t in state.values())}
    with ckptstore.open(a.path, mode="a") as s:
        out["chunk_size"] = s.chunk_size
        watch = ThreadWatch()
        full = measure(lambda: profiled(a.profile, lambda: s.save(1, state, progress=watch)),
                       a.prefault_bytes)
        out["workers"] = watch.workers
        for i in changed_indices(len(state)):
            state[f"layers.{i}.weight"].add_(1)
        incr = measure(lambda: s.save(2, state), a.prefault_bytes)
    fs, fp = full.result
    out.update(seconds=full.seconds, peak_extra=full.peak_extra, rss_before=full.rss_before,
               written=fs.written_bytes, stats_seconds=fs.seconds, profile=fp,
               incr_seconds=incr.seconds, incr_peak_extra=incr.peak_extra,
               incr_written=incr.result.written_bytes, incr_dedup=incr.result.dedup_bytes,
               disk_bytes=disk_usage(a.path))
    return out


def profiled(enabled: bool, fn: Callable[[], Any]) -> tuple[Any, list[dict[str, Any]] | None]:
    """Run ``fn``, under cProfile when ``enabled``; return its result and the top functions."""
    if not enabled:
        return fn(), None
    import cProfile
    import pstats

    prof = cProfile.Profile()
    result = prof.runcall(fn)
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{os.path.basename(file)}:{line}({func})", "calls": nc,
                     "tottime": tt, "cumtime": ct})
    rows.sort(key=lambda r: r["tottime"], reverse=True)
    return result, rows[:15]


def child_load(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    specs = tensor_specs(a.size_mib, a.tensors)
    warm_up(a.engine, a.scratch, a.dcp_threads)
    prealloc = a.engine in ("dcp", "ckptstore_into")
    into = {name: torch.zeros(shape) for name, shape in specs} if prealloc else None
    evicted = make_cold(a.path) if a.cold else None
    watch = ThreadWatch()
    fn: Callable[[], dict[str, Any]] = {
        "ckptstore": lambda: load_ckptstore(a.path, progress=watch),
        "ckptstore_into": lambda: load_ckptstore_into(a.path, into, progress=watch),  # type: ignore[arg-type]
        "torch": lambda: load_torch(a.path),
        "safetensors": lambda: load_safetensors(a.path),
        "dcp": lambda: load_dcp(a.path, into),  # type: ignore[arg-type]
    }[a.engine]
    m = measure(fn, a.prefault_bytes)
    allocated = 0 if prealloc else state_bytes(specs)
    verify_loaded(specs, m.result)
    return {"bytes": state_bytes(specs), "seconds": m.seconds, "cache": "cold" if evicted else "warm",
            "evicted_by": evicted,
            "peak_extra": m.peak_extra - allocated, "rss_file_after": m.rss_file_after,
            "workers": watch.workers}


# ---- restore of a live model + AdamW ----------------------------------------------------------
def restore_model(restore_mib: float, seed: int) -> tuple[Any, Any]:
    """An MLP of 8 square Linear layers with ``restore_mib`` MiB of float32 parameters, and AdamW."""
    import torch

    width = max(8, int(math.sqrt(restore_mib * MiB / 4 / 8)))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def trained_model(restore_mib: float) -> tuple[Any, Any]:
    """The state both engines save: one AdamW step, so the optimizer has its moments."""
    import torch

    model, opt = restore_model(restore_mib, SEED)
    model(torch.randn(4, model[0].in_features, generator=torch.Generator().manual_seed(SEED))) \
        .square().sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def child_restore_prep(a: argparse.Namespace) -> dict[str, Any]:
    """Save the trained model + AdamW with a Checkpointer (a base) and with DCP (not timed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ckptstore
    from ckptstore.torch import Checkpointer

    model, opt = trained_model(a.restore_mib)
    with ckptstore.open(os.path.join(a.path, "ckptstore"), mode="a") as store:
        Checkpointer(store, model, opt, asynchronous=False).save_base(1)
    msd, osd = get_state_dict(model, opt)
    writer = dcp.FileSystemWriter(os.path.join(a.path, "dcp"), sync_files=True,
                                  thread_count=a.dcp_threads)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer, no_dist=True)
    return {"param_bytes": sum(p.numel() * 4 for p in model.parameters())}


def child_restore(a: argparse.Namespace) -> dict[str, Any]:
    """A restarted trainer: a fresh model + AdamW (other values, no optimizer state) brought to
    the saved state, timed from opening the checkpoint to the live objects holding it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ckptstore
    from ckptstore.torch import Checkpointer

    warm_up("ckptstore" if a.engine == "ckptstore" else "dcp", a.scratch, a.dcp_threads)
    tiny = torch.nn.Linear(4, 4)  # first calls of the state-dict helpers, outside the clock
    tiny_opt = torch.optim.AdamW(tiny.parameters())
    set_state_dict(tiny, tiny_opt, **dict(zip(("model_state_dict", "optim_state_dict"),
                                              get_state_dict(tiny, tiny_opt))))
    model, opt = restore_model(a.restore_mib, SEED + 1)
    where = os.path.join(a.path, a.engine)
    evicted = make_cold(where) if a.cold else None
    stores: list[Any] = []

    def ours() -> None:
        store = ckptstore.open(where, mode="a")
        stores.append(store)
        Checkpointer(store, model, opt, asynchronous=False).restore()

    def theirs() -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, storage_reader=dcp.FileSystemReader(where),
                 no_dist=True)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    m = measure(ours if a.engine == "ckptstore" else theirs)
    for store in stores:
        store.close()
    ref, ref_opt = trained_model(a.restore_mib)
    for p, q in zip(model.parameters(), ref.parameters()):
        if not (torch.equal(p, q) and torch.equal(opt.state[p]["exp_avg_sq"],
                                                   ref_opt.state[q]["exp_avg_sq"])):
            raise AssertionError(f"{a.engine}: the restored model or optimizer differs")
    nbytes = 3 * sum(p.numel() * 4 for p in model.parameters())
    return {"bytes": nbytes, "seconds": m.seconds, "cache": "cold" if evicted else "warm",
            "evicted_by": evicted, "peak_extra": m.peak_extra}


def disk_usage(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def child_main(a: argparse.Namespace) -> None:
    op = {"limits": child_limits, "save": child_save, "load": child_load,
          "restore_prep": child_restore_prep, "restore": child_restore}[a.child]
    print(RESULT_PREFIX + json.dumps(op(a)), flush=True)


# ================================================================================================
# Parent side: environment, orchestration, aggregation, report
# ================================================================================================
def environment(a: argparse.Namespace, malloc: str, fstype: str) -> dict[str, Any]:
    """The machine header (:func:`harness.machine`) and this tool's settings."""
    try:
        import safetensors
        st_version = safetensors.__version__
    except ImportError:
        st_version = "missing"
    return machine(safetensors=st_version, malloc=malloc,
                   thp=read_text("/sys/kernel/mm/transparent_hugepage/enabled"), dir=a.dir,
                   filesystem=fstype,
                   prefault=f"{a.prefault_bytes / MiB:.0f} MiB touched+freed before each clock"
                   if a.prefault else "off")


def run_child(a: argparse.Namespace, op: str, path: str, scratch: str, r: int, engine: str = "",
              cold: bool = False) -> dict[str, Any]:
    argv = [sys.executable, os.path.abspath(__file__), "--child", op, "--path", path,
            "--scratch", scratch, "--size-mib", str(a.size_mib), "--tensors", str(a.tensors),
            "--dcp-threads", str(a.dcp_threads), "--round", str(r),
            "--restore-mib", str(a.restore_mib)]
    if a.prefault:
        argv.append("--prefault")
    if engine:
        argv += ["--engine", engine]
    if cold:
        argv.append("--cold")
    if a.profile and op == "save" and engine == "ckptstore":
        argv.append("--profile")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=a.child_timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            res = json.loads(line[len(RESULT_PREFIX):])
            res["loadavg1"] = os.getloadavg()[0]  # other processes on the machine skew everything
            return res
    raise RuntimeError(f"child {op} {engine} failed (rc {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def settle() -> None:
    """Flush dirty pages and let discards of deleted files finish before the next measurement."""
    os.sync()
    time.sleep(0.5)


def run_repeat(a: argparse.Namespace, work: str, r: int, samples: dict[str, list[dict]],
               caches: list[str]) -> None:
    rdir = os.path.join(work, f"r{r}")
    scratch = os.path.join(work, "scratch")
    os.makedirs(rdir)
    os.makedirs(scratch, exist_ok=True)
    log(f"  repeat {r + 1}/{a.rounds}: limits")
    samples["limits"].append(run_child(a, "limits", rdir, scratch, r))
    paths = {e: os.path.join(rdir, f"{e}.ckpt") for e in SAVE_ENGINES}
    paths["ckptstore_into"] = paths["ckptstore"]
    for engine in rotated(SAVE_ENGINES, r):
        settle()
        log(f"  repeat {r + 1}/{a.rounds}: save {engine}")
        samples[f"save:{engine}"].append(run_child(a, "save", paths[engine], scratch, r, engine))
    for engine in rotated(LOAD_ENGINES, r):
        for cache in caches:
            settle()
            log(f"  repeat {r + 1}/{a.rounds}: load {engine} ({cache})")
            res = run_child(a, "load", paths[engine], scratch, r, engine, cold=cache == "cold")
            samples.setdefault(f"load:{engine}:{res['cache']}", []).append(res)
    if a.restore_mib > 0:
        rpath = os.path.join(rdir, "restore")
        os.makedirs(rpath)
        log(f"  repeat {r + 1}/{a.rounds}: restore: saving model + AdamW with both engines")
        run_child(a, "restore_prep", rpath, scratch, r)
        for engine in rotated(RESTORE_ENGINES, r):
            for cache in caches:
                settle()
                log(f"  repeat {r + 1}/{a.rounds}: restore {engine} ({cache})")
                res = run_child(a, "restore", rpath, scratch, r, engine, cold=cache == "cold")
                samples.setdefault(f"restore:{engine}:{res['cache']}", []).append(res)
    shutil.rmtree(rdir)
    settle()


# ---- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--size-mib", type=float, default=1024.0,
                   help="state size in MiB (default 1024)")
    p.add_argument("--tensors", type=int, default=100, help="number of tensors (default 100)")
    add_standard_args(p, rounds=3, rounds_help="repeats per measurement", aliases=("--repeat",),
                      quick_help="~64 MiB, 1 repeat, 16 MiB restore: a CI-sized run")
    p.add_argument("--dir", default=os.getcwd(), help="where the temporary work dir goes (not tmpfs)")
    p.add_argument("--cache", choices=("cold", "warm", "both"), default="both",
                   help="loads after dropping the page cache, without, or both (default)")
    p.add_argument("--dcp-threads", type=int, default=2, help="FileSystemWriter thread_count (default 2)")
    p.add_argument("--profile", action="store_true", help="cProfile the first ckptstore full save")
    p.add_argument("--prefault", action="store_true",
                   help="before each clock, touch and free 2x the state + 256 MiB of memory so the "
                        "operation gets host-backed pages (hides this VM's first-touch cost)")
    p.add_argument("--no-malloc-env", action="store_true", help="do not re-exec with MALLOC_* set")
    p.add_argument("--allow-tmpfs", action="store_true", help="allow --dir on tmpfs")
    p.add_argument("--child-timeout", type=int, default=900, help=argparse.SUPPRESS)
    p.add_argument("--restore-mib", type=float, default=128.0,
                   help="MiB of parameters of the model + AdamW restored into a live model "
                        "(default 128; 16 with --quick; 0 skips)")
    p.add_argument("--child", choices=("limits", "save", "load", "restore_prep", "restore"),
                   help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    p.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    quick(a, p, size_mib=64.0, rounds=1, restore_mib=16.0)
    a.dir = os.path.abspath(a.dir)
    state = state_bytes(tensor_specs(a.size_mib, a.tensors))
    a.prefault_bytes = 2 * state + 256 * MiB if a.prefault else 0
    if a.rounds < 1 or a.tensors < 1 or a.size_mib <= 0:
        p.error("--rounds, --tensors and --size-mib must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        child_main(a)
        return 0
    malloc = ensure_malloc_env(__file__, a.no_malloc_env)
    fstype = filesystem_type(a.dir)
    if fstype in ("tmpfs", "ramfs") and not a.allow_tmpfs:
        print(f"bench_core: {a.dir} is on {fstype}; give --dir on a real disk", file=sys.stderr)
        return 2
    env = environment(a, malloc, fstype)
    log(f"bench_core: malloc: {malloc}")
    total = state_bytes(tensor_specs(a.size_mib, a.tensors))
    caches = ["cold", "warm"] if a.cache == "both" else [a.cache]
    samples: dict[str, list[dict]] = {"limits": [], **{f"save:{e}": [] for e in SAVE_ENGINES}}
    work = tempfile.mkdtemp(prefix="bench_core-", dir=a.dir)
    try:
        for r in range(a.rounds):
            run_repeat(a, work, r, samples, caches)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    got = sorted({k.rsplit(":", 1)[1] for k in samples if k.startswith("load:")})
    methods = sorted({r["evicted_by"] for k, rows in samples.items() for r in rows
                      if r.get("evicted_by")})
    note = ", ".join(got) + (f" (cold: the page cache emptied before each read by "
                             f"{' / '.join(methods)}, the same way for every engine)"
                             if methods else "")
    agg = aggregate(samples, total)
    env["load average during"] = load_summary(
        [r["loadavg1"] for rows in samples.values() for r in rows if "loadavg1" in r])
    ts = targets(agg, got)
    print(report(env, a, total, agg, ts, note, samples))
    # ("aggregate" and "environment": what goodput.py --from-bench reads)
    write_json(a.json, "bench_core", {k: v for k, v in vars(a).items() if k not in (
        "child", "engine", "path", "scratch", "cold", "round")}, env, samples, agg,
        state_bytes=total, targets=ts, aggregate=agg, environment=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
