"""tools/harness.py, the benchmarks' shared harness: its pure pieces (statistics, rotated
interleaving, the standard CLI and --quick, the Markdown table, the JSON file). No test runs a
benchmark or asserts a performance number (tools/ is not a package: imported from its path)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import harness as h  # noqa: E402


def test_stats_median_mean_spread_stdev():
    st = h.Stats.of([3.0, 1.0, 2.0, 10.0])
    assert (st.n, st.median, st.mean, st.min, st.max) == (4, 2.5, 4.0, 1.0, 10.0)
    assert st.stdev == pytest.approx(4.0825, abs=1e-4)
    assert st.spread(".1f") == "1.0-10.0"
    assert h.Stats.of([5.0]).stdev == 0.0
    empty = h.Stats.of([])
    assert empty.n == 0 and math.isnan(empty.median) and empty.show() == "-"
    assert h.median([]) is None and h.median([4, 1, 2]) == 2


def test_interleave_rotates_the_order_each_round_and_keeps_every_sample():
    calls = []

    def run(name, r):
        calls.append((r, name))
        return {"a": 1.0, "b": [r], "c": None}[name]

    s = h.interleave(["a", "b", "c"], 3, run)
    assert [n for _, n in calls] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert s.values("a") == [1.0, 1.0, 1.0] and s.values("b") == [0.0, 1.0, 2.0]
    assert "c" not in s.rows  # None: nothing recorded
    assert [row["round"] for row in s.rows["b"]] == [0, 1, 2]
    s.add("d", 0, {"seconds": [0.5, 1.5], "bytes": 7})  # one call's several samples
    assert s.values("d") == [0.5, 1.5] and s.values("d", "bytes") == [7]
    assert s.aggregates()["a"]["median"] == 1.0


def test_standard_args_aliases_and_quick_keep_what_the_user_gave():
    def parse(*argv):
        ap = h.parser("tool: one line\n\nmore")
        ap.add_argument("--size", type=int, default=100)
        ap.add_argument("--tensors", type=int, default=10)
        h.add_standard_args(ap, rounds=3, aliases=("--repeat",))
        a = ap.parse_args(argv)
        h.quick(a, ap, size=1, tensors=2, rounds=1)
        return a

    assert vars(parse()) == {"size": 100, "tensors": 10, "rounds": 3, "json": None,
                             "quick": False}
    assert (parse("--repeat", "5").rounds, parse("--rounds", "4").rounds) == (5, 4)
    a = parse("--quick", "--tensors", "7")
    assert (a.size, a.tensors, a.rounds) == (1, 7, 1)
    ap = argparse.ArgumentParser()
    h.add_standard_args(ap, rounds=None)
    assert not hasattr(ap.parse_args([]), "rounds")


def test_table_is_markdown_with_padded_columns():
    out = h.table(["name", "s"], [["alpha", "1.5"], ["b", "10.25"]])
    assert out.splitlines() == ["| name  |     s |",
                                "|-------|------:|",
                                "| alpha |   1.5 |",
                                "| b     | 10.25 |"]
    assert h.fmt(None) == h.fmt(math.nan) == "-" and h.ratio(3.0, 0.0) == "-"


def test_write_json_holds_config_machine_samples_and_aggregates(tmp_path):
    s = h.Samples()
    s.add("x", 0, 0.25)
    a = argparse.Namespace(rounds=1, json=str(tmp_path / "out.json"), quick=True)
    h.write_json(a.json, "bench_x", a, {"cpus": 2}, s, s.aggregates(), extra=[1])
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["tool"] == "bench_x" and doc["config"]["rounds"] == 1
    assert doc["samples"] == {"x": [{"round": 0, "seconds": 0.25}]}
    assert doc["aggregates"]["x"]["n"] == 1 and doc["machine"] == {"cpus": 2}
    assert doc["extra"] == [1]
    h.write_json(None, "bench_x", a, {}, s, None)  # no --json: nothing written


def test_file_helpers(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x" * 5000)
    (tmp_path / "g").write_bytes(b"y" * 10)
    assert h.dir_bytes(str(tmp_path)) == h.tree_bytes(str(tmp_path))[0] == 5010
    h.fsync_tree(str(tmp_path / "d"))
    h.evict_files(str(tmp_path))
    h.read_tree(str(tmp_path))
    assert h.filesystem_type(str(tmp_path)) != ""
