"""A multi-rank save's plans: the store key of every write item, given to each rank's plan by the
coordinator (``prepare_global_plan``) and checked by the rank that writes them, and DCP's
metadata of the whole save made from the global plan. Pure functions of DCP's plans, no I/O."""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from typing import TYPE_CHECKING, Any, Sequence

from ...errors import DCPError
from .metadata import FORMAT

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem


def _storage_key(index: MetadataIndex, taken: dict[str, Any]) -> str:
    """The store key of a write item: its fqn, ``@offsets`` appended for a chunk away from the
    origin, ``#`` appended while the key is taken."""
    key = index.fqn
    if index.offset is not None and any(index.offset):
        key += "@" + ",".join(str(int(n)) for n in index.offset)
    while key in taken:
        key += "#"
    return key


def assign_keys(items: Sequence[WriteItem]) -> list[str]:
    """The store keys of one rank's write items, in plan order (:func:`_storage_key`): a pure
    function of the items, so the coordinator and the rank that writes them agree."""
    taken: dict[str, None] = {}
    for item in items:
        taken[_storage_key(item.index, taken)] = None
    return list(taken)


def _offset_of(index: MetadataIndex) -> list[int] | None:
    return None if index.offset is None else [int(n) for n in index.offset]


def _check_coverage(md: Metadata, storage: dict[Any, tuple[int, str]]) -> None:
    """Every item DCP's metadata names has exactly one writer in the global plan, and nothing
    else is written."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    want = set()
    for fqn, v in md.state_dict_metadata.items():
        if isinstance(v, BytesStorageMetadata):
            want.add(MetadataIndex(fqn))
        else:
            want.update(MetadataIndex(fqn, c.offsets) for c in v.chunks)
    have = set(storage)
    if want != have:
        lost, extra = sorted(i.fqn for i in want - have), sorted(i.fqn for i in have - want)
        raise DCPError(f"DCP's metadata and the global plan disagree: {len(lost)} items no rank "
                       f"writes {lost[:5]}, {len(extra)} writes the metadata lacks {extra[:5]}")


def plan_keys(plans: list[SavePlan], coordinator: int | None) -> list[SavePlan]:
    """Every rank's plan with the store keys of its items as ``storage_data`` (JSON-like; the
    coordinator's, in its ``prepare_global_plan``)."""
    out = []
    for r, plan in enumerate(plans):
        if not getattr(plan, "usable", True):
            # DCP's plan cache: that rank reuses its cached final plan, whose storage data was
            # made here from the same items
            out.append(plan)
            continue
        keys = assign_keys(plan.items)
        data = {"format": FORMAT, "rank": r, "coordinator": coordinator,
                "keys": [[item.index.fqn, _offset_of(item.index), key]
                         for item, key in zip(plan.items, keys)]}
        out.append(dataclasses.replace(plan, storage_data=data))
    return out


def keys_of(plan: SavePlan, rank: int | None) -> list[str]:
    """The store keys the coordinator gave this rank's items (checked against the items)."""
    data = plan.storage_data
    rows = data.get("keys") if type(data) is dict and data.get("format") == FORMAT else None
    if type(rows) is not list or data.get("rank") != rank or \
            type(data.get("coordinator")) is not int:
        raise DCPError(f"rank {rank}: the plan DCP passed to write_data carries no "
                       "store keys for this rank from ckptstore.dcp's prepare_global_plan")
    if len(rows) != len(plan.items) or any(
            type(row) is not list or len(row) != 3 or row[0] != item.index.fqn
            or row[1] != _offset_of(item.index) or type(row[2]) is not str
            for row, item in zip(rows, plan.items)):
        raise DCPError(f"rank {rank}: the plan's items are not those the "
                       "coordinator planned (a planner's finish_plan changed them?)")
    return [row[2] for row in rows]


def global_metadata(plans: list[SavePlan] | None, planner: SavePlanner, world_size: int | None
                    ) -> tuple[Metadata, dict[Any, tuple[int, str]]]:
    """DCP's metadata of the whole save (the Metadata DCP passes to ``finish``) and the storage
    map naming the rank and key of every item, from the global plan ``plans`` (the coordinator's
    :func:`plan_keys`)."""
    from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner,
                                                              create_default_global_save_plan)
    from torch.distributed.checkpoint.metadata import Metadata

    if plans is None or not all(getattr(p, "usable", True) for p in plans):
        # DCP's plan cache sent unusable plans: the default planner holds the full ones
        plans = getattr(planner, "global_plan", None) \
            if isinstance(planner, DefaultSavePlanner) else None
        if type(plans) is not list or len(plans) != world_size:
            raise DCPError("the coordinator has no global plan of every rank (a planner with "
                           "plan caching that is not a DefaultSavePlanner?)")
    storage: dict[Any, tuple[int, str]] = {}
    for r, p in enumerate(plans):
        for item, key in zip(p.items, assign_keys(p.items)):
            storage[item.index] = (r, key)
    md: Any = None
    if isinstance(planner, DefaultSavePlanner) and \
            type(planner).create_global_plan is DefaultSavePlanner.create_global_plan:
        md = getattr(planner, "metadata", None)   # the Metadata DCP passes to finish()
    if not isinstance(md, Metadata):
        _, md = create_default_global_save_plan(list(plans), rewrite_index_hints=False)
        data = [p.planner_data for p in plans]
        if data and all(isinstance(d, dict) for d in data):
            md.planner_data = dict(ChainMap(*data))
    _check_coverage(md, storage)
    return md, storage
