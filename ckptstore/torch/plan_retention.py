"""The retention a Checkpointer derives from its plan, keeping the store within the disk budget
(:class:`PlanRetention`): set on the store whenever a plan comes into force, unless the user set
a retention.

On a multi-rank job store the retention is the job's collective gc
(:meth:`ckptstore.JobStore.set_retention`: every rank makes the same call, and the gc runs on
every rank together before the same base). Every rank derives the same call here: its plans are
agreed (:mod:`ckptstore.torch.plan_agreement`: the same plan, in force at the same iteration on
every rank), and what is set is a pure function of the plans in force so far."""

from __future__ import annotations

import logging
import math
from typing import Any

from ..errors import CkptStoreError
from ..ops.retention import KeepLast
from .plan import SNAPSHOTS, Plan

log = logging.getLogger("ckptstore")


class PlanRetention:
    """Applies the disk budget's retention to ``store`` (``enabled``: no user retention)."""

    def __init__(self, store: Any, enabled: bool) -> None:
        self.store = store
        self.enabled = enabled
        #: (keep, every) last set on the store (None: none yet)
        self.applied: tuple[int, int] | None = None
        #: the plan in force fits no checkpoint in the budget (warned; the newest alone is kept)
        self.over_budget = False

    def planned(self, plan: Plan) -> None:
        """A plan is in force: keep the store within the disk budget by the plan's retention
        ``R`` (checkpoints that fit with room for the next): ``KeepLast`` of the newest
        ``K = max(1, R // 4)`` snapshots (chains: ``(K - 1) * interval + 1`` iterations, their
        bases closed over) after every ``E = max(1, floor(0.8 * R) - K)``-th base. The store then
        holds at most ``K + E`` of them (``<= 0.8 * R`` from ``R = 3`` on) plus the one being
        written (the 20% margin
        covers record framing, manifests and the index, which the measured sizes leave out),
        and each gc, which copies what it keeps, copies ``K`` per ``E`` written (about 0.45x).

        A budget that holds no checkpoint with room for the next (``R < 1``: nothing fits, the
        plan says so) still bounds the store: it keeps the newest alone (``R = 1``: ``K = E =
        1``, a gc after every base; on a job store a collective one before every base), so it
        holds two checkpoints between gcs and three during one (the newest, the one before,
        gc's copy), more than the budget; the log says so once, when the plan first goes beyond
        it."""
        r = plan.retention
        if not self.enabled or r is None:
            return
        over = r < 1
        r = max(r, 1)
        k = max(1, r // 4)
        keep = k if plan.mode == SNAPSHOTS else (k - 1) * plan.chosen.interval + 1
        every = max(1, math.floor(0.8 * r) - k)
        applied = self.applied
        # (set_retention restarts its count of bases: a plan whose sizes jitter must not keep
        # postponing the gc, so a change of less than 10% keeps the retention in force)
        if applied is None or abs(keep - applied[0]) > 0.1 * applied[0] or \
                (applied != (keep, every) and r < 10):
            try:
                self.store.set_retention(KeepLast(keep), every)
            except CkptStoreError as e:  # (a store that refuses retention: the plan still holds)
                log.warning("Checkpointer %s: the disk budget's retention cannot be set (%s); "
                            "the store is not bounded", self.store.path, e)
                self.enabled = False
                return
            self.applied = (keep, every)
        if over and not self.over_budget:
            log.warning("Checkpointer %s: the disk budget of %d bytes (%s) holds no %s with room "
                        "for the next; keeping only the newest one (two to three times its size "
                        "on disk, more than the budget)", self.store.path, plan.disk_budget,
                        plan.budget_source, "snapshot" if plan.mode == SNAPSHOTS else "chain")
        self.over_budget = over
