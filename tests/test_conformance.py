"""Conformance suites for the storage layer's two seams (STYLE.md items 7-8).

Each interface has one test class, written once against the interface and subclassed once per
implementation (zarr-python v3's ``StoreTests``, dulwich's ``ObjectStoreTests``). A new backend is
tested by a subclass of three lines that says how to make one; class attributes declare what it
can do (a reader's view cannot be cleared, only a persistent index survives a reopen, ...).

* :class:`IndexConformance` -- ``ckptstore.storage.index.Index``: ``MemoryIndex`` (what a reader
  builds by scanning the log), ``LmdbIndex`` (the writer's persistent index) and ``ReaderIndex``
  (the reader's read-only view of an ``LmdbIndex`` snapshot, filled through a writable twin; once
  with everything in the snapshot, once with only the first batch there and the rest applied to
  the view as a reader's scan after the snapshot's position does). The batches come from
  :class:`FakeLog`, which places records the way a writer's log does and keeps the COMMIT payloads
  a ``ReaderIndex`` checks its snapshot entries against. Two module-level tests compare the
  implementations' answers to each other: on the same synthetic batches, and on a real store.
* :class:`FileOpsConformance` -- ``ckptstore.storage.fileops.FileOps``: the real one and every
  fault-injecting or recording subclass the other tests use, configured not to fault.
"""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.errors import DiskFullError, FormatError, IndexUnusable, StoreIOError
from ckptstore.format.chunk import Codec
from ckptstore.format.commit import COMMIT_SIZE, KIND_DELTA, KIND_SNAPSHOT, Commit, encode_commit
from ckptstore.format.records import MAX_PAYLOAD
from ckptstore.storage.fileops import FileOps
from ckptstore.storage.index import (Chains, ChunkRef, CommitEntry, Index, IndexBatch, MemoryIndex,
                                     Position)
from ckptstore.storage.lmdb_index import LmdbIndex
from ckptstore.storage.reader_index import IndexSnapshot, ReaderIndex
from ckptstore.storage.segments import SEGMENT_HEADER_RECORD_SIZE, Loc

from _crashkit import FreezeOps, KillOps
from test_evict import Recording
from test_faults import FaultyOps, SweepOps, _Dribble

STORE_ID = bytes(range(16))
#: the largest segment number an index value may name (segment names have ten digits)
SEQ_LAST = 10**10 - 1


# ==== the index ====================================================================================

def S(it: int) -> tuple[int, int]:
    return it, KIND_SNAPSHOT


def D(it: int) -> tuple[int, int]:
    return it, KIND_DELTA


class FakeLog:
    """Record locations handed out in append order over numbered segments, as a writer's log
    places them, and the COMMIT payload at each commit location (what ReaderIndex reads back
    through its callback). Remembers every address, root and iteration it named, so that
    :func:`answers` can ask an index about all of them."""

    def __init__(self) -> None:
        self.seqs = [1]
        self.offset = SEGMENT_HEADER_RECORD_SIZE
        self.payloads: dict[Loc, bytes] = {}
        self.addresses: list[bytes] = []
        self.roots: list[bytes] = []
        self.iterations: set[int] = set()
        self._names = 0

    @property
    def seq(self) -> int:
        return self.seqs[-1]

    def place(self, length: int) -> Loc:
        loc = Loc(self.seq, self.offset, length)
        self.offset = loc.end
        return loc

    def roll(self) -> None:
        """Continue in the next segment."""
        self.seqs.append(self.seq + 1)
        self.offset = SEGMENT_HEADER_RECORD_SIZE

    def _name(self, what: bytes) -> bytes:
        self._names += 1
        return struct.pack("<4sQ4x", what, self._names)  # 16 bytes, like an xxh3-128 address

    def address(self) -> bytes:
        a = self._name(b"chnk")
        self.addresses.append(a)
        return a

    def root(self) -> bytes:
        r = self._name(b"tree")
        self.roots.append(r)
        return r

    def chunk_ref(self, codec: int = Codec.RAW) -> ChunkRef:
        return ChunkRef(self.place(4096 + 40 * self._names), int(codec))

    def tree_loc(self) -> Loc:
        return self.place(200)

    def commit(self, it: int, kind: int = KIND_SNAPSHOT) -> CommitEntry:
        manifest = self.place(300)
        c = Commit(it, manifest.seq, manifest.offset, manifest.length,
                   manifest_digest=self._name(b"dgst"), snapshot_root=self._name(b"root"),
                   created_ns=1_700_000_000_000_000_000 + it, logical_bytes=1000 * it,
                   written_bytes=10 * it, kind=kind)
        loc = self.place(COMMIT_SIZE)
        self.payloads[loc] = encode_commit(c)
        self.iterations.add(it)
        return CommitEntry(c, loc)

    def batch(self, *commits: tuple[int, int], chunks: int = 2, trees: int = 1,
              position: bool = True) -> IndexBatch:
        """What one commit (or a scan over several) hands the index: new chunks and trees, then
        the commits, then the position right after the last record."""
        b = IndexBatch()
        for _ in range(chunks):
            b.chunks[self.address()] = self.chunk_ref()
        for _ in range(trees):
            b.trees[self.root()] = self.tree_loc()
        for it, kind in commits:
            b.commits.append(self.commit(it, kind))
        if position:
            b.position = Position(self.seq, self.offset)
            b.segments = tuple(self.seqs)
        return b

    def read_payload(self, loc: Loc) -> bytes:
        """ReaderIndex's callback: the COMMIT payload at ``loc``."""
        if loc not in self.payloads:
            raise FormatError(f"no COMMIT record at {loc}")
        return self.payloads[loc]


def answers(idx: Index, addresses, roots, iterations) -> dict:
    """Everything an index says about the given keys, for comparing indexes."""
    return {
        "iterations": idx.iterations(),
        "latest": idx.latest(),
        "position": idx.position(),
        "last_commit": idx.last_commit(),
        "segments": idx.segments(),
        "kinds": list(idx.kinds()),
        "recoverable": idx.recoverable(),
        "latest_recoverable": idx.latest_recoverable(),
        "chunks": {a: idx.get_chunk(a) for a in addresses},
        "trees": {r: idx.get_tree(r) for r in roots},
        "commits": {it: idx.get_commit(it) for it in sorted(iterations)},
    }


def log_answers(idx: Index, log: FakeLog) -> dict:
    return answers(idx, log.addresses, log.roots, log.iterations)


def applied(idx: Index, batches) -> Index:
    for b in batches:
        idx.apply(b)
    return idx


def reader_view(index_dir: str, log: FakeLog, batches, in_snapshot: int) -> ReaderIndex:
    """A reader's view as ReaderEngine._warm_view builds it: the first ``in_snapshot`` batches
    written through a writable LmdbIndex (closed again: one LMDB environment per process), the
    snapshot opened read-only and validated against the log, then the remaining batches applied
    to the view (what a scan of the log after the snapshot's position hands it)."""
    assert in_snapshot >= 1, "a reader's snapshot needs a position: fill at least one batch"
    twin = LmdbIndex(index_dir, STORE_ID)
    try:
        applied(twin, batches[:in_snapshot])
    finally:
        twin.close()
    snap = IndexSnapshot.open(index_dir, STORE_ID)
    assert snap is not None, "the filled index could not be opened read-only"
    view = ReaderIndex(snap, STORE_ID, log.read_payload)
    try:
        assert view.validate(list(log.seqs)), "the snapshot does not validate against its log"
        return applied(view, batches[in_snapshot:])
    except BaseException:
        view.close()
        raise


#: The chain rule's cases (format-spec/deltas.md), as batches in log order.
CHAIN_BATCHES = [
    [D(1), S(2)],    # a delta with no committed predecessor; a snapshot
    [D(3), D(4)],    # deltas on an intact chain
    [D(6), D(7)],    # a gap (5 missing), then a delta after the unrecoverable one
    [S(8)],          # a snapshot: recoverable whatever came before
    [D(9)],
    [D(11)],         # a gap again: the latest iteration is not recoverable
]
CHAIN_RECOVERABLE = [2, 3, 4, 8, 9]
CHAIN_BASES = {2: 2, 3: 2, 4: 2, 8: 8, 9: 8, 1: None, 6: None, 7: None, 11: None, 5: None, 12: None}


class IndexConformance:
    """The contract of ``ckptstore.storage.index.Index``. Subclasses implement :meth:`make`
    (an index holding ``batches``, applied in order) or :meth:`new` (an empty writable one)."""

    #: an index can exist holding nothing (a reader's view always stands on a snapshot)
    starts_empty = True
    #: clear() empties the index (else it refuses with IndexUnusable and changes nothing)
    can_clear = True
    #: chunk_alternatives() returns every replaced location (else it may return fewer: the
    #: interface's default keeps none)
    keeps_alternatives = False
    #: the content survives close() and a reopen (see :meth:`reopen`)
    persistent = False

    def new(self) -> Index:
        raise NotImplementedError

    def make(self, batches: list[IndexBatch]) -> Index:
        return applied(self.track(self.new()), batches)

    def reopen(self, idx: Index) -> Index:
        """Close ``idx`` and open the same index again (persistent implementations)."""
        raise NotImplementedError

    def released(self, idx: Index) -> None:
        """After close(): assert that what ``idx`` held can be taken again."""

    # ---- plumbing ----------------------------------------------------------------------------
    @pytest.fixture(autouse=True)
    def _workspace(self, tmp_path):
        self.tmp = tmp_path
        self.log = FakeLog()
        self._opened: list[Index] = []
        yield
        for idx in reversed(self._opened):
            idx.close()

    def track(self, idx: Index) -> Index:
        self._opened.append(idx)
        return idx

    def empty(self) -> Index:
        if not self.starts_empty:
            pytest.skip("this index cannot exist without content")
        return self.make([])

    # ---- look-ups ----------------------------------------------------------------------------
    def test_absent_keys_are_none(self):
        idx = self.make([self.log.batch(S(1))])
        assert idx.get_chunk(self.log._name(b"none")) is None
        assert idx.get_tree(self.log._name(b"none")) is None
        for it in (0, 2, -1, 1 << 63, 1 << 64):
            assert idx.get_commit(it) is None, it
        assert idx.chunk_alternatives(self.log._name(b"none")) == []

    def test_new_index_is_empty(self):
        idx = self.empty()
        assert idx.iterations() == []
        assert idx.latest() is None
        assert idx.position() is None
        assert idx.last_commit() is None
        assert idx.segments() is None
        assert list(idx.kinds()) == []
        assert idx.recoverable() == []
        assert idx.latest_recoverable() is None
        assert idx.get_commit(0) is None

    def test_apply_makes_chunks_trees_and_commits_visible(self):
        b1 = self.log.batch(S(1), chunks=3, trees=2)
        b2 = self.log.batch(S(2), chunks=2, trees=1)
        idx = self.make([b1, b2])
        for b in (b1, b2):
            for addr, ref in b.chunks.items():
                assert idx.get_chunk(addr) == ref
            for root, loc in b.trees.items():
                assert idx.get_tree(root) == loc
            for e in b.commits:
                assert idx.get_commit(e.commit.iteration) == e
        # and through apply() on the index itself (a reader's view: its scan overlay)
        b3 = self.log.batch(S(3))
        idx.apply(b3)
        (addr, ref), = list(b3.chunks.items())[:1]
        assert idx.get_chunk(addr) == ref
        assert idx.get_tree(next(iter(b3.trees))) == next(iter(b3.trees.values()))
        assert idx.get_commit(3) == b3.commits[0]
        assert idx.iterations() == [1, 2, 3]

    def test_batch_without_position_keeps_the_old_one(self):
        b1 = self.log.batch(S(1))
        idx = self.make([b1])
        chunks_only = self.log.batch(chunks=2, trees=1, position=False)
        idx.apply(chunks_only)
        for addr, ref in chunks_only.chunks.items():
            assert idx.get_chunk(addr) == ref
        assert idx.position() == b1.position
        assert idx.segments() == b1.segments
        assert idx.last_commit() == b1.commits[-1]
        assert idx.iterations() == [1]

    def test_later_locations_replace_earlier_ones(self):
        b1 = self.log.batch(S(1), S(2))
        addr, root = next(iter(b1.chunks)), next(iter(b1.trees))
        idx = self.make([b1])
        # a rewrite of the chunk and the tree, and a copy of the checkpoints (as gc makes them)
        b2 = self.log.batch(chunks=0, trees=0, position=False)
        b2.chunks[addr] = self.log.chunk_ref(Codec.LZ4)
        b2.trees[root] = self.log.tree_loc()
        b2.commits = [self.log.commit(1), self.log.commit(2)]
        b2.position, b2.segments = Position(self.log.seq, self.log.offset), tuple(self.log.seqs)
        idx.apply(b2)
        assert idx.get_chunk(addr) == b2.chunks[addr] != b1.chunks[addr]
        assert idx.get_tree(root) == b2.trees[root] != b1.trees[root]
        assert idx.get_commit(1) == b2.commits[0] != b1.commits[0]
        assert idx.get_commit(2) == b2.commits[1]
        assert idx.iterations() == [1, 2]
        assert list(idx.kinds()) == [S(1), S(2)]
        assert idx.last_commit() == b2.commits[1]
        assert idx.recoverable() == [1, 2]

    def test_replacement_through_the_writable_side(self):
        """The same replacement, with both versions filled before the index is made (for a
        reader's view: both in its snapshot, or the new one in its overlay)."""
        b1 = self.log.batch(S(1))
        addr = next(iter(b1.chunks))
        b2 = self.log.batch(chunks=0, trees=0, position=False)
        b2.chunks[addr] = self.log.chunk_ref()
        b2.commits = [self.log.commit(1)]
        b2.position, b2.segments = Position(self.log.seq, self.log.offset), tuple(self.log.seqs)
        idx = self.make([b1, b2])
        assert idx.get_chunk(addr) == b2.chunks[addr]
        assert idx.get_commit(1) == b2.commits[0]
        assert idx.iterations() == [1]

    # ---- iterations and the log position --------------------------------------------------------
    def test_iterations_ascending_whatever_the_apply_order(self):
        idx = self.make([self.log.batch(S(3))])
        assert idx.iterations() == [3]          # also primes any cache
        idx.apply(self.log.batch(S(1)))
        assert idx.iterations() == [1, 3]
        idx.apply(self.log.batch(S(7), S(5)))   # one batch, iterations falling
        assert idx.iterations() == [1, 3, 5, 7]
        idx.apply(self.log.batch(S(9)))
        assert idx.iterations() == [1, 3, 5, 7, 9]
        assert list(idx.kinds()) == [S(1), S(3), S(5), S(7), S(9)]

    def test_iterations_are_sorted_numerically(self):
        its = [2, 10, 1, 255, 256, 65536, 1 << 40]
        idx = self.make([self.log.batch(*(S(i) for i in its))])
        assert idx.iterations() == sorted(its)
        assert idx.latest() == 1 << 40
        assert [it for it, _ in idx.kinds()] == sorted(its)

    def test_latest_is_the_highest_iteration(self):
        idx = self.make([self.log.batch(S(2)), self.log.batch(S(4))])
        assert idx.latest() == 4
        idx.apply(self.log.batch(S(3)))        # a lower iteration applied later
        assert idx.latest() == 4
        idx.apply(self.log.batch(S(10)))
        assert idx.latest() == 10

    def test_position_segments_and_last_commit_follow_the_last_batch(self):
        b1 = self.log.batch(S(1))
        idx = self.make([b1])
        assert idx.position() == b1.position == Position(1, b1.commits[-1].loc.end)
        assert idx.segments() == (1,)
        assert idx.last_commit() == b1.commits[-1]
        self.log.roll()
        self.log.roll()
        b2 = self.log.batch(S(2), S(3))
        idx.apply(b2)
        assert idx.position() == b2.position and idx.position().seq == 3
        assert idx.segments() == (1, 2, 3)
        assert idx.last_commit() == b2.commits[-1]
        b3 = self.log.batch(S(12), S(10))
        idx.apply(b3)
        # the last commit applied (in log order), not the highest iteration
        assert idx.last_commit() == b3.commits[-1]
        assert idx.last_commit().commit.iteration == 10
        assert idx.latest() == 12

    # ---- recoverability (the chain rule) ------------------------------------------------------
    def test_kinds_ascending(self):
        idx = self.make([self.log.batch(*b) for b in CHAIN_BATCHES])
        kinds = list(idx.kinds())
        assert kinds == sorted(kinds)
        assert kinds == sorted(k for b in CHAIN_BATCHES for k in b)

    def test_chain_rule(self):
        idx = self.make([self.log.batch(*b) for b in CHAIN_BATCHES])
        assert idx.iterations() == [1, 2, 3, 4, 6, 7, 8, 9, 11]
        assert idx.latest() == 11
        assert idx.recoverable() == CHAIN_RECOVERABLE
        assert idx.latest_recoverable() == 9
        chains = idx.chains()
        for it, base in CHAIN_BASES.items():
            assert chains.base(it) == base, it
        assert idx.recoverable() == Chains(idx.kinds()).recoverable

    def test_only_deltas_nothing_recoverable(self):
        idx = self.make([self.log.batch(D(5), D(6))])
        assert idx.iterations() == [5, 6]
        assert idx.recoverable() == []
        assert idx.latest_recoverable() is None

    def test_chains_follow_later_applies(self):
        idx = self.make([self.log.batch(S(1))])
        assert idx.recoverable() == [1]          # the summary now exists and must be kept current
        idx.apply(self.log.batch(D(2)))
        assert idx.recoverable() == [1, 2]
        idx.apply(self.log.batch(D(4)))          # 3 is missing: broken chain
        assert idx.recoverable() == [1, 2]
        assert idx.latest_recoverable() == 2
        idx.apply(self.log.batch(D(3)))          # arrives late and mends the chain
        assert idx.recoverable() == [1, 2, 3, 4]
        assert idx.latest_recoverable() == 4
        idx.apply(self.log.batch(D(6), S(7), D(8)))
        assert idx.recoverable() == [1, 2, 3, 4, 7, 8]
        assert idx.chains().base(8) == 7 and idx.chains().base(6) is None
        assert idx.recoverable() == Chains(idx.kinds()).recoverable

    # ---- chunk alternatives -------------------------------------------------------------------
    def test_chunk_alternatives(self):
        b1 = self.log.batch(S(1))
        addr, other = list(b1.chunks)
        r1 = b1.chunks[addr]
        idx = self.make([b1])
        assert idx.chunk_alternatives(addr) == []
        # a later batch rewrites the chunk twice: r2 was replaced by r3 inside the batch
        b2 = self.log.batch(S(2), chunks=0)
        r2, r3 = self.log.chunk_ref(), self.log.chunk_ref()
        b2.chunks[addr] = r3
        b2.superseded = [(addr, r2)]
        idx.apply(b2)
        assert idx.get_chunk(addr) == r3
        alts = idx.chunk_alternatives(addr)
        assert all(isinstance(r, ChunkRef) for r in alts)
        newest_first = [r2, r1]
        assert r3 not in alts
        assert alts == [r for r in newest_first if r in alts], alts  # a subsequence, in order
        if self.keeps_alternatives:
            assert alts == newest_first
        # the same location applied again replaces nothing
        idx.apply(IndexBatch(chunks={addr: r3}))
        assert idx.chunk_alternatives(addr) == alts
        assert idx.chunk_alternatives(other) == []

    # ---- values ------------------------------------------------------------------------------
    def test_values_at_their_limits_round_trip(self):
        b = self.log.batch(chunks=0, trees=0, position=False)
        addr, root = self.log.address(), self.log.root()
        big = ChunkRef(Loc(SEQ_LAST, (1 << 48) + 7, MAX_PAYLOAD), int(Codec.LZ4))
        b.chunks[addr] = big
        b.trees[root] = Loc(SEQ_LAST, 1 << 40, MAX_PAYLOAD)
        manifest = self.log.place(300)
        c = Commit((1 << 63) - 1, manifest.seq, manifest.offset, manifest.length, b"\xff" * 16,
                   b"\x00" * 16, (1 << 64) - 1, (1 << 64) - 1, 0, KIND_SNAPSHOT)
        loc = self.log.place(COMMIT_SIZE)
        self.log.payloads[loc] = encode_commit(c)
        self.log.iterations.add(c.iteration)
        b.commits.append(CommitEntry(c, loc))
        b.position, b.segments = Position(self.log.seq, self.log.offset), tuple(self.log.seqs)
        idx = self.make([b])
        assert idx.get_chunk(addr) == big
        assert idx.get_tree(root) == b.trees[root]
        assert idx.get_commit((1 << 63) - 1) == CommitEntry(c, loc)
        assert idx.latest() == (1 << 63) - 1
        assert idx.last_commit() == CommitEntry(c, loc)

    # ---- clear and close ---------------------------------------------------------------------
    def test_clear_empties_everything(self):
        b1, b2 = self.log.batch(S(1), D(2)), self.log.batch(S(3))
        idx = self.make([b1, b2])
        assert idx.recoverable() == [1, 2, 3]     # build the summary: clear() must drop it
        before = log_answers(idx, self.log)
        if not self.can_clear:
            with pytest.raises(IndexUnusable):
                idx.clear()
            assert log_answers(idx, self.log) == before
            return
        idx.clear()
        assert idx.iterations() == [] and idx.latest() is None
        assert idx.position() is None and idx.segments() is None and idx.last_commit() is None
        assert list(idx.kinds()) == [] and idx.recoverable() == []
        assert idx.latest_recoverable() is None
        for b in (b1, b2):
            assert all(idx.get_chunk(a) is None for a in b.chunks)
            assert all(idx.chunk_alternatives(a) == [] for a in b.chunks)
            assert all(idx.get_tree(r) is None for r in b.trees)
            assert all(idx.get_commit(e.commit.iteration) is None for e in b.commits)
        # and it fills again from scratch
        b3 = self.log.batch(D(4), S(5))
        idx.apply(b3)
        assert idx.iterations() == [4, 5]
        assert idx.recoverable() == [5]
        assert idx.position() == b3.position and idx.last_commit() == b3.commits[-1]

    def test_verify_complete_on_a_sound_index(self):
        idx = self.make([self.log.batch(*b) for b in CHAIN_BATCHES])
        assert idx.verify_complete() is None
        idx.apply(self.log.batch(S(20), S(15)))
        assert idx.verify_complete() is None
        assert idx.iterations()[-3:] == [11, 15, 20]

    def test_close_is_idempotent(self):
        idx = self.make([self.log.batch(S(1))])
        assert idx.close() is None
        assert idx.close() is None
        self.released(idx)

    def test_values_survive_reopen(self):
        if not self.persistent:
            pytest.skip("not a persistent index")
        idx = self.make([self.log.batch(*b) for b in CHAIN_BATCHES])
        self.log.roll()
        idx.apply(self.log.batch(S(20), chunks=3))
        before = log_answers(idx, self.log)
        again = self.reopen(idx)
        assert log_answers(again, self.log) == before
        assert before["recoverable"] == CHAIN_RECOVERABLE + [20]
        assert before["segments"] == (1, 2)


class TestMemoryIndex(IndexConformance):
    keeps_alternatives = True

    def new(self) -> Index:
        return MemoryIndex()


class TestLmdbIndex(IndexConformance):
    persistent = True

    def new(self) -> Index:
        return LmdbIndex(str(self.tmp / "index"), STORE_ID)

    def reopen(self, idx: Index) -> Index:
        idx.close()
        return self.track(self.new())

    def released(self, idx: Index) -> None:
        again = self.track(self.new())   # LMDB refuses a second environment of one process
        assert again.iterations() == [1]

    def test_another_stores_index_is_refused(self):
        self.make([self.log.batch(S(1))]).close()
        with pytest.raises(IndexUnusable):
            LmdbIndex(str(self.tmp / "index"), bytes(16))


class TestReaderIndex(IndexConformance):
    """The reader's read-only view, every batch in its snapshot."""

    starts_empty = False
    can_clear = False  # ReaderIndex.clear raises IndexUnusable: a reader's view is replaced instead

    in_snapshot: int | None = None  # None: all batches

    def make(self, batches: list[IndexBatch]) -> Index:
        if not batches:
            pytest.skip("a reader's view stands on a snapshot with a position")
        k = len(batches) if self.in_snapshot is None else self.in_snapshot
        return self.track(reader_view(str(self.tmp / "index"), self.log, batches, k))

    def released(self, idx: Index) -> None:
        assert idx.revoked
        snap = IndexSnapshot.open(str(self.tmp / "index"), STORE_ID)  # None while it is held
        assert snap is not None
        snap.close()

    def test_snapshot_entries_are_checked_against_the_log(self):
        b = self.log.batch(S(1), S(2))
        idx = self.make([b])
        loc = b.commits[0].loc
        self.log.payloads[loc] = encode_commit(self.log.commit(7).commit)  # the log says otherwise
        with pytest.raises(IndexUnusable):
            idx.get_commit(1)
        assert idx.get_commit(2) == b.commits[1]


class TestReaderIndexOverlay(TestReaderIndex):
    """The reader's view with only the first batch in its snapshot: the rest is applied to it
    as a reader's scan of the log after the snapshot's position does."""

    in_snapshot = 1


def test_indexes_agree_on_the_same_batches(tmp_path):
    log = FakeLog()
    batches = [log.batch(*b) for b in CHAIN_BATCHES]
    log.roll()
    batches.append(log.batch(S(12), D(13), chunks=4, trees=2))
    makers = {
        "memory": lambda: applied(MemoryIndex(), batches),
        "lmdb": lambda: applied(LmdbIndex(str(tmp_path / "lmdb"), STORE_ID), batches),
        "reader": lambda: reader_view(str(tmp_path / "reader"), log, batches, len(batches)),
        "reader+overlay": lambda: reader_view(str(tmp_path / "overlay"), log, batches, 1),
    }
    got = {}
    for name, make in makers.items():
        idx = make()
        try:
            got[name] = log_answers(idx, log)
        finally:
            idx.close()
    assert got["memory"]["recoverable"] == CHAIN_RECOVERABLE + [12, 13]
    for name, a in got.items():
        assert a == got["memory"], name


def _real_state(i: int) -> dict:
    return {"w": torch.arange(10_000, dtype=torch.float32) * i, "fixed": torch.ones(5000),
            "b": torch.arange(4, dtype=torch.int16) + i, "i": i}


def test_indexes_agree_on_a_real_store(tmp_path):
    """A store's own indexes, filled from its log: the writer's LmdbIndex, a warm reader's
    ReaderIndex and a cold reader's MemoryIndex answer alike about every key the log holds."""
    path = tmp_path / "s"
    with ckptstore.open(path, "a", chunk_size=16 << 10, segment_size=64 << 10) as w:
        for i in (1, 2, 3, 5):
            w.save(i, _real_state(i))
    got = {}
    with ckptstore.open(path, "r", use_index=False) as cold:
        assert type(cold.index) is MemoryIndex
        # the index interface has no enumeration: take the keys from the scan's dicts
        keys = (list(cold.index._chunks), list(cold.index._trees), [0, 1, 2, 3, 4, 5, 6])
        got["memory"] = answers(cold.index, *keys)
    with ckptstore.open(path, "r") as warm:
        assert isinstance(warm.index, ReaderIndex)
        got["reader"] = answers(warm.index, *keys)
    with ckptstore.open(path, "a") as w:
        assert isinstance(w.index, LmdbIndex)
        got["lmdb"] = answers(w.index, *keys)
    assert len(keys[0]) >= 4 and len(got["memory"]["segments"]) >= 2
    assert got["memory"]["iterations"] == [1, 2, 3, 5]
    assert got["memory"]["recoverable"] == [1, 2, 3, 5]
    assert all(v is not None for v in got["memory"]["chunks"].values())
    for name, a in got.items():
        assert a == got["memory"], name


# ==== the file-ops seam ============================================================================

def _assert_io_error(err: BaseException, operation: str, path: str, code: int) -> None:
    assert isinstance(err, StoreIOError) and isinstance(err, OSError), type(err)
    assert err.operation == operation
    assert err.filename == path
    assert err.errno == code
    assert operation in str(err) and path in str(err)
    assert isinstance(err, DiskFullError) == (code in (errno.ENOSPC, errno.EDQUOT))


def _read(path) -> bytes:
    return Path(path).read_bytes()


class FileOpsConformance:
    """The contract of ``ckptstore.storage.fileops.FileOps``. Subclasses implement
    :meth:`make_ops`; the instance must be configured never to inject a fault."""

    #: advise_written may be fed calls whose advice fails (it must then return False)
    advice_may_fail = True

    def make_ops(self) -> FileOps:
        raise NotImplementedError

    @pytest.fixture
    def ops(self) -> FileOps:
        return self.make_ops()

    # ---- open, write, fsync ------------------------------------------------------------------
    def test_create_write_fsync_read(self, ops, tmp_path):
        p = str(tmp_path / "seg")
        fd = ops.open_append(p, create=True)
        try:
            arr = np.arange(6, dtype=np.float32).reshape(2, 3)  # lengths count bytes, not items
            ops.writev(fd, p, [b"head", memoryview(bytearray(b"-mid-")), b"", arr], 0)
            ops.writev(fd, p, [b"tail"], 4 + 5 + arr.nbytes)
            ops.fsync(fd, p)
        finally:
            os.close(fd)
        assert _read(p) == b"head-mid-" + arr.tobytes() + b"tail"

    def test_writev_at_offsets(self, ops, tmp_path):
        p = str(tmp_path / "f")
        fd = ops.open_truncate(p)
        try:
            ops.writev(fd, p, [b"abcdef"], 10)          # past the end: a hole of zeros
            ops.writev(fd, p, [b"XY", b"Z"], 12)        # over bytes already written
            payload = os.urandom(100_000)
            ops.writev(fd, p, [payload[:1], memoryview(payload)[1:]], 16)
            ops.fsync(fd, p)
        finally:
            os.close(fd)
        assert _read(p) == bytes(10) + b"abXYZf" + payload

    def test_create_refuses_an_existing_file(self, ops, tmp_path):
        p = tmp_path / "seg"
        p.write_bytes(b"committed")
        with pytest.raises(StoreIOError) as e:
            ops.open_append(str(p), create=True)
        _assert_io_error(e.value, "create", str(p), errno.EEXIST)
        assert _read(p) == b"committed"

    def test_open_existing_keeps_its_bytes(self, ops, tmp_path):
        p = tmp_path / "seg"
        p.write_bytes(b"0123456789")
        fd = ops.open_append(str(p), create=False)
        try:
            ops.writev(fd, str(p), [b"ab"], 10)
            ops.fsync(fd, str(p))
        finally:
            os.close(fd)
        assert _read(p) == b"0123456789ab"

    def test_open_missing_file_without_create(self, ops, tmp_path):
        p = str(tmp_path / "missing")
        with pytest.raises(StoreIOError) as e:
            ops.open_append(p, create=False)
        _assert_io_error(e.value, "open", p, errno.ENOENT)
        assert not os.path.exists(p)

    def test_open_truncate_creates_or_empties(self, ops, tmp_path):
        old, new = tmp_path / "old", tmp_path / "new"
        old.write_bytes(b"x" * 1000)
        for p in (old, new):
            fd = ops.open_truncate(str(p))
            try:
                assert os.fstat(fd).st_size == 0
                ops.writev(fd, str(p), [b"fresh"], 0)
                ops.fsync(fd, str(p))
            finally:
                os.close(fd)
            assert _read(p) == b"fresh"

    def test_open_lock_creates_and_keeps(self, ops, tmp_path):
        p = tmp_path / "lock"
        fd = ops.open_lock(str(p))
        os.close(fd)
        assert p.is_file() and _read(p) == b""
        p.write_bytes(b"pid 1")
        fd = ops.open_lock(str(p))
        try:
            assert os.pread(fd, 16, 0) == b"pid 1"   # opened for reading too, not truncated
        finally:
            os.close(fd)

    def test_open_under_a_missing_directory(self, ops, tmp_path):
        p = str(tmp_path / "no" / "such" / "seg")
        for call, op in ((lambda: ops.open_append(p, create=True), "create"),
                         (lambda: ops.open_truncate(p), "create"),
                         (lambda: ops.open_lock(p), "open lock file")):
            with pytest.raises(StoreIOError) as e:
                call()
            _assert_io_error(e.value, op, p, errno.ENOENT)

    def test_write_to_a_full_disk_is_disk_full(self, ops):
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full")
        fd = ops.open_append("/dev/full", create=False)
        try:
            with pytest.raises(DiskFullError) as e:
                ops.writev(fd, "/dev/full", [b"x" * 100], 0)
        finally:
            os.close(fd)
        _assert_io_error(e.value, "write", "/dev/full", errno.ENOSPC)

    def test_write_to_a_read_only_descriptor(self, ops, tmp_path):
        p = tmp_path / "f"
        p.write_bytes(b"keep")
        fd = os.open(p, os.O_RDONLY)
        try:
            with pytest.raises(StoreIOError) as e:
                ops.writev(fd, str(p), [b"xx"], 0)
        finally:
            os.close(fd)
        _assert_io_error(e.value, "write", str(p), errno.EBADF)
        assert _read(p) == b"keep"

    # ---- directories -------------------------------------------------------------------------
    def test_makedirs_is_idempotent(self, ops, tmp_path):
        d = tmp_path / "a" / "b" / "c"
        ops.makedirs(str(d))
        assert d.is_dir()
        (d / "f").write_bytes(b"1")
        ops.makedirs(str(d))
        ops.makedirs(str(tmp_path / "a"))
        assert d.is_dir() and _read(d / "f") == b"1"

    def test_makedirs_over_a_file(self, ops, tmp_path):
        f = tmp_path / "f"
        f.write_bytes(b"1")
        with pytest.raises(StoreIOError) as e:
            ops.makedirs(str(f))
        _assert_io_error(e.value, "create directory", str(f), errno.EEXIST)
        assert _read(f) == b"1"

    def test_fsync_dir(self, ops, tmp_path):
        (tmp_path / "f").write_bytes(b"1")
        assert ops.fsync_dir(str(tmp_path)) is None
        assert sorted(os.listdir(tmp_path)) == ["f"]
        missing = str(tmp_path / "missing")
        with pytest.raises(StoreIOError) as e:
            ops.fsync_dir(missing)
        _assert_io_error(e.value, "directory fsync", missing, errno.ENOENT)

    # ---- truncate, rename, unlink ------------------------------------------------------------
    def test_truncate(self, ops, tmp_path):
        p = tmp_path / "f"
        p.write_bytes(b"0123456789")
        fd = os.open(p, os.O_WRONLY)
        try:
            ops.truncate(fd, str(p), 4)
            assert _read(p) == b"0123"
            ops.truncate(fd, str(p), 8)
            assert _read(p) == b"0123" + bytes(4)
        finally:
            os.close(fd)
        fd = os.open(p, os.O_RDONLY)
        try:
            with pytest.raises(StoreIOError) as e:
                ops.truncate(fd, str(p), 0)
        finally:
            os.close(fd)
        assert e.value.operation == "truncate" and e.value.filename == str(p)
        assert e.value.errno in (errno.EBADF, errno.EINVAL)
        assert _read(p) == b"0123" + bytes(4)

    def test_rename_replaces(self, ops, tmp_path):
        src, dst = tmp_path / "src", tmp_path / "dst"
        src.write_bytes(b"new")
        dst.write_bytes(b"old")
        ops.rename(str(src), str(dst))
        assert not src.exists() and _read(dst) == b"new"
        with pytest.raises(StoreIOError) as e:
            ops.rename(str(src), str(dst))
        _assert_io_error(e.value, "rename", f"{src} -> {dst}", errno.ENOENT)
        assert _read(dst) == b"new"

    def test_unlink(self, ops, tmp_path):
        p = tmp_path / "f"
        p.write_bytes(b"1")
        ops.unlink(str(p))
        assert not p.exists()
        with pytest.raises(StoreIOError) as e:
            ops.unlink(str(p))
        _assert_io_error(e.value, "unlink", str(p), errno.ENOENT)

    # ---- write_file_atomic -------------------------------------------------------------------
    def test_write_file_atomic(self, ops, tmp_path):
        p = tmp_path / "STORE"
        ops.write_file_atomic(str(p), b"first")
        assert _read(p) == b"first"
        (tmp_path / "STORE.tmp").write_bytes(b"left by a crash" * 100)
        ops.write_file_atomic(str(p), b"second")
        assert _read(p) == b"second"
        assert sorted(os.listdir(tmp_path)) == ["STORE"]   # no temp file left

    def test_write_file_atomic_under_a_missing_directory(self, ops, tmp_path):
        p = str(tmp_path / "missing" / "STORE")
        with pytest.raises(StoreIOError) as e:
            ops.write_file_atomic(p, b"x")
        assert e.value.errno == errno.ENOENT and e.value.filename.startswith(p)
        assert e.value.operation in str(e.value) and p in str(e.value)
        assert not os.path.exists(os.path.dirname(p))

    # ---- advice ------------------------------------------------------------------------------
    def test_advise_written_never_changes_data(self, ops, tmp_path):
        p = str(tmp_path / "f")
        data = os.urandom(3 * 4096 + 17)
        fd = ops.open_truncate(p)
        try:
            ops.writev(fd, p, [data], 0)
            dirty = ops.advise_written(fd, p, 0, len(data))  # dirty pages: written back, kept
            ops.fsync(fd, p)
            clean = ops.advise_written(fd, p, 4096, 4096)     # clean pages: dropped from the cache
        finally:
            os.close(fd)
        assert isinstance(dirty, bool) and isinstance(clean, bool)
        if hasattr(os, "posix_fadvise"):  # Linux: the advice is available and takes
            assert dirty is True and clean is True
        assert _read(p) == data

    def test_advise_written_failure_is_false(self, ops, tmp_path):
        if not self.advice_may_fail:
            pytest.skip("this FileOps asserts that every advice succeeds")
        p = str(tmp_path / "f")
        fd = ops.open_truncate(p)
        try:
            ops.writev(fd, p, [b"abc"], 0)
            assert ops.advise_written(fd, p, 0, 0) is False     # 0 would mean "to the end"
            assert ops.advise_written(fd, p, 0, -5) is False
        finally:
            os.close(fd)
        assert ops.advise_written(1 << 20, p, 0, 4096) is False  # a bad descriptor: no raise
        assert _read(p) == b"abc"

    # ---- the LMDB index ----------------------------------------------------------------------
    def test_index_open_and_commit_round_trip(self, ops, tmp_path):
        path = str(tmp_path / "index")
        env = ops.index_open(path, map_size=1 << 20, max_dbs=2, subdir=True)
        try:
            db = env.open_db(b"d")
            txn = env.begin(write=True, db=db)
            txn.put(b"k", b"v")
            ops.index_commit(txn, path)
            with env.begin(db=db) as r:
                assert r.get(b"k") == b"v"
            # a commit that fails aborts the transaction and raises (here: it was already ended)
            txn = env.begin(write=True, db=db)
            txn.put(b"k2", b"v2")
            txn.abort()
            with pytest.raises(lmdb.Error):
                ops.index_commit(txn, path)
            with env.begin(db=db) as r:
                assert r.get(b"k2") is None
        finally:
            env.close()
        env = lmdb.open(path, readonly=True, max_dbs=2, subdir=True)
        try:
            with env.begin(db=env.open_db(b"d", create=False)) as r:
                assert r.get(b"k") == b"v" and r.get(b"k2") is None
        finally:
            env.close()

    def test_lmdb_index_through_these_ops(self, ops, tmp_path):
        log = FakeLog()
        b = log.batch(S(1), D(2))
        path = str(tmp_path / "index")
        idx = LmdbIndex(path, STORE_ID, ops=ops)
        try:
            idx.apply(b)
        finally:
            idx.close()
        idx = LmdbIndex(path, STORE_ID)
        try:
            assert idx.iterations() == [1, 2] and idx.recoverable() == [1, 2]
            assert idx.get_commit(2) == b.commits[1] and idx.position() == b.position
        finally:
            idx.close()


class TestFileOps(FileOpsConformance):
    def make_ops(self) -> FileOps:
        return FileOps()


class TestFaultyOpsUnarmed(FileOpsConformance):   # tests/test_faults.py
    def make_ops(self) -> FileOps:
        return FaultyOps()


class TestSweepOpsCounting(FileOpsConformance):   # tests/test_faults.py (fsyncs counted, skipped)
    def make_ops(self) -> FileOps:
        return SweepOps()


class TestDribbleOps(FileOpsConformance):         # tests/test_faults.py: every write is short
    def make_ops(self) -> FileOps:
        return _Dribble()


class TestKillOpsUnarmed(FileOpsConformance):     # tests/_crashkit.py: must never fire here
    def make_ops(self) -> FileOps:
        return KillOps(target=None, armed=False)


class TestFreezeOpsThawed(FileOpsConformance):    # tests/_crashkit.py
    def make_ops(self) -> FileOps:
        return FreezeOps(nth=1 << 62)


class TestRecordingOps(FileOpsConformance):       # tests/test_evict.py
    advice_may_fail = False  # Recording.advise_written asserts that the advice succeeded

    def make_ops(self) -> FileOps:
        return Recording()
