"""gc that rebases on follower bases (``Store.gc(follower_bases=True)``, ``ckptstore gc
--follower-bases``; format-spec/follower.md section 6): a kept delta's chain may start at a
verified follower base, copied into the primary as a snapshot, and the deltas before it go."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ckptstore
from ckptstore.follow import Follower, follower_path
from ckptstore.ops.fsck import check
from ckptstore.ops.retention import chain_closure, rebasing_closure
from ckptstore.replay.follower import REBASED_KEY
from ckptstore.torch import Checkpointer
from test_follower import (K, _flip_chunk_byte, _one_thread, _rewrite_follower,  # noqa: F401
                           batch, build, check_state, follower_bases, live_state,
                           train_steps)  # (_one_thread: autouse)
from test_retention import layouts, recoverable

N = 45  # primary iterations; fingerprints every 5, follower bases every K = 10
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _primary(path, n=N, seed=2):
    """A Checkpointer run with deltas only after base 0 (fingerprints every 5) and its follower
    (bases every K). Returns the live states by iteration."""
    model, opt, sched = build(seed)
    live = {}
    with ckptstore.open(path) as store:
        ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=None,
                          asynchronous=False,
                          group_commit=5, fingerprint_every=5)
        ck.restore()
        live[0] = live_state(model, opt, sched)
        train_steps(ck, model, opt, sched, range(1, n + 1), live, seed=seed)
        ck.close()
    with Follower(path, every=K) as f:
        f.run(until=n)
    return live


@pytest.fixture(scope="module")
def primary(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("fgc") / "run"
    return path, _primary(path)


def _copy(primary, tmp_path, name="s"):
    path = tmp_path / name
    shutil.copytree(primary[0], path)
    return path, primary[1]


def _check_all(assert_same, path, live, what):
    """fsck clean, and every committed iteration loads as it trained (with no FollowerWarning)."""
    report = check(path)
    assert report.clean, report.lines()
    with ckptstore.open(path, "r") as r, warnings.catch_warnings():
        warnings.simplefilter("error", ckptstore.FollowerWarning)
        for t in r.iterations():
            check_state(assert_same, live[t], r.load(t), f"{what}: load({t})")
        return r.iterations()


def _segments(path):
    d = os.path.join(path, "segments")
    return {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))}


# ---- the closure, pure -----------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_rebasing_closure_invariant(data):
    layout = data.draw(layouts())
    its = [i for i, _ in layout]
    kinds = dict(layout)
    keep = set(data.draw(st.lists(st.sampled_from(its), max_size=len(its))))
    ok = set(data.draw(st.lists(st.sampled_from(its), max_size=len(its))))
    asked: list[int] = []

    def can(t):
        asked.append(t)
        return t in ok

    r, rebased = rebasing_closure(layout, keep, can)
    assert keep <= r <= chain_closure(layout, keep)
    assert rebased <= r and all(kinds[t] == "delta" and t in ok for t in rebased)
    assert all(kinds[t] == "delta" for t in asked)
    # with the rebased deltas turned into snapshots, r is closed and loses no kept recoverable
    # iteration (a kept iteration of a broken chain stays unrecoverable, as without rebasing)
    after = [(i, "snapshot" if i in rebased else k) for i, k in layout if i in r]
    assert recoverable(after) >= recoverable(layout) & r
    for t in r:
        if kinds[t] == "delta" and t - 1 in kinds and t not in rebased:
            assert t - 1 in r
    # a rebased delta's predecessor is never kept (that rebase would free nothing)
    assert all(t - 1 not in r for t in rebased)
    assert rebasing_closure(layout, keep, None) == (chain_closure(layout, keep), frozenset())


# ---- gc ---------------------------------------------------------------------------------------
def test_gc_rebases_on_the_newest_verified_follower_base(primary, tmp_path, assert_same, capsys):
    from ckptstore.cli import main

    path, live = _copy(primary, tmp_path)
    assert follower_bases(path) == [10, 20, 30, 40]
    # default gc: the follower is not looked at, the chain back to base 0 is kept
    with ckptstore.open(path) as s:
        r = s.gc(keep_last=3)
        assert r.kept == list(range(N + 1)) and r.rebased == () and r.removed == []
    # the dry run (a reader: nothing under the directory changes) reports the rebase
    before = _segments(path)
    assert main(["gc", str(path), "--keep-last", "3", "--follower-bases", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove 40 of 46 checkpoints: 0-39" in out, out
    assert "would replace delta 40 by a snapshot made from a verified follower base" in out, out
    assert _segments(path) == before
    with ckptstore.open(path) as s:
        meta40 = s.meta(40)
        digest40 = s.info(40).manifest_digest
        r = s.gc(keep_last=3, follower_bases=True)
        # base 40 (the newest) is verified by replaying 41..45 (fingerprint at 45)
        assert r.rebased == (40,) and r.kept == list(range(40, N + 1)), r
        assert r.removed == list(range(40)) and r.bytes_after < r.bytes_before
        assert s.kind(40) == "snapshot" and s.base_of(N) == 40
        assert s.meta(40) == meta40  # the delta's meta is kept
        prov = s.manifest(40).extra[REBASED_KEY]
        assert prov["digest"] == digest40 and prov["base"] == 0
        with pytest.raises(ckptstore.NotFoundError, match="follower bases dropped it"):
            s.load(25)
    assert _check_all(assert_same, path, live, "after gc") == list(range(40, N + 1))
    # the primary no longer needs the follower store
    shutil.rmtree(follower_path(path))
    assert _check_all(assert_same, path, live, "without the follower store") == list(range(40, N + 1))


def test_training_and_following_go_on_after_a_rebase(primary, tmp_path, assert_same):
    """After gc rebased at 40: the trainer resumes, the follower accepts its store (its bases
    name the chain's origin, base 0, which the rebased snapshot records) and keeps writing bases
    the reader uses; a second gc rebases again, at the newest base."""
    path, live = _copy(primary, tmp_path)
    live = dict(live)
    with ckptstore.open(path) as s:
        assert s.gc(keep_last=1, follower_bases=True).rebased == (40,)
    model, opt, sched = build(seed=9)
    with ckptstore.open(path) as store:
        ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=None,
                          asynchronous=False,
                          group_commit=5, fingerprint_every=5)
        assert ck.restore() == N
        check_state(assert_same, live[N], live_state(model, opt, sched), "restore")
        with Follower(path, every=K) as f:  # no FollowerMismatchError
            train_steps(ck, model, opt, sched, range(N + 1, 66), live, seed=2)
            ck.flush()
            f.run(until=65)
            assert f.stats.bases == [50, 60]
        ck.close()
        assert store.base_of(65) == 40
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert store.load_base(65) == ("follower", 60)
            check_state(assert_same, live[65], store.load(65), "load(65) from follower base 60")
        r = store.gc(keep_last=2, follower_bases=True)
        assert r.rebased == (60,) and r.kept == list(range(60, 66)), r
        prov = store.manifest(60).extra[REBASED_KEY]
        assert prov["base"] == 0  # the origin, through the earlier rebase
    assert _check_all(assert_same, path, live, "second rebase") == list(range(60, 66))


def test_retention_decides_what_stays(primary, tmp_path, assert_same):
    """Deltas the policy keeps are never dropped: kept iterations below the follower base keep
    their chain, and a rebase whose predecessor is kept anyway is not made."""
    path, live = _copy(primary, tmp_path)
    with ckptstore.open(path) as s:
        r = s.gc(keep_last=1, keep_every=25, follower_bases=True)
        # 0 is kept as it is; 25's chain stops at follower base 20, 45's at 40
        assert r.rebased == (20, 40), r
        assert r.kept == [0] + list(range(20, 26)) + list(range(40, N + 1)), r
    _check_all(assert_same, path, live, "keep_every")
    path, live = _copy(primary, tmp_path, "s2")
    with ckptstore.open(path) as s:
        r = s.gc(policy=ckptstore.KeepSinceIteration(35) | ckptstore.KeepEvery(100), follower_bases=True)
        assert r.rebased == (30,) and r.kept == [0] + list(range(30, N + 1)), r  # 35 needs 30..34
        r = s.gc(policy=ckptstore.KeepSinceIteration(30) | ckptstore.KeepEvery(100), follower_bases=True)
        assert r.rebased == () and r.removed == [], r  # 30 is a snapshot already: nothing to do
    _check_all(assert_same, path, live, "keep_since")


def _tamper_params(b, state):
    if b == 40:
        state["model"]["0.weight"] = state["model"]["0.weight"] + 1.0


def _tamper_moments(b, state):
    if b == 40:  # parameters intact (the fingerprint at 40 matches), optimizer state not
        s0 = state["optimizer"]["state"][0]
        s0["exp_avg"] = s0["exp_avg"] * 1.5


def _tamper_rng(b, state):
    if b == 40:
        state["rng"]["torch"] = torch.Generator().manual_seed(123).get_state()


@pytest.mark.parametrize("damage", ["chunk", "params", "moments", "rng", "missing", "foreign"])
def test_a_bad_follower_base_is_never_used(primary, tmp_path, assert_same, damage):
    """Follower base 40 damaged, tampered with or missing, or the follower store of another run:
    gc rebases on the next older base that passes (30), or on none, and keeps every delta it
    needs; everything kept loads exactly."""
    path, live = _copy(primary, tmp_path)
    expect = (30,)
    if damage == "chunk":
        _flip_chunk_byte(follower_path(path), 40, "2.weight")
    elif damage == "params":
        _rewrite_follower(path, _tamper_params)
    elif damage == "moments":
        _rewrite_follower(path, _tamper_moments)
    elif damage == "rng":
        _rewrite_follower(path, _tamper_rng)
    elif damage == "missing":
        shutil.rmtree(follower_path(path))
        expect = ()
    elif damage == "foreign":
        other = tmp_path / "other"
        _primary(other, n=25, seed=3)
        shutil.rmtree(follower_path(path))
        shutil.copytree(follower_path(other), follower_path(path))
        expect = ()
    with ckptstore.open(path) as s, warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptstore.FollowerWarning)
        dry = s.gc(keep_last=3, follower_bases=True, dry_run=True)
        r = s.gc(keep_last=3, follower_bases=True)
    assert (dry.rebased, dry.kept) == (r.rebased, r.kept)
    assert r.rebased == expect, r
    assert r.kept == list(range(expect[0] if expect else 0, N + 1))
    why = dict(r.rebase_skipped)
    if damage in ("chunk", "params", "moments", "rng"):
        assert 40 in why, r.rebase_skipped
        assert {"params": "fingerprint", "moments": "diverged", "rng": "rng state"}.get(
            damage, "") in why[40]
    if damage == "foreign":
        assert all("another primary" in w for w in why.values()), why
    # the primary alone (a reader would still try the bad follower base for a load of 40..45:
    # a cache, not what gc changed)
    shutil.rmtree(follower_path(path), ignore_errors=True)
    _check_all(assert_same, path, live, damage)


# ---- SIGKILL during the gc ------------------------------------------------------------------
_SERVER = r"""
import json, os, signal, sys, traceback
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
import torch
torch.set_num_threads(1)
import ckptstore
from ckptstore.replay.follower import FollowerRebaser  # noqa: F401
from _crashkit import KillOps

for line in sys.stdin:
    cmd = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            ops = KillOps(cmd.get("target"), cmd.get("nth", 0), cmd.get("tear", 0.0),
                          cmd.get("after", False), armed=False)
            counts = {}
            if cmd.get("count"):
                class Counting(type(ops)):
                    def _due(self, op):
                        if self.armed:
                            counts[op] = counts.get(op, 0) + 1
                        return False
                ops = Counting(None, 0, armed=False)
            # small segments: the copies span several, so kills between their renames leave
            # some copies live beside the old segments (iteration 40 committed twice)
            with ckptstore.open(cmd["path"], file_ops=ops, segment_size=16 << 10) as s:
                ops.armed = True
                s.gc(keep_last=3, follower_bases=True)
                ops.armed = False
            if cmd.get("count"):
                with open(cmd["count"], "w") as f:
                    json.dump(counts, f)
        except BaseException:
            traceback.print_exc()
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                      "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}),
          flush=True)
"""


@pytest.mark.slow
def test_sigkill_during_a_rebasing_gc(primary, tmp_path, assert_same):
    """A gc that rebases at 40 SIGKILLed at writes, fsyncs, renames and unlinks (torn writes,
    kills before and after the call): the next writer open finishes or rolls back the gc, fsck is
    clean, every iteration still listed loads exactly, and the kept ones (40..45) always do."""
    server = subprocess.Popen([sys.executable, "-c", _SERVER, ROOT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None

    def trial(cmd):
        server.stdin.write(json.dumps(cmd) + "\n")
        server.stdin.flush()
        return json.loads(server.stdout.readline())

    try:
        path, live = _copy(primary, tmp_path, "count")
        count_file = tmp_path / "count.json"
        assert trial({"path": str(path), "count": str(count_file)}) == {"signal": None, "exit": 0}
        counts = json.loads(count_file.read_text())
        assert counts.get("rename", 0) >= 2 and counts.get("write", 0) >= 2, counts
        assert counts["rename"] >= 4, counts  # three copies or more, and the marker
        n = counts["rename"]
        plans = [("rename", nth) for nth in sorted({1, 2, n // 2, n - 1, n})]
        for op in ("write", "fsync", "unlink"):
            n = counts.get(op, 0)
            plans += [(op, nth) for nth in sorted({1, (n + 1) // 2, n} - {0})]
        outcomes, kinds = set(), set()
        for i, (op, nth) in enumerate(plans):
            path, live = _copy(primary, tmp_path, f"t{i}")
            end = trial({"path": str(path), "target": op, "nth": nth, "tear": 0.5,
                         "after": i % 2 == 1})
            where = f"kill at {op} #{nth} (after={i % 2 == 1})"
            assert end["signal"] == signal.SIGKILL, f"{where}: {end}"
            ckptstore.open(path).close()  # the writer's open finishes or rolls back the gc
            its = _check_all(assert_same, path, live, where)
            assert set(range(40, N + 1)) <= set(its), (where, its)
            done = its == list(range(40, N + 1))
            assert done or its == list(range(N + 1)), (where, its)
            outcomes.add(done)
            with ckptstore.open(path, "r") as r:
                kinds.add(r.kind(40))  # the delta, or (its copy live) the snapshot
                assert not done or r.kind(40) == "snapshot"
        assert outcomes == {True, False}, plans  # kills on both sides of the commit point
        assert kinds == {"delta", "snapshot"}
    finally:
        server.stdin.close()
        server.wait(30)
