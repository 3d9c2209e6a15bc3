"""ckptstore/storage/memory.py: huge-page advice for fresh read destinations is pure advice."""

from __future__ import annotations

import torch

import ckptstore
from ckptstore.storage import memory


def test_advice_never_changes_what_is_read(tmp_path, assert_same, monkeypatch):
    state = {"big": torch.randn(3_000_000), "odd": torch.randn(1_234_567).to(torch.float64),
             "small": torch.arange(10)}
    with ckptstore.open(tmp_path / "s") as s:
        s.save(1, state)
    for enabled in (None, False):  # as the machine says, and off
        monkeypatch.setattr(memory, "_enabled", enabled)
        with ckptstore.open(tmp_path / "s", "r") as r:
            assert_same(state, r.load(1))
    monkeypatch.setattr(memory, "_enabled", None)
    t = torch.empty(8 << 20, dtype=torch.uint8)
    memory.advise_huge_tensor(t)  # True where THP is on in madvise/always mode; never raises
    assert memory.advise_huge(t.data_ptr(), 1 << 20) is False  # too small to advise
    monkeypatch.setattr(memory, "_enabled", False)
    assert memory.advise_huge_tensor(t) is False
