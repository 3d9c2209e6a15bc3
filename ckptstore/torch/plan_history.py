"""The persisted plan field and the failure history it carries (issue 30).

Every base the Checkpointer writes under policy "auto" or "snapshots" carries
:meth:`~ckptstore.torch.auto_policy.AutoPolicy.persisted` under :data:`PLAN_KEY`
(format-spec/deltas.md, "Persisted plan"): the failure history (restarts, since when) and, once
planned, the cost medians the plan was made from. This module holds what reads it back and what
turns a history into a failure rate:

* :func:`parse_persisted`: a field checked before anything in it reaches the planner (a hostile
  or damaged field is a ValueError naming what is wrong: the caller measures again);
* :func:`learned_mtbf`: restarts over the time they happened in, one implementation for both
  kinds of store;
* :func:`job_restarts`: a job store's restarts, its epochs.
"""

from __future__ import annotations

import time
from typing import Any

from .plan import MODES, CostMeter

#: the base snapshot's key of the persisted plan (format-spec/deltas.md)
PLAN_KEY = "ckptstore.plan"
PLAN_VERSION = 1
#: the newest ``since_ns`` a persisted plan may hold ahead of this machine's clock (clock skew)
_CLOCK_SKEW_NS = 600 * 10**9
#: the largest persisted cost believed: seconds (11.6 days per step or save), bytes (1 EiB)
_MAX_SECONDS = 1e6
_MAX_BYTES = float(2 ** 60)
_MAX_RESTARTS = 10 ** 9


def learned_mtbf(restarts: int, since_ns: int, what: str,
                 now_ns: int | None = None) -> tuple[float, str] | None:
    """(MTBF seconds, where it comes from) for ``restarts`` restarts since ``since_ns`` (wall
    clock, ns since the epoch), or None when that teaches nothing (no restart, no time)."""
    now = time.time_ns() if now_ns is None else now_ns
    span = (now - since_ns) / 1e9 if since_ns else 0.0
    if restarts < 1 or span <= 0:
        return None
    return span / restarts, f"learned: {restarts} restart(s) of {what} in {span / 3600:.2f} h"


def job_restarts(view: Any) -> tuple[int, int]:
    """(restarts, since when in ns) a job store's global logs show: each epoch on the chain is one
    open of the job, except the first one counted, an epoch written by gc (a *generation*: its
    commits were copied, so its first commit is older than its EPOCH record) and the epoch the
    job opened right after its own gc (``JobStore.gc`` on a writer, automatic retention). A gc
    deletes the epochs it replaces, so restarts are known only since the newest generation:
    ``since`` is its EPOCH's time (else the oldest commit's; 0: nothing committed). A job that
    restarted right after an offline gc is not counted either: the count errs low."""
    chain = list(view.chain)

    def generation(e: int) -> bool:
        scan = view.logs.get(e)
        return bool(scan is not None and scan.epoch is not None and scan.commits and
                    scan.commits[0][0].created_ns < scan.epoch.created_ns)

    start = max((i for i, e in enumerate(chain) if generation(e)), default=None)
    if start is not None:
        opens = chain[start + 2:]  # (start + 1: the job's own epoch after its gc)
        scan = view.logs[chain[start]]
        return len(opens), scan.epoch.created_ns
    since = min((g.created_ns for g in view.commits.values()), default=0)
    return max(0, len(chain) - 1), since


def _int(name: str, v: Any, lo: int) -> int:
    if type(v) is not int or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, not {v!r}")
    return v


def parse_persisted(field: Any, now_ns: int | None = None) -> tuple[int, int, dict | None]:
    """``(restarts, since_ns, cost medians or None)`` from a persisted plan field, checked:
    ValueError naming what is wrong (a hostile or damaged field must not reach the planner)."""
    if type(field) is not dict:
        raise ValueError(f"not a dict but {type(field).__name__}")
    if field.get("v") != PLAN_VERSION:
        raise ValueError(f"version {field.get('v')!r}, not {PLAN_VERSION}")
    restarts = _int("restarts", field.get("restarts"), 0)
    if restarts > _MAX_RESTARTS:
        raise ValueError(f"restarts {restarts} is beyond {_MAX_RESTARTS}")
    since = _int("since_ns", field.get("since_ns"), 1)
    now = time.time_ns() if now_ns is None else now_ns
    if since > now + _CLOCK_SKEW_NS:
        raise ValueError(f"since_ns {since} is in the future")
    costs = field.get("costs")
    if costs is not None:
        CostMeter().seed(costs)  # (raises ValueError for a bad one)
        for kind, v in costs.items():
            top = _MAX_BYTES if kind.endswith("bytes") else _MAX_SECONDS
            if v > top:
                raise ValueError(f"{kind} {v!r} is beyond {top:g}")
        if field.get("mode") not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {field.get('mode')!r}")
        _int("interval", field.get("interval"), 1)
    return restarts, since, costs
