"""The global two-phase commit of a multi-rank job store (format-spec/format.md §22).

One *round* per commit operation, on every rank, in the same order:

1. **Prepare** (each rank, alone): its stream's transaction appends its records, fsyncs them,
   appends its local COMMIT records and fsyncs them. The stream's commit hook
   (:meth:`GlobalCommitter.hook`) then runs the round with a PREPARED vote naming those local
   commits. A rank whose operation failed before that votes FAILED (:meth:`vote_failed`); one with
   nothing to commit votes EMPTY (:meth:`vote_empty`): every rank votes in every round.
2. **Votes** are all-gathered: every rank learns every vote.
3. **Decision** (the coordinator, rank 0): commit only if every rank PREPARED the same
   iterations of the same kinds, and no newer epoch has been claimed. Committing appends one
   GLOBAL_COMMIT per iteration to the epoch's global log and fsyncs it: **the global commit
   point**. Then it checks for a newer epoch again.
4. **Outcome** is broadcast. COMMITTED: each rank indexes its local commits. ABORTED: each rank
   cuts its local commits back (the hook raises; the stream's transaction aborts) and raises a
   typed error. UNKNOWN (a newer job claimed the store while the record was written): each rank
   keeps its records and raises CommitOutcomeUnknownError.

DCP's variant (format-spec/format.md §22.6, :mod:`.prepared`) runs no round: DCP's own
collectives gather the PREPARED votes, and the coordinator's :meth:`GlobalCommitter.decide_prepared`
makes the same decision (:meth:`GlobalCommitter._decide`) and the caller :meth:`~GlobalCommitter.settle`-s
it as a round does.

Invariants:
  * A rank cuts its prepared records only on an ABORTED outcome, which the coordinator sends only
    when it did not write (and will never write) a global commit naming them. Every other
    failure after a PREPARED vote (a dead coordinator, a timeout) keeps them: the global log
    alone says whether they are committed.
  * A round either completes on every rank or fails on every rank within the group's timeout
    (:class:`~ckptstore.multirank.group.RankGroup`); any failure of the group marks the committer
    broken, and every later round refuses at once (a new job must reopen the store).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from ..errors import (CkptStoreError, CommitOutcomeUnknownError, GlobalCommitAbortedError,
                      FormatError, RankFailureError, RankMismatchError, StaleWriterError)
from ..format.job import GlobalCommit, RankCommit
from ..storage.index import CommitEntry
from ..storage.job_log import EpochLog
from .group import RankGroup
from ..errors import describe, rebuild
from .messages import (Outcome, OutcomeCode, Reason, Vote, VoteStatus, decode_outcome, decode_vote,
                       encode_outcome, encode_vote)

T = TypeVar("T")


class GlobalCommitter:
    """Runs the commit rounds of one rank; the coordinator (rank 0) also holds the epoch's log."""

    def __init__(self, group: RankGroup, epoch: int, log: EpochLog | None, path: str) -> None:
        assert (log is not None) == (group.rank == 0), "the coordinator and only it holds the log"
        self.group = group
        self.epoch = epoch
        self.log = log
        self.path = path
        #: rounds this rank has voted in
        self.rounds = 0
        #: told every global commit this job makes, in order (the job store's view)
        self.on_commit: Callable[[list[GlobalCommit]], None] = lambda commits: None
        self._last_committed: int | None = None
        #: why no further round can run (a failed group, a stale epoch), or None
        self.broken: CkptStoreError | None = None
        #: the latest iteration this epoch continues from (its first commit must follow it)
        self.adopted_latest: int | None = None
        #: (rank, what it said) of the FAILED votes of the latest round (errors.describe)
        self._failures: tuple[tuple[int, str], ...] = ()
        #: the coordinator: its global log's failure in the latest round it cut back
        self._log_failure: CkptStoreError | None = None

    # ---- one commit operation as one round --------------------------------------------------
    def around(self, operation: Callable[[], T]) -> T:
        """Run one commit operation of this rank's stream as exactly one round: the stream's
        commit hook votes PREPARED inside it; a failure before that votes FAILED (so the others
        abort instead of waiting); an operation that committed nothing votes EMPTY. Called by
        the thread that commits: the caller's, or, once the store's async pipeline runs, only its
        persister (the job store then sends every commit through the pipeline), so rounds never
        run on two threads at once."""
        before = self.rounds
        try:
            out = operation()
        except BaseException as e:
            if self.rounds == before:
                self.vote_failed(e)
            raise
        if self.rounds == before:
            self.vote_empty()
        return out

    # ---- the three ways a rank votes ------------------------------------------------------
    def hook(self, entries: list[CommitEntry]) -> BaseException | None:
        """The stream's commit hook: its local commits are durable; vote PREPARED. Returns None
        when the round committed them globally, or the error to raise when it decided against
        them (ABORTED: the stream's transaction then cuts them). Raises when the outcome is not
        known (the coordinator died, the group failed, anything unexpected): the transaction
        then keeps them, since a global commit may name them."""
        commits = tuple(RankCommit(e.loc.seq, e.loc.offset, e.commit) for e in entries)
        try:
            outcome = self._round(Vote(VoteStatus.PREPARED, commits))
        except RankFailureError as e:
            raise CommitOutcomeUnknownError(
                f"{self.path}: rank {self.group.rank} prepared iterations "
                f"{[c.commit.iteration for c in commits]} but lost contact with the other ranks "
                f"before the outcome was known ({e}); its records are kept, and the global log "
                "says whether they are committed (reopen the store)") from e
        return self.refusal(outcome)

    def vote_failed(self, error: BaseException) -> None:
        """This rank's operation failed before it could prepare: take part in the round so the
        others abort too, instead of waiting for a vote that never comes. Never raises (the
        caller re-raises its own error)."""
        try:
            self._round(Vote(VoteStatus.FAILED, message=describe(error)))
        except CkptStoreError:
            pass

    def vote_empty(self) -> None:
        """This rank had nothing to commit in this round (a flush with no pending delta)."""
        refusal = self.refusal(self._round(Vote(VoteStatus.EMPTY)))
        if refusal is not None:
            raise refusal

    # ---- one round --------------------------------------------------------------------------
    def _round(self, vote: Vote) -> Outcome:
        if self.broken is not None:
            raise RankFailureError(f"{self.path}: no commit round can run: {self.broken}")
        self.rounds += 1
        try:
            votes_raw = self.group.all_gather(encode_vote(vote), "the commit vote")
            decision = self._decide(votes_raw) if self.log is not None else None
            raw = self.group.broadcast(encode_outcome(decision) if decision else None,
                                       "the commit outcome")
            outcome = decode_outcome(raw)
            self._failures = _failures_of(votes_raw)
        except RankFailureError as e:
            self.broken = e
            raise  # (not "from e": an exception that is its own cause cuts its traceback short)
        except FormatError as e:
            self.broken = RankFailureError(f"{self.path}: the commit outcome did not decode: {e}")
            raise self.broken from e
        self.settle(outcome, votes_raw if vote.status == VoteStatus.PREPARED else None)
        return outcome

    def settle(self, outcome: Outcome, votes_raw: list[bytes] | None) -> None:
        """What a rank learns from an outcome, in a round or in DCP's variant: a COMMITTED outcome
        of PREPARED votes (``votes_raw``; None when this rank did not prepare) is the job's next
        global commits (:attr:`on_commit`); a stale or unknown one breaks the committer."""
        if outcome.code == OutcomeCode.COMMITTED and votes_raw is not None:
            commits = self._global_commits(votes_raw)
            self._last_committed = commits[-1].iteration
            self.on_commit(commits)
        if outcome.reason == Reason.STALE:
            self.broken = StaleWriterError(outcome.message)
        elif outcome.code == OutcomeCode.UNKNOWN:
            self.broken = CommitOutcomeUnknownError(outcome.message)

    # ---- the DCP variant (format-spec/format.md §22.6; ckptstore/multirank/prepared.py) -------
    def decide_prepared(self, votes_raw: list[bytes]) -> Outcome:
        """The coordinator's decision on votes that DCP's own collectives gathered (every rank
        prepared in ``write_data``; no round runs): the decision of a round, :meth:`_decide`,
        with the global log written when it commits. The caller :meth:`settle`-s the outcome.
        Never raises; ABORTED when no round could run either (a broken committer)."""
        assert self.log is not None, "only the coordinator decides"
        if self.broken is not None:
            reason = Reason.STALE if isinstance(self.broken, StaleWriterError) else Reason.GLOBAL_LOG
            return Outcome(OutcomeCode.ABORTED, reason, f"no commit can be made: {self.broken}")
        return self._decide(votes_raw)

    def _decide(self, votes_raw: list[bytes]) -> Outcome:
        """The coordinator's decision, with the global log written when it commits. Never
        raises: before the append, any failure is ABORTED (nothing was written); once the append
        may have reached the disk, any doubt is UNKNOWN (every rank keeps its records). A round
        and DCP's variant (:meth:`decide_prepared`) both decide here."""
        assert self.log is not None
        try:
            votes, refusal = self._check_votes(votes_raw)
        except Exception as e:  # noqa: BLE001 - nothing was written: abort on every rank
            return Outcome(OutcomeCode.ABORTED, Reason.GLOBAL_LOG,
                           f"the coordinator could not decide ({type(e).__name__}: {e})")
        if refusal is not None:
            return refusal
        try:
            self.log.append_commits(self._global_commits(votes_raw, votes))
        except Exception as e:  # noqa: BLE001 - decided below by whether the log was cut back
            if isinstance(e, CkptStoreError) and not self.log.broken:
                self._log_failure = e  # (this rank's refusal: its own error as the cause)
                return Outcome(OutcomeCode.ABORTED, Reason.GLOBAL_LOG,
                               f"{_LOG_CUT_BACK}{describe(e)}")
            return Outcome(OutcomeCode.UNKNOWN, Reason.GLOBAL_LOG,
                           f"the global log failed and may hold the commit ({e}): every rank "
                           "keeps its records; reopen the store")
        try:
            newer = self.log.superseded()
        except Exception as e:  # noqa: BLE001 - the commit is durable; only the check failed
            return Outcome(OutcomeCode.UNKNOWN, Reason.GLOBAL_LOG,
                           f"committed, but checking for a newer job failed ({e})")
        if newer is not None:
            return Outcome(OutcomeCode.UNKNOWN, Reason.STALE, self._stale(newer))
        return Outcome(OutcomeCode.COMMITTED)

    def _check_votes(self, votes_raw: list[bytes]) -> tuple[list[Vote], Outcome | None]:
        """The votes, and the ABORTED (or EMPTY-round COMMITTED) outcome when no global commit
        is to be written."""
        assert self.log is not None
        try:
            votes = [decode_vote(v) for v in votes_raw]
        except FormatError as e:
            return [], Outcome(OutcomeCode.ABORTED, Reason.MISMATCH, f"a vote did not decode: {e}")
        failed = [f"rank {r}: {v.message}" for r, v in enumerate(votes)
                  if v.status == VoteStatus.FAILED]
        if failed:
            return votes, Outcome(OutcomeCode.ABORTED, Reason.RANK_FAILED, "; ".join(failed))
        if all(v.status == VoteStatus.EMPTY for v in votes):
            return votes, Outcome(OutcomeCode.COMMITTED)
        shapes = [tuple((c.commit.iteration, c.commit.kind) for c in v.commits)
                  if v.status == VoteStatus.PREPARED else "nothing" for v in votes]
        if any(s != shapes[0] for s in shapes):
            return votes, Outcome(OutcomeCode.ABORTED, Reason.MISMATCH,
                                  "ranks disagree on what to commit: "
                                  + ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes)))
        newer = self.log.superseded()
        if newer is not None:
            return votes, Outcome(OutcomeCode.ABORTED, Reason.STALE, self._stale(newer))
        last = self._last_committed if self._last_committed is not None else self.adopted_latest
        first = votes[0].commits[0].commit.iteration
        if last is not None and first <= last:
            return votes, Outcome(OutcomeCode.ABORTED, Reason.MISMATCH,
                                  f"iteration {first} is not after the latest global commit {last}")
        return votes, None

    def _global_commits(self, votes_raw: list[bytes], votes: list[Vote] | None = None
                        ) -> list[GlobalCommit]:
        votes = votes if votes is not None else [decode_vote(v) for v in votes_raw]
        now = time.time_ns()
        out = []
        for i, c in enumerate(votes[0].commits):
            ranks = tuple(v.commits[i] for v in votes)
            out.append(GlobalCommit(c.commit.iteration, self.epoch, c.commit.kind, ranks, now))
        return out

    def _stale(self, newer: int) -> str:
        return (f"{self.path}: this job's writer epoch {self.epoch} is stale: a newer job claimed "
                f"epoch {newer}; this writer may not commit again")

    def refusal(self, outcome: Outcome) -> CkptStoreError | None:
        """None for COMMITTED; the error to raise for ABORTED (a decision: prepared records may
        be cut); raises CommitOutcomeUnknownError for UNKNOWN (they must be kept)."""
        if outcome.code == OutcomeCode.COMMITTED:
            return None
        where = f"{self.path} (rank {self.group.rank} of {self.group.world_size}, epoch {self.epoch})"
        if outcome.code == OutcomeCode.UNKNOWN:
            raise CommitOutcomeUnknownError(f"{where}: {outcome.message}")
        if outcome.reason == Reason.STALE:
            return StaleWriterError(outcome.message)
        if outcome.reason == Reason.MISMATCH:
            return RankMismatchError(f"{where}: not committed: {outcome.message}")
        failures, self._failures = self._failures, ()
        error = GlobalCommitAbortedError(f"{where}: not committed on any rank: {outcome.message}",
                                         failures)
        peers = [(r, text) for r, text in failures if r != self.group.rank]
        if peers:  # the first other failing rank's own typed error (this rank raises its own)
            error.__cause__ = rebuild(*peers[0])
        elif outcome.reason == Reason.GLOBAL_LOG and outcome.message.startswith(_LOG_CUT_BACK):
            # the coordinator's (rank 0's) global log failed: its typed error, e.g. DiskFullError
            own, self._log_failure = self._log_failure, None
            error.__cause__ = own if own is not None else \
                rebuild(0, outcome.message[len(_LOG_CUT_BACK):])
        return error


#: how an ABORTED outcome whose global log append failed and was cut back begins; the failure's
#: one-line description (errors.describe) follows, rebuilt typed by every other rank
_LOG_CUT_BACK = "the global log failed (cut back): "


def _failures_of(votes_raw: list[bytes]) -> tuple[tuple[int, str], ...]:
    """(rank, message) of every FAILED vote of a round (none when a vote does not decode: the
    coordinator's decision says so)."""
    try:
        votes = [decode_vote(v) for v in votes_raw]
    except FormatError:
        return ()
    return tuple((r, v.message) for r, v in enumerate(votes) if v.status == VoteStatus.FAILED)
