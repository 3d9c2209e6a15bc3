"""Overlapped snapshots (issue 30, item 4; ckptstore/ops/deferred_copy.py): a snapshot taken after
step t copies the parameters and the optimizer state while step t+1 runs forward and backward,
and is complete before t+1's optimizer step. Each test holds the background copy back until
the next step's backward has run, so the overlap is certain, not a matter of timing."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import ckptstore
from ckptstore.ops.deferred_copy import DeferredCopy
from ckptstore.ops.fsck import check
from ckptstore.torch import Checkpointer

from _crashkit import KillOps, die, run_forked

#: one torch thread everywhere: the bits depend on the thread count, and forked victims must not
#: use the parent's OpenMP pool
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _backward(model, it: int) -> None:
    g = torch.Generator().manual_seed(it)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()  # (BatchNorm's buffers change here)


def _live(model, opt) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": {i: {k: v.clone() for k, v in s.items()}
                          for i, s in opt.state_dict()["state"].items()}}


def _reference(n: int) -> dict[int, dict]:
    """The live state after each of iterations 0..n of the training below, without checkpoints."""
    model, opt = _model()
    refs = {0: _live(model, opt)}
    for it in range(1, n + 1):
        _backward(model, it)
        opt.step()
        opt.zero_grad()
        refs[it] = _live(model, opt)
    return refs


def _assert_state(ref: dict, loaded: dict, where: str) -> None:
    for k, v in ref["model"].items():
        assert torch.equal(loaded["model"][k], v), f"{where}: model {k}"
    for i, per in ref["optimizer"].items():
        for k, v in per.items():
            assert torch.equal(loaded["optimizer"]["state"][i][k], v), f"{where}: optimizer {i}.{k}"


class _Held:
    """Holds the overlapped copy of each listed iteration until :meth:`release` (test seam on the
    public DeferredCopy.run); ``hook(phase, copy)`` runs at "held" and "copied"."""

    def __init__(self, monkeypatch, iterations, hook=None) -> None:
        self.gates = {i: threading.Event() for i in iterations}
        run = DeferredCopy.run

        def held(copy: DeferredCopy) -> None:
            gate = self.gates.get(copy.iteration)
            if gate is not None:
                if hook is not None:
                    hook("held", copy)
                gate.wait(60)
            run(copy)
            if gate is not None and hook is not None:
                hook("copied", copy)

        monkeypatch.setattr(DeferredCopy, "run", held)

    def release(self, iteration: int) -> None:
        self.gates[iteration].set()


def test_overlapped_snapshot_is_the_state_of_its_iteration(tmp_path, monkeypatch):
    """The copy of snapshot t runs only after t+1's forward and backward (which change
    BatchNorm's buffers) and still equals the state of t bit for bit: buffers are copied at once,
    parameters and AdamW moments in the background, before t+1's optimizer step."""
    refs = _reference(7)
    model, opt = _model()
    held = _Held(monkeypatch, [2, 4, 6])
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="snapshots", snapshot_every=2)
        ck.restore()
        pending = None
        for it in range(1, 8):
            _backward(model, it)
            if pending is not None:
                fut, t = pending
                assert not fut.deferred.done(), f"snapshot {t} was copied before step {it} ran"
                held.release(t)
            out = ck.step(it)
            opt.zero_grad()
            pending = (out, it) if out is not None else None
        held.release(6)
        ck.close()
        store.flush()
        overlapped = [s for s in store.stats() if s.iteration in (2, 4, 6)]
    assert [s.iteration for s in overlapped] == [2, 4, 6]
    params = sum(p.numel() * 4 for p in model.parameters())
    for s in overlapped:  # parameters + exp_avg + exp_avg_sq (+ the step counters) overlapped
        assert 3 * params <= s.overlap_bytes < s.snapshot_bytes, s
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.iterations() == [0, 2, 4, 6]
        for it in (0, 2, 4, 6):
            _assert_state(refs[it], r.load(it), f"iteration {it}")


def test_overlap_off_copies_at_once(tmp_path):
    model, opt = _model()
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="snapshots", snapshot_every=1, overlap=False)
        ck.restore()
        _backward(model, 1)
        ck.step(1).result(timeout=30)
        assert all(s.overlap_bytes == 0 for s in store.stats())
    with pytest.raises(ckptstore.CheckpointPlanError, match="overlap"):
        Checkpointer(store, model, opt, overlap="yes")


def test_a_change_during_the_copy_fails_that_checkpoint_only(tmp_path, monkeypatch):
    held = _Held(monkeypatch, [1])
    w = torch.arange(4096, dtype=torch.float32)
    with ckptstore.open(tmp_path / "s") as store:
        store.save(0, {"w": w})
        fut = store.save_async(1, {"w": w}, deferred=lambda t: True)
        with torch.no_grad():
            w.add_(1)  # before the copy ran: what the store would get is not iteration 1's state
        held.release(1)
        with pytest.raises(ckptstore.LiveStateChangedError) as e:
            fut.result(timeout=30)
        assert e.value.path == "w"
        with pytest.raises(ckptstore.LiveStateChangedError):
            store.flush()  # (a background failure is also raised once by the next call)
        assert store.iterations() == [0]
        fut = store.save_async(1, {"w": w}, deferred=lambda t: True)
        assert fut.copied() >= 0.0
        w.add_(1)  # after copied(): allowed
        fut.result(timeout=30)
        assert torch.equal(store.load(1)["w"], w - 1)


# ---- SIGKILL at every phase of an overlapped snapshot -----------------------------------------
PHASES = ["held", "copied", "persist-write-1", "persist-write-2", "persist-fsync-1", "next-step",
          "queued"]


def _fired(marker: str, what: str) -> None:
    """Record which kill ended the victim (the parent checks it was the phase's own)."""
    with open(marker, "w") as f:
        f.write(what)


class _MarkedKillOps(KillOps):
    """KillOps that records its kill (``persist-<op>-<n>``) before it happens."""

    def __init__(self, marker: str, op: str, nth: int) -> None:
        super().__init__(op, nth, tear=0.5, armed=False)
        self.marker, self.what = marker, f"persist-{op}-{nth}"

    def _due(self, op: str) -> bool:
        due = super()._due(op)
        if due:
            _fired(self.marker, self.what)
        return due


class _QueuedKillOps(KillOps):
    """Holds the first write of snapshot 2's persist until snapshot 4's copy is done (two
    snapshots in flight: one persisting, one copied and queued behind it), then tears that
    write and kills ("queued"; "queued-timeout" when the copy never came)."""

    def __init__(self, marker: str) -> None:
        super().__init__("write", 1, tear=0.5, armed=False)
        self.marker = marker
        self.copied = threading.Event()

    def _due(self, op: str) -> bool:
        due = super()._due(op)
        if due:
            _fired(self.marker, "queued" if self.copied.wait(30) else "queued-timeout")
        return due


def _victim(path: str, phase: str, log: str, marker: str) -> None:
    """Snapshots every 2 iterations; snapshot 2 durable before step 3 (but for "queued", whose
    kill comes in snapshot 2's persist after snapshot 4's copy), so snapshot 4's copy and
    persist are the only checkpoint work when the phase's kill is armed. Each kill records
    itself in ``marker``; a run that reaches its end records "none"."""
    ops: KillOps | None = None
    if phase.startswith("persist"):
        ops = _MarkedKillOps(marker, phase.split("-")[1], int(phase.split("-")[2]))
    elif phase == "queued":
        ops = _QueuedKillOps(marker)
    run = DeferredCopy.run

    def held(copy: DeferredCopy) -> None:
        if copy.iteration == 4:
            if phase in ("held", "copied"):
                _fired(marker, phase)  # (before the copy: no file I/O between it and the kill)
            if phase == "held":
                die()
            if isinstance(ops, _MarkedKillOps):
                ops.armed = True  # its persist starts once the copy is done; nothing else writes
        run(copy)
        if copy.iteration == 4 and phase == "copied":
            die()
        if copy.iteration == 4 and isinstance(ops, _QueuedKillOps):
            ops.copied.set()

    DeferredCopy.run = held  # (a forked victim: nothing to restore)
    model, opt = _model()
    store = ckptstore.open(path, "a", file_ops=ops) if ops else ckptstore.open(path, "a")
    ck = Checkpointer(store, model, opt, policy="snapshots", snapshot_every=2)
    ck.restore()
    if isinstance(ops, _QueuedKillOps):
        ops.armed = True  # (after base 0: the next write is snapshot 2's persist)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    futures = {}
    for it in range(1, 6):
        _backward(model, it)
        fut = ck.step(it)
        if fut is not None:  # resolved => durable (checked by the parent)
            futures[it] = fut
            fut.add_done_callback(lambda f, it=it: f.exception() is None and
                                  os.write(fd, f"{it}\n".encode()))
        opt.zero_grad()
        if it == 2 and phase != "queued":
            fut.result(timeout=30)
        if it == 5 and phase == "next-step":
            _fired(marker, phase)
            die()
    futures[4].result(timeout=30)  # (a persist phase's kill comes while this waits)
    _fired(marker, "none")
    die()


@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_at_every_phase_of_an_overlapped_snapshot(tmp_path, phase):
    """A kill while snapshot 4's copy is held, right after it, during its persist (the first
    or second write, torn; the first fsync) or after the next step (each kill checked to be the
    one that ended the run) leaves 0, 2 (durable before the phase) and 4 only where its persist
    committed; a kill in snapshot 2's first write while 4 is copied and queued behind it
    ("queued") leaves 0 alone. The store holds every snapshot whose future resolved (never a
    partial one), each the state of its iteration bit for bit, and takes the next run's
    writes."""
    refs = _reference(5)
    log, marker = tmp_path / "resolved", tmp_path / "fired"
    rc = run_forked(_victim, str(tmp_path / "s"), phase, str(log), str(marker))
    assert rc == -signal.SIGKILL, rc
    assert marker.read_text() == phase, (marker.read_text(), phase)
    resolved = [int(x) for x in log.read_text().split()] if log.exists() else []
    with ckptstore.open(tmp_path / "s", "r") as r:
        its = r.iterations()
        assert its == [0] if phase == "queued" else its in ([0, 2], [0, 2, 4]), its
        assert set(resolved) <= set(its), (resolved, its)
        if phase != "next-step":
            assert 4 not in its, its  # (no copy, or killed before its COMMIT was written)
        for it in its:
            _assert_state(refs[it], r.load(it), f"{phase}: iteration {it}")
    model, opt = _model()
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="snapshots", snapshot_every=2)
        start = ck.restore()  # (loads only: no arithmetic that depends on threads)
        assert start == its[-1]
        _assert_state(refs[start], {"model": model.state_dict(), "optimizer": opt.state_dict()},
                      f"{phase}: restored")
    assert check(tmp_path / "s").clean, phase
