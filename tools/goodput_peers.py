"""The checkpointing strategies a bench_goodput training child runs (tools/bench_goodput.py):
the peers (torch.save, DCP ``async_save``, a PCcheck/CheckFreq-style baseline) and ckptstore's
Checkpointer under one policy, each behind the same small interface, plus what every child
reports with (:class:`Emitter`: JSON lines on stdout) and checks with (:func:`params_hash`).

Interface of a strategy (``CHILD_STRATEGIES[name](cfg, model, opt, emit)``): ``restore()`` ->
the iteration restored (0: none), ``step(it)`` applies the optimizer step and checkpoints when
due (True when it wrote one), ``finish()`` where the strategy has background work to end.
Durability is reported as ``emit("durable", i=it)`` events. The child processes' main loops
(:func:`child_main`: train under one strategy; :func:`calibrate_main`: measure the stalls the
every-N choices need) end this module.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import sys
import threading
import time
from typing import Any

import harness  # tools/harness.py (fsync_path)
class Emitter:
    """JSON lines on stdout, one event each, thread-safe (background writers report too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, ev: str, **kw: Any) -> None:
        kw.update(ev=ev, t=time.monotonic())
        line = json.dumps(kw) + "\n"
        with self._lock:
            sys.stdout.write(line)
            sys.stdout.flush()


def wchar(pid: int | str = "self") -> int:
    """Bytes the process passed to write calls so far (/proc/PID/io ``wchar``; 0 if unreadable)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def params_hash(model) -> str:
    """xxh3-64 over the model's parameters in order (tied ones once), as hex."""
    import xxhash
    h = xxhash.xxh3_64()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().view("uint8").data)
    return h.hexdigest()


def adam_state_tensors(model, opt) -> list:
    """The tensors of a checkpoint in a fixed order: each parameter, then per parameter (in the
    optimizer's order) AdamW's step, exp_avg, exp_avg_sq; missing optimizer state is created
    (zeros, step 0) so a restore has somewhere to copy into. All float32 on CPU."""
    import torch
    out = list(model.parameters())
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if not st:
                st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                          exp_avg_sq=torch.zeros_like(p))
            out += [st["step"], st["exp_avg"], st["exp_avg_sq"]]
    return out


class Plain:
    """No checkpoints; the reference: a parameter hash per iteration (outside the timed step)."""

    reference = True

    def __init__(self, cfg: dict, model, opt, emit: Emitter) -> None:
        self.opt = opt

    def restore(self) -> int:
        return 0

    def step(self, it: int) -> bool:
        self.opt.step()
        return False


class TorchSave:
    """torch.save of model + optimizer every N: temp file, fsync, rename, fsync dir."""

    def __init__(self, cfg: dict, model, opt, emit: Emitter) -> None:
        self.model, self.opt, self.emit, self.every = model, opt, emit, cfg["every"]
        self.path = os.path.join(cfg["dir"], "ckpt.pt")

    def restore(self) -> int:
        import torch
        if not os.path.exists(self.path):
            return 0
        sd = torch.load(self.path, weights_only=True)
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optimizer"])
        return int(sd["iteration"])

    def step(self, it: int) -> bool:
        import torch
        self.opt.step()
        if it % self.every:
            return False
        tmp = self.path + ".tmp"
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                    "iteration": it}, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        harness.fsync_path(os.path.dirname(self.path))
        self.emit("durable", i=it)
        return True


class DcpAsync:
    """DCP async_save every N (one in flight, as DCP allows); older checkpoints are removed once
    a newer one is durable. A checkpoint is complete when its ``.metadata`` exists."""

    def __init__(self, cfg: dict, model, opt, emit: Emitter) -> None:
        self.model, self.opt, self.emit, self.every = model, opt, emit, cfg["every"]
        self.dir = cfg["dir"]
        self.fut = None

    def _done(self) -> list[int]:
        its = []
        for name in os.listdir(self.dir):
            if name.startswith("dcp-") and os.path.exists(os.path.join(self.dir, name, ".metadata")):
                its.append(int(name[4:]))
        return sorted(its)

    def restore(self) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        its = self._done()
        if not its:
            return 0
        msd, osd = get_state_dict(self.model, self.opt)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(self.dir, f"dcp-{its[-1]}")),
                 no_dist=True)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        return its[-1]

    def step(self, it: int) -> bool:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        self.opt.step()
        if it % self.every:
            return False
        if self.fut is not None:
            self.fut.result()
        msd, osd = get_state_dict(self.model, self.opt)
        path = os.path.join(self.dir, f"dcp-{it}")
        self.fut = dcp.async_save({"model": msd, "optimizer": osd},
                                  storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                                  no_dist=True)
        self.fut.add_done_callback(lambda f, it=it: self._durable(f, it))
        return True

    def _durable(self, fut, it: int) -> None:
        if fut.exception() is None:
            harness.fsync_path(self.dir)
            self.emit("durable", i=it)
            for old in self._done():
                if old < it:
                    shutil.rmtree(os.path.join(self.dir, f"dcp-{old}"), ignore_errors=True)


class PCcheck:
    """PCcheck/CheckFreq-style: K reused page-aligned staging buffers, one writer thread (O_DIRECT
    + fsync into one of two slot files, then an atomically renamed metadata file)."""

    def __init__(self, cfg: dict, model, opt, emit: Emitter) -> None:
        self.model, self.opt, self.emit, self.every = model, opt, emit, cfg["every"]
        self.dir, self.k = cfg["dir"], cfg.get("inflight", 4)
        self.meta = os.path.join(self.dir, "pc-meta.json")
        self.bufs: list | None = None
        self.free: queue.Queue = queue.Queue()
        self.jobs: queue.Queue = queue.Queue()
        self.count = 0
        threading.Thread(target=self._writer, daemon=True).start()

    def _layout(self) -> None:
        import mmap
        import torch
        self.tensors = adam_state_tensors(self.model, self.opt)
        n = sum(t.numel() for t in self.tensors)
        self.nbytes = -(-n * 4 // 4096) * 4096
        self.bufs = []
        for k in range(self.k):
            mm = mmap.mmap(-1, self.nbytes)
            flat = torch.frombuffer(mm, dtype=torch.float32)
            flat.zero_()  # touch it once: copies later land in warm pages
            self.bufs.append((mm, flat))
            self.free.put(k)

    def restore(self) -> int:
        import numpy as np
        import torch
        if not os.path.exists(self.meta):
            return 0
        with open(self.meta) as f:
            meta = json.load(f)
        data = np.fromfile(os.path.join(self.dir, f"pc-slot{meta['slot']}.bin"), dtype=np.float32)
        flat = torch.from_numpy(data)
        off = 0
        with torch.no_grad():
            for t in adam_state_tensors(self.model, self.opt):
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
        return int(meta["iteration"])

    def step(self, it: int) -> bool:
        self.opt.step()
        if it % self.every:
            return False
        k, slot = self.reserve()
        self.copy(it, k, slot)
        return True

    def reserve(self) -> tuple[int, int]:
        """A staging buffer (waits while K checkpoints are in flight) and the slot file to use."""
        if self.bufs is None:
            self._layout()
        k = self.free.get()
        self.count += 1
        return k, (self.count - 1) % 2

    def copy(self, it: int, k: int, slot: int) -> None:
        """Copy the state into buffer ``k`` and hand it to the writer (the stall)."""
        import torch
        flat = self.bufs[k][1]
        off = 0
        with torch.no_grad():
            for t in self.tensors:
                flat[off:off + t.numel()].view_as(t).copy_(t)
                off += t.numel()
        self.jobs.put((it, k, slot))

    def _writer(self) -> None:
        while True:
            it, k, slot = self.jobs.get()
            path = os.path.join(self.dir, f"pc-slot{slot}.bin")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
            try:
                mv = memoryview(self.bufs[k][0])
                done = 0
                while done < self.nbytes:
                    done += os.pwrite(fd, mv[done:], done)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.free.put(k)
            tmp = self.meta + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"iteration": it, "slot": slot}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.meta)
            harness.fsync_path(self.dir)
            self.emit("durable", i=it)


class Ckpt:
    """ckptstore's Checkpointer under one policy; durable events from the save futures."""

    def __init__(self, cfg: dict, model, opt, emit: Emitter) -> None:
        import ckptstore
        from ckptstore.torch import Checkpointer
        self.emit = emit
        self.store = ckptstore.open(os.path.join(cfg["dir"], "store"))
        kind = cfg["strategy"]
        kw: dict[str, Any] = {"fingerprint_every": 0}
        if kind == "ckpt-snapshots":
            kw.update(policy="snapshots", snapshot_every=cfg["every"], mtbf_s=cfg["mtbf_s"])
        elif kind == "ckpt-auto":
            kw.update(policy="auto", mtbf_s=cfg["mtbf_s"])
        else:
            kw.update(policy="every-iteration", base_every=cfg["base_every"],
                      codec="topk:0.01" if kind == "ckpt-topk" else "exact")
        self.ck = Checkpointer(self.store, model, opt, **kw)
        self.plan = None

    def restore(self) -> int:
        return self.ck.restore()

    def close(self) -> None:
        self.ck.close()
        self.store.close()

    def step(self, it: int) -> bool:
        fut = self.ck.step(it)
        plan = self.ck.plan()
        if plan is not None and plan is not self.plan:
            self.plan = plan
            self.emit("plan", i=it, mode=plan.mode, interval=plan.chosen.interval,
                      goodputs=plan.goodputs(), text=str(plan))
        if fut is None:
            return False
        if hasattr(fut, "add_done_callback"):
            fut.add_done_callback(lambda f, it=it: f.exception() is None and self.emit("durable", i=it))
        else:
            self.emit("durable", i=it)
        return True  # (a snapshot, or a delta: every step of the delta strategies checkpoints)


CHILD_STRATEGIES = {"plain": Plain, "torch.save": TorchSave, "dcp-async": DcpAsync,
                    "pccheck": PCcheck, "ckpt-snapshots": Ckpt, "ckpt-deltas": Ckpt,
                    "ckpt-topk": Ckpt, "ckpt-auto": Ckpt}


# ---- the child processes' main loops ---------------------------------------------------------
def child_main(cfg: dict) -> None:
    """Train under ``cfg["strategy"]`` from its last checkpoint up to ``cfg["iterations"]``,
    emitting events (ready, restored, start, it, durable, plan, done); exits with os._exit."""
    emit = Emitter()
    emit("boot")
    import warnings
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message=".*APPROXIMATE replay")  # ckpt-topk: reported as lossy
    import torch
    torch.set_num_threads(cfg["threads"])
    from bench_delta import add_model_args, build, fwd_bwd
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    margs = ap.parse_args(cfg["model"])
    model, opt = build(margs)
    strat = CHILD_STRATEGIES[cfg["strategy"]](cfg, model, opt, emit)
    emit("ready")
    t0 = time.monotonic()
    start = strat.restore()
    load_s = time.monotonic() - t0
    emit("restored", i=start, load_s=load_s, hash=params_hash(model))
    ref = getattr(strat, "reference", False)
    emit("start", i=start)
    for it in range(start + 1, cfg["iterations"] + 1):
        ck, dt = train_step(strat, model, opt, margs, fwd_bwd, it)
        if ref:
            emit("it", i=it, dt=dt, ck=ck, hash=params_hash(model))
        else:
            emit("it", i=it, dt=dt, ck=ck)
    emit("done", i=cfg["iterations"], hash=params_hash(model), wchar=wchar())
    sys.stdout.flush()
    os._exit(0)


def train_step(strat, model, opt, margs, fwd_bwd, it: int) -> tuple[bool, float]:
    """One timed training step of iteration ``it`` under ``strat``: (whether it checkpointed,
    its wall time from the forward pass to the zeroed gradients)."""
    t0 = time.monotonic()
    fwd_bwd(model, margs, it)
    checkpointed = strat.step(it)
    opt.zero_grad()
    return checkpointed, time.monotonic() - t0


def all_in_cost(cls, cfg: dict, model, opt, margs, fwd_bwd, windows: int = 6,
                period: int = 12, stall_s: float = 0.0) -> float:
    """What one checkpoint of strategy ``cls`` costs training, all in: a checkpoint every
    ``period`` steps, ``windows`` times, measured by ckptstore's own
    :class:`ckptstore.torch.plan.SnapshotWindow` (the one implementation, which the Checkpointer's
    planner uses on itself): the steps from a checkpoint's own to the one during which it became
    durable, beyond as many plain steps (the median of the steps outside such windows), per
    checkpoint; the median over the checkpoints, and never below ``stall_s`` (its measured
    blocking part: a slowdown is never negative, though a noisy plain median can make it look
    so). The stall plus the slowdown its background work (a writer thread, a persister) caused
    on the same cores: what Young/Daly needs, measured alike for every strategy."""
    from ckptstore.torch.plan import CostMeter, SnapshotWindow
    window, meter = SnapshotWindow(), CostMeter(window=64)
    lock = threading.Lock()
    durable = [0]

    def emit(ev: str, **kw: Any) -> None:
        if ev == "durable":
            with lock:
                durable[0] += 1

    strat = cls(dict(cfg, every=period), model, opt, emit)
    it = strat.restore()
    deadline = time.monotonic() + 120
    while meter.count("snapshot_cost") < windows:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{cls.__name__}: {meter.count('snapshot_cost')} of {windows} "
                               f"checkpoints measured in 120 s")
        it += 1
        checkpointed, dt = train_step(strat, model, opt, margs, fwd_bwd, it)
        if checkpointed:
            window.submitted(whole=True)
        with lock:
            n, durable[0] = durable[0], 0
        for _ in range(n):
            window.durable()
        window.step("base" if checkpointed else "plain", dt, meter)
    close = getattr(strat, "close", None)
    if close is not None:
        close()
    return max(stall_s, meter.median("snapshot_cost") or 0.0)


def calibrate_main(cfg: dict) -> None:
    """Measure, in one process, what the every-N choices need: the plain step, torch.save's
    stall, DCP async_save's blocking part, the PCcheck copy and ckptstore's save_async stall
    (medians of ``reps``), and each one's all-in cost (:func:`all_in_cost`: the stall plus the
    slowdown of the steps its background work overlaps); emits one ``calib`` event."""
    emit = Emitter()
    import warnings
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import torch
    torch.set_num_threads(cfg["threads"])
    from bench_delta import add_model_args, build, fwd_bwd
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    margs = ap.parse_args(cfg["model"])
    model, opt = build(margs)
    steps = []
    for it in range(1, cfg["steps"] + 1):
        t0 = time.monotonic()
        fwd_bwd(model, margs, it)
        opt.step()
        opt.zero_grad()
        steps.append(time.monotonic() - t0)
    out: dict[str, Any] = {"step_s": statistics.median(steps[2:] or steps)}
    reps = cfg["reps"]
    base = cfg["dir"]

    def timed(name: str, fn, finish=None) -> None:
        ts = []
        for r in range(reps + 1):
            t0 = time.monotonic()
            h = fn(r)
            ts.append(time.monotonic() - t0)
            if finish is not None:
                finish(h)
        out[name] = statistics.median(ts[1:])  # the first touches fresh memory: warm-up

    c = {"dir": base, "every": 1, "mtbf_s": 3600.0, "base_every": 30, "strategy": "x", "inflight": 1}
    ts_ = TorchSave(dict(c), model, opt, lambda *a, **k: None)
    timed("torch_save_s", lambda r: ts_.step(1) and None)
    os.makedirs(os.path.join(base, "dcp"), exist_ok=True)
    dc = DcpAsync(dict(c, dir=os.path.join(base, "dcp")), model, opt, lambda *a, **k: None)
    timed("dcp_block_s", lambda r: dc.step(r + 1) and dc.fut, lambda f: f.result())
    pc = PCcheck(dict(c), model, opt, lambda *a, **k: None)
    pc.step(1)
    pc.free.put(pc.free.get())
    timed("pccheck_copy_s", lambda r: pc.step(r + 2))
    import ckptstore
    from ckptstore.torch import Checkpointer
    store = ckptstore.open(os.path.join(base, "store"))
    ck = Checkpointer(store, model, opt, policy="snapshots", snapshot_every=2, mtbf_s=3600.0)
    ck.restore()
    # A snapshot every other step, as training meets it: the stall is the snapshot step's own
    # part plus, with an overlapped copy (the default), what the next step still waits for
    # before its optimizer step (the Checkpointer's "stall" samples); each snapshot is durable
    # before the next one, so no backpressure is counted.
    last = None
    for it in range(1, 2 * (reps + 1) + 1):
        fwd_bwd(model, margs, it)
        fut = ck.step(it)
        opt.zero_grad()
        if fut is None and last is not None:
            last.result()
        last = fut or last
    last.result()
    out["ckpt_stall_s"] = max(ck.meter.median("stall") or 0.0, 1e-4)
    ck.close()
    store.close()
    out["checkpoint_bytes"] = sum(t.numel() * 4 for t in adam_state_tensors(model, opt))
    for name, cls, extra, stall in (("torch_save", TorchSave, {}, "torch_save_s"),
                                    ("dcp", DcpAsync, {}, "dcp_block_s"),
                                    ("pccheck", PCcheck, {}, "pccheck_copy_s"),
                                    ("ckpt", Ckpt, {"strategy": "ckpt-snapshots"}, "ckpt_stall_s")):
        d = os.path.join(base, f"all-in-{name}")
        os.makedirs(d)
        out[f"{name}_cost_s"] = max(all_in_cost(cls, dict(c, dir=d, **extra), model, opt, margs,
                                                fwd_bwd, stall_s=out[stall]), 1e-4)
    emit("calib", **out)
    sys.stdout.flush()
    os._exit(0)
