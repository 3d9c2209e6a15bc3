"""Per-iteration checkpoints of sharded (FSDP2 / DTensor) training through the Checkpointer on a
multi-rank job store (format-spec/deltas.md, "Sharded states"), on real gloo groups.

An FSDP2 (``fully_shard``) MLP with AdamW and a scheduler trains on 2 ranks; every rank writes its
local shards (base) and its local gradient shards (deltas). Checked bit for bit: every rank's
part of every iteration, base or replayed delta, against the live local shards; the assembled
whole state against the gathered full tensors; a restore in fresh processes at the same world
size continuing exactly as an uninterrupted run; a restore at another world size (1) from the
assembled state, and the typed error for a part restored at the wrong world size.
"""

from __future__ import annotations

import os

import pytest
import torch
from _ranks import needs_gloo, run_ranks

import ckptstore

MOD = __name__

pytestmark = [
    needs_gloo,
    pytest.mark.timeout(240),
]


def ok(results) -> list:
    assert all("ok" in r for r in results), [
        (r.get("error"), r.get("message"), r.get("trace", "")[-2000:], r.get("died")) for r in results]
    return [r["ok"] for r in results]


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bits(a, b, what: str) -> None:
    """Tensors (nested in dicts) equal bit for bit, with the same dtypes and shapes."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{what}: {type(b).__name__} is not a tensor"
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), \
            f"{what}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert bits(a) == bits(b), f"{what}: bytes differ"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{what}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_bits(a[k], b[k], f"{what}[{k!r}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


# ---- scenario (every rank) ----------------------------------------------------------------------
def _fsdp(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    # 7 output rows: the last layer's Shard(0) is uneven at 2 and 4 ranks
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24),
                                torch.nn.Tanh(), torch.nn.Linear(24, 7))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def _local_state(model, opt) -> dict:
    from ckptstore.replay.shards import local

    return {"model": {k: local(v).clone() for k, v in model.state_dict().items()},
            "optimizer": {i: {k: local(v).clone() if isinstance(v, torch.Tensor) else v
                              for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}}


def _full_state(model, opt) -> dict:
    """Every DTensor gathered whole (collective: every rank calls it)."""
    from ckptstore.replay.shards import is_dtensor

    def full(v):
        return v.full_tensor() if is_dtensor(v) else v.clone()
    return {"model": {k: full(v) for k, v in model.state_dict().items()},
            "optimizer": {i: {k: full(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                          for i, s in opt.state_dict()["state"].items()}}


def record(model, opt, live_dir: str, tag: str, name: str, rank: int) -> None:
    """Save this rank's live local shards as ``{tag}-{name}-rank{rank}.pt`` and, from rank 0,
    the gathered full state as ``{tag}-{name}-full.pt`` (collective: every rank calls it)."""
    torch.save(_local_state(model, opt), os.path.join(live_dir, f"{tag}-{name}-rank{rank}.pt"))
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(live_dir, f"{tag}-{name}-full.pt"))


def fsdp_train(rank, world, path, iterations, live_dir, tag, base_every=4, group_commit=2,
               check_wrong_world=False, asynchronous=True):
    """Restore (or start) on the job store, train ``iterations`` steps, save the live local
    shards (and, from rank 0, the gathered full state) after every step for the test."""
    import torch.distributed as dist

    from ckptstore.torch import Checkpointer

    model, opt, sched = _fsdp(world)
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60.0)
    ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=base_every,
                      group_commit=group_commit,
                      fingerprint_every=3, asynchronous=asynchronous)
    out: dict = {"sharded": ck._layout.sharded}
    if check_wrong_world:  # a part written by 2 ranks is not the part of one rank of 1
        from ckptstore.errors import ShardLayoutError
        from ckptstore.torch.sharded import copy_into_live

        part = store.load(store.latest(), rank=0)
        try:
            copy_into_live(part, model, opt, ck._layout.params, ck._layout.names, world)
            out["wrong_world"] = None
        except ShardLayoutError as e:
            out["wrong_world"] = [type(e).__name__, e.saved_world, e.world, str(e)]
    start = ck.restore()
    out["start"] = start
    record(model, opt, live_dir, tag, "restored", rank)
    for it in range(start + 1, start + iterations + 1):
        g = torch.Generator().manual_seed(1000 * rank + it)
        x, y = torch.randn(6, 12, generator=g), torch.randn(6, 7, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        ck.step(it, meta={"rank": rank})
        opt.zero_grad()
        record(model, opt, live_dir, tag, str(it), rank)
    store.flush()
    store.close()
    ck.close()
    out["captured"] = dict(ck.capture_counts)
    return out


# ---- tests ----------------------------------------------------------------------------------------
def _check_parts(path, live, tag, its, world):
    """(a) every rank's part of every iteration (base, or delta replayed in its stream) equals
    that rank's live local shards bit for bit; the assembled state equals the gathered tensors."""
    with ckptstore.open(path, "r") as reader:
        for it in its:
            for r in range(world):
                want = torch.load(os.path.join(live, f"{tag}-{it}-rank{r}.pt"))
                part = reader.load(it, rank=r)
                assert part["ckptstore.replay"]["shards"]["world"] == world
                assert_bits(want["model"], part["model"], f"iteration {it} rank {r} model")
                assert_bits(want["optimizer"], part["optimizer"]["state"],
                            f"iteration {it} rank {r} optimizer")
            whole = reader.load(it)  # every rank's shards assembled
            want = torch.load(os.path.join(live, f"{tag}-{it}-full.pt"))
            assert "shards" not in whole["ckptstore.replay"]
            assert_bits(want["model"], whole["model"], f"iteration {it} full model")
            assert_bits(want["optimizer"], whole["optimizer"]["state"], f"iteration {it} full optimizer")


def test_sharded_checkpointer_replays_each_rank_and_restores_bit_exactly(tmp_path):
    world = 2
    path, ref, live = str(tmp_path / "job"), str(tmp_path / "ref"), str(tmp_path / "live")
    os.makedirs(live)
    # the uninterrupted run: 10 iterations
    ok(run_ranks(world, MOD, "fsdp_train", ref, str(tmp_path / "w0"), deadline=150,
                 iterations=10, live_dir=live, tag="ref"))
    # the interrupted run: 6 iterations (bases 0 and 4, deltas 1-3 and 5-6) ...
    res = ok(run_ranks(world, MOD, "fsdp_train", path, str(tmp_path / "w1"), deadline=150,
                       iterations=6, live_dir=live, tag="a"))
    assert [r["start"] for r in res] == [0, 0] and all(r["sharded"] for r in res)
    # every gradient was captured during backward, as the local shard (none copied at step)
    assert all(r["captured"]["hook"] > 0 and r["captured"]["step"] == 0 for r in res), res
    with ckptstore.open(path, "r") as reader:
        assert reader.iterations() == list(range(7))
        assert [reader.kind(i) for i in range(7)] == ["snapshot", "delta", "delta", "delta",
                                                      "snapshot", "delta", "delta"]
        d = reader.load_record(5, rank=1)  # a delta holds the local gradient shards
        w = torch.load(os.path.join(live, "a-5-rank1.pt"))["model"]
        assert [tuple(p["g"].shape) for p in d["grads"]] == [tuple(t.shape) for t in w.values()]
    _check_parts(path, live, "a", range(1, 7), world)
    for it in range(1, 7):  # the interrupted run is the reference run so far
        assert_bits(torch.load(os.path.join(live, f"ref-{it}-full.pt")),
                    torch.load(os.path.join(live, f"a-{it}-full.pt")), f"iteration {it}")
    # ... (b) resumed in fresh processes at the same world size: each rank replays its own part
    res = ok(run_ranks(world, MOD, "fsdp_train", path, str(tmp_path / "w2"), deadline=150,
                       iterations=4, live_dir=live, tag="b"))
    assert [r["start"] for r in res] == [6, 6]
    for r in range(world):
        assert_bits(torch.load(os.path.join(live, f"a-6-rank{r}.pt")),
                    torch.load(os.path.join(live, f"b-restored-rank{r}.pt")), f"restored rank {r}")
    for it in range(7, 11):  # continues bit-identically to the uninterrupted run
        assert_bits(torch.load(os.path.join(live, f"ref-{it}-full.pt")),
                    torch.load(os.path.join(live, f"b-{it}-full.pt")), f"resumed iteration {it}")
    _check_parts(path, live, "b", range(7, 11), world)
    with ckptstore.open(path, "r") as reader:
        assert reader.kind(7) == "snapshot" and reader.kind(8) == "delta"  # a new job's own chain
    # (c) another world size: 1 rank restores from the state assembled from both parts
    res = ok(run_ranks(1, MOD, "fsdp_train", path, str(tmp_path / "w3"), deadline=150,
                       iterations=2, live_dir=live, tag="c", check_wrong_world=True))
    assert res[0]["start"] == 10
    assert res[0]["wrong_world"][:3] == ["ShardLayoutError", 2, 1], res
    assert_bits(torch.load(os.path.join(live, "b-10-full.pt")),
                torch.load(os.path.join(live, "c-restored-full.pt")), "restored at 1 rank")
    with ckptstore.open(path, "r") as reader:
        assert reader.iterations()[-1] == 12 and reader.kind(11) == "snapshot"
        assert [reader.global_commit(i).world_size for i in (10, 11)] == [2, 1]
    _check_parts(path, live, "c", [12], 1)


@pytest.mark.parametrize("world,asynchronous", [(2, False), (4, True)], ids=["2-sync", "4-async"])
def test_sharded_parts_replay_bit_exactly(tmp_path, world, asynchronous):
    """The synchronous path (gradients encoded at step) and 4 ranks (uneven shards: 7 rows)."""
    path, live = str(tmp_path / "job"), str(tmp_path / "live")
    os.makedirs(live)
    res = ok(run_ranks(world, MOD, "fsdp_train", path, str(tmp_path / "w1"), deadline=150,
                       iterations=5, live_dir=live, tag="a", asynchronous=asynchronous))
    assert all(r["sharded"] and r["start"] == 0 for r in res)
    _check_parts(path, live, "a", range(1, 6), world)
    with ckptstore.open(path, "r") as reader:
        assert [reader.kind(i) for i in range(6)] == ["snapshot", "delta", "delta", "delta",
                                                      "snapshot", "delta"]
        boxes = [reader.load(0, rank=r)["ckptstore.replay"]["shards"]["tensors"]["4.weight"]
                 for r in range(world)]
        assert [b["offsets"][0] for b in boxes] == [sum(b["local"][0] for b in boxes[:r])
                                                    for r in range(world)]
        assert all(b["shape"] == [7, 24] and b["placements"] == ["S0"] for b in boxes)


def test_assembly_refuses_parts_that_do_not_tile():
    """Pure: an assembly of sharded parts whose boxes overlap, leave a gap, or both (a typed
    ShardCoverageError naming the tensor, the box and the ranks, before anything is assembled),
    a box outside the tensor, or a part missing."""
    from ckptstore.errors import DamagedCheckpointError, ShardCoverageError
    from ckptstore.replay.shards import assemble_parts

    def part(rank, world, offsets, rows):
        box = {"shape": [4, 2], "offsets": [offsets, 0], "local": [rows, 2], "placements": ["S0"],
               "mesh": [world]}
        return {"model": {"w": torch.full((rows, 2), float(rank))},
                "optimizer": {"state": {0: {"step": torch.tensor(1.0),
                                            "exp_avg": torch.full((rows, 2), rank + 0.5)}},
                              "param_groups": [{"params": [0]}]},
                "ckptstore.replay": {"groups": [["w"]], "shards": {"v": 1, "rank": rank,
                                                                    "world": world,
                                                                    "tensors": {"w": box}}}}
    whole = assemble_parts([part(0, 2, 0, 2), part(1, 2, 2, 2)])
    assert whole["model"]["w"].tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]
    assert whole["optimizer"]["state"][0]["exp_avg"][:, 0].tolist() == [0.5, 0.5, 1.5, 1.5]
    assert whole["optimizer"]["state"][0]["step"].item() == 1.0
    assert "shards" not in whole["ckptstore.replay"]
    # a gap (row 2: no shard), an overlap (row 1 twice, nothing missing: 3 ranks) and both at
    # once (rows 0-1 and 1-2: row 1 twice, row 3 in no shard; the overlap is named)
    cases = [([part(0, 2, 0, 2), part(1, 2, 3, 1)], "no shard holds the box at offsets "
              r"\[2, 0\] of sizes \[1, 2\]", ((2, 0), (1, 2), (0, 1))),
             ([part(0, 3, 0, 2), part(1, 3, 1, 2), part(2, 3, 3, 1)], "overlap in the box at "
              r"offsets \[1, 0\] of sizes \[1, 2\]", ((1, 0), (1, 2), (0, 1))),
             ([part(0, 2, 0, 2), part(1, 2, 1, 2)], r"its shards at offsets \[0, 0\] \(sizes "
              r"\[2, 2\], rank 0\) and at offsets \[1, 0\] \(sizes \[2, 2\], rank 1\) overlap",
              ((1, 0), (1, 2), (0, 1)))]
    for parts, what, (offsets, sizes, ranks) in cases:
        for p in parts:
            p["iteration"] = 5
        with pytest.raises(ShardCoverageError,
                           match=r"^iteration 5: tensor 'w' of shape \[4, 2\]: .*" + what) as ei:
            assemble_parts(parts)
        e = ei.value
        assert (e.fqn, e.offsets, e.sizes, e.ranks) == ("w", offsets, sizes, ranks), str(e)
        assert isinstance(e, DamagedCheckpointError)  # a committed checkpoint that does not read
    # a replica (an equal box held by two ranks) is one box: no overlap
    whole = assemble_parts([part(0, 3, 0, 2), part(1, 3, 2, 2), part(2, 3, 2, 2)])
    assert whole["model"]["w"][:, 0].tolist() == [0, 0, 1, 1]
    with pytest.raises(DamagedCheckpointError, match="rank 1's box of tensor 'w' .* does not fit"):
        assemble_parts([part(0, 2, 0, 2), part(1, 2, 3, 2)])  # rows 3-4 of 4
    with pytest.raises(DamagedCheckpointError, match="do not form one state"):
        assemble_parts([part(0, 2, 0, 2)])


def test_cli_shows_the_boxes_and_restores_full_tensors(tmp_path, capsys, monkeypatch):
    """``ckptstore show`` of a sharded Checkpointer job store prints every DTensor entry's box on
    every rank (a delta: its base's boxes) and exits 1 naming the tensor when the recorded boxes
    do not tile it, as fsck does for every iteration; ``ckptstore restore --format
    safetensors`` writes one file of the full (gathered) tensors."""
    from safetensors.torch import load_file

    from ckptstore.cli import main as cli
    from ckptstore.multirank.fsck import check_job
    from ckptstore.multirank.job_store import JobStore

    world, path, live = 2, str(tmp_path / "job"), str(tmp_path / "live")
    os.makedirs(live)
    ok(run_ranks(world, MOD, "fsdp_train", path, str(tmp_path / "w1"), deadline=150,
                 iterations=2, live_dir=live, tag="a"))
    with ckptstore.open(path, "r") as reader:
        assert [reader.kind(i) for i in range(3)] == ["snapshot", "delta", "delta"]
        stored = [reader.load_record(0, keys=["ckptstore.replay"], rank=r)["ckptstore.replay"]
                  ["shards"]["tensors"] for r in range(world)]
    # (a) show: one row per tensor and rank (tensor, global shape, offsets, local, placements,
    # mesh, rank, stored by)
    assert cli(["show", path, "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"iteration 2 (delta): sharded Checkpointer parts (FSDP2 / DTensor) of "
                          f"{world} ranks"), out
    assert "boxes as recorded by its base 0" in out.splitlines()[0]
    rows: dict = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] in stored[0]:
            rows.setdefault(cells[0], []).append(cells[1:])
    assert sorted(rows) == sorted(stored[0]) == ["0.bias", "0.weight", "2.bias", "2.weight",
                                                  "4.bias", "4.weight"]
    for name, got in rows.items():
        assert got == [["x".join(map(str, b["shape"])), ",".join(map(str, b["offsets"])),
                        "x".join(map(str, b["local"])), "S0", "2", str(r), str(r)]
                       for r, b in enumerate(box[name] for box in stored)], name
    # 7 output rows over 2 ranks (uneven): rows 0-3 on rank 0, 4-6 on rank 1
    assert rows["4.weight"] == [["7x24", "0,0", "4x24", "S0", "2", "0", "0"],
                                ["7x24", "4,0", "3x24", "S0", "2", "1", "1"]]
    assert cli(["show", path, "2", "--rank", "1"]) == 0  # rank 1's part as stored
    assert "showing rank 1" in capsys.readouterr().out
    # (b) restore: one safetensors file of the full tensors, equal to the gathered ones
    target = str(tmp_path / "full.safetensors")
    assert cli(["restore", path, "2", "--format", "safetensors", target]) == 0
    assert f"restored iteration 2 to {target}" in capsys.readouterr().out
    got = load_file(target)
    want = torch.load(os.path.join(live, "a-2-full.pt"))
    for name, t in want["model"].items():
        assert_bits(t, got[f"model/{name}"], f"model {name}")
    for i, entry in want["optimizer"].items():
        for k, t in entry.items():
            assert_bits(t, got[f"optimizer/state/{i}/{k}"], f"optimizer state {i} {k}")
    assert tuple(got["model/4.weight"].shape) == (7, 24)
    assert check_job(path).clean  # fsck checks the layout of every iteration's parts
    # recorded boxes that overlap (rank 1's rows 3-5 of 4.weight) and leave a gap (row 6)
    real = JobStore.load_record

    def shifted(self, iteration, keys=None, *, rank=None):
        rec = real(self, iteration, keys, rank=rank)
        if rank == 1:
            rec["ckptstore.replay"]["shards"]["tensors"]["4.weight"]["offsets"] = [3, 0]
        return rec
    monkeypatch.setattr(JobStore, "load_record", shifted)
    assert cli(["show", path, "2"]) == 1
    captured = capsys.readouterr()
    assert ["4.weight", "7x24", "3,0", "3x24", "S0", "2", "1", "1"] in \
        [line.split() for line in captured.out.splitlines()]  # the layout is still printed
    assert "ckptstore show: error: iteration 2: tensor '4.weight' of shape [7, 24]: its shards " \
           "at offsets [0, 0] (sizes [4, 24], rank 0) and at offsets [3, 0] (sizes [3, 24], " \
           "rank 1) overlap in the box at offsets [3, 0] of sizes [1, 24]" in captured.err, \
        captured.err
    report = check_job(path)  # fsck names every iteration whose parts no longer tile
    assert not report.clean and set(report.damaged_iterations) == set(report.iterations)
    assert any("'4.weight'" in m and "overlap" in m for m in report.damaged_iterations[2]), \
        report.damaged_iterations[2]


# ---- policy="auto" on sharded states --------------------------------------------------------------
def fsdp_auto(rank, world, path, iterations, live_dir, tag, mode):
    """The FSDP2 model under ``Checkpointer(policy="auto")`` with the planner held to ``mode``
    (a busy test machine's costs decide nothing): restore (or start), train, record the live
    local shards and the gathered state after every step."""
    import torch.distributed as dist

    from test_auto_policy import hold_planner

    from ckptstore.torch import Checkpointer

    hold_planner(lambda: mode)
    model, opt, sched = _fsdp(world)
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60.0)
    ck = Checkpointer(store, model, opt, sched, policy="auto", measure_steps=2, snapshot_every=3)
    start = ck.restore()
    record(model, opt, live_dir, tag, "restored", rank)
    for it in range(start + 1, start + iterations + 1):
        g = torch.Generator().manual_seed(1000 * rank + it)
        x, y = torch.randn(6, 12, generator=g), torch.randn(6, 7, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        ck.step(it)
        opt.zero_grad()
        record(model, opt, live_dir, tag, str(it), rank)
    store.flush()
    plan = ck.plan()
    out = {"start": start, "mode": ck.mode, "sharded": ck._layout.sharded,
           "plan": None if plan is None else [plan.mode, plan.chosen.interval]}
    ck.close()
    store.close()
    return out


@pytest.mark.parametrize("mode", ["snapshots", pytest.param("deltas", marks=pytest.mark.slow)])
def test_auto_policy_on_sharded_state_plans_and_restores_bit_exactly(tmp_path, mode):
    """FSDP2 training under policy="auto" on 2 ranks: it measures, plans (the same plan on both
    ranks), writes sharded snapshots (overlapped copies of the local shards) or deltas, every
    stored iteration's parts equal the live local shards bit for bit, and fresh processes resume
    from the newest one exactly."""
    world, path, live = 2, str(tmp_path / "job"), str(tmp_path / "live")
    os.makedirs(live)
    res = ok(run_ranks(world, MOD, "fsdp_auto", path, str(tmp_path / "w1"), deadline=150,
                       iterations=16, live_dir=live, tag="a", mode=mode))
    assert all(r["sharded"] and r["start"] == 0 and r["mode"] == mode for r in res), res
    assert res[0]["plan"] is not None and res[0]["plan"] == res[1]["plan"], res
    assert res[0]["plan"][0] == mode, res  # (deltas: measured, then planned)
    with ckptstore.open(path, "r") as reader:
        its = [i for i in reader.iterations() if i > 0]
        kinds = {reader.kind(i) for i in its if i > 12}  # after measuring: the plan's kind only
    assert its and its[-1] <= 16
    assert kinds == {"snapshot"} if mode == "snapshots" else "delta" in kinds, kinds
    _check_parts(path, live, "a", its, world)
    res = ok(run_ranks(world, MOD, "fsdp_auto", path, str(tmp_path / "w2"), deadline=150,
                       iterations=1, live_dir=live, tag="b", mode=mode))
    assert [r["start"] for r in res] == [its[-1]] * world, (res, its)
    for r in range(world):
        assert_bits(torch.load(os.path.join(live, f"a-{its[-1]}-rank{r}.pt")),
                    torch.load(os.path.join(live, f"b-restored-rank{r}.pt")), f"restored rank {r}")
