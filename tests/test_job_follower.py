"""The shadow follower of a multi-rank job store (ckptstore/follow.py,
ckptstore/multirank/job_follower.py, format-spec/follower.md §7).

One job is trained once per module by real 2-rank gloo ranks (tests/_ranks.py): DDP, a
Checkpointer with base_every=None and a delta every iteration (partitioned parts), while a
Follower in this process follows it live (a thread) and writes a base every K iterations. The
slow tests also resume a copy with a second job (a new epoch: its first checkpoint is a
snapshot), followed live too. The reference is a copy of a job without its follower store:
every load with the follower must equal a load without it, bit for bit, at 1 rank (a reader),
at 2 ranks (readers with a group: each rank's own RNG) and, slow, restores at 1 and 4 ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import warnings

import pytest
import torch
import xxhash

import ckptstore
from ckptstore.cli import main
from ckptstore.errors import FollowerError, FollowerMismatchError, FollowerWarning
from ckptstore.follow import Follower, follower_path
from ckptstore.multirank.job_follower import job_digest

from _crashkit import KillOps, run_forked
from _ranks import needs_gloo, run_ranks
from conftest import _same
from test_follower import _flip_chunk_byte
from test_multirank import _ddp_model, ok

pytestmark = needs_gloo

MOD = __name__
K = 4            # follower base interval
FIRST = 13       # the first job trains 1..FIRST; the second resumes and trains SECOND more
SECOND = 5
LAST = FIRST + SECOND


# ---- scenarios (run on every rank) ------------------------------------------------------------
def train(rank, world, path, iterations):
    """DDP with a Checkpointer (base_every=None, a delta every iteration, fingerprints every K):
    restore (or start), then train ``iterations`` steps."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptstore.torch import Checkpointer

    model, opt, sched = _ddp_model()
    ddp = DDP(model)
    with ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60.0) as store:
        ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=None,
                          fingerprint_every=K, asynchronous=False)
        start = ck.restore()
        torch.manual_seed(100 + rank + start)  # per-rank RNG states differ (dropout-like use)
        for it in range(start + 1, start + iterations + 1):
            g = torch.Generator().manual_seed(1000 * rank + it)
            x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            torch.rand(3)  # advances this rank's RNG
            ck.step(it)
            opt.zero_grad()
        ck.close()
    del ddp
    return start


def loads_with_a_group(rank, world, path, ref, its):
    """Readers with a group: this rank's merged load (its own RNG and scheduler) and its own
    part (what a parallel restore loads), with the follower (no FollowerWarning) and without
    (the reference copy), bit for bit; where the loads started."""
    import torch.distributed as dist

    starts = []
    with ckptstore.open(path, "r", process_group=dist.group.WORLD) as js, \
            ckptstore.open(ref, "r", process_group=dist.group.WORLD) as rs:
        for t in its:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FollowerWarning)
                got, own = js.load(t), js.load(t, rank=rank)
            _same(rs.load(t), got, f"rank {rank}: load({t})")
            _same(rs.load(t, rank=rank), own, f"rank {rank}: load({t}, rank={rank})")
            starts.append(list(js.load_base(t)))
    return starts


def own_gc_on_follower_bases(rank, world, path):
    """The job's own gc (collective, on a writer), rebasing on its follower's bases: its dry run
    (each rank, local) and the gc; what each rank's reports say and the job then holds."""
    import torch.distributed as dist

    with ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60.0) as s:
        dry = s.gc(keep_last=2, follower_bases=True, dry_run=True)
        rep = s.gc(keep_last=2, follower_bases=True)
        return [list(dry.rebased), list(rep.rebased), rep.kept, rep.removed, s.iterations(),
                s.kind(2 * K)]


# ---- the module's job ---------------------------------------------------------------------------
def _follow_live(path, until, box):
    """A follower (this process, a thread) of the job at ``path`` while it trains."""
    try:
        t0 = time.monotonic()
        while not os.path.exists(os.path.join(path, "STORE")):
            assert time.monotonic() - t0 < 120, "the job store never appeared"
            time.sleep(0.02)
        with Follower(path, every=K, poll_s=0.02, wait=True) as f:
            box["follower"] = f
            f.run(until=until, timeout=240)
            box["stats"] = f.stats
    except BaseException as e:  # noqa: BLE001 - reported by the fixture
        box["error"] = e


def _train_followed(path, work, iterations, until, start):
    """Train ``iterations`` steps of the job at ``path`` (2 ranks) while a follower thread
    follows it until ``until``; the follower's stats."""
    box: dict = {}
    thread = threading.Thread(target=_follow_live, args=(path, until, box), daemon=True)
    thread.start()
    try:
        assert ok(run_ranks(2, MOD, "train", path, work, iterations=iterations)) == [start] * 2
    finally:
        thread.join(240)
        if thread.is_alive() and "follower" in box:  # (never hide a hang: stop it, then fail)
            box["follower"].stop()
            thread.join(30)
    assert not thread.is_alive(), "the follower did not stop"
    assert "error" not in box, box.get("error")
    return box["stats"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job (FIRST iterations) followed live; ``ref``, a copy without its follower store."""
    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("jobfollow")
    path, ref = str(base / "job"), str(base / "ref")
    t0 = time.perf_counter()
    stats = _train_followed(path, str(base / "w"), FIRST, FIRST, 0)
    print(f"a 2-rank job followed live in {time.perf_counter() - t0:.2f} s: {stats}")
    _copy_job(path, ref, follower=False)
    return {"path": path, "ref": ref, "stats": stats}


@pytest.fixture(scope="module")
def resumed(job, tmp_path_factory):
    """A copy of the job (its follower store included) resumed by a second job for SECOND more
    iterations (a new epoch: its first checkpoint is a snapshot), followed live by a new
    follower (it resumes from the first one's newest base); ``ref``, a copy without the
    follower store."""
    base = tmp_path_factory.mktemp("jobresumed")
    path, ref = _copy_job(job["path"], str(base / "job")), str(base / "ref")
    stats = _train_followed(path, str(base / "w"), SECOND, LAST, FIRST)
    _copy_job(path, ref, follower=False)
    return {"path": path, "ref": ref, "stats": stats}


def _copy_job(src, dst, follower=True) -> str:
    shutil.copytree(src, dst, ignore=None if follower else
                    (lambda d, names: ["follower"] if d == src else []))
    return dst


def _copy(job, tmp_path, follower=True) -> str:
    return _copy_job(job["path"], str(tmp_path / "job"), follower)


def jd(reader, it) -> str:
    """The job digest of ``it`` (format-spec/follower.md §7), from each rank's stream."""
    return xxhash.xxh3_128_hexdigest(b"".join(bytes.fromhex(reader.info(it, rank=k).manifest_digest)
                                              for k in range(reader.global_commit(it).world_size)))


# ---- tests --------------------------------------------------------------------------------------
def test_job_digest_vectors():
    """format-spec/follower.md §7's vectors."""
    from ckptstore.format.commit import Commit
    from ckptstore.format.job import GlobalCommit, RankCommit

    def g(*digests):
        return GlobalCommit(5, 1, 1, tuple(RankCommit(1, 0, Commit(5, 1, 0, 10, d, bytes(16), 0,
                                                                     0, 0, 1)) for d in digests))

    a, b = bytes(range(16)), bytes(range(16, 32))
    assert job_digest(g(a, b)) == "25e7c9b3424ceed2457d9566b6fcd697"
    assert job_digest(g(a)) == "72950631827607e2842812cc870dcae2"


def _check_bases(path, ref, want):
    """The follower store of ``path`` holds bases ``want``, each holding both ranks' parts,
    equal to each rank's replayed part, named by the job digest."""
    with ckptstore.open(ref, "r") as r, ckptstore.open(follower_path(path), "r") as f:
        assert f.iterations() == want
        sid = r.header.store_id.hex()
        for b in want:
            base = r.base_of(b)
            assert f.meta(b)["ckptstore.follower"] == {
                "v": 1, "primary": sid, "iteration": b, "digest": jd(r, b), "base": base,
                "base_digest": jd(r, base)}
            state = f.load(b)
            assert sorted(state) == ["rank0", "rank1"]
            for k in (0, 1):
                _same(r.load(b, rank=k), state[f"rank{k}"], f"base {b} rank {k}")


def _check_reader_loads(path, ref, its):
    """A reader without a group: merged loads and every rank's part start from the newest
    follower base of their chain and equal the loads without a follower."""
    with ckptstore.open(path, "r") as js, ckptstore.open(ref, "r") as rs:
        for t in its:
            b = t // K * K
            want = ("follower", b) if rs.kind(t) == "delta" and b > rs.base_of(t) else \
                ("primary", rs.base_of(t))
            assert js.load_base(t) == want, t
            assert rs.load_base(t) == ("primary", rs.base_of(t))
            with warnings.catch_warnings():
                warnings.simplefilter("error", FollowerWarning)
                _same(rs.load(t), js.load(t), f"load({t})")
                for r in (0, 1):
                    _same(rs.load(t, rank=r), js.load(t, rank=r), f"load({t}, rank={r})")


def test_the_follower_writes_every_ranks_part(job):
    """base_every=None: the job's only base is 0; the follower wrote bases at K, 2K, 3K."""
    with ckptstore.open(job["ref"], "r") as r:
        assert [i for i in r.iterations() if r.kind(i) == "snapshot"] == [0]
    assert job["stats"].bases == [K, 2 * K, 3 * K]
    assert job["stats"].started_from == ("primary", 0)
    _check_bases(job["path"], job["ref"], [K, 2 * K, 3 * K])


def test_reader_loads_start_from_follower_bases(job):
    _check_reader_loads(job["path"], job["ref"], (K + 1, 2 * K + 3, FIRST))


def test_loads_with_a_group_at_2_ranks(job, tmp_path):
    its = [2 * K + 1, FIRST]
    res = ok(run_ranks(2, MOD, "loads_with_a_group", job["path"], str(tmp_path / "w"),
                       ref=job["ref"], its=its))
    assert res[0] == res[1] == [["follower", t // K * K] for t in its]


@pytest.mark.slow
def test_a_resumed_job_is_followed_into_its_new_epoch(resumed):
    """A second job's first checkpoint is a snapshot (its new epoch): the new follower (which
    accepted the first one's store) restarted its replica at that snapshot (a chain restart)
    and wrote the new chain's bases; loads in both chains start from them."""
    with ckptstore.open(resumed["ref"], "r") as r:
        assert [i for i in r.iterations() if r.kind(i) == "snapshot"] == [0, FIRST + 1]
    assert resumed["stats"].bases == [4 * K]
    assert resumed["stats"].started_from == ("primary", FIRST + 1)
    _check_bases(resumed["path"], resumed["ref"], [K, 2 * K, 3 * K, 4 * K])
    _check_reader_loads(resumed["path"], resumed["ref"], (FIRST, FIRST + 1, LAST))


def test_a_damaged_part_falls_back_for_its_rank(job, tmp_path):
    """A corrupted chunk in rank 1's part of a follower base: rank 1's part loads from the
    older base (FollowerWarning naming the base and the part), rank 0's from the damaged base's
    intact part; the merged load is exact."""
    path = _copy(job, tmp_path)
    b = 3 * K
    with ckptstore.open(follower_path(path), "r") as f:
        tensor = next(t.path for t in f.manifest(b).tensors
                      if t.path.startswith("rank1/model/") and t.inline is None)
    _flip_chunk_byte(follower_path(path), b, tensor)
    with ckptstore.open(path, "r") as js, ckptstore.open(job["ref"], "r") as rs:
        with pytest.warns(FollowerWarning, match=rf"base {b} \(rank1\) is not used"):
            got = js.load(b + 1)
        _same(rs.load(b + 1), got, "merged load past a damaged part")
        with warnings.catch_warnings():
            warnings.simplefilter("error", FollowerWarning)  # warned once per base and part
            _same(rs.load(b, rank=1), js.load(b, rank=1), "rank 1's part again")
            _same(rs.load(b, rank=0), js.load(b, rank=0), "rank 0's part")


def _rewrite_follower(path, change):
    """Rewrite the follower store with ``change(b, meta)`` applied to each base's identity."""
    fp = follower_path(path)
    with ckptstore.open(fp, "r") as f:
        bases = {b: (f.load(b), f.meta(b)) for b in f.iterations()}
    shutil.rmtree(fp)
    with ckptstore.open(fp) as f:
        for b, (state, meta) in bases.items():
            change(b, meta["ckptstore.follower"])
            f.save(b, state, meta=meta)


@pytest.mark.parametrize("other", ["job", "history"])
def test_a_follower_store_of_another_job_or_history(job, tmp_path, other):
    """Follower bases naming another job store (its store id) or another history of this one
    (another job digest at that iteration): readers skip them (warned) and load exactly from
    the job's own bases; a Follower refuses the store (FollowerMismatchError, nothing
    written)."""
    path = _copy(job, tmp_path)

    def change(b, ident):
        if other == "job":
            ident["primary"] = "0" * 32
        elif b == 2 * K:
            ident["digest"] = "f" * 32

    _rewrite_follower(path, change)
    with ckptstore.open(follower_path(path), "r") as f:
        before = f.iterations()
    with ckptstore.open(path, "r") as js, ckptstore.open(job["ref"], "r") as rs:
        with pytest.warns(FollowerWarning, match="another primary" if other == "job" else
                          "another manifest digest") as w:
            got = js.load(2 * K + 1)
        assert len(w) == 1
        _same(rs.load(2 * K + 1), got, "load past a foreign base")
        assert js.load_base(2 * K + 1) == (("primary", 0) if other == "job" else ("follower", K))
    with pytest.raises(FollowerMismatchError,
                       match="another primary" if other == "job" else "another manifest digest"):
        Follower(path, every=K)
    with ckptstore.open(follower_path(path), "r") as f:
        assert f.iterations() == before


@pytest.mark.slow
def test_job_gc_then_the_follower_starts_again(job, resumed, tmp_path, capsys):
    """A follower at iteration 2K+2 of the first job's chain while the second job writes its
    own (its files copied in: what the job wrote while the follower lagged); a gc of the job
    store removes the first chain: the follower starts again from the second job's base and
    follows it; loads stay exact, the follower's bases of removed iterations are harmless (a
    new follower accepts its store), and fsck finds the job store and the follower store
    clean."""
    path = _copy(job, tmp_path, follower=False)
    with Follower(path, every=K) as f:
        assert f.step_once(max_deltas=2 * K + 2) > 0 and f.iteration == 2 * K + 2
        f.flush()
        assert f.stats.bases == [K, 2 * K]
        for part in ("global", "streams"):  # the second job's epoch (nothing else changed)
            new = resumed["ref"]
            for name in sorted(os.listdir(os.path.join(new, part))):
                src, dst = os.path.join(new, part, name), os.path.join(path, part, name)
                if not os.path.exists(dst):
                    (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, dst)
        with ckptstore.open(path, "r") as js:
            assert js.latest() == LAST
            rep = js.gc(keep_last=1)
        assert rep.removed == list(range(FIRST + 1)), rep.removed
        f.run(until=LAST, timeout=60)
        assert f.stats.started_from == ("primary", FIRST + 1)
        assert f.stats.bases == [K, 2 * K, 4 * K]
    with Follower(path, every=K) as f:  # its bases of removed iterations: no mismatch
        f.step_once()
        assert f.iteration == LAST and f.stats.started_from == ("follower", 4 * K)
    with ckptstore.open(path, "r") as js, ckptstore.open(resumed["ref"], "r") as rs:
        assert js.load_base(LAST) == ("follower", 4 * K)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FollowerWarning)
            for t in (4 * K, LAST):
                _same(rs.load(t), js.load(t), f"load({t}) after gc")
    assert main(["fsck", path]) == 0 and main(["fsck", follower_path(path)]) == 0  # both clean
    capsys.readouterr()


def test_cli_follows_a_job(job, tmp_path, capsys):
    path = _copy(job, tmp_path, follower=False)
    assert main(["follow", path, "--every", str(K), "--until-iteration", str(FIRST),
                 "--poll", "0.02"]) == 0
    assert f"followed to iteration {FIRST} (primary at {FIRST})" in capsys.readouterr().out
    with ckptstore.open(follower_path(path), "r") as f:
        assert f.iterations() == [K, 2 * K, 3 * K]


def test_bad_input(job, tmp_path):
    """A job store not written by a Checkpointer: a typed error naming it and the iteration;
    a stream of a job store: JobStreamError (the follower store would lie inside the job)."""
    from ckptstore.errors import JobStreamError
    from ckptstore.storage.job_log import JobLayout

    with pytest.raises(JobStreamError):
        Follower(JobLayout(job["ref"]).stream_dir(1, 0), every=K)
    plain = str(tmp_path / "plain")
    ok(run_ranks(1, "test_job_gc", "save_chains", plain, str(tmp_path / "w"), start=0, count=2,
                 base_every=4))
    with Follower(plain, every=K) as f:
        with pytest.raises(FollowerError, match=r"plain: base snapshot 0 .*not a Checkpointer"):
            f.step_once()


# ---- SIGKILL while the follower writes its bases ---------------------------------------------
def _follow_with(path, ops, until):
    with Follower(path, every=K, file_ops=ops) as f:
        ops.armed = True
        f.run(until=until, timeout=120)


def _count_ops(path, until, out):
    class Counting(KillOps):
        def _due(self, op):
            if self.armed:
                self.counts[op] = self.counts.get(op, 0) + 1
            return False

    ops = Counting(None, 0, armed=False)
    ops.counts = {}
    _follow_with(path, ops, until)
    with open(out, "w") as fh:
        json.dump(ops.counts, fh)


def _kill_plans(counts, sweep):
    """(target, nth, tear, after): with ``sweep``, torn writes at 8 points spread over the run
    (the follower store's own crash safety is the store's, tested at every write by
    test_crash.py) and every fsync, killed before and after it completes; else one torn write in
    the middle of the run."""
    n = counts["write"]
    if sweep:
        writes = sorted({1 + i * (n - 1) // 7 for i in range(8)})
        return [("write", w, 0.5, False) for w in writes] + \
            [("fsync", f, 0.0, after) for f in range(1, counts["fsync"] + 1)
             for after in (False, True)]
    return [("write", n // 2 + 1, 0.5, False)]


def _killed_then_resumed(job, tmp_path, sweep):
    """A follower of the first job (bases K, 2K, 3K) SIGKILLed at a write or fsync of its store;
    whatever bases survived are whole (they load), the next follower resumes from the newest and
    writes the rest, and the job's loads are exact."""
    path = _copy(job, tmp_path, follower=False)
    until = FIRST
    pristine = str(tmp_path / "pristine")
    shutil.copytree(path, pristine)
    counts_file = str(tmp_path / "counts.json")
    assert run_forked(_count_ops, path, until, counts_file) == 0
    with open(counts_file) as fh:
        counts = json.load(fh)
    assert counts.get("write", 0) >= 2 and counts.get("fsync", 0) >= 2, counts
    with ckptstore.open(job["ref"], "r") as rs:
        want = {b: rs.load(b) for b in (K, 2 * K)} | {FIRST: rs.load(FIRST)}
    for target, nth, tear, after in _kill_plans(counts, sweep):
        shutil.rmtree(path)
        shutil.copytree(pristine, path)
        what = f"SIGKILL at {target} {nth} (tear {tear}, after {after})"
        assert run_forked(_follow_with, path, KillOps(target, nth, tear, after, armed=False),
                          until) == -9, what
        survived = []
        if os.path.isfile(os.path.join(follower_path(path), "STORE")):
            with ckptstore.open(follower_path(path), "r") as f:
                survived = f.iterations()
        assert set(survived) <= {K, 2 * K, 3 * K}, (what, survived)
        with Follower(path, every=K) as f:  # resumes from what survived
            f.run(until=FIRST, timeout=60)
            assert f.stats.started_from == (("follower", survived[-1]) if survived
                                            else ("primary", 0)), what
        with ckptstore.open(path, "r") as js:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FollowerWarning)
                for t in want:
                    _same(want[t], js.load(t), f"{what}: load({t})")
            assert js.load_base(FIRST) == ("follower", 3 * K), what


def test_a_follower_killed_while_writing_a_base_resumes(job, tmp_path):
    _killed_then_resumed(job, tmp_path, sweep=False)


@pytest.mark.slow
def test_a_follower_killed_at_every_write_and_fsync_resumes(job, tmp_path):
    _killed_then_resumed(job, tmp_path, sweep=True)


# ---- elastic: one follower base serves restores at every world size ---------------------------
def restore_at(rank, world, path, out, t, tag):
    """A new job at this world size restores iteration t through its Checkpointer (a parallel
    restore at the saving world size, a merged load otherwise) and saves what it got."""
    import torch.distributed as dist

    from ckptstore.torch import Checkpointer

    model, opt, sched = _ddp_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FollowerWarning)
        with ckptstore.open(path, "a", process_group=dist.group.WORLD,
                            commit_timeout=60.0) as store:
            ck = Checkpointer(store, model, opt, sched, policy="every-iteration",
                              base_every=None, asynchronous=False)
            assert ck.restore(t) == t
            where = store.load_base(t)
            ck.close()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "rng": torch.get_rng_state()},
               os.path.join(out, f"{tag}-{world}-{rank}.pt"))
    return list(where)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])  # (2: the default group loads, each rank its own part)
def test_restores_at_every_world_size_start_from_the_follower(job, tmp_path, world):
    t = FIRST
    out = str(tmp_path / "out")
    os.makedirs(out)
    path, ref = _copy(job, tmp_path), str(tmp_path / "ref")
    shutil.copytree(job["ref"], ref)
    assert ok(run_ranks(world, MOD, "restore_at", path, str(tmp_path / "w1"), out=out, t=t,
                        tag="follower")) == [["follower", t // K * K]] * world
    assert ok(run_ranks(world, MOD, "restore_at", ref, str(tmp_path / "w2"), out=out, t=t,
                        tag="ref")) == [["primary", 0]] * world
    for r in range(world):
        _same(torch.load(os.path.join(out, f"ref-{world}-{r}.pt")),
              torch.load(os.path.join(out, f"follower-{world}-{r}.pt")), f"rank {r} of {world}")


# ---- gc rebasing on the job's follower bases (format-spec/follower.md §6-7) -------------------
# The job's fingerprints are every K, like its follower bases: base 4K - K = 12 cannot be verified
# (no fingerprinted delta after it yet), base 8 can (replayed to 12 on every rank).
REBASE = 2 * K


def _loads_exact(path, ref, its, what):
    """Every iteration of ``its`` loads as in ``ref`` (a copy of the job without follower store
    or gc), merged and every rank's part, with no FollowerWarning."""
    with ckptstore.open(path, "r") as js, ckptstore.open(ref, "r") as rs, \
            warnings.catch_warnings():
        warnings.simplefilter("error", FollowerWarning)
        for t in its:
            _same(rs.load(t), js.load(t), f"{what}: load({t})")
            for r in (0, 1):
                _same(rs.load(t, rank=r), js.load(t, rank=r), f"{what}: load({t}, rank={r})")


def test_gc_rebases_the_job_on_a_verified_follower_base(job, tmp_path, capsys):
    """``gc --follower-bases`` of a job store: the dry run explains and writes nothing; the gc
    makes delta 8 a snapshot on every rank (each rank's part of follower base 8, verified),
    drops 0..7, keeps 8..13 loadable bit for bit (with and without the follower store), fsck
    is clean, and the follower's bases keep matching (the job's loads and a new follower start
    from base 12)."""
    from ckptstore.errors import NotFoundError
    from test_job_gc import tree

    path = _copy(job, tmp_path)
    before = tree(path)
    assert main(["gc", path, "--keep-last", "2", "--follower-bases", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove {REBASE} of {FIRST + 1} iterations" in out, out
    assert f"would replace delta {REBASE} by a snapshot made from a verified follower" in out, out
    assert f"follower base {3 * K} not used: its part rank0: no delta after {3 * K} records a " \
        "fingerprint" in out, out
    assert tree(path) == before
    with ckptstore.open(follower_path(path), "r") as f:
        follower_id = f.header.store_id.hex()
    with ckptstore.open(path, "r") as js:
        digest, origin = jd(js, REBASE), jd(js, 0)
        metas = [js.meta(REBASE, rank=r) for r in (0, 1)]
        rep = js.gc(keep_last=2, follower_bases=True)
        assert rep.rebased == (REBASE,) and rep.kept == list(range(REBASE, FIRST + 1)), rep
        assert rep.removed == list(range(REBASE)) and rep.bytes_after < rep.bytes_before, rep
        assert f"no delta after {3 * K}" in dict(rep.rebase_skipped)[3 * K], rep
        print(f"job gc with follower bases: {rep.bytes_before} -> {rep.bytes_after} bytes")
        assert js.kind(REBASE) == "snapshot" and js.base_of(FIRST) == REBASE
        for r in (0, 1):
            assert js.kind(REBASE) == js.stream(REBASE, rank=r).kind(REBASE) == "snapshot"
            assert js.meta(REBASE, rank=r) == metas[r]  # the delta's meta, on every rank
            assert js.manifest(REBASE, rank=r).extra["rebased"] == {
                "v": 1, "digest": digest, "base": 0, "base_digest": origin,
                "follower": follower_id}
        with pytest.raises(NotFoundError, match="follower bases dropped it"):
            js.load(REBASE - 3)
        assert js.load_base(FIRST) == ("follower", 3 * K)
    _loads_exact(path, job["ref"], range(REBASE, FIRST + 1), "after gc")
    assert main(["fsck", path]) == 0
    with Follower(path, every=K) as f:  # no FollowerMismatchError: its bases still match
        f.step_once()
        assert f.iteration == FIRST and f.stats.started_from == ("follower", 3 * K)
    shutil.rmtree(follower_path(path))  # the job needs nothing of it
    _loads_exact(path, job["ref"], (REBASE, REBASE + 1, FIRST), "without the follower store")
    capsys.readouterr()


@pytest.mark.parametrize("damage", ["chunk", pytest.param("history", marks=pytest.mark.slow)])
def test_a_job_follower_base_that_does_not_verify_is_not_used(job, tmp_path, capsys, damage):
    """Follower base 8 with a corrupted chunk in a rank's part, or naming another history of
    iteration 8: the dry run and the gc (``ckptstore gc JOB --follower-bases``) say why it is not
    used and rebase on base 4 instead (verified by replaying 5..8 on every rank); every kept
    iteration loads bit for bit."""
    path = _copy(job, tmp_path)
    if damage == "chunk":
        with ckptstore.open(follower_path(path), "r") as f:
            tensor = next(t.path for t in f.manifest(REBASE).tensors
                          if t.path.startswith("rank1/optimizer/") and t.inline is None)
        _flip_chunk_byte(follower_path(path), REBASE, tensor)
    else:
        _rewrite_follower(path, lambda b, ident: ident.update(digest="f" * 32) if b == REBASE
                          else None)
    with ckptstore.open(path, "r") as js, warnings.catch_warnings():
        warnings.simplefilter("ignore", FollowerWarning)
        dry = js.gc(keep_last=2, follower_bases=True, dry_run=True)
    assert (dry.rebased, dry.kept) == ((K,), list(range(K, FIRST + 1))), dry
    why = dict(dry.rebase_skipped)[REBASE]
    assert ("its part rank" in why) if damage == "chunk" else ("another manifest digest" in why)
    with warnings.catch_warnings():  # the gc itself, through the CLI
        warnings.simplefilter("ignore", FollowerWarning)
        assert main(["gc", path, "--keep-last", "2", "--follower-bases"]) == 0
    out = capsys.readouterr().out
    assert f"replace delta {K} by a snapshot made from a verified follower base" in out, out
    assert f"follower base {REBASE} not used: {why}" in out, out
    with ckptstore.open(path, "r") as js:
        assert js.iterations() == dry.kept and js.kind(K) == "snapshot"
    shutil.rmtree(follower_path(path))
    _loads_exact(path, job["ref"], range(K, FIRST + 1), damage)


@pytest.mark.slow
def test_a_writing_jobs_own_gc_rebases_on_every_rank(job, tmp_path, capsys):
    """gc(follower_bases=True) on a 2-rank writer (collective): rank 0 plans and verifies, every
    rank gets the same report; the job then holds 8..13, 8 a snapshot, bit for bit."""
    path = _copy(job, tmp_path)
    res = ok(run_ranks(2, MOD, "own_gc_on_follower_bases", path, str(tmp_path / "w")))
    want = [[REBASE], [REBASE], list(range(REBASE, FIRST + 1)), list(range(REBASE)),
            list(range(REBASE, FIRST + 1)), "snapshot"]
    assert res == [want, want], res
    _loads_exact(path, job["ref"], range(REBASE, FIRST + 1), "after the job's own gc")
    assert main(["fsck", path]) == 0
    capsys.readouterr()


def _rebase_kill_sweep(job, tmp_path, capsys, every_step):
    """The rebasing gc of the job (keep the last 2: rebased at 8) SIGKILLed (``every_step``: at
    many of its renames, unlinks and directory fsyncs, and at random writes and fsyncs): the store
    shows the old or the new iterations, every kept one loads bit for bit, fsck is clean, and
    the next gc finishes (8..13, 8 a snapshot on every rank)."""
    from ckptstore.ops.retention import KeepLast
    from test_job_gc import _crash_points, _forked_gc

    base, policy = _copy(job, tmp_path), KeepLast(2)
    probe, log_file = str(tmp_path / "probe"), str(tmp_path / "ops.txt")
    shutil.copytree(base, probe)
    assert _forked_gc(probe, policy, 0, log_file, follower_bases=True) == 0
    ops = open(log_file).read().split("\n")
    old, new = list(range(FIRST + 1)), list(range(REBASE, FIRST + 1))
    with ckptstore.open(probe, "r") as r:
        assert r.iterations() == new and r.kind(REBASE) == "snapshot"
    steps = _crash_points(ops, 0, 0)  # every rename, unlink and directory fsync (33 here)
    # default: the first step (a rank's stream renamed into place: before the commit point) and
    # the last (deleting the old epochs: after it); slow: every 3rd step, the last 6 (the commit
    # point and after) and 4 random writes or fsyncs
    others = set(_crash_points(ops, 4, 5)) - set(steps)
    points = sorted(set(steps[::3]) | set(steps[-6:]) | others) if every_step else \
        [steps[0], steps[-1]]
    seen = set()
    for kill in points:
        trial = str(tmp_path / "trial")
        shutil.rmtree(trial, ignore_errors=True)
        shutil.copytree(base, trial)
        what = f"SIGKILL at operation {kill} ({ops[kill - 1]})"
        assert os.WIFSIGNALED(_forked_gc(trial, policy, kill, follower_bases=True)), what
        with ckptstore.open(trial, "r") as r:
            shown = r.iterations()
        assert shown in (old, new), (what, shown)
        seen.add(tuple(shown))
        _loads_exact(trial, job["ref"], (REBASE, REBASE + 2, FIRST), what)
        assert main(["fsck", trial]) == 0, what
        assert _forked_gc(trial, policy, 0, follower_bases=True) == 0, what
        with ckptstore.open(trial, "r") as r:
            assert r.iterations() == new and r.kind(REBASE) == "snapshot", what
        _loads_exact(trial, job["ref"], (REBASE, FIRST), what)
        assert main(["fsck", trial]) == 0, what
    capsys.readouterr()
    assert seen == {tuple(old), tuple(new)}  # kills on both sides of the commit point
    return trial


def test_a_rebasing_job_gc_killed_at_its_steps(job, tmp_path, capsys):
    _rebase_kill_sweep(job, tmp_path, capsys, every_step=False)


@pytest.mark.slow
def test_a_rebasing_job_gc_killed_everywhere_then_loads_at_2_ranks(job, tmp_path, capsys):
    trial = _rebase_kill_sweep(job, tmp_path, capsys, every_step=True)
    its = [REBASE, REBASE + 1, FIRST]
    res = ok(run_ranks(2, MOD, "loads_with_a_group", trial, str(tmp_path / "w"),
                       ref=job["ref"], its=its))
    assert res[0] == res[1] == [["primary", REBASE], ["primary", REBASE],
                                ["follower", 3 * K]], res
