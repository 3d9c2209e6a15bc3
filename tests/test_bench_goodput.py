"""tools/bench_goodput.py (issue 30): its pure pieces, the peers' checkpoint round trips, one tiny
job killed and restored for real, and tools/goodput.py's calibration against its JSON.

tools/ is not a package: the scripts are imported from their paths. No test asserts a
performance number."""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import sys
import threading
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod   # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


goodput = _load("goodput")
goodput_e2e = _load("goodput_e2e")
bg = _load("bench_goodput")
TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--vocab", "64", "--ctx", "8", "--batch", "2"]
BAMBOO = "0,add,node1\n0,add,node2\n60000,remove,node1\n60000,remove,node2\n120000,add,node3\n" \
         "180000,remove,node3\n200000,remove,node1\n240000,add,node4\n"


def tiny_model():
    from bench_delta import add_model_args, build
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    margs = ap.parse_args(TINY)
    return margs, *build(margs)


def train(margs, model, opt, its) -> None:
    from bench_delta import fwd_bwd
    for it in its:
        fwd_bwd(model, margs, it)
        opt.step()
        opt.zero_grad()


# ---- pure pieces ---------------------------------------------------------------------------------
def test_compressed_trace_keeps_its_shape_and_hits_the_mtbf(tmp_path):
    tr = goodput.load_trace(_write(tmp_path / "spot-trace.csv", BAMBOO))
    c = bg.compress_trace(tr, 10.0)
    assert c.mtbf_s == pytest.approx(10.0)
    k = tr.period_s / c.period_s
    assert [f * k for f in c.failures] == pytest.approx(list(tr.failures))
    assert c.resolution_s * k == pytest.approx(tr.resolution_s)
    with pytest.raises(ValueError):
        bg.compress_trace(tr, 0.0)


def test_schedules_are_goodputs_draws_cut_at_the_horizon(tmp_path):
    _write(tmp_path / "spot-trace.csv", BAMBOO)
    scs = bg.make_scenarios(tmp_path, ["spot-trace.csv"], 10.0, [6.0])
    assert [s.name for s in scs] == ["spot (MTBF 10 s)", "Poisson (MTBF 6 s)"]
    assert [s.mtbf_s for s in scs] == pytest.approx([10.0, 6.0])
    for sc in scs:
        times = bg.failure_schedule(sc, seed=3, run=1, horizon_s=100.0)
        assert times and all(0 < t <= 100.0 for t in times) and times == sorted(times)
        ref = sc.failure_times(3, 1)
        assert times == [next(ref) for _ in times]
    doc = {"args": {"trace_dir": str(tmp_path), "traces": ["spot-trace.csv"], "trace_mtbf": 10.0,
                    "poisson_mtbf": [6.0]}}
    rebuilt = goodput_e2e.e2e_scenarios(doc)
    assert list(rebuilt) == [s.name for s in scs]
    for sc in scs:
        a, b = rebuilt[sc.name].failure_times(0, 0), sc.failure_times(0, 0)
        assert [next(a) for _ in range(5)] == [next(b) for _ in range(5)]


def test_goodput_arithmetic_and_spread():
    assert bg.goodput_of(100, 0.1, 20.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        bg.goodput_of(100, 0.1, 0.0)
    s = bg.spread([3.0, 1.0, 2.0, float("nan")])
    assert (s["median"], s["mean"], s["min"], s["max"], s["n"]) == (2.0, 2.0, 1.0, 3.0, 3)
    assert bg.spread([])["n"] == 0 and math.isnan(bg.spread([])["median"])


def test_every_n_is_young_daly_on_the_calibrated_all_in_cost():
    calib = {"step_s": 0.1, "torch_save_cost_s": 0.05, "dcp_cost_s": 0.2, "pccheck_cost_s": 0.0,
             "ckpt_cost_s": 0.05, "torch_save_s": 9.0, "dcp_block_s": 9.0, "ckpt_stall_s": 9.0}
    assert bg.every_for("torch.save", calib, 10.0) == 10          # sqrt(2 * 0.05 * 10) = 1 s
    assert bg.every_for("dcp-async", calib, 10.0) == 20           # sqrt(4) = 2 s
    assert bg.every_for("pccheck", calib, 10.0) == 1              # a free copy: every step
    assert bg.every_for("ckpt-deltas", calib, 10.0) == 1


def test_lost_work_is_counted_from_where_training_went_on_after_the_restored_checkpoint():
    res = bg.JobResult("x", "s", 0, 100, 10)
    killed = {"t": 5.0, "at": 105.0, "last_it": 17, "started": True,
              "reach": {4: 100.0, 10: 102.0, 17: 104.5}}
    bg.record_failure(res, killed, 10, 106.0)
    f = res.failures[0]
    assert (f["lost_s"], f["lost_it"], f["resume_s"], f["during_resume"]) == (3.0, 7, 1.0, False)
    # killed while resuming: nothing more is lost, the resume counts
    bg.record_failure(res, {"t": 6.0, "at": 106.5, "last_it": None, "started": False, "reach": {}},
                      10, 107.0)
    assert res.failures[1]["lost_s"] == 0 and res.failures[1]["during_resume"]
    assert not res.errors


def test_a_job_s_own_plain_steps_exclude_checkpoints_in_flight_and_warm_ups():
    """clean_plain_steps: steps that wrote nothing, were not a process' first and overlapped no
    checkpoint between its step and its durability (none: until the process ended)."""
    steps = [(1, 0.50, False, 1.0, 0),   # a process' first step: warm-up
             (2, 0.10, False, 1.1, 0),   # clean
             (3, 0.12, True, 1.22, 0),   # checkpoints: durable at 1.45
             (4, 0.15, False, 1.37, 0),  # in its window
             (5, 0.10, False, 1.47, 0),  # started at 1.37 < 1.45: in its window
             (6, 0.11, False, 1.58, 0),  # clean
             (7, 0.12, True, 1.70, 0),   # never durable (killed): the rest of the process is out
             (8, 0.10, False, 1.80, 0),
             (8, 0.40, False, 3.0, 1),   # the next process: warm-up
             (9, 0.09, False, 3.09, 1)]  # clean: the killed process' checkpoint is not its own
    assert bg.clean_plain_steps(steps, [(3, 1.45, 0)]) == [0.10, 0.11, 0.09]
    # a durable event of another process does not close this one's checkpoint
    assert bg.clean_plain_steps(steps, [(3, 1.45, 1)]) == [0.10, 0.09]
    assert bg.clean_plain_steps(steps, []) == [0.10, 0.09]


def test_fit_replay_recovers_base_and_per_delta_cost():
    loads = [(30 * k + d, 0.2 + 0.05 * d) for k in range(3) for d in (0, 5, 12, 29)]
    base, replay = goodput_e2e.fit_replay(loads, 30)
    assert base == pytest.approx(0.2) and replay == pytest.approx(0.05)
    assert goodput_e2e.fit_replay([(7, 0.3), (7, 0.5)], 30) == pytest.approx((0.4, 0.0))
    assert goodput_e2e.fit_replay([], 30) == (0.0, 0.0)


# ---- the peers' checkpoints round trip (in process, tiny model) ----------------------------------
@pytest.mark.parametrize("kind", ["torch.save", "pccheck", "dcp-async"])
def test_peer_checkpoint_restores_the_exact_state(tmp_path, kind):
    margs, model, opt = tiny_model()
    durable = threading.Event()
    cls = bg.CHILD_STRATEGIES[kind]
    cfg = {"dir": str(tmp_path), "every": 3, "inflight": 2, "strategy": kind}
    st = cls(cfg, model, opt, lambda ev, **kw: ev == "durable" and kw["i"] == 3 and durable.set())
    from bench_delta import fwd_bwd
    for it in (1, 2, 3):
        fwd_bwd(model, margs, it)
        st.step(it)
        opt.zero_grad()
    assert durable.wait(30)
    if kind == "dcp-async":
        st.fut.result()
    want = bg.params_hash(model)
    want_opt = [t.clone() for t in bg.adam_state_tensors(model, opt)]
    _, model2, opt2 = tiny_model()
    assert bg.params_hash(model2) != want
    assert cls(cfg, model2, opt2, lambda *a, **k: None).restore() == 3
    assert bg.params_hash(model2) == want
    got = bg.adam_state_tensors(model2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(want_opt, got))
    # and training on from it matches training on from the original
    train(margs, model, opt, [4])
    train(margs, model2, opt2, [4])
    assert bg.params_hash(model2) == bg.params_hash(model)


@pytest.mark.parametrize("kind", ["torch.save", "pccheck", "dcp-async", "ckpt-snapshots"])
def test_every_strategy_s_all_in_cost_is_measured_alike(tmp_path, kind):
    """The calibration's cost of one checkpoint, for each every-N strategy, from windows of
    steps that end when the checkpoint is durable: a number >= 0 for each (what it is on this
    machine is a benchmark's business, not a test's)."""
    from bench_delta import fwd_bwd
    margs, model, opt = tiny_model()
    cfg = {"dir": str(tmp_path), "inflight": 2, "strategy": kind, "mtbf_s": 60.0, "base_every": 30}
    cost = bg.all_in_cost(bg.CHILD_STRATEGIES[kind], cfg, model, opt, margs, fwd_bwd, windows=2,
                          period=8, stall_s=1e-3)
    assert math.isfinite(cost) and cost >= 1e-3


# ---- one tiny job, killed and restored for real --------------------------------------------------
@pytest.mark.slow  # a zygote imports torch, DCP and ckptstore: 5-20 s on the shared 2-core VM
@pytest.mark.parametrize("strategy", ["torch.save", "ckpt-snapshots", "ckpt-auto"])
def test_a_killed_job_resumes_from_a_verified_checkpoint(tmp_path, strategy):
    """A job SIGKILLed 0.05 s into its training restarts in a new process that restores a
    checkpoint whose parameters hash as the plain run's at that iteration, and ends on the
    plain run's final state."""
    z = bg.Zygote(bg.child_env(1), tmp_path, TINY)
    try:
        base = {"model": TINY, "threads": 1, "iterations": 200, "base_every": 30, "inflight": 2,
                "mtbf_s": 60.0}
        (tmp_path / "p").mkdir()
        ref = bg.run_job(dict(base, strategy="plain", dir=str(tmp_path / "p"), every=0), [], None,
                         timeout_s=120, zygote=z)
        assert not ref.errors and set(ref.hashes) == set(range(201))
        (tmp_path / "j").mkdir()
        r = bg.run_job(dict(base, strategy=strategy, dir=str(tmp_path / "j"), every=5,
                            scenario="t"), [0.05], ref.hashes, timeout_s=120, zygote=z)
    finally:
        z.close()
    assert not r.errors, r.errors
    assert len(r.failures) == 1 and r.final_ok
    assert [x["ok"] for x in r.restores] == [True, True]
    assert r.wall_s > 0.05
    if strategy != "ckpt-auto":  # (auto's interval is its plan's)
        assert r.restores[1]["i"] % 5 == 0
    s = bg.job_summary(r, step_plain_s=0.01)
    assert s["failures"] == 1 and s["restores_ok"] == 2 and s["goodput"] > 0


# ---- goodput.py --from-e2e -----------------------------------------------------------------------
def test_simulator_replays_an_e2e_job_on_its_schedule(tmp_path):
    sc = goodput.Scenario("Poisson (MTBF 6 s)", rate_per_hour=600.0)
    st = goodput.Strategy("torch.save", 10, 0.1, stall_s=0.05, load_s=0.2, restart_s=0.1)
    sim = goodput.simulate(st, 200, 0.1, sc.failure_times(0, 0))
    times = sc.failure_times(0, 0)
    job = {"strategy": "torch.save", "scenario": sc.name, "repeat": 0, "every": 10,
           "iterations": 200, "step_plain_s": 0.1, "step_s": 0.1, "stall_s": 0.05,
           "checkpoints": 20, "persist_s": 0.0, "loads": [(10, 0.2)], "load_s": 0.2,
           "resume_s_per_failure": 0.3, "failures": sim.failures, "plans": [],
           "goodput": sim.goodput - 0.002, "lost_s_per_failure": sim.lost_per_failure_s,
           "wall_s": sim.wall_s,
           "schedule_s": [next(times) for _ in range(sim.failures)]}
    doc = {"args": {"trace_dir": str(tmp_path), "traces": [], "trace_mtbf": 10.0,
                    "poisson_mtbf": [6.0], "seed": 0, "base_every": 30, "inflight": 4},
           "jobs": [job], "date": "d", "machine": "m"}
    rows = goodput_e2e.calibrate_e2e(doc)
    assert rows[0]["sim"] == pytest.approx(sim.goodput)
    text = goodput_e2e.e2e_report(doc, rows)
    assert "+0.002" in text and "torch.save: step x1.000, stall 50.0 ms" in text
    job["schedule_s"][0] += 1.0
    with pytest.raises(ValueError, match="schedule"):
        goodput_e2e.calibrate_e2e(doc)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_rng_free():
    # the pure pieces draw from seeded generators only: two calls agree
    sc = goodput.Scenario("p", rate_per_hour=360.0)
    assert bg.failure_schedule(sc, 1, 2, 50.0) == bg.failure_schedule(sc, 1, 2, 50.0)
    random.seed(5)
    assert bg.failure_schedule(sc, 1, 2, 50.0) == bg.failure_schedule(sc, 1, 2, 50.0)
