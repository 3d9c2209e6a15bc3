"""Faults in the writer's LMDB index (format-spec/format.md §16): the index is a cache, so whatever
happens to it — deleted, truncated, an older copy put back, a full map, malformed or wrong values —
the store rebuilds or grows it and loses nothing that the log holds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import lmdb
import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.format.commit import KIND_DELTA
from ckptstore.ops.fsck import check
from ckptstore.storage import lmdb_index
from ckptstore.storage.index import seal, unpack_chunk, unpack_commit, unpack_loc, unseal

CHUNK = 1024


def state_for(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(700, generator=g), "frozen": torch.arange(600, dtype=torch.float32),
            "step": i}


def delta_for(i: int) -> dict:
    return {"g": np.full(300, i, dtype=np.float32), "step": i}


def _save(w, its) -> None:
    for i in its:
        w.save(i, state_for(i))


def _index_dir(path) -> str:
    return os.path.join(path, "index")


def _assert_intact(path, its, assert_same, deltas=()) -> None:
    """Writer and reader list exactly ``its`` and load each one bit-exact; fsck is clean."""
    for mode in ("a", "r"):
        with ckptstore.open(path, mode=mode) as s:
            assert s.iterations() == list(its), mode
            assert s.latest() == its[-1]
            for i in its:
                if i in deltas:
                    assert s.kind(i) == "delta"
                    assert_same(delta_for(i), s.load_record(i))
                else:
                    assert_same(state_for(i), s.load(i))
    report = check(str(path))
    assert report.clean, report.lines()


def test_deleted_index_is_rebuilt(tmp_path, assert_same):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, range(1, 6))
    shutil.rmtree(_index_dir(path))
    with ckptstore.open(path) as w:
        assert w.last_scan.commits == 5  # rebuilt by a full replay
        _save(w, [6])
    _assert_intact(path, range(1, 7), assert_same)


def test_index_deleted_while_the_writer_runs(tmp_path, assert_same):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, range(1, 4))
        shutil.rmtree(_index_dir(path))  # the open environment keeps the unlinked files
        _save(w, range(4, 7))
        for i in range(1, 7):
            assert_same(state_for(i), w.load(i))
    _assert_intact(path, range(1, 7), assert_same)


@pytest.mark.parametrize("cut", ["zero", "100", "one_page", "two_pages", "three_pages", "half",
                                 "minus_one_page"])
def test_truncated_index_is_rebuilt(tmp_path, assert_same, cut):
    """data.mdb cut anywhere: refused and rebuilt, never a crash (LMDB reading a page past the
    end of its file would be SIGBUS, so the open runs in a child process)."""
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, range(1, 40))
    data = os.path.join(_index_dir(path), "data.mdb")
    size, page = os.path.getsize(data), 4096
    at = {"zero": 0, "100": 100, "one_page": page, "two_pages": 2 * page, "three_pages": 3 * page,
          "half": size // 2 // page * page, "minus_one_page": size - page}[cut]
    os.truncate(data, at)
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import ckptstore
        with ckptstore.open({str(path)!r}) as w:
            print(len(w.iterations()), w.latest())
            for i in w.iterations():
                w.load(i)
        """)], capture_output=True, text=True, timeout=120, env={**os.environ})
    assert child.returncode == 0, f"rc {child.returncode}: {child.stderr[-2000:]}"
    assert child.stdout.split() == ["39", "39"]
    _assert_intact(path, range(1, 40), assert_same)


def _older_index_put_back(path, more) -> None:
    """Copy the index, run ``more(writer)``, then put the old copy back."""
    old = str(path) + "-index-copy"
    shutil.copytree(_index_dir(path), old)
    with ckptstore.open(path) as w:
        more(w)
    shutil.rmtree(_index_dir(path))
    shutil.copytree(old, _index_dir(path))


def test_index_from_an_older_state_of_the_store(tmp_path, assert_same):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=32 << 10) as w:
        _save(w, range(1, 5))
    _older_index_put_back(path, lambda w: _save(w, range(5, 20)))  # several new segments
    with ckptstore.open(path) as w:
        assert w.last_scan.commits == 15  # caught up from the old position, no rebuild
        _save(w, [20])
    _assert_intact(path, range(1, 21), assert_same)


def test_older_index_after_deltas_and_gc(tmp_path, assert_same):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=32 << 10) as w:
        _save(w, range(1, 5))

    def more(w):
        for i in range(5, 9):
            w.save_delta(i, delta_for(i), durable=False)
        w.flush()
        _save(w, [9, 10])
        w.gc(keep_last=3)  # keeps 8 (a delta) and its chain back to the snapshot 4

    _older_index_put_back(path, more)
    with ckptstore.open(path) as w:
        assert w.iterations() == [4, 5, 6, 7, 8, 9, 10]
        assert w.base_of(8) == 4
        _save(w, [11])
    _assert_intact(path, [4, 5, 6, 7, 8, 9, 10, 11], assert_same, deltas={5, 6, 7, 8})


def test_map_full_grows_the_map(tmp_path, assert_same, monkeypatch):
    """A map far too small for the index (saves, then a full rebuild) is doubled as needed."""
    monkeypatch.setattr(lmdb_index, "_INITIAL_MAP", 64 << 10)
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=256) as w:  # ~12 new chunk entries per save
        _save(w, range(1, 80))
        assert w.index.env.info()["map_size"] > 64 << 10
    shutil.rmtree(_index_dir(path))
    with ckptstore.open(path) as w:  # rebuild: one big replay batch into a tiny map
        assert w.last_scan.commits == 79
        assert w.iterations() == list(range(1, 80))
    _assert_intact(path, range(1, 80), assert_same)


# ---- malformed or wrong index values ----------------------------------------------------------

def _rewrite(path, db: bytes, pick, change) -> None:
    """Rewrite one value of the index database ``db`` (the log stays intact), sealed again as a
    writer would seal it: the checks behind the seal must catch a wrong value that a buggy writer
    wrote (tests/test_index_bitflips.py covers damage the seal itself catches)."""
    env = lmdb.open(_index_dir(path), max_dbs=8, subdir=True)
    try:
        handle = env.open_db(db, create=False)
        with env.begin(write=True) as txn:
            key, stored = pick(list(txn.cursor(db=handle)))
            txn.put(key, seal(db, key, change(unseal(db, key, stored))), db=handle)
    finally:
        env.close()


def _middle(items):
    return items[len(items) // 2]


def _shift_offset(val: bytes) -> bytes:  # a well-formed location naming the wrong bytes
    off = int.from_bytes(val[8:16], "little")
    return val[:8] + (off + 8).to_bytes(8, "little") + val[16:]


FAULTS = {
    "chunk_short": (b"chunks", lambda v: v[:10]),
    "chunk_bad_codec": (b"chunks", lambda v: v[:24] + b"\x07"),
    "chunk_wrong_offset": (b"chunks", _shift_offset),
    "chunk_huge_length": (b"chunks", lambda v: v[:16] + (1 << 40).to_bytes(8, "little") + v[24:]),
    "tree_short": (b"trees", lambda v: v + b"x"),
    "tree_wrong_offset": (b"trees", _shift_offset),
    "commit_short": (b"commits", lambda v: v[:50]),
    "commit_bad_kind": (b"commits", lambda v: v[:112] + b"\x09" + v[113:]),
    "commit_wrong_manifest": (b"commits", lambda v: v[:32] + (int.from_bytes(v[32:40], "little") + 8)
                              .to_bytes(8, "little") + v[40:]),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_malformed_or_wrong_index_value(tmp_path, assert_same, fault):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, range(1, 6))
    db, change = FAULTS[fault]
    _rewrite(path, db, _middle, change)
    with ckptstore.open(path) as w:
        for i in range(1, 6):  # reads, kinds and listing see the log's truth
            assert_same(state_for(i), w.load(i))
        assert w.iterations() == list(range(1, 6))
        _save(w, range(6, 8))  # saving (dedup against the index) stays correct
    _assert_intact(path, range(1, 8), assert_same)


@pytest.mark.parametrize("fault", ["chunk_wrong_offset", "tree_wrong_offset", "chunk_short"])
def test_save_does_not_dedup_against_a_wrong_index_entry(tmp_path, assert_same, fault):
    """The first thing after the fault is a save of a state sharing every chunk: it must not
    commit a checkpoint that names a chunk where the log does not hold it."""
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, [1])
    db, change = FAULTS[fault]
    _rewrite(path, db, _middle, change)
    with ckptstore.open(path) as w:
        w.save(2, state_for(1))
    with ckptstore.open(path, mode="r") as r:
        assert_same(state_for(1), r.load(2))
    assert check(str(path)).clean


def test_position_value_malformed(tmp_path, assert_same):
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, range(1, 4))
    _rewrite(path, b"meta", lambda items: next(kv for kv in items if kv[0] == b"position"),
             lambda v: v[:5])
    with ckptstore.open(path) as w:
        assert w.last_scan.commits == 3  # rebuilt
        _save(w, [4])
    _assert_intact(path, range(1, 5), assert_same)


def test_unpack_rejects_malformed_values():
    for fn, good_len in ((unpack_loc, 24), (unpack_chunk, 25), (unpack_commit, 120)):
        for n in (0, good_len - 1, good_len + 1):
            with pytest.raises(ckptstore.IndexUnusable):
                fn(bytes(n))
    assert issubclass(ckptstore.IndexUnusable, ckptstore.CkptStoreError)


def test_recoverability_matches_the_chain_rule_after_faults(tmp_path):
    """The O(1) recoverability summary agrees with a direct walk of the chain rule, in the writer
    (rebuilt LMDB index) and in a reader, for a log whose commit of iteration 3 — in the middle of
    a delta chain — is damaged: deltas 4 and 5 lose their chain."""
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, [1])
        for i in range(2, 6):
            w.save_delta(i, delta_for(i))
        _save(w, [6])
        for i in range(7, 10):
            w.save_delta(i, delta_for(i))
        loc = w.index.get_commit(3).loc
    seg = os.path.join(path, "segments", f"{loc.seq:010d}.seg")
    with open(seg, "r+b") as f:
        f.seek(loc.payload_offset + 60)
        b = f.read(1)
        f.seek(loc.payload_offset + 60)
        f.write(bytes([b[0] ^ 0xFF]))
    shutil.rmtree(_index_dir(path))
    for mode in ("a", "r"):
        with ckptstore.open(path, mode=mode) as s:
            expect, ok = [], set()
            for i in s.index.iterations():
                if s.index.get_commit(i).commit.kind != KIND_DELTA or i - 1 in ok:
                    ok.add(i)
                    expect.append(i)
            assert s.iterations() == expect == [1, 2, 6, 7, 8, 9], mode
            assert s.latest() == 9 and s.base_of(9) == 6 and s.base_of(2) == 1
            with pytest.raises(ckptstore.errors.DeltaChainError, match="broken at iteration 3"):
                s.base_of(5)


@pytest.mark.parametrize("what", ["chunk", "tree"])
def test_save_does_not_dedup_against_a_phantom_entry(tmp_path, assert_same, what):
    """An index entry (well-formed, pointing at another record) for a chunk or tree the log does
    not hold: a save of a state with that chunk or tree must write it, not trust the entry."""
    from ckptstore.format.chunk import address_of
    from ckptstore.format.tree import make_tree

    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        _save(w, [1])
    new = state_for(2)
    raw = new["w"].numpy().tobytes()
    addrs = [address_of(raw[i:i + CHUNK]) for i in range(0, len(raw), CHUNK)]
    key = addrs[0] if what == "chunk" else make_tree(len(raw), CHUNK, addrs).root
    env = lmdb.open(_index_dir(path), max_dbs=8, subdir=True)
    try:
        db = env.open_db(what.encode() + b"s", create=False)
        with env.begin(write=True) as txn:
            _, some_value = next(iter(txn.cursor(db=db)))
            txn.put(key, some_value, db=db)
    finally:
        env.close()
    with ckptstore.open(path) as w:
        w.save(2, new)
    with ckptstore.open(path, mode="r") as r:
        assert_same(new, r.load(2))
    assert check(str(path)).clean
