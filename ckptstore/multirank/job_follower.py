"""The shadow follower of a multi-rank job store (format-spec/follower.md §7): what it names, what
it holds, and how a job's loads start from its bases.

A job's state at iteration t is the combination of its ranks' parts (:mod:`.combine`), each part
replayed within that rank's stream. The follower (:mod:`ckptstore.follow`) keeps a replica of
every rank's part (:class:`JobReplica`: one :class:`~ckptstore.replay.IncrementalReplayer` per
rank, over that rank's records, exactly as a load replays it) and writes them as one follower base
whose state maps :func:`part_key` (``"rank<r>"``) to rank r's part. Combined, the parts are what
:meth:`JobStore.load` without a group returns; kept apart, every rank's own RNG and scheduler
states survive, so a load with a group (each rank its own) is bit-exact too, and a restore at
another world size combines the parts as it does without a follower.

Identity (:class:`JobPrimary`, the read side's Primary protocol over a job): the job's STORE
store id, and for an iteration its **job digest** (:func:`job_digest`): xxh3-128 of the
manifest digests its global commit records, one per rank in rank order. A rank's manifest names
its tensors' Merkle roots, meta and chain fields, and a job's gc copies manifests unchanged
(format.md §22.7), so a job digest names one committed iteration of one history at every rank
and stays valid across gc, like a single store's manifest digest.

Loads (:func:`load_part`): rank r's part of a delta iteration t starts from the newest follower
base b with ``base_of(t) < b <= t`` whose identity matches and whose part r reads and matches the
fingerprint rank r's delta b records, then replays rank r's deltas b+1..t; any failure falls back
(FollowerWarning) to an older base or the rank's own base, bit-exact either way
(:class:`ckptstore.replay.follower.FollowerBases`, shared with single stores).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import xxhash

from ..errors import DeltaChainError
from ..format.commit import KIND_DELTA
from ..format.job import GlobalCommit
from ..replay.follower import FollowerBases, FollowerRebaser, Part
from ..replay.replayer import IncrementalReplayer, replay_to
from ..replay.report import ReplayReport
from ..store import Store, select_keys
from .job_history import RankRecords

if TYPE_CHECKING:
    from .job_store import JobStore


def part_key(rank: int) -> str:
    """The top-level key of rank ``rank``'s part in a job's follower base."""
    return f"rank{rank}"


def job_digest(g: GlobalCommit) -> str:
    """The job digest of global commit ``g`` (hex): xxh3-128 of its ranks' manifest digests
    (16 bytes each, rank order)."""
    return xxhash.xxh3_128_hexdigest(b"".join(r.commit.manifest_digest for r in g.ranks))


@dataclass(frozen=True)
class JobCommitDigest:
    """What a follower identity reads of a job's commit (the field name the single-store
    identity code reads: ``manifest_digest``), here the job digest."""

    manifest_digest: str


class JobPrimary:
    """A job store (read-only, no group) as the primary of a follower: the Primary protocol of
    :mod:`ckptstore.replay.follower`, whose identities name job digests. ``latest`` picks up
    new global commits first (as a single store's reader does)."""

    def __init__(self, job: "JobStore") -> None:
        self.job = job
        self.path = job.path
        self.mode = job.mode

    @property
    def header(self) -> Any:
        return self.job.header

    def base_of(self, iteration: int) -> int:
        return self.job.base_of(iteration)

    def kind(self, iteration: int) -> str:
        return self.job.kind(iteration)

    def info(self, iteration: int) -> JobCommitDigest:
        return JobCommitDigest(job_digest(self.job.global_commit(iteration)))

    def manifest(self, iteration: int) -> Any:
        """Rank 0's manifest (its extra fields: every rank's snapshot that a rebasing gc made
        records the same job-level provenance, format-spec/follower.md §7)."""
        return self.job.manifest(iteration, rank=0)

    def refresh(self) -> None:
        self.job.refresh()

    def latest(self) -> int | None:
        self.refresh()
        return self.job.latest()

    def iterations(self) -> list[int]:
        return self.job.iterations()

    def load(self, iteration: int, keys: Sequence[Any] | None = None) -> Any:
        return self.job.load(iteration, keys)

    def load_record(self, iteration: int, keys: Sequence[Any] | None = None, *,
                    into: Callable[[Any], Any] | None = None) -> Any:
        return self.job.load_record(iteration, keys)

    def consistent_reads(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def close(self) -> None:
        self.job.close()


class JobReplica:
    """The follower's replica of a job: every rank's part at one iteration, each advanced in its
    own rank's records (the interface of :class:`~ckptstore.replay.IncrementalReplayer` that
    :class:`ckptstore.follow.Follower` uses). After an error the replica is unusable."""

    def __init__(self, parts: list[IncrementalReplayer]) -> None:
        self.parts = parts

    @classmethod
    def start(cls, job: "JobStore", base: int) -> "JobReplica":
        """Every rank's part of the job's base snapshot ``base``, loaded from its stream."""
        return cls._build(job, base, lambda r: IncrementalReplayer(RankRecords(job, r), base))

    @classmethod
    def from_state(cls, job: "JobStore", state: Any, base: int) -> "JobReplica":
        """From a job follower base's state (it must hold exactly the parts of the ranks of
        ``base``'s global commit: DeltaChainError otherwise)."""
        world = job.global_commit(base).world_size
        keys = [part_key(r) for r in range(world)]
        if not isinstance(state, dict) or sorted(state) != sorted(keys):
            raise DeltaChainError(f"follower base {base} does not hold exactly the parts of the "
                                  f"{world} ranks of iteration {base}")
        return cls._build(job, base, lambda r: IncrementalReplayer.from_state(
            state[part_key(r)], base, RankRecords(job, r)))

    @classmethod
    def _build(cls, job: "JobStore", base: int,
               make: Callable[[int], IncrementalReplayer]) -> "JobReplica":
        parts: list[IncrementalReplayer] = []
        try:
            for r in range(job.global_commit(base).world_size):
                parts.append(make(r))
        except BaseException:
            for p in parts:
                p.close()
            raise
        return cls(parts)

    @property
    def iteration(self) -> int:
        return self.parts[0].iteration

    @property
    def exact(self) -> bool:
        return all(p.exact for p in self.parts)

    @property
    def report(self) -> ReplayReport:
        """The report of the first part that is not exact (else rank 0's)."""
        return next((p.report for p in self.parts if not p.exact), self.parts[0].report)

    def apply_next(self, iteration: int) -> None:
        for p in self.parts:
            p.apply_next(iteration)

    def advance(self, last: int, threads: int = 1) -> None:
        for p in self.parts:
            p.advance(last, threads)

    def state(self, clone: bool = True) -> dict:
        """The follower base's state: ``{part_key(r): rank r's part}``."""
        return {part_key(r): p.state(clone) for r, p in enumerate(self.parts)}

    def close(self) -> None:
        for p in self.parts:
            p.close()


class JobFollowerBases:
    """The read side of a job's follower store (``<job>/follower/``), opened lazily, never
    written: :class:`~ckptstore.replay.follower.FollowerBases` over :class:`JobPrimary`, one rank's
    part at a time."""

    def __init__(self, job: "JobStore") -> None:
        self.job = job
        self.bases = FollowerBases(JobPrimary(job), lambda path: Store(path, "r"))

    def load_part(self, iteration: int, rank: int) -> Any:
        """Rank ``rank``'s part of delta ``iteration`` replayed from the newest usable follower
        base; None when none could be used."""
        part = Part(part_key(rank), RankRecords(self.job, rank))
        return self.bases.replay(iteration, lambda source: replay_to(source, iteration), part)

    def start(self, iteration: int) -> int | None:
        """The follower base a load of delta ``iteration`` starts from (identities only), or
        None."""
        found = self.bases.candidates(iteration)
        return found[0] if found else None

    def close(self) -> None:
        self.bases.close()


def job_rebaser(job: "JobStore") -> FollowerRebaser:
    """The follower bases a gc of ``job`` (a reader, or a writer between saves) may rebase on
    (format-spec/follower.md §6-7): identities by job digest (:class:`JobPrimary`), each base
    verified part by part, rank ``r``'s part against rank ``r``'s records. Close it after use."""
    return FollowerRebaser(JobPrimary(job), lambda path: Store(path, "r"),
                           lambda b: [Part(part_key(r), RankRecords(job, r))
                                      for r in range(job.global_commit(b).world_size)])


def load_part(job: "JobStore", followers: JobFollowerBases, g: GlobalCommit, rank: int,
              keys: Sequence[Any] | None) -> Any:
    """Rank ``rank``'s state at ``g.iteration`` (its stream checked against ``g`` first): a delta
    from the newest usable follower base, else (and a snapshot) from the rank's stream."""
    stream = job.stream(g.iteration, rank)
    if g.kind == KIND_DELTA:
        state = followers.load_part(g.iteration, rank)
        if state is not None:
            return select_keys(state, keys, g.iteration)
    return stream.load(g.iteration, keys)
