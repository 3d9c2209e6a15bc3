"""One durable change to the live log: the commit protocol, written once.

Every checkpoint reaches the log through a :class:`Transaction` (a snapshot save is a transaction
of one checkpoint; a delta group commit is one transaction that several deltas join before it
commits). Call sequence, in the style of SQLite's pager (format-spec/format.md, "Commit
protocol"; format-spec/deltas.md, "Group commit"):

1. ``txn = engine.begin()`` -- the transaction starts at the log's committed end; at most one
   is open per writer, and only the engine's lock holder uses it.
2. ``txn.append(type, parts) -> Loc`` -- chunk, tree and manifest records, any number.
   ``sp = txn.savepoint()`` / ``txn.rollback_to(sp)`` undo the appends after ``sp`` (a delta
   that fails inside a group, leaving the group's earlier deltas in place).
3. ``txn.stage(checkpoint)`` -- a :class:`StagedCheckpoint`: its records are all appended, its
   COMMIT is not written yet.
4. ``txn.prepare()`` -- fsync every appended record: commit phase one.
5. ``txn.commit() -> IndexBatch`` -- one COMMIT record per staged checkpoint, in order, then
   fsync: **the commit point** (phase two). Then the host's ``commit_hook``, if any (an outer
   commit: a job store's global commit, which may still abort this transaction, or hold the
   batch back from the index: :class:`Hold`), then the index learns the batch.
   ``txn.abort()`` instead of 4-5 (or after any failure in them): cut the log back to the start.

Invariants:
  * :func:`append_commit_record` is the only code that writes a COMMIT record (gc's copies use it
    too), and a transaction calls it only after :meth:`Transaction.prepare`: a COMMIT never names
    a record that is not durable before it.
  * A transaction never commits records it did not append itself after its start, and an abort
    or a rollback cuts exactly what it appended after the start or savepoint. Cutting goes
    through the host's one rollback (:meth:`TransactionHost.cut_back`), which, when the cut
    itself fails, leaves the engine marked for recovery instead of raising a second error.
  * The index is updated only after the commit point; if that update fails, the commit stays
    durable and the host's recovery catches the index up from the log.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from ..format import records as rec
from ..format.commit import Commit, encode_commit
from ..storage.index import ChunkRef, CommitEntry, IndexBatch, Position
from ..storage.log import Log
from ..storage.segments import Loc


@dataclass
class StagedCheckpoint:
    """A checkpoint whose records are appended and whose COMMIT is not written yet."""

    commit: Commit
    #: chunks and trees this checkpoint appended (what the index learns when it commits)
    chunks: dict[bytes, ChunkRef] = field(default_factory=dict)
    trees: dict[bytes, Loc] = field(default_factory=dict)
    #: for a delta: the base snapshot its chain starts from (format-spec/deltas.md)
    base: int | None = None

    @property
    def iteration(self) -> int:
        return self.commit.iteration


class RecordAppender(Protocol):
    """Something records can be appended to: the live log's transaction, or gc's copies."""

    def append(self, record_type: int, parts: Sequence[bytes | memoryview]) -> Loc: ...


def append_commit_record(target: RecordAppender, commit: Commit) -> Loc:
    """Append the COMMIT record of ``commit``: the only function that writes one. The caller has
    made every record the commit names durable first (format-spec/format.md, "Commit
    protocol"), or, for gc's copies, does so before the copies become visible."""
    return target.append(rec.RecordType.COMMIT, [encode_commit(commit)])


class TransactionHost(Protocol):
    """What a transaction needs of the engine that opened it (the writer engine)."""

    log: Log
    segment_size: int

    def cut_back(self, start: Position | None) -> None:
        """Cut the log after ``start`` and put the writer there; when that fails, mark the
        engine for recovery (never raises)."""

    def apply_committed(self, batch: IndexBatch) -> None:
        """Give the index a durable batch; on failure recover the index from the log."""

    def transaction_closed(self, txn: "Transaction") -> None:
        """The transaction committed or aborted: the engine forgets it."""

    #: Called after the local commit point with the commits just made durable, before the index
    #: learns them (None: no outer commit). A multi-rank job store's global two-phase commit
    #: (ckptstore/multirank/): returning None means committed; returning an error means the
    #: outer commit decided against them: the transaction is aborted (its records, COMMITs
    #: included, are cut back) and that error raised. Returning a :class:`Hold` means the outer
    #: decision comes later (a DCP save's, ckptstore/multirank/prepared.py): the transaction
    #: closes with its records durable and hands the batch to the hold instead of the index.
    #: Raising means the outcome is unknown: the local commit is kept and indexed (an outer
    #: commit may name it), then the error re-raised.
    commit_hook: Callable[[list[CommitEntry]], "BaseException | Hold | None"] | None


class Hold:
    """A commit hook's answer "decided later": the transaction's local commit stays durable and
    unindexed, and ``receive`` gets its batch instead of the index. Whoever holds the batch
    must then give it to the host's ``apply_committed`` (committed) or cut the log back to
    where the transaction began (not committed), under the engine's lock, before the next
    transaction: until then the log holds a COMMIT the index does not know (which a recovery
    scan would index: keeping is the safe default)."""

    def __init__(self, receive: Callable[[IndexBatch], None]) -> None:
        self.receive = receive


class Transaction:
    """One open transaction on the live log (see the module docstring for the call sequence)."""

    def __init__(self, host: TransactionHost, start: Position | None) -> None:
        self._host = host
        self.log = host.log
        #: where the log ended when the transaction began (None: an empty log)
        self.start = start
        #: checkpoints appended and staged, in commit order
        self.staged: list[StagedCheckpoint] = []
        #: monotonic time the first checkpoint was staged (the age of a pending delta group)
        self.staged_since = 0.0
        self._closed = False

    # ---- 2. records ------------------------------------------------------------------------
    def append(self, record_type: int, parts: Sequence[bytes | memoryview]) -> Loc:
        self._check_open()
        return self.log.append(record_type, list(parts), self._host.segment_size)

    def append_image(self, buffers: Sequence[memoryview]) -> tuple[int, int]:
        """Append whole records laid out in memory (format/image.py); (seq, offset) of the first."""
        self._check_open()
        return self.log.append_image(list(buffers), self._host.segment_size)

    def savepoint(self) -> Position | None:
        """The log's end now: :meth:`rollback_to` it undoes every later append."""
        w = self.log.writer
        if w is None or not self.staged:
            return self.start
        return Position(w.seq, w.offset)

    def rollback_to(self, savepoint: Position | None) -> None:
        """Undo the appends after ``savepoint`` (nothing staged after it). The checkpoints staged
        before it stay staged; a transaction left with none is closed."""
        self._host.cut_back(savepoint)
        if not self.staged:
            self._close()

    # ---- 3. stage --------------------------------------------------------------------------
    def stage(self, checkpoint: StagedCheckpoint) -> None:
        """A checkpoint whose records are appended: its COMMIT is written by :meth:`commit`."""
        self._check_open()
        if not self.staged:
            self.staged_since = time.monotonic()
        self.staged.append(checkpoint)

    def iterations(self) -> list[int]:
        return [c.iteration for c in self.staged]

    # ---- 4-5. prepare, commit | abort ------------------------------------------------------
    def prepare(self) -> None:
        """Phase one: every record appended so far is durable."""
        self._check_open()
        assert self.log.writer is not None
        self.log.writer.sync()

    def commit(self) -> IndexBatch:
        """Phase one if not done, then a COMMIT per staged checkpoint and the fsync that is the
        commit point, then the index. On a failure before the commit point the transaction is
        aborted (the log cut back to its start) and the error raised."""
        self._check_open()
        merged = IndexBatch()
        try:
            self.prepare()
            cloc: Loc | None = None
            for staged in self.staged:
                cloc = append_commit_record(self, staged.commit)
                merged.chunks.update(staged.chunks)
                merged.trees.update(staged.trees)
                merged.commits.append(CommitEntry(staged.commit, cloc))
            assert self.log.writer is not None and cloc is not None
            self.log.writer.sync()  # the commit point (of this log)
        except BaseException:
            self.abort()
            raise
        unknown: BaseException | None = None
        hold: Hold | None = None
        if self._host.commit_hook is not None:
            try:
                refusal = self._host.commit_hook(merged.commits)  # the outer (global) commit
            except BaseException as e:  # noqa: BLE001 - re-raised below
                unknown = e  # the outer outcome is not known: an outer commit may name these
                # records, so they are kept and indexed, then the error is raised
            else:
                if isinstance(refusal, Hold):
                    hold = refusal
                elif refusal is not None:
                    self.abort()  # decided against: cut the local commit back, never written
                    raise refusal
        self._close()
        merged.position = Position(cloc.seq, cloc.end)
        merged.segments = tuple(s for s in self.log.refresh_segments() if s <= cloc.seq)
        if hold is not None:
            hold.receive(merged)
            return merged
        self._host.apply_committed(merged)
        if unknown is not None:
            raise unknown
        return merged

    def abort(self) -> None:
        """Cut everything this transaction appended (idempotent)."""
        if self._closed:
            return
        self.staged = []
        self._close()
        self._host.cut_back(self.start)

    # ---- internals -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("transaction already committed or aborted")

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._host.transaction_closed(self)
