"""The Store API: iterations, ordering, partial loads, diff, dedup, locking, read-only mode, reopen,
segment rolling and index rebuilds."""

from __future__ import annotations

import builtins
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import lmdb
import numpy as np
import pytest
import torch

import ckptstore
import ckptstore.engine.read_path
from ckptstore import (CkptStoreError, DamagedCheckpointError, FormatError, IterationOrderError,
                       NotFoundError, ReadOnlyStoreError, StoreClosedError, StoreLockedError,
                       StoreNotFoundError, UnsupportedVersionError)
from ckptstore.format.chunk import address_of
from ckptstore.format.header import StoreHeader, decode_store_header, encode_store_header

CHUNK = 4096


def rand(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def state_for(i: int) -> dict:
    """A small training-like state that changes with ``i`` (one tensor stays the same)."""
    return {"model": {"w": rand(1500, i), "frozen": rand(1200, 12345)},
            "optim": {"step": i, "lr": 0.1 / (i + 1)}, "tag": f"it{i}"}


@pytest.fixture
def path(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def store(path):
    s = ckptstore.open(path, chunk_size=CHUNK)
    yield s
    s.close()


def snapshot(root, lock_table: bool = False) -> dict:
    """Every file and directory under ``root`` with its size and mtime. ``lock_table``: leave out
    the mtime of ``index/lock.mdb`` (a reader registers in LMDB's reader table there, format-spec
    §16 "Readers"; its size, and every other file, must not change)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        st = os.stat(dirpath)
        out[os.path.relpath(dirpath, root) + "/"] = (sorted(dirnames + filenames), st.st_mtime_ns)
        for n in filenames:
            st = os.stat(os.path.join(dirpath, n))
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            out[rel] = (st.st_size, None if lock_table and rel == os.path.join("index", "lock.mdb")
                        else st.st_mtime_ns)
    return out


def segment_files(path) -> list[str]:
    return sorted(os.listdir(os.path.join(path, "segments")))


# ---------------------------------------------------------------------------------------------
# iterations and ordering


def test_empty_store(store, path):
    assert store.iterations() == []
    assert store.latest() is None
    with pytest.raises(NotFoundError):
        store.load(0)
    with pytest.raises(KeyError):  # NotFoundError is a KeyError too
        store.info(1)
    with pytest.raises(NotFoundError):
        store.manifest(1)
    with pytest.raises(NotFoundError):
        store.diff(1, 2)
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == [] and r.latest() is None


def test_iterations_and_latest(store, path, assert_same):
    its = [0, 1, 5, 6, 100, 2**40, 2**63 - 1]
    for i in its[:-1]:
        store.save(i, {"i": i})
        assert store.latest() == i
    store.save(its[-1], {"i": its[-1]})
    assert store.iterations() == its and store.latest() == its[-1]
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == its and r.latest() == its[-1]
        for i in its:
            assert r.load(i) == {"i": i}
            assert r.info(i).iteration == i


def test_iteration_order_enforced(store):
    store.save(10, {"x": 1})
    for bad in (10, 9, 0):
        with pytest.raises(IterationOrderError) as ei:
            store.save(bad, {"x": 2})
        assert isinstance(ei.value, ValueError)
        assert str(bad) in str(ei.value) and "10" in str(ei.value)
    assert store.iterations() == [10]
    store.save(11, {"x": 3})
    assert store.iterations() == [10, 11]


@pytest.mark.parametrize("bad", [-1, -(2**70), 1.0, 2.5, "3", None, True, False, np.int64(3),
                                 torch.tensor(3), 2**63, 2**64], ids=repr)
def test_bad_iteration_values(store, bad):
    with pytest.raises(ValueError) as ei:
        store.save(bad, {"x": 1})
    assert not isinstance(ei.value, IterationOrderError)
    assert store.iterations() == []


def test_info_manifest_meta(store):
    st = store.save(3, {"w": rand(5000, 1), "small": torch.arange(4)}, meta={"loss": 1.25})
    info = store.info(3)
    assert info.iteration == 3 and info.kind == "snapshot"
    assert info.logical_bytes == st.logical_bytes == 5000 * 4 + 4 * 8
    assert info.snapshot_root == st.snapshot_root
    assert info.written_bytes >= st.written_bytes > 20000
    assert st.tensors == 2 and st.chunks_written == 5 and st.chunks_deduped == 0
    m = store.manifest(3)
    assert m.iteration == 3 and m.chunk_size == CHUNK
    assert {t.path: t.nbytes for t in m.tensors} == {"w": 20000, "small": 32}
    assert store.meta(3) == {"loss": 1.25}


# ---------------------------------------------------------------------------------------------
# partial loads


def test_partial_load_reads_only_requested_keys(store, monkeypatch, assert_same):
    state = {"a": rand(3 * 1024 + 7, 1), "b": rand(5 * 1024, 2), 7: {"c": rand(2048, 3)},
             "s": "scalar", "tiny": torch.ones(3)}
    store.save(1, state)
    read: list[bytes] = []
    real = ckptstore.engine.read_path.read_chunk_into

    def spy(log, index, address, dest):
        read.append(address)
        return real(log, index, address, dest)

    monkeypatch.setattr(ckptstore.engine.read_path, "read_chunk_into", spy)

    def addresses(t):
        b = t.contiguous().view(torch.uint8).numpy().tobytes()
        return {address_of(b[i:i + CHUNK]) for i in range(0, len(b), CHUNK)}

    out = store.load(1, keys=["a"])
    assert list(out) == ["a"]
    assert_same({"a": state["a"]}, out)
    assert set(read) == addresses(state["a"]) and len(read) == 4

    read.clear()
    out = store.load(1, keys=[7, "s", "tiny"])
    assert list(out) == [7, "s", "tiny"] and type(out) is dict
    assert_same({7: state[7], "s": "scalar", "tiny": state["tiny"]}, out)
    assert set(read) == addresses(state[7]["c"])

    read.clear()
    assert store.load(1, keys=["s"]) == {"s": "scalar"} and read == []
    assert store.load(1, keys=[]) == {}

    with pytest.raises(NotFoundError) as ei:
        store.load(1, keys=["a", "missing"])
    assert "missing" in str(ei.value)
    with pytest.raises(NotFoundError):
        store.load(1, keys=["7"])  # int key 7 is not str key "7"
    with pytest.raises(NotFoundError):
        store.load(2, keys=["a"])


def test_partial_load_skips_damaged_tensors_of_other_keys(path, assert_same):
    state = {"a": rand(2 * 1024, 1), "b": rand(2 * 1024, 2)}
    with ckptstore.open(path, chunk_size=CHUNK) as w:
        w.save(1, state)
    seg = os.path.join(path, "segments", segment_files(path)[0])
    data = bytearray(open(seg, "rb").read())
    needle = state["b"].view(torch.uint8).numpy().tobytes()[CHUNK:CHUNK + 64]
    pos = data.find(needle)
    assert pos > 0
    data[pos + 10] ^= 0xFF
    with open(seg, "r+b") as f:
        f.write(data)
    with ckptstore.open(path, mode="r") as r:
        assert_same({"a": state["a"]}, r.load(1, keys=["a"]))
        with pytest.raises(DamagedCheckpointError) as ei:
            r.load(1)
        assert "b" in str(ei.value)
        with pytest.raises(DamagedCheckpointError):
            r.load(1, keys=["b"])


def test_partial_load_of_non_dict_state(store):
    store.save(1, [rand(10, 1)])
    with pytest.raises(NotFoundError):
        store.load(1, keys=[0])


def test_partial_load_of_module_state_dict(store, assert_same):
    """Regression: keys= refused an OrderedDict top level ("the state is not a dict")."""
    sd = torch.nn.Linear(300, 20).state_dict()
    store.save(1, sd)
    out = store.load(1, keys=["weight"])
    assert list(out) == ["weight"]
    assert_same(sd["weight"], out["weight"])
    with pytest.raises(NotFoundError):
        store.load(1, keys=["nope"])


# ---------------------------------------------------------------------------------------------
# diff


def test_diff_statuses_and_changed_bytes(store):
    n = 10 * CHUNK // 4 + 100                       # 10 full chunks + a 400-byte partial chunk
    big = rand(n, 1)
    a = {"big": big, "same": rand(3000, 2), "gone": rand(2000, 3), "small": torch.arange(8),
         "retyped": torch.zeros(1024, dtype=torch.int32), "reshaped": rand(2048, 4).reshape(2, 1024),
         "grown": rand(2000, 5)}
    store.save(1, a)
    big2 = big.clone()
    big2[3 * 1024 + 5] += 1                          # chunk 3
    big2[-1] += 1                                    # the partial last chunk
    b = {"big": big2, "same": a["same"].clone(), "small": torch.arange(8) + 1,
         "retyped": torch.zeros(1024, dtype=torch.float32), "reshaped": a["reshaped"].reshape(1024, 2),
         "grown": rand(2100, 5), "new": rand(1500, 6)}
    store.save(2, b)
    d = {t.path: t for t in store.diff(1, 2)}
    assert [t.path for t in store.diff(1, 2)] == list(a) + ["new"]
    assert d["big"].status == "changed" and d["big"].bytes_changed == CHUNK + 400
    assert d["big"].nbytes_a == d["big"].nbytes_b == n * 4
    assert d["same"].status == "unchanged" and d["same"].bytes_changed == 0
    assert d["gone"].status == "removed" and (d["gone"].nbytes_a, d["gone"].nbytes_b) == (8000, 0)
    assert d["gone"].bytes_changed == 0
    assert d["new"].status == "added" and d["new"].bytes_changed == d["new"].nbytes_b == 6000
    assert d["small"].status == "changed" and d["small"].bytes_changed == 64
    assert d["retyped"].status == "changed"        # same bytes, other dtype
    assert d["reshaped"].status == "changed"       # same bytes, other shape
    assert d["grown"].status == "changed" and d["grown"].bytes_changed == 8400
    assert all(t.status == "unchanged" and t.bytes_changed == 0 for t in store.diff(2, 2))
    back = {t.path: t for t in store.diff(2, 1)}
    assert back["new"].status == "removed" and back["gone"].status == "added"
    assert back["big"].bytes_changed == CHUNK + 400


def test_diff_one_byte_change_in_each_chunk(store):
    t = torch.zeros(8 * CHUNK, dtype=torch.uint8)
    store.save(1, {"t": t})
    for k, idx in enumerate([0, CHUNK - 1, 5 * CHUNK, 8 * CHUNK - 1]):
        t2 = t.clone()
        t2[idx] = 1
        store.save(2 + k, {"t": t2})
        (d,) = store.diff(1, 2 + k)
        assert d.status == "changed" and d.bytes_changed == CHUNK


def test_diff_with_colliding_display_paths(store):
    x, y = rand(2000, 1), rand(2000, 2)
    store.save(1, {"a/b": x, "a": {"b": y}, 1: x, "1": y})
    store.save(2, {"a/b": x + 1, "a": {"b": y}, 1: x + 1, "1": y})
    diffs = store.diff(1, 2)
    assert len(diffs) == 4
    assert sum(t.status == "changed" for t in diffs) == 2
    # keyed by structured path, displayed unambiguously where the usual a/b display collides
    assert {t.path: t.status for t in diffs} == {
        "state['a/b']": "changed", "state['a']['b']": "unchanged",
        "state[1]": "changed", "state['1']": "unchanged"}


def test_diff_keeps_the_plain_display_when_unambiguous(store):
    x = rand(2000, 1)
    store.save(1, {"a": {"b": x}, "n": [x, x + 1]})
    store.save(2, {"a": {"b": x + 1}, "n": [x, x + 1], "new": x})
    assert [(t.path, t.status) for t in store.diff(1, 2)] == [
        ("a/b", "changed"), ("n/0", "unchanged"), ("n/1", "unchanged"), ("new", "added")]


# ---------------------------------------------------------------------------------------------
# dedup


def test_saving_the_same_state_twice_writes_almost_nothing(store, path):
    state = {"w": rand(20 * 1024, 1), "b": rand(5000, 2), "n": np.arange(3000, dtype=">i8"),
             "small": torch.ones(4), "step": 1}
    s1 = store.save(1, state)
    assert s1.written_bytes > 20 * 1024 * 4 and s1.chunks_written > 20
    size1 = sum(os.path.getsize(os.path.join(path, "segments", f)) for f in segment_files(path))
    s2 = store.save(2, state)
    size2 = sum(os.path.getsize(os.path.join(path, "segments", f)) for f in segment_files(path))
    chunked = (20 * 1024 + 5000) * 4 + 3000 * 8
    assert s2.chunks_written == 0 and s2.chunks_deduped == s1.chunks_written
    assert s2.dedup_bytes == chunked
    assert s2.logical_bytes == s1.logical_bytes == chunked + 16
    assert s2.written_bytes < 2048                       # manifest only
    assert size2 - size1 < 2048 and size2 - size1 == store.info(2).written_bytes
    assert s2.snapshot_root == s1.snapshot_root
    s3 = store.save(3, {"renamed": state["w"]})          # dedup across paths too
    assert s3.chunks_written == 0 and s3.dedup_bytes == 20 * 1024 * 4


def test_dedup_within_one_save_and_partial_change(store):
    t = rand(8 * 1024, 1)
    s1 = store.save(1, {"a": t, "b": t.clone()})
    assert s1.chunks_written == 8 and s1.chunks_deduped == 8 and s1.dedup_bytes == 8 * CHUNK
    t2 = t.clone()
    t2[0] += 1
    s2 = store.save(2, {"a": t2, "b": t})
    assert s2.chunks_written == 1 and s2.dedup_bytes == 15 * CHUNK


# ---------------------------------------------------------------------------------------------
# locking


def test_second_writer_in_process_is_refused(store, path):
    store.save(1, {"x": 1})
    with pytest.raises(StoreLockedError) as ei:
        ckptstore.open(path)
    assert 'mode="r"' in str(ei.value) or "mode='r'" in str(ei.value)
    store.save(2, {"x": 2})                 # the first writer is unaffected
    with ckptstore.open(path, mode="r") as r:  # readers are welcome
        assert r.iterations() == [1, 2]
    store.close()
    with ckptstore.open(path) as w2:        # the lock is released on close
        w2.save(3, {"x": 3})
        assert w2.iterations() == [1, 2, 3]


CHILD = textwrap.dedent("""
    import sys, ckptstore
    try:
        ckptstore.open(sys.argv[1], mode="a")
    except ckptstore.StoreLockedError:
        print("LOCKED")
    else:
        print("OPENED")
    with ckptstore.open(sys.argv[1], mode="r") as r:
        print(r.iterations())
""")


def test_second_writer_in_another_process_is_refused(store, path):
    store.save(1, {"x": 1})
    store.save(2, {"x": 2})
    p = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == ["LOCKED", "[1, 2]"], p.stdout + p.stderr


HOLDER = textwrap.dedent("""
    import sys, time, ckptstore
    s = ckptstore.open(sys.argv[1], mode="a")
    s.save(7, {"x": 7})
    print("READY", flush=True)
    time.sleep(120)
""")


def test_lock_held_by_another_process_and_released_when_it_dies(path):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "READY", p.stderr.read()
        with pytest.raises(StoreLockedError):
            ckptstore.open(path)
        with ckptstore.open(path, mode="r") as r:
            assert r.iterations() == [7]
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    with ckptstore.open(path) as w:  # a crashed writer's lock goes with its process
        assert w.iterations() == [7]
        w.save(8, {"x": 8})


# ---------------------------------------------------------------------------------------------
# read-only mode


def test_read_mode_on_missing_store(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(StoreNotFoundError) as ei:
        ckptstore.open(missing, mode="r")
    assert isinstance(ei.value, FileNotFoundError)
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(StoreNotFoundError):
        ckptstore.open(empty, mode="r")
    assert os.listdir(empty) == []


def test_bad_mode(tmp_path):
    for mode in ("w", "rw", "", "A"):
        with pytest.raises(ValueError):
            ckptstore.open(tmp_path / "s", mode=mode)
    assert not (tmp_path / "s").exists()


def _fill(path, n=6, **opts):
    with ckptstore.open(path, chunk_size=CHUNK, **opts) as w:
        for i in range(1, n + 1):
            w.save(i, state_for(i), meta={"i": i})


def _exercise_reader(path, n=6):
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == list(range(1, n + 1)) and r.latest() == n
        for i in range(1, n + 1):
            out = r.load(i)
            assert torch.equal(out["model"]["w"], state_for(i)["model"]["w"])
            assert r.meta(i) == {"i": i}
            r.info(i)
            r.manifest(i)
        r.load(n, keys=["optim"])
        r.diff(1, n)
        r.refresh()
        with pytest.raises(ReadOnlyStoreError):
            r.save(n + 1, {"x": 1})
        with pytest.raises(NotFoundError):
            r.load(n + 1)


def test_read_mode_changes_nothing_on_disk(path):
    _fill(path)
    before = snapshot(path, lock_table=True)
    _exercise_reader(path)
    assert snapshot(path, lock_table=True) == before


@pytest.mark.parametrize("missing", ["index", "lock.mdb", "data.mdb"])
def test_reader_never_creates_index_files(path, missing):
    """Without the writer's index (or one of its two files) a reader replays the log and creates
    nothing: not the directory, not LMDB's lock file."""
    _fill(path)
    target = os.path.join(path, "index") if missing == "index" else os.path.join(path, "index", missing)
    shutil.rmtree(target) if missing == "index" else os.unlink(target)
    before = snapshot(path)
    with ckptstore.open(path, mode="r") as r:
        assert type(r.index).__name__ == "MemoryIndex"
        assert r.last_scan.commits == 6
    _exercise_reader(path)
    assert snapshot(path) == before


def test_reader_skips_the_index_on_a_read_only_filesystem(path, monkeypatch):
    """On a read-only filesystem LMDB would run without its reader table (unsafe next to a
    writer on another mount): the reader replays the log instead."""
    _fill(path)
    real = os.statvfs

    class RO:
        def __init__(self, st):
            self._st = st

        def __getattr__(self, name):
            return getattr(self._st, name)

        @property
        def f_flag(self):
            return self._st.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda p: RO(real(p)))
    with ckptstore.open(path, mode="r") as r:
        assert type(r.index).__name__ == "MemoryIndex" and r.last_scan.commits == 6
        assert r.iterations() == list(range(1, 7))


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_EXCL


@pytest.fixture
def no_writes(monkeypatch):
    """Fail (and record) every call that could write to the file system."""
    violations: list[str] = []

    def refuse(what):
        violations.append(what)
        raise PermissionError(f"test forbids writes: {what}")

    real_os_open, real_open = os.open, builtins.open

    def guarded_os_open(p, flags, *a, **k):
        if flags & _WRITE_FLAGS:
            refuse(f"os.open({p!r}, {flags:#x})")
        return real_os_open(p, flags, *a, **k)

    def guarded_open(file, mode="r", *a, **k):
        if any(c in mode for c in "wax+"):
            refuse(f"open({file!r}, {mode!r})")
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(os, "open", guarded_os_open)
    monkeypatch.setattr(builtins, "open", guarded_open)
    for mod, names in ((os, ("makedirs", "mkdir", "rename", "replace", "unlink", "remove", "rmdir",
                             "truncate", "ftruncate", "write", "pwrite", "pwritev", "writev",
                             "symlink", "link", "chmod", "utime", "fsync", "fdatasync")),
                       (shutil, ("rmtree", "copy", "copy2", "copyfile", "move")),
                       (fcntl, ("flock", "lockf"))):
        for name in names:
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name,
                                    lambda *a, _n=f"{mod.__name__}.{name}", **k: refuse(f"{_n}{a!r}"))
    real_lmdb_open = lmdb.open

    def guarded_lmdb_open(path, *a, **k):  # readers may open the index read-only, nothing else
        if not k.get("readonly") or k.get("create", True) or not k.get("lock", True):
            refuse(f"lmdb.open({path!r}, {k!r})")
        return real_lmdb_open(path, *a, **k)

    monkeypatch.setattr(lmdb, "open", guarded_lmdb_open)
    return violations


@pytest.fixture
def filled(tmp_path_factory):
    p = tmp_path_factory.mktemp("filled") / "store"
    _fill(p, segment_size=16 * 1024)
    return p


def test_read_mode_never_writes_with_guard(filled, no_writes):
    before = snapshot(filled, lock_table=True)
    _exercise_reader(filled)
    assert no_writes == []
    assert snapshot(filled, lock_table=True) == before


def test_guard_catches_a_writer(tmp_path, no_writes):
    with pytest.raises(CkptStoreError):  # the guard itself works: a writer open trips it
        ckptstore.open(tmp_path / "s")
    assert no_writes


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_read_mode_on_read_only_tree(filled):  # pragma: no cover - runs only as non-root
    for dirpath, dirnames, filenames in os.walk(filled):
        for n in filenames:
            os.chmod(os.path.join(dirpath, n), 0o444)
    for dirpath, dirnames, filenames in list(os.walk(filled))[::-1]:
        os.chmod(dirpath, 0o555)
    try:
        _exercise_reader(filled)
    finally:
        for dirpath, dirnames, filenames in os.walk(filled):
            os.chmod(dirpath, 0o755)


def test_reader_sees_commits_of_a_running_writer(path, assert_same):
    w = ckptstore.open(path, chunk_size=CHUNK, segment_size=32 * 1024)
    try:
        r = ckptstore.open(path, mode="r")
        r2 = ckptstore.open(path, mode="r")
        assert r.iterations() == [] and r.latest() is None
        for i in range(1, 13):
            w.save(i, state_for(i))
            assert r.iterations() == list(range(1, i + 1))
            assert r.latest() == i
            if i % 4 == 0:  # straight to load, without asking for iterations first
                assert_same(state_for(i), r2.load(i))
        assert len(segment_files(path)) > 2     # the reader followed rolled segments
        for i in (1, 6, 12):
            assert_same(state_for(i), r.load(i))
        r.close()
        r2.close()
    finally:
        w.close()


def test_closed_store(path):
    s = ckptstore.open(path)
    s.save(1, {"x": 1})
    s.close()
    s.close()  # idempotent
    for call in (lambda: s.save(2, {"x": 2}), lambda: s.load(1), s.iterations, s.latest,
                 lambda: s.info(1)):
        with pytest.raises(StoreClosedError):
            call()
    r = ckptstore.open(path, mode="r")
    r.close()
    with pytest.raises(StoreClosedError):
        r.iterations()
    with pytest.raises(StoreClosedError):
        r.save(2, {"x": 2})
    with ckptstore.open(path) as s2:
        assert s2.load(1) == {"x": 1}
    with pytest.raises(StoreClosedError):
        s2.save(2, {})


def test_save_through_read_mode(path):
    _fill(path, 2)
    with ckptstore.open(path, mode="r") as r:
        with pytest.raises(ReadOnlyStoreError) as ei:
            r.save(3, {"x": 1})
        assert isinstance(ei.value, PermissionError)
        assert r.iterations() == [1, 2]


# ---------------------------------------------------------------------------------------------
# STORE header


def _rewrite_store_header(path, **changes):
    f = os.path.join(path, "STORE")
    old = open(f, "rb").read()
    h = decode_store_header(old)
    fields = dict(format_version=h.format_version, store_id=h.store_id, chunk_size=h.chunk_size,
                  segment_size=h.segment_size, created_ns=h.created_ns)
    fields.update(changes)
    with open(f, "wb") as fh:
        fh.write(encode_store_header(StoreHeader(**fields)))  # a valid checksum over the new body
    return old


@pytest.mark.parametrize("version", [0, 2, 99])
def test_unknown_store_version(path, version):
    _fill(path, 2)
    old = _rewrite_store_header(path, format_version=version)
    crafted = open(os.path.join(path, "STORE"), "rb").read()
    for mode in ("r", "a"):
        with pytest.raises(UnsupportedVersionError) as ei:
            ckptstore.open(path, mode=mode)
        assert str(version) in str(ei.value)
        assert "STORE" in str(ei.value)
    assert open(os.path.join(path, "STORE"), "rb").read() == crafted  # left alone
    with open(os.path.join(path, "STORE"), "wb") as fh:
        fh.write(old)
    with ckptstore.open(path) as w:  # the refused writer released its lock
        assert w.iterations() == [1, 2]


def test_corrupt_store_header(path):
    _fill(path, 1)
    f = os.path.join(path, "STORE")
    data = bytearray(open(f, "rb").read())
    data[40] ^= 1
    open(f, "wb").write(bytes(data))
    for mode in ("r", "a"):
        with pytest.raises(FormatError) as ei:
            ckptstore.open(path, mode=mode)
        assert ei.value.path == f
    open(f, "wb").write(b"short")
    with pytest.raises(FormatError):
        ckptstore.open(path, mode="r")


# ---------------------------------------------------------------------------------------------
# reopening, segments, index


def test_reopen_keeps_everything(path, assert_same):
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=64 * 1024) as w:
        infos = {}
        for i in range(1, 6):
            w.save(i, state_for(i), meta={"i": i, "f": 0.5})
            infos[i] = w.info(i)
    for mode in ("a", "r", "a"):
        with ckptstore.open(path, mode=mode) as s:
            assert s.chunk_size == CHUNK and s.segment_size == 64 * 1024
            assert s.iterations() == [1, 2, 3, 4, 5]
            for i in range(1, 6):
                assert_same(state_for(i), s.load(i))
                assert s.meta(i) == {"i": i, "f": 0.5}
                assert s.info(i) == infos[i]
    with ckptstore.open(path) as w:
        w.save(6, state_for(6))
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == [1, 2, 3, 4, 5, 6]


def test_many_small_iterations_roll_segments(path, assert_same):
    seg_size = 64 * 1024
    shared = rand(4096, 999)
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=seg_size) as w:
        for i in range(300):
            w.save(i, {"w": rand(1024, i), "shared": shared, "i": i})
    segs = segment_files(path)
    assert len(segs) >= 15
    for name in segs:
        assert os.path.getsize(os.path.join(path, "segments", name)) <= seg_size
    for mode in ("a", "r"):
        with ckptstore.open(path, mode=mode) as s:
            assert s.iterations() == list(range(300))
            for i in (0, 1, 77, 150, 298, 299):
                assert_same({"w": rand(1024, i), "shared": shared, "i": i}, s.load(i))
    with ckptstore.open(path) as w:
        assert w.last_scan is not None and w.last_scan.commits == 0  # the index was reused
        w.save(300, {"i": 300})


def _saved(path, its, **opts):
    with ckptstore.open(path, chunk_size=CHUNK, **opts) as w:
        for i in its:
            w.save(i, state_for(i))


def _check_all(path, its, assert_same):
    for mode in ("a", "r"):
        with ckptstore.open(path, mode=mode) as s:
            assert s.iterations() == list(its)
            for i in its:
                assert_same(state_for(i), s.load(i))


@pytest.mark.parametrize("segment_size", [1 << 30, 16 * 1024])
def test_deleted_index_is_rebuilt(path, assert_same, segment_size):
    _saved(path, range(1, 9), segment_size=segment_size)
    shutil.rmtree(os.path.join(path, "index"))
    with ckptstore.open(path) as w:
        assert w.last_scan.commits == 8  # rebuilt from the log
        assert w.iterations() == list(range(1, 9))
    assert os.path.isdir(os.path.join(path, "index"))
    _check_all(path, range(1, 9), assert_same)
    with ckptstore.open(path) as w:
        assert w.last_scan.commits == 0
        w.save(9, state_for(9))
        assert w.save(10, state_for(9)).chunks_written == 0  # rebuilt index still dedups


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated", "zeros", "lock_garbage"])
def test_corrupt_index_is_rebuilt(path, assert_same, damage):
    _saved(path, range(1, 6))
    data_mdb = os.path.join(path, "index", "data.mdb")
    size = os.path.getsize(data_mdb)
    if damage == "garbage":
        open(data_mdb, "wb").write(np.random.default_rng(0).bytes(size))
    elif damage == "empty":
        open(data_mdb, "wb").close()
    elif damage == "truncated":
        os.truncate(data_mdb, 100)
    elif damage == "zeros":
        open(data_mdb, "wb").write(bytes(size))
    else:
        open(os.path.join(path, "index", "lock.mdb"), "wb").write(b"\xff" * 4096)
    with ckptstore.open(path) as w:
        assert w.iterations() == [1, 2, 3, 4, 5]
        w.save(6, state_for(6))
    _check_all(path, range(1, 7), assert_same)


def test_index_of_another_store_is_rebuilt(tmp_path, assert_same):
    a, b = tmp_path / "a", tmp_path / "b"
    _saved(a, range(1, 4))
    _saved(b, range(1, 3))
    shutil.rmtree(os.path.join(b, "index"))
    shutil.copytree(os.path.join(a, "index"), os.path.join(b, "index"))
    with ckptstore.open(b) as w:
        assert w.iterations() == [1, 2]
    _check_all(b, range(1, 3), assert_same)


@pytest.mark.parametrize("segment_size", [1 << 30, 16 * 1024])
def test_stale_index_catches_up(path, assert_same, segment_size):
    saved_index = path.parent / "index-at-5"
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=segment_size) as w:
        for i in range(1, 11):
            w.save(i, state_for(i))
            if i == 5:
                shutil.copytree(os.path.join(path, "index"), saved_index)
    shutil.rmtree(os.path.join(path, "index"))
    shutil.copytree(saved_index, os.path.join(path, "index"))
    with ckptstore.open(path) as w:
        assert w.iterations() == list(range(1, 11))
        assert w.last_scan.commits == 5  # replayed only what the old index lacked
    _check_all(path, range(1, 11), assert_same)


@pytest.mark.parametrize("segment_size", [1 << 30, 16 * 1024])
def test_index_newer_than_restored_log_is_rebuilt(path, assert_same, segment_size):
    """Segments restored from a backup taken at iteration 5; the index still knows 1..10."""
    saved = path.parent / "segments-at-5"
    with ckptstore.open(path, chunk_size=CHUNK, segment_size=segment_size) as w:
        for i in range(1, 11):
            w.save(i, state_for(i))
            if i == 5:
                shutil.copytree(os.path.join(path, "segments"), saved)
    shutil.rmtree(os.path.join(path, "segments"))
    shutil.copytree(saved, os.path.join(path, "segments"))
    with ckptstore.open(path) as w:
        assert w.iterations() == [1, 2, 3, 4, 5]
        w.save(6, {"other": 6})
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == [1, 2, 3, 4, 5, 6]
        assert r.load(6) == {"other": 6}
        for i in range(1, 6):
            assert_same(state_for(i), r.load(i))


def _tamper_first_chunk_entry(path, how):
    """Rewrite one value of the LMDB index's chunk table in place (the log stays intact)."""
    env = lmdb.open(os.path.join(path, "index"), max_dbs=8, subdir=True)
    try:
        chunks = env.open_db(b"chunks", create=False)
        with env.begin(write=True) as txn:
            key, val = next(iter(txn.cursor(db=chunks)))
            if how == "short_value":
                txn.put(key, val[:10], db=chunks)
            else:  # a well-formed entry pointing at the wrong offset
                off = int.from_bytes(val[8:16], "little")
                txn.put(key, val[:8] + (off + 8).to_bytes(8, "little") + val[16:], db=chunks)
    finally:
        env.close()


@pytest.mark.parametrize("how", ["short_value", "wrong_offset"])
def test_damaged_index_entry_does_not_break_intact_checkpoints(path, assert_same, how):
    _saved(path, range(1, 4))
    _tamper_first_chunk_entry(path, how)
    with ckptstore.open(path, mode="r") as r:  # the log itself is fine
        for i in range(1, 4):
            assert_same(state_for(i), r.load(i))
    with ckptstore.open(path) as w:
        for i in range(1, 4):
            assert_same(state_for(i), w.load(i))


@pytest.mark.parametrize("it", [-1, 2**63, 2**64, 1.0, "1", None, True])
def test_lookups_of_odd_iteration_values(store, it):
    store.save(1, {"x": 1})
    for fn in (store.load, store.info, store.manifest, store.meta):
        with pytest.raises(NotFoundError):
            fn(it)
    with pytest.raises(NotFoundError):
        store.diff(1, it)


def test_writer_chunk_size_override(path, assert_same):
    _saved(path, [1])                                   # created with CHUNK
    with ckptstore.open(path, chunk_size=1024) as w:    # this writer uses 1 KiB chunks
        st = w.save(2, state_for(2))
        assert w.manifest(2).chunk_size == 1024 and w.manifest(1).chunk_size == CHUNK
        assert st.chunks_written + st.chunks_deduped == -(-1500 * 4 // 1024) + -(-1200 * 4 // 1024)
    with ckptstore.open(path, mode="r") as r:
        assert r.chunk_size == CHUNK                    # the STORE header is unchanged
        assert_same(state_for(1), r.load(1))
        assert_same(state_for(2), r.load(2))


def test_every_package_error_is_exported():
    """Callers catch errors by ``ckptstore.X``: every public class in ckptstore/errors.py derived
    from CkptStoreError is exported from the package (and listed in ``__all__``), as the same
    object."""
    import inspect

    import ckptstore.errors as errors

    public = {name: cls for name, cls in vars(errors).items()
              if inspect.isclass(cls) and issubclass(cls, CkptStoreError)
              and cls.__module__ == errors.__name__ and not name.startswith("_")}
    assert {"CkptStoreError", "DeltaChainError", "ReplayDivergenceError"} <= set(public)
    for name, cls in public.items():
        assert getattr(ckptstore, name, None) is cls, f"ckptstore.{name} is not exported"
        assert name in ckptstore.__all__, f"{name} is missing from ckptstore.__all__"
