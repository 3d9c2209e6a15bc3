"""Issue 5's resource bound, scaled down: a store of thousands of tiny iterations (snapshots with
delta chains between them) opens with a warm index without replaying anything, and latest(),
iterations(), load() and save_delta() touch a bounded number of index entries, not all of them.
(tools/bench_many_iterations.py measures 10**5 iterations.)"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

import ckptstore
from ckptstore.storage.lmdb_index import LmdbIndex

N = 3000
BASE_EVERY = 50


def snap(i: int) -> dict:
    return {"step": i, "w": np.full(16, i, dtype=np.float32)}


def delta(i: int) -> dict:
    return {"g": np.full(4, i, dtype=np.float32)}


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    path = tmp_path_factory.mktemp("many") / "s"
    with ckptstore.open(path, segment_size=1 << 20) as w:  # several segments
        for i in range(1, N + 1):
            if i % BASE_EVERY == 1:
                w.save(i, snap(i))
            else:
                w.save_delta(i, delta(i), durable=False)
                if i % 100 == 0:
                    w.flush()
    return path


class _Counting:
    """Counts the commit entries the LMDB index decodes and its full passes over the commits."""

    def __init__(self, monkeypatch) -> None:
        self.gets = self.passes = 0
        real_get, real_kinds = LmdbIndex.get_commit, LmdbIndex.kinds

        def get_commit(index, iteration):
            self.gets += 1
            return real_get(index, iteration)

        def kinds(index):
            self.passes += 1
            return real_kinds(index)

        monkeypatch.setattr(LmdbIndex, "get_commit", get_commit)
        monkeypatch.setattr(LmdbIndex, "kinds", kinds)

    def take(self) -> tuple[int, int]:
        out, self.gets, self.passes = (self.gets, self.passes), 0, 0
        return out


def test_writer_work_is_bounded(many, monkeypatch, assert_same):
    count = _Counting(monkeypatch)
    t0 = time.perf_counter()
    w = ckptstore.open(many)
    opened = time.perf_counter() - t0
    try:
        assert w.last_scan.commits == 0  # warm index: nothing replayed
        assert opened < 5.0, f"opening took {opened:.2f} s"  # generous; typically milliseconds
        assert count.take() == (0, 0)
        assert w.latest() == N
        assert count.take()[1] == 1  # one pass builds the recoverability summary ...
        for _ in range(50):
            assert w.latest() == N
        its = w.iterations()
        assert its == list(range(1, N + 1))
        assert count.take() == (0, 0)  # ... and later calls read nothing
        rng = random.Random(5)
        for i in rng.sample(its, 20):
            if w.kind(i) == "snapshot":
                assert_same(snap(i), w.load(i))
            else:
                assert_same(delta(i), w.load_record(i))
                assert w.base_of(i) == i - (i - 1) % BASE_EVERY
        gets, passes = count.take()
        assert passes == 0 and gets <= 20 * 4, gets  # a few lookups per iteration, no scan
        for i in range(N + 1, N + 30):  # extending a chain: O(1) index work per delta
            w.save_delta(i, delta(i), durable=False)
        assert w.flush() == N + 29
        gets, passes = count.take()
        assert passes == 0 and gets <= 5, gets
    finally:
        w.close()


class _LogWork:
    """Counts the records log replays read and the manifests decoded anywhere."""

    def __init__(self, monkeypatch) -> None:
        from ckptstore.format import manifest as manifest_mod
        from ckptstore.storage import log as log_mod

        self.records = self.manifests = 0
        real_scan, real_decode = log_mod.scan_segment, manifest_mod.decode_manifest

        def scan_segment(*a, **k):
            for item in real_scan(*a, **k):
                self.records += 1
                yield item

        def decode_manifest(buf):
            self.manifests += 1
            return real_decode(buf)

        monkeypatch.setattr(log_mod, "scan_segment", scan_segment)
        monkeypatch.setattr(log_mod, "decode_manifest", decode_manifest)
        monkeypatch.setattr(manifest_mod, "decode_manifest", decode_manifest)

    def take(self) -> tuple[int, int]:
        out, self.records, self.manifests = (self.records, self.manifests), 0, 0
        return out


def test_warm_reader_does_not_scan_the_log(many, monkeypatch, assert_same):
    """A reader opens from the writer's index: no log record read, no manifest decoded; listing
    reads the index once; a load decodes the manifests it needs and checks a few commit entries
    against the log. A reader without the index would read every record (the control)."""
    work = _LogWork(monkeypatch)
    with ckptstore.open(many, mode="r") as r:
        assert type(r.index).__name__ == "ReaderIndex"
        assert r.last_scan.commits == 0
        assert work.take() == (0, 0)
        top = r.latest()  # N, or more when the writer test ran first (same module store)
        assert top >= N and r.iterations() == list(range(1, top + 1))
        assert work.take() == (0, 0)  # refreshes start at the index's position, at the log's end
        rng = random.Random(7)
        for i in rng.sample(range(1, N + 1), 20):
            if r.kind(i) == "snapshot":
                assert_same(snap(i), r.load(i))
            else:
                assert_same(delta(i), r.load_record(i))
                assert r.base_of(i) == i - (i - 1) % BASE_EVERY
        records, manifests = work.take()
        assert records == 0 and manifests <= 20, (records, manifests)
        assert r.index.commits_checked <= 20 * 2
    with ckptstore.open(many, mode="r", use_index=False) as r:  # control: a full replay
        assert r.last_scan.commits == top
        records, manifests = work.take()
        assert records >= 2 * top and manifests == top, (records, manifests)


def test_reader_refresh_is_bounded(many):
    with ckptstore.open(many, mode="r") as r:
        assert r.latest() == r.iterations()[-1]
        t0 = time.perf_counter()
        for _ in range(20):
            r.latest()  # each refreshes: the scan starts at the reader's position
        assert r.last_scan.commits == 0
        assert time.perf_counter() - t0 < 5.0
