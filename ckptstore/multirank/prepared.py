"""The DCP variant of a job store's global commit (format-spec/format.md §22.6).

``torch.distributed.checkpoint`` runs its own collectives around a storage layer: every rank's
``write_data``, then a gather of every rank's results on the coordinator, its ``finish``, and a
broadcast of the outcome. A storage layer that runs a collective of its own inside
``write_data`` (a commit round) hangs or breaks when a rank fails anywhere DCP does not call it
(a planner raising before ``write_data``), and commits before DCP knows that every rank's write
succeeded. This variant runs no collective: DCP's own gather carries the votes.

1. **Prepare** (``write_data``, every rank): :meth:`PreparedCommits.prepare` commits the rank's
   state in its own stream (records, fsync, local COMMIT, fsync: the stream's transaction, with a
   commit hook that runs no round) and *holds back the index batch*: the stream's index stays
   where it was before the save, so the prepared commit can be cut back to there without touching
   the index. The vote (the RankCommit: where the local COMMIT is and its payload, in the round's
   own byte encoding, :mod:`.messages`) is returned to DCP as plain data.
2. **Decide** (``finish``, the coordinator, rank 0 of the job store, after DCP gathered every
   rank's results): :meth:`PreparedCommits.decide` runs the committer's decision on those votes
   (:meth:`.committer.GlobalCommitter.decide_prepared`, the same code a round runs): one
   GLOBAL_COMMIT appended and fsynced, **the global commit point**, or none.
3. **Learn** (every other rank, lazily): the prepared commit stays held until an operation of the
   store reads the epoch's global log (:meth:`learn`, at every check of the store): a
   GLOBAL_COMMIT names it -> the held batch is indexed and the view learns the iteration. It is
   *cut back* only by :meth:`settle_earlier`, which DCP's next ``write_data`` on that rank calls
   (after DCP scattered the next save's plans from the coordinator) when the log does not name it.
   Before any other write to the stream (a ``JobStore.save`` round, ``close``) a held commit is
   :meth:`keep`-ed instead: indexed, invisible (no global commit names it), never cut afterwards.

Safety (never cut what a global commit names; a cut is final):
  * The coordinator appends a GLOBAL_COMMIT in this variant only in :meth:`decide`, under
    ``self._lock``, for the commit its own rank prepared *in the current save*.
    :meth:`begin_save` (the coordinator's ``set_up_storage_writer`` of every save) takes the same
    lock and retires any earlier held commit (cut: it was not named, and no later decide can name
    it: decide refuses a commit of an earlier save). So once the coordinator began save S', no
    GLOBAL_COMMIT for a commit prepared before S' is ever appended.
  * A rank other than the coordinator reaches ``write_data`` of save S' only after DCP scattered
    S''s plans, which the coordinator sends after its ``set_up_storage_writer`` of S' returned (the
    plan step gathers every rank's set-up result first). So when :meth:`settle_earlier` runs, the
    global log's content about any earlier prepared commit is final: named -> index it; not named
    -> it never will be; cutting it is safe.
  * Anywhere the outcome is not proven final (a check of the store after DCP raised: the
    coordinator may still be inside ``finish`` when DCP's collective timed out), a held commit is
    only learned, never cut; before another write it is kept. Keeping is always safe: a stream's
    commit that no visible GLOBAL_COMMIT names is not part of the job store's state (§22.2).
  * A crash anywhere leaves the prepared local COMMIT durable or not, and the global log naming it
    or not: the next epoch shows exactly the iterations the log names (a torn GLOBAL_COMMIT
    append is a torn tail the next epoch quarantines, §22.2).

Nothing here is pickled: votes cross ranks inside DCP's WriteResults as hex strings of the vote
encoding, decoded by :func:`.messages.decode_vote`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CkptStoreError, DamagedCheckpointError, DCPError
from ..format.job import GlobalCommit, RankCommit
from ..storage.index import CommitEntry, IndexBatch, Position
from ..engine.transaction import Hold
from ..storage.job_log import scan_epoch_log
from .messages import OutcomeCode, Vote, VoteStatus, encode_vote

if TYPE_CHECKING:
    from ..store import SaveStats, Store
    from .committer import GlobalCommitter
    from .job_store import JobStore


@dataclass
class Prepared:
    """A local commit this rank made durable and holds back from its stream's index."""

    iteration: int
    #: the save (this rank's count of DCP saves begun) that prepared it
    save: int
    commits: tuple[RankCommit, ...]
    #: where the stream's log ended before it (the cut point; None: an empty stream)
    start: Position | None
    #: the index batch held back (None: the transaction failed after its commit point)
    batch: IndexBatch | None


class PreparedCommits:
    """One rank's prepared DCP commits of a writing job store (at most one is held)."""

    def __init__(self, store: "JobStore", own: "Store", committer: "GlobalCommitter") -> None:
        """``own``: this rank's stream (a writer); ``committer``: its commit rounds' committer
        (the job store passes its own; the view learns through ``store.learn``)."""
        assert store.epoch is not None
        self._store = store
        self._own = own
        self._committer = committer
        self._lock = threading.RLock()
        #: the held commit (None: none)
        self.held: Prepared | None = None
        #: DCP saves begun on this rank (the coordinator's set_up_storage_writer counts them)
        self._saves = 0
        #: what happened to the last prepared commit ("committed", "cut", "kept"), for tests
        self.last: tuple[int, str] | None = None

    @property
    def engine(self) -> Any:
        return self._own.engine

    # ---- 1. prepare (write_data) -------------------------------------------------------------
    def prepare(self, iteration: int, state: Any, meta: dict | None) -> tuple["SaveStats", bytes]:
        """Commit ``state`` in this rank's stream without indexing it; the encoded PREPARED vote.
        Call only from DCP's ``write_data`` (it first settles an earlier held commit)."""
        with self._lock:
            self.settle_earlier()
            own, engine = self._own, self.engine
            if own.pending():
                raise DCPError(f"{self._store.path}: rank {self._store.rank} has deltas pending "
                               "commit; flush() the job store before a DCP save")
            seen: list[tuple[list[CommitEntry], Position | None]] = []
            held: list[IndexBatch] = []

            def prepared(entries: list[CommitEntry]) -> Hold:
                # the local commit point passed; the batch is held back from the index
                seen.append((list(entries), engine.index.position()))
                return Hold(held.append)

            with engine.locked():
                engine.commit_hook = prepared
                try:
                    stats = own.save(iteration, state, meta)
                finally:
                    engine.commit_hook = self._committer.hook
                    if seen:
                        entries, start = seen[-1]
                        self.held = Prepared(
                            iteration, self._saves,
                            tuple(RankCommit(e.loc.seq, e.loc.offset, e.commit) for e in entries),
                            start, held[-1] if held else None)
            assert len(seen) == 1 and self.held is not None
            return stats, encode_vote(Vote(VoteStatus.PREPARED, self.held.commits))

    # ---- 2. decide (the coordinator's finish) --------------------------------------------------
    def begin_save(self) -> None:
        """The coordinator begins a DCP save: an earlier held commit is settled now (no decide
        can name it from here on)."""
        with self._lock:
            self._saves += 1
            self.settle_earlier()

    def decide(self, iteration: int, votes: list[bytes]) -> None:
        """The coordinator's global commit of the current save from every rank's vote (rank
        order). Returns when committed; raises the committer's typed error otherwise (the
        coordinator's own prepared commit is cut when nothing was written, kept when the outcome
        is unknown)."""
        with self._lock:
            p = self.held
            if p is None or p.save != self._saves or p.iteration != iteration:
                raise DCPError(f"{self._store.path}: the coordinator holds no prepared commit of "
                               f"iteration {iteration} from this save; nothing is committed")
            if votes[self._store.rank or 0] != encode_vote(Vote(VoteStatus.PREPARED, p.commits)):
                self._cut(p)
                raise DCPError(f"{self._store.path}: the coordinator's own vote in DCP's results "
                               "is not the commit it prepared; nothing is committed")
            committer = self._committer
            with self.engine.locked():
                try:
                    outcome = committer.decide_prepared(votes)
                except BaseException:
                    self._keep(p)  # unexpected: whether the log holds it is not known
                    raise
                if outcome.code == OutcomeCode.COMMITTED:
                    self._index(p)
                elif outcome.code == OutcomeCode.ABORTED:
                    self._cut(p)
                else:
                    self._keep(p)
                committer.settle(outcome, votes)
                refusal = committer.refusal(outcome)  # raises for UNKNOWN
            if refusal is not None:
                raise refusal

    def abandon(self) -> None:
        """The coordinator's save failed before its decision: cut its held commit now."""
        with self._lock:
            if self.held is not None and self._committer.log is not None:
                self._cut(self.held)

    # ---- 3. learn / settle / keep ------------------------------------------------------------
    def learn(self) -> None:
        """Index the held commit if a GLOBAL_COMMIT names it (never cuts; never raises)."""
        with self._lock:
            p = self.held
            if p is None:
                return
            try:
                named = self._named(p)
            except DamagedCheckpointError:
                self._keep(p)
                return
            except (CkptStoreError, OSError):
                return  # resolved at a later check
            if named is not None:
                with self.engine.locked():
                    self._index(p)
                    self._store.learn([named])

    def settle_earlier(self) -> None:
        """Resolve a held commit of an earlier save for good: named -> indexed, else cut.
        Only where the coordinator has provably begun a later save (module docstring)."""
        with self._lock:
            p = self.held
            if p is None:
                return
            try:
                named = self._named(p)
            except (CkptStoreError, OSError):
                self._keep(p)  # the log cannot be read (or names another commit): keep it
                return
            with self.engine.locked():
                if named is not None:
                    self._index(p)
                    self._store.learn([named])
                else:
                    self._cut(p)

    def keep(self) -> None:
        """Before another write to the stream: learn, else index the held commit (invisible
        unless a global commit names it; never cut afterwards)."""
        with self._lock:
            self.learn()
            if self.held is not None:
                self._keep(self.held)

    # ---- internals -----------------------------------------------------------------------------
    def _named(self, p: Prepared) -> GlobalCommit | None:
        """The GLOBAL_COMMIT of this epoch naming ``p``'s iteration, or None. Raises
        DamagedCheckpointError when one names the iteration with another local commit of this
        rank (the callers then keep ``p``: never cut what the log names)."""
        store = self._store
        assert store.epoch is not None and store.rank is not None
        scan = scan_epoch_log(store.layout.epoch_log_path(store.epoch), store.epoch,
                              store.header.store_id)
        for g, _ in scan.commits:
            if g.iteration == p.iteration:
                if g.ranks[store.rank] != p.commits[-1]:
                    raise DamagedCheckpointError(
                        f"{store.path}: the global commit of iteration {p.iteration} names another "
                        f"local commit of rank {store.rank} than the one it prepared")
                return g
        return None

    def _index(self, p: Prepared) -> None:
        self.held = None
        if p.batch is not None:
            self.engine.apply_committed(p.batch)
        else:
            self.engine.mark_unclean()  # the next write's recovery indexes it from the log
        self.last = (p.iteration, "committed")

    def _keep(self, p: Prepared) -> None:
        self._index(p)
        self.last = (p.iteration, "kept")

    def _cut(self, p: Prepared) -> None:
        self.held = None
        with self.engine.locked():
            self.engine.cut_back(p.start)  # a failed cut leaves the engine to recover (keeps it)
        self.last = (p.iteration, "cut")
