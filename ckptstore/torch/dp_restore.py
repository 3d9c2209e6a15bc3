"""Parallel recovery of a data-parallel job: each rank rebuilds its own part, then the ranks
exchange parts.

A partitioned Checkpointer state (format-spec/deltas.md, "Partitioned states") is replayed part by
part. Loading the job's state through :meth:`ckptstore.JobStore.load` replays every part in the
loading process; here, at the world size that wrote the iteration, each rank replays only its
own part (all ranks at once: the LowDiff idea of parallel recovery) and then broadcasts its
parameters and their optimizer state to the others over the store's gloo group, as bytes (exact
for every dtype). Every rank then merges the same parts, keeping its own RNG states.

Call sequence (collective, every rank): ``state = load_in_parallel(store, iteration)``.
Invariants: what travels is described first (a small JSON message per rank: the optimizer-state
entries of its parameters, with dtype and shape), so every receiver allocates exactly what the
owner sends; nothing is pickled.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..errors import DamagedCheckpointError, RankFailureError
from ..format.delta import REPLAY_KEY
from ..multirank.job_store import JobStore
from ..replay.partition import PARTITION_KEY, merge_parts, partition_of


def can_load_in_parallel(store: Any, iteration: int) -> bool:
    """Whether ``iteration`` was written by as many ranks as ``store``'s job has now (so each
    rank can rebuild its own part); the caller then checks the part itself."""
    return isinstance(store, JobStore) and store.group is not None and \
        store.global_commit(iteration).world_size == store.group.world_size


def load_in_parallel(store: JobStore, iteration: int) -> dict:
    """The merged state of ``iteration`` on every rank (collective), each rank rebuilding only
    its own part. Falls back to :meth:`JobStore.load` (every part here) for a state that is not
    partitioned."""
    try:
        return _load_in_parallel(store, iteration)
    except RankFailureError as e:
        store.mark_broken(e)  # the group is unusable: no commit round may follow
        raise


def _load_in_parallel(store: JobStore, iteration: int) -> dict:
    group = store.group
    assert group is not None and store.rank is not None
    # every rank loads its own part first and says whether it could, so a rank whose part is
    # damaged makes every rank raise at once (none waits in the exchange)
    own: Any = None
    try:
        own = store.load(iteration, rank=store.rank)
        section = partition_of(own)
        status = b"\1" if section is not None else b"\0"
    except Exception as e:  # noqa: BLE001 - raised below, after every rank heard of it
        failure, status = e, b"\2" + f"rank {store.rank}: {type(e).__name__}: {e}".encode()
    flags = group.all_gather(status, "the restore's layout")
    if status[:1] == b"\2":
        raise failure
    broken = [f[1:].decode(errors="replace") for f in flags if f[:1] == b"\2"]
    if broken:
        raise DamagedCheckpointError(f"iteration {iteration} cannot be restored: "
                                     + "; ".join(broken))
    if all(f == b"\0" for f in flags):
        return own  # every rank saved its own whole state
    if any(f != b"\1" for f in flags):
        return store.load(iteration)  # a mix: the merge says what is wrong
    assert section is not None
    groups: list[list[str]] = section["groups"]
    owner: dict[str, int] = section["owner"]
    names = [n for g in groups for n in g]
    # what this rank's part holds for each of its parameters: the model tensor and the
    # optimizer-state entries (tensors by dtype and shape, other values as JSON)
    own_names = [n for g in own[REPLAY_KEY]["groups"] for n in g]
    described: dict[str, Any] = {}
    for i, n in enumerate(own_names):
        entry = own["optimizer"]["state"].get(i)
        described[n] = {"param": _describe(own["model"][n]),
                        "state": None if entry is None else
                        {k: _describe(v) for k, v in entry.items()}}
    messages = [json.loads(m) for m in group.all_gather(json.dumps(described).encode(),
                                                        "the restore's descriptions")]
    parts: list[dict] = []
    for q in range(group.world_size):
        if q == store.rank:
            parts.append(own)
            continue
        q_names = [n for g in groups for n in g if owner[n] == q]
        model: dict[str, Any] = {}
        state: dict[int, Any] = {}
        for i, n in enumerate(q_names):
            d = messages[q].get(n)
            if d is None:
                raise DamagedCheckpointError(f"iteration {iteration}: rank {q} does not describe "
                                             f"its parameter {n!r}")
            model[n] = _allocate(d["param"])
            if d["state"] is not None:
                state[i] = {k: _allocate(v) for k, v in d["state"].items()}
        parts.append({"model": model, "optimizer": {"state": state},
                      REPLAY_KEY: {"groups": [[n for n in g if owner[n] == q] for g in groups],
                                   "aliases": {}, PARTITION_KEY: dict(section, rank=q)}})
    for q in range(group.world_size):  # every rank's tensors, from their owner, in one order
        q_names = [n for n in names if owner[n] == q]
        index = {n: i for i, n in enumerate(n for g in parts[q][REPLAY_KEY]["groups"] for n in g)}
        tensors = []
        for n in q_names:
            tensors.append(parts[q]["model"][n])
            entry = parts[q]["optimizer"]["state"].get(index[n])
            if entry is not None:
                tensors += [v for _, v in sorted(entry.items()) if isinstance(v, torch.Tensor)]
        group.broadcast_bytes_of([_contiguous(t) for t in tensors], q, "the restore's exchange")
    return merge_parts(parts, store.rank)


def _describe(v: Any) -> list:
    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype).removeprefix("torch."), list(v.shape)]
    return ["value", v]


def _allocate(d: list) -> Any:
    if d[0] == "tensor":
        dtype = getattr(torch, d[1], None)
        if not isinstance(dtype, torch.dtype):
            raise DamagedCheckpointError(f"unknown dtype {d[1]!r} in a restore exchange")
        return torch.empty([int(x) for x in d[2]], dtype=dtype)
    return d[1]


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    assert t.is_contiguous(), "state tensors from a store are contiguous"
    return t
