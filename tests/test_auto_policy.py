"""The Checkpointer's policy across restarts (ckptstore/torch/auto_policy.py): the plan persisted
in its bases, a restarted process that starts planned, a hostile persisted plan that is ignored
and re-measured, the failure rate learned from a single store, and the default disk budget."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
import time

import pytest
import torch

import ckptstore
from ckptstore.torch import Checkpointer
from ckptstore.torch import auto_policy
from _crashkit import run_forked
from ckptstore.torch.plan_history import PLAN_KEY, learned_mtbf, parse_persisted
from ckptstore.torch.delta_forecast import DeltaForecast
from ckptstore.torch.plan import CostMeter


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(width: int = 8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _step(model, ck, opt, it, width: int = 8):
    g = torch.Generator().manual_seed(10_000 + it)
    x, y = torch.randn(6, width, generator=g), torch.randn(6, 4, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    out = ck.step(it)
    opt.zero_grad()
    return out


def _live(model, opt):
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})


def held_forecast(pays, asked=None):
    """A stand-in for ``auto_policy.forecast_deltas`` that says deltas are worth measuring
    exactly when ``pays()`` (a break-even of 1 s and a floor of 0 then, else 0 and 0), with the
    share it was given; each call's ``(share, mtbf_s)`` is appended to ``asked`` when given."""
    def forecast(costs, share, mtbf_s, budget=None, **kw):
        if asked is not None:
            asked.append((share, mtbf_s))
        p = pays()
        return DeltaForecast(p, 0.0, 1.0 if p else 0.0, share)
    return forecast


def hold_planner(mode, setattr_=setattr):
    """Hold the planner to the one mode ``mode()`` names when it plans (the measured costs of a
    busy test machine decide nothing): ``auto_policy.make_plan`` plans that mode only, and
    ``auto_policy.forecast_deltas`` says deltas are worth measuring exactly when it is
    "deltas". ``setattr_``: how to set them (``monkeypatch.setattr``; the default sets them
    for good, as multi-rank scenarios do in their ranks)."""
    real = auto_policy.make_plan

    def held(costs, *a, **kw):
        # (the snapshot plan deltas are measured under: held to snapshots until they are)
        unmeasured = mode() == "deltas" and costs.delta_overhead_s is None
        return real(costs, *a, **{**kw, "modes": ("snapshots",) if unmeasured else (mode(),)})

    setattr_(auto_policy, "make_plan", held)
    setattr_(auto_policy, "forecast_deltas", held_forecast(lambda: mode() == "deltas"))


@pytest.fixture
def one_mode(monkeypatch):
    """Force the planner to one mode (``want[0]``, which a test may change)."""
    want = ["snapshots"]
    hold_planner(lambda: want[0], monkeypatch.setattr)
    return want


def _planned_store(path, mode, n=14, **kw):
    """A store trained by a Checkpointer(policy="auto") until planned in ``mode`` and a few steps
    on; returns (store, the first Checkpointer's last plan, {iteration: live state})."""
    model, opt = _model()
    store = ckptstore.open(path)
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=2, snapshot_every=2, **kw)
    ck.restore()
    lives = {}
    for it in range(1, n + 1):
        _step(model, ck, opt, it)
        lives[it] = _live(model, opt)
    assert ck.plan() is not None and ck.mode == mode
    store.flush()
    ck.close()
    return store, ck.plan(), lives


def _restart(store, mtbf_s):
    model, opt = _model()
    return model, opt, Checkpointer(store, model, opt, policy="auto", measure_steps=2,
                                    snapshot_every=2, mtbf_s=mtbf_s)


@pytest.mark.parametrize("mode", ["snapshots", "deltas"])
def test_restarted_checkpointer_starts_planned(tmp_path, one_mode, caplog, assert_same, mode):
    """A second Checkpointer on the store (a restarted process) restores and is planned at once,
    with the persisted plan (mode, interval, costs): no measuring phase, no extra snapshot. A
    third one, given no MTBF, learns it from the restarts the persisted plans count."""
    one_mode[0] = mode
    store, _, lives = _planned_store(tmp_path / "s", mode, mtbf_s=600.0)
    latest = store.iterations()[-1]
    assert latest in (13, 14)
    field = store.load_record(store.base_of(latest), keys=[PLAN_KEY])[PLAN_KEY]
    restarts, since, costs = parse_persisted(field)
    assert restarts == 0 and costs is not None and field["mode"] == mode
    model, opt, ck = _restart(store, 600.0)
    with caplog.at_level(logging.INFO, logger="ckptstore"):
        assert ck.restore() == latest
    assert_same(lives[latest], _live(model, opt))
    p = ck.plan()
    assert p is not None and ck.mode == mode and p.mode == mode
    assert (p.mode, p.chosen.interval) == (field["mode"], field["interval"])
    seeded = CostMeter()
    seeded.seed(costs)
    if mode == "snapshots":  # (a snapshot restored: the restore's time is a "restore" sample)
        seeded.add("restore", ck.meter.median("restore"))
    assert p.costs == seeded.costs(True, 1)
    assert any("resumed from the persisted plan" in r.getMessage() for r in caplog.records)
    before = store.iterations()
    for it in (latest + 1, latest + 2):  # planned steps: no measuring deltas or snapshot
        _step(model, ck, opt, it)
    store.flush()
    new = [i for i in store.iterations() if i not in before]
    assert new == ([latest + 1, latest + 2] if mode == "deltas" else [latest + 2])
    assert [store.kind(i) for i in new] == (["delta"] * 2 if mode == "deltas" else ["snapshot"])
    ck.close()
    model, opt, ck = _restart(store, None)
    assert ck.restore() == latest + 2
    p = ck.plan()
    assert p is not None and p.mode == mode
    assert p.mtbf_source.startswith("learned: ") and "restart(s) of this store" in p.mtbf_source
    assert 0 < p.mtbf_s < 3600
    ck.close()
    store.close()


def _steps_to_the_next_base(store, model, opt, ck, latest: int) -> tuple[int, int, dict | None]:
    """Two steps after ``latest`` (a snapshot every 2: one base), flushed, ``ck`` closed: the
    persisted plan field of the newest base, parsed (restarts, since_ns, costs)."""
    for it in (latest + 1, latest + 2):
        _step(model, ck, opt, it)
    store.flush()
    ck.close()
    newest = store.iterations()[-1]
    return parse_persisted(store.load_record(store.base_of(newest), keys=[PLAN_KEY])[PLAN_KEY])


def test_learned_mtbf_is_the_span_over_the_restarts():
    """The failure rate a restart history teaches: the time since the history began over the
    restarts in it; nothing from no restart, an unknown start or no time."""
    t0, hour = 1_700_000_000 * 10**9, 3600 * 10**9
    assert learned_mtbf(0, t0, "this store", now_ns=t0 + hour) is None
    assert learned_mtbf(3, 0, "this store", now_ns=t0 + hour) is None
    assert learned_mtbf(3, t0, "this store", now_ns=t0) is None
    assert learned_mtbf(4, t0, "this store", now_ns=t0 + 2 * hour) == \
        (1800.0, "learned: 4 restart(s) of this store in 2.00 h")
    assert learned_mtbf(8, t0, "this store", now_ns=t0 + 2 * hour)[0] == 900.0  # more: shorter


def test_each_restart_is_counted_and_teaches_the_rate(tmp_path, one_mode):
    """Every restarted Checkpointer counts one restart more in the plan it persists with its
    next base (1, 2, 3, from the same start); one given no MTBF plans with the history's span
    over those restarts."""
    one_mode[0] = "snapshots"
    store, _, _ = _planned_store(tmp_path / "s", "snapshots", mtbf_s=600.0)
    since0 = None
    for n in (1, 2, 3):
        model, opt, ck = _restart(store, 600.0)
        restarts, since, _ = _steps_to_the_next_base(store, model, opt, ck, ck.restore())
        since0 = since if since0 is None else since0
        assert (restarts, since) == (n, since0)
    model, opt, ck = _restart(store, None)
    before = time.time_ns()
    ck.restore()
    after = time.time_ns()
    p = ck.plan()
    assert p is not None and "learned: 4 restart(s) of this store" in p.mtbf_source
    assert (before - since0) / 4e9 <= p.mtbf_s <= (after - since0) / 4e9
    ck.close()
    store.close()


@pytest.mark.parametrize("mode", ["snapshots", "deltas"])
def test_a_restart_measures_its_restore_as_the_load_time(tmp_path, one_mode, monkeypatch, mode):
    """A restarted process times its restore of a snapshot (here made to take 0.25 s more): a
    "restore" sample, which plan() takes as the load time from then on (before, a snapshot's
    write time), persisted with the plan at the next base for the next restart. The restore of
    a delta, which also replays, is no sample."""
    import ckptstore.torch.checkpointer as checkpointer

    one_mode[0] = mode
    store, _, _ = _planned_store(tmp_path / "s", mode, mtbf_s=600.0)
    real = checkpointer.restore_live

    def slow(*args, **kwargs):
        time.sleep(0.25)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpointer, "restore_live", slow)
    model, opt, ck = _restart(store, 600.0)
    latest = ck.restore()
    p = ck.plan()
    assert p is not None and p.mode == mode
    assert store.kind(latest) == ("delta" if mode == "deltas" else "snapshot")
    if mode == "deltas":
        assert ck.meter.count("restore") == 0 and p.costs.load_s < 0.25
        ck.close()
        store.close()
        return
    assert ck.meter.count("restore") == 1 and ck.meter.median("restore") >= 0.25
    assert p.costs.load_s == ck.meter.median("restore")
    _, _, costs = _steps_to_the_next_base(store, model, opt, ck, latest)
    assert costs is not None and costs["restore"] >= 0.25
    model, opt, ck = _restart(store, 600.0)
    ck.restore()
    assert ck.meter.count("restore") == 2 and ck.plan().costs.load_s >= 0.25
    ck.close()
    store.close()


def test_plan_charges_the_slowdown_of_the_steps_a_snapshot_overlaps(tmp_path):
    """Training that runs 30 ms slower while a snapshot is in flight (a persister competing for
    the cores, made deterministic): the plan's snapshot cost is its stall plus that slowdown
    (before, the stall alone), and plain steps are measured outside the snapshots' windows."""
    model, opt = _model()
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="snapshots", snapshot_every=4, measure_steps=4,
                      mtbf_s=60.0)
    ck.restore()
    inflight = []
    for it in range(1, 61):
        if any(not f.done() for f in inflight):
            time.sleep(0.03)  # (this step overlaps a snapshot's persist)
        if inflight and ck.mode == "snapshots":
            inflight[-1].result()  # (durable within the step after its own)
        out = _step(model, ck, opt, it)
        inflight = [out] if out is not None and hasattr(out, "done") else []
    p = ck.plan()
    assert p is not None and ck.meter.count("snapshot_cost") >= 3
    c = p.costs
    assert 0.02 <= c.snapshot_slowdown_s <= 0.2, str(p)
    assert c.snapshot_cost_s == c.snapshot_stall_s + c.snapshot_slowdown_s
    assert ck.meter.median("plain") < 0.02  # (steps outside the windows are not slowed)
    assert "slowdown" in str(p)
    ck.close()
    store.close()


@pytest.mark.parametrize("planned, gaps", [(None, [6, 6]), ([5, 6], [5, 6]), ([1], [4, 4])])
def test_the_first_plan_waits_for_several_snapshot_windows(tmp_path, monkeypatch, planned, gaps):
    """One window's slowdown is two steps' noise (0-62 ms measured for a real ~10-30 ms, and a 0
    planned a snapshot every 2-3 iterations): the measuring phases snapshot every few plain steps
    until MEASURE_WINDOWS snapshots' costs are measured, and the first plan comes from them. The
    gap to the next measuring snapshot is the interval the windows so far plan, within
    [MEASURE_SNAPSHOT_GAP, 2 x measure_steps] = [4, 6]: ``planned`` holds the planner to these
    intervals, one per plan (the last one repeated), so each gap follows the windows measured
    before it; None: a tiny model's snapshots against an MTBF of a minute, hundreds of steps
    apart."""
    if planned is not None:
        real, intervals = auto_policy.make_plan, list(planned)

        def held(costs, *a, **kw):
            interval = intervals.pop(0) if len(intervals) > 1 else intervals[0]
            return real(costs, *a, **{**kw, "fixed": {"snapshots": interval}})
        monkeypatch.setattr(auto_policy, "make_plan", held)
    model, opt = _model()
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=3, mtbf_s=60.0)
    ck.restore()
    snapshots = []
    it = 0
    while ck.plan() is None:
        it += 1
        out = _step(model, ck, opt, it)
        if ck.mode == "snapshots" and out is not None:
            if ck.plan() is None:  # (the step that plans may snapshot for the plan)
                snapshots.append(it)
            out.result()  # (durable before the next step: a window of its own step)
        assert it < auto_policy.measuring_steps_max(3) + 2
    assert ck.meter.count("snapshot_cost") >= auto_policy.MEASURE_WINDOWS
    assert len(snapshots) == auto_policy.MEASURE_WINDOWS
    assert [b - a for a, b in zip(snapshots, snapshots[1:])] == gaps, snapshots
    ck.close()
    store.close()


def test_deltas_mode_keeps_the_delta_overhead_measured_beside_plain_steps(tmp_path, one_mode):
    """Once planned in the deltas mode no plain step runs: later delta steps are no samples (their
    median against an older plain one would follow the machine's drift, not the delta's cost);
    the bases' windows still are."""
    one_mode[0] = "deltas"
    model, opt = _model()
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=3, mtbf_s=60.0)
    ck.restore()
    it = 0
    while ck.plan() is None or ck.plan().mode != "deltas":  # (measured under a snapshot plan)
        it += 1
        _step(model, ck, opt, it)
        assert it < 60
    assert ck.mode == "deltas"
    # the delta/plain ratio measured together is kept: the overhead follows the plain step
    ratio = ck.meter.median("delta") / ck.meter.median("plain")
    assert ck.meter.count("delta_ratio") == 1 and ck.meter.median("delta_ratio") == ratio
    assert ck.plan().costs.delta_overhead_s == pytest.approx(
        ck.plan().costs.step_s * max(0.0, ratio - 1.0))
    # with its standard error, from the same samples: the margin deltas were planned at
    se = ck.meter.ratio_standard_error("delta", "plain")
    assert se is not None and ck.meter.median("delta_ratio_se") == se
    assert ck.plan().costs.delta_overhead_margin_s == pytest.approx(
        2.0 * ck.plan().costs.step_s * se)
    measured = (ck.meter.count("delta"), ck.meter.median("delta"))
    assert measured[0] >= 1
    for it in range(it + 1, it + 20):
        _step(model, ck, opt, it)
    assert (ck.meter.count("delta"), ck.meter.median("delta")) == measured
    ck.close()
    store.close()


def test_a_new_mtbf_asks_the_forecast_again_and_measures_deltas_once(tmp_path, monkeypatch,
                                                                      caplog, assert_same):
    """Planned with snapshots while deltas could not pay (the forecast held to no: no delta step
    written), a new MTBF under which they could (held to yes) measures ``measure_steps`` delta
    steps, logged, then plans from both modes; the forecast is asked with the agreed inputs (the
    gradients' measured share, the new MTBF) and never again once deltas are measured. Nothing
    committed is lost on the way and the newest iteration loads bit for bit."""
    asked, pays = [], [False]
    monkeypatch.setattr(auto_policy, "forecast_deltas", held_forecast(lambda: pays[0], asked))
    model, opt = _model()
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=3, mtbf_s=3600.0)
    ck.restore()
    it, lives = 0, {}
    while ck.plan() is None:
        it += 1
        _step(model, ck, opt, it)
        lives[it] = _live(model, opt)
        assert it < 60
    assert ck.mode == "snapshots" and ck.meter.count("delta") == 0
    # (the gradients' share of a snapshot's bytes then: later snapshots may move it a little)
    assert len(asked) == 1 and asked[0][1] == 3600.0 and 0 < asked[0][0] < 1
    assert "deltas not measured" in str(ck.plan())
    store.flush()
    committed = store.iterations()
    assert all(store.kind(i) == "snapshot" for i in committed)
    pays[0] = True
    ck.replan(mtbf_s=5.0)
    with caplog.at_level(logging.INFO, logger="ckptstore"):
        it += 1
        _step(model, ck, opt, it)
        lives[it] = _live(model, opt)
    assert ck.mode == "deltas" and asked[-1][1] == 5.0
    assert any("measuring deltas" in r.getMessage() for r in caplog.records)
    start = it
    while ck.meter.count("delta_ratio") == 0:
        it += 1
        _step(model, ck, opt, it)
        lives[it] = _live(model, opt)
        assert it < start + 4 * 3 + 2
    p = ck.plan()
    assert set(p.goodputs()) == {"snapshots", "deltas"} and p.mtbf_s == 5.0
    store.flush()
    assert sum(store.kind(i) == "delta" for i in store.iterations()) >= 3  # (the measured ones)
    n_asked = len(asked)
    ck.replan(mtbf_s=4.0)
    for it in range(it + 1, it + 3):
        _step(model, ck, opt, it)
        lives[it] = _live(model, opt)
    assert len(asked) == n_asked and ck.plan().mtbf_s == 4.0
    store.flush()
    assert set(committed) <= set(store.iterations())
    newest = store.iterations()[-1]
    assert_same(lives[newest], {k: store.load(newest)[k] for k in ("model", "optimizer")})
    ck.close()
    store.close()


def test_a_process_stopped_while_measuring_deltas_resumes_the_snapshot_plan(tmp_path,
                                                                             monkeypatch,
                                                                             assert_same):
    """Deltas are measured under the snapshot plan (the forecast held to "they could pay"): the
    base written at the switch persists that plan, so a process restored from its chain is
    planned at once (snapshots). It does not measure deltas at its first step (its plain median
    is the other process'), but at its first drift check after its warm-up (no samples in its
    first RESUME_WARMUP_STEPS), from plain steps of its own."""
    monkeypatch.setattr(auto_policy, "forecast_deltas", held_forecast(lambda: True))
    model, opt = _model()
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=3, mtbf_s=60.0)
    ck.restore()
    it, lives = 0, {}
    while ck.mode != "deltas" or it < 3:  # (into the deltas phase, a few delta steps on)
        it += 1
        _step(model, ck, opt, it)
        lives[it] = _live(model, opt)
        assert it < 60
    store.flush()
    ck.close()  # (stopped before the phase ended: what a kill leaves, the pending deltas aside)
    latest = store.iterations()[-1]
    field = store.load_record(store.base_of(latest), keys=[PLAN_KEY])[PLAN_KEY]
    assert field["mode"] == "snapshots" and "delta_ratio" not in field["costs"]
    model2, opt2 = _model()
    ck2 = Checkpointer(store, model2, opt2, policy="auto", measure_steps=3, mtbf_s=60.0)
    assert ck2.restore() == latest
    assert_same(lives[latest], _live(model2, opt2))
    assert ck2.plan() is not None and ck2.mode == "snapshots"
    assert "measured once this process has measured its own plain steps" in str(ck2.plan())
    first_check = latest + 16 * (1 + auto_policy.RESUME_WARMUP_STEPS // 16)  # (every 16 steps)
    for it in range(latest + 1, first_check):
        _step(model2, ck2, opt2, it)
        assert ck2.mode == "snapshots" and ck2.meter.count("delta") == 0, it
        if it == latest + auto_policy.RESUME_WARMUP_STEPS:
            assert ck2.meter.count("plain") == 1  # (the seeded one: none while warming up)
    assert ck2.meter.count("plain") >= 4  # (its own plain steps outvote the seeded one)
    it += 1
    _step(model2, ck2, opt2, it)  # (the drift check asks the forecast again)
    assert ck2.mode == "deltas"
    while ck2.meter.count("delta_ratio") == 0:
        it += 1
        _step(model2, ck2, opt2, it)
        assert it < first_check + 4 * 3 + 2
    assert set(ck2.plan().goodputs()) == {"snapshots", "deltas"}
    ck2.close()
    store.close()


@pytest.mark.parametrize("stops", [True, False])
def test_the_delta_measurement_stops_once_deltas_clearly_lose(tmp_path, monkeypatch, assert_same,
                                                              stops):
    """A sequential test ends the deltas phase early: delta steps 25 ms slower than plain ones
    (a sleep) on a model whose snapshots cost a few ms stop after EARLY_STOP_SAMPLES of them (the
    planner chooses snapshots even at the optimistic end of that overhead), and the plan made
    then, of snapshots, says so (the plans after it do not). Where the planner would choose
    deltas at that end (held to deltas: ``stops`` False) the phase measures its
    ``measure_steps``. Either way the plan is made from the delta/plain ratio measured, and the
    store restores its newest iteration exactly."""
    monkeypatch.setattr(auto_policy, "forecast_deltas", held_forecast(lambda: True))
    if not stops:
        real = auto_policy.make_plan

        def held(costs, *a, **kw):  # (deltas whenever the plan may choose them)
            modes = kw.get("modes", ("snapshots",))
            return real(costs, *a, **{**kw, "modes": ("deltas",) if "deltas" in modes
                                      else modes})
        monkeypatch.setattr(auto_policy, "make_plan", held)
    model, opt = _model()
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=8, mtbf_s=60.0)
    ck.restore()
    it, lives, delta_steps = 0, {}, 0
    while ck.meter.count("delta_ratio") == 0:
        it += 1
        slow = ck.mode == "deltas"
        delta_steps += slow
        _step(model, ck, opt, it)
        if slow:
            time.sleep(0.025)  # (inside the step's time: from one step's start to the next)
        lives[it] = _live(model, opt)
        assert it < 100
    samples = ck.meter.count("delta")
    assert samples == (auto_policy.EARLY_STOP_SAMPLES if stops else 8)
    assert delta_steps < (8 if stops else 4 * 8 + 1)
    plan = ck.plan()
    assert plan.mode == ("snapshots" if stops else "deltas") == ck.mode
    assert plan.costs.delta_overhead_s > 0.015
    assert ("deltas measured on 4 steps only" in str(plan)) == stops
    if stops:
        ck.replan(mtbf_s=30.0)
        it += 1
        _step(model, ck, opt, it)
        lives[it] = _live(model, opt)
        assert ck.plan() is not plan and "steps only" not in str(ck.plan())
    store.flush()
    newest = store.iterations()[-1]
    assert_same(lives[newest], {k: store.load(newest)[k] for k in ("model", "optimizer")})
    ck.close()
    store.close()

HOSTILE = [
    "not a dict", 7, None, [1, 2], {}, {"v": 2, "restarts": 0, "since_ns": 1},
    {"v": 1, "restarts": -1, "since_ns": 1}, {"v": 1, "restarts": True, "since_ns": 1},
    {"v": 1, "restarts": 0, "since_ns": 0}, {"v": 1, "restarts": 0, "since_ns": 2 ** 62},
    {"v": 1, "restarts": 0, "since_ns": 1, "costs": "fast", "mode": "snapshots", "interval": 2},
    {"v": 1, "restarts": 0, "since_ns": 1, "costs": {"plain": float("nan"), "stall": 0.1},
     "mode": "snapshots", "interval": 2},
    {"v": 1, "restarts": 0, "since_ns": 1, "costs": {"plain": -1.0, "stall": 0.1},
     "mode": "snapshots", "interval": 2},
    {"v": 1, "restarts": 0, "since_ns": 1, "costs": {"plain": float("inf"), "stall": 0.1},
     "mode": "snapshots", "interval": 2},
    {"v": 1, "restarts": 0, "since_ns": 1, "costs": {"__class__": 1.0}, "mode": "snapshots",
     "interval": 2},
    {"v": 1, "restarts": 0, "since_ns": 1, "costs": {"plain": "0.1", "stall": 0.1},
     "mode": "snapshots", "interval": 2},
    {"v": 1, "restarts": 0, "since_ns": 1, "costs": {"plain": 0.1, "stall": 0.1},
     "mode": "weekly", "interval": 2},
    {"v": 1, "restarts": 0, "since_ns": 1, "costs": {"plain": 0.1, "stall": 0.1},
     "mode": "snapshots", "interval": 0},
    {"v": 1, "restarts": 0, "since_ns": 1, "costs": {"plain": 1e-300, "stall": 0.1,
                                                      "persist": 1e300}, "mode": "snapshots",
     "interval": 2},
    {"v": 1, "restarts": 0, "since_ns": 1, "costs": {"plain": 0.1, "stall": 0.1,
                                                      "snapshot_bytes": 1e30},
     "mode": "snapshots", "interval": 2},
    {"v": 1, "restarts": 2 ** 62, "since_ns": 1, "costs": {"plain": 0.1, "stall": 0.1},
     "mode": "snapshots", "interval": 2, "extra": [0] * 1000},
]


@pytest.mark.parametrize("hostile", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_persisted_plan_is_ignored_and_remeasured(tmp_path, caplog, assert_same, hostile):
    """A base whose persisted plan is damaged or hostile: restore() loads it bit for bit, logs a
    WARNING naming the problem, and the costs are measured again (plain steps and snapshots),
    then planned as on a new store."""
    model, opt = _model()
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=2)
    ck.restore()
    for it in range(1, 4):
        _step(model, ck, opt, it)
    store.flush()
    ck.close()
    state = ck.state(3)
    state[PLAN_KEY] = hostile
    state["iteration"] = 4
    store.save(4, state)
    live = _live(model, opt)
    model2, opt2 = _model()
    ck2 = Checkpointer(store, model2, opt2, policy="auto", measure_steps=2)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert ck2.restore() == 4
    assert_same(live, _live(model2, opt2))
    warned = [r.getMessage() for r in caplog.records if "persisted plan" in r.getMessage()]
    assert len(warned) == 1 and "ignoring" in warned[0] and "measuring costs again" in warned[0]
    assert ck2.plan() is None and ck2.mode == "snapshots"
    it = 4
    while ck2.plan() is None and it < 100:  # (the measured snapshot's stall is known once durable)
        it += 1
        _step(model2, ck2, opt2, it)
        store.flush()
    assert ck2.plan() is not None
    assert ck2.plan().mtbf_source.startswith("assumed")  # (the hostile history taught nothing)
    ck2.close()
    store.close()


def test_old_store_without_a_persisted_plan_measures_without_warning(tmp_path, caplog):
    """A store written by policy="every-iteration" (no persisted plan): measured, no warning."""
    model, opt = _model()
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="every-iteration")
    ck.restore()
    for it in range(1, 6):
        _step(model, ck, opt, it)
    assert ck.meter.count("delta") >= 2  # (no planner, but its delta steps are sampled)
    store.flush()
    ck.close()
    assert PLAN_KEY not in store.load(0)
    model2, opt2 = _model()
    ck2 = Checkpointer(store, model2, opt2, policy="auto", measure_steps=2)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert ck2.restore() == 5
    assert not caplog.records and ck2.plan() is None and ck2.mode == "snapshots"
    ck2.close()
    store.close()


def _store_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
               for f in files)


def _default_budget_of(snapshots: float, width: int, tmp_path, monkeypatch):
    """A model of ``width`` and its optimizer, with the default disk budget (a share of the free
    space at open) made ``snapshots`` of its snapshots (parameters + momentum) by lowering the
    share: (model, opt, bytes of one snapshot)."""
    model, opt = _model(width)
    snapshot = sum(p.numel() * 4 for p in model.parameters()) * 2  # parameters + momentum
    monkeypatch.setattr(auto_policy, "DEFAULT_DISK_SHARE",
                        snapshots * snapshot / shutil.disk_usage(tmp_path).free)
    return model, opt, snapshot


def test_default_disk_budget_bounds_the_store(tmp_path, monkeypatch, assert_same):
    """disk_budget=None: the budget is a share of the free space at open (here made ~12
    snapshots by lowering the share); the plan says so, and its retention keeps the store's
    files within the budget at every step of a run that writes ~3x as much; the newest
    snapshot loads bit for bit."""
    width = 512
    model, opt, snapshot = _default_budget_of(12, width, tmp_path, monkeypatch)
    budget = 12 * snapshot
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="snapshots", snapshot_every=2, measure_steps=2,
                      asynchronous=False)
    assert abs(ck.disk_budget - budget) < 0.05 * budget
    ck.restore()
    worst = 0
    for it in range(1, 81):
        _step(model, ck, opt, it, width)
        if ck.plan() is not None:
            worst = max(worst, _store_bytes(tmp_path / "s"))
    p = ck.plan()
    assert p is not None and p.retention is not None and 1 <= p.retention <= 12
    assert "default: " in str(p) and "free space at open" in str(p)
    assert worst <= ck.disk_budget, (worst, ck.disk_budget)
    assert len(store.iterations()) <= p.retention + 1
    newest = store.iterations()[-1]
    assert newest == 80
    assert_same(_live(model, opt), {k: store.load(80)[k] for k in ("model", "optimizer")})
    ck.close()
    store.close()


@pytest.mark.parametrize("snapshots", [0.4, 1.5])
def test_a_budget_smaller_than_two_snapshots_keeps_the_newest_alone(tmp_path, monkeypatch, caplog,
                                                                    assert_same, snapshots):
    """A default budget that holds no snapshot with room for the next (0.4 and 1.5 snapshots:
    a nearly full disk) still bounds the store: the plan says nothing fits, one WARNING says so
    and that only the newest is kept, and from the plan's first gc on the store's files stay
    within about three snapshots (the newest, the one being written, framing and the index) at
    every step of a run that writes 40; the newest loads bit for bit."""
    width = 512
    model, opt, snapshot = _default_budget_of(snapshots, width, tmp_path, monkeypatch)
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="snapshots", snapshot_every=2, measure_steps=2,
                      asynchronous=False)
    ck.restore()
    worst = 0
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        for it in range(1, 81):
            _step(model, ck, opt, it, width)
            if store.iterations()[0] > 0:
                worst = max(worst, _store_bytes(tmp_path / "s"))
    p = ck.plan()
    assert p is not None and p.retention is not None and p.retention < 1 and not p.chosen.fits
    warned = [r.getMessage() for r in caplog.records if "holds no snapshot" in r.getMessage()]
    assert len(warned) == 1 and "keeping only the newest" in warned[0], warned
    assert 0 < worst <= 3 * snapshot + (1 << 20), (worst, snapshot)
    assert len(store.iterations()) <= 2
    assert store.iterations()[-1] == 80
    assert_same(_live(model, opt), {k: store.load(80)[k] for k in ("model", "optimizer")})
    ck.close()
    store.close()


def test_plan_retention_follows_the_plan_down_to_the_newest_alone(caplog):
    """The retention the plans set: R = 5 keeps the last 1 after every 3rd base; a plan that
    fits nothing (R < 1) keeps the newest alone after every base (also when the last one kept
    the newest already, with a gc less often), with one WARNING each time the plans go beyond
    the budget, none while they stay there."""
    from types import SimpleNamespace

    from ckptstore.torch.plan_retention import PlanRetention

    calls: list[tuple[int, int]] = []
    store = SimpleNamespace(path="s", set_retention=lambda p, every: calls.append((p.n, every)))
    kept = PlanRetention(store, enabled=True)

    def plan(r: int):
        return SimpleNamespace(retention=r, mode="snapshots", chosen=SimpleNamespace(interval=2),
                               disk_budget=100, budget_source="given")

    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        for r in (5, 0, -1, 5, 0):
            kept.planned(plan(r))
    assert calls == [(1, 3), (1, 1), (1, 3), (1, 1)]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all("keeping only the newest" in w for w in warned), warned


def test_default_checkpointer_plans_within_the_default_budget(tmp_path, monkeypatch, caplog,
                                                              one_mode, assert_same):
    """Checkpointer(store, model, opt) with no policy and no budget: policy "auto", one INFO
    line at the first plan saying so, and the default disk budget (here made ~12 snapshots by
    lowering the share) bounds the store's files at every planned step of a run that writes
    several times as much (a snapshot every 2 steps, the planner held to that mode: a busy
    machine's costs decide nothing) from its first gc on; the newest iteration loads bit for
    bit."""
    width = 512
    model, opt, _ = _default_budget_of(12, width, tmp_path, monkeypatch)
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, snapshot_every=2)
    assert ck.checkpoint_policy == "auto" and ck.mode == "snapshots"  # (measuring first)
    ck.restore()
    worst, first, lives = 0, None, {}
    with caplog.at_level(logging.INFO, logger="ckptstore"):
        for it in range(1, 45):
            _step(model, ck, opt, it, width)
            lives[it] = _live(model, opt)
            if ck.plan() is not None:
                first = it if first is None else first
            if store.iterations()[0] > 0:
                # (from the plan's first gc on: until then the store also holds what measuring
                # wrote, which the plan's retention does not count)
                worst = max(worst, _store_bytes(tmp_path / "s"))
    p = ck.plan()
    assert p is not None and first is not None and first < 30 and ck.mode == "snapshots"
    chosen = [r.getMessage() for r in caplog.records if "checkpoint plan" in r.getMessage()]
    assert 'policy="auto", the default' in chosen[0] and "free space at open" in chosen[0]
    assert 0 < worst <= ck.disk_budget, (worst, ck.disk_budget, str(p))
    store.flush()
    newest = store.iterations()[-1]
    assert newest >= 43
    assert_same(lives[newest], {k: store.load(newest)[k] for k in ("model", "optimizer")})
    ck.close()
    store.close()


# ---- SIGKILL while the plan is measured, made and persisted --------------------------------------
def _digest(model, opt) -> str:
    import hashlib
    h = hashlib.sha256()
    for t in list(model.state_dict().values()) + [
            v for s in opt.state_dict()["state"].values() for v in s.values()
            if isinstance(v, torch.Tensor)]:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _victim(path: str, target: str, nth: int, log: str) -> None:
    from _crashkit import KillOps
    torch.set_num_threads(1)
    model, opt = _model()
    ops = KillOps(target, nth, tear=0.5, armed=False)
    store = ckptstore.open(path, "a", file_ops=ops)
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=2, snapshot_every=2)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"0 {_digest(model, opt)}\n".encode())
    ck.restore()
    ops.armed = True  # (counted from the first step: the calls of training, not of the open)
    for it in range(1, 31):
        g = torch.Generator().manual_seed(10_000 + it)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        ck.before_step(it)
        opt.step()
        # logged before the record is handed to the store: once it is, the persister may make
        # it durable (a COMMIT written, the kill at its fsync) before this thread runs again
        os.write(fd, f"{it} {_digest(model, opt)}\n".encode())
        ck.after_step()
        opt.zero_grad()
    store.flush()


@pytest.mark.parametrize("target,nth", [("fsync", 2), ("fsync", 5), ("fsync", 9), ("fsync", 14),
                                        ("write", 7), ("write", 30)])
def test_sigkill_while_planning_restores_and_resumes(tmp_path, caplog, target, nth):
    """A process training with policy="auto" is SIGKILLed at the ``nth`` ``target`` call (while
    measuring, planning, or writing a snapshot that carries the plan; a killed write leaves a
    torn record): the next process restores a committed iteration bit for bit (the victim's
    logged digest), is planned at once exactly when that iteration's base carries a plan, never
    warns, and trains on."""
    one = tmp_path / "s"
    rc = run_forked(_victim, str(one), target, nth, str(tmp_path / "log"))
    assert rc == -9, f"the victim was not killed (rc {rc})"
    logged = dict(line.split() for line in open(tmp_path / "log").read().splitlines())
    store = ckptstore.open(one)
    model, opt = _model()
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=2, snapshot_every=2)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        got = ck.restore()
    assert _digest(model, opt) == logged[str(got)]
    try:
        has_plan = "costs" in store.load_record(store.base_of(got), keys=[PLAN_KEY])[PLAN_KEY]
    except KeyError:
        has_plan = False
    assert (ck.plan() is not None) == has_plan
    assert not [r for r in caplog.records if "persisted plan" in r.getMessage()]
    for it in range(got + 1, got + 4):
        _step(model, ck, opt, it)
    store.flush()
    assert store.iterations()[-1] >= got + 2
    ck.close()
    store.close()


def test_disk_budget_bounds_a_delta_chain_store(tmp_path, one_mode, assert_same):
    """The deltas mode of policy="auto" under a budget of ~12 snapshots: the plan's base interval
    fits the budget (two chains at least), its retention keeps the store's files within it at
    every planned step of a run that writes several times as much, and what is kept loads bit
    for bit (the newest delta, replayed from its chain's base)."""
    one_mode[0] = "deltas"
    width = 512
    model, opt = _model(width)
    budget = 12 * sum(p.numel() * 4 for p in model.parameters()) * 2
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=2, disk_budget=budget,
                      asynchronous=False)
    ck.restore()
    worst = 0
    for it in range(1, 81):
        _step(model, ck, opt, it, width)
        if ck.plan() is not None and it > 10:
            worst = max(worst, _store_bytes(tmp_path / "s"))
    p = ck.plan()
    assert p is not None and p.mode == "deltas" and p.retention is not None and p.retention >= 1
    assert "given" in str(p)
    assert worst <= budget, (worst, budget, str(p))
    store.flush()
    assert store.iterations()[0] > 10  # (old chains were removed)
    assert_same(_live(model, opt), {k: store.load(80)[k] for k in ("model", "optimizer")})
    ck.close()
    store.close()


# ---- a multi-rank job store: one plan for every rank ---------------------------------------------
def agreed_plan(rank, world, path, load_s):
    """Train with policy="auto" on the job store, rank 1 measuring a base load of ``load_s``
    (its costs differ: the ranks' step times are not, every commit waits for both), then close and train on in a new Checkpointer on the store opened again (a
    restarted job, in the same processes); per run this rank's plan, its own step median and
    the persisted field of its part of the newest base."""
    import torch.distributed as dist

    runs = []
    for iterations in (7, 1):
        model, opt = _model()
        store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=30.0)
        ck = Checkpointer(store, model, opt, policy="auto", measure_steps=1, snapshot_every=2)
        start = ck.restore()
        planned_at_restore = ck.plan() is not None
        for _ in range(5 if rank == 1 and not runs else 0):
            ck.meter.add("load", load_s)
        for it in range(start + 1, start + iterations + 1):
            _step(model, ck, opt, it)
        store.flush()
        p = ck.plan()
        latest = store.iterations()[-1]
        field = store.load_record(store.base_of(latest), keys=[PLAN_KEY], rank=rank)[PLAN_KEY]
        runs.append({"plan": None if p is None else [p.mode, p.chosen.interval, p.disk_budget,
                                                     p.mtbf_s, p.costs.load_s],
                     "own_load": ck.meter.median("load"), "field": field, "start": start,
                     "planned_at_restore": planned_at_restore,
                     "iterations": store.iterations()})
        ck.close()
        store.close()
    return runs


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ranks_with_different_costs_write_one_plan(tmp_path, world):
    """policy="auto" on a job store whose ranks measured different costs (rank 1 a slow base
    load): every rank plans at the same iteration from the combined costs (the larger), writes
    the same plan and the same persisted field into its part, and a restarted job resumes that
    plan on every rank at once."""
    from _ranks import run_ranks

    res = run_ranks(world, __name__, "agreed_plan", str(tmp_path / "job"), str(tmp_path / "w"),
                    deadline=180, load_s=5.0)
    assert all("ok" in r for r in res), res
    runs = [r["ok"] for r in res]
    (a, a2), (b, b2) = runs[0], runs[1]
    for x, y in [(first, other) for r in runs[1:] for first, other in zip(runs[0], r)]:
        assert x["plan"] is not None and x["plan"] == y["plan"], (x, y)
        assert x["field"] == y["field"] and "costs" in x["field"], (x, y)
        assert x["iterations"] == y["iterations"]
    assert b["own_load"] > 1.0 > a["own_load"]  # (the ranks measured differently...)
    assert a["plan"][4] > 1.0  # (...and planned from the larger)
    assert a["plan"][2] is not None and a["plan"][2] > 0  # the budget: the smaller, split
    assert a2["start"] == b2["start"] == a["iterations"][-1]
    assert a2["planned_at_restore"] and b2["planned_at_restore"]
    assert a2["field"]["restarts"] == 1



def measuring_gaps(rank, world, path):
    """Train with policy="auto" (measure_steps 3) on the job store, rank 1 measuring a base load
    of 5 s (the ranks' step times do not differ: every commit waits for both), for as many
    steps as the measuring phase may last and a few more, the planner held to an interval of 5
    for a load of 1 s or more, else 4 (so that the gap depends on whose costs it is planned
    from); returns the iterations that wrote a snapshot, and the first plan with its
    iteration."""
    import torch.distributed as dist

    real = auto_policy.make_plan

    def held(costs, *a, **kw):
        return real(costs, *a, **{**kw, "fixed": {"snapshots": 5 if costs.load_s >= 1.0 else 4}})
    auto_policy.make_plan = held  # (this rank's process only)
    model, opt = _model()
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=30.0)
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=3, mtbf_s=60.0)
    ck.restore()
    for _ in range(5 if rank == 1 else 0):
        ck.meter.add("load", 5.0)
    snapshots, planned = [], None
    for it in range(1, auto_policy.measuring_steps_max(3) + 5):
        out = _step(model, ck, opt, it)
        if out is not None and ck.mode == "snapshots":
            snapshots.append(it)
            out.result()
        if planned is None and ck.plan() is not None:
            p = ck.plan()
            planned = [it, p.mode, p.chosen.interval]
    store.flush()
    ck.close()
    store.close()
    return {"snapshots": snapshots, "planned": planned}


def test_ranks_wait_the_same_gaps_between_measuring_snapshots(tmp_path):
    """The gap to the next measuring snapshot is planned from the windows measured so far
    (agreed inputs): on a job store whose ranks measure different costs every rank asks for its
    measuring snapshots at the same iterations, and plans at the same one; the gaps are planned
    from the larger cost (the planner held to 5 for it, 4 for the smaller one's: a gap from a
    rank's own costs would differ between the ranks, whose snapshots would then fall apart)."""
    from _ranks import run_ranks

    res = run_ranks(2, __name__, "measuring_gaps", str(tmp_path / "job"), str(tmp_path / "w"),
                    deadline=180)
    assert all("ok" in r for r in res), res
    a, b = (r["ok"] for r in res)
    assert a == b, (a, b)
    assert a["planned"] is not None
    measuring = [i for i in a["snapshots"] if i < a["planned"][0]]
    assert len(measuring) == auto_policy.MEASURE_WINDOWS, a
    assert [y - x for x, y in zip(measuring, measuring[1:])] == [5, 5], a

def test_combined_plan_inputs_are_conservative_and_idempotent():
    """combine(): the largest cost of each kind (over the ranks that measured it), the smallest
    count, MTBF (with its source) and known budget (split over the ranks), the most restarts and
    the oldest history; combined costs combine to themselves (a plan resumed from a persisted
    field is the plan that wrote it); a bad message is a ValueError."""
    from ckptstore.torch.plan_agreement import Shared, combine

    a = Shared({"delta": 2, "plain": 3, "stall": 1}, {"plain": 0.01, "stall": 0.2}, 900.0, "given",
               1000, "default", 0, 50)
    b = Shared({"delta": 2, "plain": 2, "stall": 0}, {"plain": 0.03, "load": 1.5}, 600.0,
               "learned", None, "none", 2, 70)
    c = combine([a, b])
    assert c.counts == {"delta": 2, "plain": 2, "stall": 0}
    assert c.medians == {"load": 1.5, "plain": 0.03, "stall": 0.2}
    assert (c.mtbf_s, c.restarts, c.since_ns, c.budget) == (600.0, 2, 50, 500)
    assert c.mtbf_source.startswith("learned") and "rank 1" in c.mtbf_source
    assert "rank 0" in c.budget_source
    assert combine([c, c]).medians == c.medians and combine([c]) == c
    for bad in ({"counts": {"plain": -1}}, {"medians": {"plain": float("nan")}}, {"mtbf_s": 0},
                {"budget": 0}, {"restarts": "2"}, "not a dict"):
        msg = bad if isinstance(bad, str) else {**a.to_json(), **bad}
        with pytest.raises(ValueError):
            Shared.from_json(msg)
    assert Shared.from_json(a.to_json()) == a


def killed_while_planning(rank, world, path, kill_at, log):
    """Rank 1 SIGKILLs itself at the start of step ``kill_at`` (measuring, planning, or just
    planned, by ``kill_at``); rank 0 logs the digest of every step it ended and returns the
    error that stopped it."""
    import signal
    import torch.distributed as dist

    model, opt = _model()
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=20.0)
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=1, snapshot_every=2)
    ck.restore()
    error = None
    with open(f"{log}-{rank}", "a") as f:
        f.write(f"0 {_digest(model, opt)}\n")
        try:
            for it in range(1, 12):
                if rank == 1 and it == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                _step(model, ck, opt, it)
                f.write(f"{it} {_digest(model, opt)}\n")
                f.flush()
            # (a plan with a long snapshot interval may leave steps 6-11 without a collective:
            # the next one, this flush's round, is where a survivor must get its typed error)
            store.flush()
        except ckptstore.CkptStoreError as e:
            error = type(e).__name__
    return {"error": error}


def resumed_after_a_kill(rank, world, path):
    import torch.distributed as dist

    model, opt = _model()
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=20.0)
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=1, snapshot_every=2)
    start = ck.restore()
    out = {"start": start, "digest": _digest(model, opt),
           "plan": None if ck.plan() is None else [ck.plan().mode, ck.plan().chosen.interval]}
    for it in range(start + 1, start + 9):
        _step(model, ck, opt, it)
    store.flush()
    p = ck.plan()
    out.update(after=None if p is None else [p.mode, p.chosen.interval],
               iterations=store.iterations())
    ck.close()
    store.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [3, 4, 6])
def test_a_rank_killed_while_planning_loses_nothing_and_the_job_resumes_one_plan(tmp_path,
                                                                                 kill_at):
    """A rank SIGKILLed while the job measures, plans or has just planned (policy="auto", 2
    ranks): the other stops with a typed error; a new job restores a committed iteration bit for
    bit (the digest the survivor logged) on both ranks, with the same plan (or both measuring),
    and trains on with one plan."""
    from _ranks import run_ranks

    path, log = str(tmp_path / "job"), str(tmp_path / "log")
    res = run_ranks(2, __name__, "killed_while_planning", path, str(tmp_path / "w1"),
                    deadline=120, kill_at=kill_at, log=log)
    assert res[1].get("died") == -9, res
    assert "ok" in res[0] and res[0]["ok"]["error"] is not None, res  # (a typed error)
    logged = dict(line.split() for line in open(f"{log}-0").read().splitlines())
    res = run_ranks(2, __name__, "resumed_after_a_kill", path, str(tmp_path / "w2"),
                    deadline=120)
    assert all("ok" in r for r in res), res
    a, b = (r["ok"] for r in res)
    assert a["start"] == b["start"] and a["digest"] == b["digest"] == logged[str(a["start"])]
    assert a["plan"] == b["plan"] and a["after"] == b["after"] is not None
    assert a["iterations"] == b["iterations"] and a["iterations"][-1] >= a["start"] + 2


@pytest.mark.parametrize("gain, mode", [(0.001, "snapshots"), (0.02, "deltas")])
def test_a_drift_switches_modes_only_for_a_clear_gain(tmp_path, monkeypatch, gain, mode):
    """A re-plan on drifted costs keeps the mode in force unless the other gains
    MODE_SWITCH_MARGIN goodput (0.005): measured, a drift 16 steps after a restart, on a fresh
    process's slowed snapshot windows, switched to deltas for +0.0010 and back 112 steps later.
    The planner is held: snapshots until the drift; at the drift deltas ahead by ``gain``."""
    monkeypatch.setattr(auto_policy, "forecast_deltas", held_forecast(lambda: True))
    real, drift = auto_policy.make_plan, [False]

    def held(costs, *a, **kw):
        modes = kw.get("modes", ("snapshots", "deltas"))
        if not drift[0] or modes != ("snapshots", "deltas") or costs.delta_overhead_s is None:
            return real(costs, *a, **{**kw, "modes": ("snapshots",) if "snapshots" in modes
                                      else modes})
        p = real(costs, *a, **kw)
        snap = next(o for o in p.options if o.mode == "snapshots")
        deltas = dataclasses.replace(next(o for o in p.options if o.mode == "deltas"),
                                     goodput=snap.goodput + gain)
        return dataclasses.replace(p, chosen=deltas, options=(deltas, snap))
    monkeypatch.setattr(auto_policy, "make_plan", held)
    model, opt = _model()
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, policy="auto", measure_steps=4, mtbf_s=60.0)
    ck.restore()
    it = 0
    while ck.meter.count("delta_ratio") == 0 or ck.plan() is None:  # (both modes measured)
        it += 1
        _step(model, ck, opt, it)
        assert it < 200
    assert ck.mode == ck.plan().mode == "snapshots"
    drift[0] = True
    monkeypatch.setattr(auto_policy, "drifted", lambda old, new: True)
    for _ in range(17):  # (a drift check every 16 steps)
        it += 1
        _step(model, ck, opt, it)
    assert ck.mode == ck.plan().mode == mode
    kept = [n for n in ck.plan().notes if n.startswith("kept snapshots: deltas would gain")]
    assert len(kept) == (mode == "snapshots"), ck.plan().notes
    if kept:
        assert "+0.0010" in kept[0]
    ck.close()
    store.close()


def test_a_resumed_process_takes_no_samples_while_it_warms_up(tmp_path, one_mode):
    """A restarted process plans from the persisted medians (one sample of each cost) and takes
    no step or snapshot window as a sample for RESUME_WARMUP_STEPS steps: measured, a fresh
    process's first windows ran 3-4x slower and outvoted the persisted sample at the first drift
    check (16 steps in), which re-planned. Samples come again after the warm-up."""
    store, _, _ = _planned_store(tmp_path / "s", "snapshots", mtbf_s=600.0)
    model, opt, ck = _restart(store, 600.0)
    latest = ck.restore()
    seeded = {k: ck.meter.count(k) for k in ("plain", "snapshot_cost")}
    assert seeded["plain"] == 1 and seeded["snapshot_cost"] <= 1   # (the persisted medians)
    it = latest
    for _ in range(auto_policy.RESUME_WARMUP_STEPS):
        it += 1
        out = _step(model, ck, opt, it)
        if out is not None:
            out.result()  # (durable within its own step: its window closes at the next)
    assert {k: ck.meter.count(k) for k in seeded} == seeded
    for _ in range(8):
        it += 1
        out = _step(model, ck, opt, it)
        if out is not None:
            out.result()
    assert ck.meter.count("snapshot_cost") > seeded["snapshot_cost"]
    assert ck.meter.count("plain") > seeded["plain"]
    ck.close()
    store.close()
