"""Sharded (FSDP2 / DTensor) Checkpointer states (format-spec/deltas.md, "Sharded states").

Under FSDP2 (``fully_shard``) every rank holds a shard of every parameter, of its optimizer state
and of its gradient (DTensors). On a multi-rank job store the Checkpointer writes, on every rank,
the rank's *local* shards as plain tensors: its part is a complete Checkpointer state of a model
whose parameters are those local shards, so the replay engine replays it unchanged (every
supported optimizer is elementwise within a parameter: a step on a shard gives the bits of the
same entries of the whole step). The replay section of a part gains ``shards``::

    {"v": 1, "rank": r, "world": N, "tensors": {model entry: BOX, ...}}  # its DTensor entries
    BOX = {"shape": [global], "offsets": [where the local shard starts], "local": [its shape],
           "placements": ["S0" | "S1" | ... | "R", per mesh dimension], "mesh": [mesh shape]}

:func:`localize` makes a part from a live state, :func:`shards_of` reads the section back and
:func:`assemble_parts` puts every rank's part of one iteration together into one state of full
tensors (any reader, any world size). An optimizer-state tensor of a sharded parameter
is sharded with the parameter's BOX when it has the parameter's local shape (moments, momentum
buffers: every supported optimizer's per-entry state); any other entry (``step``) is the same on
every rank. This holds for the replayed states too, whose optimizer state the base may not have
held yet (a base written before the first step). Pure functions of their arguments: no I/O, no collectives.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import DamagedCheckpointError, UnsupportedTypeError
from ..format.delta import REPLAY_KEY

SHARDS_KEY = "shards"
SHARDS_VERSION = 1


def dtensor_type() -> Any:
    """torch's DTensor class, or None when no DTensor can exist (its module was never imported)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t: Any) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: Any) -> Any:
    """A DTensor's local shard, a plain tensor sharing its memory (the same object on every call
    for a gradient); anything else is returned as it is."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        r = t.to_local()
    if isinstance(r, torch.nn.Parameter) or getattr(r, "_is_param", False):
        r = r.detach()  # a parameter's local view: a plain tensor over the same memory
    return r


def placement_code(p: Any) -> str:
    """``Shard(d)`` -> ``"Sd"``, ``Replicate()`` -> ``"R"``; other placements (``Partial``:
    a pending reduction) have no stored form."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(p, Shard):
        return f"S{p.dim}"
    if isinstance(p, Replicate):
        return "R"
    raise UnsupportedTypeError(f"a DTensor placement {p!r} cannot be checkpointed (only Shard "
                               "and Replicate)")


def box_of(t: Any) -> dict:
    """The BOX (module docstring) of this rank's shard of the DTensor ``t``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    lt = local(t)
    if tuple(lt.shape) != tuple(shape):
        raise UnsupportedTypeError(f"a DTensor's local shard has shape {tuple(lt.shape)}, not the "
                                   f"{tuple(shape)} its placements give (uneven custom shards)")
    return {"shape": list(t.shape), "offsets": [int(o) for o in offsets],
            "local": [int(s) for s in shape],
            "placements": [placement_code(p) for p in t.placements],
            "mesh": [int(s) for s in t.device_mesh.shape]}


def localize(state: dict, rank: int, world: int) -> dict:
    """A Checkpointer state (``{"model", "optimizer", REPLAY_KEY, ...}``) with every DTensor of
    the model and of the optimizer state replaced by its local shard, and the ``shards`` section
    saying where each shard lies."""
    tensors: dict[str, dict] = {}
    model = type(state["model"])()
    for k, v in state["model"].items():
        if is_dtensor(v):
            tensors[k] = box_of(v)
            v = local(v)
        model[k] = v
    if hasattr(state["model"], "_metadata"):
        model._metadata = state["model"]._metadata
    names = [n for g in state[REPLAY_KEY]["groups"] for n in g]
    opt_state: dict[int, Any] = {}
    for i, entry in state["optimizer"]["state"].items():
        out = {}
        for k, v in entry.items():
            if is_dtensor(v):
                own = tensors.get(names[i]) if 0 <= i < len(names) else None
                if own is None or not same_box(box_of(v), own):
                    raise UnsupportedTypeError(f"optimizer state {k!r} of {names[i]!r} is not "
                                               "sharded as its parameter")
                v = local(v)
            out[k] = v
        opt_state[i] = out
    st = dict(state)
    st["model"] = model
    st["optimizer"] = dict(state["optimizer"], state=opt_state)
    st[REPLAY_KEY] = dict(state[REPLAY_KEY], **{SHARDS_KEY: {
        "v": SHARDS_VERSION, "rank": rank, "world": world, "tensors": tensors}})
    return st


def shards_of(state: Any) -> dict | None:
    """The ``shards`` section of a sharded part, or None for any other state."""
    info = state.get(REPLAY_KEY) if isinstance(state, dict) else None
    sec = info.get(SHARDS_KEY) if isinstance(info, dict) else None
    return sec if isinstance(sec, dict) else None


def state_box(v: Any, box: dict | None) -> dict | None:
    """The BOX of an optimizer-state entry ``v`` of a parameter whose BOX is ``box``: the
    parameter's own when ``v`` is a tensor of its local shape, else None (not sharded)."""
    if box is None or not isinstance(v, torch.Tensor) or \
            [int(s) for s in v.shape] != [int(s) for s in box["local"]]:
        return None
    return box


def same_box(a: dict, b: dict) -> bool:
    return all(list(a.get(k) or []) == list(b.get(k) or [])
               for k in ("shape", "offsets", "local", "placements", "mesh"))


def region(full: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of ``full`` holding the box at ``offsets`` of ``sizes``."""
    view = full
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        view = view.narrow(d, int(o), int(n))
    return view


def _assemble(what: str, pieces: list[tuple[Any, dict, int]]) -> torch.Tensor:
    """One full tensor from (local shard, BOX, rank) of every rank; replicas (equal boxes) once."""
    t0, b0, _ = pieces[0]
    shape = [int(s) for s in b0["shape"]]
    full = torch.empty(shape, dtype=t0.dtype)
    seen: set[tuple] = set()
    covered = 0
    for t, b, r in pieces:
        if not isinstance(t, torch.Tensor) or [int(s) for s in b["shape"]] != shape or \
                t.dtype != t0.dtype or list(t.shape) != [int(s) for s in b["local"]] or \
                len(b["offsets"]) != len(shape) or \
                any(o < 0 or o + n > s for o, n, s in zip(b["offsets"], b["local"], shape)):
            raise DamagedCheckpointError(f"rank {r}'s shard of {what} does not fit its recorded box "
                                         f"(global shape {shape})")
        key = (tuple(b["offsets"]), tuple(b["local"]))
        if key in seen:
            continue
        seen.add(key)
        covered += math.prod(int(n) for n in b["local"])
        region(full, b["offsets"], b["local"]).copy_(t)
    if covered != math.prod(shape):
        raise DamagedCheckpointError(f"the shards of {what} cover {covered} of its "
                                     f"{math.prod(shape)} entries")
    return full


def assemble_parts(parts: Sequence[dict], local_rank: int = 0) -> dict:
    """The whole state of one iteration from every rank's sharded part (rank order): each
    sharded tensor assembled from its shards (a contiguous CPU tensor of the global shape),
    every other entry, the RNG and scheduler states from part ``local_rank``. The result has no
    ``shards`` section: it is a Checkpointer state of the unsharded model."""
    sections = [shards_of(p) for p in parts]
    if any(s is None for s in sections):
        raise DamagedCheckpointError("not every rank's state is a sharded part")
    secs: list[dict] = [s for s in sections if s is not None]
    world = secs[0]["world"]
    if len(parts) != world or [s["rank"] for s in secs] != list(range(world)) or \
            any(s["world"] != world or set(s["tensors"]) != set(secs[0]["tensors"]) for s in secs):
        raise DamagedCheckpointError(f"the {len(parts)} sharded parts do not form one state of "
                                     f"{world} ranks")
    base = parts[local_rank]
    model = type(base["model"])()
    for k, v in base["model"].items():
        if k in secs[0]["tensors"]:
            v = _assemble(f"model entry {k!r}",
                          [(p["model"].get(k), s["tensors"][k], r)
                           for r, (p, s) in enumerate(zip(parts, secs))])
        model[k] = v
    if hasattr(base["model"], "_metadata"):
        model._metadata = base["model"]._metadata
    names = [n for g in base[REPLAY_KEY]["groups"] for n in g]
    opt_state: dict[int, Any] = {}
    for i, entry in base["optimizer"]["state"].items():
        name = names[i] if 0 <= i < len(names) else None
        out = {}
        for k, v in entry.items():
            if state_box(v, secs[local_rank]["tensors"].get(name)) is not None:
                pieces = []
                for r, (p, s) in enumerate(zip(parts, secs)):
                    w = p["optimizer"]["state"].get(i, {}).get(k)
                    b = state_box(w, s["tensors"][name])
                    if b is None:
                        raise DamagedCheckpointError(f"rank {r} holds no shard of optimizer state "
                                                     f"{k!r} of {name!r}")
                    pieces.append((w, b, r))
                v = _assemble(f"optimizer state {k!r} of {name!r}", pieces)
            out[k] = v
        opt_state[i] = out
    st = dict(base)
    st["model"] = model
    st["optimizer"] = dict(base["optimizer"], state=opt_state)
    st[REPLAY_KEY] = {k: v for k, v in base[REPLAY_KEY].items() if k != SHARDS_KEY}
    return st
