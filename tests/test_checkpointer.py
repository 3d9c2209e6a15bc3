"""Checkpointer + replay: bit-exact point-in-time restore, chain rules, group commit, gc, fsck,
corruption and lossy codecs (format-spec/deltas.md)."""

from __future__ import annotations

import copy
import re
import threading
import time
import warnings

import pytest
import torch

import ckptstore
from ckptstore.errors import DeltaChainError, IterationOrderError, ReplayDivergenceError
from ckptstore.ops.fsck import check
from ckptstore.replay import ApproximateReplayWarning
from ckptstore.torch import Checkpointer, auto_policy

N_ITERS = 100
BASE_EVERY = 30
#: iterations the bit-exact test loads: every chain position class (a base, right after a base,
#: right before the next, mid-chain) in every chain, and the end
CHECK_ITERS = sorted(set(range(0, N_ITERS + 1, 11)) | {1, 29, 30, 31, 59, 61, 89, 91, 100})
RANGE = (27, 32)  # store.replay across the base at 30


#: tile size for the tests' tiny models: cuts parameters into 64-element pieces (the smallest
#: cut) and packs pieces of several parameters into one tile
TEST_TILE_NUMEL = 100


@pytest.fixture(autouse=True)
def _one_thread_and_sharded_replay(monkeypatch):
    """Tiny models: one intra-op thread (threads only add handoffs, and an oversubscribed machine
    makes them very slow). Replay shards the optimizer step whatever the model's size, and runs
    steady-state windows tile by tile with tiles of TEST_TILE_NUMEL entries, so both paths are the
    ones checked bit for bit (store.replay checks the sequential one)."""
    from ckptstore.replay import parallel as recovery

    monkeypatch.setattr(recovery, "PARALLEL_MIN_NUMEL", 0)
    monkeypatch.setattr(recovery, "default_shards", lambda: 3)
    monkeypatch.setattr(recovery, "TILE_NUMEL", TEST_TILE_NUMEL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(opt_name, opt_kwargs, sched):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = getattr(torch.optim, opt_name)(model.parameters(), **opt_kwargs)
    scheduler = None
    if sched == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    elif sched == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    elif sched == "multistep":  # milestones: a collections.Counter (12 counts twice)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[5, 12, 12, 33], gamma=0.5)
    return model, opt, scheduler


def batch(it):
    g = torch.Generator().manual_seed(10_000 + it)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def live_state(model, opt, sched):
    st = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if sched is not None:
        st["scheduler"] = sched.state_dict()
    return copy.deepcopy(st)


def train(path, opt_name, opt_kwargs, sched, n=N_ITERS, keep=None, **ck_options):
    """Train ``n`` iterations through a Checkpointer; returns the live states saved on the side
    (at every iteration, or at those in ``keep``)."""
    model, opt, scheduler = build(opt_name, opt_kwargs, sched)
    store = ckptstore.open(path)
    ck = Checkpointer(store, model, opt, scheduler, **{"policy": "every-iteration", **ck_options})
    start = ck.restore()
    saved = {start: live_state(model, opt, scheduler)}
    for it in range(start + 1, n + 1):
        x, y = batch(it)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ck.step(it, meta={"loss": loss.item()})
        opt.zero_grad()
        if keep is None or it in keep:
            saved[it] = live_state(model, opt, scheduler)
    return store, ck, saved, (model, opt, scheduler)


OPTIMIZERS = [
    ("SGD", {"lr": 0.05}),
    ("SGD", {"lr": 0.05, "momentum": 0.9}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "foreach": True}),
    ("Adam", {"lr": 1e-2}),
    ("Adam", {"lr": 1e-2, "amsgrad": True, "foreach": True}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.05}),
    ("AdamW", {"lr": 1e-2, "foreach": True}),
    ("RMSprop", {"lr": 1e-3, "momentum": 0.9, "centered": True}),
    ("Adagrad", {"lr": 0.05}),
    # fused kernels exist on CPU for these three (torch >= 2.4)
    ("SGD", {"lr": 0.05, "momentum": 0.9, "fused": True}),
    ("Adam", {"lr": 1e-2, "fused": True}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.05, "fused": True}),
]


#: the optimizers a changing learning rate is checked with (each optimizer class once, and each
#: fused kernel): replay sets a step's recorded hyperparameters on the parameter groups the same
#: way for every optimizer (replayer.py, parallel.py: group.update), so the other variants are
#: checked with a constant rate (sched None), tiled and untiled
SCHEDULED = {
    "step": [OPTIMIZERS[i] for i in (1, 4, 6, 8, 9, 10, 11, 12)],
    "cosine": [OPTIMIZERS[i] for i in (2, 6)],
}


@pytest.mark.parametrize("sched", [None, "step", "cosine", "none-untiled", "none-torch-tiled"])
@pytest.mark.parametrize("opt_name,opt_kwargs", OPTIMIZERS,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, kw in OPTIMIZERS])
def test_bit_exact_point_in_time(tmp_path, assert_same, monkeypatch, opt_name, opt_kwargs, sched):
    if sched in SCHEDULED and (opt_name, opt_kwargs) not in SCHEDULED[sched]:
        pytest.skip(f"{sched} covered with {', '.join(n for n, _ in SCHEDULED[sched])}")
    if opt_kwargs.get("fused") and not _fused_on_cpu(opt_name):
        pytest.skip(f"this torch has no fused {opt_name} on CPU")
    from ckptstore.replay import parallel as recovery
    from ckptstore.replay.native import adam as native_adam

    native_ok = opt_name in ("Adam", "AdamW") and not (opt_kwargs.get("fused") or opt_kwargs.get("amsgrad"))
    if sched == "none-torch-tiled":  # Adam/AdamW windows through torch's ops, not the native kernel
        if not native_ok:
            pytest.skip("only Adam/AdamW windows have a native kernel")
        sched = None
        native_ok = False
        monkeypatch.setenv("CKPTSTORE_NATIVE", "0")
    tiled = sched != "none-untiled"
    if not tiled:  # every step through the sharded step-by-step path
        sched = None
        native_ok = False
        monkeypatch.setattr(recovery, "window_size", lambda params: 1)
    native_ok = native_ok and native_adam._load() is not None
    native_steps = native_adam.stats["steps"]
    windows = []
    run = recovery.TiledSteps.run
    monkeypatch.setattr(recovery.TiledSteps, "run", lambda self, steps: (windows.append(len(steps)),
                                                                          run(self, steps))[1])
    keep = set(CHECK_ITERS) | set(range(RANGE[0], RANGE[1] + 1)) | {77}
    store, ck, saved, _ = train(tmp_path / "s", opt_name, opt_kwargs, sched, keep=keep,
                                base_every=BASE_EVERY, group_commit=4, fingerprint_every=5)
    ck.flush()
    its = store.iterations()
    assert its == list(range(0, N_ITERS + 1))
    assert [i for i in its if store.kind(i) == "snapshot"] == [0, 30, 60, 90]
    for t in CHECK_ITERS:  # store.load: records read ahead, tiled windows (or steps sharded over 3 threads)
        st = store.load(t)
        for k in saved[t]:
            assert_same(saved[t][k], st[k], f"iteration {t} {k}")
    # steady-state deltas ran as tiled windows (ending at each fingerprint, every 5 iterations),
    # Adam's and AdamW's through the native kernel where this machine can build it
    assert (max(windows, default=0) == 5) == tiled, windows
    assert (native_adam.stats["steps"] > native_steps) == native_ok
    # replay of a range (records read ahead, steps unsharded) yields independent, exact states
    seen = []
    for it, st in store.replay(*RANGE):
        assert_same(saved[it]["model"], st["model"], f"replay {it}")
        assert_same(saved[it]["optimizer"], st["optimizer"], f"replay {it}")
        seen.append(it)
    assert seen == list(range(RANGE[0], RANGE[1] + 1))
    store.close()
    # a fresh reader sees the same
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert_same(saved[77]["model"], r.load(77)["model"])


def _fused_on_cpu(opt_name):
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    try:
        getattr(torch.optim, opt_name)([p], lr=0.1, fused=True).step()
    except (RuntimeError, ValueError):
        return False
    return True


def test_restore_into_live_objects_and_continue(tmp_path, assert_same):
    store, ck, saved, _ = train(tmp_path / "s", "AdamW", {"lr": 1e-2}, "step", n=40, base_every=15)
    store.close()
    model, opt, sched = build("AdamW", {"lr": 1e-2}, "step")
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, sched, base_every=15, policy="every-iteration")
        assert ck.restore() == 40
        assert_same(saved[40]["model"], model.state_dict())
        assert_same(saved[40]["optimizer"], opt.state_dict())
        assert_same(saved[40]["scheduler"], sched.state_dict())
        assert ck.restore(22) == 22
        assert_same(saved[22]["model"], model.state_dict())
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(DeltaChainError):
            ck.step(23)  # iterations must increase past 40
        assert_same(before, model.state_dict())  # refused before optimizer.step()
    with pytest.raises(IterationOrderError):
        with ckptstore.open(tmp_path / "s") as store:
            store.save_delta(40, {})


def test_chain_errors(tmp_path):
    with ckptstore.open(tmp_path / "s") as store:
        with pytest.raises(DeltaChainError, match="no base"):
            store.save_delta(1, {"x": 1})
        store.save(5, {"x": 1})
        with pytest.raises(DeltaChainError, match="gap"):
            store.save_delta(7, {"x": 1})
        with pytest.raises(IterationOrderError):
            store.save_delta(5, {"x": 1})
        store.save_delta(6, {"x": 1})
        assert store.iterations() == [5, 6] and store.kind(6) == "delta" and store.base_of(6) == 5
        with pytest.raises(DeltaChainError, match="Checkpointer"):
            store.load(6)  # not a Checkpointer base: replay refuses clearly


def _settle(store, ck):
    """Async: wait until every record is persisted (without committing a group early)."""
    if ck.asynchronous:
        store.pipeline.wait()


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_group_commit_and_durable_iteration(tmp_path, assert_same, asynchronous):
    store, ck, saved, _ = train(tmp_path / "s", "SGD", {"lr": 0.05, "momentum": 0.9}, None, n=23,
                                base_every=100, group_commit=5, asynchronous=asynchronous)
    _settle(store, ck)
    # 23 deltas, groups of 5: 20 are committed, 21..23 pending
    assert store.pending() == [21, 22, 23]
    assert store.durable_iteration() == 20
    assert store.iterations()[-1] == 20
    with ckptstore.open(tmp_path / "s", "r") as r:  # another process sees only what is committed
        assert r.iterations()[-1] == 20
        assert r.durable_iteration() == 20
    assert ck.flush() == 23
    assert store.durable_iteration() == 23 and store.pending() == []
    store.close()


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_group_commit_by_time(tmp_path, asynchronous):
    store, ck, saved, _ = train(tmp_path / "s", "SGD", {"lr": 0.05}, None, n=6, base_every=100,
                                group_commit=1000, group_seconds=0.0, asynchronous=asynchronous)
    _settle(store, ck)
    assert store.pending() == [] and store.durable_iteration() == 6
    store.close()


def _wait_durable(store, iteration, limit=60.0):
    """Poll durable_iteration() (no flush) until it reaches ``iteration`` or ``limit`` s pass."""
    deadline = time.monotonic() + limit
    while store.durable_iteration() != iteration and time.monotonic() < deadline:
        time.sleep(0.05)
    return store.durable_iteration()


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_group_seconds_commits_without_further_steps(tmp_path, assert_same, asynchronous):
    """Training pauses after step 5: the group timer commits the pending deltas within about
    group_seconds, with no step, flush or close; a reader sees them."""
    store, ck, saved, _ = train(tmp_path / "s", "SGD", {"lr": 0.05, "momentum": 0.9}, None, n=5,
                                base_every=100, group_commit=1000, group_seconds=0.2,
                                asynchronous=asynchronous)
    t0 = time.monotonic()
    time.sleep(1.0)
    assert _wait_durable(store, 5) == 5
    # generous: a loaded 2-core CI machine may delay the timer thread; without the timer the
    # deltas would stay pending forever (group_commit=1000)
    assert time.monotonic() - t0 < 60.0
    assert store.pending() == [] and store.iterations() == list(range(6))
    if asynchronous:
        assert ck.last_stats.done() and ck.last_stats.result().iteration == 5
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.iterations()[-1] == 5 and r.durable_iteration() == 5
        assert_same(saved[5]["model"], r.load(5)["model"], "iteration 5")
    # training resumes: the next group is committed by the timer as well, in order
    model, opt, sched = _
    for it in (6, 7):
        x, y = batch(it)
        torch.nn.functional.mse_loss(model(x), y).backward()
        ck.step(it)
        opt.zero_grad()
    assert _wait_durable(store, 7) == 7
    timers = [t for t in threading.enumerate() if t.name.startswith("ckptstore-group:")]
    assert len(timers) == 1
    store.close()
    timers[0].join(timeout=5)
    assert not timers[0].is_alive()  # close stopped the timer
    assert check(tmp_path / "s").clean


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_close_commits_pending(tmp_path, asynchronous):
    store, ck, saved, _ = train(tmp_path / "s", "SGD", {"lr": 0.05}, None, n=7, base_every=100,
                                group_commit=100, asynchronous=asynchronous)
    _settle(store, ck)
    assert store.durable_iteration() == 0
    store.close()
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.iterations() == list(range(8))


def test_gc_keeps_bases_of_retained_deltas(tmp_path, assert_same):
    store, ck, saved, _ = train(tmp_path / "s", "Adam", {"lr": 1e-2}, None, n=50, base_every=20)
    assert [i for i in store.iterations() if store.kind(i) == "snapshot"] == [0, 20, 40]
    r = store.gc(keep_last=3, keep_every=25)  # keeps 48..50 (chain to 40) and 25 (chain to 20)
    assert 40 in r.kept and 20 in r.kept and 1 in r.removed and 30 in r.removed
    assert store.iterations() == [0] + list(range(20, 26)) + list(range(40, 51))
    for t in (25, 45, 50):
        assert_same(saved[t]["model"], store.load(t)["model"])
        assert_same(saved[t]["optimizer"], store.load(t)["optimizer"])
    store.close()
    assert check(tmp_path / "s").clean


def test_ls_shows_bases_and_deltas(tmp_path, capsys):
    from ckptstore.cli import main

    store, ck, saved, _ = train(tmp_path / "s", "SGD", {"lr": 0.05}, None, n=4, base_every=3)
    store.close()
    assert main(["ls", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out.splitlines()
    kinds = {int(line.split()[0]): line.split()[1] for line in out[2:]}
    assert kinds == {0: "snapshot", 1: "delta", 2: "delta", 3: "snapshot", 4: "delta"}
    out_file = tmp_path / "r.pt"
    assert main(["restore", str(tmp_path / "s"), "2", "--out", str(out_file)]) == 0
    st = torch.load(out_file, weights_only=False)
    assert torch.equal(st["model"]["0.weight"], saved[2]["model"]["0.weight"])


def _corrupt_chunks_of(store_path, iteration, tensor_suffix):
    """Flip a byte in the chunk record holding a tensor of ``iteration``'s record."""
    with ckptstore.open(store_path, "r") as r:
        m = r.manifest(iteration)
        entry = next(t for t in m.tensors if t.path.endswith(tensor_suffix) and t.inline is None)
        from ckptstore.engine.read_path import read_tree

        tree = read_tree(r.log, r.index, entry)
        ref = r.index.get_chunk(tree.addresses[0])
        path = r.log.layout.segment_path(ref.loc.seq)
        off = ref.loc.offset + ref.loc.length // 2 + 40
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupted_delta_breaks_only_its_chain_tail(tmp_path, assert_same):
    path = tmp_path / "s"
    store, ck, saved, _ = train(path, "AdamW", {"lr": 1e-2}, None, n=40, base_every=15)
    store.close()
    assert [0, 15, 30] == [i for i in range(41) if i % 15 == 0]
    _corrupt_chunks_of(path, 20, "grads/2/g")  # the 16x16 weight's gradient in delta 20
    report = check(path)
    assert not report.clean
    assert 20 in report.damaged_iterations
    assert set(report.damaged_iterations) == set(range(20, 30))  # 21..29 named as unrecoverable
    assert any("chain broken at iteration 20" in p for p in report.damaged_iterations[21])
    with ckptstore.open(path, "r") as r:
        for t in (19, 30, 35, 40):
            assert_same(saved[t]["model"], r.load(t)["model"])
        for t in (20, 25, 29):
            with pytest.raises(ckptstore.DamagedCheckpointError):
                r.load(t)


def test_fingerprint_divergence_is_reported(tmp_path):
    path = tmp_path / "s"
    store, ck, saved, _ = train(path, "SGD", {"lr": 0.05}, None, n=12, base_every=100,
                                fingerprint_every=5)
    store.close()
    # replay a store whose delta 3 was recorded with a different gradient: simulate by rewriting
    # the record through the API into a copy of the chain
    with ckptstore.open(path, "r") as r:
        recs = {t: r.load_record(t) for t in range(1, 13)}
        base = r.load(0)
    with ckptstore.open(tmp_path / "t") as w:
        w.save(0, base)
        for t in range(1, 13):
            rec = recs[t]
            if t == 3:
                rec["grads"][0]["g"] = rec["grads"][0]["g"] * 1.0001
            w.save_delta(t, rec)
        w.load(4)  # no fingerprint before 5: not detectable yet
        with pytest.raises(ReplayDivergenceError) as ei:
            w.load(7)
        assert ei.value.iteration == 5
        assert isinstance(ei.value, ckptstore.CkptStoreError)


@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8", "topk:0.1"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_lossy_sgd_error_is_reported_and_within_bound(tmp_path, codec, momentum):
    store, ck, saved, _ = train(tmp_path / "s", "SGD", {"lr": 0.05, "momentum": momentum,
                                                         "weight_decay": 1e-3}, None, n=40,
                                base_every=100, codec=codec)
    for t in (10, 40):
        with pytest.warns(ApproximateReplayWarning, match="APPROXIMATE"):
            st = store.load(t)
        rep = st["replay_report"]
        assert rep["exact"] is False and rep["lossy_steps"] == t
        assert rep["grad_max_abs_error"] > 0
        bound = rep["param_error_bound"]
        assert bound is not None and bound > 0
        actual = max(float((saved[t]["model"][k] - st["model"][k]).abs().max())
                     for k in saved[t]["model"] if not k.startswith("3."))
        assert actual <= bound * (1 + 1e-4) + 1e-7, (actual, bound)
    store.close()


@pytest.mark.parametrize("codec", ["bf16", "topk:0.05", "int8"])
def test_lossy_adam_reports_measured_error(tmp_path, codec):
    store, ck, saved, _ = train(tmp_path / "s", "AdamW", {"lr": 1e-2}, "step", n=30,
                                base_every=100, codec=codec, fingerprint_every=5)
    with pytest.warns(ApproximateReplayWarning):
        st = store.load(30)
    rep = st["replay_report"]
    assert rep["exact"] is False and rep["param_error_bound"] is None
    assert rep["fingerprints_checked"] == 6 and rep["measured_norm_rel_error"] is not None
    norm = lambda s: sum(float(v.double().square().sum()) for v in s.values()) ** 0.5  # noqa: E731
    true_rel = abs(norm(st["model"]) - norm(saved[30]["model"])) / norm(saved[30]["model"])
    # the report is the largest deviation over the fingerprints at 5, 10, ..., 30, measured with
    # parameter_norm (float32 partial sums, accurate to ~1e-7 relative: see fingerprint()), so it
    # may fall short of this float64 figure by up to that much for each of the two norms
    assert rep["measured_norm_rel_error"] >= true_rel - 2e-7
    assert rep["measured_norm_rel_error"] > 0
    store.close()


@pytest.mark.parametrize("codec", ["bf16", "topk:0.05", "int8"])
def test_training_on_decoded_gradients_replays_exactly(tmp_path, assert_same, monkeypatch, codec):
    """Bit-exact through tiled windows (the native kernel where it builds), where bf16 and topk
    payloads are decoded tile by tile (GradSlices; topk goes sparse to the native kernel) and
    int8 ones whole."""
    from ckptstore.replay import gradcodecs
    from ckptstore.replay.native import adam as native_adam

    native_steps = native_adam.stats["steps"]

    sliced = []
    into = gradcodecs.GradSlices.into
    monkeypatch.setattr(gradcodecs.GradSlices, "into", lambda self, a, b, out: (sliced.append(b - a),
                                                                                into(self, a, b, out))[1])
    store, ck, saved, _ = train(tmp_path / "s", "AdamW", {"lr": 1e-2}, "step", n=35,
                                base_every=20, codec=codec, apply_decoded=True, fingerprint_every=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ApproximateReplayWarning)
        for t in (5, 19, 33, 35):
            st = store.load(t)
            assert "replay_report" not in st
            for k in saved[t]:
                assert_same(saved[t][k], st[k], f"{t} {k}")
    native = native_adam._load() is not None
    assert (native_adam.stats["steps"] > native_steps) == native
    # topk payloads reach the native kernel sparse, with no decode at all
    assert bool(sliced) == (codec == "bf16" or (codec.startswith("topk") and not native))
    store.close()


def test_auto_base_interval(tmp_path):
    store, ck, saved, _ = train(tmp_path / "s", "Adam", {"lr": 1e-2}, None, n=30,
                                base_every="auto", target_recovery_s=1e-9)
    # an impossible recovery target forces a base at every iteration
    assert ck.interval() == 1
    assert all(store.kind(i) == "snapshot" for i in store.iterations()[-5:])
    store.close()
    store, ck, saved, _ = train(tmp_path / "t", "Adam", {"lr": 1e-2}, None, n=30,
                                base_every="auto", target_recovery_s=3600)
    assert ck.interval() > 30
    assert [i for i in store.iterations() if store.kind(i) == "snapshot"] == [0]
    store.close()


def test_tied_parameters_and_buffers(tmp_path, assert_same):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)
            self.bn = torch.nn.BatchNorm1d(8)
            self.out = torch.nn.Linear(8, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx):
            return self.out(self.bn(self.emb(idx)))

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, base_every=10, policy="every-iteration")
    ck.restore()
    saved = {}
    for it in range(1, 16):
        idx = torch.randint(0, 10, (12,), generator=torch.Generator().manual_seed(it))
        torch.nn.functional.cross_entropy(model(idx), idx).backward()
        ck.step(it)
        opt.zero_grad()
        saved[it] = copy.deepcopy(model.state_dict())
    for t in (5, 15):
        st = store.load(t)
        assert_same(saved[t], st["model"])
        assert st["model"]["out.weight"] is st["model"]["emb.weight"]
    store.close()


def test_non_separable_optimizer_replays_sequentially(tmp_path, assert_same, monkeypatch):
    """Only allowlisted per-parameter optimizers are sharded; another replayable one (NAdam here)
    steps as one optimizer, still bit-exact."""
    from ckptstore.replay import parallel as recovery

    assert "NAdam" not in recovery.SEPARABLE_OPTIMIZERS
    built = []
    real = recovery.ShardedStep
    monkeypatch.setattr(recovery, "ShardedStep", lambda *a, **kw: built.append(1) or real(*a, **kw))
    store, ck, saved, _ = train(tmp_path / "s", "NAdam", {"lr": 1e-2}, "step", n=12, base_every=100)
    assert_same(saved[12]["optimizer"], store.load(12)["optimizer"])
    assert built == []
    store.close()
    store, ck, saved, _ = train(tmp_path / "t", "Adam", {"lr": 1e-2}, None, n=3, base_every=100)
    assert_same(saved[3]["optimizer"], store.load(3)["optimizer"])
    assert built == []  # tiled windows apply: never sharded as well (replay.py, parallel)
    monkeypatch.setattr(recovery, "window_size", lambda params: 1)
    assert_same(saved[3]["optimizer"], store.load(3)["optimizer"])
    assert built == [1]  # the allowlisted one is sharded (PARALLEL_MIN_NUMEL is 0 in these tests)
    store.close()


def test_sharded_step_deals_whole_parameters():
    from ckptstore.replay.parallel import ShardedStep, _deal

    assert _deal([10, 1, 1, 8, 3], 2) == [[0, 1, 2], [3, 4]]  # totals 12 and 11
    assert _deal([5], 4) == [[0]]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam([{"params": [model[0].weight, model[1].weight], "lr": 0.1},
                            {"params": [model[0].bias, model[1].bias], "lr": 0.2}])
    sh = ShardedStep(opt, 3, lambda groups: torch.optim.Adam(groups))
    try:
        owned = [p for o, _ in sh.shards for g in o.param_groups for p in g["params"]]
        assert sorted(map(id, owned)) == sorted(id(p) for p in model.parameters())
        opt.param_groups[1]["lr"] = 0.3
        sh.sync_groups()
        assert all(g["lr"] == (0.1 if gi == 0 else 0.3) for o, gis in sh.shards
                   for g, gi in zip(o.param_groups, gis))
    finally:
        sh.close()


def test_replay_error_stops_the_reader_thread(tmp_path):
    """A delta that fails mid-replay (here a damaged one) surfaces as its typed error and leaves no
    reader thread behind."""
    import threading

    path = tmp_path / "s"
    store, ck, saved, _ = train(path, "SGD", {"lr": 0.05}, None, n=12, base_every=100)
    store.close()
    _corrupt_chunks_of(path, 6, "grads/0/g")
    with ckptstore.open(path, "r") as r:
        with pytest.raises(ckptstore.DamagedCheckpointError, match="iteration 6"):
            r.load(12)
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptstore-replay")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_state_is_logged_and_restored(tmp_path):
    """With CUDA initialised, every base and delta carries the CUDA RNG states; restore() puts
    them back (a training step that draws from the CUDA generator then repeats exactly)."""
    torch.cuda.init()
    store, ck, saved, (model, opt, sched) = train(tmp_path / "s", "SGD", {"lr": 0.05}, None, n=6,
                                                  base_every=4)
    states = {}
    for it in (3, 4, 6):
        rec = store.load_record(it) if store.kind(it) == "delta" else store.load(it)
        assert "cuda" in rec["rng"] and len(rec["rng"]["cuda"]) == torch.cuda.device_count()
        states[it] = [s.clone() for s in rec["rng"]["cuda"]]
    torch.cuda.manual_seed_all(12345)
    assert ck.restore(6) == 6
    # the delta record of t holds the RNG states captured when step(t) was called, which the
    # replayed state of t carries
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), states[6]))
    draw = torch.rand(4, device="cuda")
    assert ck.restore(6) == 6
    assert torch.equal(draw, torch.rand(4, device="cuda"))
    store.close()


# ---- sync path: a failed write or commit restarts the chain (like the async path) ------------
@pytest.mark.parametrize("op,err,at,lost", [("write", "ENOSPC", 8, ()), ("fsync", "EIO", 8, (7, 8)),
                                            ("write", "EIO", 15, (13, 14))],
                         ids=["delta-write-ENOSPC", "group-fsync-EIO", "base-write-EIO"])
def test_sync_failure_restarts_chain_with_a_base(tmp_path, assert_same, op, err, at, lost):
    """A write (or group fsync) failing inside step(at) on the synchronous path is raised to the
    caller after optimizer.step(); what was committed before stays intact, the next step writes a
    base of the live state (the chain restarts) and every later iteration replays bit-exact.
    ``at`` = 15 is a base-snapshot step (base_every=15). ``lost``: the uncommitted deltas of the
    group the failure rolled back (groups of 3: 7-9, 13-15); a failed delta write keeps the
    deltas appended before it (7 is committed with the restart). Buffered appends, so a write
    fails in the step that issues it (O_DIRECT appends write a group's records at its sync)."""
    import errno as errno_mod

    from test_faults import FaultyOps

    ops = FaultyOps()
    model, opt, sched = build("Adam", {"lr": 1e-2}, "step")
    store = ckptstore.open(tmp_path / "s", file_ops=ops, direct_io=False)
    ck = Checkpointer(store, model, opt, sched, base_every=15, group_commit=3,
                      fingerprint_every=5, asynchronous=False, policy="every-iteration")
    assert ck.restore() == 0
    saved = {0: live_state(model, opt, sched)}
    failed = None
    for it in range(1, 31):
        if it == at:
            ops.arm(op, 1, getattr(errno_mod, err))
        x, y = batch(it)
        torch.nn.functional.mse_loss(model(x), y).backward()
        try:
            ck.step(it)
        except ckptstore.StoreIOError:
            failed = it
            committed_then = store.iterations()
        finally:
            opt.zero_grad()
        saved[it] = live_state(model, opt, sched)  # the step was applied either way
    # the fsync of a group fails in the step that commits it (the first flush at or after 8)
    assert failed == (9 if op == "fsync" else at)
    ck.flush()
    its = store.iterations()
    assert set(committed_then) <= set(its)  # nothing committed before the failure was lost
    assert store.kind(failed) == "snapshot"  # the step after the failure restarted the chain
    assert set(range(failed, 31)) <= set(its)
    assert its == [i for i in range(31) if i not in lost]
    for t in its:
        st = store.load(t)
        for k in saved[t]:
            assert_same(saved[t][k], st[k], f"iteration {t} {k}")
    seen = [it for it, _ in store.replay(failed - 1 if failed - 1 in its else failed, 20)]
    assert seen[-1] == 20
    store.close()
    assert check(tmp_path / "s").clean
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.iterations() == its
        assert_same(saved[30]["model"], r.load(30)["model"])


# ---- MultiStepLR: its Counter state is stored as a dict, restored as a Counter ------------------
def test_multisteplr_bit_exact_and_resume(tmp_path, assert_same):
    """MultiStepLR keeps ``milestones`` in a collections.Counter: stored as a plain dict (the
    format holds no Counter; format-spec/deltas.md "Scheduler state"), loaded bit-exact as that
    dict, and restored into the live scheduler as a working Counter."""
    from collections import Counter

    from ckptstore.torch import counters_like
    from ckptstore.torch.live_state import plain_counters

    store, ck, saved, (model, opt, sched) = train(tmp_path / "full", "Adam", {"lr": 1e-2},
                                                  "multistep", n=40, base_every=15, group_commit=2)
    ck.flush()
    assert [i for i in store.iterations() if store.kind(i) == "snapshot"] == [0, 15, 30]
    lrs = {t: saved[t]["optimizer"]["param_groups"][0]["lr"] for t in (4, 5, 12, 33)}
    assert lrs == {4: 1e-2, 5: 5e-3, 12: 1.25e-3, 33: 6.25e-4}  # 12 counts twice
    for t in (1, 5, 12, 14, 15, 16, 29, 30, 33, 40):
        st = store.load(t)
        assert_same(saved[t]["model"], st["model"], f"iteration {t} model")
        assert_same(saved[t]["optimizer"], st["optimizer"], f"iteration {t} optimizer")
        assert type(st["scheduler"]["milestones"]) is dict
        assert_same(plain_counters(saved[t]["scheduler"]), st["scheduler"], f"iteration {t} sched")
        back = counters_like(st["scheduler"], sched.state_dict())
        assert_same(saved[t]["scheduler"], back, f"iteration {t} scheduler as Counter")
    store.close()

    # interrupted at 26 (a delta), resumed by restore(): same final state as the uninterrupted run
    s2, ck2, _, _ = train(tmp_path / "resumed", "Adam", {"lr": 1e-2}, "multistep", n=26,
                          base_every=15, group_commit=2)
    s2.close()
    store2, ck3, saved2, (model2, opt2, sched2) = train(tmp_path / "resumed", "Adam", {"lr": 1e-2},
                                                        "multistep", n=40, base_every=15,
                                                        group_commit=2)
    assert min(saved2) == 26  # restore() resumed at 26
    assert type(sched2.milestones) is Counter and sched2.milestones[7] == 0
    assert sched2.milestones == Counter({5: 1, 12: 2, 33: 1})
    assert_same(saved[40]["model"], model2.state_dict(), "resumed final model")
    assert_same(saved[40]["optimizer"], opt2.state_dict(), "resumed final optimizer")
    assert_same(saved[40]["scheduler"], sched2.state_dict(), "resumed final scheduler")
    # the restored scheduler works with Counter semantics: the closed form (step(epoch)) uses
    # milestones.elements()
    assert sched2._get_closed_form_lr() == [opt2.param_groups[0]["initial_lr"] * 0.5 ** 4]
    store2.close()


# ---- store.replay(start, stop): records read ahead, same states as stepping one at a time --------
def _feed_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ckptstore-replay")]


def _stepping(store, start, stop):
    """The previous replay_range (one record read at a time, in the caller's thread): the
    reference the read-ahead version must reproduce exactly."""
    from ckptstore.replay import replayer as R
    from ckptstore.replay.report import warn_if_approximate

    eng = R._replayer_at(store, start)
    it = eng.iteration
    if it == start:
        yield it, eng.current(clone=True)
    while it < stop:
        it += 1
        if store.kind(it) == "snapshot":
            eng = R._StateReplayer(store.load(it), it)
        else:
            eng.apply(it, R._record(store, it))
        if it >= start:
            warn_if_approximate(eng.report)
            yield it, eng.current(clone=True)


def _collect(gen):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = list(gen)
    return out, [str(x.message) for x in w if issubclass(x.category, ApproximateReplayWarning)]


@pytest.mark.parametrize("codec", ["exact", "int8"])
def test_replay_range_reads_ahead_and_matches_stepping(tmp_path, assert_same, monkeypatch, codec):
    store, ck, saved, _ = train(tmp_path / "s", "SGD", {"lr": 0.05, "momentum": 0.9}, None, n=40,
                                base_every=15, codec=codec)
    ck.flush()
    want, want_warn = _collect(_stepping(store, 12, 33))  # crosses the bases at 15 and 30
    got, got_warn = _collect(store.replay(12, 33))
    assert [i for i, _ in got] == list(range(12, 34)) == [i for i, _ in want]
    assert got_warn == want_warn and (len(got_warn) > 0) == (codec != "exact")
    for (i, a), (_, b) in zip(want, got):
        assert_same(a, b, f"iteration {i}")  # the whole state, replay_report included
        if codec == "exact":
            assert_same(saved[i]["model"], b["model"], f"iteration {i} vs training")
    # a state from the base itself, and a range inside one chain
    warnings.simplefilter("ignore", ApproximateReplayWarning)  # (restored by pytest after the test)
    assert [i for i, _ in store.replay(15, 16)] == [15, 16]
    assert [i for i, _ in store.replay(3, 3)] == [3] and list(store.replay(5, 4)) == []

    # read ahead: while the caller holds state k, the feed thread has read k + 1 (and beyond)
    reads = []
    orig = store.load_record

    def logged(it, *a, **kw):
        reads.append((it, threading.current_thread().name))
        return orig(it, *a, **kw)

    monkeypatch.setattr(store, "load_record", logged)
    held = []
    for it, st in store.replay(17, 25):
        deadline = time.monotonic() + 30
        while it < 25 and not any(r == it + 1 for r, _ in reads) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert it == 25 or any(r == it + 1 for r, _ in reads), f"record {it + 1} not read ahead"
        for t in st["model"].values():  # yielded states are independent copies
            t.add_(1.0)
        held.append((it, st))
    assert {name for _, name in reads} == {"ckptstore-replay-feed"}
    ref = dict(want)
    for it, st in held:  # nothing the feed or the engine reused changed an earlier state
        for k, t in st["model"].items():
            assert torch.equal(t, ref[it]["model"][k] + 1.0), f"iteration {it} {k}"
    assert not _feed_threads()
    store.close()


def test_replay_range_early_exit_and_errors_stop_the_feed(tmp_path, assert_same):
    path = tmp_path / "s"
    store, ck, saved, _ = train(path, "Adam", {"lr": 1e-2}, None, n=30, base_every=100)
    store.close()
    with ckptstore.open(path, "r") as r:
        for it, _ in r.replay(2, 28):  # break
            if it == 4:
                break
        assert not _feed_threads()
        gen = r.replay(1, 28)  # close()
        assert next(gen)[0] == 1 and next(gen)[0] == 2
        gen.close()
        assert not _feed_threads()
        with pytest.raises(ZeroDivisionError):  # an exception in the loop body
            for it, _ in r.replay(1, 28):
                if it == 3:
                    1 / 0
        assert not _feed_threads()
        with pytest.raises(ckptstore.NotFoundError):  # past the end: raised after every state
            seen = []
            for it, _ in r.replay(27, 35):
                seen.append(it)
        assert seen == [27, 28, 29, 30] and not _feed_threads()
    _corrupt_chunks_of(path, 12, "grads/2/g")
    with ckptstore.open(path, "r") as r:
        seen = []
        with pytest.raises(ckptstore.DamagedCheckpointError, match="12"):
            for it, st in r.replay(9, 20):
                assert_same(saved[it]["model"], st["model"], f"iteration {it}")
                seen.append(it)
        assert seen == [9, 10, 11]  # the states before the damaged delta, then its error
        assert not _feed_threads()


# ---- checkpoint policies (issue 30.3: ckptstore/torch/plan.py) -------------------------------
class SignMomentum(torch.optim.Optimizer):
    """A custom optimizer replay does not know (Lion-like: a sign step and a momentum state)."""

    def __init__(self, params, lr=1e-2, beta=0.9):
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                p.add_(torch.sign(m * g["beta"] + p.grad), alpha=-g["lr"])
                m.mul_(g["beta"]).add_(p.grad, alpha=1 - g["beta"])


def _small(opt_cls=SignMomentum, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, opt_cls(model.parameters(), lr=1e-2, **kw)


def _one_step(model, ck, opt, it):
    x, y = batch(it)
    torch.nn.functional.mse_loss(model(x) + 1e-3 * torch.randn(6, 4), y).backward()  # uses the RNG
    out = ck.step(it, meta={"it": it})
    opt.zero_grad()
    return out


@pytest.mark.parametrize("asynchronous", [True, False])
def test_unreplayable_optimizer_is_checkpointed_by_snapshots(tmp_path, assert_same, caplog,
                                                             asynchronous):
    """A custom optimizer: no TypeError, one WARNING saying why deltas are off, snapshots every
    ``snapshot_every``; restore() is bit-exact (model, optimizer state, RNG) from the newest
    snapshot, and from an older one."""
    model, opt = _small()
    store = ckptstore.open(tmp_path / "s")
    with caplog.at_level("WARNING", logger="ckptstore"):
        ck = Checkpointer(store, model, opt, snapshot_every=4, asynchronous=asynchronous)
    warned = [r for r in caplog.records if "not replayable" in r.getMessage()]
    assert len(warned) == 1 and "snapshots" in warned[0].getMessage() and ck.mode == "snapshots"
    assert ck.checkpoint_policy == "auto"  # (the default, given an interval)
    assert ck.restore() == 0
    saved, rng = {}, {}
    for it in range(1, 11):
        out = _one_step(model, ck, opt, it)
        assert (out is None) == (it % 4 != 0)
        saved[it] = live_state(model, opt, None)
        rng[it] = torch.get_rng_state()
    store.flush()
    assert store.iterations() == [0, 4, 8] and store.kind(8) == "snapshot"
    assert store.meta(8) == {"it": 8}
    for target in (4, None):
        model2, opt2 = _small()
        ck2 = Checkpointer(store, model2, opt2, policy="snapshots", snapshot_every=4,
                           asynchronous=asynchronous)
        got = ck2.restore(target)
        assert got == (8 if target is None else 4)
        assert_same(saved[got], live_state(model2, opt2, None))
        assert torch.equal(torch.get_rng_state(), rng[got])
        ck2.close()
    # training goes on after a restore of the newest: the next snapshot at 12
    for it in range(9, 13):
        _one_step(model2, ck2, opt2, it)
    store.flush()
    assert store.iterations()[-1] == 12
    ck.close()
    store.close()


def test_every_iteration_refuses_an_unreplayable_optimizer(tmp_path):
    model, opt = _small()
    store = ckptstore.open(tmp_path / "s")
    with pytest.raises(ckptstore.UnreplayableOptimizerError, match="policy") as e:
        Checkpointer(store, model, opt, policy="every-iteration")
    assert isinstance(e.value, TypeError) and isinstance(e.value, ckptstore.CheckpointPlanError)
    assert "SignMomentum" in str(e.value) and store.iterations() == []
    store.close()


@pytest.mark.parametrize("kwargs", [{"policy": "every-iteration"}, {"base_every": 0},
                                    {"codec": "zip"}, {"mtbf_s": -1.0}, {"capture": "copy?"}])
def test_a_refused_checkpointer_leaves_the_store_as_it_was(tmp_path, kwargs):
    """A Checkpointer refused for a bad argument (an unreplayable optimizer under
    "every-iteration", a bad base interval, codec, MTBF or capture) sets no retention on the
    store it was given, writes nothing and starts no pipeline."""
    from ckptstore.ops.retention import KeepLast

    model, opt = _small() if kwargs.get("policy") else _small(torch.optim.SGD)
    store = ckptstore.open(tmp_path / "s")
    with pytest.raises((ValueError, TypeError)):
        Checkpointer(store, model, opt, retention=KeepLast(2), **kwargs)
    assert store.retention is None
    assert store.iterations() == [] and store.running_pipeline is None
    store.close()


@pytest.mark.parametrize("kwargs, argument", [
    ({"policy": "weekly"}, "policy"), ({"policy": "Auto"}, "policy"),
    ({"mtbf_s": 0}, "mtbf_s"), ({"mtbf_s": -3.0}, "mtbf_s"), ({"mtbf_s": float("nan")}, "mtbf_s"),
    ({"mtbf_s": float("inf")}, "mtbf_s"), ({"mtbf_s": "24h"}, "mtbf_s"), ({"mtbf_s": True}, "mtbf_s"),
    ({"disk_budget": 0}, "disk_budget"), ({"disk_budget": 1.5e9}, "disk_budget"),
    ({"policy": "snapshots", "snapshot_every": 0}, "snapshot_every"),
    ({"policy": "every-iteration", "snapshot_every": 5}, "snapshot_every"),
    ({"policy": "auto", "measure_steps": 0}, "measure_steps"),
])
def test_bad_policy_arguments_are_refused_before_anything_is_written(tmp_path, kwargs, argument):
    model, opt = _small(torch.optim.SGD)
    store = ckptstore.open(tmp_path / "s")
    with pytest.raises(ckptstore.CheckpointPlanError, match=argument) as e:
        Checkpointer(store, model, opt, **kwargs)
    assert isinstance(e.value, ValueError)
    assert store.iterations() == [] and store.running_pipeline is None
    store.close()


@pytest.mark.parametrize("deltas_pay", [False, True])
def test_auto_plans_from_measured_costs(tmp_path, monkeypatch, deltas_pay):
    """policy="auto": plain steps and snapshots, then delta steps only where the forecast says
    deltas could pay (held either way here: a busy machine's costs decide nothing), then a plan
    with its numbers; the failure rate is said to be assumed when none is given, and given when
    it is. A plan without measured deltas says why in a note."""
    from test_auto_policy import held_forecast

    monkeypatch.setattr(auto_policy, "forecast_deltas", held_forecast(lambda: deltas_pay))
    model, opt = _small(torch.optim.SGD, momentum=0.9)
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=3)
    assert ck.plan() is None and ck.mode == "snapshots"
    ck.restore()
    # the measuring phases end by their documented limit (3 plain steps and MEASURE_WINDOWS
    # snapshots' windows, whose samples wait for the snapshots to be durable, then 3 delta
    # steps when they could pay)
    limit = auto_policy.measuring_steps_max(3) + 4 * 3 + 2
    it = 0
    while (ck.plan() is None or ck.mode != ck.plan().mode) and it < limit:
        # (while deltas are measured, the snapshot plan is in force and the steps write deltas)
        it += 1
        _one_step(model, ck, opt, it)
        if deltas_pay and ck.plan() is not None and ck.mode == "deltas":
            assert "measuring deltas" in str(ck.plan()) or ck.plan().mode == "deltas"
    p = ck.plan()
    assert p is not None and p.mode in ("snapshots", "deltas") and ck.mode == p.mode
    assert p.costs.step_s > 0 and 0 <= p.goodput <= 1
    store.flush()
    deltas = [i for i in store.iterations() if store.kind(i) == "delta"]
    if deltas_pay:
        assert set(p.goodputs()) == {"snapshots", "deltas"}
        assert p.costs.delta_overhead_s is not None and ck.meter.count("delta_ratio") == 1
        assert len(deltas) >= 3  # (the measured deltas are committed)
    else:
        assert set(p.goodputs()) == {"snapshots"} and p.costs.delta_overhead_s is None
        assert deltas == [] and ck.meter.count("delta") == 0
        assert any(n.startswith("deltas not measured") for n in p.notes), str(p)
    assert 0 < ck.meter.median("delta_share") < 1  # (gradients: a share of a snapshot's bytes)
    assert p.mtbf_source.startswith("assumed") and "24" in str(p) and "mtbf_s" in str(p)
    ck.replan(mtbf_s=600.0)
    _one_step(model, ck, opt, it + 1)
    assert ck.plan().mtbf_s == 600.0 and ck.plan().mtbf_source == "given"
    store.flush()
    assert set(deltas) <= set(store.iterations())  # the measured deltas stay committed
    ck.close()
    store.close()


@pytest.mark.parametrize("mtbf_s", [0, -1.0, float("nan"), float("inf"), "1h", True])
def test_replan_refuses_a_bad_mtbf(tmp_path, mtbf_s):
    """replan(mtbf_s=...) checks the failure rate as the constructor does (CheckpointPlanError
    naming it, the plan's rate unchanged); policy "every-iteration" has no plan to redo."""
    model, opt = _small(torch.optim.SGD)
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="snapshots", snapshot_every=2, mtbf_s=600.0,
                      measure_steps=2, asynchronous=False)
    ck.restore()
    for it in range(1, 9):
        _one_step(model, ck, opt, it)
    assert ck.plan() is not None and ck.plan().mtbf_s == 600.0
    with pytest.raises(ckptstore.CheckpointPlanError, match="mtbf_s") as e:
        ck.replan(mtbf_s=mtbf_s)
    assert isinstance(e.value, ValueError)
    _one_step(model, ck, opt, 9)
    assert ck.plan().mtbf_s == 600.0
    ck.close()
    every = Checkpointer(store, model, opt, policy="every-iteration")
    with pytest.raises(ckptstore.CheckpointPlanError, match="every-iteration"):
        every.replan(mtbf_s=60.0)
    every.close()
    store.close()


@pytest.mark.parametrize("asynchronous", [True, False])
def test_switching_plans_loses_nothing_committed(tmp_path, assert_same, caplog, monkeypatch,
                                                 asynchronous):
    """deltas -> snapshots -> deltas -> snapshots (the planner held to one mode at a time):
    every iteration committed before a switch is still committed after it, and every committed
    iteration loads bit for bit as the live state was; each plan change is logged (INFO)."""
    from test_auto_policy import hold_planner

    want = ["deltas"]
    hold_planner(lambda: want[0], monkeypatch.setattr)
    model, opt = _small(torch.optim.Adam)
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=2, snapshot_every=3,
                      group_commit=2, asynchronous=asynchronous)
    saved = {0: live_state(model, opt, None)}
    ck.restore()
    committed: list[int] = []
    with caplog.at_level("INFO", logger="ckptstore"):
        for it in range(1, 31):
            if it in (14, 21, 27):
                store.flush()
                committed = store.iterations()
                want[0] = {14: "snapshots", 21: "deltas", 27: "snapshots"}[it]
                ck.replan()
            _one_step(model, ck, opt, it)
            saved[it] = live_state(model, opt, None)
            if it in (14, 21, 27):
                assert ck.mode == want[0]
                store.flush()
                assert set(committed) <= set(store.iterations())
    store.flush()
    its = store.iterations()
    plans = [r for r in caplog.records if r.levelname == "INFO" and "checkpoint plan" in r.getMessage()]
    assert len(plans) >= 5
    first = next(int(re.search(r"from iteration (\d+) on", r.getMessage()).group(1))
                 for r in plans if "a delta every iteration" in r.getMessage())
    assert "measuring deltas" in plans[0].getMessage()  # (the snapshot plan they were measured in)
    # plain steps 1-2 (snapshots measured first; the fixed interval's first is not due yet),
    # then, the forecast held to "deltas pay", measured deltas after a base of the live state
    # (2), until 2 of them ran outside that base's window (the phase ends by iteration 12 at
    # the latest), planned deltas from ``first`` (a base of it persists the plan), snapshots from
    # 14 every 3, deltas again from 21 (the snapshot at 20 is their base), snapshots from 27
    assert 5 <= first <= 12
    assert its == [0, 2, *range(3, first), *range(first, 15), 17, *range(20, 28), 30]
    assert [store.kind(i) for i in its[:its.index(first) + 1]] == \
        ["snapshot", "snapshot", *["delta"] * (first - 3), "snapshot"]
    for it in its:
        st = store.load(it)
        assert_same(saved[it]["model"], st["model"], f"iteration {it}")
        assert_same(saved[it]["optimizer"], st["optimizer"], f"iteration {it}")
    model2, opt2 = _small(torch.optim.Adam)
    ck2 = Checkpointer(store, model2, opt2, policy="auto", asynchronous=asynchronous)
    assert ck2.restore() == its[-1]
    assert_same(saved[its[-1]], live_state(model2, opt2, None))
    ck.close()
    ck2.close()
    store.close()


@pytest.mark.parametrize("opt_name", ["Adam", "SGD"])
def test_tensor_learning_rate_under_a_scheduler_is_recorded_as_in_effect(tmp_path, assert_same,
                                                                        opt_name):
    """A learning rate given as a tensor (as fused and capturable optimizers take it) is changed
    in place by the scheduler (``fill_``, torch >= 2.2) after the step: each delta records the
    rate the step used, not a view of the live tensor, so every iteration replays bit for bit
    (the record held the next step's rate before, and the replay diverged at the first change)."""
    kwargs = {"lr": torch.tensor(0.05)} | ({"momentum": 0.9} if opt_name == "SGD" else {})
    store, ck, saved, _ = train(tmp_path / "s", opt_name, kwargs, "step", n=16, base_every=100,
                                fingerprint_every=1)
    ck.flush()
    # StepLR(step_size=7, gamma=0.7): iterations 1-7 step at 0.05, 8-14 at 0.035
    lrs = [float(store.load_record(it)["hyper"][0]["lr"]) for it in (6, 7, 8)]
    assert lrs == pytest.approx([0.05, 0.05, 0.035], rel=1e-6)
    for t in (1, 6, 7, 8, 15, 16):
        st = store.load(t)
        for k in saved[t]:
            assert_same(saved[t][k], st[k], f"iteration {t} {k}")
    store.close()


def test_a_chain_recorded_with_capturable_replays_on_the_cpu(tmp_path, assert_same, monkeypatch):
    """A chain trained with ``capturable=True`` (a GPU's compiled or CUDA-graph optimizer: its
    base and every record say so) replays on the CPU, where torch refuses ``capturable``: the
    replay turns it off (it moves the step counts, not the arithmetic). Here the CPU training
    runs without it and its base, defaults and records are made to say it, as a GPU's would;
    before, every replay of such a chain raised torch's AssertionError."""
    from ckptstore.torch import async_steps, records, step_writer

    real = records.hyperparameters

    def capturable(optimizer):
        return [dict(h, capturable=True) for h in real(optimizer)]

    for module in (records, step_writer, async_steps):
        monkeypatch.setattr(module, "hyperparameters", capturable)
    model, opt, sched = build("Adam", {"lr": 1e-2}, None)
    opt.defaults["capturable"] = True
    live_state_dict = opt.state_dict

    def state_dict():
        sd = live_state_dict()
        for g in sd["param_groups"]:
            g["capturable"] = True
        return sd

    monkeypatch.setattr(opt, "state_dict", state_dict)
    saved = {}
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=5)
        ck.restore()
        for it in range(1, 9):
            x, y = batch(it)
            torch.nn.functional.mse_loss(model(x), y).backward()
            ck.step(it)
            opt.zero_grad()
            saved[it] = copy.deepcopy({"model": model.state_dict(), "optimizer": live_state_dict()})
        ck.close()
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.load(5)["optimizer"]["param_groups"][0]["capturable"] is True  # (the base as saved)
        assert r.load_record(7)["hyper"][0]["capturable"] is True
        for t in (3, 4, 7, 8):
            st = r.load(t)
            assert_same(saved[t]["model"], st["model"], f"iteration {t}")
            assert_same(saved[t]["optimizer"]["state"], st["optimizer"]["state"], f"iteration {t}")
