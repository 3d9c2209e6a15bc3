"""Processes side by side: one writer, many readers.

* A second writer, in another process, is refused with StoreLockedError while the first holds the
  store, and gets it as soon as the first closes or is SIGKILLed.
* Reader processes run while a writer process saves snapshots and logs group-committed deltas
  (and, in the last tests, runs gc): every iteration a reader lists loads, and its content equals
  the deterministic generator's (snapshots and delta records alike); with no gc the listing is
  always a gap-free prefix that never shrinks.
* Eight readers beside a training writer (the Checkpointer: base snapshots, replayable
  group-committed deltas, gc): each reader loads iterations (a delta one is replayed from its base)
  and replays ranges (``Store.replay``), every state bit-exact against the training run the test
  computed beforehand (:class:`TrainingRun`).

Processes are forked from the test process (ckptstore, numpy and torch are already imported, so a
child costs a fork rather than a 3 s interpreter start). The states of the first tests hold numpy
arrays only: their children never run a torch kernel. The training test's children do (the
optimizer steps of training and replay), with one intra-op thread each
(``torch.set_num_threads(1)``, as every forked torch child in these tests), so none depends on a
thread pool of the parent's.
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.ops.fsck import check
from ckptstore.torch import Checkpointer

CHUNK = 16 << 10


def snap(i: int) -> dict:
    r = np.random.default_rng(i)
    return {"w": r.standard_normal(12_000).astype(np.float32),  # 3 chunks, new every iteration
            "const": np.arange(9_000, dtype=np.int32),          # deduplicated
            "small": np.full(5, i, dtype=np.int64), "i": i}


def delta(i: int) -> dict:
    return {"g": np.random.default_rng(10_000 + i).standard_normal(5_000).astype(np.float32), "i": i}


def is_snapshot(i: int) -> bool:
    return i % 4 == 0


def verify(r: ckptstore.Store, i: int, plan: bool = True) -> None:
    """Load iteration ``i`` from reader ``r`` and compare it with the generator, bit for bit
    (``plan``: also check that its kind is the writer loop's: a snapshot every 4th iteration)."""
    kind = r.kind(i)
    if plan:
        assert kind == ("snapshot" if is_snapshot(i) else "delta"), f"iteration {i} is a {kind}"
    got = r.load(i) if kind == "snapshot" else r.load_record(i)
    want = snap(i) if kind == "snapshot" else delta(i)
    assert got.keys() == want.keys(), f"iteration {i}: keys {list(got)}"
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), f"iteration {i}: {k}"
        else:
            assert got[k] == v, f"iteration {i}: {k}"


class TrainingRun:
    """The generator of the training test: a small model and AdamW, stepped with gradients drawn
    from a seeded generator per iteration. ``states[i]``: the model and optimizer state after
    iteration ``i``, computed here (in the test process, before forking) one step at a time, as the
    writer trains and as replay must reproduce them bit for bit. The writer stops at ``last``."""

    def __init__(self, last: int, assert_same: Callable[..., None]) -> None:
        self.last = last
        self.same = assert_same
        model, opt = self.model()
        self.states = {0: self._state(model, opt)}
        for i in range(1, last + 1):
            self.set_grads(model, i)
            opt.step()
            self.states[i] = self._state(model, opt)

    @staticmethod
    def model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    @staticmethod
    def set_grads(model: torch.nn.Module, i: int) -> None:
        r = np.random.default_rng(20_000 + i)
        for p in model.parameters():
            p.grad = torch.from_numpy(r.standard_normal(p.numel()).astype(np.float32)).view(p.shape)

    @staticmethod
    def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
        return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})

    def check(self, i: int, got: dict) -> None:
        """``got``: the state loaded or replayed for iteration ``i``."""
        assert got["iteration"] == i, f"iteration {i}: the state says {got['iteration']}"
        self.same(self.states[i]["model"], got["model"], f"iteration {i}: model")
        self.same(self.states[i]["optimizer"], got["optimizer"], f"iteration {i}: optimizer")

    def verify(self, r: ckptstore.Store, i: int) -> None:
        """Load iteration ``i`` (a delta: replayed from its chain's base) and check it; its kind
        must be the writer's plan (a base every 4th iteration)."""
        kind = r.kind(i)
        assert kind == ("snapshot" if is_snapshot(i) else "delta"), f"iteration {i} is a {kind}"
        self.check(i, r.load(i))

    def verify_replay(self, r: ckptstore.Store, start: int, stop: int) -> int:
        """``r.replay(start, stop)``: every iteration of the range, in order, each checked.
        Returns how many it yielded."""
        n = 0
        for i, state in r.replay(start, stop):
            assert i == start + n, f"replay({start}, {stop}) yielded {i} after {start + n - 1}"
            self.check(i, state)
            n += 1
        assert n == stop - start + 1, f"replay({start}, {stop}) yielded {n} iterations"
        return n


# ---- a tiny process harness ---------------------------------------------------------------------------

def fork(fn: Callable[[], dict], out: Path) -> int:
    """Run ``fn`` in a forked child; its result (or its traceback) is written to ``out`` as JSON."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            code = 1
        try:
            out.write_text(json.dumps(result))
        finally:
            os._exit(code)
    return pid


def join(pid: int, out: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"child {pid} did not finish in {timeout} s")
        time.sleep(0.02)
    result = json.loads(out.read_text()) if out.exists() else {}
    assert "error" not in result, f"child failed: {result['error']}\n{result.get('traceback', '')}"
    return result


def wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


# ---- a second writer -------------------------------------------------------------------------------------

def test_second_writer_in_another_process_is_refused(tmp_path):
    path = tmp_path / "s"
    with ckptstore.open(path, "a", chunk_size=CHUNK) as s:
        s.save(0, snap(0))
    ready, release = tmp_path / "ready", tmp_path / "release"

    def holder() -> dict:
        with ckptstore.open(path, "a") as s:
            s.save(1, snap(1))
            ready.touch()
            wait_for(release)
        return {"closed": True}

    pid = fork(holder, tmp_path / "holder.json")
    wait_for(ready)
    with pytest.raises(ckptstore.StoreLockedError) as info:
        ckptstore.open(path, "a")
    assert str(path) in str(info.value) and "LOCK" in str(info.value)

    def contender() -> dict:  # a third process: refused too, and a reader works meanwhile
        try:
            ckptstore.open(path, "a")
            refused = False
        except ckptstore.StoreLockedError:
            refused = True
        with ckptstore.open(path, "r") as r:
            its = r.iterations()
            for i in its:
                verify(r, i, plan=False)
        return {"refused": refused, "iterations": its}

    third = join(fork(contender, tmp_path / "c.json"), tmp_path / "c.json")
    assert third == {"refused": True, "iterations": [0, 1]}
    release.touch()
    assert join(pid, tmp_path / "holder.json") == {"closed": True}
    with ckptstore.open(path, "a") as s:  # released: the next writer gets it
        s.save(2, snap(2))

    # a writer SIGKILLed while holding the lock releases it with its process
    ready.unlink()
    release.unlink()
    pid = fork(_holder_that_waits(path, ready), tmp_path / "h2.json")
    wait_for(ready)
    with pytest.raises(ckptstore.StoreLockedError):
        ckptstore.open(path, "a")
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    with ckptstore.open(path, "a") as s:
        assert s.iterations() == [0, 1, 2]
        s.save(3, snap(3))
    assert check(path).clean


def _holder_that_waits(path: Path, ready: Path) -> Callable[[], dict]:
    def run() -> dict:
        s = ckptstore.open(path, "a")
        ready.touch()
        time.sleep(120)
        s.close()
        return {}
    return run


# ---- readers beside a writer --------------------------------------------------------------------------

def writer_loop(path: Path, stop: Path, seconds: float, gc_every: int | None) -> Callable[[], dict]:
    """Snapshots every 4th iteration, deltas between them (group commit: flushed every 2), and a
    gc every ``gc_every`` iterations. Runs ``seconds`` and reports what it committed."""
    def run() -> dict:
        n_gc = 0
        with ckptstore.open(path, "a", chunk_size=CHUNK, segment_size=256 << 10) as s:
            it = s.latest() + 1
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if is_snapshot(it):
                    s.save(it, snap(it))
                else:
                    s.save_delta(it, delta(it), durable=False)
                    if it % 2 == 0 or is_snapshot(it + 1):
                        s.flush()
                if gc_every and it % gc_every == 0:
                    s.gc(keep_last=5)
                    n_gc += 1
                it += 1
            s.flush()
            last = s.latest()
        stop.touch()
        return {"last": last, "gcs": n_gc}
    return run


def trainer_loop(path: Path, stop: Path, seconds: float, gc_every: int | None,
                 training: TrainingRun) -> Callable[[], dict]:
    """The Checkpointer trains :class:`TrainingRun`'s model: a base every 4th iteration, exact
    deltas between them, group-committed by 2 through the async pipeline, and a gc every
    ``gc_every`` iterations. Runs ``seconds`` (or up to ``training.last``) and reports what it
    committed."""
    def run() -> dict:
        torch.set_num_threads(1)
        n_gc = 0
        with ckptstore.open(path, "a", chunk_size=CHUNK, segment_size=256 << 10) as s:
            model, opt = TrainingRun.model()
            ck = Checkpointer(s, model, opt, policy="every-iteration", base_every=4,
                              group_commit=2, fingerprint_every=2)
            it = ck.restore() + 1
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and it <= training.last:
                TrainingRun.set_grads(model, it)
                ck.step(it)
                if gc_every and it % gc_every == 0:
                    s.gc(keep_last=5)
                    n_gc += 1
                it += 1
            ck.flush()
            ck.close()
            last = s.latest()
        stop.touch()
        return {"last": last, "gcs": n_gc}
    return run


def reader_loop(path: Path, stop: Path, seed: int, gc: bool,
                training: TrainingRun | None = None) -> Callable[[], dict]:
    """Alternate a fresh reader and a long-lived one that refreshes; verify the latest iteration
    and a random listed one each round (with ``training``: as :meth:`TrainingRun.verify`, and
    replay a range of up to 5 iterations, :meth:`TrainingRun.verify_replay`, from the oldest
    listed iteration or a random one). Reports counts; any failure fails the test."""
    def run() -> dict:
        if training is not None:
            torch.set_num_threads(1)
        check_one = verify if training is None else training.verify
        rng = random.Random(seed)
        stats = {"rounds": 0, "loads": 0, "replays": 0, "replayed": 0, "removed by gc": 0,
                 "max latest": -1}
        long_lived = ckptstore.open(path, "r")
        last_latest = -1
        try:
            while not stop.exists():
                fresh = stats["rounds"] % 2 == 0
                r = ckptstore.open(path, "r") if fresh else long_lived
                try:
                    its = r.iterations()
                    assert its, "a reader lists no iteration"
                    if not gc:
                        assert its == list(range(its[-1] + 1)), f"gap in the listing: {its}"
                        if not fresh:
                            assert its[-1] >= last_latest, f"latest went back to {its[-1]}"
                            last_latest = its[-1]
                    for i in {its[-1], rng.choice(its)}:
                        try:
                            check_one(r, i)
                            stats["loads"] += 1
                        except ckptstore.NotFoundError:
                            if not gc:
                                raise
                            r.refresh()
                            assert i not in r.iterations(), f"iteration {i} listed but not found"
                            stats["removed by gc"] += 1
                    if training is not None:
                        # half the time from the oldest listed: what the next gc removes
                        start = its[0] if rng.random() < 0.5 else rng.choice(its)
                        try:
                            stop_at = min(start + 4, its[-1])
                            stats["replayed"] += training.verify_replay(r, start, stop_at)
                            stats["replays"] += 1
                        except ckptstore.NotFoundError:
                            if not gc:
                                raise
                            r.refresh()
                            assert start not in r.iterations(), \
                                f"replay from {start} found nothing, yet it is listed"
                            stats["removed by gc"] += 1
                    stats["max latest"] = max(stats["max latest"], its[-1])
                finally:
                    if fresh:
                        r.close()
                stats["rounds"] += 1
        finally:
            long_lived.close()
        return stats
    return run


def _run_side_by_side(tmp_path: Path, seconds: float, gc_every: int | None, readers: int = 2,
                      training: TrainingRun | None = None):
    path = tmp_path / "s"
    with ckptstore.open(path, "a", chunk_size=CHUNK) as s:
        if training is None:
            s.save(0, snap(0))
        else:
            Checkpointer(s, *TrainingRun.model(), asynchronous=False).restore()  # base 0
    stop = tmp_path / "stop"
    gc = gc_every is not None
    writer = writer_loop(path, stop, seconds, gc_every) if training is None else \
        trainer_loop(path, stop, seconds, gc_every, training)
    kids = [(fork(writer, tmp_path / "w.json"), tmp_path / "w.json")]
    for j in range(readers):
        out = tmp_path / f"r{j}.json"
        kids.append((fork(reader_loop(path, stop, j, gc, training), out), out))
    results = [join(pid, out) for pid, out in kids]
    w, rs = results[0], results[1:]
    # after the writer: every retained iteration is intact, and the store is clean
    with ckptstore.open(path, "r") as r:
        its = r.iterations()
        assert its[-1] == w["last"]
        for i in its:
            (verify if training is None else training.verify)(r, i)
        if training is not None:
            training.verify_replay(r, its[0], its[-1])
    assert check(path).clean
    return w, rs


def test_readers_during_saves_and_deltas(tmp_path):
    w, rs = _run_side_by_side(tmp_path, 3.0, None)
    print(w, rs)
    assert w["last"] >= 12, f"the writer made little progress: {w}"
    for r in rs:
        assert r["rounds"] >= 5 and r["loads"] >= 5, r
        assert r["max latest"] > 4, f"a reader never saw the writer's progress: {r}"


def test_readers_during_gc(tmp_path):
    w, rs = _run_side_by_side(tmp_path, 3.0, gc_every=6)
    print(w, rs)
    assert w["gcs"] >= 2, f"too few gc runs: {w}"
    for r in rs:
        assert r["rounds"] >= 5 and r["loads"] >= 5, r


@pytest.mark.slow
def test_eight_readers_during_saves_deltas_and_gc(tmp_path, assert_same):
    """The load of issue 15: eight reader processes (fresh and long-lived) beside a writer that
    trains with the Checkpointer: it saves bases, group-commits replayable deltas and runs gc.
    Every reader loads iterations (a delta one replayed from its base) and replays ranges, each
    state checked bit for bit against the training run. No reader sees wrong data or an error
    other than an iteration gc removed after its listing. tools/bench_readers.py measures the
    rates."""
    seconds = float(os.environ.get("CKPTSTORE_READERS_SECONDS", "4"))
    training = TrainingRun(int(100 * seconds), assert_same)  # (the writer's pace here: ~30/s)
    w, rs = _run_side_by_side(tmp_path, seconds, gc_every=6, readers=8, training=training)
    print(w, rs)
    assert w["gcs"] >= 1, f"no gc ran: {w}"
    assert all(r["rounds"] >= 1 and r["loads"] >= 1 and r["replays"] >= 1 for r in rs), rs
    assert sum(r["replayed"] for r in rs) >= 8 * 2, rs
