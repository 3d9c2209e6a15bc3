"""Power-loss simulation of every write path (tests/_powerloss.py; format-spec §2, A1-A4).

Each scenario runs one operation on a store through :class:`RecordingOps`, which records every
write-side call and marks what the caller was told (a save returned, gc returned). Then, for crash
images of the disk at every sync boundary -- unsynced writes lost, kept or torn at a sector,
unsynced creations, renames and unlinks lost or kept, the index lost or as of its last commit --
the image is written to a fresh directory and checked:

* every iteration acknowledged before the crash is there and loads bit-exact, and nothing is
  visible that was never saved (or that a completed gc removed);
* fsck finds no damaged or lost iteration; where it reports damage (a suspicious tail: a COMMIT
  cut inside by the crash), ``fsck --repair`` makes the store clean without removing an
  acknowledged iteration;
* the next writer opens it, saves, and fsck is clean afterwards.

``CKPTSTORE_POWERLOSS_STATES`` bounds the images checked per scenario (default 0: every distinct
image the enumeration yields, ~1,000 over the scenarios in under a minute; N > 0: at most N,
spread evenly over the crash points). Every image of a scenario is checked even after one fails
(the first failure is raised at the end). The counts per scenario (crash points, images, what
fsck found, failures) are printed as one table in the run's terminal summary (tests/conftest.py,
shown by ``pytest -q -m slow``, where this slow-marked sweep runs) and written to
$CKPTSTORE_POWERLOSS_REPORT as JSON when set.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.ops.fsck import check
from ckptstore.storage.fileops import FileOps
from ckptstore.storage.layout import Layout

from _powerloss import CrashState, RecordingOps, explore
from conftest import add_terminal_table

BUDGET = int(os.environ.get("CKPTSTORE_POWERLOSS_STATES", "0")) or None
SEED = int(os.environ.get("CKPTSTORE_SEED", "1337"))
CHUNK = 16 << 10
SEGMENT = 100 << 10
_FIXED = np.arange(5000.0)  # identical in every snapshot: the second save deduplicates it


def snap(i: int) -> dict:
    rng = np.random.default_rng(2000 + i)
    return {"w": rng.standard_normal(12_000).astype(np.float32), "fixed": _FIXED, "i": i}


def delta(i: int) -> dict:
    return {"g": np.random.default_rng(6000 + i).standard_normal(3000).astype(np.float32), "i": i}


def open_writer(path: Path, ops: FileOps | None = None, **kw: Any) -> ckptstore.Store:
    return ckptstore.open(path, "a", chunk_size=CHUNK, segment_size=SEGMENT,
                          file_ops=ops or FileOps(), **kw)


def verify_generated(r: ckptstore.Store, i: int, assert_same) -> None:
    if r.kind(i) == "delta":
        assert_same(delta(i), r.load_record(i), f"iteration {i}")
    else:
        assert_same(snap(i), r.load(i), f"iteration {i}")


# ---- a trainer for the Checkpointer scenario -----------------------------------------------------

TRAIN_LAST = 6


def _trainer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _backward(model: torch.nn.Module, it: int) -> None:
    g = torch.Generator().manual_seed(it)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
    model.zero_grad()
    ((model(x) - y) ** 2).mean().backward()


def _reference() -> dict[int, dict[str, torch.Tensor]]:
    model, opt = _trainer()
    ref = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    for it in range(1, TRAIN_LAST + 1):
        _backward(model, it)
        opt.step()
        ref[it] = {k: v.clone() for k, v in model.state_dict().items()}
    return ref


REFERENCE = _reference()


def verify_trained(r: ckptstore.Store, i: int, assert_same) -> None:
    got = r.load(i)["model"]
    for k, want in REFERENCE[i].items():
        assert torch.equal(got[k], want), f"iteration {i}: {k} differs from the uninterrupted run"


# ---- scenarios -----------------------------------------------------------------------------------

def _resume_saving(p: Path, where: str, assert_same) -> None:
    """The next writer saves one more snapshot after the newest iteration."""
    with open_writer(p) as w:
        nxt = (w.latest() if w.latest() is not None else -1) + 1
        w.save(nxt, snap(nxt))
    with ckptstore.open(p, "r") as r:
        verify_generated(r, nxt, assert_same)


@dataclass
class Scenario:
    """``prepare`` builds the starting store (closed cleanly, so durable); ``run`` performs the
    operation through the recording ops and marks what it was told: ("begin", i) before a save of
    iteration i, ("ack", i) once it returned, ("gc", [removed]) before a gc and ("gc-done",) once
    gc returned. ``resume`` is the next writer after a crash: it recovers the store, goes on and
    checks what it wrote. ``job``: a multi-rank store (its own fsck)."""

    name: str
    prepare: Callable[[Path], None]
    run: Callable[[Path, RecordingOps], None]
    verify: Callable[[ckptstore.Store, int, Any], None] = verify_generated
    resume: Callable[[Path, str, Any], None] = _resume_saving
    job: bool = False


def _saves(its: list[int], opener: Callable[..., Any] = open_writer) -> Callable[[Path], None]:
    def prepare(p: Path) -> None:
        with opener(p) as s:
            for i in its:
                s.save(i, snap(i))
    return prepare


def _nothing(p: Path) -> None:
    pass


def _run_saves(its: list[int], opener: Callable[..., Any] = open_writer
               ) -> Callable[[Path, RecordingOps], None]:
    def run(p: Path, ops: RecordingOps) -> None:
        with opener(p, ops) as s:
            for i in its:
                ops.mark("begin", i)
                s.save(i, snap(i))
                ops.mark("ack", i)
    return run


def _run_deltas(its: list[int], durable: bool) -> Callable[[Path, RecordingOps], None]:
    def run(p: Path, ops: RecordingOps) -> None:
        with open_writer(p, ops) as s:
            for i in its:
                ops.mark("begin", i)
                s.save_delta(i, delta(i), durable=durable)
                if durable:
                    ops.mark("ack", i)
            if not durable:
                s.flush()  # the group commit
                for i in its:
                    ops.mark("ack", i)
    return run


def _small_stage_writer(p: Path, ops: FileOps | None = None) -> ckptstore.Store:
    """Every record through O_DIRECT, staged in two 16 KiB regions: each save hands several
    full regions to the background writer while the next fills (storage/direct.py)."""
    from ckptstore.storage import direct

    saved, direct.STAGE_CAPACITY = direct.STAGE_CAPACITY, 16 << 10
    try:
        return open_writer(p, ops, direct_io=True)
    finally:
        direct.STAGE_CAPACITY = saved


def _imaged_delta(i: int) -> dict:
    """:func:`delta`'s record with its gradient in a chunk image (ckptstore/format/image.py):
    framed in place, written from its own memory (O_DIRECT after a pad record)."""
    from test_chunk_image import image_state

    d = delta(i)
    g = torch.from_numpy(np.concatenate([d["g"]] * 4))
    return {"g": image_state({"g": g})["g"], "i": i}


def verify_imaged(r: ckptstore.Store, i: int, assert_same) -> None:
    if r.kind(i) != "delta":
        return verify_generated(r, i, assert_same)
    got = r.load_record(i)
    assert got["i"] == i and np.array_equal(got["g"].numpy(), np.concatenate([delta(i)["g"]] * 4)), \
        f"iteration {i}"


def _run_deltas_of(record: Callable[[int], dict], its: list[int]) -> Callable[[Path, RecordingOps], None]:
    """Deltas ``record(i)`` for ``its``, every second one durable (acknowledging the pair)."""
    def run(p: Path, ops: RecordingOps) -> None:
        with open_writer(p, ops) as s:
            for i in its:
                ops.mark("begin", i)
                s.save_delta(i, record(i), durable=i % 2 == 0)
                if i % 2 == 0:
                    ops.mark("ack", i - 1)
                    ops.mark("ack", i)
    return run


def _lent_gradient(i: int) -> torch.Tensor:
    """:func:`delta`'s gradient, four times over, in a tensor at an address 5 floats past a
    page boundary plus 4 KiB * i (no alignment: written by lent records, format.md section 8)."""
    g = np.concatenate([delta(i)["g"]] * 4)
    backing = torch.zeros(g.size + 4096 + 1024 * i + 5)
    shift = (-backing.data_ptr() // 4 % 1024) + 1024 * i + 5
    t = backing[shift:shift + g.size]
    t.copy_(torch.from_numpy(g))
    return t


def _lent_delta(i: int) -> dict:
    from ckptstore.tensors import LentTensor

    return {"g": LentTensor(_lent_gradient(i)), "i": i}


def _run_gc(p: Path, ops: RecordingOps) -> None:
    with open_writer(p, ops) as s:
        its = s.iterations()
        ops.mark("gc", its[:-2])
        s.gc(keep_last=2)
        ops.mark("gc-done")


def _saves_then_gc(p: Path) -> None:
    _saves(list(range(6)))(p)
    with open_writer(p) as s:
        s.gc(keep_last=2)


def _train(p: Path, ops: RecordingOps | None, last: int) -> None:
    """Resume from the store, train to ``last`` with the async Checkpointer (exact deltas, group
    commits of 2, a base every 4), marking every iteration the store reports durable."""
    from ckptstore.torch import Checkpointer

    with open_writer(p, ops) as s:
        model, opt = _trainer()
        ckpt = Checkpointer(s, model, opt, policy="every-iteration", base_every=4, group_commit=2,
                            fingerprint_every=0)
        first = ckpt.restore() + 1
        for it in range(first, last + 1):
            _backward(model, it)
            if ops is not None:
                ops.mark("begin", it)
            ckpt.step(it)
            durable = s.durable_iteration()
            if ops is not None and durable is not None:
                ops.mark("acked-through", durable)
        durable = ckpt.flush()
        if ops is not None and durable is not None:
            ops.mark("acked-through", durable)
        ckpt.close()


def _resume_training(p: Path, where: str, assert_same) -> None:
    """The next trainer restores from the store and trains on to the end, bit-exact."""
    _train(p, None, TRAIN_LAST)
    with ckptstore.open(p, "r") as r:
        assert max(r.iterations()) == TRAIN_LAST, f"{where}: training did not resume"
        verify_trained(r, TRAIN_LAST, assert_same)


# ---- the multi-rank store: its global commit, with a one-rank gloo group in this process -------

_PG: list = []


def _group() -> Any:
    """A one-rank gloo process group in this process (created once per module)."""
    import datetime

    import torch.distributed as dist
    from _ports import server_port

    if not _PG:
        if not dist.is_initialized():
            init = f"tcp://127.0.0.1:{server_port()}"
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60))
        _PG.append(dist.group.WORLD)
    return _PG[0]




def _job_writer(p: Path, ops: FileOps | None = None) -> ckptstore.JobStore:
    return ckptstore.JobStore(p, "a", process_group=_group(), chunk_size=CHUNK,
                              segment_size=SEGMENT, file_ops=ops or FileOps(), commit_timeout=60)


SCENARIOS = [
    Scenario("create", _nothing, _run_saves([0])),
    Scenario("save+dedup", _saves([0, 1]), _run_saves([2, 3])),
    Scenario("save-roll", _saves([0, 1]), _run_saves([2, 3, 4])),
    Scenario("delta-durable", _saves([0]), _run_deltas([1, 2], durable=True)),
    Scenario("delta-group", _saves([0]), _run_deltas([1, 2, 3], durable=False)),
    Scenario("delta-images", _saves([0]), _run_deltas_of(_imaged_delta, [1, 2, 3, 4]),
             verify=verify_imaged),
    Scenario("delta-lent", _saves([0]), _run_deltas_of(_lent_delta, [1, 2, 3, 4]),
             verify=verify_imaged),
    Scenario("save-direct-overlap", _saves([0, 1], _small_stage_writer),
             _run_saves([2, 3], _small_stage_writer)),
    Scenario("checkpointer", lambda p: _train(p, None, 2), lambda p, ops: _train(p, ops, TRAIN_LAST),
             verify=verify_trained, resume=_resume_training),
    Scenario("gc", _saves(list(range(6))), _run_gc),
    Scenario("save-after-gc", _saves_then_gc, _run_saves([6, 7])),
    Scenario("multi-rank-commit", _saves([0], _job_writer), _run_saves([1, 2], _job_writer),
             job=True),
]

#: per scenario: crash points, images checked, what fsck found in them, and failed images
TOTALS: dict[str, Counter] = {}
#: the summary table's columns: (heading, TOTALS key)
COLUMNS = [("crash points", "points"), ("images", "images"), ("clean", "clean"),
           ("tail note", "tail note"), ("repaired", "repaired"), ("no store", "no store"),
           ("index lost", "index lost"), ("failures", "failures")]


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if not TOTALS:
        return
    rows = [[name, *(c[key] for _, key in COLUMNS)] for name, c in TOTALS.items()]
    total = sum(TOTALS.values(), Counter())
    rows.append(["total", *(total[key] for _, key in COLUMNS)])
    add_terminal_table(f"power-loss simulation: crash images per operation (budget "
                       f"{BUDGET or 'all'} per scenario)", ["scenario", *(h for h, _ in COLUMNS)],
                       rows)
    if os.environ.get("CKPTSTORE_POWERLOSS_REPORT"):
        with open(os.environ["CKPTSTORE_POWERLOSS_REPORT"], "w") as f:
            json.dump({k: dict(v) for k, v in TOTALS.items()}, f, indent=1)


def _expectations(marks: list[tuple], before: set[int]) -> tuple[set[int], set[int]]:
    """(iterations that must be present, iterations that may be present) after a crash with
    ``marks`` issued."""
    acked, begun, removed, gc_done, through = set(), set(), set(), False, -1
    for m in marks:
        if m[0] == "begin":
            begun.add(m[1])
        elif m[0] == "ack":
            acked.add(m[1])
        elif m[0] == "acked-through":
            through = max(through, m[1])
        elif m[0] == "gc":
            removed = set(m[1])
        elif m[0] == "gc-done":
            gc_done = True
    acked |= {i for i in begun if i <= through}
    must = (before | acked) - removed
    may = (before | acked | begun) - (removed if gc_done else set())
    return must, may


def _check_image(sc: Scenario, state: CrashState, root: Path, dest: Path, before: set[int],
                 assert_same, stats: Counter) -> None:
    must, may = _expectations(state.marks, before)
    where = f"{sc.name}: crash at trace entry {state.point} ({state.how})"
    state.materialize(str(root), str(dest))
    if state.index is None:
        stats["index lost"] += 1
    if sc.job:
        _check_job_image(where, dest, must, may, assert_same, stats)
        return
    if not os.path.exists(Layout(str(dest)).store_file):
        assert not must, f"{where}: the store is gone but {sorted(must)} were acknowledged"
        stats["no store"] += 1
    else:
        report = check(dest)
        lines = "\n".join(report.lines())
        assert not report.damaged_iterations, f"{where}: damaged iterations:\n{lines}"
        assert not (set(report.lost_iterations) & must), f"{where}: acknowledged lost:\n{lines}"
        if not report.clean:
            # only a COMMIT the crash cut inside (a suspicious tail) may show as damage; repair
            # quarantines and cuts it
            report = check(dest, repair=True)
            lines = "\n".join(report.lines())
            assert not report.damaged_iterations, f"{where}: after repair:\n{lines}"
            report = check(dest)
            assert report.clean, f"{where}: fsck --repair left it unclean:\n{check(dest).lines()}"
            stats["repaired"] += 1
        elif report.notes:
            stats["tail note"] += 1
        else:
            stats["clean"] += 1
        present = set(report.iterations)
        assert must <= present, f"{where}: acknowledged iterations lost: {sorted(must - present)}"
        assert present <= may, f"{where}: iterations never saved or already collected: " \
                               f"{sorted(present - may)}"
        with ckptstore.open(dest, "r") as r:
            assert set(r.iterations()) == present, f"{where}: a reader lists {r.iterations()}"
            for i in sorted(present):
                sc.verify(r, i, lambda a, b, msg="": assert_same(a, b, f"{where}: {msg}"))
    sc.resume(dest, where, assert_same)  # the next writer recovers whatever the crash left
    after = check(dest)
    assert after.clean and all("quarantine" in n for n in after.notes), \
        f"{where}: fsck after the next save:\n" + "\n".join(after.lines())


def _check_job_image(where: str, dest: Path, must: set[int], may: set[int], assert_same,
                     stats: Counter) -> None:
    """The checks of :func:`_check_image` for a multi-rank store (its own fsck, reader, writer)."""
    from ckptstore.multirank.fsck import check_job

    report = check_job(dest)
    lines = "\n".join(report.lines())
    if not report.clean:
        # only commits the crash garbled during their own fsync (suspicious tails): a rank's
        # COMMIT in its stream, which fsck --repair quarantines and cuts, or the GLOBAL_COMMIT
        # at the end of the current global log, which the next job quarantines (checked below)
        assert not report.damaged_iterations, f"{where}:\n{lines}"
        check_job(dest, repair=True)
        report = check_job(dest)
        lines = "\n".join(report.lines())
        assert all(r.clean for r in report.streams.values()) and not report.damaged_iterations \
            and all("fails its check" in d for d in report.damage), f"{where}: after repair:\n{lines}"
        stats["repaired"] += 1
    elif report.notes or any(r.notes for r in report.streams.values()):
        stats["tail note"] += 1
    else:
        stats["clean"] += 1
    present = set(report.iterations)
    assert must <= present, f"{where}: acknowledged iterations lost: {sorted(must - present)}\n{lines}"
    assert present <= may, f"{where}: iterations never saved: {sorted(present - may)}\n{lines}"
    with ckptstore.open(dest, "r") as r:
        assert set(r.iterations()) == present, f"{where}: a reader lists {r.iterations()}"
        for i in sorted(present):
            assert_same(snap(i), r.load(i, rank=0), f"{where}: iteration {i}")
    with _job_writer(dest) as w:
        nxt = max(present | {-1}) + 1
        w.save(nxt, snap(nxt))
    with ckptstore.open(dest, "r") as r:
        assert_same(snap(nxt), r.load(nxt, rank=0), f"{where}: the next save")
    after = check_job(dest)
    assert after.clean, f"{where}: fsck after the next job's save:\n" + "\n".join(after.lines())


@pytest.mark.slow
@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_power_loss(sc: Scenario, tmp_path, assert_same):
    root = tmp_path / "store"
    sc.prepare(root)
    if root.exists():
        with ckptstore.open(root, "r") as r:
            before = set(r.iterations())
    else:
        before = set()
    ops = RecordingOps(str(root))
    sc.run(root, ops)
    stats: Counter = Counter({"failures": 0})
    points: set[int] = set()
    first: Exception | None = None
    for state in explore(ops, SEED, BUDGET):
        points.add(state.point)
        stats["images"] += 1
        try:
            _check_image(sc, state, root, tmp_path / "crash", before, assert_same, stats)
        except Exception as e:  # noqa: BLE001 - counted; the first is raised once all are checked
            stats["failures"] += 1
            first = first or e
    stats["points"] = len(points)
    TOTALS[sc.name] = stats
    if first is not None:
        raise AssertionError(f"{sc.name}: {stats['failures']} of {stats['images']} crash images "
                             f"failed; the first: {first}") from first
    assert stats["images"] >= min(BUDGET or 10, 10), f"only {stats['images']} images explored"
    shutil.rmtree(tmp_path / "crash", ignore_errors=True)


# ---- regressions of what the simulation found (each fails without its fix) -----------------------

def test_a_torn_global_log_tail_stays_a_note_after_the_next_job(tmp_path):
    """A crash during a global commit leaves a torn record at the end of the global log; the next
    job adopts the valid prefix. fsck reported the ignored bytes as damage from then on."""
    from ckptstore.multirank.fsck import check_job

    root = tmp_path / "job"
    _saves([0, 1], _job_writer)(root)
    log = sorted((root / "global").iterdir())[-1]
    with open(log, "ab") as f:
        f.write(bytes(10))  # a record header cut short
    assert check_job(root).clean
    with _job_writer(root) as w:
        w.save(2, snap(2))
    report = check_job(root)
    assert report.clean and report.iterations == [0, 1, 2], report.lines()
    assert any("past what epoch 2 adopted, are ignored" in n for n in report.notes)


def test_a_garbled_global_commit_is_damage_until_the_next_job_quarantines_it(tmp_path):
    from ckptstore.multirank.fsck import check_job

    root = tmp_path / "job"
    _saves([0, 1], _job_writer)(root)
    log = sorted((root / "global").iterdir())[-1]
    data = bytearray(log.read_bytes())
    data[-3] ^= 0xFF  # the trailer of the last GLOBAL_COMMIT (iteration 1)
    log.write_bytes(bytes(data))
    report = check_job(root)
    assert not report.clean and report.iterations == [0], report.lines()
    assert "fails its check" in report.damage[0]
    with _job_writer(root) as w:
        w.save(2, snap(2))
    report = check_job(root)
    assert report.clean and report.iterations == [0, 2], report.lines()
    kept = os.listdir(root / "quarantine")
    assert len(kept) == 1 and kept[0].startswith(f"global-{log.stem}-")
    assert any("quarantine/ holds 1" in n for n in report.notes)


def test_a_stream_that_a_crash_left_without_store_is_a_note(tmp_path):
    from ckptstore.multirank.fsck import check_job

    root = tmp_path / "job"
    _saves([0], _job_writer)(root)
    (root / "streams" / "0000000009-00000" / "segments").mkdir(parents=True)
    report = check_job(root)
    assert report.clean, report.lines()
    assert any("was never completed" in n for n in report.notes)
