"""O_DIRECT appends (ckptstore/storage/direct.py): same bytes, same durability, fallbacks."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.format import records as rec
from ckptstore.ops.fsck import check
from ckptstore.storage import direct
from ckptstore.storage.direct import ALIGN, StagingBuffer
from ckptstore.storage.fileops import FileOps
from ckptstore.storage.layout import Layout
from ckptstore.storage.segments import SegmentFile, SegmentWriter, scan_segment

pytestmark = pytest.mark.skipif(not direct.supported(), reason="no O_DIRECT on this platform")


def _direct_ok(path: Path) -> bool:
    fd = FileOps().open_direct(str(path))
    if fd is None:
        return False
    os.close(fd)
    return True


@pytest.fixture
def dio_dir(tmp_path: Path) -> Path:
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    if not _direct_ok(probe):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    return tmp_path


def _drive(w: SegmentWriter, rng: random.Random, steps: int) -> None:
    """Random appends (tiny to several stage capacities), syncs, truncates back to a record
    boundary (a rollback) and flushes."""
    ends = [w.offset]
    for _ in range(steps):
        r = rng.random()
        if r < 0.70:
            size = rng.choice([0, 1, 17, 4000, 4096, 5000, 70_000, 1 << 20,
                               rng.randrange(1, (3 * w_capacity(w)) // 2)])
            parts = [rng.randbytes(size // 2), memoryview(rng.randbytes(size - size // 2))]
            ends.append(w.append(rec.RecordType.CHUNK, parts).end)
        elif r < 0.85:
            w.sync()
            assert os.path.getsize(w.path) == w.offset  # no padding past the log's end, ever
        elif r < 0.95:
            if rng.random() < 0.5:
                w.sync()
            keep = rng.randrange(len(ends))
            w.truncate(ends[keep])
            del ends[keep + 1:]
        else:
            w.flush()


def w_capacity(w: SegmentWriter) -> int:
    return w.direct.stage.capacity if w.direct is not None else 1 << 16


@pytest.mark.parametrize("seed", range(6))
def test_direct_appends_write_the_bytes_buffered_appends_write(dio_dir: Path, seed: int) -> None:
    stage = StagingBuffer(64 << 10)  # small, so records span many stage refills
    paths = [dio_dir / "direct.seg", dio_dir / "buffered.seg"]
    writers = [SegmentWriter.create(str(paths[0]), 1, b"s" * 16, FileOps(), stage=stage,
                                    framing_checks=False),
               SegmentWriter.create(str(paths[1]), 1, b"s" * 16, FileOps(), framing_checks=False)]
    assert writers[0].direct is not None and writers[1].direct is None
    for w in writers:
        _drive(w, random.Random(seed), 60)
        w.sync()
    assert writers[0].offset == writers[1].offset
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert writers[0].direct is not None and writers[0].direct.direct_bytes > 0
    # reopened at the unaligned end (the partial block is read back), appending on
    ends = [w.offset for w in writers]
    for w in writers:
        w.close()
    writers = [SegmentWriter.reopen(str(paths[0]), 1, ends[0], FileOps(), stage=stage,
                                    framing_checks=False),
               SegmentWriter.reopen(str(paths[1]), 1, ends[1], FileOps(), framing_checks=False)]
    for w in writers:
        _drive(w, random.Random(seed + 100), 30)
        w.close()  # close writes what is staged, like buffered appends reach the file
    assert paths[0].read_bytes() == paths[1].read_bytes()
    records = list(scan_segment(SegmentFile(str(paths[0]), 1), verify=True))
    assert records and all(getattr(r, "error", None) is None and hasattr(r, "loc") for r in records)


class _AppendOnlyOps(FileOps):
    """Asserts that every write starts exactly at the file's current end: no write ever covers a
    byte already in the file (format-spec §14: an interrupted write may leave garbage over its
    whole range, A2/A3, so rewriting the block that holds the last COMMIT, even with the same
    bytes, would put a committed checkpoint at risk)."""

    writes = 0

    def _pwritev(self, fd, buffers, offset):
        size = os.fstat(fd).st_size
        assert offset == size, f"a write at {offset} covers bytes already in the file (size {size})"
        self.writes += 1
        return super()._pwritev(fd, buffers, offset)


@pytest.mark.parametrize("seed", range(4))
def test_appends_never_write_a_byte_twice(dio_dir: Path, seed: int) -> None:
    ops = _AppendOnlyOps()
    stage = StagingBuffer(64 << 10)
    path = dio_dir / "s.seg"
    w = SegmentWriter.create(str(path), 1, b"s" * 16, ops, stage=stage, framing_checks=False)
    _drive(w, random.Random(seed), 60)
    end = w.offset
    w.close()
    # an unaligned end, read back
    w = SegmentWriter.reopen(str(path), 1, end, ops, stage=stage, framing_checks=False)
    _drive(w, random.Random(seed + 100), 30)
    w.close()
    assert ops.writes > 20


def test_unsynced_direct_appends_are_not_in_the_file(dio_dir: Path) -> None:
    """What was appended and not synced or flushed lives in memory only (as an unsynced buffered
    append may be lost to a power cut); a sync puts it in the file, exactly at its end."""
    stage = StagingBuffer(1 << 20)
    path = dio_dir / "a.seg"
    w = SegmentWriter.create(str(path), 1, b"s" * 16, FileOps(), stage=stage, framing_checks=False)
    start = w.offset
    w.append(rec.RecordType.CHUNK, [b"x" * 1000])
    assert os.path.getsize(path) == start
    w.sync()
    assert os.path.getsize(path) == w.offset == start + rec.OVERHEAD + 1000
    w.close()


class _RefusingOpen(FileOps):
    """A file system that refuses O_DIRECT at open (as tmpfs did before Linux 6.6)."""

    def _open(self, path, flags, mode):
        if flags & direct.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return super()._open(path, flags, mode)


class _DirectFds(FileOps):
    """Remembers the descriptors opened with O_DIRECT (for subclasses that fail their writes)."""

    def __init__(self) -> None:
        self.direct_fds: set[int] = set()

    def _open(self, path, flags, mode):
        fd = super()._open(path, flags, mode)
        if flags & direct.O_DIRECT:
            self.direct_fds.add(fd)
        return fd


class _RefusingWrite(_DirectFds):
    """A file system that opens with O_DIRECT but refuses the writes (EINVAL)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def _pwritev(self, fd, buffers, offset):
        if fd in self.direct_fds:
            self.refused += 1
            raise OSError(errno.EINVAL, "O_DIRECT write refused")
        return super()._pwritev(fd, buffers, offset)


def _state(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(600_000, generator=g), "b": torch.randn(77, generator=g), "i": i}


@pytest.mark.parametrize("ops_cls", [_RefusingOpen, _RefusingWrite])
def test_a_file_system_that_refuses_o_direct_gets_buffered_appends(tmp_path: Path, ops_cls) -> None:
    ops = ops_cls()
    with ckptstore.open(tmp_path / "s", file_ops=ops, chunk_size=1 << 20, direct_io=True) as s:
        for i in range(1, 4):
            s.save(i, _state(i))
        assert s.engine.log.writer.direct is None
    if isinstance(ops, _RefusingWrite):
        assert ops.refused >= 1
    with ckptstore.open(tmp_path / "s", mode="r") as r:
        for i in range(1, 4):
            got, want = r.load(i), _state(i)
            assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])


def test_store_saves_through_o_direct_and_loads_exactly(dio_dir: Path) -> None:
    path = dio_dir / "s"
    with ckptstore.open(path, chunk_size=1 << 20, direct_io=True) as s:
        for i in range(1, 4):
            s.save(i, _state(i))
        d = s.engine.log.writer.direct
        assert d is not None and d.direct_bytes >= 3 * 600_000 * 4 * 0.9
    with ckptstore.open(path, direct_io=False) as s:  # the same store, buffered appends
        s.save(4, _state(4))
        assert s.engine.log.writer.direct is None
    with ckptstore.open(path, direct_io=True) as s:  # and direct again, resuming mid-block
        s.save(5, _state(5))
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == [1, 2, 3, 4, 5]
        for i in range(1, 6):
            got, want = r.load(i), _state(i)
            assert torch.equal(got["w"], want["w"]) and got["i"] == i
    assert check(str(path)).clean


def test_staging_buffer_is_page_aligned_and_zero() -> None:
    b = StagingBuffer(3 * ALIGN)
    assert b.overlap and len(b.arrays) == 2
    for array, view in zip(b.arrays, b.views):
        assert array.ctypes.data % ALIGN == 0 and len(view) == 3 * ALIGN
        assert not np.any(array)
    assert not StagingBuffer(ALIGN, overlap=False).overlap
    with pytest.raises(ValueError):
        StagingBuffer(ALIGN + 1)


def test_staging_memory_is_made_by_the_first_append_not_by_opening(dio_dir: Path) -> None:
    """A restarted trainer opens its store and restores before it writes: opening for writing
    and loading make no staging memory (touching it cost 10-18 ms of every resume); the first
    save through O_DIRECT does."""
    path = str(dio_dir / "s")
    with ckptstore.open(path) as st:
        st.save(1, _state(1))
    with ckptstore.open(path, direct_io=True) as st:
        stage = st.engine.log.stage
        assert stage is not None
        assert torch.equal(st.load(1)["w"], _state(1)["w"])
        assert not stage.allocated
        st.save(2, _state(2))
        assert stage.allocated
        assert torch.equal(st.load(2)["w"], _state(2)["w"])


class _FullOnDirect(_DirectFds):
    """O_DIRECT writes fail with ENOSPC while ``full`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.full = False

    def _pwritev(self, fd, buffers, offset):
        if self.full and fd in self.direct_fds:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return super()._pwritev(fd, buffers, offset)


def test_a_failed_direct_save_is_cut_from_the_stage_too(dio_dir: Path) -> None:
    """Regression: a save whose records never left the stage (its O_DIRECT write failed) was not
    cut, because the cut looked only at the file's size; the writer then appended after the
    failed records. The cut now follows the writer's end: the next save starts where the last
    commit ends and nothing of the failed one reaches the file."""
    ops = _FullOnDirect()
    path = dio_dir / "s"
    s = ckptstore.open(path, file_ops=ops, chunk_size=1 << 20, direct_io=True)
    s.save(1, _state(1))
    end_of_1 = s.engine.log.writer.offset
    ops.full = True
    with pytest.raises(ckptstore.DiskFullError):
        s.save(2, _state(2))
    assert s.engine.log.writer.offset == end_of_1 and s.iterations() == [1]
    ops.full = False
    s.save(3, _state(3))
    s.close()
    seg = SegmentFile(str(Layout(str(path)).segment_path(1)), 1)
    manifests = [r for r in scan_segment(seg) if getattr(r, "type", None) == rec.RecordType.MANIFEST]
    assert len(manifests) == 2  # iterations 1 and 3: no record of the failed save in the file
    report = check(str(path))
    assert report.clean and not report.notes, report.lines()
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == [1, 3]
        assert torch.equal(r.load(3)["w"], _state(3)["w"])


def _delta(i: int) -> dict:
    g = torch.Generator().manual_seed(1000 + i)
    return {"g": torch.randn(300_000, generator=g), "i": i}


def _mixed(s, its=range(1, 13)) -> None:
    """Snapshots every 4 iterations, deltas between them in groups of 2 (a delta group is
    committed by the next snapshot or every second delta)."""
    for i in its:
        if i % 4 == 1:
            s.save(i, _state(i))
        else:
            s.save_delta(i, _delta(i), durable=i % 2 == 0)
    s.flush()


def test_default_mode_writes_deltas_direct_and_snapshots_buffered(dio_dir: Path) -> None:
    """direct_io="deltas" (the default) switches the same segment between O_DIRECT (delta
    records) and buffered appends (snapshots); every checkpoint loads exactly and fsck is clean
    (tests/test_direct.py's writer-level test checks the bytes against buffered appends)."""
    path = dio_dir / "s"
    with ckptstore.open(path, chunk_size=1 << 20) as s:
        _mixed(s)
        d = s.engine.log.writer.direct
        assert d is not None and d.direct_bytes >= 7 * 300_000 * 4 * 0.9
        assert d.direct_bytes < 12 * 300_000 * 4  # the snapshots went buffered
    assert check(str(path)).clean
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == list(range(1, 13))
        for i in range(1, 13):
            if i % 4 == 1:
                assert torch.equal(r.load(i)["w"], _state(i)["w"])
            else:
                assert torch.equal(r.load_record(i)["g"], _delta(i)["g"])


@pytest.mark.slow
def test_sigkill_at_every_write_and_fsync_of_mixed_direct_and_buffered_appends(dio_dir: Path,
                                                                               assert_same) -> None:
    """Kill the default-mode writer at each of its writes (torn: an O_DIRECT write on a block
    boundary) and fsyncs: a prefix of whole iterations survives, every durable one among them,
    fsck is clean and the writer finishes the run."""
    import shutil

    from _crashkit import kill_sweep

    template = dio_dir / "template"
    with ckptstore.open(template, chunk_size=1 << 20) as s:
        s.save(0, _state(0))

    def run(path: Path, ops: FileOps, journal=None) -> None:
        s = ckptstore.open(path, chunk_size=1 << 20, file_ops=ops)
        for i in range(1, 8):
            if i % 4 == 1:
                s.save(i, _state(i))
            else:
                s.save_delta(i, _delta(i), durable=i % 2 == 0)
            if journal is not None and s.durable_iteration() is not None:
                journal(f"durable {s.durable_iteration()}")
        s.close()

    for path, where, durable in kill_sweep(template, dio_dir, run):
        with ckptstore.open(path, chunk_size=1 << 20) as w:
            its = w.iterations()
            assert its == list(range(len(its))) and its[-1] >= durable, f"{where}: {its}"
            for i in its[1:]:
                got = w.load(i) if i % 4 == 1 else w.load_record(i)
                want = _state(i) if i % 4 == 1 else _delta(i)
                assert_same(want, got, f"{where}: iteration {i}")
            for i in range(its[-1] + 1, 8):  # the writer finishes the run
                if i % 4 == 1:
                    w.save(i, _state(i))
                else:
                    w.save_delta(i, _delta(i), durable=True)
        with ckptstore.open(path, mode="r") as r:
            assert r.iterations() == list(range(8)), where
        shutil.rmtree(path)


# ---- two-stage overlap: a background write that fails --------------------------------------------
class _FailNthDirect(_DirectFds):
    """The ``fail_at``-th O_DIRECT write from now fails with ENOSPC (counted from 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at = 0
        self.direct_writes = 0

    def _pwritev(self, fd, buffers, offset):
        if fd in self.direct_fds:
            self.direct_writes += 1
            if self.fail_at and self.direct_writes == self.fail_at:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return super()._pwritev(fd, buffers, offset)


def test_a_failed_background_write_is_a_hole_no_append_or_cut_may_pass(dio_dir: Path) -> None:
    """Writer level, a 64 KiB two-region stage: a background write that fails leaves its bytes
    out of the file. The error comes back at the next append; every append and any cut past
    the hole's start raise it again, a cut back before it works, and the writer then writes
    exactly the bytes a buffered writer writes for the surviving records."""
    ops = _FailNthDirect()
    stage = StagingBuffer(64 << 10)
    path, ref_path = dio_dir / "d.seg", dio_dir / "b.seg"
    w = SegmentWriter.create(str(path), 1, b"s" * 16, ops, stage=stage, framing_checks=False)
    ref = SegmentWriter.create(str(ref_path), 1, b"s" * 16, FileOps(), framing_checks=False)
    rng = random.Random(7)
    for _ in range(3):
        part = rng.randbytes(50_000)
        w.append(rec.RecordType.CHUNK, [part])
        ref.append(rec.RecordType.CHUNK, [part])
    w.sync()
    ref.sync()
    good = w.offset
    ops.fail_at = ops.direct_writes + 2  # the second region handed off from here
    with pytest.raises(OSError) as first:
        for _ in range(20):
            w.append(rec.RecordType.CHUNK, [rng.randbytes(50_000)])
    assert first.value.errno == errno.ENOSPC
    lost = w.direct._lost[0]
    assert good < lost < w.offset
    with pytest.raises(OSError) as again:  # appending after the hole
        w.append(rec.RecordType.CHUNK, [b"x" * 10])
    assert again.value is first.value
    with pytest.raises(OSError):  # a cut that would keep the hole
        w.truncate(lost + 1)
    with pytest.raises(OSError):
        w.flush()
    w.truncate(good)  # the rollback
    assert os.path.getsize(path) == good and w.offset == good
    for _ in range(4):
        part = rng.randbytes(70_000)
        w.append(rec.RecordType.CHUNK, [part])
        ref.append(rec.RecordType.CHUNK, [part])
    w.close()
    ref.close()
    assert path.read_bytes() == ref_path.read_bytes()


def _big(i: int, n: int = 6_000_000) -> dict:  # 24 MB: three regions of the 8 MiB stage
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(n, generator=g), "i": i}


def test_a_background_write_failing_mid_save_loses_only_that_save(dio_dir: Path) -> None:
    """Store level (O_DIRECT snapshots, the default 8 MiB regions): ENOSPC on a background
    write in the middle of a 24 MB save raises DiskFullError from the save, the next save
    works, and nothing of the failed one is in the store."""
    ops = _FailNthDirect()
    path = dio_dir / "s"
    s = ckptstore.open(path, file_ops=ops, chunk_size=1 << 20, direct_io=True)
    s.save(1, _big(1))
    ops.fail_at = ops.direct_writes + 2
    with pytest.raises(ckptstore.DiskFullError):
        s.save(2, _big(2))
    assert s.iterations() == [1]
    s.save(3, _big(3))
    s.close()
    report = check(str(path))
    assert report.clean and not report.notes, report.lines()
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == [1, 3]
        for i in (1, 3):
            assert torch.equal(r.load(i)["w"], _big(i)["w"])


def test_a_background_write_failing_under_a_pending_group_aborts_the_group(dio_dir: Path) -> None:
    """A pending delta's bytes in a background write that fails while the next delta is staged:
    the hole lies before the failed delta's start, so its cut fails and the group cannot commit
    (format-spec/deltas.md: a cut that fails twice aborts the pending deltas, named once by
    CheckpointAbortedError). The durable iteration is unchanged and the writer goes on."""
    ops = _FailNthDirect()
    path = dio_dir / "s"
    s = ckptstore.open(path, file_ops=ops, chunk_size=1 << 20, direct_io=True)
    s.save(0, _big(0, 1000))
    s.save_delta(1, _big(11, 3_000_000), durable=False)  # 12 MB: a region handed off, one filling
    ops.fail_at = ops.direct_writes + 1  # the write in flight now (delta 1's bytes) or the next
    with pytest.raises((ckptstore.DiskFullError, ckptstore.CheckpointAbortedError)):
        s.save_delta(2, _big(12, 3_000_000), durable=False)
        s.flush()
    with pytest.raises(ckptstore.CheckpointAbortedError, match=r"deltas \[1"):
        s.flush()
        s.save_delta(3, _big(13, 1000))
    assert s.durable_iteration() == 0
    s.save_delta(1, _big(21, 3_000_000))
    assert s.iterations() == [0, 1]
    s.close()
    report = check(str(path))
    assert report.clean, report.lines()
    with ckptstore.open(path, mode="r") as r:
        assert torch.equal(r.load_record(1)["w"], _big(21, 3_000_000)["w"])


def test_the_writer_thread_exits_when_idle_and_comes_back(dio_dir: Path, monkeypatch) -> None:
    """A staging buffer no longer written leaves no thread behind (stores opened and dropped by
    the thousand would otherwise keep one each); the next hand-off starts one again."""
    import threading
    import time

    monkeypatch.setattr(direct, "_WRITER_IDLE_S", 0.1)

    def writers() -> int:
        return sum(t.name == "ckptstore-direct-write" for t in threading.enumerate())

    # other buffers' writer threads (earlier tests in this process) exit within their idle wait
    # (<= the 5 s default): wait for them, so that the count below is this buffer's alone
    deadline = time.monotonic() + 8
    while writers() and time.monotonic() < deadline:
        time.sleep(0.05)
    before = writers()
    path, ref_path = dio_dir / "d.seg", dio_dir / "b.seg"
    w = SegmentWriter.create(str(path), 1, b"s" * 16, FileOps(), stage=StagingBuffer(64 << 10),
                             framing_checks=False)
    ref = SegmentWriter.create(str(ref_path), 1, b"s" * 16, FileOps(), framing_checks=False)
    rng = random.Random(3)
    for burst in range(2):
        for _ in range(12):
            part = rng.randbytes(40_000)
            w.append(rec.RecordType.CHUNK, [part])
            ref.append(rec.RecordType.CHUNK, [part])
        assert writers() == before + 1
        w.sync()
        deadline = time.monotonic() + 5
        while writers() > before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert writers() == before, f"burst {burst}: the idle writer thread did not exit"
    w.close()
    ref.close()
    assert path.read_bytes() == ref_path.read_bytes()
