"""Whole-store fuzzer: damage a real store at random, then open + fsck + load.

The pristine store holds snapshots (mixed torch/numpy states, shared and lz4 chunks, several
segments) and a torch Checkpointer chain (bases and group-committed exact deltas). Each trial
copies it and applies 1-3 random mutations: flip bytes, truncate a segment, append garbage (random
bytes or a copy of a valid record), delete a segment, swap two segment names, move a segment to a
new number, or flip a byte of the STORE file. Then, for every iteration the pristine store held:

* fsck (read-only) must *report* it when it cannot be loaded: listed as damaged, or gone from its
  iteration list and named in its report (or fsck itself refuses the store with a package error);
* an iteration fsck does not report must load bit-exact (equal to the pristine store's load);
* a load either returns the bit-exact state or raises a CkptStoreError; nothing raises anything
  else, and no iteration appears that was never saved.

Seeded (CKPTSTORE_SEED) and bounded (CKPTSTORE_TRIALS, default 16; CI sets 60). No failure is
skipped: fsck names iterations whose commit is damaged or gone from verified evidence (orphaned
manifests, the writer's index), and the mutations never touch index/, so every lost iteration has
a trace fsck can name.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import ckptstore
from ckptstore.errors import CkptStoreError
from ckptstore.format import records as rec
from ckptstore.format.commit import decode_commit
from ckptstore.ops.fsck import check
from ckptstore.storage.layout import Layout
from ckptstore.storage.segments import ScannedRecord, SegmentFile, scan_segment

from _crashkit import CHUNK_SIZE, state_for
from conftest import _same

TRIALS = int(os.environ.get("CKPTSTORE_TRIALS", "16"))
SEED = int(os.environ.get("CKPTSTORE_SEED", "20240607"))
SEGMENT_SIZE = 96 << 10
SNAPSHOTS = [1, 2, 3, 5]


@dataclass
class Pristine:
    path: Path
    sizes: dict[int, int]
    #: iteration -> (seq, offset, end) of its COMMIT record
    commit_at: dict[int, tuple[int, int, int]]
    #: (seq, offset, end) of every record, for "garbage that looks like records"
    records: list[tuple[int, int, int]]
    expected: dict[int, object] = field(default_factory=dict)


def _build(path: Path) -> None:
    import torch

    from ckptstore.torch import Checkpointer

    with ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE) as s:
        for it in SNAPSHOTS:
            s.save(it, state_for(it))
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.BatchNorm1d(48))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ck = Checkpointer(s, model, opt, policy="every-iteration", base_every=4, group_commit=2,
                          fingerprint_every=2)
        ck.save_base(10)
        for it in range(11, 20):  # deltas 11-13, base 14, deltas 15-17, base 18, delta 19
            model(torch.randn(6, 64)).square().mean().backward()
            ck.step(it)
            opt.zero_grad()
        ck.flush()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    path = tmp_path_factory.mktemp("storefuzz") / "store"
    _build(path)
    layout = Layout(str(path))
    sizes, commit_at, records = {}, {}, []
    for seq in layout.list_segments():
        f = SegmentFile(layout.segment_path(seq), seq)
        try:
            sizes[seq] = f.size()
            for item in scan_segment(f, 0, verify=True):
                assert isinstance(item, ScannedRecord) and item.error is None, item
                records.append((seq, item.loc.offset, item.loc.end))
                if item.type == rec.RecordType.COMMIT:
                    commit_at[decode_commit(item.payload).iteration] = (seq, item.loc.offset, item.loc.end)
        finally:
            f.close()
    p = Pristine(path, sizes, commit_at, records)
    with ckptstore.open(path, "r") as r:
        its = r.iterations()
        assert its == sorted(commit_at) and len(its) == len(SNAPSHOTS) + 10
        assert {r.kind(i) for i in its} == {"snapshot", "delta"}
        p.expected = {it: r.load(it) for it in its}
    for it in SNAPSHOTS:
        _same(state_for(it), p.expected[it], f"pristine iteration {it}")
    assert len(sizes) >= 4, sizes
    assert check(path).clean
    return p


# ---- mutations ---------------------------------------------------------------------------------------

@dataclass
class Damage:
    """What the mutations touched: byte ranges per original segment, and gone segments."""

    ranges: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)
    store_file: bool = False
    steps: list[str] = field(default_factory=list)
    #: live segment number -> the pristine segment its file holds (renames move files)
    origin: dict[int, int | None] = field(default_factory=dict)

    def touch(self, seq: int, start: int, end: int) -> None:
        self.ranges.setdefault(seq, []).append((start, end))

    def hits(self, seq: int, start: int, end: int) -> bool:
        return self.store_file or seq in self.gone or any(
            s < end and start < e for s, e in self.ranges.get(seq, []))


def _seg(layout: Layout, seq: int) -> Path:
    return Path(layout.segment_path(seq))


def mutate(store: Path, p: Pristine, rng: random.Random, dmg: Damage) -> None:
    layout = Layout(str(store))
    live = layout.list_segments()
    kind = rng.choices(["flip", "truncate", "append", "delete", "swap", "move", "store"],
                       weights=[10, 4, 3, 2, 2, 1, 1])[0]
    if not live:
        kind = "store"
    if kind == "store":
        f = store / "STORE"
        data = bytearray(f.read_bytes())
        i = rng.randrange(len(data))
        data[i] ^= rng.randint(1, 255)
        f.write_bytes(bytes(data))
        dmg.store_file = True
        dmg.steps.append(f"flip STORE byte {i}")
        return
    seq = rng.choice(live)
    path = _seg(layout, seq)
    orig = dmg.origin.get(seq)
    size = path.stat().st_size
    if kind == "flip" and size:
        n = rng.choice([1, 1, 2, 4, 8, 32])
        off = rng.randrange(size)
        data = bytearray(path.read_bytes())
        for i in range(off, min(off + n, size)):
            data[i] ^= rng.randint(1, 255)
        path.write_bytes(bytes(data))
        if orig is not None:
            dmg.touch(orig, off, off + n)
        dmg.steps.append(f"flip {n} bytes of segment {seq} at {off}")
    elif kind == "truncate":
        new = rng.randrange(size + 1)
        os.truncate(path, new)
        if orig is not None:
            dmg.touch(orig, new, 1 << 62)
        dmg.steps.append(f"truncate segment {seq} to {new} of {size} bytes")
    elif kind == "append":
        if rng.random() < 0.5:
            junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
            what = f"{len(junk)} random bytes"
        else:
            s2, a, b = rng.choice(p.records)
            with open(p.path / "segments" / os.path.basename(layout.segment_path(s2)), "rb") as fh:
                fh.seek(a)
                junk = fh.read(b - a)
            what = f"a copy of the record at segment {s2} offset {a}"
        with open(path, "ab") as fh:
            fh.write(junk)
        dmg.steps.append(f"append {what} to segment {seq}")
    elif kind == "delete":
        path.unlink()
        if orig is not None:
            dmg.gone.add(orig)
        dmg.origin.pop(seq, None)
        dmg.steps.append(f"delete segment {seq}")
    elif kind == "swap" and len(live) > 1:
        other = rng.choice([s for s in live if s != seq])
        tmp = path.with_suffix(".tmp")
        path.rename(tmp)
        _seg(layout, other).rename(path)
        tmp.rename(_seg(layout, other))
        for s in (seq, other):
            o = dmg.origin.get(s)
            if o is not None:
                dmg.gone.add(o)
        dmg.origin[seq], dmg.origin[other] = dmg.origin.get(other), dmg.origin.get(seq)
        dmg.steps.append(f"swap segments {seq} and {other}")
    else:  # move to a number past the last one
        new = max(live) + rng.randint(1, 3)
        path.rename(_seg(layout, new))
        if orig is not None:
            dmg.gone.add(orig)
        dmg.origin[new] = dmg.origin.pop(seq, None)
        dmg.steps.append(f"rename segment {seq} to {new}")


# ---- the oracle -----------------------------------------------------------------------------------

def _named(lines: list[str], it: int) -> bool:
    return any(re.search(rf"\biteration {it}\b", line) for line in lines)


def run_trial(p: Pristine, store: Path, rng: random.Random, where: str) -> dict[str, int]:
    dmg = Damage(origin={s: s for s in p.sizes})
    for _ in range(rng.choice([1, 1, 2, 3])):
        mutate(store, p, rng, dmg)
    where = f"{where}: {'; '.join(dmg.steps)}"
    stats = {"reported": 0, "intact": 0, "load_failed": 0}

    try:
        report = check(store)
        lines = report.lines()
        listed, damaged = set(report.iterations), set(report.damaged_iterations)
        fsck_refused = False
    except CkptStoreError as e:
        lines, listed, damaged, fsck_refused = [str(e)], set(), set(), True
    text = "\n".join(lines)

    try:
        reader = ckptstore.open(store, "r")
    except CkptStoreError:
        reader = None
    try:
        if reader is not None:
            phantom = set(reader.iterations()) - set(p.expected)
            assert not phantom, f"{where}: iterations {phantom} appeared"
        for it, want in p.expected.items():
            reported = fsck_refused or it in damaged or (it not in listed and _named(lines, it))
            try:
                if reader is None:
                    raise CkptStoreError("store does not open")
                got = reader.load(it)
            except CkptStoreError as e:
                stats["load_failed"] += 1
                assert reported, (f"{where}: iteration {it} does not load ({e!r}) but fsck does "
                                  f"not report it:\n{text}")
                stats["reported"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - the point of the test
                pytest.fail(f"{where}: loading iteration {it} raised a non-package exception "
                            f"{e!r}")
            _same(want, got, f"{where}: iteration {it}")
            stats["intact" if not reported else "reported"] += 1
    finally:
        if reader is not None:
            reader.close()
    return stats


def test_store_fuzz(pristine, tmp_path):
    rng = random.Random(SEED)
    totals: dict[str, int] = {}
    for trial in range(TRIALS):
        store = tmp_path / f"t{trial}"
        shutil.copytree(pristine.path, store)
        stats = run_trial(pristine, store, rng, f"trial {trial} (seed {SEED})")
        for k, v in stats.items():
            totals[k] = totals.get(k, 0) + v
        shutil.rmtree(store)
    print(f"store fuzz: {TRIALS} trials, per iteration: {totals}")
    assert totals["intact"] > 0 and totals["load_failed"] > 0, totals
