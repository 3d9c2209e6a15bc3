"""gc of multi-rank job stores (format-spec/format.md §22.7; ckptstore/multirank/job_gc.py).

Job stores are written by real 2-rank gloo jobs (tests/_ranks.py): a Checkpointer under DDP
(delta chains replayed per rank, parts merged on load), or store.save/save_delta directly. After
gc every kept iteration loads bit-exact (1-process reader, every rank's part, and a job resuming
at another world size), removed ones raise NotFoundError, fsck is clean and the bytes drop. The
crash test SIGKILLs a forked gc at chosen file operations and checks that the store shows the old
or the new set, every kept iteration loads, fsck is clean, and the next gc finishes the job.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

import ckptstore
from ckptstore.cli import main
from ckptstore.errors import NotFoundError, RetentionError, StoreLockedError
from ckptstore.ops.retention import KeepBest, KeepEvery, KeepLast
from ckptstore.storage.fileops import FileOps
from ckptstore.storage.job_log import JobLayout

from _ranks import needs_gloo, run_ranks
from conftest import _same
from test_multirank import _ddp_check, ok, rank_state

pytestmark = needs_gloo

MOD = __name__


def _pg():
    import torch.distributed as dist

    return dist.group.WORLD


def _delta(it: int, rank: int) -> dict:
    return {"g": torch.arange(64, dtype=torch.float32) * (rank + 1) + it}


# ---- scenarios (run on every rank) ------------------------------------------------------------
def save_chains(rank, world, path, start, count, base_every):
    """Iterations start..start+count-1: a snapshot every ``base_every``, deltas between."""
    with ckptstore.open(path, "a", process_group=_pg(), commit_timeout=60.0) as s:
        for it in range(start, start + count):
            if (it - start) % base_every == 0:
                s.save(it, rank_state(it, rank), meta={"loss": 1.0 / (it + 1)})
            else:
                s.save_delta(it, _delta(it, rank), meta={"loss": 1.0 / (it + 1)})
        return s.iterations()


def gc_while_writing(rank, world, path):
    """A job writes the store; an offline gc (through a reader) is refused with a typed error
    and nothing is damaged: the job saves on. (The job's own gc is collective:
    tests/test_job_retention.py.)"""
    with ckptstore.open(path, "a", process_group=_pg(), commit_timeout=60.0) as s:
        start = s.latest() + 1
        s.save(start, rank_state(start, rank))
        errors = []
        if rank == 0:
            with ckptstore.open(path, "r") as reader:
                try:
                    reader.gc(keep_last=1)
                except StoreLockedError as e:
                    errors.append(type(e).__name__)
        s.save(start + 1, rank_state(start + 1, rank))
        return {"errors": errors, "iterations": s.iterations()}


# ---- helpers ------------------------------------------------------------------------------------
def build(tmp_path, name="job", runs=((0, 10, 4), (10, 8, 3))) -> str:
    path = str(tmp_path / name)
    for i, (start, count, base_every) in enumerate(runs):
        ok(run_ranks(2, MOD, "save_chains", path, str(tmp_path / f"w-{name}-{i}"), deadline=180,
                     start=start, count=count, base_every=base_every))
    return path


def records(path) -> dict:
    """Every iteration's stored record on every rank (snapshots loaded, deltas as written)."""
    out = {}
    with ckptstore.open(path, "r") as r:
        for it in r.iterations():
            out[it] = [r.load(it, rank=k) if r.kind(it) == "snapshot" else r.load_record(it, rank=k)
                       for k in range(r.global_commit(it).world_size)]
    return out


def check_records(path, ref: dict, kept) -> None:
    with ckptstore.open(path, "r") as r:
        for it in kept:
            for k, want in enumerate(ref[it]):
                got = r.load(it, rank=k) if r.kind(it) == "snapshot" else r.load_record(it, rank=k)
                _same(want, got, f"iteration {it} rank {k}")


def tree(path) -> dict:
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            p = os.path.join(d, n)
            if "index" not in p.split(os.sep):
                out[os.path.relpath(p, path)] = open(p, "rb").read()
    return out


def fsck_clean(path, capsys=None) -> bool:
    rc = main(["fsck", path])
    if capsys is not None:
        capsys.readouterr()
    return rc == 0


# ---- tests ----------------------------------------------------------------------------------------
def test_gc_keeps_chains_on_every_rank(tmp_path, capsys):
    path = build(tmp_path)
    ref = records(path)
    its = list(ref)
    assert its == list(range(18))
    with ckptstore.open(path, "r") as r:
        assert {r.global_commit(i).epoch for i in its} == {1, 2}
        dry = r.gc(keep_last=2, keep_every=7, dry_run=True)
        before = sorted(os.listdir(JobLayout(path).streams_dir))
        # bases 0, 4, 8 | 10, 13, 16; the policy: 0, 7, 14, 16, 17; 7 needs 4..6, 14 needs 13
        assert dry.kept == [0, 4, 5, 6, 7, 13, 14, 16, 17], dry
        assert "needed by rank" in dry.why[4] and "iteration 7" in dry.why[4], dry.why
        assert dry.estimated and dry.bytes_after < dry.bytes_before
        assert sorted(os.listdir(JobLayout(path).streams_dir)) == before  # nothing written
        rep = r.gc(keep_last=2, keep_every=7)
        assert rep.kept == dry.kept and rep.removed == [i for i in its if i not in rep.kept]
        assert r.iterations() == rep.kept  # the reader follows the new epoch
        assert rep.bytes_after < rep.bytes_before, rep
        print(f"job gc: {rep.bytes_before} -> {rep.bytes_after} bytes")
    check_records(path, ref, rep.kept)
    with ckptstore.open(path, "r") as r:
        for it in rep.removed:
            with pytest.raises(NotFoundError):
                r.load(it, rank=0)
        assert {r.global_commit(i).epoch for i in rep.kept} == {rep.epoch}
    layout = JobLayout(path)
    assert sorted(os.listdir(layout.streams_dir)) == [f"{rep.epoch:010d}-0000{k}" for k in (0, 1)]
    assert layout.list_epochs() == [rep.epoch]
    assert fsck_clean(path, capsys)
    # a job continues after the gc (adopting the new epoch), and gc runs again
    ok(run_ranks(2, MOD, "save_chains", path, str(tmp_path / "w3"), deadline=180,
                 start=18, count=3, base_every=3))
    ref.update(records(path))
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == rep.kept + [18, 19, 20]
        rep2 = r.gc(keep_last=1)
    assert rep2.kept == [18, 19, 20] and "chain of iteration 20" in rep2.why[18]
    check_records(path, ref, rep2.kept)
    assert fsck_clean(path, capsys)


def test_gc_ddp_checkpointer_and_another_world_size(tmp_path, capsys):
    """A Checkpointer under DDP (partitioned parts, delta chains replayed per rank): after gc the
    merged 1-process load of every kept iteration equals the live state; a job resumes from the
    gc'd store at world size 1; a second gc keeps the 2-rank iterations as they are (an earlier
    world size) and compacts the 1-rank ones."""
    path, live = str(tmp_path / "job"), str(tmp_path / "live")
    os.makedirs(live)
    ok(run_ranks(2, "test_multirank", "ddp_train", path, str(tmp_path / "w1"), deadline=240,
                 iterations=9, live_dir=live))
    with ckptstore.open(path, "r") as r:
        assert r.kind(5) == "delta"
        rep = r.gc(keep_last=2)
        assert rep.removed and rep.kept[-1] == 9
        assert r.kind(rep.kept[0]) == "snapshot"
    _ddp_check(path, live, rep.kept)
    assert fsck_clean(path, capsys)
    res = ok(run_ranks(1, "test_multirank", "ddp_train", path, str(tmp_path / "w2"),
                       deadline=240, iterations=5, live_dir=live))
    assert res[0]["start"] == 9
    restored = torch.load(os.path.join(live, "restored-9-rank0.pt"))
    _same(dict(torch.load(os.path.join(live, "live-9.pt"))["model"]), restored["model"], "restored")
    with ckptstore.open(path, "r") as r:
        rep2 = r.gc(keep_last=1)
        assert set(rep2.unchanged) == set(rep.kept) and rep2.removed
        assert "world size 2" in rep2.why[rep.kept[0]]
        assert [r.global_commit(i).world_size for i in (9, 14)] == [2, 1]
    _ddp_check(path, live, rep2.kept)
    assert fsck_clean(path, capsys)


def test_gc_refuses_bad_policy_and_a_writing_job(tmp_path, capsys):
    path = build(tmp_path, runs=((0, 4, 2),))
    before = tree(path)
    with ckptstore.open(path, "r") as r:
        with pytest.raises(RetentionError):
            r.gc(policy=KeepBest(2, "no.such.metric"))
        with pytest.raises(TypeError):
            r.gc(KeepLast(2))
    assert tree(path) == before
    assert main(["gc", path, "--keep-best", "1", "--metric", "nope"]) != 0
    capsys.readouterr()
    assert tree(path) == before
    res = ok(run_ranks(2, MOD, "gc_while_writing", path, str(tmp_path / "w2"), deadline=180))
    assert res[0]["errors"] == ["StoreLockedError"]
    assert res[0]["iterations"] == [0, 1, 2, 3, 4, 5]
    assert fsck_clean(path, capsys)
    # the CLI: the same options as a single store
    assert main(["gc", path, "--keep-last", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove" in out
    assert main(["gc", path, "--keep-last", "2", "--keep-every", "4"]) == 0
    out = capsys.readouterr().out
    assert "removed" in out
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == [0, 4, 5]
    assert fsck_clean(path, capsys)


# ---- crashes ----------------------------------------------------------------------------------------
class _Ops(FileOps):
    """Counts every write-side operation (``log``), and SIGKILLs the process at the ``kill``-th."""

    def __init__(self, kill: int = 0) -> None:
        self.n, self.kill, self.log = 0, kill, []

    def _step(self, what: str) -> None:
        self.n += 1
        self.log.append(what)
        if self.n == self.kill:
            os.kill(os.getpid(), 9)

    def _pwritev(self, fd, buffers, offset):
        self._step("write")
        return super()._pwritev(fd, buffers, offset)

    def _fsync(self, fd):
        self._step("fsync")
        return super()._fsync(fd)

    def _fsync_dir(self, fd):
        self._step("fsync_dir")
        return super()._fsync_dir(fd)

    def _rename(self, src, dst):
        self._step("rename")
        return super()._rename(src, dst)

    def _unlink(self, path):
        self._step("unlink")
        return super()._unlink(path)


def _forked_gc(path, policy, kill, log_file=None, **options) -> int:
    """Run the gc (``collect_job``, with ``options``) in a forked child (killed at operation
    ``kill``; 0: never). Returns its wait status."""
    from ckptstore.multirank.job_gc import collect_job

    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            ops = _Ops(kill)
            collect_job(path, policy, lambda p: ckptstore.JobStore(p, "r"), file_ops=ops,
                        **options)
            if log_file:
                with open(log_file, "w") as f:
                    f.write("\n".join(ops.log))
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _crash_points(ops: list[str], trials: int, seed: int) -> list[int]:
    """Every rename, unlink and directory fsync (the protocol's steps), and ``trials`` others."""
    steps = [i + 1 for i, op in enumerate(ops) if op in ("rename", "unlink", "fsync_dir")]
    rest = [i + 1 for i in range(len(ops)) if i + 1 not in steps]
    rng = random.Random(seed)
    return sorted(set(steps) | set(rng.sample(rest, min(trials, len(rest)))))


def _crash_loop(tmp_path, capsys, trials: int, every_step: bool) -> None:
    base = build(tmp_path, "base")
    ref = records(base)
    old = list(ref)
    policy = KeepLast(2) | KeepEvery(7)
    probe = str(tmp_path / "probe")
    shutil.copytree(base, probe)
    log_file = str(tmp_path / "ops.txt")
    assert _forked_gc(probe, policy, 0, log_file) == 0
    ops = open(log_file).read().split("\n")
    with ckptstore.open(probe, "r") as r:
        new = r.iterations()
    points = _crash_points(ops, trials, 7)
    if not every_step:
        steps = [p for p in points if ops[p - 1] != "write" and ops[p - 1] != "fsync"]
        points = sorted(set(steps[::max(1, len(steps) // 8)] + steps[-6:]) |
                        set(random.Random(3).sample(points, min(trials, len(points)))))
    seen = set()
    for kill in points:
        trial = str(tmp_path / "trial")
        if os.path.exists(trial):
            shutil.rmtree(trial)
        shutil.copytree(base, trial)
        status = _forked_gc(trial, policy, kill)
        assert os.WIFSIGNALED(status), (kill, status)
        with ckptstore.open(trial, "r") as r:
            shown = r.iterations()
        assert shown in (old, new), (kill, ops[kill - 1], shown)
        seen.add(tuple(shown))
        check_records(trial, ref, new)
        assert fsck_clean(trial, capsys), (kill, ops[kill - 1])
        # the next gc finishes the work and leaves no leftovers
        assert _forked_gc(trial, policy, 0) == 0
        with ckptstore.open(trial, "r") as r:
            assert r.iterations() == new
        check_records(trial, ref, new)
        layout = JobLayout(trial)
        assert not os.path.exists(layout.gc_trash_dir)
        assert len(os.listdir(layout.streams_dir)) == 2 and len(layout.list_epochs()) == 1
        assert fsck_clean(trial, capsys)
    assert seen == {tuple(old), tuple(new)}  # crashes on both sides of the commit point


def test_gc_sigkill_at_its_steps(tmp_path, capsys):
    _crash_loop(tmp_path, capsys, trials=3, every_step=False)


@pytest.mark.slow
def test_gc_sigkill_everywhere(tmp_path, capsys):
    _crash_loop(tmp_path, capsys, trials=int(os.environ.get("CKPTSTORE_TRIALS", "40")),
                every_step=True)
