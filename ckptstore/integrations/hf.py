"""Hugging Face ``transformers.Trainer`` with a checkpoint every optimizer step.

    from ckptstore.hf import StoreCallback

    cb = StoreCallback("runs/gpt", policy="every-iteration", base_every=200)  # Checkpointer options
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_from())   # None on an empty store

:class:`StoreCallback` is a ``TrainerCallback`` that runs a :class:`~ckptstore.torch.Checkpointer`
beside the Trainer's own loop. The Trainer applies the optimizer step itself, so the callback
uses the Checkpointer's two-phase step: ``on_pre_optimizer_step`` (gradients final, clipped) calls
:meth:`~ckptstore.torch.Checkpointer.before_step` with iteration ``global_step + 1``, and
``on_step_end`` (after ``optimizer.step()``, ``lr_scheduler.step()`` and ``zero_grad()``) calls
:meth:`~ckptstore.torch.Checkpointer.after_step`: iteration *t* of the store is the Trainer's
global step *t*, with an exact gradient delta (or a base when due), so ``store.load(t)`` equals
the Trainer's model, optimizer and scheduler after step *t*. Gradient accumulation needs nothing:
the optimizer steps once per accumulated step and the capture hooks keep the accumulated gradient.
That is ``policy="every-iteration"``; without a ``policy`` the Checkpointer's default applies
("auto": measured costs plan deltas or snapshots within a disk budget, on any number of
ranks).

Every record's meta holds ``{"hf": {"v": 1, "trainer_state": ..., "log": [...], "log_n": n}}``:
the ``TrainerState`` as ``trainer_state.json`` holds it (global_step, epoch, total_flos, best_*,
...) without ``log_history``; ``log`` the ``log_history`` entries appended since the previous
record, ``log_n`` the length of ``log_history``. The whole ``log_history`` is in the meta of
every base snapshot, of the first record of a ``train()`` call and of the first record after a
failed one, so :meth:`StoreCallback.resume_from` rebuilds it from the metas of one chain.

Resuming: :meth:`StoreCallback.resume_from` loads iteration *t* (default: the latest) from the store
once, and writes a directory for ``Trainer.train(resume_from_checkpoint=...)`` holding
``trainer_state.json`` (from the meta) and ``model.safetensors`` (the weights of *t*): the Trainer
restores its state, skips the batches already trained and loads the weights as it does for its
own checkpoints. There is no ``optimizer.pt``, ``scheduler.pt`` or ``rng_state.pth`` in it, so
the Trainer leaves those alone (nothing is pickled); ``on_train_begin`` loads optimizer and
scheduler states from the state already read, and the RNG states are set where the Trainer sets
its own on resume: before the epoch's data loader starts when *t* ended an epoch, else just
before the first step's forward pass.

Several processes (DDP through accelerate, e.g. ``torchrun --nproc-per-node N train.py``): the
same code on every rank. The Trainer starts torch.distributed; the callback then opens the store
on every rank, collectively, as a multi-rank job store over the default process group
(format-spec/format.md §22): each rank writes its part of every step's record (the
Checkpointer's partition) and a step is visible once every rank's part is durable (the global
commit). Call sequence on every rank:

1. ``cb = StoreCallback(path, ...)``; ``trainer = Trainer(..., callbacks=[cb])`` (starts
   torch.distributed);
2. ``cb.resume_from()``: opens the job store (collective) and reads iteration *t*: at the world
   size that wrote it each rank replays its own part and the ranks exchange parts, at another
   one every rank merges every part; each rank keeps its own RNG states;
3. ``trainer.train(resume_from_checkpoint=...)``: every rank restores, and every step is one
   collective record; ``on_train_end`` flushes and closes, collectively.

A single process without torch.distributed cannot write a job store, and a job of several
ranks cannot write a single-writer store (ValueError, nothing opened).

``transformers`` is imported by this module, never by ``import ckptstore``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

import torch

from ..errors import NotFoundError
from ..multirank.job_store import JobStore
from ..store import Store
from .store_ref import StoreRef
from ..torch.checkpointer import Checkpointer
from ..torch.live_state import capture_rng, restore_rng
from ..torch.dp_restore import can_load_in_parallel, load_in_parallel

try:
    from safetensors.torch import save_file
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("ckptstore.hf needs transformers: pip install 'ckptstore[hf]'") from e

__all__ = ["StoreCallback", "META_KEY"]

#: the key of the callback's entry in each record's meta
META_KEY = "hf"
META_VERSION = 1

log = logging.getLogger("ckptstore")


class StoreCallback(TrainerCallback):
    """Per-iteration checkpoints of a ``transformers.Trainer`` in a ckptstore store.

    ``store``: a path (opened for writing when first needed and closed at the end of training)
    or an open writable :class:`~ckptstore.Store` or :class:`~ckptstore.JobStore` (left open).
    A path is opened with ``ckptstore.open(path, "a")`` by a single process, and as a multi-rank
    job store by every rank of a job of several processes (DDP through accelerate: the Trainer
    initializes torch.distributed, whose default group opens it, collectively, on every rank;
    ``commit_timeout`` bounds how long a rank waits for the others, default the job store's).
    ``checkpointer_options``: passed to :class:`~ckptstore.torch.Checkpointer` (``base_every``,
    ``codec``, ``group_commit``, ``group_seconds``, ``fingerprint_every``, ``asynchronous``,
    ``capture``, ``on_failure``, ...). On a job store of several ranks ``capture`` defaults to
    "step": DDP all-reduces the gradients in place after the capture hooks ran, so a hook's copy
    would be made again at the step anyway.

    Several processes: every rank constructs the callback with the same arguments and calls
    :meth:`resume_from` (the same iteration) and ``train()``; each rank writes its part of every
    iteration (the Checkpointer's partition) and iteration *t* is visible once every rank's part
    is durable (the job store's global commit). A rank whose record fails makes every rank's
    next step raise (GlobalCommitAbortedError naming that rank and its error); a rank that dies
    makes the others raise RankFailureError, or torch's own error from DDP's all-reduce,
    whichever collective meets it first.

    Refused at ``on_train_begin`` (ValueError): a single-writer :class:`~ckptstore.Store` handed
    in while ``args.world_size > 1``, ``fp16`` (its GradScaler skips steps whose gradients
    overflow; the record would say the step was applied), and a store holding iterations at or
    after the Trainer's starting step without :meth:`resume_from`. An optimizer the Checkpointer
    cannot replay gets async snapshots instead of deltas (the Checkpointer's default ``policy``,
    or "auto"; ``policy="every-iteration"`` refuses it with
    UnreplayableOptimizerError); the Trainer's default ``adamw_torch_fused`` and ``adamw_torch``
    are torch.optim.AdamW, which it replays.
    """

    def __init__(self, store: str | os.PathLike | Store | JobStore, *,
                 commit_timeout: float | None = None, **checkpointer_options: Any) -> None:
        self._ref = StoreRef(store, "StoreCallback")
        self._path = self._ref.path
        self._open_options = {} if commit_timeout is None else {"commit_timeout": commit_timeout}
        self.options = checkpointer_options
        #: the Checkpointer of the running ``train()`` call (None outside one)
        self.checkpointer: Checkpointer | None = None
        # resume_from(): (iteration, the state read, the directory written)
        self._resume: tuple[int, dict, str] | None = None
        self._rng_at: str | None = None  # "epoch" | "step": where the resumed RNG states go
        self._rng: dict | None = None
        self._logged = 0  # entries of state.log_history already in a record's meta
        self._full_log = True  # the next record's meta holds the whole log_history

    # ---- the store ----------------------------------------------------------------------------
    @property
    def store(self) -> Store | JobStore | None:
        """The store while it is open (None before the first use of a path, and after close)."""
        return self._ref.store

    def _store(self) -> Store | JobStore:
        """The writer (collective on every rank when it opens a job store)."""
        return self._ref.writer(distributed=True, **self._open_options)

    def close(self) -> None:
        """Commit what is pending, drop the Checkpointer and close the store if this callback
        opened it (done at the end of every ``train()``; call it after a failed one)."""
        ckpt, self.checkpointer = self.checkpointer, None
        try:
            if ckpt is not None:
                try:
                    ckpt.flush()
                finally:
                    ckpt.close()
        finally:
            self._drop_resume_dir()
            self._ref.close()

    # ---- resume -------------------------------------------------------------------------------
    def resume_from(self, iteration: int | None = None, directory: str | os.PathLike | None = None
                    ) -> str | None:
        """Prepare a resume from ``iteration`` (default: the latest) of the store and return the
        directory to pass as ``Trainer.train(resume_from_checkpoint=...)``; None when the store is
        empty (train from scratch). Reads the iteration once (a delta is replayed) and keeps it
        for ``on_train_begin``. ``directory`` (default: a new temporary one): where
        ``trainer_state.json`` and ``model.safetensors`` are written; it is removed once the
        Trainer has read it (``on_train_begin``). Raises NotFoundError for an iteration not in the
        store, ValueError when its meta was not written by this callback; training on from an
        iteration below the newest one is refused at ``on_train_begin`` (ValueError).

        Several processes: call it on every rank after the Trainer is constructed (which starts
        torch.distributed): it opens the job store collectively; at the world size that wrote
        the iteration each rank replays its own part and the ranks exchange parts, at another
        world size every rank merges every part (elastic); each rank restores its own RNG
        states (a rank the iteration's job did not have gets rank 0's)."""
        store = self._store()
        its = store.iterations()
        if not its:
            return None
        t = its[-1] if iteration is None else iteration
        if t not in its:
            raise NotFoundError(f"iteration {t} is not in {store.path}")
        meta = _meta_of(store, t)
        entry = meta.get(META_KEY) if isinstance(meta, dict) else None
        if not isinstance(entry, dict) or "trainer_state" not in entry:
            raise ValueError(f"iteration {t} of {store.path} was not written by "
                             "ckptstore.hf.StoreCallback (its meta has no trainer state)")
        trainer_state = dict(entry["trainer_state"], log_history=self._log_history(store, t))
        # (a job store at the world size that wrote t: each rank replays its part, then exchange)
        state = load_in_parallel(store, t) if isinstance(store, JobStore) and \
            can_load_in_parallel(store, t) else store.load(t)
        self._drop_resume_dir()
        out = tempfile.mkdtemp(prefix="ckptstore-hf-") if directory is None else os.fspath(directory)
        os.makedirs(out, exist_ok=True)
        weights = {k: v.detach().contiguous() for k, v in state["model"].items()
                   if isinstance(v, torch.Tensor)}
        save_file(_unshared(weights), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "trainer_state.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
        self._resume = (t, state, out)
        return out

    def _log_history(self, store: Store | JobStore, t: int) -> list:
        """``log_history`` as of iteration ``t``: the ``log`` pieces of ``t``, ``t - 1``, ...
        back to the newest meta holding the whole history (a base, or a first record)."""
        pieces: list[list] = []
        it = t
        expected = None
        while True:
            try:
                meta = _meta_of(store, it)
            except Exception:  # noqa: BLE001 - missing (gc) or unreadable: the history stops here
                meta = None
            entry = meta.get(META_KEY) if isinstance(meta, dict) else None
            if not isinstance(entry, dict):
                log.warning("ckptstore.hf: log_history of iteration %d is incomplete: iteration "
                            "%d has no StoreCallback meta", t, it)
                break
            if expected is None:
                expected = entry.get("log_n")
            if "log_history" in entry:
                pieces.append(list(entry["log_history"]))
                break
            pieces.append(list(entry.get("log", [])))
            if it == 0:
                break
            it -= 1
        history = [e for piece in reversed(pieces) for e in piece]
        if expected is not None and len(history) != expected:
            log.warning("ckptstore.hf: rebuilt %d log_history entries for iteration %d, its meta "
                        "counts %d", len(history), t, expected)
        return history

    def _drop_resume_dir(self) -> None:
        if self._resume is not None:
            shutil.rmtree(self._resume[2], ignore_errors=True)
            self._resume = None

    # ---- meta ---------------------------------------------------------------------------------
    def _meta(self, state: Any, full: bool) -> dict:
        ts = dataclasses.asdict(state)
        history = ts.pop("log_history") or []
        entry: dict[str, Any] = {"v": META_VERSION,
                                 "trainer_state": json.loads(json.dumps(ts)),
                                 "log": json.loads(json.dumps(history[self._logged:])),
                                 "log_n": len(history)}
        if full:
            entry["log_history"] = json.loads(json.dumps(history))
        return {META_KEY: entry}

    # ---- Trainer events -----------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                       **kwargs):
        if getattr(args, "fp16", False):
            raise ValueError("ckptstore.hf.StoreCallback does not support fp16: its GradScaler "
                             "skips steps whose gradients overflow, which a record cannot express")
        if model is None or optimizer is None:
            raise ValueError("ckptstore.hf.StoreCallback: the Trainer gave no model or optimizer")
        inner = optimizer
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer  # accelerate's AcceleratedOptimizer (an Optimizer itself)
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None
        store = self._store()
        world = getattr(args, "world_size", 1)
        if world > 1 and not isinstance(store, JobStore):
            raise ValueError(f"ckptstore.hf.StoreCallback: args.world_size is {world} and "
                             f"{store.path} is a single-writer store: pass a path (every rank "
                             "opens it as a multi-rank job store) or a JobStore opened on "
                             "every rank")
        ranks = store.group.world_size if isinstance(store, JobStore) and store.group else 1
        if isinstance(store, JobStore) and ranks != world:
            raise ValueError(f"ckptstore.hf.StoreCallback: args.world_size is {world} but the job "
                             f"store {store.path} was opened by {ranks} ranks")
        latest = store.latest()
        resume, self._resume = self._resume, None
        g = state.global_step
        if resume is not None:
            t, loaded, directory = resume
            shutil.rmtree(directory, ignore_errors=True)  # the Trainer has read it
            if g != t:
                raise ValueError(f"StoreCallback.resume_from() prepared iteration {t} but the Trainer "
                                 f"starts at global step {g}: pass trainer.train("
                                 "resume_from_checkpoint=callback.resume_from())")
            if latest is not None and latest > t:
                raise ValueError(f"{store.path} holds iterations up to {latest}: training on from "
                                 f"iteration {t} would write them again (iterations only "
                                 "increase); train on from an older iteration into another store")
        elif latest is not None and latest >= g:
            raise ValueError(f"{store.path} holds iterations up to {latest} and the Trainer starts "
                             f"at global step {g}: resume with trainer.train(resume_from_checkpoint="
                             "callback.resume_from()), or use an empty store")
        options = dict(self.options)
        if ranks > 1:
            options.setdefault("capture", "step")  # (DDP changes the gradients after the hooks)
        ckpt = Checkpointer(store, model, inner, lr_scheduler, **options)
        self.checkpointer = ckpt
        self._full_log = True
        if resume is not None:
            ckpt.restore(resume[0], state=resume[1])
            self._rng = capture_rng()  # the restored states, set again below where they belong
            self._rng_at = "epoch" if float(state.epoch or 0).is_integer() else "step"
            self._logged = len(state.log_history)
            return
        # the live state (initial, or what the Trainer resumed from its own checkpoint) starts
        # the chain: a base snapshot at the starting step
        self._logged = 0
        fut = ckpt.save_base(g, meta=self._meta(state, full=True))
        if ckpt.asynchronous:
            fut.result()
        self._logged = len(state.log_history)
        self._full_log = False
        self._rng_at = None

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self._rng_at == "epoch":
            self._set_rng()

    def on_step_begin(self, args, state, control, **kwargs):
        if self._rng_at is not None:
            self._set_rng()

    def _set_rng(self) -> None:
        assert self._rng is not None
        restore_rng(self._rng)
        self._rng, self._rng_at = None, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        assert self.checkpointer is not None, "on_pre_optimizer_step before on_train_begin"
        self.checkpointer.before_step(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        ckpt = self.checkpointer
        assert ckpt is not None, "on_step_end before on_train_begin"
        t = state.global_step
        meta = self._meta(state, full=self._full_log or ckpt.base_due(t))
        result = ckpt.after_step(meta)
        self._logged = meta[META_KEY]["log_n"]
        # a lost record (the "retry" failure policy) restarts the chain with a base without
        # meta: the next record carries the whole log_history
        self._full_log = result is None

    def on_train_end(self, args, state, control, **kwargs):
        self.close()


def _meta_of(store: Store | JobStore, iteration: int) -> Any:
    """The meta of ``iteration``: on a job store this rank's, or rank 0's when the job that
    wrote it had fewer ranks (a resume at a larger world size)."""
    if isinstance(store, JobStore) and store.rank is not None and \
            store.rank >= store.global_commit(iteration).world_size:
        return store.meta(iteration, rank=0)
    return store.meta(iteration)


def _unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied weights): copy all but the first."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for k, v in weights.items():
        key = (v.untyped_storage().data_ptr(), int(v.storage_offset()))
        out[k] = v.clone() if key in seen else v
        seen.add(key)
    return out
