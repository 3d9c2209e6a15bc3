"""A job store's history as a whole: replay over its global commits, diffs of two iterations,
bisection, the sharded layout an iteration was saved in. Functions over a :class:`~.job_store.JobStore`'s
public reads (``iterations``, ``global_commit``, ``stream``, ``reading_rank``,
``combine_parts``); its methods of the same names delegate here."""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..errors import DamagedCheckpointError, NotFoundError
from ..format.delta import REPLAY_KEY
from ..ops.diff import diff_manifests
from ..replay import replay_range
from ..replay.shards import shards_of

if TYPE_CHECKING:
    from .job_store import JobStore


class RankRecords:
    """One rank's checkpoints of a job store as a :class:`~ckptstore.replay.replayer.
    RecordSource` (what replay reads), each iteration from the stream its global commit names
    (a delta chain never crosses streams, so each chain is read from one)."""

    def __init__(self, job: "JobStore", rank: int) -> None:
        self.job, self.rank, self.mode = job, rank, job.mode

    def base_of(self, iteration: int) -> int:
        return self.job.base_of(iteration, rank=self.rank)

    def kind(self, iteration: int) -> str:
        return self.job.kind(iteration)

    def load(self, iteration: int) -> Any:
        return self.job.stream(iteration, self.rank).load(iteration)

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    into: Callable[[Any], Any] | None = None) -> Any:
        return self.job.stream(iteration, self.rank).load_record(iteration, keys, into=into)

    def consistent_reads(self) -> AbstractContextManager[Any]:
        return nullcontext()  # (each stream read is one index view; a job's view is its logs')


def replay_job(job: "JobStore", start: int, stop: int, rank: int | None = None
               ) -> Iterator[tuple[int, Any]]:
    """Yield ``(iteration, state)`` for every iteration in ``start..stop`` (inclusive), as
    :meth:`ckptstore.Store.replay` does: each rank's part is replayed incrementally within its
    stream (:func:`ckptstore.replay.replay_range`, one per rank, in step), and each iteration's
    parts are combined as :meth:`JobStore.load` combines them (with ``rank``: that rank's part
    only). The range may cross epochs and changes of world size."""
    if stop < start:
        return
    its = [it for it in job.iterations() if start <= it <= stop]
    if not its or its[0] != start or its[-1] != stop:
        missing = start if not its or its[0] != start else stop
        raise NotFoundError(f"iteration {missing} is not committed in {job.path}")
    runs: list[list[int]] = []  # consecutive iterations of one world size
    for it in its:
        w = job.global_commit(it).world_size
        if runs and job.global_commit(runs[-1][0]).world_size == w:
            runs[-1].append(it)
        else:
            runs.append([it])
    for run in runs:
        g0 = job.global_commit(run[0])
        ranks = [job.reading_rank(rank, g0)] if rank is not None else list(range(g0.world_size))
        gens = [replay_range(RankRecords(job, r), run[0], run[-1]) for r in ranks]
        try:
            for items in zip(*gens):
                it = items[0][0]
                if rank is not None:
                    yield it, items[0][1]
                else:
                    parts = {r: state for r, (_, state) in zip(ranks, items)}
                    yield it, job.combine_parts(job.global_commit(it), parts.__getitem__, None)
        finally:
            for gen in gens:
                gen.close()


def diff_job(job: "JobStore", a: int, b: int, rank: int | None = None) -> list[Any]:
    """:meth:`ckptstore.Store.diff` of what ``rank`` stored at ``a`` and ``b`` (each in its own stream). Without ``rank`` on a job of several ranks (a reader): every rank's, each
    path prefixed ``rank<r>/``; ValueError when ``a`` and ``b`` have different world sizes
    (pass ``rank=``)."""
    ga, gb = job.global_commit(a), job.global_commit(b)
    if rank is not None or job.rank is not None or ga.world_size == gb.world_size == 1:
        sa, sb = job.stream(a, rank), job.stream(b, rank)
        return diff_manifests(sa.manifest(a), sb.manifest(b), sa.engine.tree_of,
                              sb.engine.tree_of)
    if ga.world_size != gb.world_size:
        raise ValueError(f"iterations {a} and {b} of {job.path} were written at world "
                         f"sizes {ga.world_size} and {gb.world_size}: pass rank=")
    out = []
    for r in range(ga.world_size):
        for d in job.diff(a, b, rank=r):
            out.append(dataclasses.replace(d, path=f"rank{r}/{d.path}"))
    return out


def shard_sections(job: "JobStore", iteration: int) -> list[dict] | None:
    """Every rank's ``shards`` section (rank order) when ``iteration`` holds sharded
    (FSDP2 / DTensor) Checkpointer parts (format-spec/deltas.md, "Sharded states"), else
    None. A delta records no section: its base's (in the same rank stream, so the same
    layout) is read. Reads each part's replay section only, no tensor; raises
    DamagedCheckpointError when rank 0 saved a sharded part and another rank did not."""
    sections = []
    for r in range(job.global_commit(iteration).world_size):
        base = job.base_of(iteration, rank=r)
        try:
            section = shards_of(job.load_record(base, keys=[REPLAY_KEY], rank=r))
        except NotFoundError:  # a state without a replay section: not a Checkpointer's
            section = None
        if section is None:
            if r == 0:
                return None
            raise DamagedCheckpointError(f"{job.path}: iteration {iteration}: rank 0 saved "
                                         f"a sharded part, rank {r} (base {base}) did not")
        sections.append(section)
    return sections


def bisect_job(job: "JobStore", predicate: Any, start: int | None, end: int | None,
               rank: int | None) -> Any:
    """:meth:`ckptstore.Store.bisect` over the job's global commits. States are those
    :meth:`JobStore.load` returns (with ``rank``: that rank's part); meta conditions read
    ``rank``'s meta (default: the job's own rank, else rank 0). The one interval walked is
    replayed (:func:`replay_job`, with ``rank``; :mod:`ckptstore.ops.bisect`)."""
    from ..ops.bisect import bisect

    meta_rank = rank if rank is not None else (job.rank or 0)
    return bisect(job, predicate, start, end,
                  meta=lambda it: job.meta(it, rank=meta_rank),
                  load=lambda it: job.load(it, rank=rank),
                  replay=lambda lo, hi: replay_job(job, lo, hi, rank))
