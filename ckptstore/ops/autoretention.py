"""Automatic retention of one writer (:meth:`ckptstore.Store.set_retention`, or ``retention=`` /
``retention_every=`` at open): a gc with a retention policy right after every ``every``-th base
snapshot the writer commits.

Invariants:

* it never runs inside a save: a base commit also commits every pending delta, so no transaction
  is open; a delta group opened after the base (not possible from the async pipeline, which runs
  it before its next job) makes the run a no-op, never a commit on the trainer's behalf;
* it runs in the thread that committed the base (the pipeline's persister, or the caller of a
  synchronous save), under the writer's lock;
* it compacts only when the policy removes something (``only_if_removing``);
* it never raises: a failure is logged (logger ``ckptstore``, WARNING) and kept in
  :attr:`AutoRetention.last`; nothing is removed then.

Call sequence:

1. at open / :meth:`~ckptstore.Store.set_retention`: :func:`check_every`, :func:`check_retention`,
   then :meth:`AutoRetention.set` (which restarts the count of bases);
2. after each base snapshot commit: :meth:`AutoRetention.after_base`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..engine.writer_engine import WriterEngine
from ..errors import ReadOnlyStoreError, RetentionError
from .gc import GcReport, collect
from .retention import Policy

__all__ = ["AutoRetention", "RetentionRun", "check_every", "check_retention"]

log = logging.getLogger("ckptstore")


@dataclass(frozen=True)
class RetentionRun:
    """One automatic retention run (:meth:`Store.set_retention`): ``after`` is the base snapshot
    whose commit triggered it; ``report`` what the gc did (``report.compacted`` False: the policy
    removed nothing, nothing was written), or ``error`` why it failed (nothing removed then;
    the store stays consistent, as after any failed gc)."""

    after: int
    report: GcReport | None
    error: BaseException | None
    seconds: float


class AutoRetention:
    """The automatic retention state of one store: its policy, every how many bases it runs,
    the bases counted since it was set, and the last run. ``meta_cache`` is the store's cache of
    decoded metas, shared with its explicit gc."""

    def __init__(self, path: str, meta_cache: dict[int, Any]) -> None:
        self.path = path
        self.meta_cache = meta_cache
        self._setting: tuple[Policy, int] | None = None
        self._bases = 0
        #: the latest run, or None
        self.last: RetentionRun | None = None

    def set(self, policy: Policy | None, every: int) -> None:
        """Apply ``policy`` every ``every`` bases from now on (None: off); arguments checked by
        the caller (:func:`check_every`, :func:`check_retention`)."""
        self._setting = None if policy is None else (policy, every)
        self._bases = 0

    @property
    def policy(self) -> Policy | None:
        return None if self._setting is None else self._setting[0]

    def after_base(self, writer: WriterEngine, iteration: int, closed: Callable[[], bool]) -> None:
        """Called once base snapshot ``iteration`` is committed: run the gc when due. ``closed``
        tells (asked under the writer's lock) whether the store was closed meanwhile. Never
        raises."""
        setting = self._setting
        if setting is None:
            return
        policy, every = setting
        self._bases += 1
        if self._bases % every:
            return
        t0 = time.perf_counter()
        report: GcReport | None = None
        error: BaseException | None = None
        try:
            with writer.locked():
                if closed() or writer.closed:
                    return
                writer.recover_if_needed()
                if writer.group is not None:
                    # deltas appended after the base (not possible from the pipeline, which runs
                    # this before its next job): never commit them on the trainer's behalf
                    return
                report = writer.read(lambda: collect(writer, policy=policy, only_if_removing=True,
                                                     meta_cache=self.meta_cache))
        except Exception as e:  # noqa: BLE001 - logged and kept: retention never fails a save
            error = e
            log.warning("ckptstore: automatic retention after base %d of %s failed, nothing "
                        "removed: %s", iteration, self.path, e)
        self.last = RetentionRun(iteration, report, error, time.perf_counter() - t0)
        if report is not None and report.removed:
            log.info("ckptstore: retention after base %d removed %d checkpoints of %s",
                     iteration, len(report.removed), self.path)


def check_retention(policy: Any, path: str, mode: str, commit_round: Any) -> None:
    """A policy a store opened in ``mode`` (with ``commit_round``: a rank's stream) may apply:
    TypeError, ReadOnlyStoreError or RetentionError otherwise."""
    if not isinstance(policy, Policy):
        raise TypeError(f"retention must be a retention policy (ckptstore.ops.retention), "
                        f"not {policy!r}")
    if mode != "a":
        raise ReadOnlyStoreError(f'store {path} is open read-only (mode="r"): no retention')
    if commit_round is not None:
        raise RetentionError(f"{path}: a rank's stream of a multi-rank job store: retention "
                             "is the job's (JobStore.set_retention, collective on every rank)")


def check_every(every: Any) -> None:
    """ValueError unless ``every`` is an int >= 1."""
    if type(every) is not int or every < 1:
        raise ValueError(f"retention_every must be an int >= 1 (bases between runs), not {every!r}")
