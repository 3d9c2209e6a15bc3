"""Which parameters a Checkpointer logs, in what order, and which of them this rank writes.

Built once per Checkpointer (:class:`ParamLayout`), from the optimizer's parameter groups (their
names in the model), the store (a multi-rank job store: this rank and the world size) and the
``partition`` argument:

1. the optimizer's parameters, group by group, named as in ``model.named_parameters()``;
2. data parallelism over several ranks: a balanced partition of whole parameters
   (:class:`ckptstore.replay.partition.Partition`; format-spec/deltas.md, "Partitioned states");
   FSDP2 / DTensor parameters: each rank its local shards, a box several ranks hold written by one
   of them (:func:`ckptstore.torch.sharded.replicas_of`; "Sharded states");
3. tied entries of the model's state dict (another name of one of the parameters);
4. ``owned[i]``: whether this rank writes parameter ``i``.

Invariant: every rank of a job computes the same layout (ties and owners are structural).
"""

from __future__ import annotations

from typing import Any

import torch

from ..multirank.job_store import JobStore
from ..replay.partition import Partition
from ..replay.shards import is_dtensor, local
from .live_state import tensor_bytes
from .sharded import check_meshes, replicas_of


def storage_key(v: torch.Tensor) -> tuple | None:
    """What two tied entries share: the (local, for a DTensor) storage address, shape and dtype.
    None for an empty DTensor shard (its address says nothing: ties are then found by identity)."""
    t = local(v)
    if is_dtensor(v) and t.numel() == 0:
        return None
    return (t.data_ptr(), tuple(t.shape), t.dtype, is_dtensor(v))


def tied_entries(model: torch.nn.Module, param_names: set[str]) -> dict[str, str]:
    """``{state_dict key: parameter name}`` for every model entry that is not one of the
    optimizer's parameters but is one of them under another name (a tied weight: the same object,
    or the same storage, shape and dtype; for a DTensor, of its local shard). The same on every
    rank: ties are structural."""
    by_id: dict[int, str] = {}
    by_key: dict[tuple, str] = {}
    for n, p in model.named_parameters():  # (a tied parameter once, under its first name)
        by_id[id(p)] = n
        key = storage_key(p)
        if key is not None:
            by_key[key] = n
    out: dict[str, str] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if k in param_names or not isinstance(v, torch.Tensor):
            continue
        key = storage_key(v)
        tie = by_id.get(id(v)) or (by_key.get(key) if key is not None else None)
        if tie is not None and tie in param_names:
            out[k] = tie
    return out


class ParamLayout:
    """The parameters of ``optimizer`` (all in ``model``) as the Checkpointer logs them, and which
    this rank writes on ``store`` (see the module docstring). ValueError for a parameter not in
    the model, for ``partition=True`` with DTensor parameters, and for DTensor parameters over
    several ranks without a job store; RankMismatchError for a mesh that is not the job store's."""

    def __init__(self, store: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 partition: bool | None) -> None:
        job = isinstance(store, JobStore)
        names = {id(p): n for n, p in model.named_parameters()}
        #: the parameter names of each optimizer group, and the parameters, in the same order
        self.groups: list[list[str]] = []
        self.params: list[torch.nn.Parameter] = []
        for g in optimizer.param_groups:
            gn = []
            for p in g["params"]:
                if id(p) not in names:
                    raise ValueError("the optimizer holds a parameter that is not in the model")
                gn.append(names[id(p)])
                self.params.append(p)
            self.groups.append(gn)
        #: the parameter names in optimizer order (``names[i]`` is ``params[i]``'s)
        self.names = [n for gn in self.groups for n in gn]
        self.param_names = set(self.names)
        #: data parallelism on a multi-rank store: the parameters this rank writes (replay/partition.py)
        self.partition: Partition | None = None
        self.rank = 0
        self.world = store.world_size if job and store.world_size else 1
        #: FSDP2 / DTensor parameters: every rank writes its local shards (replay/shards.py)
        self.sharded = any(is_dtensor(p) for p in self.params)
        if self.sharded:
            if partition:
                raise ValueError("partition=True: sharded (DTensor) parameters are written as "
                                 "each rank's local shards, not partitioned")
            dts: list[Any] = [p for p in self.params if is_dtensor(p)]
            meshes = [p.device_mesh for p in dts]
            if not job and any(m.size() > 1 for m in meshes):
                raise ValueError("sharded (DTensor) parameters over several ranks need a multi-rank "
                                 "job store (ckptstore.open(path, process_group=...)) on every rank")
            if job:
                assert store.rank is not None
                self.rank = store.rank
                check_meshes(store, [n for n, p in zip(self.names, self.params) if is_dtensor(p)],
                             dts)
        elif job and store.world_size > 1 and partition is not False:
            assert store.rank is not None and store.world_size is not None
            self.rank = store.rank
            self.partition = Partition.balanced(
                [(n, p.numel() * p.element_size()) for n, p in zip(self.names, self.params)],
                store.world_size)
        #: tied entries: {state_dict key: the parameter it is} (plain tensors and DTensors)
        self.aliases = tied_entries(model, self.param_names)
        #: sharded parameters whose box other ranks hold too: {name: the rank that writes it}
        self.replicas: dict[str, int] = {}
        if self.sharded and job and self.world > 1 and partition is not False:
            self.replicas = replicas_of(store, self.names, self.params, self.rank, self.world)
        #: whether this rank writes parameter ``i``
        self.owned = [(self.partition is None or self.partition.owner[n] == self.rank)
                      and self.replicas.get(n, self.rank) == self.rank for n in self.names]
        dev = {p.device.type for p in self.params}
        #: the parameters' device type, or "mixed"
        self.device = dev.pop() if len(dev) == 1 else "mixed"
        #: ``{id(parameter): its position}``
        self.index = {id(p): i for i, p in enumerate(self.params)}

    def grad_bytes(self) -> int:
        """The bytes of the gradients this rank writes in a delta (its parameters', local shards
        of sharded ones), at the parameters' dtypes."""
        return sum(tensor_bytes(local(p)) for p, mine in zip(self.params, self.owned)
                   if mine and p.requires_grad)
