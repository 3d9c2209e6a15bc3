"""One checkpoint plan for every rank of a multi-rank job store (issue 30).

Every rank of a job must write the same checkpoints (a global commit holds one record per rank
of each iteration), but each rank measures its own costs: planning from them could pick a
different mode or interval on each rank. :class:`AutoPolicy` (ckptstore/torch/auto_policy.py)
therefore makes every decision from :class:`Shared` inputs: on a single store its own; on a
multi-rank job store those :class:`RankAgreement` combines from every rank's (:func:`combine`),
identical on every rank, so every rank computes the same plan (pure arithmetic) at the same
iteration and persists the same field.

Combination (conservative, and idempotent: combining combined values again changes nothing, so
a plan resumed from a persisted field is the plan that wrote it):

- cost medians: per kind, the largest over the ranks that measured it (the slowest rank gates a
  step; the largest part bounds the bytes);
- sample counts: the smallest (a phase ends when every rank measured enough);
- MTBF: the smallest, with where that rank has it from;
- disk budget: the smallest known (None: none known), split over the ranks
  (``budget // world``: the plan's bytes are one rank's part, the job writes ``world`` of them);
- failure history: the most restarts, the oldest ``since_ns``.

Call sequence (every call a collective over the job's ranks, made at the same step by every rank:
AutoPolicy reaches its decision points by counting steps, which every rank shares):

1. ``agree(local)`` -> the :class:`Shared` every rank gets (JSON over a gloo group of its own,
   :class:`ckptstore.multirank.group.RankGroup`, created at the first call: never the store's
   group, whose commit thread may be in a round; nothing is pickled);
2. ``close()`` when the Checkpointer closes (the exit hook closes a group left open).

A rank that died or stops answering fails the others within the store's commit timeout with
RankFailureError naming the collective.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointPlanError, RankFailureError


@dataclass(frozen=True)
class Shared:
    """What one decision of the policy is made from (see the module docstring)."""
    counts: dict[str, int] = field(default_factory=dict)
    medians: dict[str, float] = field(default_factory=dict)
    mtbf_s: float = 0.0
    mtbf_source: str = ""
    budget: int | None = None
    budget_source: str = ""
    restarts: int = 0
    since_ns: int = 0

    def to_json(self) -> dict:
        return {"counts": self.counts, "medians": self.medians, "mtbf_s": self.mtbf_s,
                "mtbf_source": self.mtbf_source, "budget": self.budget,
                "budget_source": self.budget_source, "restarts": self.restarts,
                "since_ns": self.since_ns}

    @staticmethod
    def from_json(d: Any) -> Shared:
        """A peer's message, checked (ValueError naming what is wrong)."""
        if type(d) is not dict:
            raise ValueError(f"not a dict but {type(d).__name__}")
        counts, medians = d.get("counts"), d.get("medians")
        if type(counts) is not dict or not all(type(v) is int and v >= 0 for v in counts.values()):
            raise ValueError(f"counts {counts!r}")
        if type(medians) is not dict or not all(
                type(v) in (int, float) and math.isfinite(v) and v >= 0 for v in medians.values()):
            raise ValueError(f"medians {medians!r}")
        mtbf: Any = d.get("mtbf_s")
        budget: Any = d.get("budget")
        if type(mtbf) not in (int, float) or not math.isfinite(mtbf) or mtbf <= 0:
            raise ValueError(f"mtbf_s {mtbf!r}")
        if budget is not None and (type(budget) is not int or budget < 1):
            raise ValueError(f"budget {budget!r}")
        restarts, since = d.get("restarts"), d.get("since_ns")
        if type(restarts) is not int or restarts < 0 or type(since) is not int or since < 0:
            raise ValueError(f"failure history {restarts!r}, {since!r}")
        return Shared(dict(counts), {k: float(v) for k, v in medians.items()}, float(mtbf),
                      str(d.get("mtbf_source")), budget, str(d.get("budget_source")),
                      restarts, since)


def combine(proposals: list[Shared]) -> Shared:
    """The inputs every rank plans from, given each rank's ``proposals`` in rank order (pure,
    the same on every rank; see the module docstring for each rule)."""
    world = len(proposals)
    if world == 1:
        return proposals[0]
    kinds = sorted({k for p in proposals for k in p.counts})
    counts = {k: min(p.counts.get(k, 0) for p in proposals) for k in kinds}
    medians: dict[str, float] = {}
    for p in proposals:
        for k, v in p.medians.items():
            medians[k] = max(medians.get(k, v), v)
    low = min(range(world), key=lambda r: (proposals[r].mtbf_s, r))
    known = [(p.budget, r) for r, p in enumerate(proposals) if p.budget is not None]
    budget, source = None, proposals[0].budget_source
    if known:
        least, r = min(known)
        budget = max(1, least // world)
        source = f"{proposals[r].budget_source}; rank {r}'s, split over {world} ranks"
    return Shared(counts, dict(sorted(medians.items())), proposals[low].mtbf_s,
                  f"{proposals[low].mtbf_source} (rank {low}'s, the smallest)",
                  budget, source, max(p.restarts for p in proposals),
                  min(p.since_ns for p in proposals))


class RankAgreement:
    """The collective behind a multi-rank job store's plan: every rank of ``store.group`` makes
    the same calls in the same order (see the module docstring)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._group: Any = None

    def agree(self, local: Shared, when: str) -> Shared:
        """:func:`combine` of every rank's ``local`` (a collective). ``when``: the step and the
        decision, the same on every rank: a rank at another (it skipped a step, or alone called
        ``replan()``) raises CheckpointPlanError on every rank, naming it, instead of planning
        from another decision's inputs."""
        what = f"the checkpoint plan's inputs ({when})"
        group = self._group
        if group is None:
            from ..multirank.group import RankGroup
            source = self._store.group
            if source is None:
                raise RankFailureError(f"{what}: the job store {self._store.path} has no rank "
                                       "group (closed, or open read-only)")
            group = self._group = RankGroup(source.group, source.timeout,
                                            label=f"{self._store.path} (checkpoint plan)")
        raw = group.all_gather(json.dumps({"when": when, "inputs": local.to_json()}).encode(),
                               what)
        out = []
        for r, msg in enumerate(raw):
            try:
                d = json.loads(msg)
                if type(d) is not dict:
                    raise ValueError(f"not a dict but {type(d).__name__}")
                inputs = Shared.from_json(d.get("inputs"))
            except ValueError as e:  # (json.JSONDecodeError is one)
                raise RankFailureError(f"{what}: rank {r} sent a bad message ({e})") from e
            if d.get("when") != when:
                raise CheckpointPlanError(
                    f"{what}: rank {r} is at {d.get('when')!r}: every rank must step the same "
                    "iterations and call Checkpointer.replan() together")
            out.append(inputs)
        return combine(out)

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()
