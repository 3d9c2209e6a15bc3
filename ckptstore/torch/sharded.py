"""Restoring a sharded (FSDP2 / DTensor) Checkpointer state into live DTensor objects.

Call sequence (every rank, collective only through the store): ``state =
load_sharded(store, iteration, rank, world)``, then ``copy_into_live(state, model, optimizer,
params)``. At the world size that wrote ``iteration``, a rank reads (and replays) only its own
part, and the parts of the ranks that wrote the replicated boxes it left to them (a
``Replicate()`` mesh dimension: each box is written once, by its owner), completed into all of
its local shards (:func:`ckptstore.replay.shards.complete_part`), copied into the local shards
of the live parameters and optimizer state after checking that every box (global shape,
offsets, placements, mesh) is the live one. At another world size the job's state is assembled
whole from every rank's part (:func:`ckptstore.replay.shards.assemble_parts`) and each rank
copies its own box out of it. Which ranks own which replicated boxes (:func:`replicas_of`) is
computed alike on every rank, with no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import RankMismatchError, ShardLayoutError, UnsupportedTypeError
from ..multirank.job_store import JobStore
from ..replay.shards import (
    Holding,
    box_of,
    complete_part,
    donors_needed,
    holdings_of,
    is_dtensor,
    local,
    mesh_ranks,
    omitted,
    region,
    replica_owners,
    same_box,
    shards_of,
    state_box,
)


def check_meshes(store: JobStore, names: Sequence[str], params: Sequence[Any]) -> None:
    """Refuse DTensor parameters whose device mesh does not span exactly the ranks of the job
    store's process group (RankMismatchError naming the parameter and both rank sets): a part
    per store rank can only assemble whole tensors when the store's ranks are the mesh's (a
    store per replica group under a mesh over every rank would hold half of each tensor)."""
    import torch.distributed as dist

    group = store.group
    if group is None:
        return
    store_ranks = sorted(int(g) for g in dist.get_process_group_ranks(group.group))
    for n, p in zip(names, params):
        if not is_dtensor(p):
            continue
        if mesh_ranks(p) != store_ranks:
            raise RankMismatchError(f"{store.path}: parameter {n!r} is sharded over the device "
                                    f"mesh of global ranks {mesh_ranks(p)}, but the job store's "
                                    f"process group holds ranks {store_ranks}: open the store "
                                    "with the process group the mesh spans")


def replicas_of(store: JobStore, names: Sequence[str], params: Sequence[Any], rank: int,
                world: int) -> dict[str, int]:
    """``{parameter name: owner}`` for every DTensor parameter (``names``, ``params``: the
    optimizer's, in its order) whose box this ``rank`` holds together with other ranks of the
    job store (a ``Replicate()`` mesh dimension), the owner being the rank that writes it
    (:func:`ckptstore.replay.shards.assign_owners`). Computed from every parameter's global shape,
    mesh and placements, so every rank finds the same owners (no collective)."""
    import torch.distributed as dist

    group = store.group
    if group is None:
        return {}
    store_rank = {int(g): r for r, g in enumerate(dist.get_process_group_ranks(group.group))}
    holdings: list[Holding] = []
    for n, p in zip(names, params):
        found = holdings_of(n, p, store_rank) if is_dtensor(p) else None
        if found is None:
            continue
        mine = box_of(p)
        if not any(h.offsets == tuple(mine["offsets"]) and h.local == tuple(mine["local"])
                   and rank in h.ranks for h in found):
            raise UnsupportedTypeError(f"the shard of {n!r} on rank {rank} ({mine}) is not where "
                                       "its placements put it")
        holdings += found
    return replica_owners(holdings, world, rank)


def load_sharded(store: Any, iteration: int, rank: int, world: int) -> dict:
    """The state of ``iteration`` for ``rank`` of ``world``: its own part (replayed) when the
    iteration was written by ``world`` ranks, completed with the replicated entries it left to
    their owners from the owners' parts (only those parts are read), else the whole state
    assembled from every part. DamagedCheckpointError (naming the tensor) when an owner's part
    does not hold what this part left to it."""
    if isinstance(store, JobStore):
        if store.global_commit(iteration).world_size == world:
            own = store.load(iteration, rank=rank)
            return complete_part(own, {o: store.load(iteration, rank=o)
                                       for o in donors_needed(own)})
        return store.load(iteration)  # every part, assembled (JobStore.load)
    return store.load(iteration)


def copy_into_live(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   params: Sequence[torch.Tensor], names: Sequence[str], world: int) -> None:
    """Copy ``state`` (a sharded part of this rank, or a whole state) into the live model and
    optimizer, whose parameters may be DTensors. Raises ShardLayoutError, before changing
    anything, when a part's boxes are not the live ones. ``params``, ``names``: the optimizer's
    parameters and their model names, in optimizer order."""
    sec = shards_of(state)
    saved_world = int(sec["world"]) if sec is not None else world
    if sec is not None and saved_world != world:
        raise ShardLayoutError(f"the sharded state was written by {saved_world} ranks; it cannot "
                               f"be restored as the part of one of {world}",
                               saved_world=saved_world, world=world)
    gone = omitted(state)
    if sec is not None and gone:
        k, owner = next(iter(gone.items()))
        raise ShardLayoutError(f"the part of rank {sec['rank']} left {k!r} to rank {owner} (a "
                               "replica): complete it first (load_sharded)",
                               saved_world=saved_world, world=world, name=k)
    live = model.state_dict()
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live local destination, source)
    for k, dst in live.items():
        if k not in state["model"]:
            raise ShardLayoutError(f"the state holds no model entry {k!r}", saved_world=saved_world,
                                   world=world, name=k)
        plan.append((local(dst), _piece(state["model"][k], dst, sec["tensors"].get(k)
                                        if sec is not None else None, k, saved_world, world)))
    saved_opt = state["optimizer"]
    new_state: dict[int, Any] = {}
    for i, entry in saved_opt["state"].items():
        if not 0 <= int(i) < len(params):
            raise ShardLayoutError(f"the optimizer state names parameter {i}, the optimizer has "
                                   f"{len(params)}", saved_world=saved_world, world=world)
        p = params[int(i)]
        pbox = sec["tensors"].get(names[int(i)]) if sec is not None else None
        out = {}
        for key, v in entry.items():
            sharded = is_dtensor(p) and isinstance(v, torch.Tensor) and (
                state_box(v, pbox) is not None if sec is not None
                else v.dim() > 0 and tuple(v.shape) == tuple(p.shape))
            if sharded:  # a moment or buffer of the parameter's shape: its shard, as a DTensor
                piece = _piece(v, p, pbox, f"optimizer state {key!r} of {names[int(i)]!r}",
                               saved_world, world)
                d: Any = p  # a DTensor
                v = type(d).from_local(piece.clone(), d.device_mesh, d.placements, run_check=False,
                                       shape=d.shape, stride=d.stride())
            out[key] = v
        new_state[int(i)] = out
    with torch.no_grad():
        for dst, src in plan:
            dst.copy_(src)
    optimizer.load_state_dict({"state": new_state, "param_groups": saved_opt["param_groups"]})


def _piece(src: Any, dst: torch.Tensor, box: dict | None, what: str, saved_world: int,
           world: int) -> torch.Tensor:
    """What of ``src`` goes into the local shard of ``dst``: the whole of a part's shard (its box
    checked), or the live box cut out of a whole tensor."""
    if not isinstance(src, torch.Tensor):
        raise ShardLayoutError(f"{what}: the state holds no tensor", saved_world=saved_world,
                               world=world, name=what)
    if not is_dtensor(dst):
        if box is not None or tuple(src.shape) != tuple(dst.shape):
            raise ShardLayoutError(f"{what}: the state's shape {tuple(src.shape)} is not the live "
                                   f"{tuple(dst.shape)}", saved_world=saved_world, world=world, name=what)
        return src
    live_box = box_of(dst)
    if box is not None:
        if not same_box(box, live_box):
            raise ShardLayoutError(f"{what}: saved shard {box} is not the live shard {live_box}",
                                   saved_world=saved_world, world=world, name=what)
        return src
    if list(src.shape) != live_box["shape"]:
        raise ShardLayoutError(f"{what}: the state's shape {tuple(src.shape)} is not the live "
                               f"global shape {tuple(live_box['shape'])}", saved_world=saved_world,
                               world=world, name=what)
    return region(src, live_box["offsets"], live_box["local"])
