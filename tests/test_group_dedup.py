"""Deduplication inside one group commit (format-spec/deltas.md, "Group commit and durability"):
a pending delta reuses the chunks and trees that earlier pending deltas of its group appended.
Checked: the chunk is written once; a rolled-back group or a failed single delta leaves nothing a
later save could wrongly reuse; a damaged shared chunk damages every delta naming it; SIGKILL at
every write and fsync of two groups leaves a prefix of whole, bit-exact iterations."""

from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import pytest

import ckptstore
from ckptstore.fsck import check
from ckptstore.format.chunk import address_of

from _crashkit import CHUNK_SIZE, SEGMENT_SIZE, KillOps, _Journal, read_journal
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
def _workload(path, ops, journal=None) -> None:
    s = open_store(path, file_ops=ops)
    for it in range(1, 7):
        s.save_delta(it, rec(SEEDS[it]), durable=False)
        if it % 3 == 0:
            s.flush()
            if journal is not None:
                journal(f"durable {it}")
    s.close()


def _count(tmp_path, template) -> dict[str, int]:
    from ckptstore.storage.fileops import FileOps

    counts = {"write": 0, "fsync": 0}

    class CountOps(FileOps):
        def _pwritev(self, fd, buffers, offset):
            counts["write"] += 1
            return super()._pwritev(fd, buffers, offset)

        def _fsync(self, fd):
            counts["fsync"] += 1
            return super()._fsync(fd)

    work = tmp_path / "count"
    shutil.copytree(template, work)
    _workload(work, CountOps())
    return counts


def test_sigkill_during_groups_with_deduplicated_chunks(tmp_path, assert_same):
    template = tmp_path / "template"
    with_base(template)
    counts = _count(tmp_path, template)
    assert counts["write"] >= 15 and counts["fsync"] >= 4
    kills = [("write", n, 0.5, False) for n in range(1, counts["write"] + 1)] + \
            [("fsync", n, 0.0, after) for n in range(1, counts["fsync"] + 1) for after in (False, True)]
    outcomes = set()
    for target, nth, tear, after in kills:
        path = tmp_path / f"{target}-{nth}-{int(after)}"
        shutil.copytree(template, path)
        jpath = str(path) + ".journal"

        def victim():
            _workload(path, KillOps(target, nth, tear, after), _Journal(jpath))

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
