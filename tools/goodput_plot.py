"""The goodput simulator's sweep, drawn and tabulated (``tools/goodput.py --plot PNG [--e2e FILE]``).

:func:`plot` draws goodput and work lost per failure against the failure rate (one line per
strategy over the Poisson sweep, the traces as markers) and, given the end-to-end points of a
``bench_goodput.py --json`` run (:func:`goodput_e2e.e2e_means`), a third panel: each measured
job group's goodput against the simulator's for the same jobs, so the model's distance from real
runs is on the same page. :func:`sweep_table` is the sweep as text, with how far
``ckptstore-auto`` is from the best peer at each rate. Takes results, computes nothing new.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness  # tools/harness.py (tables)
from goodput_traces import llama3_rate_per_hour

#: the other checkpointing systems (every strategy not ckptstore's)
PEERS = ("torch.save", "dcp-async", "pccheck")
#: bench_goodput's strategy names -> the simulator's strategy of the same kind (same colour)
E2E_AS_SWEEP = {"ckpt-snapshots": "ckptstore-snapshots", "ckpt-auto": "ckptstore-auto",
                "ckpt-deltas": "ckptstore"}
MARKERS = "osD^v<>p"


def sweep_table(sweep: dict[str, list[tuple[float, Any]]]) -> str:
    """Goodput per rate (rows) and strategy (columns); with ckptstore-auto and a peer swept,
    a last column: auto minus the best peer at that rate."""
    names = list(sweep)
    peers = [s for s in names if s in PEERS]
    auto = "ckptstore-auto" in sweep and bool(peers)
    rows = []
    for k, (rate, _) in enumerate(next(iter(sweep.values()))):
        row = [f"{rate:.3g}"] + [f"{sweep[s][k][1].goodput:.4f}" for s in names]
        if auto:
            best = max(peers, key=lambda s: sweep[s][k][1].goodput)
            diff = sweep["ckptstore-auto"][k][1].goodput - sweep[best][k][1].goodput
            row.append(f"{diff:+.4f} ({best})")
        rows.append(row)
    return harness.table(["failures/h", *names] + (["auto - best peer"] if auto else []), rows,
                         left=None)


def plot(path: str | os.PathLike, sweep: dict[str, list[tuple[float, Any]]],
         points: dict[str, list[tuple[str, float, Any]]], title: str,
         e2e: Sequence[dict] | None = None, e2e_title: str = "", markers: str = "traces",
         marker_prefix: str = "trace: ") -> None:
    """Goodput and lost work per failure against the failure rate: one line per strategy over the
    Poisson sweep, ``points`` as markers (``markers`` says what they are on the axes, e.g.
    "traces", simulated, or measured jobs; ``marker_prefix`` starts their legend); with ``e2e`` (dicts with scenario, strategy, e2e and sim goodput), a third
    panel of measured against simulated goodput."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if e2e else 2, figsize=(18 if e2e else 12, 4.8),
                             constrained_layout=True)
    ax_g, ax_l = axes[0], axes[1]
    colors = {strategy: f"C{k}" for k, strategy in enumerate(sweep)}
    # (one marker per scenario on every panel: the e2e panel's scenarios too)
    trace_names = sorted({name for pts in points.values() for name, _, _ in pts} |
                         {p["scenario"] for p in e2e or ()})
    for strategy, series in sweep.items():
        color = colors[strategy]
        line = "--" if strategy == "ckptstore-auto" else "-"   # (it often runs the snapshots' line)
        xs = [rate for rate, _ in series]
        ax_g.plot(xs, [r.goodput for _, r in series], line, color=color, label=strategy)
        lx = [(rate, r.lost_per_failure_s) for rate, r in series if r.failures]
        ax_l.plot([x for x, _ in lx], [y for _, y in lx], line, color=color, label=strategy)
        for name, rate, r in points.get(strategy, []):
            m = MARKERS[trace_names.index(name) % len(MARKERS)]
            ax_g.plot([rate], [r.goodput], m, color=color, mfc="none", ms=7)
            if r.failures:
                ax_l.plot([rate], [r.lost_per_failure_s], m, color=color, mfc="none", ms=7)
    for k, name in enumerate(trace_names):
        if any(name == n for pts in points.values() for n, _, _ in pts):
            ax_g.plot([], [], MARKERS[k % len(MARKERS)], color="k", mfc="none",
                      label=f"{marker_prefix}{name}")
    for ax in (ax_g, ax_l):
        ax.set_xscale("log")
        ax.set_xlabel(f"job failures per hour (lines: Poisson; markers: {markers})")
        ax.grid(True, which="both", alpha=0.3)
        top = ax.secondary_xaxis("top", functions=(lambda r: r / llama3_rate_per_hour(1),
                                                   lambda g: g * llama3_rate_per_hour(1)))
        top.set_xlabel("GPUs in the job at LLaMA 3's failure rate per GPU")
    ax_g.set_ylabel("goodput (useful training time / wall time)")
    ax_l.set_ylabel("work lost per failure (s)")
    ax_l.set_yscale("log")
    ax_g.legend(fontsize=8, loc="lower left")
    if e2e:
        _e2e_panel(axes[2], e2e, colors, e2e_title, trace_names)
    fig.suptitle(textwrap.fill(title, 200), fontsize=9)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _e2e_panel(ax: Any, e2e: Sequence[dict], colors: dict[str, str], title: str,
               order: Sequence[str]) -> None:
    """Measured (x) against simulated (y) goodput per scenario (marker) and strategy (colour,
    that of the sweep's strategy of the same kind), with the diagonal where they agree."""
    scenarios = [sc for sc in order if any(p["scenario"] == sc for p in e2e)]
    strategies = list(dict.fromkeys(p["strategy"] for p in e2e))
    extra = iter(f"C{k}" for k in range(len(colors), len(colors) + len(strategies)))
    color = {s: colors.get(E2E_AS_SWEEP.get(s, s)) or next(extra) for s in strategies}
    for p in e2e:
        ax.plot([p["e2e"]], [p["sim"]], MARKERS[order.index(p["scenario"]) % len(MARKERS)],
                color=color[p["strategy"]], mfc="none", ms=7)
    vals = [v for p in e2e for v in (p["e2e"], p["sim"])]
    lo, hi = min(vals) - 0.02, max(vals) + 0.02
    ax.plot([lo, hi], [lo, hi], "-", color="0.6", lw=1, label="simulated = measured")
    for s in strategies:
        ax.plot([], [], "s", color=color[s], label=s)
    for sc in scenarios:
        ax.plot([], [], MARKERS[order.index(sc) % len(MARKERS)], color="k", mfc="none", label=sc)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("measured goodput (real SIGKILLs, mean of repeats)")
    ax.set_ylabel("simulated goodput (same jobs and failures, pooled costs)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
