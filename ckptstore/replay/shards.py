"""Sharded (FSDP2 / DTensor) Checkpointer states (format-spec/deltas.md, "Sharded states").

Under FSDP2 (``fully_shard``) every rank holds a shard of every parameter, of its optimizer state
and of its gradient (DTensors). On a multi-rank job store the Checkpointer writes, on every rank,
the rank's *local* shards as plain tensors: its part is a complete Checkpointer state of a model
whose parameters are those local shards, so the replay engine replays it unchanged (every
supported optimizer is elementwise within a parameter: a step on a shard gives the bits of the
same entries of the whole step). The replay section of a part gains ``shards``::

    {"v": 1, "rank": r, "world": N, "tensors": {model entry: BOX, ...},  # its DTensor entries
     "replicas": {entry: owner rank, ...},       # entries whose box other ranks hold too
     "groups": [[every param name], ...], "keys": [every model entry], "aliases": {tie: param},
     "state_order": [optimizer state indices], "param_names": [per group: names or None]}
    BOX = {"shape": [global], "offsets": [where the local shard starts], "local": [its shape],
           "placements": ["S0" | "S1" | ... | "R", per mesh dimension], "mesh": [mesh shape]}

A box held by several ranks (a ``Replicate()`` mesh dimension: HSDP, replicated tensor-parallel
parameters) is written by one of them, its *owner* (:func:`assign_owners`: balanced by bytes, a
pure function every rank computes alike); the others omit the parameter (its optimizer state, its
gradient, its tied entries) and their part is cut as a data-parallel partition's is
(ckptstore/replay/partition.py): the replay ``groups`` and ``aliases`` name the written
parameters, the optimizer state is renumbered in their order, ``grads`` lists theirs. The whole
model's names (``groups``, ``keys``, ``aliases``, ``state_order``, ``param_names``) stay in the
section. Parts written before ``replicas`` existed omit nothing and lack those fields.

:func:`localize` makes a part from a live state, :func:`shards_of` reads the section back,
:func:`complete_part` puts back what a part omitted from its owners' parts and
:func:`assemble_parts` puts every rank's part of one iteration together into one state of full
tensors (any reader, any world size), once :func:`layout_problems` found that the boxes of every
tensor tile it exactly (no overlap, no gap: :func:`tiling_error`). An optimizer-state tensor of a
sharded parameter is sharded with the parameter's BOX when it has the parameter's local shape
(moments, momentum buffers: every supported optimizer's per-entry state); any other entry
(``step``) is the same on every rank. This holds for the replayed states too, whose optimizer
state the base may not have held yet (a base written before the first step). Pure functions of
their arguments: no I/O, no collectives.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import (CkptStoreError, DamagedCheckpointError, ShardCoverageError,
                      UnsupportedTypeError)
from ..format.delta import REPLAY_KEY
from ..tensors.leaves import dtensor_type, is_dtensor
from .partition import cut_group, whole_optimizer

SHARDS_KEY = "shards"
SHARDS_VERSION = 1


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


def mesh_ranks(t: Any) -> list[int]:
    """The global ranks of the DTensor ``t``'s device mesh, sorted."""
    return sorted(int(g) for g in t.device_mesh.mesh.reshape(-1).tolist())


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


@dataclass(frozen=True)
class Holding:
    """One distinct box of one parameter: where it lies, its bytes, and the ranks (of the job
    store) that hold it, bit-identical (more than one: a replicated box)."""

    name: str
    offsets: tuple[int, ...]
    local: tuple[int, ...]
    nbytes: int
    ranks: tuple[int, ...]

    @property
    def key(self) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        return (self.name, self.offsets, self.local)


def assign_owners(holdings: Sequence[Holding], world: int
                  ) -> dict[tuple[str, tuple[int, ...], tuple[int, ...]], int]:
    """The writer of every replicated box (``Holding.key`` -> rank). Every rank first carries the
    bytes of the boxes it alone holds; then the replicated boxes, largest first (ties: name,
    offsets, shape), each go to the holder carrying the fewest bytes so far (ties: lowest rank).
    A pure function of its arguments (not of their order): every rank computes the same owners."""
    load = [0] * world
    for h in holdings:
        if len(h.ranks) == 1:
            load[h.ranks[0]] += h.nbytes
    owner: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}
    for h in sorted((h for h in holdings if len(h.ranks) > 1),
                    key=lambda h: (-h.nbytes, h.name, h.offsets, h.local)):
        r = min(h.ranks, key=lambda i: (load[i], i))
        owner[h.key] = r
        load[r] += h.nbytes
    return owner


def replica_owners(holdings: Sequence[Holding], world: int, rank: int) -> dict[str, int]:
    """``{parameter: owner}`` for every parameter whose box ``rank`` holds with other ranks: the
    ``replicas`` section of ``rank``'s part (without the tied entries, which follow their
    parameter)."""
    owners = assign_owners(holdings, world)
    return {h.name: owners[h.key] for h in holdings if len(h.ranks) > 1 and rank in h.ranks}


def box_at(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
           codes: Sequence[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, local shape) of the shard at mesh coordinate ``coord`` of a tensor of global
    ``shape`` placed by ``codes`` (``"Sd"`` / ``"R"`` per mesh dimension), as DTensor places it:
    mesh dimensions left to right, each ``Shard(d)`` splitting the current extent of dimension
    ``d`` into mesh-size chunks the way ``torch.chunk`` does (``ceil(extent / k)`` entries each,
    the last ones shorter or empty), offsets adding up; an empty shard's offset is the global
    extent. Pure; :func:`box_of` is torch's own answer for the local rank, and the Checkpointer
    checks that the two agree there."""
    sizes = [int(n) for n in shape]
    offsets = [0] * len(sizes)
    for code, k, c in zip(codes, mesh_shape, coord):
        if code == "R":
            continue
        d = int(code[1:])
        cur = sizes[d]
        chunk = -(-cur // k)
        start = min(cur, chunk * c)
        size = max(0, min(cur, chunk * c + chunk) - chunk * c)
        sizes[d] = size
        offsets[d] = offsets[d] + start if size else int(shape[d])
    return tuple(offsets), tuple(sizes)


def holdings_of(name: str, t: Any, store_rank: dict[int, int]) -> list[Holding] | None:
    """Every distinct box of the DTensor ``t`` over its mesh and the job-store ranks holding it
    (``store_rank``: global rank -> rank in the job store), from its global shape, mesh and
    placements alone (the same on every rank). None when no box can have several holders (no
    ``Replicate()`` over a mesh dimension of more than one rank), or when a rank of the mesh does
    not write the job store (the entry is then written by every rank that holds it)."""
    mesh_shape = [int(n) for n in t.device_mesh.shape]
    codes = [placement_code(p) for p in t.placements]  # Shard / Replicate only
    if not any(c == "R" and n > 1 for c, n in zip(codes, mesh_shape)):
        return None
    grid = [int(g) for g in t.device_mesh.mesh.reshape(-1).tolist()]  # row-major coordinates
    boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    by_shard: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for g, coord in zip(grid, itertools.product(*(range(n) for n in mesh_shape))):
        if g not in store_rank:
            return None
        where = tuple(0 if c == "R" else x for c, x in zip(codes, coord))  # what the box depends on
        key = by_shard.get(where)
        if key is None:
            key = by_shard[where] = box_at(list(t.shape), mesh_shape, where, codes)
        boxes.setdefault(key, []).append(store_rank[g])
    size = t.element_size()
    return [Holding(name, o, n, math.prod(n) * size, tuple(sorted(set(rs))))
            for (o, n), rs in sorted(boxes.items())]


def localize(state: dict, rank: int, world: int, replicas: Mapping[str, int] | None = None) -> dict:
    """A Checkpointer state (``{"model", "optimizer", REPLAY_KEY, ...}``) with every DTensor of
    the model and of the optimizer state replaced by its local shard, and the ``shards`` section
    saying where each shard lies. ``replicas``: ``{entry: owner}`` for the parameters (and their
    tied entries) whose box other ranks hold too; those another rank owns are cut from the part
    (model, optimizer state, replay groups and aliases), their BOX kept in ``tensors``."""
    info = state[REPLAY_KEY]
    aliases = dict(info.get("aliases") or {})
    replicas = {k: int(o) for k, o in (replicas or {}).items()}
    for a, c in aliases.items():  # a tied entry follows its parameter
        if c in replicas:
            replicas[a] = replicas[c]
    tensors: dict[str, dict] = {}
    model = type(state["model"])()
    for k, v in state["model"].items():
        if is_dtensor(v):
            tensors[k] = box_of(v)
            v = local(v)
        model[k] = v
    names = [n for g in info["groups"] for n in g]
    opt_state = {i: _local_state_entry(entry, names, i, tensors)
                 for i, entry in state["optimizer"]["state"].items()}
    kept = [n for n in names if replicas.get(n, rank) == rank]
    new_index: dict[int, int] = {}  # the whole optimizer's index -> the part's
    for i, n in enumerate(names):
        if replicas.get(n, rank) == rank:
            new_index[i] = len(new_index)
    sd = state["optimizer"]
    st = dict(state)
    st["model"] = _cut_model(model, state["model"], {k for k, o in replicas.items() if o != rank})
    st["optimizer"] = dict(sd, state={new_index[i]: e for i, e in opt_state.items() if i in new_index},
                           param_groups=[cut_group(g, new_index) for g in sd["param_groups"]])
    st[REPLAY_KEY] = dict(info, groups=[[n for n in g if n in kept] for g in info["groups"]],
                          aliases={a: c for a, c in aliases.items()
                                   if replicas.get(a, rank) == rank and replicas.get(c, rank) == rank},
                          **{SHARDS_KEY: {
                              "v": SHARDS_VERSION, "rank": rank, "world": world, "tensors": tensors,
                              "replicas": replicas, "groups": info["groups"],
                              "keys": list(state["model"].keys()), "aliases": aliases,
                              "state_order": list(sd["state"].keys()),
                              "param_names": [g.get("param_names") for g in sd["param_groups"]]}})
    return st


def _local_state_entry(entry: dict, names: Sequence[str], i: int, tensors: dict[str, dict]) -> dict:
    """An optimizer-state entry (of parameter ``i``) with its DTensors replaced by their local
    shards; each must be sharded as its parameter."""
    name = names[i] if 0 <= i < len(names) else f"parameter {i}"
    out = {}
    for k, v in entry.items():
        if is_dtensor(v):
            own = tensors.get(name)
            if own is None or not same_box(box_of(v), own):
                raise UnsupportedTypeError(f"optimizer state {k!r} of {name!r} is not sharded as "
                                           "its parameter")
            v = local(v)
        out[k] = v
    return out


def _cut_model(model: Any, like: Any, drop: set[str]) -> Any:
    """``model`` without the entries in ``drop``, with ``like``'s ``_metadata``."""
    out = type(model)((k, v) for k, v in model.items() if k not in drop)
    if hasattr(like, "_metadata"):
        out._metadata = like._metadata
    return out


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


def assemble_tensor(what: str, pieces: list[tuple[Any, dict, int]]) -> torch.Tensor:
    """One full tensor from (local shard, BOX, rank) of every rank; replicas (equal boxes) once.
    The boxes tile the global shape (:func:`layout_problems`, checked by :func:`assemble_parts`
    before anything is assembled), so every entry of the result is written exactly once."""
    t0, b0, _ = pieces[0]
    shape = [int(s) for s in b0["shape"]]
    full = torch.empty(shape, dtype=t0.dtype)
    seen: set[tuple] = set()
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
        region(full, b["offsets"], b["local"]).copy_(t)
    return full


_Box = tuple[tuple[int, ...], tuple[int, ...]]   # offsets, sizes


def _ints(v: Any) -> tuple[int, ...] | None:
    if not isinstance(v, (list, tuple)) or not all(type(x) is int for x in v):
        return None
    return tuple(v)


def _fitting_box(box: Any) -> tuple[tuple[int, ...], _Box] | None:
    """(global shape, (offsets, sizes)) of a BOX that lies inside its global shape; None for a
    box that does not (another number of dimensions, a negative offset, past the end)."""
    if not isinstance(box, dict):
        return None
    shape, offsets = _ints(box.get("shape")), _ints(box.get("offsets"))
    sizes = _ints(box.get("local"))
    if shape is None or offsets is None or sizes is None or \
            not len(shape) == len(offsets) == len(sizes) or \
            any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape)):
        return None
    return shape, (offsets, sizes)


def meet(a: _Box, b: _Box) -> _Box | None:
    """The box two boxes share, or None."""
    lo = [max(x, y) for x, y in zip(a[0], b[0])]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1])]
    if all(lh < hh for lh, hh in zip(lo, hi)):
        return tuple(lo), tuple(hh - lh for lh, hh in zip(lo, hi))
    return None


def _cells(mask: torch.Tensor, lo: Sequence[int], hi: Sequence[int]) -> torch.Tensor:
    """The view of ``mask`` over the grid cells ``lo`` .. ``hi`` (exclusive), per dimension."""
    return region(mask, lo, [h - lo_ for lo_, h in zip(lo, hi)])


#: The most grid cells :func:`tiling_error` checks (a boolean each): far more than any real
#: layout makes (a 1024 x 1024 mesh sharding two dimensions makes 2**20), bounded against
#: hostile boxes
MAX_GRID_CELLS = 1 << 24


def tiling_error(fqn: str, shape: Sequence[int], boxes: Sequence[tuple[_Box, int]],
                 where: str = "") -> CkptStoreError | None:
    """Why the boxes ``((offsets, sizes), rank)`` of tensor ``fqn`` do not tile its global
    ``shape`` exactly (ShardCoverageError), or None when they do. Precondition: every box lies
    inside ``shape`` (:func:`_fitting_box`). Equal boxes are one box held by several ranks (a
    replica); empty boxes cover nothing. The first overlap found (the two boxes, their ranks and
    the box they share) is reported before a gap (the first uncovered box, grown along each
    dimension).

    Box arithmetic on the grid the boxes' edges cut the tensor into (a boolean per grid cell, at
    most ``(2 * boxes + 1) ** ndim`` of them, never one per entry), so it costs nothing next to
    the tensor's bytes. Boxes that cut it into more than :data:`MAX_GRID_CELLS` cells are not
    checked: DamagedCheckpointError."""
    size = tuple(int(n) for n in shape)
    held: dict[_Box, list[int]] = {}
    for b, r in boxes:
        if math.prod(b[1]) > 0:
            held.setdefault((tuple(b[0]), tuple(b[1])), []).append(int(r))
    distinct = list(held)
    edges = [sorted({0, size[d]} | {o[d] for o, _ in distinct} | {o[d] + n[d] for o, n in distinct})
             for d in range(len(size))]
    name = f"{where}tensor {fqn!r} of shape {list(size)}"
    if math.prod(len(e) - 1 for e in edges) > MAX_GRID_CELLS:
        return DamagedCheckpointError(f"{name}: its {len(distinct)} distinct shards cut it into "
                                      f"more than {MAX_GRID_CELLS} boxes; not a layout to check")
    mask = torch.zeros([len(e) - 1 for e in edges], dtype=torch.bool)

    def grid(b: _Box) -> tuple[list[int], list[int]]:
        return ([bisect.bisect_left(e, o) for e, o in zip(edges, b[0])],
                [bisect.bisect_left(e, o + n) for e, o, n in zip(edges, b[0], b[1])])

    def holders(b: _Box) -> str:
        rs = sorted(set(held[b]))
        return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"

    for i, b in enumerate(distinct):
        view = _cells(mask, *grid(b))
        if bool(view.any()):
            # a grid cell is inside or outside each box whole: an earlier box shares it with b
            a = next(a for a in distinct[:i] if meet(a, b) is not None)
            common = meet(a, b)
            assert common is not None
            return ShardCoverageError(
                f"{name}: its shards at offsets {list(a[0])} (sizes {list(a[1])}, {holders(a)}) "
                f"and at offsets {list(b[0])} (sizes {list(b[1])}, {holders(b)}) overlap in the "
                f"box at offsets {list(common[0])} of sizes {list(common[1])}", fqn=fqn,
                offsets=common[0], sizes=common[1], ranks=tuple(sorted(set(held[a] + held[b]))))
        view.fill_(True)
    free = (~mask).reshape(-1).nonzero()
    if free.numel() == 0:
        return None
    flat = int(free[0, 0])
    lo: list[int] = []
    for n in reversed(mask.shape):  # the first uncovered cell's index per dimension
        flat, c = divmod(flat, n)
        lo.insert(0, c)
    hi = [c + 1 for c in lo]
    for d in range(len(size)):  # grown while the grown box stays uncovered
        while hi[d] < mask.shape[d]:
            slab = _cells(mask, lo[:d] + [hi[d]] + lo[d + 1:], hi[:d] + [hi[d] + 1] + hi[d + 1:])
            if bool(slab.any()):
                break
            hi[d] += 1
    offsets = tuple(edges[d][lo[d]] for d in range(len(size)))
    sizes = tuple(edges[d][hi[d]] - offsets[d] for d in range(len(size)))
    ranks = tuple(sorted({r for rs in held.values() for r in rs}))
    have = sum(math.prod(b[1]) for b in distinct)
    return ShardCoverageError(
        f"{name}: no shard holds the box at offsets {list(offsets)} of sizes {list(sizes)} (the "
        f"{len(distinct)} distinct shards of ranks {list(ranks)} hold {have} of its "
        f"{math.prod(size)} entries)", fqn=fqn, offsets=offsets, sizes=sizes, ranks=ranks)


def _misfit(rank: int, fqn: str, box: Any, shape: tuple[int, ...] | None) -> str:
    """Why ``rank``'s ``box`` of ``fqn`` does not fit (``shape``: what earlier ranks record)."""
    if box is None:
        return f"rank {rank} records no box of tensor {fqn!r}"
    if not isinstance(box, dict):
        return f"rank {rank} records a malformed box of tensor {fqn!r}"
    others = f" (other ranks record {list(shape)})" if shape is not None else ""
    return (f"rank {rank}'s box of tensor {fqn!r} ({_box_text(box)}) does not fit its global "
            f"shape {box.get('shape')}{others}")


def layout_problems(sections: Sequence[dict], where: str = "") -> list[CkptStoreError]:
    """Why the boxes that the ``shards`` sections of one iteration's parts (one per rank, rank
    order) record do not form one sharded state, per DTensor entry (in the order the sections
    name them): a rank that records no box of it, or one that does not fit the global shape the
    other ranks record (DamagedCheckpointError); boxes that overlap or leave a gap
    (ShardCoverageError, :func:`tiling_error`). Empty when every entry's boxes tile it. Reads
    the boxes only (no tensor), so a layout is checked before any tensor is assembled.
    ``where`` prefixes every message (e.g. ``"iteration 7: "``)."""
    problems: list[CkptStoreError] = []
    tables = [t if isinstance(t := sec.get("tensors"), dict) else {} for sec in sections]
    names: dict[str, None] = {}
    for t in tables:
        names.update(dict.fromkeys(t))
    for fqn in names:
        shape: tuple[int, ...] | None = None
        boxes: list[tuple[_Box, int]] = []
        bad = None
        for r, t in enumerate(tables):
            box = t.get(fqn)
            fit = _fitting_box(box)
            if fit is None or (shape is not None and fit[0] != shape):
                bad = where + _misfit(r, fqn, box, shape)
                break
            shape = fit[0]
            boxes.append((fit[1], r))
        if bad is not None:
            problems.append(DamagedCheckpointError(bad))
            continue
        assert shape is not None  # (every section was read: fqn is in one of them)
        err = tiling_error(fqn, shape, boxes, where)
        if err is not None:
            problems.append(err)
    return problems


def omitted(part: dict) -> dict[str, int]:
    """``{entry: owner}`` for every entry a sharded part omitted (a replica another rank owns)."""
    sec = shards_of(part) or {}
    rank = sec.get("rank")
    reps = sec.get("replicas")
    return {k: o for k, o in reps.items() if o != rank} if isinstance(reps, dict) else {}


def donors_needed(part: dict) -> list[int]:
    """The ranks whose parts (of the same iteration) :func:`complete_part` needs for ``part``."""
    return sorted(set(omitted(part).values()))


def complete_part(part: dict, donors: Mapping[int, dict]) -> dict:
    """A sharded part with every entry it omitted put back from its owner's part
    (``donors[owner]``, of the same iteration): the part as if its rank had written every shard
    it holds (model entries in the whole model's order, the whole optimizer's indices, groups and
    aliases, ``replicas`` empty). A part that omitted nothing is returned as it is. Raises
    DamagedCheckpointError, naming the entry, the box, the owner and the iteration, when the
    owner's part does not hold that box."""
    missing = omitted(part)
    if not missing:
        return part
    sec = shards_of(part)
    assert sec is not None  # (omitted() found replicas)
    it, rank = part.get("iteration"), sec["rank"]
    whole = _whole_names(sec, f"iteration {it}: rank {rank}'s part")
    groups, keys, aliases = whole
    names = [n for g in groups for n in g]
    model = type(part["model"])()
    for k in keys:
        if k in part["model"] and k not in missing:
            model[k] = part["model"][k]
        elif k in missing:
            model[k] = _donated(k, sec, missing[k], donors, it)
        else:
            raise DamagedCheckpointError(f"iteration {it}: rank {rank}'s part holds no model "
                                         f"entry {k!r}")
    if hasattr(part["model"], "_metadata"):
        model._metadata = part["model"]._metadata
    found: dict[int, Any] = {}
    own_state = _state_by_name(part)
    for i, n in enumerate(names):
        if n in missing:
            donor_state = _state_by_name(donors[missing[n]])  # (present: _donated checked it)
            entry = donor_state.get(n)
        else:
            entry = own_state.get(n)
        if entry is not None:
            found[i] = entry
    out = dict(part)
    out["model"] = model
    out["optimizer"] = dict(part["optimizer"], **whole_optimizer(
        found, sec.get("state_order"), groups, part["optimizer"]["param_groups"],
        sec.get("param_names")))
    out[REPLAY_KEY] = dict(part[REPLAY_KEY], groups=groups, aliases=aliases,
                           **{SHARDS_KEY: dict(sec, replicas={})})
    return out


def _whole_names(sec: dict, what: str) -> tuple[list[list[str]], list[str], dict[str, str]]:
    """The whole model's param groups, entries and aliases a cut part records."""
    groups, keys, aliases = sec.get("groups"), sec.get("keys"), sec.get("aliases")
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups) or \
            not isinstance(keys, list) or not isinstance(aliases, dict):
        raise DamagedCheckpointError(f"{what} omits replicated entries but does not record the "
                                     "whole model's names (shards.groups, keys, aliases)")
    return groups, keys, aliases


def _state_by_name(part: dict) -> dict[str, Any]:
    """A part's optimizer-state entries by parameter name (its replay ``groups`` order)."""
    names = [n for g in part[REPLAY_KEY]["groups"] for n in g]
    state = part["optimizer"]["state"]
    return {n: state[i] for i, n in enumerate(names) if i in state}


def _box_text(box: Any) -> str:
    if not isinstance(box, dict):
        return "(no box)"
    return f"offsets {list(box.get('offsets') or [])} shape {list(box.get('local') or [])}"


def _donated(k: str, sec: dict, owner: int, donors: Mapping[int, dict], it: Any) -> Any:
    """Model entry ``k`` of a part (its BOX in ``sec``) from its owner's part."""
    box = sec["tensors"].get(k)
    donor = donors.get(owner)
    dsec = shards_of(donor) if donor is not None else None
    where = (f"iteration {it}: no part holds the box {_box_text(box)} of {k!r} (rank "
             f"{sec['rank']} left it to rank {owner}")
    if donor is None or dsec is None or dsec.get("rank") != owner or \
            dsec.get("world") != sec["world"]:
        raise DamagedCheckpointError(f"{where}, whose part is not at hand)")
    v = donor["model"].get(k)
    dbox = (dsec.get("tensors") or {}).get(k)
    if not isinstance(v, torch.Tensor) or not isinstance(dbox, dict) or box is None or \
            not same_box(dbox, box) or (dsec.get("replicas") or {}).get(k, owner) != owner:
        raise DamagedCheckpointError(f"{where}, whose part does not hold it)")
    if any(k in g for g in sec["groups"]) and not any(k in g for g in donor[REPLAY_KEY]["groups"]):
        raise DamagedCheckpointError(f"{where}, whose part does not replay it)")
    return v


def assemble_parts(parts: Sequence[dict], local_rank: int = 0) -> dict:
    """The whole state of one iteration from every rank's sharded part (rank order): each
    sharded tensor assembled from its shards (a contiguous CPU tensor of the global shape; a box
    several ranks hold from its owner's part, once), every other entry, the RNG and scheduler
    states from part ``local_rank``. The result has no ``shards`` section: it is a Checkpointer
    state of the unsharded model. Before any shard is assembled, raises ShardCoverageError when
    the boxes of a tensor do not tile its global shape (an overlap or a gap, naming the tensor,
    the box and the ranks: :func:`layout_problems`); DamagedCheckpointError when the parts do
    not form one state, a box does not fit the tensor, or no part holds a box (naming the tensor
    and the box)."""
    sections = [shards_of(p) for p in parts]
    if any(s is None for s in sections):
        raise DamagedCheckpointError("not every rank's state is a sharded part")
    secs0: list[dict] = [s for s in sections if s is not None]
    world = secs0[0]["world"]
    if len(parts) != world or [s["rank"] for s in secs0] != list(range(world)) or \
            any(s["world"] != world or set(s["tensors"]) != set(secs0[0]["tensors"])
                for s in secs0):
        raise DamagedCheckpointError(f"the {len(parts)} sharded parts do not form one state of "
                                     f"{world} ranks")
    it = parts[0].get("iteration")
    problems = layout_problems(secs0, f"iteration {it}: " if it is not None else "")
    if problems:
        raise problems[0]
    donors = dict(enumerate(parts))
    parts = [complete_part(p, donors) for p in parts]
    secs: list[dict] = [s for s in (shards_of(p) for p in parts) if s is not None]
    base = parts[local_rank]
    model = type(base["model"])()
    for k, v in base["model"].items():
        if k in secs[0]["tensors"]:
            v = assemble_tensor(f"model entry {k!r}",
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
                v = assemble_tensor(f"optimizer state {k!r} of {name!r}", pieces)
            out[k] = v
        opt_state[i] = out
    st = dict(base)
    st["model"] = model
    st["optimizer"] = dict(base["optimizer"], state=opt_state)
    st[REPLAY_KEY] = {k: v for k, v in base[REPLAY_KEY].items() if k != SHARDS_KEY}
    return st
