"""Reading one iteration of a job store: whose records a read takes, and how the ranks' parts
become the job's state. Functions over a :class:`~.job_store.JobStore`'s public reads
(``rank``, ``path``, ``global_commit``, ``stream``); its methods of the same names delegate here.

A load without ``rank`` (:func:`load_job`), in order:

1. into preallocated targets of a sharded (FSDP2 / DTensor) iteration: only the boxes the
   targets need are read (:func:`~.dtensor_state.load_into`), nothing else;
2. otherwise every rank's state the combination needs is loaded from the stream its global
   commit names (each checked against that commit: :meth:`JobStore.stream`), a delta from the
   newest usable shadow-follower base when there is one (:func:`~.job_follower.load_part`);
3. the parts are combined (:func:`combine_parts`, :func:`~.combine.combine`), then copied
   into ``into`` when given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import NotFoundError, RankMismatchError
from ..format.job import GlobalCommit
from ..replay.follower import dropped_by_rebase
from ..tensors.inplace import copy_into
from .combine import combine
from .dtensor_state import is_sharded, load_into
from .job_follower import JobFollowerBases, JobPrimary, load_part

if TYPE_CHECKING:
    from .job_store import JobStore


def reading_rank(job: "JobStore", rank: int | None, g: GlobalCommit) -> int:
    """The rank whose records a read of ``g``'s iteration with ``rank=`` reads: ``rank``, else
    the job's own rank, else 0 on a 1-rank commit (ValueError: a reader must choose;
    RankMismatchError: no such rank in that commit)."""
    r = job.rank if rank is None else rank
    if r is None:
        if g.world_size == 1:
            return 0
        raise ValueError(f"{job.path} holds {g.world_size} ranks' states at iteration "
                         f"{g.iteration}: pass rank= (0..{g.world_size - 1})")
    if type(r) is not int or not 0 <= r < g.world_size:
        raise RankMismatchError(f"rank {r!r} is not among the {g.world_size} ranks that "
                                f"committed iteration {g.iteration} in {job.path}")
    return r


def combine_parts(job: "JobStore", g: GlobalCommit, part: Callable[[int], Any],
                  keys: Sequence[Any] | None) -> Any:
    """The job's state at ``g.iteration`` from its ranks' states (``part(r)``: rank r's), with
    the job's own rank's RNG and scheduler states when it took part (:func:`.combine.combine`)."""
    mine = job.rank if job.rank is not None and job.rank < g.world_size else None
    return combine(part, g.world_size, mine, g.iteration, keys,
                   lambda: reading_rank(job, None, g))


def load_job(job: "JobStore", iteration: int, keys: Sequence[Any] | None, rank: int | None,
             into: Any, followers: JobFollowerBases) -> Any:
    """The state at ``iteration``, bit-exact (a delta is replayed within its stream, or from
    the newest usable base of the job's shadow follower, ``followers``: format-spec/follower.md
    §7); with ``rank``: what that rank saved, else the job's state (steps 1-3 of the module
    docstring). ``into``: tensors to fill, as in :meth:`ckptstore.Store.load` (here always
    copied into once the state is combined)."""
    try:
        g = job.global_commit(iteration)
    except NotFoundError as e:
        dropped = dropped_by_rebase(JobPrimary(job), iteration)  # (a rebasing gc's: it says so)
        if dropped is None:
            raise
        raise dropped from e
    if into is not None and rank is None and is_sharded(job, iteration):
        return load_into(job, iteration, into, keys)[0]  # reads only the targets' boxes
    if rank is not None:
        state = load_part(job, followers, g, reading_rank(job, rank, g), keys)
    else:
        state = combine_parts(job, g, lambda r: load_part(job, followers, g, r, None), keys)
    return state if into is None else copy_into(state, into)


def base_rank(job: "JobStore", iteration: int, rank: int | None) -> int:
    """The rank whose stream answers where ``iteration``'s load starts: ``rank``; without it
    any rank answers (every rank saves its bases at the same iterations: saves are collective,
    and each epoch's streams begin with one), so the job's own rank when it took part, else 0."""
    if rank is not None:
        return rank
    g = job.global_commit(iteration)
    return job.rank if job.rank is not None and job.rank < g.world_size else 0


def load_start(job: "JobStore", iteration: int, rank: int | None,
               followers: JobFollowerBases) -> tuple[str, int]:
    """Where a load of ``iteration`` starts (every rank's part alike): ``("follower", b)`` when
    the job's follower store holds a matching base ``b`` of its chain (format-spec/follower.md
    §7; identities only: a part that then fails to read is skipped by the load), else
    ``("primary", base_of(iteration))``."""
    if rank is not None:
        job.stream(iteration, rank)  # (the rank exists and its stream holds the commit)
    b = followers.start(iteration) if job.kind(iteration) == "delta" else None
    return ("follower", b) if b is not None else ("primary", job.base_of(iteration, rank=rank))
