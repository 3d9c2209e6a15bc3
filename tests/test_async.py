"""The asynchronous pipeline (ckptstore/pipeline.py): snapshot isolation, ordering, futures,
interleaved loads and a reader process, backpressure and buffer reuse, failures surfaced through
future / next call / flush / close with the store kept consistent, SIGKILL during in-flight
persists, the Checkpointer's layer-wise gradient capture, the DDP comm hook and the CLI stats."""

from __future__ import annotations

import copy
import datetime
import errno
import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.errors import CheckpointAbortedError, DiskFullError, IterationOrderError, StoreIOError
from ckptstore.ops.fsck import check

from _crashkit import CHUNK_SIZE, SEGMENT_SIZE, KillOps, run_forked, state_for
from _ranks import needs_gloo
from test_faults import FaultyOps

HERE = os.path.dirname(os.path.abspath(__file__))


class GateOps(FaultyOps):
    """FaultyOps whose writes block while ``gate`` is clear (holds persists in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def _pwritev(self, fd, buffers, offset):
        assert self.gate.wait(60), "gate held too long"
        return super()._pwritev(fd, buffers, offset)


def open_store(path, **kw):
    return ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE, **kw)


def test_save_async_round_trip_order_and_stats(tmp_path, assert_same):
    with open_store(tmp_path / "s") as store:
        futs = [store.save_async(i, state_for(i), meta={"i": i}) for i in range(1, 9)]
        stats = [f.result(timeout=60) for f in futs]
        assert [s.iteration for s in stats] == list(range(1, 9))
        for s in stats:
            assert s.kind == "snapshot" and s.stall_s >= s.snapshot_s >= 0 and s.persist_s > 0
            assert s.logical_bytes > 0 and s.written_bytes > 0 and s.queue_depth >= 0
        assert sum(s.dedup_bytes for s in stats) > 0  # "embed" never changes
        assert [s.iteration for s in store.stats()] == list(range(1, 9))
        with pytest.raises(IterationOrderError):
            store.save_async(8, state_for(8))
        assert store.iterations() == list(range(1, 9))
        for i in (1, 5, 8):
            assert_same(state_for(i), store.load(i))
            assert store.meta(i) == {"i": i}
            p = store.manifest(i).extra["pipeline"]
            assert set(p) >= {"stall_s", "wait_s", "snapshot_s", "queue_depth", "write_s", "dedup_bytes"}
        # interleaving with synchronous saves keeps the order rule
        store.save(9, state_for(9))
        f = store.save_async(10, state_for(10))
        store.flush()
        assert f.done() and store.iterations()[-2:] == [9, 10]
    assert check(tmp_path / "s").clean


def _hostile_state():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    nan = torch.tensor([float("nan")] * 3).view(torch.int32)
    nan[1] = 0x7FC00123  # a NaN payload must survive the snapshot copy
    return {
        "plain": torch.randn(5000),
        "strided": base.t(),  # non-contiguous
        "conj": torch.complex(torch.randn(7), torch.randn(7)).conj(),
        "neg": torch.randn(9)._neg_view(),
        "bool": torch.tensor([True, False, True]),
        "nan": nan.view(torch.float32),
        "np": np.arange(3000, dtype=">f8"),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "param": torch.nn.Parameter(torch.randn(100)),
        "list": [torch.ones(2000), 7, "x"],
    }


def _materialize(x):
    """A deep copy of the values a state holds at this moment (what must be stored)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        t = t.resolve_conj().resolve_neg().clone()
        return torch.nn.Parameter(t, requires_grad=x.requires_grad) if isinstance(x, torch.nn.Parameter) else t
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, dict):
        return {k: _materialize(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_materialize(v) for v in x]
    return x


def _mutate(x):
    if isinstance(x, torch.Tensor):
        with torch.no_grad():
            if x.numel():
                base = x._base if x._base is not None else x
                base.reshape(-1).view(torch.uint8).fill_(0x55)
    elif isinstance(x, np.ndarray):
        x[...] = -1
    elif isinstance(x, dict):
        for v in x.values():
            _mutate(v)
    elif isinstance(x, list):
        for v in x:
            _mutate(v)


def test_mutating_live_tensors_after_save_async_never_leaks(tmp_path, assert_same):
    ops = GateOps()
    with open_store(tmp_path / "s", file_ops=ops) as store:
        expected = {}
        futs = []
        ops.gate.clear()  # nothing reaches the disk until every state has been overwritten
        try:
            for i in range(1, 4):
                st = _hostile_state()
                expected[i] = _materialize(st)
                futs.append(store.save_async(i, st))
                _mutate(st)
                st["list"][0].add_(100)
                st["list"].append("late")  # the structure is captured at save_async time too
            assert not any(f.done() for f in futs), [f.exception() for f in futs if f.done()]
        finally:
            ops.gate.set()
        store.flush()
        for i in range(1, 4):
            assert_same(expected[i], store.load(i), f"iteration {i}")


def test_loads_interleaved_with_async_saves(tmp_path, assert_same):
    ops = GateOps()
    with open_store(tmp_path / "s", file_ops=ops, max_inflight=3) as store:
        store.save(1, state_for(1))
        for i in range(2, 16):
            if i % 5 == 0:  # this one is held in flight while it is loaded
                ops.gate.clear()
                threading.Timer(0.2, ops.gate.set).start()
            store.save_async(i, state_for(i))
            if i % 3 == 0:
                assert_same(state_for(i - 2), store.load(i - 2))  # committed or in flight: waits
            if i % 5 == 0:
                assert_same(state_for(i), store.load(i))
        assert store.iterations() == list(range(1, 16))


READER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[3])
import ckptstore
from _crashkit import state_for
from conftest import _same
path, stop = sys.argv[1], sys.argv[2]
seen = set(); checks = 0
while True:
    done = os.path.exists(stop)
    try:
        with ckptstore.open(path, "r") as r:
            its = r.iterations()
            assert its == list(range(1, len(its) + 1)), its
            for i in its[-3:]:
                _same(state_for(i), r.load(i), f"iteration {i}")
                checks += 1
            seen.update(its)
    except ckptstore.StoreNotFoundError:
        pass
    if done:
        break
    time.sleep(0.01)
print(len(seen), checks)
"""


def test_reader_process_sees_only_whole_checkpoints(tmp_path):
    path, stop = tmp_path / "s", tmp_path / "stop"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), HERE]))
    with open_store(path) as store:
        store.save(1, state_for(1))
        reader = subprocess.Popen([sys.executable, "-c", READER, str(path), str(stop), HERE],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for i in range(2, 41):
                store.save_async(i, state_for(i))
                if i % 8 == 0:
                    time.sleep(0.05)
            store.flush()
        finally:
            stop.touch()
            out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err[-3000:]
    n_seen, checks = map(int, out.split())
    assert n_seen == 40 and checks > 0


@pytest.mark.parametrize("where", ["future", "next_call", "flush", "close"])
@pytest.mark.parametrize("fault", [("write", errno.ENOSPC), ("fsync", errno.EIO)],
                         ids=["write-ENOSPC", "fsync-EIO"])
def test_failing_writer_surfaces_error_and_keeps_earlier_checkpoints(tmp_path, assert_same, where,
                                                                     fault):
    op, err = fault
    ops = GateOps()
    store = open_store(tmp_path / "s", file_ops=ops)
    for i in (1, 2):
        store.save_async(i, state_for(i))
    store.flush()
    ops.gate.clear()
    f3 = store.save_async(3, state_for(3))
    f4 = store.save_async(4, state_for(4))  # queued behind the failure: aborted
    ops.arm(op, 1, err)
    ops.gate.set()
    exc_type = DiskFullError if err == errno.ENOSPC else StoreIOError
    with pytest.raises(exc_type) as ei:
        f3.result(timeout=60)
    assert ei.value.errno == err
    with pytest.raises(CheckpointAbortedError):
        f4.result(timeout=60)
    if where == "future":
        pass  # the next call still raises it once (never lost), checked below
    if where in ("future", "next_call"):
        with pytest.raises(exc_type):
            store.iterations()
        assert store.iterations() == [1, 2]  # reported once; the store is consistent
    elif where == "flush":
        with pytest.raises(exc_type):
            store.flush()
        store.flush()  # reported once
    else:
        with pytest.raises(exc_type):
            store.close()
        store = open_store(tmp_path / "s")
    assert store.iterations() == [1, 2]
    # writing resumes: the failed iteration can be saved again
    store.save_async(3, state_for(3)).result(timeout=60)
    store.close()
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.iterations() == [1, 2, 3]
        for i in (1, 2, 3):
            assert_same(state_for(i), r.load(i))
    assert check(tmp_path / "s").clean


@pytest.mark.parametrize("direct_io,nth", [(False, 8), (True, 1)])
def test_failure_rolls_back_uncommitted_async_deltas(tmp_path, assert_same, direct_io, nth):
    """With O_DIRECT appends the group's records are staged and reach the file in its sync, so
    the first write after the gate opens fails; buffered, the 8th (inside delta 4 or 5)."""
    ops = GateOps()
    store = open_store(tmp_path / "s", file_ops=ops, direct_io=direct_io)
    store.save_async(1, state_for(1))
    d2 = store.save_delta_async(2, state_for(2), durable=True)
    d2.result(timeout=60)
    ops.gate.clear()
    d3 = store.save_delta_async(3, state_for(3), durable=False)
    d4 = store.save_delta_async(4, state_for(4), durable=False)
    d5 = store.save_delta_async(5, state_for(5), durable=True)
    assert store.pending() == [3, 4, 5]
    ops.arm("write", nth, errno.EIO)
    ops.gate.set()
    for f in (d3, d4, d5):
        with pytest.raises((CheckpointAbortedError, StoreIOError)):
            f.result(timeout=60)
    with pytest.raises(StoreIOError):
        store.flush()
    assert store.iterations() == [1, 2] and store.pending() == []
    assert_same(state_for(2), store.load_record(2))
    store.save_delta_async(3, state_for(3)).result(timeout=60)
    store.close()
    assert check(tmp_path / "s").clean


def test_host_pool_reuses_an_arena_only_for_requests_near_its_size_and_frees_retired_ones():
    """Best fit among cached arenas at most twice the request while the budget has room for a
    new one (a small request does not take, and hold, the arena a large one will want again),
    else among all; a retired arena is freed, not cached: at once when cached, at its release
    when reserved."""
    import weakref

    from ckptstore.ops.host_staging import HostPool
    pool = HostPool(64 << 20, pin=False)
    big, _ = pool.acquire(8 << 20)
    pool.release(big)
    small, _ = pool.acquire(1 << 20)
    assert small is not big and pool.allocations == 2 and pool.cached == 8 << 20
    again, _ = pool.acquire(5 << 20)
    assert again is big and pool.cached == 0  # (5 MiB <= 8 MiB <= 2 x 5 MiB)
    gone = weakref.ref(again)
    pool.retire(again)  # reserved: freed at its release
    pool.release(again)
    del big, again
    gc.collect()
    assert gone() is None and pool.cached == 0 and pool.reserved == 1 << 20
    pool.release(small)
    assert pool.cached == 1 << 20
    tight = HostPool(8 << 20, pin=False)  # no room for another: the cached one serves
    big, _ = tight.acquire(8 << 20)
    tight.release(big)
    assert tight.acquire(1 << 20)[0] is big and tight.allocations == 1
    gone = weakref.ref(small)
    pool.retire(small)  # cached: freed now
    del small
    gc.collect()
    assert gone() is None and pool.cached == 0 and pool.reserved == 0


def test_backpressure_budget_and_buffer_reuse(tmp_path):
    ops = GateOps()
    one = sum(v.nbytes for v in state_for(1)["model"].values())
    with open_store(tmp_path / "s", file_ops=ops, max_inflight=2, host_budget=2 << 20) as store:
        store.save(0, {"x": 1})
        ops.gate.clear()
        threading.Timer(0.3, ops.gate.set).start()
        futs = [store.save_async(i, state_for(i)) for i in range(1, 6)]
        stats = [f.result(timeout=60) for f in futs]
        assert max(s.wait_s for s in stats) >= 0.1  # the third save waited for a slot
        assert all(s.queue_depth <= 2 for s in stats)
        pool = store.pipeline.pool
        assert pool.reserved == 0 and pool.cached <= pool.budget
        n_alloc = pool.allocations
        for i in range(6, 30):
            store.save_async(i, state_for(i))
        store.flush()
        assert pool.allocations <= n_alloc + 1, "host buffers are reused, not allocated per save"
        store.set_async_limits(max_inflight=1)
        assert store.pipeline.max_inflight == 1
    assert one > 0


def _shaped_states():
    """States whose structure changes from one to the next (shape, dtype at equal byte size,
    numpy byte order, an added key, a removed key, a strided leaf), then repeats: snapshot
    layouts are cached by structure and every change must miss the cache."""
    g = torch.Generator().manual_seed(7)

    def base(**kw):
        st = {"a": torch.randn(100, generator=g), "b": torch.arange(50) * 3, "c": [torch.randn(3, 4, generator=g)],
              "np": np.arange(40, dtype="<f8") * 0.5, "nan": torch.full((5,), 0x7FA00001, dtype=torch.int32).view(torch.float32)}
        st.update(kw)
        return st

    yield base()
    yield base()  # same structure, new values
    yield base(a=torch.randn(120, generator=g))  # shape
    yield base(a=torch.randn(10, 10, generator=g))  # same bytes, other shape
    yield base(a=torch.randn(50, generator=g).double())  # same bytes, other dtype
    yield base(np=np.arange(40, dtype=">f8") * 0.25)  # numpy byte order
    st = base()
    yield {"a": st["a"], "new": torch.randn(7, 3, generator=g).half(), **{k: v for k, v in st.items() if k != "a"}}
    yield {k: v for k, v in base().items() if k != "b"}  # removed key
    yield base(c=[torch.randn(4, 3, generator=g).t()])  # a strided leaf where a contiguous one was
    yield base(a=torch.randn(100, generator=g).to(torch.bfloat16).float())  # back to the first layout


@pytest.mark.parametrize("in_flight", [False, True])
def test_snapshot_layout_cache_follows_structure_changes(tmp_path, assert_same, in_flight):
    """Every save stores exactly the state it was given when consecutive states differ in
    structure: one after another (the same arena reused with another layout) and all in flight
    at once (each in its own arena), live tensors overwritten right after each save_async."""
    ops = GateOps()
    expected = {}
    with open_store(tmp_path / "s", file_ops=ops, max_inflight=16) as store:
        if in_flight:
            ops.gate.clear()
        futs = []
        for i, st in enumerate(_shaped_states(), start=1):
            expected[i] = _materialize(st)
            futs.append(store.save_async(i, st))
            _mutate(st)
            if not in_flight:
                futs[-1].result(timeout=60)
        ops.gate.set()
        for f in futs:
            f.result(timeout=60)
        for i, exp in expected.items():
            assert_same(exp, store.load(i), f"iteration {i}")
        if not in_flight:
            assert store.pipeline.pool.allocations == 1  # one arena served every layout


def test_save_async_inside_and_outside_inference_mode(tmp_path, assert_same):
    """The pooled arena and its cached views are created in inference mode by the first save and
    reused by saves outside it (and the reverse): copies into them work in both modes."""
    with open_store(tmp_path / "s") as store:
        expected = {}
        for i, inference in enumerate([True, False, True, False], start=1):
            st = {"w": torch.randn(64, 8), "p": torch.nn.Parameter(torch.randn(10))}
            expected[i] = _materialize(st)
            with torch.inference_mode(inference):
                store.save_async(i, st).result(timeout=60)
        for i, exp in expected.items():
            assert_same(exp, store.load(i), f"iteration {i}")


def test_save_async_on_reader_and_closed_store(tmp_path):
    with open_store(tmp_path / "s") as store:
        store.save_async(1, {"a": torch.ones(3)}).result(timeout=30)
    with ckptstore.open(tmp_path / "s", "r") as r:
        with pytest.raises(ckptstore.ReadOnlyStoreError):
            r.save_async(2, {})
    with pytest.raises(ckptstore.StoreClosedError):
        store.save_async(2, {})
    with open_store(tmp_path / "s") as store:
        with pytest.raises(ckptstore.UnsupportedTypeError):
            store.save_async(2, {"a": object()})
        store.save_async(2, {"a": 1}).result(timeout=30)  # nothing was reserved by the refusal


# ---- SIGKILL during in-flight persists ------------------------------------------------------
def _victim(path: str, nth: int, target: str, log: str) -> None:
    torch.set_num_threads(1)
    store = ckptstore.open(path, "a", chunk_size=CHUNK_SIZE, segment_size=SEGMENT_SIZE,
                           file_ops=KillOps(target, nth, tear=0.5), max_inflight=3)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def done(it):
        def cb(f):
            if f.exception() is None:
                os.write(fd, f"{it}\n".encode())  # resolved => durable (checked by the parent)
        return cb
    for it in range(1, 15):
        if it % 5 == 1:
            f = store.save_async(it, state_for(it))
        else:
            f = store.save_delta_async(it, state_for(it), durable=it % 2 == 0)
        f.add_done_callback(done(it))
    store.close()


def test_sigkill_during_inflight_persists(tmp_path, assert_same):
    trials = max(20, int(os.environ.get("CKPTSTORE_TRIALS", "20")))
    rnd = random.Random(4321)
    killed = 0
    for trial in range(trials):
        d = tmp_path / f"t{trial}"
        target = rnd.choice(["write", "write", "fsync", "any"])
        nth = rnd.randint(1, 140 if target != "fsync" else 14)
        rc = run_forked(_victim, str(d / "s"), nth, target, str(d / "resolved"))
        where = f"trial {trial} ({target} #{nth})"
        assert rc in (0, -signal.SIGKILL), f"{where}: victim failed rc={rc}"
        killed += rc == -signal.SIGKILL
        resolved = [int(x) for x in open(d / "resolved").read().split()] \
            if os.path.exists(d / "resolved") else []
        if not os.path.exists(d / "s" / "STORE"):
            assert not resolved
            continue
        with ckptstore.open(d / "s", "r") as r:
            its = r.iterations()
            assert its == list(range(1, len(its) + 1)), f"{where}: {its}"
            assert set(resolved) <= set(its), f"{where}: resolved {resolved} but durable {its}"
            for it in its:
                assert_same(state_for(it), r.load_record(it), f"{where} iteration {it}")
        with open_store(d / "s") as w:  # the writer recovers and continues
            nxt = (its[-1] if its else 0) + 1
            w.save_async(nxt, state_for(nxt)).result(timeout=60)
        assert check(d / "s").clean, where
    assert killed >= trials // 2, f"only {killed} of {trials} trials were killed mid-run"


# ---- Checkpointer: layer-wise capture ---------------------------------------------------------
def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _batch(it):
    g = torch.Generator().manual_seed(it)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip_grad_norm"])
def test_checkpointer_captures_grads_during_backward(tmp_path, assert_same, clip):
    from ckptstore.torch import Checkpointer

    model, opt = _tiny()
    store = ckptstore.open(tmp_path / "s")
    ck = Checkpointer(store, model, opt, base_every=7, group_commit=2, policy="every-iteration",
                      capture="hooks")  # (the default "lend" lends the large ones instead)
    ck.restore()
    saved = {}
    for it in range(1, 16):
        x, y = _batch(it)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip:  # in place after backward: seen by _version, recopied at step
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        ck.step(it)
        opt.zero_grad()
        saved[it] = copy.deepcopy(model.state_dict())
    store.flush()
    n = len(list(model.parameters()))
    assert ck.capture_counts["hook"] >= 13 * n
    if clip:
        assert ck.capture_counts["step"] >= 13 * n
    else:
        assert ck.capture_counts["step"] == 0
    for it in (3, 7, 11, 15):
        assert_same(saved[it], store.load(it)["model"], f"iteration {it}")
    assert all(s.stall_s >= 0 for s in store.stats())
    store.close()


def test_checkpointer_restarts_chain_after_background_failure(tmp_path, assert_same):
    from ckptstore.torch import Checkpointer

    ops = FaultyOps()
    model, opt = _tiny()
    store = ckptstore.open(tmp_path / "s", file_ops=ops)
    ck = Checkpointer(store, model, opt, base_every=100, policy="every-iteration")
    ck.restore()
    saved = {}

    def train(it):
        x, y = _batch(it)
        torch.nn.functional.mse_loss(model(x), y).backward()
        try:
            fut = ck.step(it)
        finally:
            opt.zero_grad()
        saved[it] = copy.deepcopy(model.state_dict())
        return fut

    for it in range(1, 5):
        train(it).result(timeout=30)
    ops.arm("write", 1, errno.ENOSPC)
    f5 = train(5)
    with pytest.raises(DiskFullError):
        f5.result(timeout=30)
    with pytest.raises(DiskFullError):
        train(6)  # raised before optimizer.step: the live state is still that of 5
    assert 6 not in saved
    for it in range(6, 10):
        train(it)
    store.flush()
    assert store.iterations() == list(range(0, 10))
    assert store.kind(5) == "snapshot"  # the chain restarted from the live state of 5
    for it in (4, 5, 7, 9):
        assert_same(saved[it], store.load(it)["model"], f"iteration {it}")
    store.close()


# ---- DDP comm hook ----------------------------------------------------------------------------
def _ddp_worker(rank: int, init: str, path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ckptstore.torch import Checkpointer, ddp_comm_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    ddp = None
    try:
        model, _ = _tiny()
        ddp = DDP(model, bucket_cap_mb=0.0002)  # several buckets for a tiny model
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        ck = None
        if rank == 0:
            store = ckptstore.open(path)
            ck = Checkpointer(store, model, opt, base_every=100, policy="every-iteration")
            ck.restore()
        ddp.register_comm_hook(None, ddp_comm_hook(ck))
        live = {}
        for it in range(1, 9):
            x, y = _batch(100 * rank + it)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            if ck is not None:
                ck.step(it)
                live[it] = copy.deepcopy(model.state_dict())
            else:
                opt.step()
            opt.zero_grad()
        if ck is not None:
            store.close()
            torch.save({"live": live, "counts": ck.capture_counts}, out)
    finally:
        # DDP's reducer must not hold the last reference to the process group: its destructor
        # would join gloo's threads with the GIL held while one of them waits for the GIL to free
        # the comm hook's last callback (a deadlock at exit, 2 runs in 5 here; pytorch#56297).
        # Released through the registry, the group is destroyed with the GIL released.
        ddp = None
        gc.collect()
        dist.destroy_process_group()


@needs_gloo
def test_ddp_comm_hook_checkpoints_the_allreduced_gradient(tmp_path, assert_same):
    import torch.multiprocessing as mp

    out = tmp_path / "out.pt"
    ctx = mp.spawn(_ddp_worker, args=(f"file://{tmp_path / 'init'}", str(tmp_path / "s"), str(out)),
                   nprocs=2, join=False)
    # a rank that dies can leave the other blocked in gloo; a loaded 2-core machine is slow
    deadline = time.monotonic() + 540
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the DDP workers did not finish within 540 s")
    res = torch.load(out)
    n = 4  # parameters of the tiny model
    assert res["counts"]["ddp"] == 8 * n and res["counts"]["step"] == 0
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.iterations() == list(range(0, 9))
        for it in (1, 4, 8):
            assert_same(res["live"][it], r.load(it)["model"], f"iteration {it}")


# ---- CLI ------------------------------------------------------------------------------------
def test_cli_stats(tmp_path, capsys):
    from ckptstore.cli import main

    with open_store(tmp_path / "s") as store:
        store.save(1, state_for(1))
        for i in range(2, 5):
            store.save_async(i, state_for(i))
    assert main(["stats", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["iteration", "kind", "stall"]
    assert set(lines[1]) == {"─"}  # the header rule
    assert lines[2].split()[2] == "-"  # the synchronous save
    assert float(lines[3].split()[2]) >= 0 and "median stall" in out
    assert main(["stats", str(tmp_path / "s"), "--last", "1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4


# ---- group-commit timer (ckptstore/grouptimer.py) ----------------------------------------------
def _deltas_pending(store, asynchronous, its):
    for it in its:
        rec = state_for(it)
        if asynchronous:
            store.save_delta_async(it, rec, durable=False)
        else:
            store.save_delta(it, rec, durable=False)
    if asynchronous:
        store.pipeline.wait()  # appended, not committed


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_group_timer_failure_surfaces_on_next_call(tmp_path, asynchronous):
    """An fsync failure in a timer commit rolls the group back and is raised once by the next
    call; the store then accepts writes again and the timer keeps working."""
    ops = FaultyOps()
    store = open_store(tmp_path / "s", file_ops=ops)
    store.save(0, state_for(0))
    futs = []
    if asynchronous:
        futs = [store.save_delta_async(it, state_for(it), durable=False) for it in (1, 2, 3)]
        store.pipeline.wait()
    else:
        _deltas_pending(store, False, (1, 2, 3))
    assert store.pending() == [1, 2, 3]
    ops.arm("fsync", 1, errno.EIO)
    store.set_group_seconds(0.2)  # the group is already older than that: the timer commits now
    time.sleep(1.0)
    for f in futs:  # the async deltas' futures report the rollback
        with pytest.raises(CheckpointAbortedError):
            f.result(timeout=30)
    with pytest.raises(StoreIOError):
        store.durable_iteration()  # the next call raises the timer's failure ...
    assert store.durable_iteration() == 0  # ... once; the group was rolled back
    assert store.pending() == [] and store.iterations() == [0]
    _deltas_pending(store, asynchronous, (1, 2))
    deadline = time.monotonic() + 10
    while store.durable_iteration() != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.durable_iteration() == 2
    store.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptstore-group:")]
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.iterations() == [0, 1, 2]
    assert check(tmp_path / "s").clean


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_group_timer_failure_raised_by_close(tmp_path, asynchronous):
    ops = FaultyOps()
    store = open_store(tmp_path / "s", file_ops=ops)
    store.save(0, state_for(0))
    _deltas_pending(store, asynchronous, (1,))
    ops.arm("fsync", 1, errno.EIO)
    store.set_group_seconds(0.05)
    time.sleep(0.5)
    with pytest.raises(StoreIOError):
        store.close()  # no call reported it: close does, after releasing the store
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptstore-group:")]
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.iterations() == [0]


def test_group_timer_stops_and_validates(tmp_path):
    store = open_store(tmp_path / "s")
    with pytest.raises(ValueError):
        store.set_group_seconds(-1)
    with pytest.raises(ValueError):
        store.set_group_seconds(True)
    store.save(0, state_for(0))
    store.set_group_seconds(30.0)
    _deltas_pending(store, False, (1,))
    store.set_group_seconds(None)  # off: the thread is joined, the delta stays pending
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptstore-group:")]
    time.sleep(0.1)
    assert store.pending() == [1] and store.durable_iteration() == 0
    store.close()
    with ckptstore.open(tmp_path / "s", "r") as r:
        assert r.iterations() == [0, 1]
        with pytest.raises(ckptstore.errors.ReadOnlyStoreError):
            r.set_group_seconds(1.0)
