"""A job's own gc and automatic retention on multi-rank job stores (issue 31, part 2).

``JobStore.gc`` on a writer is collective: every rank closes its stream, rank 0 runs the offline
protocol (format-spec/format.md §22.7), every rank starts a new epoch and writes on
(``JobStore._collect_while_writing``). ``set_retention`` / ``retention=`` (and the Checkpointer's
``retention=``) run it after every ``every``-th base. Real 2-rank gloo jobs (tests/_ranks.py):
every kept iteration loads bit-exact on every rank and at world size 1, removed ones are gone,
the job's disk use stays bounded, fsck is clean; a rank SIGKILLed inside the job's gc leaves the
old or the new state, the other rank gets a typed error, and a new job resumes.
"""

from __future__ import annotations

import os

import pytest

import ckptstore
from ckptstore.errors import RetentionError
from ckptstore.ops.retention import KeepBest, KeepEvery, KeepLast
from ckptstore.storage.fileops import FileOps
from ckptstore.multirank.job_gc import job_bytes
from ckptstore.storage.job_log import JobLayout

from _ranks import needs_gloo, run_ranks
from conftest import _same
from test_job_gc import _delta, _pg, check_records, fsck_clean, records
from test_multirank import _ddp_check, ok, rank_state

pytestmark = needs_gloo

MOD = __name__


def _job_bytes(path: str) -> int:
    # (job_bytes skips files that vanish while it walks: rank 0 empties gc-trash/ in a thread)
    return job_bytes(JobLayout(path))


def _write(s, it: int, rank: int, base_every: int, asynchronous: bool) -> None:
    meta = {"loss": 1.0 / (it + 1)}
    if it % base_every == 0:
        if asynchronous:
            s.save_async(it, rank_state(it, rank), meta=meta)
        else:
            s.save(it, rank_state(it, rank), meta=meta)
    elif asynchronous:
        s.save_delta_async(it, _delta(it, rank), meta=meta)
    else:
        s.save_delta(it, _delta(it, rank), meta=meta)


# ---- scenarios (run on every rank) ------------------------------------------------------------
def retained_job(rank, world, path, count, base_every, keep_last, every, asynchronous):
    """Iterations 0..count-1 (a snapshot every ``base_every``, deltas between) with automatic
    retention; the job's size after every base."""
    sizes, runs = [], []
    with ckptstore.open(path, "a", process_group=_pg(), commit_timeout=60.0,
                        retention=KeepLast(keep_last), retention_every=every) as s:
        assert s.retention == KeepLast(keep_last)
        for it in range(count):
            _write(s, it, rank, base_every, asynchronous)
            if it % base_every == base_every - 1:
                s.flush()
                sizes.append(_job_bytes(path))
                run = s.last_retention
                if run is not None and (not runs or runs[-1][0] != run.after):
                    assert run.error is None, run.error
                    runs.append([run.after, run.report.removed])
        epochs = s.epoch
        its = s.iterations()
        from ckptstore.torch.plan_history import job_restarts

        restarts = job_restarts(s.view)[0]
    return {"sizes": sizes, "runs": runs, "iterations": its, "epoch": epochs,
            "restarts": restarts}


def gc_mid_job(rank, world, path, asynchronous):
    """The job's own gc (collective), between saves; then the job writes on."""
    with ckptstore.open(path, "a", process_group=_pg(), commit_timeout=60.0) as s:
        for it in range(12):
            _write(s, it, rank, 4, asynchronous)
        s.flush()  # (a dry run is local: it plans over what is committed)
        dry = s.gc(keep_last=2, dry_run=True)
        rep = s.gc(keep_last=2)
        assert rep.kept == dry.kept and rep.removed == dry.removed, (rep, dry)
        assert s.iterations() == rep.kept
        for it in range(12, 18):
            _write(s, it, rank, 4, asynchronous)
        s.flush()
        # a policy that selects nothing: every rank gets RetentionError, nothing is removed, the
        # job writes on
        errors = []
        try:
            s.gc(policy=KeepBest(1, "no.such.metric"))
        except RetentionError as e:
            errors.append(type(e).__name__)
        _write(s, 18, rank, 4, asynchronous)
        s.flush()
        return {"kept": rep.kept, "removed": rep.removed, "why": {str(k): v for k, v in
                                                                 rep.why.items()},
                "errors": errors, "iterations": s.iterations()}


class _KillAt(FileOps):
    """SIGKILLs this process at the ``nth`` operation of kind ``kind`` once armed."""

    def __init__(self, kind: str, nth: int) -> None:
        self.kind, self.nth, self.seen, self.armed = kind, nth, 0, False

    def _step(self, what: str) -> None:
        if self.armed and what == self.kind:
            self.seen += 1
            if self.seen == self.nth:
                os.kill(os.getpid(), 9)

    def _rename(self, src, dst):
        self._step("rename")
        return super()._rename(src, dst)

    def _fsync_dir(self, fd):
        self._step("fsync_dir")
        return super()._fsync_dir(fd)

    def _unlink(self, path):
        self._step("unlink")
        return super()._unlink(path)


def killed_in_gc(rank, world, path, kind, nth):
    """Rank 0 is SIGKILLed at its ``nth`` ``kind`` operation of the job's gc; rank 1 reports the
    typed error it gets."""
    ops = _KillAt(kind, nth)
    s = ckptstore.open(path, "a", process_group=_pg(), commit_timeout=30.0, file_ops=ops)
    start = s.latest() + 1  # a new epoch's streams begin with a snapshot
    s.save(start, rank_state(start, rank))
    for it in range(start + 1, start + 3):
        s.save_delta(it, _delta(it, rank), meta={"loss": 1.0})
    s.flush()
    ops.armed = rank == 0
    try:
        s.gc(keep_last=2)
    except ckptstore.CkptStoreError as e:
        return {"error": type(e).__name__, "rank_failure": isinstance(e, ckptstore.RankFailureError)}
    return {"error": None}


def resume(rank, world, path):
    with ckptstore.open(path, "a", process_group=_pg(), commit_timeout=60.0) as s:
        it = s.latest() + 1
        s.save(it, rank_state(it, rank))
        return s.iterations()


def checkpointer_job(rank, world, path, iterations, live_dir):
    from test_multirank import ddp_train

    return ddp_train(rank, world, path, iterations, live_dir, base_every=4, group_commit=2,
                     retention=KeepLast(3))


def planned_job(rank, world, path, iterations, live_dir, disk_budget):
    """policy="auto" held to snapshots (every 2 iterations) within ``disk_budget``: the plan's
    retention, the job's collective gc, bounds the job store."""
    from test_auto_policy import hold_planner
    from test_multirank import ddp_train

    hold_planner(lambda: "snapshots")
    return ddp_train(rank, world, path, iterations, live_dir, policy="auto", measure_steps=2,
                     snapshot_every=2, disk_budget=disk_budget)


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("asynchronous", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["sync", "async"])
def test_gc_by_the_job_itself(tmp_path, asynchronous):
    path = str(tmp_path / "job")
    res = ok(run_ranks(2, MOD, "gc_mid_job", path, str(tmp_path / "w"), deadline=180,
                       asynchronous=asynchronous))
    assert res[0] == res[1]
    r0 = res[0]
    assert r0["kept"] == [8, 9, 10, 11] and r0["removed"] == list(range(8))
    assert "chain" in r0["why"]["8"] and "chain" in r0["why"]["9"]
    assert r0["errors"] == ["RetentionError"]
    assert r0["iterations"] == r0["kept"] + list(range(12, 19))
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == r0["iterations"]
        for it in r.iterations():
            for k in range(2):
                want = rank_state(it, k) if r.kind(it) == "snapshot" else _delta(it, k)
                got = r.load(it, rank=k) if r.kind(it) == "snapshot" else r.load_record(it, rank=k)
                _same(want, got, f"iteration {it} rank {k}")
    assert fsck_clean(path)
    # a job at world size 1 resumes from it
    assert ok(run_ranks(1, MOD, "resume", path, str(tmp_path / "w1"), deadline=120))[0][-1] == 19


def test_automatic_retention_bounds_the_job(tmp_path):
    """KeepLast(3) after every base of a 2-rank job with deltas: the store's size levels off,
    the last iterations and what their chains need are kept, everything kept loads."""
    path = str(tmp_path / "job")
    res = ok(run_ranks(2, MOD, "retained_job", path, str(tmp_path / "w"), deadline=240,
                       count=40, base_every=5, keep_last=3, every=1, asynchronous=True))
    r0 = res[0]
    assert res[1]["runs"] == r0["runs"] and res[1]["iterations"] == r0["iterations"]
    assert len(r0["runs"]) >= 6 and all(removed for _, removed in r0["runs"][1:])
    assert r0["iterations"][-1] == 39 and len(r0["iterations"]) <= 10, r0["iterations"]
    assert r0["epoch"] > 10 and r0["restarts"] == 0  # the gcs' epochs are no failures
    sizes = r0["sizes"]
    assert max(sizes[len(sizes) // 2:]) <= 1.5 * max(sizes[:len(sizes) // 2]), sizes
    ref = {it: [rank_state(it, k) if it % 5 == 0 else _delta(it, k) for k in range(2)]
           for it in r0["iterations"]}
    check_records(path, ref, r0["iterations"])
    layout = JobLayout(path)
    assert len(layout.list_epochs()) <= 3, layout.list_epochs()
    assert fsck_clean(path)


def test_checkpointer_retention_on_a_job(tmp_path):
    """The Checkpointer's ``retention=`` on a 2-rank DDP job: bounded, and every kept iteration
    (replayed per rank, parts merged) equals the live state."""
    path, live = str(tmp_path / "job"), str(tmp_path / "live")
    os.makedirs(live)
    ok(run_ranks(2, MOD, "checkpointer_job", path, str(tmp_path / "w"), deadline=240,
                 iterations=22, live_dir=live))
    with ckptstore.open(path, "r") as r:
        its = r.iterations()
    assert its[-1] == 22 and 1 not in its and len(its) < 15, its
    _ddp_check(path, live, its)
    assert fsck_clean(path)


def _kill_trial(tmp_path, kind: str, nth: int) -> tuple:
    path = str(tmp_path / f"job-{kind}-{nth}")
    ok(run_ranks(2, "test_job_gc", "save_chains", path, str(tmp_path / "w0"), deadline=180,
                 start=0, count=10, base_every=4))
    ref = records(path)
    res = run_ranks(2, MOD, "killed_in_gc", path, str(tmp_path / "w1"), deadline=120,
                    kind=kind, nth=nth)
    assert res[0] == {"died": -9}, res
    assert res[1]["ok"]["rank_failure"], res  # a typed error naming the dead rank, not a hang
    with ckptstore.open(path, "r") as r:
        shown = r.iterations()
    old, new = list(range(13)), [10, 11, 12]
    assert shown in (old, new), shown
    ref[10] = [rank_state(10, k) for k in range(2)]
    ref.update({it: [_delta(it, k) for k in range(2)] for it in (11, 12)})
    check_records(path, ref, shown)
    assert fsck_clean(path)
    assert ok(run_ranks(2, MOD, "resume", path, str(tmp_path / "w2"), deadline=120))[0][-1] == 13
    with ckptstore.open(path, "r") as r:  # the next gc finishes the work, no leftovers
        r.gc(keep_last=1)
    layout = JobLayout(path)
    assert not os.path.exists(layout.gc_trash_dir) and len(layout.list_epochs()) == 1
    assert fsck_clean(path)
    return tuple(shown)


# Rank 0's file operations in the job's gc of _kill_trial's store, in order (recorded once; the
# data is the same every run): fsync_dir 1 = the epoch's claim; renames 1-8 build the two new
# streams (4 and 8 rename them into place); rename 9 = global/G.log.gc-tmp -> G.log and
# fsync_dir 17 of global/ = the commit point; renames 10-13 move the old streams to gc-trash/,
# unlinks 3-4 delete the old logs; then the job's new epoch.
def test_rank_killed_in_the_jobs_gc(tmp_path):
    """SIGKILL of rank 0 just before the gc's commit point (the rename of its global log)."""
    assert _kill_trial(tmp_path, "rename", 9) == tuple(range(13))


@pytest.mark.slow
@pytest.mark.parametrize("kind,nth,new", [("rename", 4, False), ("fsync_dir", 17, True),
                                          ("unlink", 3, True)],
                         ids=["new-stream-renamed", "at-the-commit-fsync", "deleting-old-logs"])
def test_rank_killed_in_the_jobs_gc_elsewhere(tmp_path, kind, nth, new):
    """Rank 0 SIGKILLed at other steps of the job's gc: renaming the first new stream into place
    (before the commit point: the old set), the fsync of global/ that makes the commit durable
    (the rename is visible: the new set), deleting the old logs (after it). Every step of the
    protocol itself is swept on a forked offline gc (tests/test_job_gc.py,
    test_gc_sigkill_everywhere)."""
    assert _kill_trial(tmp_path, kind, nth) == ((10, 11, 12) if new else tuple(range(13)))


def test_restarts_learned_from_the_logs_skip_the_gcs_epochs():
    """The Checkpointer's learned failure rate counts job opens, not the epochs of gc."""
    from types import SimpleNamespace as NS

    from ckptstore.torch.plan_history import job_restarts

    def scan(epoch_ns, *commit_ns):
        return NS(epoch=NS(created_ns=epoch_ns), commits=[(NS(created_ns=c), 0) for c in commit_ns])

    def view(chain, logs):
        commits = {i: c for i, (c, _) in enumerate(
            x for e in chain for x in logs[e].commits)}
        return NS(chain=chain, logs=logs, commits=commits)

    plain = {1: scan(10, 11, 12), 2: scan(20, 21), 3: scan(30)}
    assert job_restarts(view([1, 2, 3], plain)) == (2, 11)
    gc = {5: scan(50, 11, 21), 6: scan(51, 52), 7: scan(60, 61), 8: scan(70)}
    assert job_restarts(view([5, 6, 7, 8], gc)) == (2, 50)
    assert job_restarts(view([5, 6], gc)) == (0, 50)
    assert job_restarts(view([], {})) == (0, 0)


def test_the_plans_retention_bounds_a_job(tmp_path):
    """policy="auto" on a 2-rank DDP job with a small disk budget: every rank sets the same
    retention from the agreed plan, the job's gc runs on both together, the job store keeps a
    few snapshots of the many it wrote, and every kept iteration equals the live state."""
    path, live = str(tmp_path / "job"), str(tmp_path / "live")
    os.makedirs(live)
    res = ok(run_ranks(2, MOD, "planned_job", path, str(tmp_path / "w"), deadline=240,
                       iterations=40, live_dir=live, disk_budget=400_000))
    assert res[0]["mode"] == "snapshots" and res[0]["retention"] == res[1]["retention"], res
    assert res[0]["retention"].startswith("KeepLast("), res
    with ckptstore.open(path, "r") as r:
        its = r.iterations()
        snapshots = [i for i in its if r.kind(i) == "snapshot"]
    # 21 snapshots written (0, 2, ..., 40: the fixed interval's snapshots are the measuring
    # phase's windows, no delta is measured: the planner is held to snapshots); the plan's
    # retention R (how many fit the budget: 3 with today's snapshot sizes) keeps the newest
    # K = max(1, R // 4) after every max(1, floor(0.8 R) - K)-th base: a handful at a time
    assert snapshots == its and its[-1] == 40 and len(its) <= 5, its
    # the checkpoints (the streams' segments) stay within the budget; the indexes (LMDB pages,
    # ~60-80 kB a stream) and global logs are outside the plan's byte count, which a 20% margin
    # covers for checkpoints of megabytes, not for this model's ~30 kB parts
    segments = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path)
                   for f in fs if f.endswith(".seg"))
    assert segments <= 400_000, segments
    _ddp_check(path, live, [i for i in its if i > 0])
    assert fsck_clean(path)
