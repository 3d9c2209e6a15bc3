"""Lent gradients (zero-copy capture): records written straight from a tensor's own memory
(format/image.py's LentFramer), the loan that keeps the persister off that memory until the
lender decides (ckptstore/ops/loan.py), and the Checkpointer lending its gradients
(ckptstore/torch/grad_capture.py, "Lending")."""

from __future__ import annotations

import copy
import gc
import shutil
import weakref
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore.errors import LoanWithdrawnError
from ckptstore.format import records as rec
from ckptstore.format.chunk import address_of
from ckptstore.format.image import BLOCK, LentFramer
from ckptstore.ops.fsck import check
from ckptstore.ops.host_staging import HostPool
from ckptstore.ops.loan import Loan
from ckptstore.tensors import LentTensor
from ckptstore.torch import Checkpointer
from test_chunk_image import _walk, check_loads_of, every_kind_of_append, sigkill_sweep_of_deltas
from test_direct import _RefusingWrite, dio_dir  # noqa: F401 - a fixture

CHUNK = 16 << 10


def _misaligned(n: int, shift: int, seed: int) -> torch.Tensor:
    """A contiguous float32 tensor of ``n`` entries starting ``shift`` entries into its storage
    (so its address is at no particular alignment)."""
    base = torch.from_numpy(np.random.default_rng(seed).standard_normal(n + shift).astype(np.float32))
    return base[shift:]


# ---- the pure layer ------------------------------------------------------------------------------

@settings(max_examples=120, deadline=None)
@given(n=st.integers(1, 5 * BLOCK), shift=st.integers(0, 2000), chunk=st.sampled_from([4096, 9000, 16384]),
       seed=st.integers(0, 2**31), framing=st.booleans())
def test_lent_records_are_valid_records_whose_middles_are_the_owners_memory(
        n: int, shift: int, chunk: int, seed: int, framing: bool) -> None:
    t = _misaligned(n, shift, seed)
    lent = LentTensor(t)
    mem = lent.memory()
    framer = LentFramer(framing)
    offsets = []
    for start in range(0, lent.nbytes, chunk):
        piece = mem[start:start + chunk]
        offsets.append(framer.add(piece, lent.address + start, address_of(piece)))
    buffers = framer.buffers()
    lo, hi = lent.address, lent.address + lent.nbytes
    for b in buffers:
        addr = np.frombuffer(b, dtype=np.uint8).ctypes.data
        assert addr % BLOCK == 0 and len(b) % BLOCK == 0  # what O_DIRECT takes
        assert lo <= addr < hi or not (lo <= addr < hi)  # (a gap or a middle)
    middles = [b for b in buffers if lo <= np.frombuffer(b, dtype=np.uint8).ctypes.data < hi]
    records = [(r[0], r[3]) for r in
               _walk(b"".join(bytes(b) for b in buffers), rec.FRAMING_CHECK if framing else 0)]
    data = [r for r in records if r[0] in offsets]
    assert [r[0] for r in data] == offsets
    assert b"".join(r[1] for r in data) == bytes(mem)
    assert all(r[1] == bytes(len(r[1])) for r in records if r[0] not in offsets)  # the pads
    # every whole block of the data that a middle could take went straight from memory
    assert sum(len(m) for m in middles) >= lent.nbytes - (lent.nbytes // chunk + 1) * 2 * BLOCK


def test_only_dense_contiguous_cpu_tensors_can_be_lent() -> None:
    with pytest.raises(ValueError):
        LentTensor(torch.zeros(4, 4).t())
    LentTensor(torch.zeros(4, 4))


# ---- through the store ---------------------------------------------------------------------------

def _grads(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"w": _misaligned(3 * CHUNK // 4 + 123 * i, 17 * i, i),
            "v": torch.randn(CHUNK // 2 + 5, generator=g), "b": torch.randn(7, generator=g)}


def _lent(i: int) -> dict:
    grads = _grads(i)
    return {"g": {"w": LentTensor(grads["w"]), "v": LentTensor(grads["v"])}, "b": grads["b"], "i": i}


def _check_loads(path: Path, its: list[int]) -> None:
    check_loads_of(path, its, _grads)


@pytest.mark.parametrize("mode", ["direct", "buffered", "refused-open", "refused-write"])
def test_lent_deltas_load_exactly_through_every_kind_of_append(tmp_path: Path, mode: str) -> None:
    every_kind_of_append(tmp_path, mode, _lent, _check_loads, 6 * 2 * CHUNK)


class _ShortDirect(_RefusingWrite):
    """O_DIRECT writes of several buffers stop short: only the first buffer and one block of
    the second are written (a device that stopped mid-request); single buffers go whole."""

    def _pwritev(self, fd, buffers, offset):
        if fd in self.direct_fds and len(buffers) > 1:
            self.refused += 1
            return super(_RefusingWrite, self)._pwritev(
                fd, [buffers[0], memoryview(buffers[1])[:BLOCK]], offset)
        return super(_RefusingWrite, self)._pwritev(fd, buffers, offset)


def test_a_short_vectored_direct_write_of_lent_records_is_finished_buffered(dio_dir: Path) -> None:
    ops = _ShortDirect()
    path = dio_dir / "s"
    with ckptstore.open(path, chunk_size=CHUNK, file_ops=ops) as s:
        s.save(0, {"w": torch.zeros(10)})
        for i in range(1, 4):
            s.save_delta(i, _lent(i), durable=True)
        assert ops.refused >= 3 and s.engine.log.writer.direct is not None
    assert check(str(path)).clean
    _check_loads(path, [1, 2, 3])


def test_lent_chunks_already_stored_or_compressible_are_not_written_from_memory(dio_dir: Path) -> None:
    path = dio_dir / "s"
    first = _misaligned(4 * CHUNK // 4, 3, 1)
    with ckptstore.open(path, chunk_size=CHUNK) as s:
        s.save(0, {"w": torch.zeros(10)})
        s.save_delta(1, {"g": LentTensor(first)}, durable=True)
        again = first.clone()
        again[CHUNK // 4:2 * CHUNK // 4] = 0  # chunk 1: zeros (compresses)
        stats = s.save_delta(2, {"g": LentTensor(again), "h": LentTensor(again)}, durable=True)
        assert stats.chunks_written == 1 and stats.dedup_bytes == 2 * again.nbytes - CHUNK
    assert check(str(path)).clean
    with ckptstore.open(path, mode="r") as r:
        assert torch.equal(r.load_record(2)["g"], again) and torch.equal(r.load_record(2)["h"], again)
        assert torch.equal(r.load_record(1)["g"], first)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["framing_checks", "full_checks"])
def test_sigkill_at_every_write_and_fsync_of_lent_deltas(dio_dir: Path, assert_same, kind: str) -> None:
    """test_chunk_image's sweep (every write and fsync killed) over lent deltas."""
    sigkill_sweep_of_deltas(dio_dir, assert_same, kind, _lent, _grads, _check_loads)


# ---- the loan ------------------------------------------------------------------------------------

def test_the_persister_reads_lent_tensors_only_once_the_lender_confirms(tmp_path: Path) -> None:
    t = torch.randn(CHUNK)
    decided = []
    with ckptstore.open(tmp_path / "s", chunk_size=CHUNK) as s:
        s.save(0, {"w": torch.zeros(10)})
        loan = Loan(1, lambda ln, early: (decided.append(1), ln.confirm()))
        fut = s.pipeline.submit("delta", 1, {"g": LentTensor(t)}, loan=loan)
        other = threading.Thread(target=lambda: decided.append(fut.done()))
        other.start()
        other.join()
        assert decided == [False] and not loan.decided  # (another thread's wait: not the lender)
        want = t.clone()
        fut.done()  # a poll on the lender's thread decides it
        assert loan.decided
        fut.result(timeout=30)
        assert decided == [False, 1] and loan.confirmed and loan.returned
        t.zero_()
    with ckptstore.open(tmp_path / "s", mode="r") as r:
        assert torch.equal(r.load_record(1)["g"], want)


def test_a_withdrawn_loan_drops_its_delta_and_the_chain_goes_on_from_the_one_before(tmp_path: Path) -> None:
    a, b = torch.randn(CHUNK), torch.randn(CHUNK)
    with ckptstore.open(tmp_path / "s", chunk_size=CHUNK) as s:
        s.save(0, {"w": torch.zeros(10)})
        s.pipeline.submit("delta", 1, {"g": LentTensor(a)}, commit=False,
                          loan=Loan(1, lambda ln, early: ln.confirm()))
        f2 = s.pipeline.submit("delta", 2, {"g": LentTensor(b)},
                               loan=Loan(2, lambda ln, early: ln.withdraw("changed")))
        with pytest.raises(LoanWithdrawnError, match="iteration 2.*changed"):
            f2.result(timeout=30)
        assert s.pipeline.tail() == 1
        s.save_async(2, {"w": torch.ones(10)}).result(timeout=30)  # the lender's base instead
        s.flush()
        assert s.iterations() == [0, 1, 2]
    assert check(str(tmp_path / "s")).clean
    with ckptstore.open(tmp_path / "s", mode="r") as r:
        assert torch.equal(r.load_record(1)["g"], a) and torch.equal(r.load(2)["w"], torch.ones(10))


def test_a_flush_on_the_lenders_thread_decides_its_loans(tmp_path: Path) -> None:
    with ckptstore.open(tmp_path / "s", chunk_size=CHUNK) as s:
        s.save(0, {"w": torch.zeros(10)})
        loans = [Loan(i, lambda ln, early: ln.confirm()) for i in (1, 2)]
        for i, loan in zip((1, 2), loans):
            s.pipeline.submit("delta", i, {"g": LentTensor(torch.randn(CHUNK))}, loan=loan)
        s.flush()
        assert all(ln.confirmed and ln.returned for ln in loans)
        assert s.iterations() == [0, 1, 2]


# ---- the Checkpointer ----------------------------------------------------------------------------

def _trainer(width: int = 2048) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model (three large gradients, a small one) and its AdamW, seeded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _steps(ck: Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int,
           zero_last: bool = True):
    """Train steps 1..n (gradients dropped after each, but the last unless ``zero_last``);
    returns the last step's future."""
    for it in range(1, n + 1):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        fut = ck.step(it)
        if it < n or zero_last:
            opt.zero_grad()
    return fut


def _train(path: Path, steps: int, set_to_none, wait_each: bool = False, backwards: int = 1,
           **kw):
    """Train a small model ``steps`` steps with a Checkpointer (every iteration a delta),
    ``backwards`` backward passes per step (accumulated); ``set_to_none(it)``: how zero_grad
    clears after step ``it``. Returns (the live states by iteration, the capture counts, why
    lending stopped)."""
    model, opt = _trainer()
    states = {}
    with ckptstore.open(path) as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50, **kw)
        ck.restore()
        for it in range(1, steps + 1):
            for _ in range(backwards):
                model(torch.randn(8, 32)).pow(2).mean().backward()
            fut = ck.step(it)
            if wait_each:
                fut.result(timeout=60)  # (on the training thread: no deadlock)
            states[it] = copy.deepcopy(model.state_dict())
            opt.zero_grad(set_to_none=set_to_none(it))
        ck.close()
        counts, stopped = dict(ck.capture_counts), ck._capture.lend_stopped
    return states, counts, stopped


def _restores_every_iteration(path: Path, states: dict) -> None:
    assert check(str(path)).clean
    with ckptstore.open(path, mode="r") as r:
        assert r.iterations() == [0, *states]
        for it, want in states.items():
            got = r.load(it)["model"]
            assert all(torch.equal(got[k], v) for k, v in want.items()), it


def test_the_checkpointer_lends_gradients_a_loop_drops_and_restores_every_iteration(tmp_path: Path) -> None:
    states, counts, stopped = _train(tmp_path / "s", 10, lambda it: True)
    assert counts["lent"] >= 2 * 7 and not stopped  # lending from the third step on
    _restores_every_iteration(tmp_path / "s", states)


def test_gradients_zeroed_in_place_are_never_lent(tmp_path: Path) -> None:
    states, counts, stopped = _train(tmp_path / "s", 8, lambda it: False)
    assert counts["lent"] == 0 and not stopped
    _restores_every_iteration(tmp_path / "s", states)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("at", [3, 6])
def test_a_lent_gradient_changed_in_place_turns_its_iteration_into_a_base(tmp_path: Path, at: int,
                                                                          group: int) -> None:
    """The loop switches to zero_grad(set_to_none=False) after lending began: the delta whose
    gradients were zeroed in place is dropped unwritten, its iteration written as a base of
    the live state (which commits the group's earlier deltas), lending stops; every iteration
    restores exactly."""
    states, counts, stopped = _train(tmp_path / "s", 10, lambda it: it < at, group_commit=group)
    assert counts["lent"] > 0 and f"after step {at}" in stopped
    _restores_every_iteration(tmp_path / "s", states)
    with ckptstore.open(tmp_path / "s", mode="r") as r:
        assert r.base_of(at) == at


def test_waiting_for_a_lent_steps_future_on_the_training_thread_decides_it(tmp_path: Path) -> None:
    states, counts, _ = _train(tmp_path / "s", 6, lambda it: True, wait_each=True)
    assert counts["lent"] > 0
    _restores_every_iteration(tmp_path / "s", states)


def test_the_hooks_capture_keeps_copying(tmp_path: Path) -> None:
    states, counts, _ = _train(tmp_path / "s", 6, lambda it: True, capture="hooks")
    assert counts["lent"] == 0 and counts["hook"] > 0
    _restores_every_iteration(tmp_path / "s", states)


def test_a_dropped_lent_gradient_is_written_without_waiting_for_the_next_step(tmp_path: Path) -> None:
    """After step 6 the loop drops its gradients and pauses (no further step, flush or wait):
    the persister sees them unreachable, confirms the loan itself and the delta becomes
    durable."""
    model, opt = _trainer()
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50)
        ck.restore()
        _steps(ck, model, opt, 6)
        assert ck.capture_counts["lent"] > 0
        _wait_durable(store, 6)
        ck.close()


def test_gradients_still_held_are_written_once_the_next_backward_decides(tmp_path: Path) -> None:
    """After step 6 the loop keeps its gradients (it zeroes them before the next backward,
    after an evaluation forward): nothing is written while they are ``p.grad``; the next
    backward's first gradient decides the loan and the delta becomes durable before step 7."""
    model, opt = _trainer()
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50)
        ck.restore()
        _steps(ck, model, opt, 6, zero_last=False)
        with torch.no_grad():
            model(torch.randn(8, 32))
        import time
        time.sleep(0.2)
        assert store.durable_iteration() == 5 and ck.capture_counts["lent"] > 0
        opt.zero_grad()
        model(torch.randn(8, 32)).pow(2).mean().backward()
        _wait_durable(store, 6)
        ck.close()


def _wait_durable(store, it: int) -> None:
    import time
    deadline = time.monotonic() + 60
    while store.durable_iteration() != it and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.durable_iteration() == it


def test_close_waits_for_gradients_still_held_so_changing_them_after_is_safe(tmp_path: Path) -> None:
    """The loop stops without zero_grad: the last step's lent gradients are still ``p.grad``;
    close() confirms the loan and returns only once the persister has read them, so zeroing
    them right after cannot tear the record."""
    model, opt = _trainer()
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50)
        ck.restore()
        _steps(ck, model, opt, 5, zero_last=False)
        want = copy.deepcopy(model.state_dict())
        assert ck.capture_counts["lent"] > 0
        ck.close()
        for p in model.parameters():
            p.grad.fill_(float("nan"))
    with ckptstore.open(tmp_path / "s", mode="r") as r:
        got = r.load(5)["model"]
        assert all(torch.equal(got[k], v) for k, v in want.items())


def test_kept_futures_do_not_keep_lent_gradients_alive(tmp_path: Path) -> None:
    """A caller keeping every step's future (a benchmark, a callback list) must not keep every
    step's gradients: a decided loan lets go of them (each would otherwise be fresh memory,
    page-faulted in by the next backward)."""
    import gc
    import weakref

    model, opt = _trainer()
    futures, grads = [], []
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50)
        ck.restore()
        for it in range(1, 9):
            model(torch.randn(8, 32)).pow(2).mean().backward()
            grads.append(weakref.ref(model[0].weight.grad))
            futures.append(ck.step(it))
            opt.zero_grad()
        ck.flush()
        assert ck.capture_counts["lent"] > 0
        gc.collect()
        assert all(g() is None for g in grads[:-1]), [g() is None for g in grads]
        assert all(f.exception() is None for f in futures)
        ck.close()


def test_gradients_zeroed_in_place_after_the_last_step_are_recorded_by_close(tmp_path: Path) -> None:
    """The in-place zeroing comes after the last step: no delta step follows to restart the
    chain, so close() writes that iteration as a base (nothing lost)."""
    states, counts, stopped = _train(tmp_path / "s", 6, lambda it: it < 6)
    assert counts["lent"] > 0 and "after step 6" in stopped
    _restores_every_iteration(tmp_path / "s", states)


def test_a_lent_step_whose_submit_fails_does_not_hang_close(tmp_path: Path, monkeypatch) -> None:
    """The record of a lent step cannot be submitted (an error in the pipeline's submit): the
    step raises, and close(), with the gradients still p.grad, returns instead of waiting for
    a write that will never happen."""
    from ckptstore.ops import pipeline

    model, opt = _trainer()
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50)
        ck.restore()
        _steps(ck, model, opt, 4)
        real = pipeline.snapshot_leaves

        def fail(*a, **kw):
            raise RuntimeError("injected submit failure")

        monkeypatch.setattr(pipeline, "snapshot_leaves", fail)
        model(torch.randn(8, 32)).pow(2).mean().backward()
        with pytest.raises(RuntimeError, match="injected"):
            ck.step(5)
        monkeypatch.setattr(pipeline, "snapshot_leaves", real)
        closing = threading.Thread(target=ck.close, daemon=True)
        closing.start()
        closing.join(timeout=60)
        assert not closing.is_alive(), "close() hung on a loan no job will read"
    with ckptstore.open(tmp_path / "s", mode="r") as r:
        assert r.iterations()[-1] == 4


def test_polling_a_future_on_the_training_thread_ends_while_gradients_are_held(tmp_path: Path) -> None:
    import time

    model, opt = _trainer()
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50)
        ck.restore()
        fut = _steps(ck, model, opt, 5, zero_last=False)
        assert ck.capture_counts["lent"] > 0
        deadline = time.monotonic() + 60
        while not fut.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert fut.done() and fut.exception() is None
        ck.close()


def test_gradients_that_view_a_persistent_buffer_are_copied_not_lent(tmp_path: Path) -> None:
    """A loop that lays each step's gradients in one flat buffer (new views each step, the same
    memory) looks like one that drops them; they are not lent (the buffer is written again)."""
    model, opt = _trainer()
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    states = {}
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50)
        ck.restore()
        for it in range(1, 7):
            loss = model(torch.randn(8, 32)).pow(2).mean()
            grads = torch.autograd.grad(loss, params)
            off = 0
            for p, g in zip(params, grads):
                view = flat[off:off + g.numel()].view_as(g)
                view.copy_(g)
                p.grad = view
                off += g.numel()
            ck.step(it)
            states[it] = copy.deepcopy(model.state_dict())
            opt.zero_grad()
        assert ck.capture_counts["lent"] == 0
        ck.close()
    _restores_every_iteration(tmp_path / "s", states)


def _spy_on_acquire(monkeypatch) -> list[tuple[int, weakref.ref]]:
    """Every host arena acquired from now on: (bytes asked for, a weak reference to it)."""
    asked: list[tuple[int, weakref.ref]] = []
    acquire = HostPool.acquire

    def spy(self, nbytes, own=0):
        arena, waited = acquire(self, nbytes, own)
        asked.append((nbytes, weakref.ref(arena)))
        return arena, waited
    monkeypatch.setattr(HostPool, "acquire", spy)
    return asked


def test_lending_steps_hold_host_memory_for_the_small_gradients_only(tmp_path: Path, monkeypatch) -> None:
    """Once the large gradients are lent, a step's arena has room for the small ones alone, and
    the full-size arenas of the two steps before lending are freed, not kept in the pool."""
    asked = _spy_on_acquire(monkeypatch)
    model, opt = _trainer()
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50)
        ck.restore()
        _steps(ck, model, opt, 8)
        ck.flush()
        cap = ck._capture
        full = [ref for n, ref in asked if n == cap._slot_bytes]
        small = [n for n, _ in asked if n == cap._small_bytes]
        assert cap._small_bytes < cap._slot_bytes
        assert len(full) == 2 and len(small) == 6  # steps 1-2 copy; 3-8 lend
        gc.collect()
        assert all(ref() is None for ref in full)
        ck.close()


def _train_with_unlendable_steps(path: Path, asked: list, unlendable: set[int], steps: int = 8,
                                  **store_options) -> tuple[dict, dict, dict]:
    """Train ``_trainer(width=8192)`` (all its slots: over the pool's 1 MiB rounding) with every
    iteration a delta, its first weight's gradient made a view (which cannot be lent) at the
    iterations in ``unlendable`` (each then flushed: its arenas are back in the pool); appends
    ("step", it) to ``asked`` as each step starts. Returns (the live states, the capture counts,
    the capture's arena bytes -> "small" or "full")."""
    model, opt = _trainer(width=8192)
    weight = model[0].weight
    states, kinds = {}, {}
    with ckptstore.open(path, **store_options) as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50)
        ck.restore()
        cap = ck._capture
        kinds = {cap._small_bytes: "small", cap._slot_bytes: "full"}
        assert cap._slot_bytes > 1 << 20
        for it in range(1, steps + 1):
            asked.append(("step", it))
            model(torch.randn(8, 32)).pow(2).mean().backward()
            if it in unlendable:
                view = torch.zeros(weight.numel() + 16)[16:].view_as(weight)
                view.copy_(weight.grad)
                weight.grad = view
            ck.step(it)
            states[it] = copy.deepcopy(model.state_dict())
            opt.zero_grad()
            if it in unlendable:
                ck.flush()
        counts = dict(ck.capture_counts)
        ck.close()
    return states, counts, kinds


def test_a_gradient_lending_cannot_take_is_copied_beside_the_small_ones_captured(
        tmp_path: Path, monkeypatch) -> None:
    """While lending, backward captures the small gradients into an arena with room for them
    alone; a step whose large gradient cannot be lent (a view) copies it into a full arena, the
    small gradients moved over; the next such step reuses that arena; every iteration restores
    exactly."""
    asked = _spy_on_acquire(monkeypatch)
    states, counts, kinds = _train_with_unlendable_steps(tmp_path / "s", asked, {5, 6})
    by_step: dict[int, list] = {}
    it = 0
    for n, ref in asked:
        if n == "step":
            it = ref
        elif n in kinds:
            by_step.setdefault(it, []).append((kinds[n], ref))
    assert [k for k, _ in by_step[1]] == ["full"] and [k for k, _ in by_step[2]] == ["full"]
    for i in (3, 4, 7, 8):
        assert [k for k, _ in by_step[i]] == ["small"], i
    for i in (5, 6):
        assert [k for k, _ in by_step[i]] == ["small", "full"], i
    assert by_step[6][1][1]() is not None and by_step[6][1][1]() is by_step[5][1][1]()
    assert counts["lent"] == 3 * 6 - 2 and counts["step"] == 2
    _restores_every_iteration(tmp_path / "s", states)


def test_moving_to_a_full_arena_within_a_tight_host_budget_does_not_wait_for_itself(
        tmp_path: Path) -> None:
    """The capture's own small arena does not count against the full one it moves to (with a
    budget that fits the full arena alone, waiting for it would wait forever)."""
    done = []
    worker = threading.Thread(target=lambda: done.append(_train_with_unlendable_steps(
        tmp_path / "s", [], {5}, steps=6, host_budget=2 << 20)), daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the step that needed a full arena waited for its own small one"
    states, counts, _ = done[0]
    assert counts["step"] == 1
    _restores_every_iteration(tmp_path / "s", states)


def test_an_arena_the_pool_drops_is_freed_though_the_capture_viewed_it(tmp_path: Path,
                                                                       monkeypatch) -> None:
    """The capture's cached slot views do not keep an arena alive: once the pool drops it (here
    to make room within a smaller budget), its memory is freed."""
    asked = _spy_on_acquire(monkeypatch)
    model, opt = _trainer()
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50,
                          capture="hooks")
        ck.restore()
        _steps(ck, model, opt, 3)
        ck.flush()
        slots = [ref for n, ref in asked if n == ck._capture._slot_bytes]
        assert slots and slots[0]() is not None  # cached by the pool
        pool = store.running_pipeline.pool
        pool.set_budget(2 << 20)
        other, _ = pool.acquire(2 << 20)  # no room: the pool drops what it cached
        gc.collect()
        assert all(ref() is None for ref in slots)
        pool.release(other)
        ck.close()


@pytest.mark.parametrize("in_place_from", [None, 5])
def test_the_two_part_step_lends_too(tmp_path: Path, in_place_from: int | None) -> None:
    """before_step/after_step (a framework's trainer: the Hugging Face integration) lend like
    step, the loop dropping its gradients between the halves; one that zeroes them in place
    there from some step on has that iteration written as a base instead, then copies."""
    model, opt = _trainer()
    states = {}
    with ckptstore.open(tmp_path / "s") as store:
        ck = Checkpointer(store, model, opt, policy="every-iteration", base_every=50)
        ck.restore()
        for it in range(1, 9):
            model(torch.randn(8, 32)).pow(2).mean().backward()
            ck.before_step(it)
            opt.step()
            opt.zero_grad(set_to_none=in_place_from is None or it < in_place_from)
            ck.after_step()
            states[it] = copy.deepcopy(model.state_dict())
        counts, stopped = dict(ck.capture_counts), ck._capture.lend_stopped
        ck.close()
    if in_place_from is None:
        assert counts["lent"] == 3 * 6 and not stopped
    else:
        assert counts["lent"] == 3 * 3 and stopped  # steps 3-5 lent; 5 withdrawn
    _restores_every_iteration(tmp_path / "s", states)


def test_accumulated_gradients_are_lent_and_every_iteration_restores(tmp_path: Path) -> None:
    """Two backward passes per step (the second accumulates in place into the gradients the
    first created; dropped after the step): lent from the third step on, and the next step's
    first backward decides the loan before the second changes anything."""
    states, counts, stopped = _train(tmp_path / "s", 8, lambda it: True, backwards=2)
    assert counts["lent"] == 3 * 6 and not stopped
    _restores_every_iteration(tmp_path / "s", states)
