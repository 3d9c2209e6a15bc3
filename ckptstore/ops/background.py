"""A writer's background work: the asynchronous save pipeline (:mod:`ckptstore.ops.pipeline`,
started on first use) and the group-commit timer (:mod:`ckptstore.ops.grouptimer`), with what
:class:`ckptstore.Store` needs to order its synchronous calls after them and to report their
failures.

Invariants:

* at most one pipeline per writer, created under the writer's lock (double-checked: the
  persister holds that lock while it writes, so a started pipeline is returned without it);
* a timer commit is queued behind the pipeline's jobs when a pipeline runs (iteration order),
  else committed under the writer's lock;
* a background failure is raised once: by :meth:`BackgroundWork.check` (the timer's is then
  forgotten), or returned by :meth:`BackgroundWork.stop` at close.

Call sequence (from the Store):

1. :meth:`BackgroundWork.pipeline_of` on the first async save; :meth:`set_group_seconds`;
2. before each call: :meth:`check`; before a synchronous write :meth:`drain`, before a read
   of an iteration :meth:`await_inflight`, on flush :meth:`flush`;
3. at close: :meth:`stop` (timer first, then the pipeline), before the writer lock is taken.
"""

from __future__ import annotations

from typing import Any, Callable

from ..engine.engine import Engine
from ..engine.writer_engine import WriterEngine
from .grouptimer import GroupTimer
from .pipeline import AsyncStats, Pipeline

__all__ = ["BackgroundWork", "check_group_seconds"]


class BackgroundWork:
    """The pipeline and group timer of one store (both None until started). ``commit_round``:
    how the pipeline runs a committing job (a multi-rank store's global round; then
    ``after_snapshot``, the automatic retention hook, is not installed)."""

    def __init__(self, name: str, host_budget: int | None, max_inflight: int | None,
                 commit_round: Callable[[Callable[[], Any]], Any] | None,
                 after_snapshot: Callable[[int], None]) -> None:
        self.name = name
        self._limits = (host_budget, max_inflight)
        self._commit_round = commit_round
        self._after_snapshot = after_snapshot
        self._pipeline: Pipeline | None = None
        self._timer: GroupTimer | None = None

    @property
    def running(self) -> Pipeline | None:
        """The pipeline if an async save started it, else None (never starts it)."""
        return self._pipeline

    def pipeline_of(self, writer: WriterEngine) -> Pipeline:
        """The pipeline of ``writer``, started on first use."""
        if self._pipeline is not None:  # no lock: the persister holds it while it writes
            return self._pipeline
        with writer.locked():
            if self._pipeline is None:
                budget, inflight = self._limits
                self._pipeline = Pipeline(writer, host_budget=budget, max_inflight=inflight,
                                          commit_round=self._commit_round)
                if self._commit_round is None:
                    self._pipeline.after_snapshot = self._after_snapshot
            return self._pipeline

    def check(self) -> None:
        """Raise a background failure not reported yet (the timer's is then forgotten)."""
        if self._pipeline is not None:
            self._pipeline.check()
        if self._timer is not None and self._timer.error is not None:
            err = self._timer.take_error()
            if err is not None:
                raise err

    def stop(self, closed: bool) -> BaseException | None:
        """At close: stop the timer (a timer commit in progress finishes first), then, unless
        the store is ``closed`` already, close the pipeline (waits for in-flight saves). Returns
        the first failure not reported before, for the caller to raise once its files are
        released."""
        err: BaseException | None = None
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.stop()
            err = timer.take_error()
        if self._pipeline is not None and not closed:
            try:
                self._pipeline.close()
            except BaseException as e:  # noqa: BLE001 - returned, raised by the caller
                err = err or e
        return err

    def flush(self) -> None:
        """Wait for every in-flight async save (and commit async deltas)."""
        if self._pipeline is not None:
            self._pipeline.flush()

    def drain(self) -> None:
        """Before a synchronous write: wait for the pipeline (and raise its failure)."""
        if self._pipeline is not None:
            self._pipeline.drain()

    def await_inflight(self, engine: Engine, iteration: Any) -> None:
        """A read of an iteration still in the pipeline waits until it is committed (flushing
        its delta group). Never called with the engine lock held."""
        p = self._pipeline
        if p is not None and type(iteration) is int and engine.index.get_commit(iteration) is None:
            tail = p.tail()
            if tail is not None and iteration <= tail:
                p.flush()

    def pending(self, staged: list[int]) -> list[int]:
        """``staged`` (the writer's pending deltas) with the pipeline's."""
        if self._pipeline is None:
            return staged
        return sorted(set(staged).union(self._pipeline.pending_deltas()))

    def stats(self) -> list[AsyncStats]:
        return [] if self._pipeline is None else self._pipeline.stats()

    def set_limits(self, host_budget: int | None, max_inflight: int | None) -> None:
        budget, inflight = self._limits
        self._limits = (host_budget or budget, max_inflight or inflight)
        if self._pipeline is not None:
            self._pipeline.set_limits(host_budget, max_inflight)

    def set_group_seconds(self, writer: WriterEngine, seconds: float | None) -> None:
        """Start, retune or (None) stop the group timer of ``writer``; stopping joins the timer
        and raises its failure not reported yet. Not under the writer's lock."""
        timer = self._timer
        if seconds is None:
            if timer is not None:
                self._timer = None
                writer.on_new_group = None
                timer.stop()
                err = timer.take_error()
                if err is not None:
                    raise err
        elif timer is not None:
            timer.set_seconds(seconds)
        else:
            self._timer = GroupTimer(writer.group_since,
                                     lambda since: self._commit_due_group(writer, since),
                                     seconds, name=self.name)
            writer.on_new_group = self._timer.poke

    def _commit_due_group(self, writer: WriterEngine, since: float) -> None:
        """The group timer's commit of the group begun at ``since``: queued behind the
        pipeline's jobs when it runs (iteration order), else committed here under the lock."""
        with writer.locked():
            if self._pipeline is not None:
                self._pipeline.request_flush()
            else:
                writer.commit_group_begun_at(since)


def check_group_seconds(seconds: Any) -> None:
    """ValueError unless ``seconds`` is a non-negative number or None."""
    if seconds is not None and (isinstance(seconds, bool) or
                                not isinstance(seconds, (int, float)) or not seconds >= 0):
        raise ValueError(f"group_seconds must be a non-negative number or None, not {seconds!r}")
