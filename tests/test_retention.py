"""Retention policies (ckptstore/ops/retention.py), gc with them, dry runs, automatic retention
after saves, and ``ckptstore gc`` end to end."""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ckptstore
from ckptstore import (AnyOf, KeepBest, KeepEvery, KeepLast, KeepNewerThan, KeepSinceIteration,
                       NotFoundError, ReadOnlyStoreError, RetentionError)
from ckptstore.cli import main
from ckptstore.cli.maintenance import _ranges
from ckptstore.ops.fsck import check
from ckptstore.ops.retention import (Checkpoint, chain_closure, metric_value, parse_duration,
                                     plan_retention, policy_from_options)
from ckptstore.torch import Checkpointer

S, D = "snapshot", "delta"


# ---- pure policies ---------------------------------------------------------------------------
def cps(layout: str, start: int = 0, created: list[int] | None = None,
        metas: dict[int, object] | None = None) -> list[Checkpoint]:
    """Checkpoints from a layout string: "S" a snapshot, "D" a delta, "." a gap (no commit)."""
    out, it = [], start
    for ch in layout:
        if ch != ".":
            out.append(Checkpoint(it, S if ch == "S" else D,
                                  created[len(out)] if created else it * 1_000_000_000,
                                  (metas or {}).get(it)))
        it += 1
    return out


def test_each_policy_selects():
    c = cps("SDDDSDDDSD")  # 0..9, bases 0, 4, 8
    now = 9 * 10**9
    assert KeepLast(3).select(c, now) == {7, 8, 9}
    assert KeepLast(100).select(c, now) == set(range(10))
    assert KeepEvery(3).select(c, now) == {0, 3, 6, 9}
    assert KeepEvery(1).select(c, now) == set(range(10))
    assert KeepSinceIteration(7).select(c, now) == {7, 8, 9}
    assert KeepSinceIteration(0).select(c, now) == set(range(10))
    assert KeepNewerThan(2.0).select(c, now) == {7, 8, 9}  # created at it s; age <= 2 s
    assert KeepNewerThan(0).select(c, now) == {9}
    assert KeepNewerThan(2.5).select(c, now + 500_000_000) == {7, 8, 9}


def test_keep_best_min_max_ties_and_missing():
    metas = {0: None, 1: {"loss": 3.0}, 2: {"loss": 1.0}, 3: {"loss": float("nan")},
             4: {"loss": True}, 5: {"loss": "0.1"}, 6: {"loss": 1.0}, 7: {"loss": 5},
             8: {"val": {"loss": -1.0}}, 9: {"loss": 2.0}}
    c = cps("SDDDSDDDSD", metas=metas)
    assert KeepBest(1, "loss").select(c, 0) == {6}             # tie 2 vs 6: the newer wins
    assert KeepBest(2, "loss", "min").select(c, 0) == {2, 6}
    assert KeepBest(2, "loss", "max").select(c, 0) == {7, 1}   # 5 (int) and 3.0
    assert KeepBest(100, "loss").select(c, 0) == {1, 2, 6, 7, 9}  # NaN, bool, str, absent: never
    assert KeepBest(1, "val.loss").select(c, 0) == {8}         # dotted keys reach nested dicts
    assert KeepBest(3, "nope").select(c, 0) == set()
    assert metric_value({"a.b": 2}, "a.b") == 2.0 and metric_value({"a": {"b": 3}}, "a.b") == 3.0
    assert metric_value(None, "a") is None and metric_value({"a": float("inf")}, "a") == float("inf")


def test_union_and_composition():
    c = cps("SDDDSDDDSD", metas={1: {"m": 0.0}})
    p = KeepLast(1) | KeepEvery(4) | KeepBest(1, "m")
    assert isinstance(p, AnyOf) and len(p.policies) == 3  # flattened
    assert p.select(c, 0) == {9, 0, 4, 8, 1}
    assert p.uses_meta and not (KeepLast(1) | KeepEvery(2)).uses_meta
    assert AnyOf((KeepLast(1),)) == AnyOf((KeepLast(1),))   # frozen dataclasses: value equality
    assert hash(KeepBest(1, "m")) == hash(KeepBest(1, "m"))
    with pytest.raises(Exception):
        KeepLast(1).n = 2  # type: ignore[misc]
    assert policy_from_options(keep_last=2) == KeepLast(2)
    assert policy_from_options(keep_last=2, keep_best=1, metric="m", mode="max",
                               keep_newer_than=60, keep_since_iteration=5, keep_every=3) == \
        AnyOf((KeepLast(2), KeepEvery(3), KeepBest(1, "m", "max"), KeepNewerThan(60),
               KeepSinceIteration(5)))
    assert str(p) == "the last 1, every 4th, the best 1 by m (min)"


@pytest.mark.parametrize("make", [lambda: KeepLast(0), lambda: KeepLast(True), lambda: KeepEvery(0),
                                  lambda: KeepBest(0, "m"), lambda: KeepBest(1, ""),
                                  lambda: KeepBest(1, "m", "median"), lambda: KeepNewerThan(-1),
                                  lambda: KeepNewerThan(float("nan")), lambda: KeepSinceIteration(-1),
                                  lambda: AnyOf(()), lambda: policy_from_options(),
                                  lambda: policy_from_options(keep_best=2),
                                  lambda: policy_from_options(metric="loss")])
def test_bad_policies_are_value_errors(make):
    with pytest.raises(ValueError):
        make()


def test_parse_duration():
    assert parse_duration("90") == 90 and parse_duration("90s") == 90
    assert parse_duration("15m") == 900 and parse_duration("2h") == 7200
    assert parse_duration("3d") == 3 * 86400 and parse_duration("1w") == 604800
    assert parse_duration("1h30m") == 5400 and parse_duration(" 1.5H ") == 5400
    assert parse_duration("250ms") == 0.25
    for bad in ("", "h", "2x", "-1h", "1h-", "2 h", "1e3"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_plan_keeps_latest_and_chains():
    c = cps("SDDDSDDDSD")
    p = plan_retention(c, KeepEvery(6))  # selects 0, 6: 6 is a delta of base 4
    assert p.selected == (0, 6) and p.kept == (0, 4, 5, 6, 8, 9) and p.removed == (1, 2, 3, 7)
    assert p.added == (4, 5, 8, 9)       # the chain of 6, and the latest (9) with its base 8
    assert plan_retention(c, KeepSinceIteration(0)).removed == ()        # keep all
    assert plan_retention([], KeepLast(1)) == plan_retention([], KeepBest(1, "x"))  # empty store
    assert plan_retention(list(reversed(c)), KeepLast(1)).kept == (8, 9)  # any input order
    assert plan_retention([(0, S, 0, None), (1, D, 0, None)], KeepLast(1)).kept == (0, 1)  # tuples


@pytest.mark.parametrize("policy", [KeepSinceIteration(10), KeepBest(2, "loss"),
                                    KeepNewerThan(1.0), KeepBest(1, "x") | KeepSinceIteration(99)])
def test_policy_selecting_nothing_is_a_retention_error(policy):
    c = cps("SDDDSDDDSD")  # created 0..9 s; "now" below is 100 s
    with pytest.raises(RetentionError, match="keeps none") as e:
        plan_retention(c, policy, now_ns=100 * 10**9)
    assert isinstance(e.value, ValueError) and isinstance(e.value, ckptstore.CkptStoreError)


def test_plan_input_errors():
    with pytest.raises(ValueError, match="twice"):
        plan_retention([(1, S, 0, None), (1, S, 0, None)], KeepLast(1))
    with pytest.raises(TypeError):
        plan_retention(cps("S"), "keep-last")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not in the layout"):
        chain_closure([(0, S)], [1])


# ---- chain closure, with hypothesis ---------------------------------------------------------
def naive_closure(layout: list[tuple[int, str]], keep: set[int]) -> set[int]:
    """Reference: for each kept iteration, every iteration back to the start of its run of
    consecutive commits that ends at the nearest snapshot."""
    kinds = dict(layout)
    out = set(keep)
    for k in keep:
        t = k
        while kinds[t] == D and t - 1 in kinds:
            t -= 1
            out.add(t)
    return out


def recoverable(layout: list[tuple[int, str]]) -> set[int]:
    """The chain rule of format-spec/deltas.md, as the store's index applies it."""
    kinds, ok = dict(layout), set()
    for it in sorted(kinds):
        if kinds[it] == S or (it - 1 in ok):
            ok.add(it)
    return ok


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 40))
    it = draw(st.integers(0, 5))
    out = []
    for i in range(n):
        kind = draw(st.sampled_from([S, D, D, D]))  # mostly deltas, like a Checkpointer
        out.append((it, kind))
        it += 1 if draw(st.integers(0, 9)) else draw(st.integers(2, 4))  # sometimes a gap
    return out


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_chain_closure_invariant(data):
    layout = data.draw(layouts())
    its = [i for i, _ in layout]
    keep = set(data.draw(st.lists(st.sampled_from(its), max_size=len(its))))
    r = chain_closure(layout, keep)
    kinds = dict(layout)
    assert keep <= r <= set(its)
    for t in r:  # closed: a kept delta's committed predecessor is kept
        if kinds[t] == D and t - 1 in kinds:
            assert t - 1 in r
    assert r == naive_closure(layout, keep)  # and the smallest such set
    # a gc keeping r breaks no chain: what was recoverable and kept stays recoverable
    rec_all = recoverable(layout)
    assert recoverable([(i, k) for i, k in layout if i in r]) == rec_all & r
    assert chain_closure(layout, r) == r  # idempotent


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_plan_invariants(data):
    layout = data.draw(layouts())
    its = [i for i, _ in layout]
    metas = {i: data.draw(st.one_of(st.none(), st.fixed_dictionaries(
        {"loss": st.floats(allow_nan=True, allow_infinity=False)}))) for i in its}
    c = [Checkpoint(i, k, 1000 * i, metas[i]) for i, k in layout]
    policy = data.draw(st.lists(st.one_of(
        st.integers(1, 5).map(KeepLast), st.integers(1, 7).map(KeepEvery),
        st.tuples(st.integers(1, 3), st.sampled_from(["min", "max"])).map(
            lambda a: KeepBest(a[0], "loss", a[1])),
        st.integers(0, 50_000).map(lambda s: KeepNewerThan(s / 1e6)),
        st.integers(0, 50).map(KeepSinceIteration)), min_size=1, max_size=4)).pop()
    now = 1000 * its[-1]
    selected = policy.select(c, now)
    if not selected:
        with pytest.raises(RetentionError):
            plan_retention(c, policy, now)
        return
    p = plan_retention(c, policy, now)
    assert set(p.kept) | set(p.removed) == set(its) and not set(p.kept) & set(p.removed)
    assert list(p.kept) == sorted(p.kept) and list(p.removed) == sorted(p.removed)
    assert its[-1] in p.kept and set(p.selected) == selected <= set(p.kept)
    assert set(p.kept) == naive_closure(layout, selected | {its[-1]})
    assert set(p.added) == set(p.kept) - selected


# ---- gc on real stores ------------------------------------------------------------------------
N, BASE = 24, 5  # bases 0, 5, 10, 15, 20 (and the deltas between)


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def score(it: int) -> int:
    """A made-up metric: 10 (the highest) at 3 and 14, 0 (the lowest) at 0, 11 and 22."""
    return (it * 7) % 11


def train(path: Path, n: int = N, base_every: int = BASE, asynchronous: bool = False,
          group_commit: int = 1, **open_options):
    """Train ``n`` iterations through a Checkpointer; returns (store, live states by iteration)."""
    model, opt = build()
    store = ckptstore.open(path, "a", **open_options)
    ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=base_every,
                      asynchronous=asynchronous,
                      group_commit=group_commit)
    start = ck.restore()
    live = {start: copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})}
    for it in range(start + 1, n + 1):
        g = torch.Generator().manual_seed(it)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ck.step(it, meta={"loss": loss.item(), "eval": {"score": score(it)}})
        opt.zero_grad()
        live[it] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    ck.close()
    store.flush()
    return store, live


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One trained store, copied per test (training is the slow part)."""
    path = tmp_path_factory.mktemp("trained") / "s"
    store, live = train(path)
    loaded = {it: store.load(it) for it in store.iterations()}
    store.close()
    return path, live, loaded


def fresh_copy(trained, tmp_path: Path) -> Path:
    import shutil

    src = trained[0]
    dst = tmp_path / "s"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("LOCK"))
    return dst


def expected(store, policy, now_ns: int) -> tuple[list[int], list[int]]:
    """The plan computed independently of ckptstore.ops.gc: select, add the latest, close."""
    its = store.iterations()
    c = [Checkpoint(i, store.kind(i), store.info(i).created_ns, store.meta(i)) for i in its]
    keep = naive_closure([(i, store.kind(i)) for i in its], set(policy.select(c, now_ns)) | {its[-1]})
    return sorted(keep), [i for i in its if i not in keep]


def tree_state(path: Path) -> dict[str, str]:
    """Every file under ``path`` and a digest of its bytes."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


POLICIES = {
    "last": KeepLast(4),
    "every": KeepEvery(7),                      # 0, 7 (chain from 5), 14 (from 10), 21 (from 20)
    "best-max": KeepBest(2, "eval.score", "max"),
    "best-min": KeepBest(3, "loss", "min"),
    "newer-than": None,                         # built from the commit times (below)
    "since": KeepSinceIteration(17),
    "union": KeepLast(1) | KeepEvery(12) | KeepBest(1, "eval.score", "min"),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_gc_with_each_policy_on_a_checkpointer_store(trained, tmp_path, assert_same, name):
    path = fresh_copy(trained, tmp_path)
    _, live, loaded = trained
    with ckptstore.open(path, "a") as store:
        policy = POLICIES[name]
        now = store.info(store.latest()).created_ns
        if policy is None:  # everything committed within 1 ms... of iteration 18's commit
            now = store.info(18).created_ns + 10**9
            policy = KeepNewerThan(1.0)
        kept, removed = expected(store, policy, now)
        assert removed, "each case removes something"
        dry = store.gc(policy=policy, dry_run=True, now_ns=now)
        assert (dry.kept, dry.removed) == (kept, removed) and dry.dry_run and not dry.compacted
        r = store.gc(policy=policy, now_ns=now)
        assert (r.kept, r.removed) == (kept, removed) and r.compacted
        assert r.bytes_after < r.bytes_before
        assert dry.bytes_after == r.bytes_after  # the estimate, exact here
        assert store.iterations() == kept
        for it in removed:
            with pytest.raises(NotFoundError):
                store.load(it)
        for it in kept:  # bit-identical to before the gc, and to the live training state
            state = store.load(it)
            assert_same(loaded[it], state)
            assert_same(live[it]["model"], state["model"])
            assert_same(live[it]["optimizer"], state["optimizer"])
    assert check(path).clean
    with ckptstore.open(path, "r") as reader:
        assert reader.iterations() == kept


def test_old_gc_arguments_still_work(trained, tmp_path):
    path = fresh_copy(trained, tmp_path)
    with ckptstore.open(path, "a") as store:
        with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
            store.gc(keep_last=0)
        with pytest.raises(ValueError, match="keep_every"):
            store.gc(keep_last=1, keep_every=0)
        with pytest.raises(TypeError):
            store.gc()
        with pytest.raises(TypeError, match="policy=KeepLast"):  # not keep_last=KeepLast(5)
            store.gc(ckptstore.KeepLast(5), follower_bases=True)
        r = store.gc(keep_last=3, keep_every=10)  # 22..24 (chain to 20) and 0, 10
        assert r.kept == [0, 10, 20, 21, 22, 23, 24]
        assert store.iterations() == [0, 10, 20, 21, 22, 23, 24]
        assert r.added == (21,)  # 20 is selected by keep_every
        # keep_last composes with a policy (union)
        r = store.gc(keep_last=1, policy=KeepSinceIteration(23))
        assert r.kept == [20, 21, 22, 23, 24] and r.removed == [0, 10]


def test_gc_policy_keeping_nothing_removes_nothing(trained, tmp_path):
    path = fresh_copy(trained, tmp_path)
    before = tree_state(path)
    with ckptstore.open(path, "a") as store:
        its = store.iterations()
        for policy in (KeepBest(3, "no.such.key"), KeepSinceIteration(10**6)):
            with pytest.raises(RetentionError, match="keeps none"):
                store.gc(policy=policy)
            with pytest.raises(RetentionError):
                store.gc(policy=policy, dry_run=True)
        assert store.iterations() == its
        r = store.gc(policy=KeepSinceIteration(0))  # keep-all: compacts, removes nothing
        assert r.removed == [] and store.iterations() == its
    segs = lambda st: {k for k in st if k.startswith("segments")}  # noqa: E731
    assert segs(tree_state(path)) != segs(before)  # (that one did compact)


def test_gc_keep_one_keeps_the_latest_chain(trained, tmp_path, assert_same):
    path = fresh_copy(trained, tmp_path)
    with ckptstore.open(path, "a") as store:
        # best: 3 and 14 (score 10 both), the newer wins: 14, a delta of base 10
        r = store.gc(policy=KeepBest(1, "eval.score", "max"))
        assert r.kept == [10, 11, 12, 13, 14, 20, 21, 22, 23, 24]
        assert r.added == (10, 11, 12, 13, 20, 21, 22, 23, 24)
        assert_same(trained[2][14], store.load(14))


def test_dry_run_touches_nothing_and_matches_gc(trained, tmp_path):
    path = fresh_copy(trained, tmp_path)
    policy = KeepLast(2) | KeepEvery(10)
    before = tree_state(path)
    # use_index=False: a reader of the warm LMDB index registers in LMDB's reader table
    # (index/lock.mdb); scanning the log instead leaves every byte as it was (the CLI does this)
    with ckptstore.open(path, "r", use_index=False) as reader:
        dry = reader.gc(policy=policy, dry_run=True)
        with pytest.raises(ReadOnlyStoreError):
            reader.gc(policy=policy)
    assert tree_state(path) == before  # listing and every file's bytes unchanged
    with ckptstore.open(path, "r") as reader:  # through the warm index: the same answer
        warm = reader.gc(policy=policy, dry_run=True)
    assert (warm.kept, warm.removed, warm.bytes_after) == (dry.kept, dry.removed, dry.bytes_after)
    assert dry.estimated and dry.bytes_freed > 0 and dry.removed
    with ckptstore.open(path, "a") as store:
        r = store.gc(policy=policy)
    assert (r.kept, r.removed) == (dry.kept, dry.removed)
    assert r.bytes_before == dry.bytes_before and r.bytes_after == dry.bytes_after


def test_dry_run_on_a_reader_beside_a_writer(trained, tmp_path):
    path = fresh_copy(trained, tmp_path)
    with ckptstore.open(path, "a") as writer:
        with ckptstore.open(path, "r") as reader:
            dry = reader.gc(keep_last=1, dry_run=True)
        assert dry.kept == [20, 21, 22, 23, 24]
        assert writer.gc(keep_last=1).removed == dry.removed


# ---- automatic retention ----------------------------------------------------------------------
def test_automatic_retention_sync_saves(tmp_path):
    with ckptstore.open(tmp_path / "s", "a", retention=KeepLast(2)) as store:
        assert store.retention == KeepLast(2) and store.last_retention is None
        for i in range(6):
            store.save(i, {"w": torch.full((64,), float(i))}, meta={"i": i})
            assert store.iterations() == list(range(max(0, i - 1), i + 1))
        run = store.last_retention
        assert run is not None and run.after == 5 and run.error is None
        assert run.report is not None and run.report.removed == [3] and run.report.compacted
        store.set_retention(None)
        store.save(6, {"w": torch.zeros(64)})
        assert store.iterations() == [4, 5, 6]
    assert check(tmp_path / "s").clean


def test_automatic_retention_every_m_bases(tmp_path):
    with ckptstore.open(tmp_path / "s", "a", retention=KeepLast(1), retention_every=3) as store:
        for i in range(7):
            store.save(i, {"w": torch.full((64,), float(i))})
        # runs after the 3rd and 6th base: at 2 (keeps 2), at 5 (keeps 5)
        assert store.iterations() == [5, 6]
        assert store.last_retention is not None and store.last_retention.after == 5


@pytest.mark.parametrize("group_commit", [1, 3])
def test_automatic_retention_with_an_async_checkpointer(tmp_path, assert_same, monkeypatch,
                                                         group_commit):
    """Bases 0, 5, ..., 30; a run after every 2nd base (5, 15, 25) in the persister thread,
    between jobs: never with a delta group open (group_commit 3: the base commits the pending
    delta 4, 14, 24 first), and deltas queued behind the base wait."""
    import ckptstore.ops.autoretention as auto_mod

    calls = []
    real = auto_mod.collect

    def spy(engine, **kw):
        calls.append((threading.current_thread().name, engine.group is None,
                      engine.index.latest()))
        return real(engine, **kw)

    monkeypatch.setattr(auto_mod, "collect", spy)
    store, live = train(tmp_path / "s", n=30, asynchronous=True, group_commit=group_commit,
                        retention=KeepLast(3), retention_every=2)
    try:
        assert [c[2] for c in calls] == [5, 15, 25]
        assert all(name.startswith("ckptstore-persist") and no_group for name, no_group, _ in calls)
        # at 25: the last 3 (23..25) and their base 20; then 26..30 were appended
        assert store.iterations() == list(range(20, 31))
        assert store.last_retention is not None and store.last_retention.after == 25
        for it in (20, 23, 25, 27, 30):
            state = store.load(it)
            assert_same(live[it]["model"], state["model"])
            assert_same(live[it]["optimizer"], state["optimizer"])
    finally:
        store.close()
    assert check(tmp_path / "s").clean


def test_automatic_retention_failure_is_logged_not_raised(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        with ckptstore.open(tmp_path / "s", "a", retention=KeepBest(1, "missing")) as store:
            for i in range(3):
                store.save(i, {"w": torch.zeros(8)})
            assert store.iterations() == [0, 1, 2]
            run = store.last_retention
            assert run is not None and isinstance(run.error, RetentionError) and run.report is None
    assert "automatic retention after base 2" in caplog.text and "keeps none" in caplog.text


def test_automatic_retention_removing_nothing_writes_nothing(tmp_path):
    with ckptstore.open(tmp_path / "s", "a", retention=KeepSinceIteration(0)) as store:
        store.save(0, {"w": torch.zeros(8)})
        before = tree_state(tmp_path / "s" / "segments")
        store.save(1, {"w": torch.ones(8)})
        run = store.last_retention
        assert run is not None and run.report is not None and not run.report.compacted
        assert run.report.removed == []
        assert set(before) <= set(tree_state(tmp_path / "s" / "segments"))


def test_retention_option_errors(tmp_path):
    with pytest.raises(ValueError, match="retention_every"):
        ckptstore.open(tmp_path / "a", "a", retention=KeepLast(1), retention_every=0)
    with pytest.raises(TypeError):
        ckptstore.open(tmp_path / "b", "a", retention="last 3")
    ckptstore.open(tmp_path / "c", "a").close()
    with pytest.raises(ReadOnlyStoreError):
        ckptstore.open(tmp_path / "c", "r", retention=KeepLast(1))
    # a job store checks its retention options before it touches the process group
    with pytest.raises(TypeError):
        ckptstore.open(tmp_path / "d", "a", process_group=object(), retention="last 3")
    with pytest.raises(ValueError, match="retention_every"):
        ckptstore.open(tmp_path / "d", "a", process_group=object(), retention=KeepLast(1),
                       retention_every=0)
    assert not os.path.exists(tmp_path / "d")
    # the lock was released by the failed opens
    with ckptstore.open(tmp_path / "a", "a") as s:
        with pytest.raises(ValueError):
            s.set_retention(KeepLast(1), every=0)


# ---- the command line -------------------------------------------------------------------------
def test_cli_gc_policies(trained, tmp_path, capsys):
    path = str(fresh_copy(trained, tmp_path))
    assert main(["gc", path, "--keep-newer-than", "1h"]) == 0  # everything is seconds old
    assert "removed 0" in capsys.readouterr().out
    assert main(["gc", path, "--keep-best", "2", "--metric", "eval.score", "--mode", "max",
                 "--keep-since-iteration", "22"]) == 0
    out = capsys.readouterr().out
    # best: 3 and 14 (score 10), chains from 0 and 10; since 22: 22..24, chain from 20
    assert out.startswith("kept 14 checkpoints, removed 11")
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == [0, 1, 2, 3, 10, 11, 12, 13, 14, 20, 21, 22, 23, 24]
    assert main(["gc", path, "--keep-last", "1", "--keep-every", "10"]) == 0
    assert capsys.readouterr().out.startswith("kept 7 checkpoints, removed 7 (1, 2, 3, 11, 12")
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == [0, 10, 20, 21, 22, 23, 24]


def test_cli_dry_run(trained, tmp_path, capsys):
    path = str(fresh_copy(trained, tmp_path))
    before = tree_state(Path(path))
    args = ["gc", path, "--keep-last", "2", "--keep-best", "1", "--metric", "loss", "--dry-run"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert tree_state(Path(path)) == before
    with ckptstore.open(path, "r") as r:
        dry = r.gc(policy=KeepLast(2) | KeepBest(1, "loss"), dry_run=True)
    assert f"would remove {len(dry.removed)} of 25 checkpoints: {_ranges(dry.removed)}" in out
    assert f"would keep {len(dry.kept)}: {_ranges(dry.kept)}" in out
    assert "estimate" in out and "would free about" in out and "dry run, nothing changed" in out
    assert main(args[:-1]) == 0
    assert f"removed {len(dry.removed)}" in capsys.readouterr().out
    with ckptstore.open(path, "r") as r:
        assert r.iterations() == dry.kept


def test_cli_gc_errors(trained, tmp_path, capsys):
    path = str(fresh_copy(trained, tmp_path))
    before = tree_state(Path(path))
    for args, msg in ((["gc", path], "no retention policy"),
                      (["gc", path, "--keep-best", "2"], "go together"),
                      (["gc", path, "--metric", "loss"], "go together"),
                      (["gc", path, "--keep-last", "2", "--mode", "max"], "--mode goes with"),
                      (["gc", path, "--keep-best", "1", "--metric", ""], "metric")):
        assert main(args) == 2, args
        assert msg in capsys.readouterr().err
    for args in (["gc", path, "--keep-last", "0"], ["gc", path, "--keep-newer-than", "soon"],
                 ["gc", path, "--keep-since-iteration", "-1"],
                 ["gc", path, "--keep-best", "1", "--metric", "m", "--mode", "avg"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2
    capsys.readouterr()
    assert main(["gc", path, "--keep-since-iteration", "99", "--dry-run"]) == 1
    assert "nothing was removed" in capsys.readouterr().err
    assert tree_state(Path(path)) == before
    assert main(["gc", path, "--keep-best", "2", "--metric", "nope"]) == 1
    assert "keeps none" in capsys.readouterr().err
    after = tree_state(Path(path))  # (the writer's open made its LOCK file and used the index)
    assert {k: v for k, v in after.items() if not k.startswith(("LOCK", "index"))} == \
        {k: v for k, v in before.items() if not k.startswith(("LOCK", "index"))}
