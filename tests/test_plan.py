"""The checkpoint planner (ckptstore/torch/plan.py): its choice against a brute-force search of
the same model, Young/Daly where it applies, and its refusals."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ckptstore.torch.plan import (DELTAS, SNAPSHOTS, CostMeter, Costs, SnapshotWindow, bounds,
                                  evaluate, plan)

MAX = 300  # max_interval for the brute force: small enough to try every interval


@st.composite
def costs(draw) -> Costs:
    f = st.floats
    step = draw(f(1e-3, 10.0))
    replayable = draw(st.booleans())
    return Costs(step_s=step,
                 snapshot_stall_s=draw(f(0.0, 5.0)),
                 snapshot_slowdown_s=draw(st.one_of(st.just(0.0), f(0.0, 5.0))),
                 snapshot_persist_s=draw(st.one_of(st.just(0.0), f(0.0, 50 * step))),
                 snapshot_bytes=draw(st.integers(0, 10 ** 10)),
                 delta_overhead_s=draw(f(0.0, step)) if replayable else None,
                 delta_overhead_margin_s=draw(st.one_of(st.just(0.0), f(0.0, step))),
                 delta_bytes=draw(st.integers(0, 10 ** 9)),
                 replay_s=draw(st.one_of(st.just(0.0), f(0.0, 2.0))),
                 load_s=draw(f(0.0, 60.0)),
                 restart_s=draw(f(0.0, 120.0)),
                 group_commit=draw(st.integers(1, 20)))


def brute_force(c: Costs, mtbf: float, budget: int | None):
    """Every (mode, interval) allowed, scored by the model: the best fitting goodput (of all
    when nothing fits anywhere, as the planner falls back)."""
    scored = []
    for mode in (SNAPSHOTS, DELTAS):
        if mode == DELTAS and c.delta_overhead_s is None:
            continue
        k = c.step_s + ((c.delta_overhead_s or 0.0) + c.delta_overhead_margin_s
                        if mode == DELTAS else 0.0)
        lo = max(1, math.ceil(c.snapshot_persist_s / k - 1e-12))
        for n in range(lo, max(lo, MAX) + 1):
            scored.append(evaluate(c, mode, n, mtbf, budget))
    fitting = [o for o in scored if o.fits]
    return max(o.goodput for o in (fitting or scored)), bool(fitting)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=costs(), mtbf=st.floats(30.0, 1e7),
       budget=st.one_of(st.none(), st.integers(10 ** 6, 10 ** 12)))
def test_planner_matches_brute_force(c, mtbf, budget):
    p = plan(c, mtbf, budget, max_interval=MAX)
    best, any_fits = brute_force(c, mtbf, budget)
    assert p.goodput >= best - 1e-9 * max(1.0, best)
    assert p.chosen.fits == any_fits
    assert 0.0 <= p.goodput <= 1.0
    assert p.chosen is p.options[0]
    assert p.chosen.goodput == max(o.goodput for o in p.options if o.fits or not any_fits)
    for o in p.options:  # every interval within its bounds, every mode at its best
        b = bounds(c, o.mode, budget, MAX)
        if b is not None:
            assert b[0] <= o.interval <= b[1]
    if c.delta_overhead_s is None:
        assert p.mode == SNAPSHOTS and p.base_every is None and "replayed" in str(p)
    assert p.snapshot_every == (p.chosen.interval if p.mode == SNAPSHOTS else None)
    assert p.base_every == (p.chosen.interval if p.mode == DELTAS else None)
    assert p.mtbf_source in str(p)


def test_young_daly_when_the_stall_is_small():
    """stall << MTBF and nothing else: N*step ~ sqrt(2*C*MTBF)."""
    c = Costs(step_s=0.1, snapshot_stall_s=0.5)
    for mtbf in (3600.0, 86400.0):
        n = plan(c, mtbf).snapshot_every
        assert n is not None
        assert n * 0.1 == pytest.approx(math.sqrt(2 * 0.5 * mtbf), rel=0.02)


def test_the_slowdown_is_charged_as_part_of_a_snapshots_cost():
    """A snapshot whose persister slows the steps it overlaps costs its stall plus that slowdown:
    Young/Daly on the sum, not on the stall (which checkpointed 3-4x too often end to end)."""
    stall_only = plan(Costs(step_s=0.1, snapshot_stall_s=0.01), 3600.0)
    slowed = plan(Costs(step_s=0.1, snapshot_stall_s=0.01, snapshot_slowdown_s=0.08), 3600.0)
    assert slowed.snapshot_every * 0.1 == pytest.approx(math.sqrt(2 * 0.09 * 3600.0), rel=0.02)
    assert slowed.snapshot_every == pytest.approx(3 * stall_only.snapshot_every, rel=0.05)
    assert slowed.goodput < stall_only.goodput
    assert "slowdown 80.0 ms" in str(slowed)
    with pytest.raises(ValueError, match="snapshot_slowdown_s"):
        plan(Costs(step_s=0.1, snapshot_stall_s=0.01, snapshot_slowdown_s=-1.0), 60.0)


def _steps(window, meter, kinds_dts):
    for kind, dt in kinds_dts:
        window.step(kind, dt, meter)


def test_snapshot_window_charges_the_steps_a_snapshot_overlaps():
    """Steps run 100 ms plain; a snapshot's own step takes 130 ms, the two after it 150 and
    120 ms until it is durable: one "snapshot_cost" sample of 30 + 50 + 20 = 100 ms, and only
    the steps outside the window are plain samples."""
    m, w = CostMeter(), SnapshotWindow()
    _steps(w, m, [("plain", 0.1)] * 4)
    w.submitted(whole=True)
    _steps(w, m, [("base", 0.13), ("plain", 0.15)])
    w.durable()
    _steps(w, m, [("plain", 0.12), ("plain", 0.1)])
    assert m.count("plain") == 5 and m.median("plain") == pytest.approx(0.1)
    assert m.count("snapshot_cost") == 1 and m.median("snapshot_cost") == pytest.approx(0.1)
    m.add("stall", 0.02)
    assert m.costs(replayable=False).snapshot_slowdown_s == pytest.approx(0.08)
    # two snapshots in flight at once share one window: the cost is split between them
    w.submitted(whole=True)
    _steps(w, m, [("base", 0.14)])
    w.submitted(whole=True)
    w.durable()
    _steps(w, m, [("base", 0.16)])
    w.durable()
    _steps(w, m, [("plain", 0.1)])
    assert m.count("snapshot_cost") == 3 and m.count("plain") == 5
    assert m.median("snapshot_cost") == pytest.approx(0.05)  # (0.1, 0.05, 0.05)


def test_snapshot_window_without_a_whole_window_or_medians():
    m, w = CostMeter(), SnapshotWindow()
    # a snapshot written outside a step (at restore) has no step of its own: no sample
    w.submitted(whole=False)
    _steps(w, m, [("delta", 0.2)])
    w.durable()
    _steps(w, m, [("delta", 0.2)])
    assert m.count("snapshot_cost") == 0
    # an interrupted window (a restore) gives none either
    w.submitted(whole=True)
    _steps(w, m, [("base", 0.3)])
    w.interrupt()
    w.durable()
    _steps(w, m, [("delta", 0.2)])
    assert m.count("snapshot_cost") == 0
    # with no median of the kind yet (only the bootstrap's), a window waits, then is taken
    m2, w2 = CostMeter(), SnapshotWindow()
    for _ in range(2):  # two windows, each of one snapshot's own step (no plain sample)
        w2.submitted(whole=True)
        w2.durable()
        _steps(w2, m2, [("base", 0.3)])
    assert m2.count("snapshot_cost") == 0 and m2.count("plain") == 0
    _steps(w2, m2, [("plain", 0.1)])
    assert m2.count("snapshot_cost") == 2 and m2.median("snapshot_cost") == pytest.approx(0.2)


def test_snapshot_window_bootstraps_plain_steps_when_none_runs_outside():
    """Snapshots so frequent that every step has one in flight: when a plan is due, the last
    plain steps that ran in windows are the samples (slowed), so a plan can still be made; and
    never while a clean sample exists."""
    m, w = CostMeter(), SnapshotWindow()
    for _ in range(6):  # (windows back to back, each closed)
        w.submitted(whole=True)
        _steps(w, m, [("base", 0.15), ("plain", 0.12)])
        w.durable()
    assert m.count("plain") == 0
    w.bootstrap("plain", m)
    assert m.count("plain") == SnapshotWindow.BOOTSTRAP
    assert m.median("plain") == pytest.approx(0.12)
    m2 = CostMeter()
    m2.add("plain", 0.1)
    w.bootstrap("plain", m2)
    assert m2.count("plain") == 1


def test_delta_overhead_follows_the_ratio_measured_beside_plain_steps():
    """Once a delta/plain ratio was measured, the overhead is the current plain step times it:
    a machine that slows down 30% (plain median up, the delta median stale) keeps the overhead
    of deltas, where the difference of the two medians said 0 and planned deltas."""
    m = CostMeter()
    for _ in range(3):
        m.add("plain", 0.100)
        m.add("delta", 0.110)
        m.add("stall", 0.01)
    assert m.costs(True).delta_overhead_s == pytest.approx(0.010)
    m.add("delta_ratio", 1.1)
    for _ in range(6):
        m.add("plain", 0.130)  # (the machine slowed; no delta step runs in the snapshots mode)
    assert m.costs(True).delta_overhead_s == pytest.approx(0.013)
    assert m.costs(False).delta_overhead_s is None


def test_standard_errors_of_medians_and_of_their_ratio():
    m = CostMeter()
    assert m.standard_error("plain") is None and m.ratio_standard_error("delta", "plain") is None
    for v in (0.100, 0.100, 0.100, 0.100):
        m.add("plain", v)
    assert m.standard_error("plain") == 0.0  # (no spread: a margin of 0)
    for v in (0.10, 0.12, 0.14, 0.16, 0.18):  # median 0.14, MAD 0.02
        m.add("delta", v)
    se_d = 1.2533 * 1.4826 * 0.02 / math.sqrt(5)
    assert m.standard_error("delta") == pytest.approx(se_d)
    assert m.ratio_standard_error("delta", "plain") == pytest.approx(se_d / 0.100)
    m.add("delta_ratio", 1.4)
    m.add("delta_ratio_se", 0.05)
    for _ in range(4):
        m.add("stall", 0.01)
    c = m.costs(True)
    assert c.delta_overhead_s == pytest.approx(0.04)
    assert c.delta_overhead_margin_s == pytest.approx(2.0 * 0.100 * 0.05)
    assert c.delta_step_extra_s == pytest.approx(0.05)
    assert m.costs(False).delta_overhead_margin_s == 0.0
    # both medians uncertain: their relative errors add in quadrature
    m2 = CostMeter()
    for v in (0.09, 0.10, 0.11):
        m2.add("plain", v)
        m2.add("delta", 1.5 * v)
    se = 1.2533 * 1.4826 * 0.01 / math.sqrt(3)
    assert m2.ratio_standard_error("delta", "plain") == pytest.approx(
        1.5 * math.hypot(1.5 * se / 0.15, se / 0.10))
    # no margin where deltas are impossible
    impossible = Costs(step_s=0.1, snapshot_stall_s=0.0, delta_overhead_margin_s=0.5)
    assert impossible.delta_step_extra_s == 0.0


def test_deltas_must_win_at_the_pessimistic_end_of_their_measurement():
    """Deltas whose measured overhead wins by less than its uncertainty are not planned: a wrong
    choice of deltas costs every step, a wrong choice of snapshots little."""
    c = Costs(step_s=0.1, snapshot_stall_s=0.005, snapshot_slowdown_s=0.015,
              snapshot_persist_s=0.05, delta_overhead_s=0.001, replay_s=0.005, load_s=0.1,
              restart_s=0.2)
    assert plan(c, 10.0).mode == DELTAS
    unsure = plan(replace(c, delta_overhead_margin_s=0.01), 10.0)
    assert unsure.mode == SNAPSHOTS
    assert "delta +1.0 ms/step (planned at +11.0" in str(unsure)
    assert "planned at" not in str(plan(c, 10.0))


def test_persist_bounds_the_interval_from_below():
    c = Costs(step_s=0.1, snapshot_stall_s=1e-4, snapshot_persist_s=3.0)  # YD alone: ~0.8 s
    p = plan(c, 3600.0)
    assert p.snapshot_every == 30  # 30 steps cover one persist: snapshots never queue


def test_deltas_win_when_failures_are_frequent_and_deltas_cheap():
    c = Costs(step_s=1.0, snapshot_stall_s=5.0, snapshot_persist_s=20.0, delta_overhead_s=0.01,
              replay_s=0.05, load_s=1.0)
    p = plan(c, 600.0)
    assert p.mode == DELTAS and p.base_every and p.goodputs()[DELTAS] > p.goodputs()[SNAPSHOTS]
    assert "snapshot every" in str(p)  # the alternative is explained
    # and snapshots win when the step overhead of deltas dominates
    q = plan(Costs(step_s=0.4, snapshot_stall_s=0.016, delta_overhead_s=0.04, replay_s=0.1), 86400.0)
    assert q.mode == SNAPSHOTS


def test_disk_budget_sets_retention_and_may_exclude_a_mode():
    c = Costs(step_s=0.5, snapshot_stall_s=0.02, snapshot_bytes=1000, delta_overhead_s=0.0,
              delta_bytes=100, replay_s=0.0)
    p = plan(c, 3600.0, 10_000)
    # (retention + 1) * unit <= budget, retention >= 1
    unit = 1000 if p.mode == SNAPSHOTS else 1000 + (p.chosen.interval - 1) * 100
    assert p.retention is not None and p.retention >= 1 and (p.retention + 1) * unit <= 10_000
    tiny = plan(c, 3600.0, 1500)  # not even two snapshots: chosen anyway, marked
    assert not tiny.chosen.fits and "disk budget" in str(tiny)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1h", None, True])
def test_bad_mtbf_is_refused(bad):
    with pytest.raises(ValueError, match="mtbf_s"):
        plan(Costs(step_s=0.1, snapshot_stall_s=0.01), bad)


def test_bad_costs_and_arguments_are_refused():
    with pytest.raises(ValueError, match="step_s"):
        plan(Costs(step_s=0.0, snapshot_stall_s=0.01), 60.0)
    with pytest.raises(ValueError, match="snapshot_stall_s"):
        plan(Costs(step_s=1.0, snapshot_stall_s=-1.0), 60.0)
    with pytest.raises(ValueError, match="disk_budget"):
        plan(Costs(step_s=1.0, snapshot_stall_s=0.0), 60.0, disk_budget=0)
    with pytest.raises(ValueError, match="modes"):
        plan(Costs(step_s=1.0, snapshot_stall_s=0.0), 60.0, modes=("weekly",))
    with pytest.raises(ValueError, match="no mode left"):
        plan(Costs(step_s=1.0, snapshot_stall_s=0.0), 60.0, modes=(DELTAS,))


def test_short_and_long_mtbfs_print_in_readable_units():
    c = Costs(step_s=0.1, snapshot_stall_s=0.01)
    assert "MTBF 5.0 s (given)" in str(plan(c, 5.0))  # not "0.00 h"
    assert "MTBF 3.00 h (given)" in str(plan(c, 3 * 3600.0))


def test_fixed_interval():
    p = plan(Costs(step_s=1.0, snapshot_stall_s=0.1), 3600.0, modes=(SNAPSHOTS,), fixed={SNAPSHOTS: 7})
    assert p.snapshot_every == 7 and len(p.options) == 1


def test_a_drift_keeps_the_mode_in_force_unless_the_other_gains_the_margin():
    from ckptstore.torch.plan import MODE_SWITCH_MARGIN, keep_mode
    costs = Costs(step_s=0.05, snapshot_stall_s=0.01, snapshot_persist_s=0.05,
                  delta_overhead_s=0.002, replay_s=0.02, load_s=0.05)
    p = plan(costs, 6.0)
    other = next(o for o in p.options if o is not p.chosen)

    def with_gain(gain, fits=True):
        # the same plan, the chosen option ahead of the other by ``gain``
        chosen = replace(p.chosen, goodput=other.goodput + gain)
        return replace(p, chosen=chosen, options=(chosen, replace(other, fits=fits)))

    assert keep_mode(with_gain(0.001), other.mode) == replace(other, fits=True)
    assert keep_mode(with_gain(MODE_SWITCH_MARGIN * 0.99), other.mode) is not None
    assert keep_mode(with_gain(MODE_SWITCH_MARGIN), other.mode) is None    # (gains enough)
    assert keep_mode(with_gain(0.001), p.chosen.mode) is None               # (nothing to switch)
    assert keep_mode(with_gain(0.001, fits=False), other.mode) is None      # (over the budget)
    only = plan(costs, 6.0, modes=(SNAPSHOTS,))
    assert keep_mode(only, DELTAS) is None                                  # (not an option)
