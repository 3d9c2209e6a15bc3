"""Issue 30's end-to-end targets judged on a tools/bench_goodput.py run (its JSON's jobs):

1. goodput of ``ckpt-auto`` >= every peer's (the strategies not named ``ckpt-*``), judged two
   ways per scenario: by the mean in-job goodput over the rounds (the expected goodput; each
   round runs every strategy on the same failure schedule) and round by round, paired (the
   rounds auto is at or above every peer, and by how much it trails in the others);
2. work lost per failure of ``ckpt-auto`` <= the lowest of the peers' (means over every failure
   of the scenario's jobs).

In-job goodput (bench_goodput's ``goodput_in_job``) charges each job against its own plain
steps, so a round's drift of the machine's speed cancels out of it. Usage::

    python tools/goodput_targets.py [--judged STRATEGY] RUN.json [RUN.json ...]

prints each run's table and, for several runs, the totals over them (``--judged``: another of
ckptstore's strategies in ``ckpt-auto``'s place, e.g. ``ckpt-snapshots``; a run without it is
skipped). bench_goodput prints the same table at the end of a run. The runs the docs quote are
in tools/data/ (tools/data/README.md).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (tools/harness.py: tables)

#: the strategy judged, and what makes a strategy one of ckptstore's own (not a peer)
JUDGED = "ckpt-auto"
OWN_PREFIX = "ckpt-"


def _finite_mean(values: Sequence[float]) -> float:
    xs = [x for x in values if isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.fmean(xs) if xs else math.nan


def judge(jobs: Sequence[dict], judged: str = JUDGED) -> list[dict]:
    """One verdict per scenario that ran ``judged`` and at least one peer, in the jobs' order:
    ``mean`` (judged's mean in-job goodput), ``best_peer`` and ``best_peer_mean``,
    ``mean_margin`` (mean - best peer's mean), ``rounds`` (rounds where every strategy ran),
    ``rounds_met`` (rounds judged was at or above every peer), ``misses`` (by how much it
    trailed the round's best peer in the others, largest first), ``lost_s`` (judged's mean
    work lost per failure), ``peer_lost_s`` and ``lowest_lost_peer`` (the lowest of the
    peers'; NaN / "" when no peer met a failure), ``failures`` (judged's)."""
    by: dict[str, dict[int, dict[str, dict]]] = {}
    for j in jobs:
        by.setdefault(j["scenario"], {}).setdefault(j["repeat"], {})[j["strategy"]] = j
    out = []
    for scenario, rounds in by.items():
        mine = [r[judged] for r in rounds.values() if judged in r]
        peers = sorted({s for r in rounds.values() for s in r if not s.startswith(OWN_PREFIX)})
        if not mine or not peers:
            continue
        means = {s: _finite_mean([r[s]["goodput_in_job"] for r in rounds.values() if s in r])
                 for s in peers}
        best_peer = max(peers, key=lambda s: means[s] if math.isfinite(means[s]) else -math.inf)
        mean = _finite_mean([j["goodput_in_job"] for j in mine])
        met, misses, n = 0, [], 0
        for r in rounds.values():
            if judged not in r or any(s not in r for s in peers):
                continue
            g = r[judged]["goodput_in_job"]
            best = max(r[s]["goodput_in_job"] for s in peers)
            if not (math.isfinite(g) and math.isfinite(best)):
                continue
            n += 1
            if g >= best:
                met += 1
            else:
                misses.append(best - g)

        def lost(strategy: str) -> float:
            return _finite_mean([f["lost_s"] for r in rounds.values() if strategy in r
                                 for f in r[strategy]["failures_detail"]])
        peer_lost = {s: lost(s) for s in peers}
        lowest = [s for s in peers if math.isfinite(peer_lost[s])]
        lowest_peer = min(lowest, key=lambda s: peer_lost[s]) if lowest else ""
        out.append({"scenario": scenario, "mean": mean, "best_peer": best_peer,
                    "best_peer_mean": means[best_peer], "mean_margin": mean - means[best_peer],
                    "rounds": n, "rounds_met": met, "misses": sorted(misses, reverse=True),
                    "lost_s": lost(judged), "lowest_lost_peer": lowest_peer,
                    "peer_lost_s": peer_lost[lowest_peer] if lowest_peer else math.nan,
                    "failures": sum(j["failures"] for j in mine)})
    return out


def _lost_ok(v: dict) -> bool:
    """Whether verdict ``v``'s work lost per failure is at or below the peers' lowest (met
    where no peer met a failure)."""
    return not math.isfinite(v["peer_lost_s"]) or v["lost_s"] <= v["peer_lost_s"]


def verdict_table(verdicts: Sequence[dict], judged: str = JUDGED) -> str:
    """The verdicts as a markdown table, then one line per target over every scenario."""
    rows = []
    for v in verdicts:
        rows.append([v["scenario"], f"{v['mean']:.3f}", f"{v['best_peer_mean']:.3f} {v['best_peer']}",
                     f"{v['mean_margin']:+.3f}", f"{v['rounds_met']} of {v['rounds']}",
                     ", ".join(f"{m:.3f}" for m in v["misses"]) or "-",
                     f"{v['lost_s']:.2f}", f"{v['peer_lost_s']:.2f} {v['lowest_lost_peer']}"
                     if v["lowest_lost_peer"] else "-", "yes" if _lost_ok(v) else "NO",
                     str(v["failures"])])
    table = harness.table(["scenario", f"{judged} mean", "best peer mean", "margin",
                           "rounds >= every peer", "misses", "lost s/failure",
                           "peers' lowest", "lost <= peers'", "failures"], rows, left=1)
    by_mean = sum(v["mean_margin"] >= 0 for v in verdicts)
    by_round = sum(v["rounds_met"] for v in verdicts)
    rounds = sum(v["rounds"] for v in verdicts)
    lost = sum(_lost_ok(v) for v in verdicts)
    return (f"{table}\n{judged} >= every peer: by mean in {by_mean} of {len(verdicts)} scenarios, "
            f"round by round in {by_round} of {rounds}; lost work per failure <= the peers' "
            f"lowest in {lost} of {len(verdicts)}")


def totals(runs: Sequence[Sequence[dict]], judged: str = JUDGED) -> str:
    """One paragraph over several runs' verdicts: (scenario, run) cells at or above the best
    peer by mean (and the margins' range), rounds at or above every peer (and the misses: how
    many, under 0.01, the largest), cells whose lost work per failure is <= the peers' lowest."""
    cells = [v for vs in runs for v in vs]
    margins = [v["mean_margin"] for v in cells]
    misses = sorted((m for v in cells for m in v["misses"]), reverse=True)
    lost = sum(_lost_ok(v) for v in cells)
    small = sum(m < 0.01 for m in misses)
    return (f"over {len(runs)} runs, {judged} >= every peer: by mean in "
            f"{sum(m >= 0 for m in margins)} of {len(cells)} (scenario, run) cells (margins "
            f"{min(margins):+.3f} to {max(margins):+.3f}); round by round in "
            f"{sum(v['rounds_met'] for v in cells)} of {sum(v['rounds'] for v in cells)} rounds "
            f"({len(misses)} missed, {small} of them by under 0.01"
            + (f", the largest by {misses[0]:.3f}" if misses else "") + "); lost work per failure "
            f"<= the peers' lowest in {lost} of {len(cells)} cells")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    judged = JUDGED
    if args[:1] == ["--judged"]:
        judged, args = (args[1], args[2:]) if len(args) > 1 else ("", [])
    if not args or not judged:
        print(__doc__)
        return 2
    runs = []
    for path in args:
        with open(path) as f:
            doc = json.load(f)
        if not any(j["strategy"] == judged for j in doc["jobs"]):
            print(f"{path}: no {judged} jobs, skipped")
            continue
        verdicts = judge(doc["jobs"], judged)
        runs.append(verdicts)
        print(f"{path} ({doc.get('date', '?')}, {len(doc['jobs'])} jobs):")
        print(verdict_table(verdicts, judged))
    if len(runs) > 1:
        print(totals(runs, judged))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
