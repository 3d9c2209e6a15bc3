"""The Checkpointer's argument checks: each bad value raises a typed error naming the argument
(CheckpointPlanError, a ValueError, for the policy's arguments; ValueError for the others), before
anything is written. Pure functions of the arguments (and, for a job store, its world size)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import CheckpointPlanError
from ..format.delta import OPTIMIZER_NAMES

#: the Checkpointer's policies (what it writes; :mod:`ckptstore.torch.plan`)
POLICIES = ("auto", "every-iteration", "snapshots")


def is_replayable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether replay knows ``optimizer``'s step: one of torch.optim's, not a subclass."""
    name = type(optimizer).__name__
    return name in OPTIMIZER_NAMES and type(optimizer) is getattr(torch.optim, name, None)


def check_policy_args(policy: str | None, snapshot_every: int | None, mtbf_s: float | None,
                      disk_budget: int | None, measure_steps: int) -> None:
    """CheckpointPlanError naming the first bad argument (before anything is written)."""
    if policy is not None and policy not in POLICIES:
        raise CheckpointPlanError(f"policy must be one of {', '.join(map(repr, POLICIES))} "
                                  f"(or None: the default), not {policy!r}")
    if mtbf_s is not None and (isinstance(mtbf_s, bool) or not isinstance(mtbf_s, (int, float))
                               or not math.isfinite(mtbf_s) or mtbf_s <= 0):
        raise CheckpointPlanError(f"mtbf_s must be a finite number of seconds > 0 or None, "
                                  f"not {mtbf_s!r}")
    if disk_budget is not None and (type(disk_budget) is not int or disk_budget <= 0):
        raise CheckpointPlanError(f"disk_budget must be a positive int (bytes) or None, "
                                  f"not {disk_budget!r}")
    if snapshot_every is not None and (type(snapshot_every) is not int or snapshot_every < 1):
        raise CheckpointPlanError(f"snapshot_every must be a positive int or None, "
                                  f"not {snapshot_every!r}")
    if snapshot_every is not None and policy == "every-iteration":
        raise CheckpointPlanError('snapshot_every: policy="every-iteration" writes no periodic '
                                  'snapshots (use policy="snapshots" or "auto")')
    if type(measure_steps) is not int or measure_steps < 1:
        raise CheckpointPlanError(f"measure_steps must be a positive int, not {measure_steps!r}")


def check_step_args(base_every: Any, group_commit: Any, group_seconds: Any,
                    capture: Any) -> int | str | None:
    """ValueError naming the first bad one of the delta path's arguments; returns ``base_every``
    with "follower" spelled None (the same: the follower writes the periodic bases)."""
    if base_every == "follower":
        base_every = None
    if base_every is not None and base_every != "auto" and \
            (type(base_every) is not int or base_every < 1):
        raise ValueError('base_every must be a positive int, "auto", None or "follower"')
    if type(group_commit) is not int or group_commit < 1:
        raise ValueError("group_commit must be a positive int")
    if group_seconds is not None and (isinstance(group_seconds, bool) or
                                      not isinstance(group_seconds, (int, float)) or
                                      not group_seconds >= 0):
        raise ValueError("group_seconds must be a non-negative number or None")
    if capture not in ("lend", "hooks", "step"):
        raise ValueError('capture must be "lend", "hooks" or "step"')
    return base_every
