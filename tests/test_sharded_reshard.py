"""Point-in-time restore of sharded (FSDP2 / DTensor) Checkpointer runs at every world size
(format-spec/deltas.md, "Sharded states"), on real gloo groups.

For each saved world size N in {1, 2, 4}, an FSDP2 MLP with AdamW and a StepLR scheduler trains
6 iterations through the Checkpointer on a job store (bases 0 and 4; iterations 3 and 6 are
replayed deltas); the gathered full state (``full_tensor``) of iterations 3 and 6 is kept. Then,
for each M in {1, 2, 4}, fresh processes of M ranks restore every store (each from its own copy)
and check, bit for bit:

* every rank's live local shards (model parameters, AdamW ``exp_avg`` / ``exp_avg_sq``) equal
  the boxes of the saved full state that DTensor itself gives the rank (``distribute_tensor``
  with ``src_data_rank=None``), ``step``, the scheduler and the rank's RNG are the saved ones;
* N == M reads only the rank's own part (replay), N != M the assembled state (replay, then
  reshard);
* the newest iteration (6, fresh objects) and an older one (3, ``restore(iteration=3)``);
* training continues: one more step at M ranks writes a base of iteration 7 at world size M,
  equal to the live gathered state bit for bit and, within float tolerance, to the same step
  taken by an unsharded model on the same global batch.

A single-process reader (``ckptstore.open(path, "r").load(it)``) assembles the same full states.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _ranks import needs_gloo, run_ranks
from test_sharded_checkpointer import _fsdp as fsdp_mlp, bits, ok

import ckptstore

MOD = __name__
WORLDS = (1, 2, 4)
ITERATIONS = 6  # bases 0 and 4 (base_every=4): 6 = base 4 + 2 deltas, 3 = base 0 + 3 deltas
RECORDED = (3, 6)
BATCH = 12  # the global batch: every world size in WORLDS divides it

pytestmark = [
    needs_gloo,
    pytest.mark.timeout(300),
]


def diff(a, b, what: str) -> list[str]:
    """Where ``a`` and ``b`` (tensors nested in dicts) differ: dtype, shape or any bit."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return [f"{what}: {type(b).__name__} is not a tensor"]
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return [f"{what}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"]
        return [] if bits(a) == bits(b) else [f"{what}: bytes differ"]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [f"{what}: keys differ"]
        return [m for k in a for m in diff(a[k], b[k], f"{what}[{k!r}]")]
    return [] if a == b else [f"{what}: {a!r} != {b!r}"]


# ---- scenario (every rank) ----------------------------------------------------------------------
def _fsdp(world: int):
    """The FSDP2 MLP of tests/test_sharded_checkpointer.py (7 output rows: uneven Shard(0) at 2
    and 4 ranks), AdamW, StepLR; then a rank-specific torch RNG, so a restored RNG says whose part
    it came from."""
    import torch.distributed as dist

    model, opt, sched = fsdp_mlp(world)
    torch.manual_seed(100 + dist.get_rank())
    return model, opt, sched


def _checkpointer(store, model, opt, sched):
    from ckptstore.torch import Checkpointer

    return Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=4,
                        group_commit=2, fingerprint_every=3)


def batch(it: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slice of iteration ``it``'s global batch (world = 0: the whole batch)."""
    g = torch.Generator().manual_seed(it)
    x, y = torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 7, generator=g)
    if world == 0:
        return x, y
    n = BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _train_step(model, ck, it: int, rank: int, world: int) -> None:
    x, y = batch(it, rank, world)
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.rand(3)  # the training's own use of the RNG (dropout, sampling)
    ck.step(it)
    ck.optimizer.zero_grad()


def _full_state(model, opt, sched) -> dict:
    """Every DTensor gathered whole (collective: every rank calls it), the param groups and the
    scheduler's state."""
    from torch.distributed.tensor import DTensor

    def full(v):
        return v.full_tensor() if isinstance(v, DTensor) else v.clone()
    osd = opt.state_dict()
    return {"model": {k: full(v) for k, v in model.state_dict().items()},
            "optimizer": {i: {k: full(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                          for i, s in osd["state"].items()},
            "param_groups": osd["param_groups"], "scheduler": sched.state_dict()}


def save_run(rank, world, path, live_dir):
    """Train ITERATIONS steps at ``world`` ranks from an empty job store; after the RECORDED
    iterations rank 0 saves the gathered full state and every rank its torch RNG state."""
    import torch.distributed as dist

    model, opt, sched = _fsdp(world)
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60.0)
    ck = _checkpointer(store, model, opt, sched)
    assert ck.restore() == 0 and ck._layout.sharded
    for it in range(1, ITERATIONS + 1):
        _train_step(model, ck, it, rank, world)
        if it in RECORDED:
            full = _full_state(model, opt, sched)
            if rank == 0:
                torch.save(full, os.path.join(live_dir, f"full-{world}-{it}.pt"))
            torch.save(torch.get_rng_state(), os.path.join(live_dir, f"rng-{world}-{it}-{rank}.pt"))
    store.flush()
    ck.close()
    store.close()


def _check_restored(model, opt, sched, live_dir: str, saved: int, it: int, rank: int) -> list[str]:
    """Mismatches of this rank's live objects against the state saved at ``saved`` ranks at
    ``it``: each local shard against the box DTensor gives this rank of the saved full tensor,
    every other optimizer entry, the scheduler, the RNG (the rank's own, rank 0's for a rank the
    saved job did not have); then (collective) the gathered live state against the saved one."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    want = torch.load(os.path.join(live_dir, f"full-{saved}-{it}.pt"))

    def mine(v, full):
        if not isinstance(v, DTensor):
            return v
        return distribute_tensor(full, v.device_mesh, v.placements, src_data_rank=None).to_local()

    bad: list[str] = []
    for k, v in model.state_dict().items():
        got = v.to_local() if isinstance(v, DTensor) else v
        bad += diff(mine(v, want["model"][k]), got, f"model {k}")
    state = opt.state_dict()["state"]
    if set(state) != set(want["optimizer"]):
        bad.append(f"optimizer state of parameters {sorted(state)} != {sorted(want['optimizer'])}")
    for i, entry in state.items():
        for key, v in entry.items():
            got = v.to_local() if isinstance(v, DTensor) else v
            bad += diff(mine(v, want["optimizer"][i][key]), got, f"optimizer {i} {key}")
    bad += diff(want["scheduler"], sched.state_dict(), "scheduler")
    rng = torch.load(os.path.join(live_dir, f"rng-{saved}-{it}-{rank if rank < saved else 0}.pt"))
    bad += diff(rng, torch.get_rng_state(), "torch RNG")
    gathered = _full_state(model, opt, sched)
    bad += diff(want["model"], gathered["model"], "gathered model")
    bad += diff(want["optimizer"], gathered["optimizer"], "gathered optimizer")
    return [f"saved at {saved}, iteration {it}, rank {rank}: {m}" for m in bad]


def _spy_loads(store, calls: list) -> None:
    """Record in ``calls`` the iteration and ``rank`` argument of every ``store.load`` made."""
    load = store.load

    def spy(iteration, *a, **kw):
        calls.append([iteration, kw.get("rank")])
        return load(iteration, *a, **kw)
    store.load = spy


def restore_run(rank, world, path, live_dir, sources):
    """For each saved world size N in ``sources``, on its copy ``path/from{N}``: restore the
    newest iteration into fresh objects, check it, take step 7 (rank 0 saves the gathered state
    after it); then restore iteration 3 into fresh objects and check it. Returns per N the
    mismatches and the loads made (iteration, rank argument)."""
    import torch.distributed as dist

    out = {}
    for n in sources:
        calls: list = []
        store_path = os.path.join(path, f"from{n}")
        res: dict = {"bad": []}
        model, opt, sched = _fsdp(world)
        store = ckptstore.open(store_path, "a", process_group=dist.group.WORLD, commit_timeout=60.0)
        _spy_loads(store, calls)
        ck = _checkpointer(store, model, opt, sched)
        res["newest"] = ck.restore()
        res["bad"] += _check_restored(model, opt, sched, live_dir, n, ITERATIONS, rank)
        _train_step(model, ck, ITERATIONS + 1, rank, world)
        full = _full_state(model, opt, sched)
        if rank == 0:
            torch.save(full, os.path.join(live_dir, f"after-{n}-{world}.pt"))
        store.flush()
        ck.close()
        store.close()
        model, opt, sched = _fsdp(world)
        store = ckptstore.open(store_path, "a", process_group=dist.group.WORLD, commit_timeout=60.0)
        _spy_loads(store, calls)
        ck = _checkpointer(store, model, opt, sched)
        res["older"] = ck.restore(iteration=RECORDED[0])
        res["bad"] += _check_restored(model, opt, sched, live_dir, n, RECORDED[0], rank)
        ck.close()
        store.close()
        res["loads"] = calls
        out[str(n)] = res
    return out


# ---- tests ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """The job stores ``root/job{N}`` trained at N ranks and the recorded states ``root/live``."""
    root = tmp_path_factory.mktemp("reshard")
    live = root / "live"
    live.mkdir()
    for n in WORLDS:
        ok(run_ranks(n, MOD, "save_run", str(root / f"job{n}"), str(root / f"w-save{n}"),
                     deadline=120, live_dir=str(live)))
    return str(root)


def test_saved_chains_end_in_replayed_deltas(saved):
    """Each store holds iterations 0..6 of its world size, 3 and 6 deltas (so every restore
    below replays), and a single-process reader assembles the gathered full states bit for bit."""
    for n in WORLDS:
        with ckptstore.open(os.path.join(saved, f"job{n}"), "r") as reader:
            assert reader.iterations() == list(range(ITERATIONS + 1))
            assert [reader.kind(i) for i in range(ITERATIONS + 1)] == \
                ["snapshot", "delta", "delta", "delta", "snapshot", "delta", "delta"]
            assert reader.base_of(3, rank=0) == 0 and reader.base_of(6, rank=n - 1) == 4
            assert {reader.global_commit(i).world_size for i in reader.iterations()} == {n}
            for it in RECORDED:
                want = torch.load(os.path.join(saved, "live", f"full-{n}-{it}.pt"))
                whole = reader.load(it)
                assert "shards" not in whole["ckptstore.replay"]
                assert not diff(want["model"], dict(whole["model"]), f"N={n} it={it} model")
                assert not diff(want["optimizer"], whole["optimizer"]["state"],
                                f"N={n} it={it} optimizer")
                assert not diff(want["scheduler"], whole["scheduler"], f"N={n} it={it} scheduler")


def _reference_step(full: dict) -> dict:
    """Iteration 7 taken by the unsharded model from the gathered state of iteration 6, on the
    whole global batch."""
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24),
                                torch.nn.Tanh(), torch.nn.Linear(24, 7))
    model.load_state_dict(full["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    opt.load_state_dict({"state": full["optimizer"], "param_groups": full["param_groups"]})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    sched.load_state_dict(full["scheduler"])
    x, y = batch(ITERATIONS + 1, 0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sched.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()["state"]}


def _assert_close(want: dict, got: dict, what: str) -> None:
    for k, v in want.items():
        if isinstance(v, dict):
            _assert_close(v, got[k], f"{what}[{k!r}]")
        elif isinstance(v, torch.Tensor) and v.is_floating_point():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=f"{what}[{k!r}]")
        else:
            assert v == got[k] if not isinstance(v, torch.Tensor) else torch.equal(v, got[k]), what


@pytest.mark.parametrize("world", WORLDS)
def test_restore_every_saved_world_size(saved, tmp_path, world):
    """Fresh processes of ``world`` ranks restore the stores saved at 1, 2 and 4 ranks (newest
    and older iteration) bit for bit and train on; see the module docstring."""
    live = os.path.join(saved, "live")
    for n in WORLDS:
        shutil.copytree(os.path.join(saved, f"job{n}"), tmp_path / f"from{n}")
    res = ok(run_ranks(world, MOD, "restore_run", str(tmp_path), str(tmp_path / "w"),
                       deadline=150, live_dir=live, sources=list(WORLDS)))
    bad = [m for r in res for n in WORLDS for m in r[str(n)]["bad"]]
    assert not bad, bad[:20]
    for rank, r in enumerate(res):
        for n in WORLDS:
            assert r[str(n)]["newest"] == ITERATIONS and r[str(n)]["older"] == RECORDED[0]
            # N == M: the rank's own part only (replayed); else every part, assembled
            own = rank if n == world else None
            assert r[str(n)]["loads"] == [[ITERATIONS, own], [RECORDED[0], own]], (n, rank, r)
    for n in WORLDS:
        after = torch.load(os.path.join(live, f"after-{n}-{world}.pt"))
        with ckptstore.open(str(tmp_path / f"from{n}"), "r") as reader:
            assert reader.iterations()[-1] == ITERATIONS + 1
            assert reader.kind(ITERATIONS + 1) == "snapshot"  # the new job's chain starts
            assert reader.global_commit(ITERATIONS + 1).world_size == world
            assert reader.global_commit(ITERATIONS).world_size == n
            whole = reader.load(ITERATIONS + 1)
        assert not diff(after["model"], dict(whole["model"]), f"{n}->{world} base 7 model")
        assert not diff(after["optimizer"], whole["optimizer"]["state"], f"{n}->{world} base 7 opt")
        ref = _reference_step(torch.load(os.path.join(live, f"full-{n}-{ITERATIONS}.pt")))
        _assert_close(ref, {"model": after["model"], "optimizer": after["optimizer"]},
                      f"{n}->{world} step 7")
