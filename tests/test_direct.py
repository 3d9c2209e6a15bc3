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
    writers = [SegmentWriter.create(str(paths[0]), 1, b"s" * 16, FileOps(), stage=stage),
               SegmentWriter.create(str(paths[1]), 1, b"s" * 16, FileOps())]
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
    writers = [SegmentWriter.reopen(str(paths[0]), 1, ends[0], FileOps(), stage=stage),
               SegmentWriter.reopen(str(paths[1]), 1, ends[1], FileOps())]
    for w in writers:
        _drive(w, random.Random(seed + 100), 30)
        w.close()  # close writes what is staged, like buffered appends reach the file
    assert paths[0].read_bytes() == paths[1].read_bytes()
    records = list(scan_segment(SegmentFile(str(paths[0]), 1), verify=True))
    assert records and all(getattr(r, "error", None) is None and hasattr(r, "loc") for r in records)


def test_unsynced_direct_appends_are_not_in_the_file(dio_dir: Path) -> None:
    """What was appended and not synced or flushed lives in memory only (as an unsynced buffered
    append may be lost to a power cut); a sync puts it in the file, exactly at its end."""
    stage = StagingBuffer(1 << 20)
    path = dio_dir / "a.seg"
    w = SegmentWriter.create(str(path), 1, b"s" * 16, FileOps(), stage=stage)
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


class _RefusingWrite(FileOps):
    """A file system that opens with O_DIRECT but refuses the writes (EINVAL)."""

    def __init__(self) -> None:
        self.direct_fds: set[int] = set()
        self.refused = 0

    def _open(self, path, flags, mode):
        fd = super()._open(path, flags, mode)
        if flags & direct.O_DIRECT:
            self.direct_fds.add(fd)
        return fd

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
    with ckptstore.open(tmp_path / "s", file_ops=ops, chunk_size=1 << 20) as s:
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
    with ckptstore.open(path, chunk_size=1 << 20) as s:
        for i in range(1, 4):
            s.save(i, _state(i))
        d = s.engine.log.writer.direct
        assert d is not None and d.direct_bytes >= 3 * 600_000 * 4 * 0.9
    with ckptstore.open(path, direct_io=False) as s:  # the same store, buffered appends
        s.save(4, _state(4))
        assert s.engine.log.writer.direct is None
    with ckptstore.open(path) as s:  # and direct again, resuming mid-block
        s.save(5, _state(5))
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == [1, 2, 3, 4, 5]
        for i in range(1, 6):
            got, want = r.load(i), _state(i)
            assert torch.equal(got["w"], want["w"]) and got["i"] == i
    assert check(str(path)).clean


def test_staging_buffer_is_page_aligned_and_touched() -> None:
    b = StagingBuffer(3 * ALIGN)
    assert b.array.ctypes.data % ALIGN == 0 and len(b.view) == 3 * ALIGN
    assert not np.any(b.array)
    with pytest.raises(ValueError):
        StagingBuffer(ALIGN + 1)


class _FullOnDirect(FileOps):
    """O_DIRECT writes fail with ENOSPC while ``full`` is set."""

    def __init__(self) -> None:
        self.full = False
        self.direct_fds: set[int] = set()

    def _open(self, path, flags, mode):
        fd = super()._open(path, flags, mode)
        if flags & direct.O_DIRECT:
            self.direct_fds.add(fd)
        return fd

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
    s = ckptstore.open(path, file_ops=ops, chunk_size=1 << 20)
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
