"""Readers and the writer's LMDB index (format-spec/format.md §16 "Readers"): a reader uses the
index read-only when it validates against the log, and replays only the log after it. The index is
a cache, so whatever happened to it — damaged values, an older or newer state, another store's
index, a truncated file, the writer reopening it in the same process — a reader lists and loads
exactly what the log holds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import ckptstore
from ckptstore.storage.index import MemoryIndex
from ckptstore.storage.reader_index import ReaderIndex
from test_index_faults import FAULTS, CHUNK, _index_dir, _middle, _rewrite, _save, delta_for, state_for


def _reader_sees(path, its, assert_same, deltas=()) -> ckptstore.Store:
    """Open a reader, check it lists ``its`` and loads each bit-exact; return it (open), with
    ``r.opened`` the replay report of its open."""
    r = ckptstore.open(path, mode="r")
    r.opened = r.last_scan
    assert r.iterations() == list(its)
    assert r.latest() == its[-1]
    for i in its:
        if i in deltas:
            assert_same(delta_for(i), r.load_record(i))
        else:
            assert_same(state_for(i), r.load(i))
        assert r.info(i).iteration == i
    return r


def test_warm_reader_replays_nothing(tmp_path, assert_same):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=32 << 10) as w:
        _save(w, range(1, 12))
    r = _reader_sees(path, range(1, 12), assert_same)
    try:
        assert isinstance(r.index, ReaderIndex)
        assert r.opened.commits == 0
    finally:
        r.close()


def test_warm_reader_follows_a_writer_in_another_process(tmp_path, assert_same):
    """A writer process commits after the reader opened: refresh replays only the new records and
    then moves the reader's snapshot to the writer's newest index state."""
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=32 << 10) as w:
        _save(w, range(1, 6))
    r = ckptstore.open(path, mode="r")
    try:
        assert isinstance(r.index, ReaderIndex) and r.iterations() == list(range(1, 6))
        base = r.index._base
        child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
            import ckptstore
            from test_index_faults import state_for
            with ckptstore.open({str(path)!r}) as w:
                for i in range(6, 10):
                    w.save(i, state_for(i))
            """)], capture_output=True, text=True, timeout=120, env={**os.environ})
        assert child.returncode == 0, child.stderr[-2000:]
        assert r.iterations() == list(range(1, 10))
        assert r.last_scan.commits == 4
        assert isinstance(r.index, ReaderIndex)
        assert r.index._base != base and r.index._base == r.index.position()  # renewed
        for i in range(1, 10):
            assert_same(state_for(i), r.load(i))
    finally:
        r.close()


def test_writer_in_the_same_process_revokes_the_readers_snapshot(tmp_path, assert_same):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, range(1, 4))
    r = ckptstore.open(path, mode="r")
    try:
        assert isinstance(r.index, ReaderIndex)
        with ckptstore.open(path) as w:  # LMDB allows one environment per file per process
            assert w.last_scan.commits == 0  # the writer's index was not rebuilt
            _save(w, [4, 5])
            assert r.iterations() == list(range(1, 6))  # the reader replays instead
            for i in range(1, 6):
                assert_same(state_for(i), r.load(i))
        r.refresh()  # a reader that fell back stays on its replayed index (until a gc)
        assert r.iterations() == list(range(1, 6))
    finally:
        r.close()
    r = _reader_sees(path, range(1, 6), assert_same)  # the writer is gone: warm again
    try:
        assert isinstance(r.index, ReaderIndex) and r.opened.commits == 0
    finally:
        r.close()


def test_reader_with_a_writer_open_in_the_same_process(tmp_path, assert_same):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, range(1, 4))
        with ckptstore.open(path, mode="r") as r:
            assert isinstance(r.index, MemoryIndex)  # the writer holds the environment
            assert r.iterations() == [1, 2, 3]
            assert_same(state_for(2), r.load(2))


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_reader_with_a_malformed_or_wrong_index_value(tmp_path, assert_same, fault):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, range(1, 6))
    db, change = FAULTS[fault]
    _rewrite(path, db, _middle, change)
    _reader_sees(path, range(1, 6), assert_same).close()


@pytest.mark.parametrize("field", ["position", "last_commit", "segments"])
def test_reader_with_stale_meta_values(tmp_path, assert_same, field):
    """Meta values that disagree with the log: the validation refuses the index."""
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=32 << 10) as w:
        _save(w, range(1, 9))
    change = {"position": lambda v: v[:8] + (int.from_bytes(v[8:], "little") - 8).to_bytes(8, "little"),
              "last_commit": lambda v: v[:8] + (int.from_bytes(v[8:16], "little") + 8)
              .to_bytes(8, "little") + v[16:],
              "segments": lambda v: v[8:] if len(v) > 8 else v + v}[field]
    _rewrite(path, b"meta", lambda items: next(kv for kv in items if kv[0] == field.encode()), change)
    r = _reader_sees(path, range(1, 9), assert_same)
    try:
        assert isinstance(r.index, MemoryIndex) and r.opened.commits == 8
    finally:
        r.close()


def test_reader_with_an_index_from_an_older_state(tmp_path, assert_same):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=32 << 10) as w:
        _save(w, range(1, 5))
    old = str(path) + "-index-copy"
    shutil.copytree(_index_dir(path), old)
    with ckptstore.open(path) as w:
        _save(w, range(5, 20))
    shutil.rmtree(_index_dir(path))
    shutil.copytree(old, _index_dir(path))
    r = _reader_sees(path, range(1, 20), assert_same)
    try:
        assert isinstance(r.index, ReaderIndex)
        assert r.opened.commits == 15  # caught up from the old position
    finally:
        r.close()


def test_reader_with_an_older_index_after_gc(tmp_path, assert_same):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=32 << 10) as w:
        _save(w, range(1, 5))
    old = str(path) + "-index-copy"
    shutil.copytree(_index_dir(path), old)
    with ckptstore.open(path) as w:
        for i in range(5, 9):
            w.save_delta(i, delta_for(i), durable=False)
        w.flush()
        _save(w, [9, 10])
        w.gc(keep_last=3)
    shutil.rmtree(_index_dir(path))
    shutil.copytree(old, _index_dir(path))
    r = _reader_sees(path, [4, 5, 6, 7, 8, 9, 10], assert_same, deltas={5, 6, 7, 8})
    try:
        assert isinstance(r.index, MemoryIndex)  # the segments changed: full replay
        assert r.base_of(8) == 4
    finally:
        r.close()


def test_reader_with_an_index_newer_than_the_log(tmp_path, assert_same):
    """The segments were put back from an older copy while the index is newer: the index's last
    commit is not in the log, so the reader replays what the log holds."""
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=1 << 20) as w:
        _save(w, range(1, 4))
    old = str(path) + "-segments-copy"
    shutil.copytree(os.path.join(path, "segments"), old)
    with ckptstore.open(path) as w:
        _save(w, range(4, 8))
    shutil.rmtree(os.path.join(path, "segments"))
    shutil.copytree(old, os.path.join(path, "segments"))
    r = _reader_sees(path, [1, 2, 3], assert_same)
    try:
        assert isinstance(r.index, MemoryIndex)
        with pytest.raises(ckptstore.NotFoundError):
            r.load(5)
    finally:
        r.close()


def test_reader_with_another_stores_index(tmp_path, assert_same):
    path, other = tmp_path / "s", tmp_path / "other"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, range(1, 4))
    with ckptstore.open(other, chunk_size=CHUNK) as w:
        _save(w, range(1, 9))
    shutil.rmtree(_index_dir(path))
    shutil.copytree(_index_dir(other), _index_dir(path))
    r = _reader_sees(path, [1, 2, 3], assert_same)
    try:
        assert isinstance(r.index, MemoryIndex)
    finally:
        r.close()


@pytest.mark.parametrize("cut", ["zero", "one_page", "half", "minus_one_page"])
def test_reader_with_a_truncated_index(tmp_path, assert_same, cut):
    """Run in a child: reading a page past the end of a cut data.mdb would be SIGBUS."""
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, range(1, 40))
    data = os.path.join(_index_dir(path), "data.mdb")
    size, page = os.path.getsize(data), 4096
    os.truncate(data, {"zero": 0, "one_page": page, "half": size // 2 // page * page,
                       "minus_one_page": size - page}[cut])
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import ckptstore
        with ckptstore.open({str(path)!r}, mode="r") as r:
            print(len(r.iterations()), r.latest(), type(r.index).__name__)
            for i in r.iterations():
                r.load(i)
        """)], capture_output=True, text=True, timeout=120, env={**os.environ})
    assert child.returncode == 0, f"rc {child.returncode}: {child.stderr[-2000:]}"
    assert child.stdout.split() == ["39", "39", "MemoryIndex"]
    _reader_sees(path, range(1, 40), assert_same).close()


def test_reader_with_a_damaged_commit_entry_that_still_decodes(tmp_path, assert_same):
    """A commit entry whose bytes changed but still decode (another created_ns): info() must not
    report it; the entry is checked against the COMMIT record before use."""
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, range(1, 6))
        truth = {i: w.info(i) for i in range(1, 6)}

    def bump_created(v: bytes) -> bytes:  # created_ns: the 4th u64 of the commit payload
        at = 24 + 64
        return v[:at] + (int.from_bytes(v[at:at + 8], "little") ^ 1).to_bytes(8, "little") + v[at + 8:]

    _rewrite(path, b"commits", _middle, bump_created)
    r = _reader_sees(path, range(1, 6), assert_same)
    try:
        assert {i: r.info(i) for i in range(1, 6)} == truth
    finally:
        r.close()
