"""Data-parallel partitions of a Checkpointer state (format-spec/deltas.md, "Partitioned states").

Under data parallelism every rank holds the same parameters, optimizer state and all-reduced
gradients. A multi-rank job store therefore does not need every rank to write everything: the
parameters are split among the ranks, whole parameters at a time, and rank r writes only the
parameters it *owns*, their optimizer state and their gradients. Each rank's part is itself a
complete Checkpointer state of a smaller model (its owned parameters), so the replay engine
replays a part unchanged: every supported optimizer updates each parameter from that parameter's
own gradient and state alone, so replaying a part gives the same bits as replaying the whole
(each rank replays its part concurrently: parallel recovery). :func:`merge_parts` puts the parts
of one iteration back together, at any number of readers.

A part's replay section (``REPLAY_KEY``) lists the owned names per param group under ``groups``
(what the replayer rebuilds) and adds ``partition``::

    {"rank": r, "world": N, "owner": {param name: rank, ...}, "groups": [[all names], ...]}

Invariants: a partition is a pure function of the parameter names and sizes (in optimizer order)
and the world size, so every rank computes the same one; the parts of one iteration hold every
parameter exactly once; non-parameter model entries (buffers) are in every part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import DamagedCheckpointError
from ..format.delta import REPLAY_KEY

PARTITION_KEY = "partition"


@dataclass(frozen=True)
class Partition:
    world: int
    #: parameter name -> the rank that owns it
    owner: dict[str, int]

    @classmethod
    def balanced(cls, sizes: Sequence[tuple[str, int]], world: int) -> "Partition":
        """Whole parameters to ranks, largest first, each to the rank holding the fewest bytes so
        far (lowest rank on ties): deterministic, within one parameter of even."""
        load = [0] * world
        owner: dict[str, int] = {}
        for name, nbytes in sorted(sizes, key=lambda x: (-x[1], x[0])):
            r = min(range(world), key=lambda i: (load[i], i))
            owner[name] = r
            load[r] += nbytes
        return cls(world, owner)

    def owned(self, rank: int, names: Sequence[str]) -> list[str]:
        return [n for n in names if self.owner[n] == rank]


def split_state(state: dict, part: Partition, rank: int) -> dict:
    """Rank ``rank``'s part of a Checkpointer state (``{"model", "optimizer", REPLAY_KEY, ...}``):
    its owned parameters, their optimizer state renumbered in owned order, every buffer, and
    everything else as it is."""
    info = state[REPLAY_KEY]
    groups: list[list[str]] = info["groups"]
    names = [n for g in groups for n in g]
    owned = set(part.owned(rank, names))
    out = dict(state)
    out["model"] = type(state["model"])(
        (k, v) for k, v in state["model"].items() if k not in names or k in owned)
    if hasattr(state["model"], "_metadata"):
        out["model"]._metadata = state["model"]._metadata
    out["model"] = _drop_aliases(out["model"], info, owned)
    sd = state["optimizer"]
    new_index: dict[int, int] = {}
    for i, n in enumerate(names):
        if n in owned:
            new_index[i] = len(new_index)
    out["optimizer"] = {
        "state": {new_index[i]: s for i, s in sd["state"].items() if i in new_index},
        "param_groups": [cut_group(g, new_index) for g in sd["param_groups"]],
    }
    out[REPLAY_KEY] = dict(info, groups=[[n for n in g if n in owned] for g in groups],
                           aliases={a: c for a, c in (info.get("aliases") or {}).items()
                                    if c in owned},
                           **{PARTITION_KEY: {"rank": rank, "world": part.world,
                                              "owner": dict(part.owner), "groups": groups,
                                              "keys": list(state["model"].keys()),
                                              "aliases": dict(info.get("aliases") or {}),
                                              "state_order": list(sd["state"].keys()),
                                              "param_names": [g.get("param_names")
                                                              for g in sd["param_groups"]]}})
    return out


def cut_group(group: dict, new_index: dict[int, int]) -> dict:
    """A param group of a part: its ``params`` (and ``param_names``) cut to the indices in
    ``new_index`` (old index -> the part's index), renumbered."""
    out = dict(group, params=[new_index[i] for i in group["params"] if i in new_index])
    if "param_names" in group:  # optimizers built from named parameters (torch >= 2.6): the
        # names the optimizer was given, parallel to "params" (not necessarily the model's)
        out["param_names"] = [n for i, n in zip(group["params"], group["param_names"])
                              if i in new_index]
    return out


def _drop_aliases(model: Any, info: dict, owned: set[str]) -> Any:
    """Tied entries (aliases of a parameter) travel with their parameter's owner."""
    aliases = info.get("aliases") or {}
    drop = {a for a, c in aliases.items() if c not in owned}
    if not drop:
        return model
    kept = type(model)((k, v) for k, v in model.items() if k not in drop)
    if hasattr(model, "_metadata"):
        kept._metadata = model._metadata
    return kept


def split_grads(grads: Sequence[Any], part: Partition, rank: int, names: Sequence[str]) -> list[Any]:
    """A delta record's gradient list (one entry per parameter, optimizer order) cut to the
    owned parameters."""
    return [g for g, n in zip(grads, names) if part.owner[n] == rank]


def partition_of(state: Any) -> dict | None:
    """The ``partition`` section of a part, or None for a whole state."""
    info = state.get(REPLAY_KEY) if isinstance(state, dict) else None
    return info.get(PARTITION_KEY) if isinstance(info, dict) else None


def whole_optimizer(found: dict[int, Any], state_order: Sequence[int] | None,
                    groups: Sequence[Sequence[str]], templates: Sequence[dict],
                    param_names: Sequence[Any] | None) -> dict:
    """The whole model's optimizer state_dict from the per-parameter states ``found`` (keyed by
    index in the whole optimizer order, the names of ``groups`` flattened): states in the
    trainer's ``state_order`` (those it does not list after, ascending), one param group per
    ``templates`` entry (a part's group: hyperparameters) listing its parameters' whole-model
    indices, with the trainer's ``param_names`` where it gave them. Shared by partition merges
    and the completion of sharded parts (replay/shards.py)."""
    order = [i for i in (state_order or []) if i in found]
    state = {i: found[i] for i in order + sorted(set(found) - set(order))}
    index = {n: i for i, n in enumerate(n for g in groups for n in g)}
    param_groups = []
    for g, gnames, pnames in zip(templates, groups, param_names or [None] * len(groups)):
        whole = dict(g, params=[index[n] for n in gnames])
        if pnames is not None:
            whole["param_names"] = list(pnames)
        param_groups.append(whole)
    return {"state": state, "param_groups": param_groups}


def merge_parts(parts: Sequence[dict], local: int = 0) -> dict:
    """The whole Checkpointer state from every rank's part of one iteration (rank order).
    Buffers, RNG states, the scheduler and the rest come from part ``local`` (a rank restores its
    own RNG states; a single reader takes rank 0's)."""
    sections = [partition_of(p) for p in parts]
    first = sections[0]
    if first is None or any(s is None for s in sections):
        raise DamagedCheckpointError("not every rank's state is a partition of one state")
    world = first["world"]
    if len(parts) != world or [s["rank"] for s in sections if s] != list(range(world)) or \
            any(s["owner"] != first["owner"] or s["groups"] != first["groups"] for s in sections if s):
        raise DamagedCheckpointError(f"the {len(parts)} parts do not form one partition of "
                                     f"{world} ranks")
    groups: list[list[str]] = first["groups"]
    owner: dict[str, int] = first["owner"]
    names = [n for g in groups for n in g]
    base = parts[local]
    index_in_part: list[dict[str, int]] = []  # per rank: name -> index in its part's optimizer
    for p in parts:
        own_names = [n for g in p[REPLAY_KEY]["groups"] for n in g]
        index_in_part.append({n: i for i, n in enumerate(own_names)})
    aliases: dict[str, str] = dict(first.get("aliases") or {})  # tied entries, all ranks'
    model = type(base["model"])()
    for k in first["keys"]:  # the trainer's state_dict order
        name = aliases.get(k, k)  # a tied entry is its parameter, from the parameter's owner
        src = parts[owner[name]]["model"] if name in owner else base["model"]
        if name not in src:
            raise DamagedCheckpointError(f"no part holds model entry {k!r}")
        model[k] = src[name]
    if hasattr(base["model"], "_metadata"):
        model._metadata = base["model"]._metadata
    found: dict[int, Any] = {}
    for i, n in enumerate(names):
        s = parts[owner[n]]["optimizer"]["state"].get(index_in_part[owner[n]][n])
        if s is not None:
            found[i] = s
    out = dict(base)
    out["model"] = model
    out["optimizer"] = whole_optimizer(found, first.get("state_order"), groups,
                                       base["optimizer"]["param_groups"], first.get("param_names"))
    info = {k: v for k, v in base[REPLAY_KEY].items() if k != PARTITION_KEY}
    out[REPLAY_KEY] = dict(info, groups=groups, aliases=aliases)
    return out
