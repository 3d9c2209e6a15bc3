"""I/O faults injected through the FileOps seam: typed errors, nothing committed lost, writing
resumes once the fault clears (no manual repair).

The sweep (``test_fault_sweep``) runs every write path of the store -- store creation, save, a save
that rolls a segment, delta logging (durable, group commit, flush on close, the Checkpointer),
index rebuild on open, tail recovery (truncate and quarantine) and gc -- once with a counting
FileOps to learn its N I/O calls, then N more times, failing the k-th call (k = 1..N) with ENOSPC,
EIO, EDQUOT, and (at writes) a short write followed by ENOSPC. After each fault: the error is typed
and names the operation and the file; a reader that opens the store then sees every iteration
committed before intact and bit-exact; the same Store object (even k) or a reopened one (odd k)
finishes the operation; fsck finds the store clean. The total number of faults injected is printed
at the end of the module (and written to $CKPTSTORE_FAULT_REPORT as JSON when that is set).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import lmdb
import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.ops.fsck import check
from ckptstore.storage.fileops import O_DIRECT
from ckptstore.storage.fileops import FileOps


class FaultyOps(FileOps):
    """Fails the N-th call of one kind of operation with an OSError of a chosen errno."""

    def __init__(self) -> None:
        self.arm(None)

    def arm(self, op: str | None, nth: int = 1, err: int = errno.EIO, short: bool = False,
            then: tuple | None = None) -> None:
        """Fail the ``nth`` next ``op``; ``then`` = arguments of the fault armed right after."""
        self.op, self.left, self.err, self.short, self.then = op, nth, err, short, then

    def _hit(self, op: str) -> int | None:
        """The errno to fail this call with, or None."""
        if self.op != op:
            return None
        self.left -= 1
        if self.left:
            return None
        err, short = self.err, self.short
        self.arm(*self.then) if self.then is not None else self.arm(None)
        if short:  # a short write now, then the disk fills up
            self.arm("write", 1, err)
            return -1
        return err

    def _pwritev(self, fd, buffers, offset):
        err = self._hit("write")
        if err == -1:
            first = bytes(buffers[0])[: max(1, len(buffers[0]) // 2)]
            return super()._pwritev(fd, [first], offset)
        if err:
            raise OSError(err, "injected")
        return super()._pwritev(fd, buffers, offset)

    def _fsync(self, fd):
        if err := self._hit("fsync"):
            raise OSError(err, "injected")
        super()._fsync(fd)

    def _ftruncate(self, fd, length):
        if err := self._hit("truncate"):
            raise OSError(err, "injected")
        super()._ftruncate(fd, length)

    def _rename(self, src, dst):
        if err := self._hit("rename"):
            raise OSError(err, "injected")
        super()._rename(src, dst)

    def _unlink(self, path):
        if err := self._hit("unlink"):
            raise OSError(err, "injected")
        super()._unlink(path)


def state(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"w": rng.standard_normal(20_000).astype(np.float32), "fixed": np.arange(5000.0), "i": i}


def assert_intact(path, iterations) -> None:
    with ckptstore.open(path, "r") as s:
        assert s.iterations() == iterations
        for i in iterations:
            got = s.load(i)
            np.testing.assert_array_equal(got["w"], state(i)["w"])
            assert got["i"] == i


CASES = [("write", 1, errno.ENOSPC, False), ("write", 3, errno.EIO, False),
         ("write", 2, errno.EDQUOT, True), ("fsync", 1, errno.EIO, False),
         ("fsync", 2, errno.EIO, False)]


@pytest.mark.parametrize("op,nth,err,short", CASES)
def test_fault_during_save_keeps_committed_and_resumes(tmp_path, op, nth, err, short):
    ops = FaultyOps()
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=16 << 10, segment_size=64 << 10, file_ops=ops) as s:
        for i in range(3):
            s.save(i, state(i))
        ops.arm(op, nth, err, short)
        with pytest.raises(ckptstore.StoreIOError) as info:
            s.save(3, state(3))
        assert info.value.errno == err
        assert op in str(info.value) and str(path) in str(info.value)
        if err in (errno.ENOSPC, errno.EDQUOT):
            assert isinstance(info.value, ckptstore.DiskFullError)
        assert s.iterations() == [0, 1, 2]
        s.save(3, state(3))  # the fault has cleared: writing resumes without repair
        s.save(4, state(4))
    assert_intact(path, [0, 1, 2, 3, 4])
    assert check(path).clean


def test_fault_during_rollback_recovers_on_next_save(tmp_path):
    ops = FaultyOps()
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=16 << 10, file_ops=ops) as s:
        s.save(0, state(0))
        # The save fails, and so does the rollback's truncate: the store must recover by itself.
        ops.arm("write", 2, errno.ENOSPC, then=("truncate", 1, errno.EIO))
        with pytest.raises(ckptstore.DiskFullError):
            s.save(1, state(1))
        assert s.iterations() == [0]  # recovery (cut the tail) runs here
        s.save(1, state(1))
    assert_intact(path, [0, 1])
    assert check(path).clean


def test_fault_in_segment_roll(tmp_path):
    ops = FaultyOps()
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=16 << 10, segment_size=40 << 10, file_ops=ops) as s:
        s.save(0, state(0))
        ops.arm("fsync", 1, errno.EIO)  # the first fsync of the next save is the roll's
        with pytest.raises(ckptstore.StoreIOError):
            s.save(1, state(1))
        s.save(1, state(1))
    assert_intact(path, [0, 1])
    assert check(path).clean


@pytest.mark.parametrize("op,nth", [("write", 1), ("fsync", 2), ("rename", 1), ("rename", 2),
                                    ("unlink", 1)])
def test_fault_during_gc_loses_nothing(tmp_path, op, nth):
    ops = FaultyOps()
    path = tmp_path / "s"
    with ckptstore.open(path, chunk_size=16 << 10, segment_size=64 << 10, file_ops=ops) as s:
        for i in range(6):
            s.save(i, state(i))
        ops.arm(op, nth, errno.EIO)
        try:
            s.gc(keep_last=2)
            done = True
        except ckptstore.StoreIOError:
            done = False
    with ckptstore.open(path, "a") as s:  # reopen finishes or discards the interrupted gc
        its = s.iterations()
    assert its[-2:] == [4, 5]
    assert its == ([4, 5] if done or op == "unlink" else its)
    assert set(its) <= set(range(6))
    assert_intact(path, its)
    assert check(path).clean


# ---- the sweep ----------------------------------------------------------------------------------

#: totals over the module, printed at its end (see _fault_report)
TOTALS: Counter = Counter()

#: the words of StoreIOError messages for each hook (FileOps methods name the operation)
OP_WORDS = {"open": ("create", "open"), "mkdir": ("create directory",), "write": ("write",),
            "fsync": ("fsync",), "fsync_dir": ("directory fsync",), "truncate": ("truncate",),
            "rename": ("rename",), "unlink": ("unlink",), "index_open": ("open index",),
            "index_commit": ("index commit", "index write")}
ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "EDQUOT": errno.EDQUOT, "short": errno.ENOSPC}


def _no_op(*_: Any) -> None:
    pass


class SweepOps(FileOps):
    """Counts every hook call; fails call number ``fail_at`` (1-based) with ``kind``.

    ``kind`` "short" (writes only): the write stores half of its first buffer and reports that,
    then the next write fails with ENOSPC (a disk filling up mid-write). LMDB calls fail the way
    py-lmdb does (an ``lmdb.Error`` whose message ends with the OS error text) for EIO and ENOSPC,
    and with a plain OSError for EDQUOT, so both wrapping paths are exercised.
    """

    def __init__(self, fail_at: int | None = None, kind: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail_at, self.kind = fail_at, kind
        self.injected = 0
        self.failed_op: str | None = None
        self.short_pending = False
        self.all_short = False  # every write is cut in half (the retry loop must finish it)

    def clear(self) -> None:
        self.fail_at = None
        self.short_pending = False

    def _due(self, op: str) -> bool:
        self.calls.append(op)
        if self.fail_at is None or len(self.calls) != self.fail_at:
            return False
        self.failed_op = op
        self.injected += 1
        return True

    def _raise(self, op: str) -> None:
        err = ERRNOS[self.kind]
        if op in ("index_open", "index_commit") and self.kind in ("EIO", "ENOSPC"):
            raise lmdb.Error(f"mdb_{op}: {os.strerror(err)}")
        raise OSError(err, f"injected {self.kind} ({op} call {self.fail_at})")

    def _pwritev(self, fd, buffers, offset):
        if self.short_pending:
            self.short_pending = False
            self.injected += 1
            raise OSError(errno.ENOSPC, "injected ENOSPC after a short write")
        if self._due("write"):
            if self.kind != "short":
                self._raise("write")
            self.short_pending = True
            first = bytes(buffers[0])
            return super()._pwritev(fd, [first[: max(1, len(first) // 2)]], offset)
        if self.all_short:
            first = bytes(buffers[0])
            return super()._pwritev(fd, [first[: max(1, (len(first) + 1) // 2)]], offset)
        return super()._pwritev(fd, buffers, offset)

    def _hook(self, op: str, fn: Callable, *args: Any) -> Any:
        if self._due(op):
            self._raise(op)
        return fn(*args)

    def _open(self, path, flags, mode):
        return self._hook("open", super()._open, path, flags, mode)

    def _mkdir(self, path):
        return self._hook("mkdir", super()._mkdir, path)

    # fsyncs are counted and failed but not performed: these tests check what the store does
    # with errors, not durability across power loss (tests/test_crash.py does that), and real
    # fsyncs would make the sweep several times slower.
    def _fsync(self, fd):
        return self._hook("fsync", _no_op, fd)

    def _fsync_dir(self, fd):
        return self._hook("fsync_dir", _no_op, fd)

    def _ftruncate(self, fd, length):
        return self._hook("truncate", super()._ftruncate, fd, length)

    def _rename(self, src, dst):
        return self._hook("rename", super()._rename, src, dst)

    def _unlink(self, path):
        return self._hook("unlink", super()._unlink, path)

    def _index_open(self, path, options):
        return self._hook("index_open", super()._index_open, path, options)

    def _index_commit(self, txn):
        return self._hook("index_commit", super()._index_commit, txn)


CHUNK = 16 << 10
_FIXED = np.arange(5000.0)  # 40000 B, identical in every snapshot (dedup)


def snap(i: int) -> dict:
    rng = np.random.default_rng(1000 + i)
    return {"w": rng.standard_normal(20_000).astype(np.float32), "fixed": _FIXED,
            "t": torch.arange(6, dtype=torch.int16) * i, "i": i, "name": f"it-{i}"}


def delta(i: int) -> dict:
    return {"g": np.random.default_rng(5000 + i).standard_normal(3000).astype(np.float32), "i": i}


def expected(kind: str, i: int) -> dict:
    return delta(i) if kind == "delta" else snap(i)


def open_writer(path: Path, ops: FileOps, **kw: Any) -> ckptstore.Store:
    return ckptstore.open(path, "a", chunk_size=CHUNK, file_ops=ops, **kw)


def verify_generated(r: ckptstore.Store, i: int, assert_same) -> None:
    kind = r.kind(i)
    got = r.load_record(i) if kind == "delta" else r.load(i)
    assert_same(expected(kind, i), got, f"iteration {i}")


def reader_check(path: Path, want: set[int] | None, assert_same, must_have: set[int] = frozenset(),
                 verify: Callable | None = None) -> list[int]:
    """A fresh reader lists ``want`` (when given) or at least ``must_have``; each loads bit-exact."""
    with ckptstore.open(path, "r") as r:
        its = r.iterations()
        if want is not None:
            assert set(its) == want, f"reader lists {its}, expected {sorted(want)}"
        assert must_have <= set(its), f"committed iterations lost: {sorted(must_have - set(its))}"
        for i in its:
            (verify or verify_generated)(r, i, assert_same)
    return its


# ---- the Checkpointer as a write path (deltas through the trainer integration) -------------------

CKPT_LAST = 6


def _trainer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _backward(model: torch.nn.Module, it: int) -> None:
    g = torch.Generator().manual_seed(it)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    model.zero_grad()
    ((model(x) - y) ** 2).mean().backward()


def _reference() -> dict[int, dict[str, torch.Tensor]]:
    """Model parameters after each iteration of an uninterrupted run (no store involved)."""
    model, opt = _trainer()
    ref = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    for it in range(1, CKPT_LAST + 1):
        _backward(model, it)
        opt.step()
        ref[it] = {k: v.clone() for k, v in model.state_dict().items()}
    return ref


REFERENCE = _reference()


def _train(s: ckptstore.Store, last: int = CKPT_LAST) -> None:
    """Resume from whatever the store holds (restore) and train to ``last``, group-committing."""
    from ckptstore.torch import Checkpointer

    model, opt = _trainer()
    ckpt = Checkpointer(s, model, opt, policy="every-iteration", base_every=100, group_commit=2,
                        fingerprint_every=0)
    for it in range(ckpt.restore() + 1, last + 1):
        _backward(model, it)
        ckpt.step(it)
    ckpt.flush()


def _closing(p: Path, fn: Callable[[ckptstore.Store], None]) -> None:
    with open_writer(p, FileOps()) as s:
        fn(s)


def _verify_trained(r: ckptstore.Store, i: int, assert_same) -> None:
    got = r.load(i)["model"]
    for k, want in REFERENCE[i].items():
        assert torch.equal(got[k], want) and got[k].dtype == want.dtype, f"iteration {i}: {k} differs"


@dataclass
class Scenario:
    """A write path. ``prepare`` builds the committed starting store (no faults); ``open`` and
    ``act`` run the path (``act`` finishes whatever is still missing, so it also resumes);
    ``states`` are the iteration sets a reader may see right after a fault."""

    name: str
    before: set[int]
    after: set[int]
    prepare: Callable[[Path], None] = lambda p: None
    open: Callable[[Path, FileOps], ckptstore.Store] = open_writer
    act: Callable[[ckptstore.Store], None] = lambda s: None
    same_object: bool = True  # act can be retried on the Store that saw the fault
    extra_states: list[set[int]] = field(default_factory=list)
    #: checks the content of one committed iteration (default: snap/delta generators, bit-exact)
    verify: Callable[[ckptstore.Store, int, Any], None] | None = None


def _saves(n: int, **kw: Any) -> Callable[[Path], None]:
    def prepare(p: Path) -> None:
        with open_writer(p, FileOps(), **kw) as s:
            for i in range(n):
                s.save(i, snap(i))
    return prepare


def _save_missing(its: list[int], **_: Any) -> Callable[[ckptstore.Store], None]:
    def act(s: ckptstore.Store) -> None:
        have = s.iterations()
        for i in its:
            if i not in have:
                s.save(i, snap(i))
    return act


def _deltas(its: list[int], durable: bool, close: bool = False) -> Callable[[ckptstore.Store], None]:
    def act(s: ckptstore.Store) -> None:
        have = set(s.iterations()) | set(s.pending())
        for i in its:
            if i not in have:
                s.save_delta(i, delta(i), durable=durable)
        if close:
            s.close()
        else:
            s.flush()
    return act


def _with_tail(suspicious: bool) -> Callable[[Path], None]:
    """Three snapshots, then bytes after the last commit: garbage (a torn save), or -- with
    ``suspicious`` -- a copy of iteration 2's COMMIT record with a damaged payload, so recovery
    quarantines the tail before cutting it."""
    def prepare(p: Path) -> None:
        _saves(3)(p)
        seg = sorted((p / "segments").glob("*.seg"))[-1]
        data = seg.read_bytes()
        if suspicious:
            from ckptstore.format import records as rec

            start = data.rindex(rec.MAGIC)  # the last record is iteration 2's COMMIT
            bad = bytearray(data[start:])
            bad[rec.HEADER_SIZE + 3] ^= 0xFF
            tail = bytes(bad)
        else:
            tail = bytes(range(256)) * 40
        with open(seg, "ab") as f:
            f.write(tail)
    return prepare


def _drop_index(p: Path) -> None:
    _saves(3)(p)
    shutil.rmtree(p / "index")


def _gc(s: ckptstore.Store) -> None:
    s.gc(keep_last=2)


def _saves_then_gc(p: Path) -> None:
    """Six snapshots collected down to the last two: the newest segment is the gc's marker."""
    _saves(6, segment_size=100 << 10)(p)
    with open_writer(p, FileOps(), segment_size=100 << 10) as s:
        s.gc(keep_last=2)


SCENARIOS = [
    Scenario("create", set(), {0}, act=_save_missing([0])),
    Scenario("save", {0, 1, 2}, {0, 1, 2, 3}, _saves(3), act=_save_missing([3])),
    Scenario("save-roll", {0, 1}, {0, 1, 2}, _saves(2),
             open=lambda p, ops: open_writer(p, ops, segment_size=100 << 10), act=_save_missing([2])),
    Scenario("delta", {0, 1}, {0, 1, 2}, _saves(2), act=_deltas([2], durable=True)),
    Scenario("delta-group", {0, 1}, {0, 1, 2, 3, 4}, _saves(2), act=_deltas([2, 3, 4], durable=False)),
    Scenario("delta-close", {0, 1}, {0, 1, 2, 3}, _saves(2), act=_deltas([2, 3], False, close=True),
             same_object=False),
    Scenario("index-rebuild", {0, 1, 2}, {0, 1, 2, 3}, _drop_index, act=_save_missing([3])),
    Scenario("tail-cut", {0, 1, 2}, {0, 1, 2, 3}, _with_tail(False), act=_save_missing([3])),
    # a damaged COMMIT record after the last commit: recovery copies the tail to quarantine/
    Scenario("tail-quarantine", {0, 1, 2}, {0, 1, 2, 3}, _with_tail(True), act=_save_missing([3])),
    Scenario("gc", set(range(6)), {4, 5}, _saves(6, segment_size=100 << 10), act=_gc),
    # saves that roll past the gc's marker: a rollback or recovery cut must keep the marker (it
    # carries the watermark; without it every collected segment counts as missing)
    Scenario("save-after-gc", {4, 5}, {4, 5, 6, 7}, _saves_then_gc,
             open=lambda p, ops: open_writer(p, ops, segment_size=100 << 10),
             act=_save_missing([6, 7]), extra_states=[{4, 5, 6}]),
    Scenario("checkpointer", {0, 1, 2, 3}, set(range(CKPT_LAST + 1)),
             lambda p: _closing(p, lambda s: _train(s, last=3)), act=_train,
             extra_states=[{0, 1, 2, 3, 4, 5}], verify=_verify_trained),
]


def _typed(err: BaseException, ops: SweepOps, path: Path) -> None:
    """The fault surfaced as the package's typed error, naming the operation and the file."""
    assert isinstance(err, ckptstore.StoreIOError), f"untyped error {type(err).__name__}: {err}"
    want = ERRNOS[ops.kind]
    assert err.errno == want, f"errno {err.errno} for injected {ops.kind}: {err}"
    if want in (errno.ENOSPC, errno.EDQUOT):
        assert isinstance(err, ckptstore.DiskFullError), err
    msg = str(err)
    failed = "write" if ops.kind == "short" else ops.failed_op
    assert any(w in msg for w in OP_WORDS[failed]), f"{failed!r} not named in {msg!r}"
    assert str(path.parent) in msg, f"no file named in {msg!r}"


def _count_calls(sc: Scenario, template: Path, work: Path) -> list[str]:
    path = work / "dry"
    shutil.copytree(template, path) if template.exists() else None
    ops = SweepOps()
    s = sc.open(path, ops)
    sc.act(s)
    s.close()
    shutil.rmtree(path)
    return ops.calls


def _trial(sc: Scenario, template: Path, path: Path, k: int, kind: str, assert_same) -> str:
    """One fault; returns what happened: "raised" or "absorbed" (the store recovered by itself)."""
    if template.exists():
        shutil.copytree(template, path)
    ops = SweepOps(k, kind)
    store, err = None, None
    try:
        store = sc.open(path, ops)
        sc.act(store)
    except Exception as e:  # noqa: BLE001 - checked just below
        err = e
    TOTALS["faults injected"] += ops.injected
    TOTALS["trials"] += 1
    assert ops.injected >= 1, f"call {k} ({ops.calls[k - 1:k]}) was not reached"
    ops.clear()
    if err is not None:
        _typed(err, ops, path)
        if path.exists() and (path / "STORE").exists():
            its = reader_check(path, None, assert_same, must_have=sc.before & sc.after,
                               verify=sc.verify)
            allowed = [sc.before, sc.after, *sc.extra_states]
            assert set(its) in allowed, f"after the fault a reader lists {its}, not one of {allowed}"
        if store is not None and sc.same_object and k % 2 == 0 and not store.closed:
            sc.act(store)  # the fault cleared: the same object finishes the job
        else:
            if store is not None:
                store.close()
            store = sc.open(path, ops)
            sc.act(store)
    if store is not None and not store.closed:
        store.close()
    reader_check(path, sc.after, assert_same, verify=sc.verify)
    report = check(path)
    assert report.clean, report.lines()
    shutil.rmtree(path)
    return "raised" if err is not None else "absorbed"


@pytest.fixture(scope="module", autouse=True)
def _fault_report(request):
    yield
    if not TOTALS:
        return
    line = ("fault injection: " + ", ".join(f"{v} {k}" for k, v in sorted(TOTALS.items()))
            + "; zero committed iterations lost")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    out = os.environ.get("CKPTSTORE_FAULT_REPORT")
    if out:
        with open(out, "w") as f:
            json.dump(dict(TOTALS), f, indent=1)


KINDS = ("ENOSPC", "EIO", "EDQUOT")


def _sweep(sc: Scenario, tmp_path: Path, assert_same, full: bool) -> None:
    template = tmp_path / "template"
    sc.prepare(template)
    calls = _count_calls(sc, template, tmp_path)
    assert calls, "the write path made no I/O call through the seam"
    outcome: Counter = Counter()
    for k in range(1, len(calls) + 1):
        # every errno at every call (full), or one errno per call in rotation (the errnos take
        # the same code paths; only the error class differs) -- plus a short write at each write
        kinds = list(KINDS) if full else [KINDS[k % len(KINDS)]]
        for kind in kinds + (["short"] if calls[k - 1] == "write" else []):
            try:
                outcome[_trial(sc, template, tmp_path / f"k{k}-{kind}", k, kind, assert_same)] += 1
            except AssertionError as e:
                raise AssertionError(f"{sc.name}: fault {kind} at call {k} ({calls[k - 1]}): {e}") from e
    outcome.update(f"calls:{c}" for c in calls)
    TOTALS[f"I/O calls in {sc.name}"] = len(calls)
    print(sc.name, dict(outcome))


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_fault_sweep(sc: Scenario, tmp_path, assert_same):
    _sweep(sc, tmp_path, assert_same, full=False)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CKPTSTORE_FAULT_SWEEP") != "full",
                    reason="every errno at every call: ~3x the default sweep; "
                           "run with CKPTSTORE_FAULT_SWEEP=full")
@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_fault_sweep_every_errno(sc: Scenario, tmp_path, assert_same):
    _sweep(sc, tmp_path, assert_same, full=True)


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_every_write_short(sc: Scenario, tmp_path, assert_same):
    """Every write returns after half its bytes: the store finishes each one and nothing differs."""
    path = tmp_path / "s"
    sc.prepare(path)
    ops = SweepOps()
    ops.all_short = True
    s = sc.open(path, ops)
    sc.act(s)
    s.close()
    TOTALS["short writes (absorbed)"] += ops.calls.count("write")
    reader_check(path, sc.after, assert_same, verify=sc.verify)
    assert check(path).clean


class _FailedAdvice(SweepOps):
    """Every page-cache advice fails (EIO); no other call does. Records the files advised."""

    def __init__(self) -> None:
        super().__init__()
        self.advised: list[str] = []
        self.direct_opens = 0

    def _open(self, path, flags, mode):
        self.direct_opens += bool(flags & O_DIRECT)
        return super()._open(path, flags, mode)

    def advise_written(self, fd, path, offset, length):
        self.advised.append(path)
        assert super().advise_written(fd, path, offset, length) is False
        return False

    def _advise(self, fd, offset, length):
        raise OSError(errno.EIO, "injected advice failure")


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_failed_advice_is_harmless(sc: Scenario, tmp_path, assert_same):
    """The sweep does not count page-cache advice (FileOps.advise_written swallows its errors, it
    is not a write): here it fails at every call of every write path and nothing differs."""
    path = tmp_path / "s"
    sc.prepare(path)
    ops = _FailedAdvice()
    s = sc.open(path, ops)
    sc.act(s)
    s.close()
    # O_DIRECT appends (the default) leave no page cache to advise about; buffered ones do
    assert ops.advised or ops.direct_opens, "the write path issued no advice"
    if sc.name == "gc":
        assert any(p.endswith(".gc-tmp") for p in ops.advised), ops.advised
    if sc.name == "tail-quarantine":
        assert any(p.endswith(".tail") for p in ops.advised), ops.advised
    TOTALS["failed advice (harmless)"] += len(ops.advised)
    reader_check(path, sc.after, assert_same, verify=sc.verify)
    assert check(path).clean


class _Dribble(FileOps):
    """Every write stores at most 7 bytes (a pathological but legal pwritev)."""

    def _pwritev(self, fd, buffers, offset):
        data = b"".join(bytes(b) for b in buffers)[:7]
        return os.pwrite(fd, data, offset)


def test_writev_finishes_after_many_short_writes(tmp_path):
    """Regression: after the second short write, writev skipped the bytes already written twice
    (it measured the skip from the original buffers but applied it to the remainder)."""
    parts = [b"header--", memoryview(np.arange(10, dtype=np.float32)), b"", b"trailer!"]
    path = str(tmp_path / "f")
    ops = _Dribble()
    fd = ops.open_truncate(path)
    try:
        ops.writev(fd, path, parts, 3)
    finally:
        os.close(fd)
    want = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert Path(path).read_bytes() == bytes(3) + want


# ---- a read-only store directory -------------------------------------------------------------------

class ReadOnlyFs(SweepOps):
    """While ``on``, every call that would change the file system fails with EROFS."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def _due(self, op: str) -> bool:
        self.calls.append(op)
        if self.on:
            self.injected += 1
            return True
        return False

    def _raise(self, op: str) -> None:
        raise OSError(errno.EROFS, f"injected EROFS ({op})")


def test_read_only_file_system(tmp_path, assert_same):
    """The store's file system turns read-only under a live writer (EROFS on every write-side
    call): each write raises a typed error naming what failed, readers are unaffected, and once
    it is writable again the same Store object carries on."""
    path = tmp_path / "s"
    ops = ReadOnlyFs()
    s = open_writer(path, ops)
    for i in range(3):
        s.save(i, snap(i))
    s.save_delta(3, delta(3))
    ops.on = True
    for what, call in [("save", lambda: s.save(4, snap(4))),
                       ("delta", lambda: s.save_delta(4, delta(4))),
                       ("gc", lambda: s.gc(keep_last=1))]:
        with pytest.raises(ckptstore.StoreIOError) as info:
            call()
        assert info.value.errno == errno.EROFS, what
        assert str(path) in str(info.value), what
        reader_check(path, {0, 1, 2, 3}, assert_same)
        assert s.iterations() == [0, 1, 2, 3]
    # a second writer cannot even open it; a reader can
    with pytest.raises(ckptstore.StoreIOError) as info:
        open_writer(tmp_path / "new", ops)
    assert info.value.errno == errno.EROFS and "new" in str(info.value)
    TOTALS["faults injected"] += ops.injected
    ops.on = False
    s.save(4, snap(4))
    s.gc(keep_last=2)
    s.close()
    reader_check(path, {2, 3, 4}, assert_same)  # 2: the base of delta 3
    assert check(path).clean


def _read_only_tree(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames:
            os.chmod(os.path.join(dirpath, n), 0o444)
        os.chmod(dirpath, 0o555)


def _as_nobody(fn: Callable[[], dict]) -> dict:
    """Run ``fn`` in a forked child without root's privileges (root ignores permission bits);
    return what it returned (a JSON-able dict)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            out = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = {"child error": f"{type(e).__name__}: {e}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def test_read_only_store_directory(tmp_path_factory, assert_same):
    """Real permissions: every directory 0555, every file 0444. A writer open is refused with a
    typed error naming the file; readers, fsck and the CLI's ls still work and write nothing."""
    import tempfile

    from ckptstore.cli import main as cli

    base = Path(tempfile.mkdtemp(prefix="ckptstore-ro-"))  # traversable by an unprivileged uid
    try:
        os.chmod(base, 0o755)
        path = base / "s"
        with open_writer(path, FileOps()) as s:
            for i in range(3):
                s.save(i, snap(i))
            s.save_delta(3, delta(3))
        _read_only_tree(path)
        before = {p: p.stat().st_mtime_ns for p in path.rglob("*")}

        def attempt() -> dict:
            out: dict = {}
            try:
                ckptstore.open(path, "a").close()
                out["writer"] = "opened"
            except ckptstore.StoreIOError as e:
                out["writer"] = [type(e).__name__, e.errno, str(e)]
            except Exception as e:  # noqa: BLE001 - reported
                out["writer"] = [type(e).__name__, None, str(e)]
            with ckptstore.open(path, "r") as r:
                out["iterations"] = r.iterations()
                for i in out["iterations"]:
                    verify_generated(r, i, assert_same)
            out["fsck clean"] = check(path).clean
            out["ls exit"] = cli(["ls", str(path)])
            return out

        out = _as_nobody(attempt) if os.geteuid() == 0 else attempt()
        assert "child error" not in out, out["child error"]
        kind, err, msg = out["writer"]
        assert kind == "StoreIOError" and err in (errno.EACCES, errno.EPERM, errno.EROFS), out
        assert str(path) in msg, msg
        assert out["iterations"] == [0, 1, 2, 3] and out["fsck clean"] and out["ls exit"] == 0
        assert {p: p.stat().st_mtime_ns for p in path.rglob("*")} == before
    finally:
        for dirpath, _, _ in os.walk(base):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(base)
