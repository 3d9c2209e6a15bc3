"""Whether deltas could pay before one is measured (ckptstore/torch/delta_forecast.py): the
break-even overhead is where the deltas option stops beating the snapshot plan, the floor is a
snapshot's cost per byte scaled to the gradients' bytes, and deltas are measured only below the
break-even."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ckptstore.torch.delta_forecast import DELTA_FLOOR_PER_BYTE, forecast_deltas, with_deltas
from ckptstore.torch.plan import DELTAS, SNAPSHOTS, Costs, plan

#: the bench_goodput model on the 2-core VM (27M GPT, AdamW, 2026-11-29): a ~100 ms step, an
#: overlapped snapshot of ~330 MB costing 25 ms all in
BENCH = Costs(step_s=0.1, snapshot_stall_s=0.005, snapshot_slowdown_s=0.02,
              snapshot_persist_s=0.2, snapshot_bytes=330 << 20, replay_s=0.02, load_s=0.3,
              restart_s=2.0)


def _deltas_goodput(c: Costs, share: float, overhead_s: float, mtbf: float) -> float:
    return plan(with_deltas(c, share, overhead_s), mtbf, modes=(DELTAS,)).goodput


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=st.floats(1e-3, 1.0), cost=st.floats(1e-4, 1.0), persist=st.floats(0.0, 5.0),
       replay=st.floats(0.0, 0.5), load=st.floats(0.0, 30.0), restart=st.floats(0.0, 60.0),
       share=st.floats(0.05, 1.0), mtbf=st.floats(1.0, 1e6))
def test_breakeven_is_where_deltas_stop_beating_the_snapshot_plan(step, cost, persist, replay,
                                                                  load, restart, share, mtbf):
    c = Costs(step_s=step, snapshot_stall_s=cost / 2, snapshot_slowdown_s=cost / 2,
              snapshot_persist_s=persist, snapshot_bytes=10 ** 8, replay_s=replay, load_s=load,
              restart_s=restart, delta_overhead_s=0.5 * step)  # (ignored: deltas unmeasured)
    f = forecast_deltas(c, share, mtbf)
    snaps = plan(replace(c, delta_overhead_s=None), mtbf, modes=(SNAPSHOTS,)).goodput
    assert f.floor_s == pytest.approx(DELTA_FLOOR_PER_BYTE * cost * share)
    assert f.pays == (f.floor_s < f.breakeven_s and f.gain_s > f.measure_cost_s)
    if f.floor_s < f.breakeven_s:  # (what deltas at the floor gain over one MTBF)
        gain = _deltas_goodput(c, share, f.floor_s, mtbf) - snaps
        assert f.gain_s == pytest.approx(max(0.0, gain) * mtbf, rel=1e-9, abs=1e-12)
    else:
        assert f.gain_s == 0.0
    assert f.measure_cost_s >= 8 * f.floor_s
    if f.breakeven_s == 0:
        assert _deltas_goodput(c, share, 0.0, mtbf) <= snaps
    else:
        b = f.breakeven_s
        assert _deltas_goodput(c, share, b * (1 - 1e-6), mtbf) >= snaps - 1e-12
        if b < 1e3 * step:  # (the bisection's ceiling: deltas win at any overhead tried)
            assert _deltas_goodput(c, share, b * (1 + 1e-3) + 1e-12, mtbf) <= snaps + 1e-12


def test_the_benchmarks_costs_measure_deltas_only_where_failures_are_frequent():
    """On bench_goodput's costs with the 27M GPT a delta is predicted at >= 4 ms a step (a third
    of the bytes of a 25 ms snapshot, halved): worth measuring at an MTBF of 6 s (deltas pay under
    ~6 ms, and at 4 ms would gain more than measuring costs), not at 20 s (under ~1 ms) nor at a
    day (where snapshots every few hundred steps cost almost nothing)."""
    share = 1 / 3
    often, rare, day = (forecast_deltas(BENCH, share, m) for m in (6.0, 20.0, 86400.0))
    assert often.floor_s == rare.floor_s == pytest.approx(0.5 * 0.025 / 3)
    assert often.pays and 0.005 < often.breakeven_s < 0.02
    assert not rare.pays and 0 < rare.breakeven_s < often.breakeven_s
    assert not day.pays and day.breakeven_s < rare.breakeven_s
    assert str(often).startswith("measuring deltas: they would pay only under +")
    assert str(day).startswith("deltas not measured: ") and "33% of its bytes" in str(day)


def test_deltas_are_measured_only_where_the_measurement_pays_for_itself_within_an_mtbf():
    """Snapshots that cost 205 ms all in and a delta of 5% of their bytes (a floor of 5 ms): at
    an MTBF of 6 s deltas at the floor would gain more than measuring them costs (8 delta steps
    and the two switches' snapshots, less those the plan writes meanwhile); at 30 s they would
    still beat snapshots, by less than that: not measured."""
    c = replace(BENCH, snapshot_slowdown_s=0.2)
    often, rare = forecast_deltas(c, 0.05, 6.0), forecast_deltas(c, 0.05, 30.0)
    for f in (often, rare):
        assert f.floor_s < f.breakeven_s
        assert 8 * f.floor_s < f.measure_cost_s <= 8 * f.floor_s + 2 * c.snapshot_cost_s
    assert often.pays and often.gain_s > often.measure_cost_s
    assert not rare.pays and 0 < rare.gain_s < rare.measure_cost_s
    assert "gain" in str(rare) and "under the" in str(rare) and "over the" in str(often)
    assert forecast_deltas(c, 0.05, 6.0, measure_steps=64).measure_cost_s > often.measure_cost_s


def test_deltas_that_lose_even_free_are_never_measured():
    """Replaying a delta three times slower than training it, and a snapshot durable at once:
    deltas lose at no cost, and the forecast says so whatever the floor (unknown here)."""
    c = replace(BENCH, snapshot_persist_s=0.0, replay_s=0.3)
    f = forecast_deltas(c, None, 3600.0)
    assert (f.pays, f.breakeven_s, f.floor_s) == (False, 0.0, 0.0)
    assert "even at no cost" in str(f) and "predicted" not in str(f)


def test_without_a_measured_share_deltas_are_measured_wherever_they_could_pay():
    f = forecast_deltas(BENCH, None, 6.0)
    assert f.pays and f.floor_s == 0.0 and f.delta_share is None


def test_a_fixed_snapshot_interval_is_what_deltas_must_beat():
    """With ``snapshot_every`` given, the snapshot plan is that interval: a bad one (every step)
    leaves more room for deltas."""
    free = forecast_deltas(BENCH, 1 / 3, 20.0)
    fixed = forecast_deltas(BENCH, 1 / 3, 20.0, fixed={SNAPSHOTS: 1})
    assert fixed.breakeven_s > free.breakeven_s and fixed.pays


def test_bad_inputs_raise_as_the_planner_does():
    with pytest.raises(ValueError, match="mtbf_s"):
        forecast_deltas(BENCH, 0.3, 0.0)
    with pytest.raises(ValueError, match="step_s"):
        forecast_deltas(replace(BENCH, step_s=0.0), 0.3, 60.0)
