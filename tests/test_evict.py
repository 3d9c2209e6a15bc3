"""Page-cache eviction advice of the writer (``evict_written``, SegmentWriter, FileOps.advise_written).

The advice (posix_fadvise DONTNEED) must be page-aligned, move forward, cover every byte written,
come only from writers with ``evict_written=True``, and change nothing: a store whose advice
fails everywhere holds the same bytes. tests/test_faults.py additionally fails the advice on every
write path of its sweep scenarios.

Advice is about the page cache that buffered appends fill: with ``direct_io`` (the default) a
segment's bytes bypass it, so these writers append buffered (``direct_io=False``);
tests/test_direct.py covers the direct path.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.ops.fsck import check
from ckptstore.storage import segments
from ckptstore.storage.fileops import FileOps

PAGE = os.sysconf("SC_PAGE_SIZE")
#: a small rolling threshold, so the tests exercise rolling advice with ~100 KiB records
EVERY = 256 << 10


class Recording(FileOps):
    """Records writes, fsyncs and advice in call order as (what, path, offset, length)."""

    def __init__(self, fail_advice: bool = False) -> None:
        self.events: list[tuple[str, str, int, int]] = []
        self.fail_advice = fail_advice
        self.advice_failed = 0
        self._paths: dict[int, str] = {}

    def writev(self, fd, path, buffers, offset):
        super().writev(fd, path, buffers, offset)
        n = sum(memoryview(b).nbytes for b in buffers)
        self.events.append(("write", path, offset, n))

    def fsync(self, fd, path):
        super().fsync(fd, path)
        self.events.append(("fsync", path, 0, 0))

    def advise_written(self, fd, path, offset, length):
        self.events.append(("advise", path, offset, length))
        ok = super().advise_written(fd, path, offset, length)
        assert ok != self.fail_advice, "advise_written reported the wrong outcome"
        return ok

    def _advise(self, fd, offset, length):
        if self.fail_advice:
            self.advice_failed += 1
            raise OSError(errno.EIO, "injected advice failure")
        super()._advise(fd, offset, length)

    def of(self, what: str) -> list[tuple[str, str, int, int]]:
        return [e for e in self.events if e[0] == what]


@pytest.fixture(autouse=True)
def _small_threshold(monkeypatch):
    monkeypatch.setattr(segments, "EVICT_EVERY", EVERY)


def state(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"w": rng.standard_normal(60_000).astype(np.float32), "i": i}


def delta(i: int) -> dict:
    return {"g": np.random.default_rng(100 + i).standard_normal(40_000).astype(np.float32)}


def workload(path: Path, ops: FileOps, **kw) -> None:
    """Snapshots, grouped and durable deltas, segment rolls (1 MiB segments) and a gc."""
    kw.setdefault("direct_io", False)
    with ckptstore.open(path, chunk_size=64 << 10, segment_size=1 << 20, file_ops=ops, **kw) as s:
        for i in range(4):
            s.save(i * 10, state(i * 10))
        for i in range(31, 35):
            s.save_delta(i, delta(i), durable=False)
        s.flush()
        s.save_delta(35, delta(35))
        s.save(40, state(40))
        s.gc(keep_last=3)  # keeps 30 (the base of 31..35), 31..35, 40
        s.save(50, state(50))


def assert_intact(path: Path, assert_same) -> None:
    with ckptstore.open(path, "r") as r:  # a fresh reader: bytes come from the files
        assert r.iterations() == [30, 31, 32, 33, 34, 35, 40, 50]
        for i in (30, 40, 50):
            assert_same(state(i), r.load(i), f"iteration {i}")
        for i in range(31, 36):
            assert_same(delta(i), r.load_record(i), f"delta {i}")
    report = check(path)
    assert report.clean, report.lines()


def test_advice_is_aligned_monotonic_and_covers_every_write(tmp_path, assert_same):
    ops = Recording()
    path = tmp_path / "s"
    workload(path, ops)
    assert_intact(path, assert_same)

    written: dict[str, list[tuple[int, int]]] = {}
    for _, p, off, n in ops.of("write"):
        written.setdefault(p, []).append((off, off + n))
    segment_files = [p for p in written if p.endswith((".seg", ".gc-tmp"))]
    assert any(p.endswith(".gc-tmp") for p in segment_files), "gc wrote no segment"
    for p in segment_files:
        advice = [(off, off + n) for _, q, off, n in ops.of("advise") if q == p]
        assert advice, f"{p}: written but never advised"
        for (s0, e0), (s1, e1) in zip(advice, advice[1:]):
            assert s0 <= s1 and e0 < e1, f"{p}: advice went backwards: {advice}"
        for s, e in advice:
            assert s % PAGE == 0 and e > s, f"{p}: advice [{s}, {e}) not page-aligned"
        # the union of the advice is one interval from the first byte written to the last
        reach = advice[0][0]
        for s, e in advice:
            assert s <= reach, f"{p}: advice leaves a gap before {s}: {advice}"
            reach = max(reach, e)
        first, last = min(w[0] for w in written[p]), max(w[1] for w in written[p])
        assert advice[0][0] <= first - first % PAGE and reach >= last, \
            f"{p}: advice covers [{advice[0][0]}, {reach}), writes span [{first}, {last})"


def test_advice_rolls_and_follows_each_fsync(tmp_path):
    ops = Recording()
    workload(tmp_path / "s", ops)
    rolling = 0
    pending: dict[str, int] = {}  # bytes written since the last advice, per file
    last_event: dict[str, str] = {}
    for what, p, off, n in ops.events:
        if not p.endswith((".seg", ".gc-tmp")):
            continue
        if what == "write":
            pending[p] = pending.get(p, 0) + n
            # rolling: never more than the threshold plus one record waits for advice
            assert pending[p] < EVERY + n, f"{p}: {pending[p]} bytes written without advice"
        elif what == "advise":
            rolling += last_event.get(p) == "write"
            pending[p] = 0
        elif what == "fsync":
            assert pending.get(p, 0) > 0 or last_event.get(p) != "write"
        last_event[p] = what
    assert rolling >= 3, "no rolling advice between fsyncs"
    # a rolling advice only starts writeback of its new bytes (pages in writeback cannot be
    # dropped): the next advice covers them again, so their pages are dropped once clean
    ends: dict[str, list[int]] = {}  # path -> ends of its advice so far
    rolled: dict[str, bool] = {}  # path -> its last advice was a rolling one (no fsync before)
    since_fsync: dict[str, bool] = {}
    for what, p, off, n in ops.events:
        if what == "fsync":
            since_fsync[p] = False
        elif what == "write":
            since_fsync[p] = True
        elif what == "advise":
            e = ends.setdefault(p, [])
            if rolled.get(p) and len(e) >= 2:
                assert off <= e[-2], f"{p}: advice at {off} skips the new bytes [{e[-2]}, {e[-1]})"
            e.append(off + n)
            rolled[p] = since_fsync.get(p, False)
    # every fsync of a segment that wrote something is followed at once by advice for it
    for k, (what, p, _, _) in enumerate(ops.events):
        if what == "fsync" and p.endswith((".seg", ".gc-tmp")) and \
                any(e[0] == "write" and e[1] == p for e in ops.events[:k]):
            nxt = ops.events[k + 1]
            assert nxt[0] == "advise" and nxt[1] == p, f"fsync of {p} not followed by advice: {nxt}"


def test_no_advice_when_disabled_or_reading(tmp_path, assert_same):
    ops = Recording()
    path = tmp_path / "s"
    workload(path, ops, evict_written=False)
    assert ops.of("write") and not ops.of("advise")
    assert_intact(path, assert_same)
    reader_ops = Recording()
    with ckptstore.open(path, "r", file_ops=reader_ops) as r:
        r.load(50)
    assert reader_ops.events == []


def test_failing_advice_loses_nothing(tmp_path, assert_same):
    ops = Recording(fail_advice=True)
    path = tmp_path / "s"
    workload(path, ops)
    assert ops.advice_failed >= 10
    with ckptstore.open(path, file_ops=ops, direct_io=False) as s:  # advice still failing
        assert s.iterations() == [30, 31, 32, 33, 34, 35, 40, 50]
        s.gc(keep_last=1)
        assert s.iterations() == [50]
        s.save(60, state(60))
    with ckptstore.open(path, "r") as r:
        assert_same(state(50), r.load(50), "iteration 50")
        assert_same(state(60), r.load(60), "iteration 60")
    assert check(path).clean


def test_advise_written_swallows_errors_and_skips_empty_ranges(tmp_path):
    ops = FileOps()
    path = str(tmp_path / "f")
    fd = ops.open_truncate(path)
    try:
        ops.writev(fd, path, [b"x" * (3 * PAGE)], 0)
        assert ops.advise_written(fd, path, 0, 3 * PAGE) is True
        assert ops.advise_written(fd, path, PAGE, 0) is False  # 0 would mean "to end of file"
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        assert ops.advise_written(r, "pipe", 0, PAGE) is False  # ESPIPE, swallowed
    finally:
        os.close(r)
        os.close(w)
    assert ops.advise_written(fd, path, 0, PAGE) is False  # EBADF, swallowed
    with open(path, "rb") as f:
        assert f.read() == b"x" * (3 * PAGE)
