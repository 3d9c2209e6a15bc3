"""A writing job's own gc: the ranks' agreement on its plan and outcome, and its automatic
retention schedule (format-spec/format.md §22.7; :meth:`JobStore.gc` on a writer,
:meth:`JobStore.set_retention`).

:func:`collect_while_writing` runs the steps; the job store passes in how its own stream is
closed and its next epoch started (what touches its writer's state stays in
:class:`~.job_store.JobStore`). The exchanges between the steps:

1. :func:`agree_gc_plan`: rank 0 plans over its view and tells every rank whether the gc runs
   (a report to return at once when the plan removes nothing, or the planning error, raised on
   every rank);
2. :func:`run_and_tell`: once every stream is closed, rank 0 runs the offline protocol and
   broadcasts its report (JSON) or its error (one line, rebuilt typed on the other ranks:
   :func:`~ckptstore.errors.rebuild`).

:class:`GcTrash` deletes what a gc moved off every chain while the job trains on.

:class:`RetentionSchedule` counts the bases a job saves and says when retention is due.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..errors import describe, rebuild
from ..ops.retention import Policy
from ..storage.fileops import FileOps
from .group import RankGroup
from ..ops.gc import skipped_bases
from .job_gc import (JobGcReport, collect_job, job_bytes, plan_job_gc, rebasing,
                     report_from_json, report_to_json)

if TYPE_CHECKING:
    from .job_store import JobStore

log = logging.getLogger("ckptstore")


def agree_gc_plan(group: RankGroup, job: "JobStore", policy: Policy,
                  now_ns: int | None, follower_bases: bool = False) -> JobGcReport | None:
    """Collective, step 2 of the job's own gc: rank 0 plans (:func:`~.job_gc.plan_job_gc`;
    ``follower_bases``: verifying the follower bases as the gc does) and
    broadcasts. Returns None when the gc runs, else the report every rank returns (the plan
    removes nothing); raises rank 0's planning error on every rank (RetentionError: the policy
    selects nothing)."""
    if group.rank != 0:
        msg = group.broadcast(None, "the job's gc plan")
        if msg[:1] == b"\x00":
            raise rebuild(0, msg[1:].decode(errors="replace"))
        return report_from_json(msg[1:]) if msg[:1] == b"\x01" else None
    t0 = time.perf_counter()
    try:
        with rebasing(job, follower_bases) as rebase:
            plan = plan_job_gc(job, policy, now_ns, rebase)
            skipped = skipped_bases(rebase)
        size = job_bytes(job.layout)
        skip = None if plan is not None and plan.removed else JobGcReport(
            plan.kept if plan else [], [], size, size, time.perf_counter() - t0,
            policy=str(policy), added=plan.added if plan else (),
            why=dict(plan.why) if plan else {},
            unchanged=tuple(plan.unchanged) if plan else (),
            world_size=plan.world_size if plan else None, rebase_skipped=skipped)
        group.broadcast(b"\x02" if skip is None else b"\x01" + report_to_json(skip),
                        "the job's gc plan")
    except Exception as e:  # noqa: BLE001 - every rank raises it
        group.broadcast(b"\x00" + describe(e).encode(), "the job's gc plan")
        raise
    return skip


def run_and_tell(group: RankGroup, collect: Callable[[], JobGcReport]
                 ) -> tuple[JobGcReport | None, BaseException | None]:
    """Collective, step 4 of the job's own gc: rank 0 runs ``collect`` (the offline protocol)
    and broadcasts its outcome. Returns (the report, None) or (None, the gc's error) on every
    rank; the caller starts its new epoch before raising the error (the store stays
    writable)."""
    if group.rank != 0:
        msg = group.broadcast(None, "the job's gc")
        if msg[:1] == b"\x01":
            return report_from_json(msg[1:]), None
        return None, rebuild(0, msg[1:].decode(errors="replace"))
    try:
        report = collect()
    except Exception as e:  # noqa: BLE001 - every rank raises it, after its new epoch
        group.broadcast(b"\x00" + describe(e).encode(), "the job's gc")
        return None, e
    group.broadcast(b"\x01" + report_to_json(report), "the job's gc")
    return report, None


class GcTrash:
    """A job's ``gc-trash/`` (what its own gc moved off every chain): deleted in a thread while
    the job trains on (:meth:`empty`), joined before the next gc and at close (:meth:`join`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.thread: threading.Thread | None = None

    def empty(self) -> None:
        if os.path.isdir(self.path):
            self.thread = threading.Thread(target=shutil.rmtree, args=(self.path,),
                                           kwargs={"ignore_errors": True},
                                           name="ckptstore-gc-trash")
            self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def collect_while_writing(job: "JobStore", group: RankGroup, policy: Policy, now_ns: int | None,
                          progress: Callable[[int], None] | None, *, trash: GcTrash,
                          close_writer: Callable[[], None], start_epoch: Callable[[], None],
                          open_reader: Callable[[str], Any], file_ops: FileOps,
                          follower_bases: bool = False) -> JobGcReport:
    """A writing job's own gc (:meth:`JobStore.gc` on a writer; collective: every rank, the
    same policy, between saves). In order:

    1. every rank commits what it has pending (one round: ``job.flush()``);
    2. rank 0 plans (:func:`~ckptstore.multirank.job_gc.plan_job_gc`, over its view) and
       tells the others whether the gc runs (:func:`agree_gc_plan`); when the plan removes
       nothing, or fails (RetentionError: the policy selects nothing), nothing more happens:
       the job writes on in its epoch, every rank returns that report or raises that error;
    3. every rank closes its stream, rank 0 its epoch's log (``close_writer``; the rank group
       stays), and the ranks tell each other (a gather): from here no stream of the job is open
       for writing on any rank, so rank 0's gc finds no LOCK held by the job;
    4. rank 0 runs the offline protocol (:func:`~ckptstore.multirank.job_gc.collect_job`,
       format §22.7: its crash guarantees are those of any job-store gc, readers opened with
       ``open_reader``), starts emptying ``trash`` and broadcasts its report or its error
       (:func:`run_and_tell`). The other ranks wait up to the group's ``commit_timeout``;
    5. every rank starts a new writer epoch as a job open does (``start_epoch``): it adopts
       the gc's epoch (or, when the gc failed before its commit point, the old state). Its
       streams are new: as after any open, each rank's next checkpoint must be a snapshot
       (automatic retention runs right before one).

    Returns the gc's :class:`~ckptstore.multirank.job_gc.JobGcReport` on every rank; raises
    the gc's error on every rank (after step 5: the store stays writable), or what a round,
    a collective or step 5 raise (a dead rank: the store is then broken, as after a failed
    open)."""
    job.flush()
    skip = agree_gc_plan(group, job, policy, now_ns, follower_bases)
    if skip is not None:
        return skip
    trash.join()  # the previous gc's (rank 0)
    close_writer()
    group.all_gather(b"", "the job's gc (every stream closed)")

    def collect() -> JobGcReport:
        report = collect_job(job.path, policy, open_reader, file_ops=file_ops, now_ns=now_ns,
                             progress=progress, remove_trash=False,
                             follower_bases=follower_bases)
        trash.empty()
        return report

    report, outcome = run_and_tell(group, collect)
    start_epoch()
    if outcome is not None:
        raise outcome
    assert report is not None
    return report


@dataclass(frozen=True)
class JobRetentionRun:
    """One automatic retention run of a job (:meth:`JobStore.set_retention`): ``after`` is the
    base snapshot saved right after it (None: a save that failed on this rank); ``report`` the gc's
    (:class:`~ckptstore.multirank.job_gc.JobGcReport`), or ``error`` why it failed (nothing
    removed then; the job store stays consistent, as after any failed gc)."""

    after: int | None
    report: Any
    error: BaseException | None
    seconds: float


def check_retention_args(policy: Any, every: Any) -> None:
    """TypeError/ValueError for a retention policy or a run interval a job cannot take."""
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"retention must be a retention policy (ckptstore.ops.retention), "
                        f"not {policy!r}")
    if type(every) is not int or every < 1:
        raise ValueError(f"retention_every must be an int >= 1 (bases between runs), not {every!r}")


class RetentionSchedule:
    """A job's automatic retention: ``policy`` runs before every ``every``-th base snapshot after
    the first (bases counted from construction)."""

    def __init__(self, policy: Policy, every: int) -> None:
        check_retention_args(policy, every)
        self.policy, self.every = policy, every
        self.bases = 0

    def before_base(self, iteration: int | None, collect: Callable[[Policy], Any],
                    job_broken: Callable[[], bool], path: str) -> JobRetentionRun | None:
        """A base snapshot of ``iteration`` is about to be saved (on every rank): run
        ``collect(policy)`` (the job's own gc) when it is due, then count the base. Returns the
        run (None: none was due). A failed gc is logged and returned, never raised, unless
        ``job_broken()`` says the job itself broke (a dead rank): that is raised, as any save
        would."""
        due = self.bases > 0 and self.bases % self.every == 0
        self.bases += 1
        if not due:
            return None
        t0 = time.perf_counter()
        report: Any = None
        error: BaseException | None = None
        try:
            report = collect(self.policy)
        except Exception as e:  # noqa: BLE001 - kept and logged, unless the job itself broke
            if job_broken():
                raise
            error = e
            log.warning("ckptstore: automatic retention before base %s of job store %s failed, "
                        "nothing removed: %s", iteration, path, e)
        if report is not None and report.removed:
            log.info("ckptstore: retention before base %s removed %d iterations of job store "
                     "%s", iteration, len(report.removed), path)
        return JobRetentionRun(iteration, report, error, time.perf_counter() - t0)
