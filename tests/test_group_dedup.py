"""Deduplication inside one group commit (format-spec/deltas.md, "Group commit and durability"):
a pending delta reuses the chunks and trees that earlier pending deltas of its group appended.
Checked: the chunk is written once; a rolled-back group or a failed single delta leaves nothing a
later save could wrongly reuse; a damaged shared chunk damages every delta naming it; SIGKILL at
every write and fsync of two groups leaves a prefix of whole, bit-exact iterations.

Failure granularity is a property of buffered appends (a write fails inside the delta that
issued it), so writers here append buffered (``direct_io=False``); with O_DIRECT appends a
delta's bytes reach the file when the stage fills or at the group's sync, where a failure
aborts the group (tests/test_async.py, tests/test_direct.py). The SIGKILL sweep runs both ways."""

from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import pytest

import ckptstore
from ckptstore.ops.fsck import check
from ckptstore.format.chunk import address_of

from _crashkit import CHUNK_SIZE, SEGMENT_SIZE, CountOps, KillOps, _Journal, die, read_journal
from test_crash import _dies_by_sigkill
from test_faults import FaultyOps

N = 10_000  # float32 entries: 40000 B, three chunks of CHUNK_SIZE (16 KiB)


def arr(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def rec(seed: int, **more) -> dict:
    return {"g": arr(seed), "step": seed, **more}


#: iteration -> gradient seed of the two groups the crash test writes (groups of three):
#: 2 repeats 1 inside group one; 5 repeats 4 and 6 repeats 1 (committed) inside group two
SEEDS = {1: 101, 2: 101, 3: 103, 4: 104, 5: 104, 6: 101}


def open_store(path, **kw):
    kw.setdefault("direct_io", False)
    return ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE, **kw)


def chunk_addresses(a: np.ndarray) -> list[bytes]:
    view = memoryview(a.reshape(-1).view(np.uint8))
    return [address_of(view[s:s + CHUNK_SIZE]) for s in range(0, len(view), CHUNK_SIZE)]


def with_base(path) -> None:
    with open_store(path) as s:
        s.save(0, {"w": arr(0)})


def test_pending_delta_dedups_against_its_group(tmp_path, assert_same):
    path = tmp_path / "s"
    with_base(path)
    with open_store(path) as s:
        st1 = s.save_delta(1, rec(101), durable=False)
        st2 = s.save_delta(2, rec(101), durable=False)
        assert st1.chunks_written == 3 and st1.chunks_deduped == 0
        assert st2.chunks_written == 0 and st2.chunks_deduped == 3  # the group's pending chunks
        assert st2.dedup_bytes == 4 * N
        # the tree is shared as well: delta 2 wrote only its manifest
        assert st2.written_bytes < st1.written_bytes // 10
        assert s.pending() == [1, 2] and s.durable_iteration() == 0
        assert s.flush() == 2
        for a in chunk_addresses(arr(101)):
            assert s.index.get_chunk(a) is not None
    assert check(path).clean
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == [0, 1, 2]
        for it in (1, 2):
            assert_same(rec(101), r.load_record(it), f"iteration {it}")


def test_rolled_back_group_leaves_nothing_to_reuse(tmp_path, assert_same):
    """A group whose commit fails is cut whole: its chunks are in no index and no pending batch,
    so the next saves of the same content write them again."""
    path = tmp_path / "s"
    with_base(path)
    ops = FaultyOps()
    s = open_store(path, file_ops=ops)
    s.save_delta(1, rec(101), durable=False)
    assert s.save_delta(2, rec(101), durable=False).chunks_written == 0
    ops.arm("fsync", 1, errno.EIO)  # the group's first fsync (flush step 1)
    with pytest.raises(ckptstore.StoreIOError):
        s.flush()
    assert s.pending() == [] and s.iterations() == [0]
    assert all(s.index.get_chunk(a) is None for a in chunk_addresses(arr(101)))
    again = s.save_delta(1, rec(101), durable=False)
    assert again.chunks_written == 3  # nothing dangling was reused
    assert s.save_delta(2, rec(101), durable=False).chunks_written == 0
    s.close()
    report = check(path)
    assert report.clean, report.lines()
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == [0, 1, 2]
        assert_same(rec(101), r.load_record(2))


def test_failed_delta_is_cut_alone_and_its_chunks_rewritten(tmp_path, assert_same):
    """Delta 2 dedups ``g`` against pending delta 1 and fails while writing a new tensor: only
    its own records are cut; the retry rewrites the new tensor's cut chunk and still shares
    delta 1's, and the group commits whole."""
    path = tmp_path / "s"
    with_base(path)
    ops = FaultyOps()
    s = open_store(path, file_ops=ops)
    s.save_delta(1, rec(101), durable=False)
    ops.arm("write", 2, errno.ENOSPC)  # the second chunk of ``h`` (``g`` is all deduplicated)
    with pytest.raises(ckptstore.DiskFullError):
        s.save_delta(2, rec(101, h=arr(202)), durable=False)
    assert s.pending() == [1]
    retry = s.save_delta(2, rec(101, h=arr(202)), durable=False)
    assert retry.chunks_written == 3 and retry.chunks_deduped == 3
    assert s.flush() == 2
    s.close()
    assert check(path).clean
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == [0, 1, 2]
        assert_same(rec(101), r.load_record(1))
        assert_same(rec(101, h=arr(202)), r.load_record(2))


def test_damaged_shared_chunk_damages_every_delta_naming_it(tmp_path):
    path = tmp_path / "s"
    with_base(path)
    with open_store(path) as s:
        s.save_delta(1, rec(101), durable=False)
        s.save_delta(2, rec(101), durable=False)
        s.save_delta(3, rec(103), durable=False)
        s.flush()
        ref = s.index.get_chunk(chunk_addresses(arr(101))[1])
        seg = s.log.layout.segment_path(ref.loc.seq)
        off = ref.loc.offset + ref.loc.length // 2
    with open(seg, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    report = check(path)
    assert {1, 2} <= set(report.damaged_iterations), report.lines()
    assert 3 in report.damaged_iterations  # its chain is broken at 1
    with ckptstore.open(path, "r") as r:
        for it in (1, 2):
            with pytest.raises(ckptstore.DamagedCheckpointError):
                r.load_record(it)


# ---- SIGKILL inside groups with deduplicated chunks ---------------------------------------------
def _workload(path, ops, journal=None, direct_io: bool = False) -> None:
    s = open_store(path, file_ops=ops, direct_io=direct_io)
    for it in range(1, 7):
        s.save_delta(it, rec(SEEDS[it]), durable=False)
        if it % 3 == 0:
            s.flush()
            if journal is not None:
                journal(f"durable {it}")
    s.close()


def _count(tmp_path, template, direct_io: bool) -> dict[str, int]:
    work = tmp_path / "count"
    shutil.copytree(template, work)
    ops = CountOps()
    _workload(work, ops, direct_io=direct_io)
    return ops.counts


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "direct"])
def test_sigkill_during_groups_with_deduplicated_chunks(tmp_path, assert_same, direct_io):
    template = tmp_path / "template"
    with_base(template)
    counts = _count(tmp_path, template, direct_io)
    # staged O_DIRECT appends reach the file in a few writes per group, buffered ones per record
    assert counts["write"] >= (4 if direct_io else 15) and counts["fsync"] >= 4
    kills = [("write", n, 0.5, False) for n in range(1, counts["write"] + 1)] + \
            [("fsync", n, 0.0, after) for n in range(1, counts["fsync"] + 1) for after in (False, True)]
    outcomes = set()
    for target, nth, tear, after in kills:
        path = tmp_path / f"{target}-{nth}-{int(after)}"
        shutil.copytree(template, path)
        jpath = str(path) + ".journal"

        def victim():
            _workload(path, KillOps(target, nth, tear, after), _Journal(jpath), direct_io)

        _dies_by_sigkill(victim)
        where = f"kill at {target} #{nth}{' (after)' if after else ''}"
        report = check(path)
        assert report.clean, f"{where}: {report.lines()}"
        durable = max([int(a) for _, e, a in read_journal(jpath) if e == "durable"], default=0)
        with open_store(path) as w:  # recovery cuts the uncommitted tail
            its = w.iterations()
            assert its == list(range(len(its))), f"{where}: not a prefix: {its}"
            assert its[-1] >= durable, f"{where}: durable iterations lost: {its}"
            for it in its[1:]:
                assert_same(rec(SEEDS[it]), w.load_record(it), f"{where}: iteration {it}")
            for it in range(its[-1] + 1, 7):  # the writer finishes the run after the crash
                w.save_delta(it, rec(SEEDS[it]), durable=False)
        assert check(path).clean, where
        with ckptstore.open(path, "r") as r:
            assert r.iterations() == list(range(7))
            for it in range(1, 7):
                assert_same(rec(SEEDS[it]), r.load_record(it), f"{where}: resumed {it}")
        outcomes.add(its[-1])
        shutil.rmtree(path)
    assert {0, 3, 6} <= outcomes  # kills before, between and after the group commits


# ---- a failed rollback with deltas pending before the failed one --------------------------------
def _fail_delta_2_and_its_rollback(s, ops, truncate_failures: int):
    """Delta 1 pending; delta 2 fails writing its second chunk and the rollback's cut fails too
    (``truncate_failures`` truncates fail in a row): the log past delta 1 is in an unknown state.
    Returns where delta 2 started (the end of delta 1's records)."""
    s.save_delta(1, rec(101), durable=False)
    end_of_1 = (s.log.writer.seq, s.log.writer.offset)
    then = None
    for _ in range(truncate_failures):
        then = ("truncate", 1, errno.EIO, False, then)
    ops.arm("write", 2, errno.ENOSPC, then=then)
    with pytest.raises(ckptstore.DiskFullError):
        s.save_delta(2, rec(101, h=arr(202)), durable=False)
    assert s.engine.needs_recovery and s.pending() == [1]
    return end_of_1


def _close_and_check(s, path, iterations: list[int], assert_same) -> None:
    """Close the writer; the store is clean, a reader sees ``iterations`` and delta 1 intact."""
    s.close()
    assert check(path).clean
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == iterations
        assert_same(rec(101), r.load_record(1))


@pytest.mark.parametrize("commit", ["flush", "save"])
def test_commit_after_failed_rollback_cuts_first_then_commits_survivors(tmp_path, assert_same, commit):
    """The pending delta survives, but its COMMIT must not follow the failed delta's records: the
    cut is retried first, and the commit lands exactly where delta 2 had started."""
    path = tmp_path / "s"
    with_base(path)
    ops = FaultyOps()
    s = open_store(path, file_ops=ops)
    end_of_1 = _fail_delta_2_and_its_rollback(s, ops, truncate_failures=1)
    if commit == "flush":
        assert s.flush() == 1
    else:  # a snapshot commits the pending group first
        s.save(2, {"w": arr(2)})
    loc = s.index.get_commit(1).loc
    assert (loc.seq, loc.offset) == end_of_1
    assert s.pending() == [] and not s.engine.needs_recovery
    if commit == "flush":
        s.save_delta(2, rec(101, h=arr(202)))  # the writer goes on
    _close_and_check(s, path, [0, 1, 2], assert_same)


@pytest.mark.parametrize("damage", ["flip", "torn"])
def test_damaged_leftover_of_failed_delta_is_cut_before_the_commit(tmp_path, assert_same, damage):
    """What the failed save left past delta 1 is damaged (bytes flipped inside its chunk record,
    or a torn record header at the end): the retried cut removes it whatever it holds, the
    commit lands right after delta 1, and the store is clean."""
    path = tmp_path / "s"
    with_base(path)
    ops = FaultyOps()
    s = open_store(path, file_ops=ops)
    seq, off = _fail_delta_2_and_its_rollback(s, ops, truncate_failures=1)
    seg = s.log.layout.segment_path(seq)
    size = os.path.getsize(seg)
    assert size > off  # the failed delta's first chunk record is still there
    with open(seg, "r+b") as f:
        if damage == "flip":
            f.seek(off + (size - off) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
        else:
            f.seek(size)
            f.write(b"CKPR" + os.urandom(9))  # the first bytes of a record header, then nothing
    assert s.flush() == 1
    loc = s.index.get_commit(1).loc
    assert (loc.seq, loc.offset) == (seq, off)
    _close_and_check(s, path, [0, 1], assert_same)


@pytest.mark.parametrize("call", ["iterations", "durable_iteration", "latest"])
def test_any_call_after_a_failed_rollback_keeps_the_pending_deltas(tmp_path, assert_same, call):
    """Not only flush: whatever call finishes the failed save's recovery re-cuts to the end of
    the pending deltas first, so they stay pending and commit later."""
    path = tmp_path / "s"
    with_base(path)
    ops = FaultyOps()
    s = open_store(path, file_ops=ops)
    seq, off = _fail_delta_2_and_its_rollback(s, ops, truncate_failures=1)
    getattr(s, call)()
    assert s.pending() == [1] and not s.engine.needs_recovery
    s.save_delta(2, rec(101, h=arr(202)), durable=False)  # the retry joins the group
    assert s.flush() == 2
    loc = s.index.get_commit(1).loc
    assert (loc.seq, loc.offset) > (seq, off)  # delta 2's records came first, then the commits
    _close_and_check(s, path, [0, 1, 2], assert_same)


def test_pending_deltas_cut_by_a_recovery_are_reported_by_the_next_save_delta(tmp_path, assert_same):
    """The cut fails twice and a read-side call runs the recovery (which cuts the pending delta):
    the next save_delta says so, naming it, instead of a puzzling chain error; then the writer
    goes on from the durable iteration."""
    path = tmp_path / "s"
    with_base(path)
    ops = FaultyOps()
    s = open_store(path, file_ops=ops)
    _fail_delta_2_and_its_rollback(s, ops, truncate_failures=2)
    assert s.iterations() == [0] and s.pending() == []
    with pytest.raises(ckptstore.CheckpointAbortedError, match=r"deltas \[1\]"):
        s.save_delta(2, rec(101, h=arr(202)), durable=False)
    assert s.flush() == 0  # reported once
    s.save_delta(1, rec(101))
    _close_and_check(s, path, [0, 1], assert_same)


def test_commit_after_rollback_failing_twice_aborts_the_pending_deltas(tmp_path, assert_same):
    """If the cut fails again, the pending delta is not committed on top of an unknown tail:
    recovery cuts it with the tail and flush says so (CheckpointAbortedError naming it)."""
    path = tmp_path / "s"
    with_base(path)
    ops = FaultyOps()
    s = open_store(path, file_ops=ops)
    _fail_delta_2_and_its_rollback(s, ops, truncate_failures=2)
    with pytest.raises(ckptstore.CheckpointAbortedError, match=r"deltas \[1\]") as info:
        s.flush()
    assert str(path) in str(info.value)
    assert s.pending() == [] and s.iterations() == [0] and s.durable_iteration() == 0
    s.save_delta(1, rec(101))  # the store is usable again
    _close_and_check(s, path, [0, 1], assert_same)


def test_sigkill_while_committing_after_a_failed_rollback(tmp_path, assert_same):
    """SIGKILL at every write, fsync and truncate of the retried cut and the group's commit
    (torn writes included): the store opens clean, delta 1 is either committed or cut, and
    nothing of the failed delta 2 is ever visible."""
    template = tmp_path / "template"
    with_base(template)

    class FailThenKill(KillOps):
        """FaultyOps' two failures, then KillOps' SIGKILL counted from ``armed``."""

        def __init__(self, target, nth, tear, after):
            super().__init__(target, nth, tear, after, armed=False)
            self.faults = FaultyOps()

        def _pwritev(self, fd, buffers, offset):
            err = self.faults._hit("write")
            if err is not None:
                raise OSError(err, os.strerror(err))
            return super()._pwritev(fd, buffers, offset)

        def _ftruncate(self, fd, length):
            err = self.faults._hit("truncate")
            if err is not None:
                raise OSError(err, os.strerror(err))
            return super()._ftruncate(fd, length)

    def workload(path, ops, journal=None) -> None:
        s = open_store(path, file_ops=ops)
        _fail_delta_2_and_its_rollback(s, ops.faults, truncate_failures=1)
        ops.armed = True
        s.flush()
        if journal is not None:
            journal("durable 1")
        s.save_delta(2, rec(101, h=arr(202)))
        if journal is not None:
            journal("durable 2")
        s.close()

    kills = [(target, n, tear, after) for target in ("write", "fsync", "truncate")
             for n in range(1, 7) for tear, after in ((0.5, False), (0.0, True))]
    outcomes = set()
    for target, nth, tear, after in kills:
        path = tmp_path / f"{target}-{nth}-{int(after)}"
        shutil.copytree(template, path)
        jpath = str(path) + ".journal"
        where = f"kill at {target} #{nth}{' (after)' if after else ''}"

        def victim():
            workload(path, FailThenKill(target, nth, tear, after), _Journal(jpath))
            die()  # a kill past the last call of this kind: end the same way

        _dies_by_sigkill(victim)
        report = check(path)
        assert report.clean, f"{where}: {report.lines()}"
        durable = max([int(a) for _, e, a in read_journal(jpath) if e == "durable"], default=0)
        with open_store(path) as w:
            its = w.iterations()
            assert its == list(range(len(its))) and its[-1] >= durable, f"{where}: {its}"
            if 1 in its:
                assert_same(rec(101), w.load_record(1), where)
            if 2 in its:
                assert_same(rec(101, h=arr(202)), w.load_record(2), where)
        outcomes.add(its[-1])
        shutil.rmtree(path)
    assert outcomes == {0, 1, 2}, outcomes
