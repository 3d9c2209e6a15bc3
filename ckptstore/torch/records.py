"""What a Checkpointer's records hold (format-spec/deltas.md): a base snapshot's state (the live
model, optimizer, scheduler and RNG states with the replay section) and a delta record (the
gradients as applied through the codec, hyperparameters, scheduler and RNG states, non-parameter
model state, fingerprints), each cut to this rank's share (:class:`ParamLayout`).

Call sequence of a delta step (:class:`RecordBuilder`): before ``optimizer.step()``,
``capture_rng()``, ``hyperparameters(optimizer)`` and :meth:`RecordBuilder.encode_grads` (then
:meth:`RecordBuilder.own_payloads` when the caller may free the gradients before the record is
built); after it (and ``scheduler.step()``), :meth:`RecordBuilder.delta_record`. Nothing here
writes to a store.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..format.delta import REPLAY_KEY, REPLAY_VERSION
from ..replay.gradcodecs import GradCodec
from ..replay.partition import split_state
from ..replay.fingerprints import fingerprint, fingerprint_digest
from ..replay.shards import local, localize
from .plan_history import PLAN_KEY
from .live_state import capture_rng, hyperparameters, json_defaults, plain_counters
from .param_layout import ParamLayout


class RecordBuilder:
    """Builds the records of ``model`` + ``optimizer`` (+ ``scheduler``) laid out by ``layout``.
    ``codec``: the gradient codec; ``apply_decoded``: with a lossy codec, the decoded gradient
    replaces ``p.grad`` (training applies what is logged); ``fingerprint_every``: a parameter
    fingerprint in every k-th delta (0: never)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 layout: ParamLayout, codec: GradCodec, apply_decoded: bool,
                 fingerprint_every: int) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.layout = layout
        self.codec = codec
        self.apply_decoded = apply_decoded
        self.fingerprint_every = fingerprint_every

    def replay_info(self) -> dict:
        """A base's replay section: what replaying its deltas needs to know."""
        lay = self.layout
        return {"v": REPLAY_VERSION, "optimizer": type(self.optimizer).__name__,
                "defaults": json_defaults(self.optimizer.defaults), "groups": lay.groups,
                "aliases": lay.aliases, "codec": self.codec.name, "device": lay.device,
                "torch": str(torch.__version__), "scheduler": self.scheduler is not None}

    def base_state(self, iteration: int, persisted_plan: dict | None) -> dict:
        """The live state as base snapshot ``iteration`` (this rank's share of it), carrying
        ``persisted_plan`` (the planner's inputs; on several ranks the same on each)."""
        st: dict[str, Any] = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scheduler is not None:
            st["scheduler"] = plain_counters(self.scheduler.state_dict())
        st["rng"] = capture_rng()
        st["iteration"] = iteration
        st[REPLAY_KEY] = self.replay_info()
        lay = self.layout
        if persisted_plan is not None:
            st[PLAN_KEY] = persisted_plan  # (several ranks: the same on each, plan_agreement.py)
        if lay.partition is not None:
            return split_state(st, lay.partition, lay.rank)
        if lay.sharded:
            return localize(st, lay.rank, lay.world, lay.replicas)
        return st

    def changed_only_by_step(self) -> Callable[[Any], bool]:
        """Whether a tensor shares memory with what only ``optimizer.step()`` changes: the
        parameters (local shards) and the optimizer state's tensors, less anything that shares
        memory with a model buffer (a forward in training mode updates buffers). An overlapped
        base copies these while the next forward and backward run (step_writer.py, step 4)."""
        ptrs = {local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        for per_param in self.optimizer.state.values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor):
                    ptrs.add(local(v).untyped_storage().data_ptr())
        ptrs -= {local(b).untyped_storage().data_ptr() for b in self.model.buffers()}
        return lambda t: isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in ptrs

    def encode_grads(self) -> tuple[list[Any], dict[str, Any]]:
        """Every parameter's gradient through the codec (None where a parameter has none), and
        the encoding error the record states for a lossy codec. With ``apply_decoded`` the
        decoded gradient replaces ``p.grad``, so training applies exactly what is logged."""
        grads: list[Any] = []
        max_err: list[float] = []
        err_l2 = g_l2 = 0.0
        lay = self.layout
        todo = [g if g is not None and (owned or self.apply_decoded and self.codec.lossy) else None
                for g, owned in ((local(p.grad), owned) for p, owned in zip(lay.params, lay.owned))]
        for grad, encoded in zip(todo, self.codec.encode_many(todo, self.apply_decoded)):
            if grad is None or encoded is None:
                grads.append(None)  # (not owned: dropped from the record below)
                max_err.append(0.0)
                continue
            payload, dec, st = encoded
            grads.append(payload)
            if st is not None:
                max_err.append(st.max_abs_error)
                err_l2 += st.l2_error ** 2
                g_l2 += st.l2_grad ** 2
                if self.apply_decoded:
                    assert dec is not None  # a lossy codec asked for its decode returns it
                    grad.copy_(dec)
            else:
                max_err.append(0.0)
        return grads, {"max_abs": max_err, "l2": err_l2 ** 0.5, "grad_l2": g_l2 ** 0.5}

    def own_payloads(self, grads: list[Any]) -> list[Any]:
        """``grads`` (payloads from :meth:`encode_grads`) with every tensor that shares memory
        with its parameter's live gradient copied (the exact codec's payload is the gradient)."""
        out: list[Any] = []
        for p, payload in zip(self.layout.params, grads):
            g = local(p.grad)
            if payload is not None and g is not None:
                ptr = g.untyped_storage().data_ptr()
                payload = {k: v.clone() if isinstance(v, torch.Tensor) and
                           v.untyped_storage().data_ptr() == ptr else v for k, v in payload.items()}
            out.append(payload)
        return out

    def delta_record(self, iteration: int, grads: list[Any], hyper: list[dict], rng: Any,
                     err: dict[str, Any]) -> dict[str, Any]:
        """The delta record of ``iteration`` (format-spec/deltas.md), built after
        ``optimizer.step()`` and ``scheduler.step()``: ``hyper`` and ``rng`` were taken before."""
        lay = self.layout
        if not all(lay.owned):  # a partition, or replicated shards other ranks write
            grads = [g for g, owned in zip(grads, lay.owned) if owned]
            if self.codec.lossy:
                err = dict(err, max_abs=[e for e, owned in zip(err["max_abs"], lay.owned) if owned])
        record: dict[str, Any] = {
            "v": REPLAY_VERSION, "codec": self.codec.name, "lossy": self.codec.lossy,
            "applied": self.apply_decoded and self.codec.lossy, "grads": grads, "hyper": hyper,
            "groups": hyperparameters(self.optimizer),
            "rng": rng,
            "buffers": {k: local(v) for k, v in self.model.state_dict().items()
                        if k not in lay.param_names and k not in lay.aliases},
        }
        if self.scheduler is not None:
            record["scheduler"] = plain_counters(self.scheduler.state_dict())
        if self.codec.lossy:
            record["err"] = err
        if self.fingerprint_every and iteration % self.fingerprint_every == 0:
            # the norm serves only replays that cannot compare bits (deltas.md, "fp")
            params = [local(p) for p, owned in zip(lay.params, lay.owned) if owned]
            if self.codec.lossy or lay.device != "cpu":
                digest, norm = fingerprint(params)
                record["fp"] = {"xxh3": digest, "norm": norm}
            else:
                record["fp"] = {"xxh3": fingerprint_digest(params)}
        return record
