"""The Checkpointer: a checkpoint every iteration for the price of its gradients.

    ckpt = Checkpointer(store, model, optimizer, scheduler, base_every=200, codec="exact")
    start = ckpt.restore()
    for it in range(start + 1, n + 1):
        loss = model(batch(it)).loss; loss.backward()
        ckpt.step(it, meta={"loss": loss.item()})   # optimizer.step(), scheduler.step(), logging
        optimizer.zero_grad()

``step(it)`` calls ``optimizer.step()`` and ``scheduler.step()`` itself, then appends the delta
record of iteration ``it`` (gradients as applied, hyperparameters, scheduler and RNG states,
non-parameter model state, meta) or, when due, a base snapshot. Deltas are group-committed: one
fsync pair per ``group_commit`` deltas or ``group_seconds`` seconds, whichever comes first (checked at
each step); ``store.durable_iteration()`` says what survives a crash now.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import torch

from ..errors import DeltaChainError, NotFoundError
from ..gradcodecs import parse_codec
from ..replay import OPTIMIZER_NAMES, REPLAY_KEY, REPLAY_VERSION, fingerprint


def capture_rng() -> dict:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                           "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _json_defaults(defaults: dict) -> dict:
    return {k: v for k, v in defaults.items()
            if v is None or type(v) in (bool, int, float, str, tuple)}


class Checkpointer:
    """Per-iteration checkpoints of ``model`` + ``optimizer`` (+ ``scheduler``) in ``store``.

    ``base_every``: an int (a base snapshot every that many iterations) or "auto" (chosen from the
    measured base-write and per-delta replay costs so the worst-case recovery time, base load plus
    replay of every delta since, stays under ``target_recovery_s``).
    ``codec``: "exact" | "bf16" | "fp16" | "topk:F" | "int8" (ckptstore.gradcodecs).
    ``apply_decoded``: with a lossy codec, train on the decoded gradient (it is copied into
    ``p.grad`` before ``optimizer.step()``), so replay is exact again.
    ``fingerprint_every``: record an xxh3 fingerprint of the parameters every k iterations (0: never);
    replay checks it and raises ReplayDivergenceError on a mismatch.
    """

    def __init__(self, store, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, *, base_every: int | str = 200, codec: str = "exact",
                 apply_decoded: bool = False, group_commit: int = 1, group_seconds: float | None = None,
                 fingerprint_every: int = 10, target_recovery_s: float = 30.0) -> None:
        if type(optimizer).__name__ not in OPTIMIZER_NAMES or \
                type(optimizer) is not getattr(torch.optim, type(optimizer).__name__):
            raise TypeError(f"optimizer {type(optimizer).__qualname__} is not replayable; supported: "
                            f"{', '.join('torch.optim.' + n for n in OPTIMIZER_NAMES)}")
        if base_every != "auto" and (type(base_every) is not int or base_every < 1):
            raise ValueError('base_every must be a positive int or "auto"')
        if type(group_commit) is not int or group_commit < 1:
            raise ValueError("group_commit must be a positive int")
        self.store = store
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.codec = parse_codec(codec)
        self.apply_decoded = bool(apply_decoded)
        self.base_every = base_every
        self.group_commit = group_commit
        self.group_seconds = group_seconds
        self.fingerprint_every = fingerprint_every
        self.target_recovery_s = target_recovery_s
        names = {id(p): n for n, p in model.named_parameters()}
        self._groups: list[list[str]] = []
        self._params: list[torch.nn.Parameter] = []
        for g in optimizer.param_groups:
            gn = []
            for p in g["params"]:
                if id(p) not in names:
                    raise ValueError("the optimizer holds a parameter that is not in the model")
                gn.append(names[id(p)])
                self._params.append(p)
            self._groups.append(gn)
        self._param_names = {n for gn in self._groups for n in gn}
        sd = model.state_dict(keep_vars=True)
        by_ptr = {(p.data_ptr(), tuple(p.shape), p.dtype): n for n, p in model.named_parameters()}
        self._aliases = {k: by_ptr[(v.data_ptr(), tuple(v.shape), v.dtype)] for k, v in sd.items()
                         if k not in self._param_names and isinstance(v, torch.Tensor)
                         and (v.data_ptr(), tuple(v.shape), v.dtype) in by_ptr
                         and by_ptr[(v.data_ptr(), tuple(v.shape), v.dtype)] in self._param_names}
        dev = {p.device.type for p in self._params}
        self._device = dev.pop() if len(dev) == 1 else "mixed"
        self._last: int | None = None
        self._base: int | None = None
        # cost model for base_every="auto" (exponential moving averages, seconds)
        self._base_cost: float | None = None
        self._delta_cost: float | None = None
        self.last_stats = None

    # ---- state ----------------------------------------------------------------------------
    def _replay_info(self) -> dict:
        return {"v": REPLAY_VERSION, "optimizer": type(self.optimizer).__name__,
                "defaults": _json_defaults(self.optimizer.defaults), "groups": self._groups,
                "aliases": self._aliases, "codec": self.codec.name, "device": self._device,
                "torch": str(torch.__version__), "scheduler": self.scheduler is not None}

    def state(self, iteration: int) -> dict:
        st: dict[str, Any] = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scheduler is not None:
            st["scheduler"] = self.scheduler.state_dict()
        st["rng"] = capture_rng()
        st["iteration"] = iteration
        st[REPLAY_KEY] = self._replay_info()
        return st

    def save_base(self, iteration: int, meta: dict | None = None):
        """Write a base snapshot of the live state as ``iteration`` (flushes pending deltas)."""
        t0 = time.perf_counter()
        stats = self.store.save(iteration, self.state(iteration), meta=meta)
        self._ema("_base_cost", time.perf_counter() - t0)
        self._last = self._base = iteration
        return stats

    def restore(self, iteration: int | None = None) -> int:
        """Load ``iteration`` (default: the latest recoverable one) into the live model, optimizer,
        scheduler and RNGs and return its number. On an empty store, write the live (initial)
        state as base snapshot 0 and return 0."""
        self.store.flush() if self.store.pending() else None
        its = self.store.iterations()
        if not its:
            if iteration not in (None, 0):
                raise NotFoundError(f"iteration {iteration} is not in the empty store {self.store.path}")
            self.save_base(0)
            return 0
        target = its[-1] if iteration is None else iteration
        state = self.store.load(target)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        restore_rng(state["rng"])
        self._last = target
        self._base = self.store.base_of(target)
        return target

    # ---- training ---------------------------------------------------------------------------
    def interval(self) -> int:
        """The current base interval (fixed, or chosen from measured costs for "auto")."""
        if self.base_every != "auto":
            return self.base_every
        if self._base_cost is None or not self._delta_cost:
            return 50
        # worst-case recovery ~ base load (~ base write) + interval * per-delta replay
        n = int((self.target_recovery_s - self._base_cost) / self._delta_cost)
        return max(1, min(n, 100_000))

    def _ema(self, attr: str, v: float) -> None:
        old = getattr(self, attr)
        setattr(self, attr, v if old is None else 0.8 * old + 0.2 * v)

    def step(self, iteration: int, meta: dict | None = None):
        """Apply the optimizer step for ``iteration`` (gradients must be in ``p.grad``), step the
        scheduler, and log the iteration: a delta record, or a base snapshot when due."""
        if self._last is None:
            latest = self.store.latest()
            if latest is None:
                self.save_base(iteration - 1)  # the state before this step starts the chain
            else:
                self._last, self._base = latest, self.store.base_of(latest)
        if iteration != self._last + 1:
            raise DeltaChainError(f"Checkpointer.step({iteration}): the last logged iteration is "
                                  f"{self._last}; iterations must follow each other")
        pending = self.store.pending()
        top = pending[-1] if pending else self.store.index.latest()
        if top is not None and top >= iteration:
            # checked before optimizer.step(): a refused step leaves the live objects untouched
            raise DeltaChainError(f"Checkpointer.step({iteration}): {self.store.path} already holds "
                                  f"iteration {top} (restored {self._last}); iterations must increase")
        t0 = time.perf_counter()
        rng = capture_rng()
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        grads: list[Any] = []
        max_err: list[float] = []
        err_l2 = g_l2 = 0.0
        for p in self._params:
            if p.grad is None:
                grads.append(None)
                max_err.append(0.0)
                continue
            payload, dec, st = self.codec.encode_measured(p.grad)
            grads.append(payload)
            if st is not None:
                max_err.append(st.max_abs_error)
                err_l2 += st.l2_error ** 2
                g_l2 += st.l2_grad ** 2
                if self.apply_decoded:
                    p.grad.copy_(dec)
            else:
                max_err.append(0.0)
        t_step = time.perf_counter()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        t_step = time.perf_counter() - t_step
        due = iteration - (self._base if self._base is not None else 0) >= self.interval()
        if due:
            stats = self.save_base(iteration, meta)
        else:
            record: dict[str, Any] = {
                "v": REPLAY_VERSION, "codec": self.codec.name, "lossy": self.codec.lossy,
                "applied": self.apply_decoded and self.codec.lossy, "grads": grads, "hyper": hyper,
                "groups": [{k: v for k, v in g.items() if k != "params"}
                           for g in self.optimizer.param_groups],
                "rng": rng,
                "buffers": {k: v for k, v in self.model.state_dict().items()
                            if k not in self._param_names and k not in self._aliases},
            }
            if self.scheduler is not None:
                record["scheduler"] = self.scheduler.state_dict()
            if self.codec.lossy:
                record["err"] = {"max_abs": max_err, "l2": err_l2 ** 0.5, "grad_l2": g_l2 ** 0.5}
            if self.fingerprint_every and iteration % self.fingerprint_every == 0:
                digest, norm = fingerprint(self._params)
                record["fp"] = {"xxh3": digest, "norm": norm}
            stats = self.store.save_delta(iteration, record, meta, durable=False)
            self._last = iteration
            if len(self.store.pending()) >= self.group_commit or (
                    self.group_seconds is not None and self.store.pending_age() >= self.group_seconds):
                self.store.flush()
            # replaying a delta costs about its read (~ its write) plus the optimizer step
            self._ema("_delta_cost", time.perf_counter() - t0)
        self.last_stats = stats
        return stats

    def flush(self) -> int | None:
        """Commit pending deltas now; returns store.durable_iteration()."""
        return self.store.flush()
