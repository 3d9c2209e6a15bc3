"""The demo (``ckptstore demo``) end to end, shortened: crash, bit-exact resume, point-in-time
restore, bisect and fsck must all succeed, and it must leave its plot."""

from __future__ import annotations

import json

import pytest

from ckptstore.cli.demo import run_demo


def test_demo_runs_and_everything_checks_out(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_dir = tmp_path / "demo"
    assert run_demo(str(out_dir), iterations=60, crash_at=37) == 0
    out = capsys.readouterr().out
    assert "SIGKILL after iteration 37" in out
    assert "final model + optimizer state: bit-identical" in out
    assert "(point in time)" in out and out.count("bit-identical") == 2
    assert "`bisect nan` found iteration" in out
    assert "6. fsck: clean" in out
    assert (out_dir / "demo.png").stat().st_size > 10_000
    log = [json.loads(line) for line in (out_dir / "train.jsonl").read_text().splitlines()]
    restored = [r["restored"] for r in log if "restored" in r]
    assert restored[0] == 0 and 0 < restored[1] <= 37  # the second run resumed from the store
    assert max(r["it"] for r in log if "it" in r) == 60
