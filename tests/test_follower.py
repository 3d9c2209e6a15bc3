"""The shadow follower (ckptstore/follow.py, ckptstore/replay/follower.py, format-spec/follower.md):
a separate process replays every committed delta into a replica and writes a base every K
iterations into <primary>/follower/; loads start from the newest matching follower base."""

from __future__ import annotations

import copy
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import ckptstore
from ckptstore.errors import (FollowerError, FollowerMismatchError, FollowerWarning,
                              StoreNotFoundError)
from ckptstore.follow import Follower, follower_path
from ckptstore.replay import IncrementalReplayer, replay_to
from ckptstore.torch import Checkpointer

K = 10          # follower base interval
N = 80          # training iterations of the shared run
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    return model, opt, sched


def batch(it, seed=0):
    g = torch.Generator().manual_seed(10_000 * (seed + 1) + it)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def live_state(model, opt, sched):
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                          "scheduler": sched.state_dict(), "rng": torch.get_rng_state()})


def check_state(assert_same, live, st, what):
    for k in ("model", "optimizer", "scheduler"):
        assert_same(live[k], st[k], f"{what} {k}")
    rng = st["rng"]["torch"] if isinstance(st["rng"], dict) else st["rng"]
    assert torch.equal(live["rng"], rng), f"{what}: torch RNG state differs"


def train_steps(ck, model, opt, sched, its, live, seed=0, pause=0.0, on_step=None):
    for it in its:
        x, y = batch(it, seed)
        torch.nn.functional.mse_loss(model(x), y).backward()
        ck.step(it)
        opt.zero_grad()
        live[it] = live_state(model, opt, sched)
        if on_step is not None:
            on_step(it)
        if pause:
            time.sleep(pause)


def follow_cmd(path, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "ckptstore.cli", "follow", str(path), "--every",
                             str(K), "--poll", "0.02", "--threads", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT)


def wait_for(cond, what, limit=90.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, f"timed out waiting for {what}"
        time.sleep(0.02)


def follower_bases(path):
    fp = follower_path(path)
    if not os.path.isfile(os.path.join(fp, "STORE")):
        return []
    with ckptstore.open(fp, "r") as f:
        return f.iterations()


# ---- the shared run: async trainer with base_every=None, a follower process SIGKILLed and resumed
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Train N iterations (AdamW + StepLR, exact codec, async Checkpointer, base_every=None) while
    `ckptstore follow` runs in another process; SIGKILL it at a random iteration (once it has
    written a base) and start a new one that finishes with --until-iteration N. Returns the store
    path, the live states and what the follower processes printed."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("follow") / "run"
    rnd = random.Random(os.environ.get("CKPTSTORE_SEED", "17"))
    kill_at, kill_delay = rnd.randint(25, 55), rnd.uniform(0.0, 0.05)
    model, opt, sched = build()
    store = ckptstore.open(path)
    first = follow_cmd(path, "--wait")  # before base 0 exists: it waits for it
    assert first.stdout is not None
    assert first.stdout.readline().startswith("following")
    ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=None,
                      codec="exact", group_commit=4, fingerprint_every=5)
    assert ck.restore() == 0
    live = {0: live_state(model, opt, sched)}
    procs = {"first": first}

    def on_step(it):
        if it == kill_at:
            ck.flush()
            # the first follower has caught up to about here (it is following, not starting)
            want = (kill_at // K - 1) * K
            wait_for(lambda: follower_bases(path)[-1:] >= [want], f"follower base {want}")
            time.sleep(kill_delay)
            procs["first"].send_signal(signal.SIGKILL)
            procs["first"].wait(30)
            procs["second"] = follow_cmd(path, "--until-iteration", str(N), "--timeout", "240")

    t0 = time.perf_counter()
    train_steps(ck, model, opt, sched, range(1, N + 1), live, pause=0.01, on_step=on_step)
    ck.flush()
    train_s = time.perf_counter() - t0
    out, _ = procs["second"].communicate(timeout=240)
    assert procs["second"].returncode == 0, out
    first_out = procs["first"].stdout.read()
    procs["first"].stdout.close()
    yield {"path": path, "live": live, "store": store, "ck": ck, "kill_at": kill_at,
           "second_out": out, "first_out": first_out, "train_s": train_s}
    ck.close()
    store.close()


def test_follower_bases_are_the_live_states(run, assert_same):
    path, live = run["path"], run["live"]
    store = run["store"]
    # the trainer wrote base 0 only
    assert [i for i in store.iterations() if store.kind(i) == "snapshot"] == [0]
    assert store.iterations() == list(range(N + 1))
    assert follower_bases(path) == list(range(K, N + 1, K))
    with ckptstore.open(follower_path(path), "r") as f:
        sid = store.header.store_id.hex()
        for b in f.iterations():
            check_state(assert_same, live[b], f.load(b), f"follower base {b}")
            ident = f.meta(b)["ckptstore.follower"]
            assert ident == {"v": 1, "primary": sid, "iteration": b,
                             "digest": store.info(b).manifest_digest, "base": 0,
                             "base_digest": store.info(0).manifest_digest}
    # the second follower resumed from a base the first one wrote: it replayed fewer than N
    line = run["second_out"].strip().splitlines()[-1]
    assert line.startswith(f"followed to iteration {N} (primary at {N}):"), run["second_out"]
    applied = int(line.split(": ")[1].split()[0])
    assert applied <= N - (run["kill_at"] // K - 1) * K, (run["kill_at"], run["second_out"])
    print(f"killed at {run['kill_at']}, trained in {run['train_s']:.2f} s; second follower: {line}")


def _count_reads(monkeypatch, store):
    """Iterations whose records the primary's replay reads (Store.load's read_record)."""
    seen = []
    load_entry = store.engine.load_entry

    def counting(it, *a, **kw):
        seen.append(it)
        return load_entry(it, *a, **kw)

    monkeypatch.setattr(store.engine, "load_entry", counting)
    return seen


@pytest.mark.parametrize("t", [N, N - 3, 41, 9])
def test_load_starts_from_the_newest_follower_base(run, assert_same, monkeypatch, t):
    store, live = run["store"], run["live"]
    b = t // K * K
    assert store.load_base(t) == (("follower", b) if b else ("primary", 0))
    seen = _count_reads(monkeypatch, store)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FollowerWarning: every base matches
        st = store.load(t)
    check_state(assert_same, live[t], st, f"load({t})")
    deltas = [i for i in seen if i > b]
    assert deltas == list(range(b + 1, t + 1)) and len(deltas) < K


def test_reader_and_restore_use_the_follower(run, assert_same):
    path, live = run["path"], run["live"]
    with ckptstore.open(path, "r") as r:
        assert r.load_base(N - 1) == ("follower", N - K)
        check_state(assert_same, live[N - 1], r.load(N - 1), "reader load")
    # Checkpointer.restore (store.load into the live objects) through a second writer-less path:
    # a fresh model restored from a copy of the store
    copy_path = path.parent / "restore-copy"
    shutil.copytree(path, copy_path)
    model, opt, sched = build(seed=5)
    with ckptstore.open(copy_path) as s2:
        ck = Checkpointer(s2, model, opt, sched, policy="every-iteration", base_every=None)
        assert ck.restore(N - 2) == N - 2
        ck.close()
    check_state(assert_same, live[N - 2], live_state(model, opt, sched), "restore")


def _flip_chunk_byte(store_path, iteration, suffix):
    """Flip a byte in the middle of the chunk record of a tensor of ``iteration``."""
    from ckptstore.engine.read_path import read_tree

    with ckptstore.open(store_path, "r") as r:
        m = r.manifest(iteration)
        entry = next(t for t in m.tensors if t.path.endswith(suffix) and t.inline is None)
        tree = read_tree(r.log, r.index, entry)
        ref = r.index.get_chunk(tree.addresses[0])
        seg = r.log.layout.segment_path(ref.loc.seq)
        off = ref.loc.offset + ref.loc.length // 2 + 40
    with open(seg, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_corrupted_follower_base_is_ignored(run, assert_same, tmp_path, monkeypatch):
    path = tmp_path / "s"
    shutil.copytree(run["path"], path)
    _flip_chunk_byte(follower_path(path), N, "2.weight")
    live = run["live"]
    with ckptstore.open(path, "r") as r:
        seen = _count_reads(monkeypatch, r)
        with pytest.warns(FollowerWarning, match=f"base {N} is not used"):
            st = r.load(N)
        check_state(assert_same, live[N], st, "load past a corrupted base")
        # the next older follower base was used
        assert [i for i in seen if i > N - K] == list(range(N - K + 1, N + 1))
        # warned once per base: the next load is quiet and still exact
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_state(assert_same, live[N - 1], r.load(N - 1), "second load")


def test_damaged_primary_delta_is_still_an_error(run, assert_same, tmp_path):
    """A damaged primary delta after the follower base: the load fails as it does without a
    follower (after a FollowerWarning: the replay from the follower base failed first); an
    iteration whose follower base lies past the damage loads (its base was checked against the
    fingerprint the primary's delta records)."""
    path = tmp_path / "s"
    shutil.copytree(run["path"], path)
    _flip_chunk_byte(path, N - 3, "grads/2/g")
    with ckptstore.open(path, "r") as r:
        with pytest.warns(FollowerWarning, match=f"replay from base {N - K} failed"):
            with pytest.raises(ckptstore.DamagedCheckpointError):
                r.load(N - 1)
        check_state(assert_same, run["live"][N], r.load(N), "load from the base past the damage")


def _rewrite_follower(path, change):
    """Rewrite the follower store with ``change(b, state)`` applied to each base (same identity)."""
    fp = follower_path(path)
    with ckptstore.open(fp, "r") as f:
        metas = {b: f.meta(b) for b in f.iterations()}
        states = {b: f.load(b) for b in f.iterations()}
    shutil.rmtree(fp)
    with ckptstore.open(fp) as f:
        for b, st in states.items():
            change(b, st)
            f.save(b, st, meta=metas[b])


def test_tampered_follower_base_fails_the_fingerprint_check(run, assert_same, tmp_path):
    """A follower base whose bytes are intact but whose state is not the primary's (a buggy or
    hostile follower: here a base rewritten with another model) is refused by the fingerprint of
    the primary's delta at that iteration."""
    path = tmp_path / "s"
    shutil.copytree(run["path"], path)

    def other_parameters(b, st):
        if b == N - K:  # same identity, other parameters
            st["model"]["0.weight"] = st["model"]["0.weight"] + 1.0

    _rewrite_follower(path, other_parameters)
    live = run["live"]
    with ckptstore.open(path, "r") as r:
        with pytest.warns(FollowerWarning, match="fingerprint"):
            st = r.load(N - 1)
        check_state(assert_same, live[N - 1], st, "load past a tampered base")


def _small_primary(path, n, seed, base_every=None):
    model, opt, sched = build(seed)
    live = {}
    with ckptstore.open(path) as store:
        ck = Checkpointer(store, model, opt, sched, policy="every-iteration",
                          base_every=base_every, asynchronous=False, group_commit=5)
        ck.restore()
        live[0] = live_state(model, opt, sched)
        train_steps(ck, model, opt, sched, range(1, n + 1), live, seed=seed)
        ck.close()
    return live


def test_follower_store_of_another_primary(run, assert_same, tmp_path):
    """Another run's follower store copied into this primary: readers ignore it (warned) and load
    exactly from the primary; `ckptstore follow` and Follower refuse to write into it."""
    from ckptstore.cli import main

    other = tmp_path / "other"
    _small_primary(other, 25, seed=3)
    with Follower(other, every=K) as f:
        f.run(until=25)
        assert f.stats.bases == [10, 20]
    path = tmp_path / "s"
    shutil.copytree(run["path"], path)
    shutil.rmtree(follower_path(path))
    shutil.copytree(follower_path(other), follower_path(path))
    live = run["live"]
    with ckptstore.open(path, "r") as r:
        with pytest.warns(FollowerWarning, match="another primary") as w:
            assert r.load_base(21) == ("primary", 0)
        assert len(w) == 1  # once for the store, not once per base
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_state(assert_same, live[21], r.load(21), "load with a foreign follower store")
    with pytest.raises(FollowerMismatchError, match="another primary"):
        Follower(path, every=K)
    assert main(["follow", str(path), "--until-iteration", "5"]) == 1
    assert follower_bases(path) == [10, 20]  # nothing written


def test_bad_input(tmp_path, capsys):
    from ckptstore.cli import main

    with pytest.raises(StoreNotFoundError):
        Follower(tmp_path / "missing")
    with pytest.raises(ValueError):
        Follower(tmp_path / "missing", every=0)
    # an empty primary: nothing to follow (unless waiting)
    ckptstore.open(tmp_path / "empty").close()
    with Follower(tmp_path / "empty") as f:
        with pytest.raises(FollowerError, match="empty.*no committed iteration"):
            f.step_once()
    with Follower(tmp_path / "empty", wait=True) as f:
        assert f.step_once() == 0 and f.iteration is None
    assert main(["follow", str(tmp_path / "empty"), "--timeout", "5"]) == 1
    assert "no committed iteration" in capsys.readouterr().err
    # a store not written by a Checkpointer: a typed error naming the store and the iteration
    with ckptstore.open(tmp_path / "plain") as s:
        s.save(3, {"w": torch.ones(4)})
    with Follower(tmp_path / "plain") as f:
        with pytest.raises(FollowerError, match=r"plain: base snapshot 3 .*not a Checkpointer"):
            f.step_once()
    # a second follower of the same primary: the follower store's writer lock
    with Follower(tmp_path / "plain"):
        with pytest.raises(ckptstore.StoreLockedError):
            Follower(tmp_path / "plain")


def test_chain_restart_after_a_failure(tmp_path, assert_same):
    """base_every=None still writes the base a chain restart needs (a failed delta write);
    the follower follows the new chain, and loads of either chain are exact."""
    import errno

    from test_faults import FaultyOps

    ops = FaultyOps()
    model, opt, sched = build()
    path = tmp_path / "s"
    store = ckptstore.open(path, file_ops=ops, direct_io=False)
    ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every="follower",
                      group_commit=1, fingerprint_every=5, asynchronous=False)
    assert ck.interval() is None
    assert ck.restore() == 0
    live = {0: live_state(model, opt, sched)}
    f = Follower(path, every=K)
    for it in range(1, 36):
        if it == 17:
            ops.arm("write", 1, errno.ENOSPC)
        x, y = batch(it)
        torch.nn.functional.mse_loss(model(x), y).backward()
        try:
            ck.step(it)
        except ckptstore.StoreIOError:
            pass
        opt.zero_grad()
        live[it] = live_state(model, opt, sched)
        if it % 4 == 0:
            f.step_once()
    f.run(until=35)
    assert [i for i in store.iterations() if store.kind(i) == "snapshot"] == [0, 17]
    assert f.stats.bases == [10, 20, 30]
    assert f.stats.started_from == ("primary", 17)
    f.close()
    assert store.load_base(16) == ("follower", 10)
    assert store.load_base(19) == ("primary", 17)
    assert store.load_base(33) == ("follower", 30)
    for t in (16, 17, 19, 25, 33, 35):
        check_state(assert_same, live[t], store.load(t), f"load({t})")
    ck.close()
    store.close()


def test_keep_only_the_newest_follower_bases(tmp_path, assert_same):
    path = tmp_path / "s"
    live = _small_primary(path, 45, seed=2)
    with Follower(path, every=K, keep=2) as f:
        f.run(until=45)
        assert f.stats.bases == [10, 20, 30, 40]
    assert follower_bases(path) == [30, 40]
    with ckptstore.open(path, "r") as r:
        assert r.load_base(45) == ("follower", 40)
        assert r.load_base(25) == ("primary", 0)
        check_state(assert_same, live[45], r.load(45), "load(45)")


def test_incremental_replayer_matches_replay_to(tmp_path, assert_same):
    path = tmp_path / "s"
    _small_primary(path, 12, seed=1)
    with ckptstore.open(path, "r") as r:
        with IncrementalReplayer(r, 0) as rep:
            for it in range(1, 13):
                rep.apply_next(it)  # the record read from the source
                assert rep.iteration == it and rep.exact
                expect = replay_to(r, it)
                got = rep.state(clone=True)
                for k in ("model", "optimizer", "scheduler", "rng", "iteration"):
                    assert_same(expect[k], got[k], f"iteration {it} {k}")
            with pytest.raises(ckptstore.DeltaChainError):
                rep.apply_next(14, r.load_record(12))
            stepped = rep.state(clone=True)
        # advance: records read ahead, steady deltas in tiled windows; the same bits
        with IncrementalReplayer(r, 0) as rep:
            rep.advance(5)
            rep.advance(12)
            assert rep.iteration == 12
            got = rep.state(clone=True)
            for k in ("model", "optimizer", "scheduler", "rng", "iteration"):
                assert_same(stepped[k], got[k], f"advance {k}")
