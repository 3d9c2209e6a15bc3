"""Replicated and tied DTensor state through the Checkpointer on a multi-rank job store
(format-spec/deltas.md, "Sharded states": ``replicas``, tied entries), on real gloo groups.

Real FSDP2 (``fully_shard``) models, AdamW and a scheduler:

* HSDP on 4 ranks: a (2, 2) mesh, placements ``(Replicate(), Shard(0))``: ranks 0 and 2 hold the
  same boxes, as do ranks 1 and 3; each box is written by exactly one of its holders (params,
  optimizer state, gradient shards in deltas), about half the bytes of writing every local shard;
* a (2, 1) mesh on 2 ranks: every parameter replicated whole on both ranks (FSDP2 as DDP);
* tied weights (``head.weight = embed.weight``, ``fully_shard`` on the parent covering both,
  which FSDP2 needs on CPU/gloo with torch 2.13) on a (2,) mesh (``Shard(0)``) and on the (2, 1)
  mesh (tied and replicated): the tie is found from the DTensors' local storage, written once
  (the alias entry deduplicates to the same chunks), replayed as an alias, restored tied.

Checked bit for bit at every iteration (bases and replayed deltas): each rank's part holds exactly
its owned entries, equal to its live local shards; completed from the owners' parts it equals all
of them; the assembled state equals the gathered full tensors. Fresh processes at the same world
size restore (a non-owner reads the owner's part) and continue exactly as an uninterrupted run.
An owner's part that does not hold a box it was left (inconsistent owners, written for real)
makes assembly and restore raise DamagedCheckpointError naming the tensor and the box.
"""

from __future__ import annotations

import os

import pytest
import torch
from _ranks import needs_gloo, run_ranks
from test_sharded_checkpointer import assert_bits, bits, ok, record

import ckptstore
from ckptstore.errors import DamagedCheckpointError
from ckptstore.replay.shards import (
    Holding,
    assemble_parts,
    assign_owners,
    complete_part,
    donors_needed,
    localize,
    omitted,
    replica_owners,
)

MOD = __name__
REPLAY = "ckptstore.replay"

pytestmark = [
    needs_gloo,
    pytest.mark.timeout(420),
]


# ---- scenario (every rank) ----------------------------------------------------------------------
class Tied(torch.nn.Module):
    """An embedding whose output layer is the same parameter (``head.weight = embed.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(x))))


def _model(kind: str, mesh_shape: list[int]):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("replicate", "shard")[-len(mesh_shape):]  # (HSDP: a 2-D mesh needs names)
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
    torch.manual_seed(0)
    model: torch.nn.Module
    if kind == "tied":
        model = Tied()
        fully_shard(model.mid, mesh=mesh)
    else:  # 7 output rows: uneven Shard(0) on the shard dimension
        model = torch.nn.Sequential(torch.nn.Linear(16, 96), torch.nn.Tanh(),
                                    torch.nn.Linear(96, 48), torch.nn.Tanh(), torch.nn.Linear(48, 7))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # (the parent covers a tie: embed and head together)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def _batch(kind: str, rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + it)
    if kind == "tied":
        return torch.randint(0, 32, (6,), generator=g), torch.randint(0, 32, (6,), generator=g)
    return torch.randn(6, 16, generator=g), torch.randn(6, 7, generator=g)


def _loss(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "tied":
        return torch.nn.functional.cross_entropy(out, y)
    return torch.nn.functional.mse_loss(out, y)


def _misowned(real):
    """Every rank believes another holder owns each replicated box: nobody writes it."""
    def replicas_of(store, names, params, rank, world):
        return {n: (o + 1) % world if o == rank else o
                for n, o in real(store, names, params, rank, world).items()}
    return replicas_of


def train(rank, world, path, iterations, live_dir, tag, kind="mlp", mesh_shape=(2, 2),
          base_every=4, asynchronous=True, dedupe=True, misown=False):
    """Restore (or start) on the job store, train ``iterations`` steps, save the live local
    shards (and, from rank 0, the gathered full state) after every step. ``dedupe=False``
    (``partition=False``): every rank writes every shard it holds (the reference run);
    ``misown``: inconsistent owners (a damaged job: no part holds the replicated boxes)."""
    import torch.distributed as dist

    import ckptstore.torch.param_layout as cp
    from ckptstore.replay.shards import local
    from ckptstore.torch import Checkpointer

    if misown:
        cp.replicas_of = _misowned(cp.replicas_of)
    model, opt, sched = _model(kind, list(mesh_shape))
    store = ckptstore.open(path, "a", process_group=dist.group.WORLD, commit_timeout=60.0)
    ck = Checkpointer(store, model, opt, sched, policy="every-iteration", base_every=base_every,
                      group_commit=2,
                      fingerprint_every=2, asynchronous=asynchronous,
                      partition=None if dedupe else False)
    out: dict = {"replicas": dict(ck._layout.replicas), "aliases": dict(ck._layout.aliases)}
    try:
        start = ck.restore()
    except DamagedCheckpointError as e:
        store.close()
        return {"damaged": str(e)}
    out["start"] = start
    if kind == "tied":  # the live tie survives the restore
        out["tied"] = model.head.weight is model.embed.weight and \
            local(model.head.weight).data_ptr() == local(model.embed.weight).data_ptr()
    for name in ("restored", str(start)):
        record(model, opt, live_dir, tag, name, rank)
    for it in range(start + 1, start + iterations + 1):
        x, y = _batch(kind, rank, it)
        _loss(kind, model(x), y).backward()
        ck.step(it, meta={"rank": rank})
        opt.zero_grad()
        record(model, opt, live_dir, tag, str(it), rank)
    store.flush()
    store.close()
    ck.close()
    out["captured"] = dict(ck.capture_counts)
    return out


# ---- checks ------------------------------------------------------------------------------------
def _by_name(part: dict, names: list[str]) -> dict:
    """A state's optimizer-state entries by parameter name (``names``: its optimizer order)."""
    return {names[i]: s for i, s in part["optimizer"]["state"].items()}


def _check_parts(path, live, tag, its, world):
    """Every rank's part of every iteration (base, or delta replayed in its stream) holds exactly
    the entries it owns, equal to its live local shards bit for bit, and completed from its
    owners' parts all of them; every box is in exactly one part; the assembled state equals the
    gathered tensors. Returns the bytes of tensors each rank's parts hold, per iteration."""
    held: dict[int, list[int]] = {}
    with ckptstore.open(path, "r") as reader:
        for it in its:
            parts = [reader.load(it, rank=r) for r in range(world)]
            held[it] = []
            writers: dict[tuple, list[int]] = {}
            for r, part in enumerate(parts):
                want = torch.load(os.path.join(live, f"{tag}-{it}-rank{r}.pt"))
                sec = part[REPLAY]["shards"]
                gone = omitted(part)
                assert sec["world"] == world and sec["rank"] == r
                assert set(part["model"]) == set(want["model"]) - set(gone), (it, r)
                assert_bits({k: want["model"][k] for k in part["model"]}, part["model"],
                            f"iteration {it} rank {r} part")
                whole_names = [n for g in sec["groups"] for n in g]
                own_names = [n for g in part[REPLAY]["groups"] for n in g]
                assert own_names == [n for n in whole_names if n not in gone]
                live_opt = _by_name({"optimizer": {"state": want["optimizer"]}}, whole_names)
                assert_bits({n: live_opt[n] for n in own_names if n in live_opt},
                            _by_name(part, own_names), f"iteration {it} rank {r} optimizer")
                full = complete_part(part, {o: parts[o] for o in donors_needed(part)})
                assert_bits(want["model"], full["model"], f"iteration {it} rank {r} completed")
                assert_bits(want["optimizer"], full["optimizer"]["state"],
                            f"iteration {it} rank {r} completed optimizer")
                for k, box in sec["tensors"].items():
                    writers.setdefault((k, tuple(box["offsets"]), tuple(box["local"])), [])
                    if k in part["model"]:
                        writers[(k, tuple(box["offsets"]), tuple(box["local"]))].append(r)
                held[it].append(sum(t.numel() * t.element_size() for t in _tensors(part)))
            assert all(len(w) == 1 for w in writers.values()), (it, writers)
            whole = reader.load(it)  # every rank's shards assembled
            want = torch.load(os.path.join(live, f"{tag}-{it}-full.pt"))
            assert "shards" not in whole[REPLAY]
            assert_bits(want["model"], whole["model"], f"iteration {it} full model")
            assert_bits(want["optimizer"], whole["optimizer"]["state"], f"iteration {it} full optimizer")
    return held


def _tensors(state: dict) -> list[torch.Tensor]:
    out = [t for t in state["model"].values() if isinstance(t, torch.Tensor)]
    for entry in state["optimizer"]["state"].values():
        out += [t for t in entry.values() if isinstance(t, torch.Tensor)]
    return out


def _param_bytes(state: dict, name: str) -> int:
    """The bytes of parameter ``name`` and its optimizer-state tensors in a whole part."""
    names = [n for g in state[REPLAY]["groups"] for n in g]
    one = {"model": {name: state["model"][name]},
           "optimizer": {"state": {0: state["optimizer"]["state"].get(names.index(name), {})}}}
    return sum(t.numel() * t.element_size() for t in _tensors(one))


def _resume_case(tmp_path, world, kind, mesh_shape, total=8, first=5, asynchronous=True):
    """The reference run (``total`` iterations, every rank writing every shard it holds), the
    run under test (``first`` iterations, replicas written once), its resumption in fresh
    processes for the rest; every full state equal to the reference's. Returns (path, live,
    results of the three runs)."""
    path, ref, live = str(tmp_path / "job"), str(tmp_path / "ref"), str(tmp_path / "live")
    os.makedirs(live)
    kw = dict(live_dir=live, kind=kind, mesh_shape=list(mesh_shape), asynchronous=asynchronous)
    r0 = ok(run_ranks(world, MOD, "train", ref, str(tmp_path / "w0"), deadline=200,
                      iterations=total, tag="ref", dedupe=False, **kw))
    r1 = ok(run_ranks(world, MOD, "train", path, str(tmp_path / "w1"), deadline=200,
                      iterations=first, tag="a", **kw))
    r2 = ok(run_ranks(world, MOD, "train", path, str(tmp_path / "w2"), deadline=200,
                      iterations=total - first, tag="b", **kw))
    assert [r["start"] for r in r1] == [0] * world and [r["start"] for r in r2] == [first] * world
    assert all(r["captured"]["step"] == 0 for r in r1 + r2), r1 + r2  # owned: captured in backward
    for it in range(1, first + 1):
        assert_bits(torch.load(os.path.join(live, f"ref-{it}-full.pt")),
                    torch.load(os.path.join(live, f"a-{it}-full.pt")), f"iteration {it}")
    for r in range(world):  # a non-owner restored its replicated entries from the owner's part
        assert_bits(torch.load(os.path.join(live, f"a-{first}-rank{r}.pt")),
                    torch.load(os.path.join(live, f"b-restored-rank{r}.pt")), f"restored rank {r}")
    for it in range(first + 1, total + 1):  # continues bit-identically
        assert_bits(torch.load(os.path.join(live, f"ref-{it}-full.pt")),
                    torch.load(os.path.join(live, f"b-{it}-full.pt")), f"resumed iteration {it}")
    return path, ref, live, (r0, r1, r2)


# ---- tests: real FSDP2 on gloo ----------------------------------------------------------------------
def test_hsdp_replicas_written_once_and_restored(tmp_path):
    """HSDP, (2, 2) mesh, (Replicate(), Shard(0)), 4 ranks: each box in one part, about half
    the bytes per rank; bit-exact parts and assembly at every iteration; restore continues."""
    world = 4
    path, ref, live, (r0, r1, _) = _resume_case(tmp_path, world, "mlp", (2, 2))
    # ranks 0 and 2 hold the same boxes (as do 1 and 3); each writes about half of them
    reps = [r["replicas"] for r in r1]
    assert all(set(rp) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
               for rp in reps)
    assert all(reps[r][n] in ({0, 2} if r % 2 == 0 else {1, 3}) and reps[r][n] == reps[r ^ 2][n]
               for r in range(world) for n in reps[r]) and r0[0]["replicas"] == {}
    held = _check_parts(path, live, "a", range(0, 6), world)
    _check_parts(path, live, "b", range(6, 9), world)
    with ckptstore.open(path, "r") as reader, ckptstore.open(ref, "r") as full_run:
        assert [reader.kind(i) for i in range(9)] == ["snapshot", "delta", "delta", "delta",
                                                      "snapshot", "delta", "snapshot", "delta",
                                                      "delta"]
        for it in (0, 4):  # bases: tensor bytes per part, and the bytes the store logged
            refs = [full_run.load(it, rank=r) for r in range(world)]
            every = [sum(t.numel() * t.element_size() for t in _tensors(p)) for p in refs]
            assert sum(held[it]) * 2 == sum(every), (held[it], every)  # half in all
            # each replica pair splits its boxes, within one parameter (with its state) of even
            largest = max(_param_bytes(refs[0], n) for n in reps[0])
            for r in (0, 1):
                assert held[it][r] + held[it][r + 2] == every[r] == every[r + 2]
                assert abs(held[it][r] - held[it][r + 2]) <= largest, (held[it], largest)
            # the store logged exactly the replicas' bytes fewer (the rest: RNG states, metadata)
            ours = [reader.info(it, rank=r).logical_bytes for r in range(world)]
            theirs = [full_run.info(it, rank=r).logical_bytes for r in range(world)]
            assert sum(theirs) - sum(ours) == sum(every) // 2, (ours, theirs, every)
        grad_bytes = sum(held[0]) * 2  # every rank's local gradient shards (= its parameters')
        for it in (1, 5):  # deltas: the owned gradient shards only, half the gradient bytes
            for r in range(world):
                d = reader.load_record(it, rank=r)
                owned = [n for g in reader.load(it, rank=r)[REPLAY]["groups"] for n in g]
                assert len(d["grads"]) == len(owned) < 6, (it, r, owned)
            ours = [reader.info(it, rank=r).logical_bytes for r in range(world)]
            theirs = [full_run.info(it, rank=r).logical_bytes for r in range(world)]
            assert sum(theirs) - sum(ours) == grad_bytes // 2, (ours, theirs, grad_bytes)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 1)], ids=["shard", "replicate-sync"])
def test_tied_dtensor_written_once_replayed_and_restored_tied(tmp_path, mesh_shape):
    """Tied FSDP2 weights (``head.weight = embed.weight``, fully_shard on the parent), 2 gloo
    ranks: a Shard(0) mesh, and a (2, 1) mesh where every parameter is replicated whole (the tie
    travels with its parameter's owner), there on the synchronous path (gradients encoded at
    step, cut to the owned ones)."""
    world = 2
    path, _, live, (r0, r1, r2) = _resume_case(tmp_path, world, "tied", mesh_shape,
                                               total=6, first=3,
                                               asynchronous=mesh_shape == (2,))
    assert all(r["aliases"] == {"head.weight": "embed.weight"} for r in r0 + r1 + r2)
    assert all(r["tied"] for r in r1 + r2), r2  # the live tie kept by the restore
    _check_parts(path, live, "a", range(0, 4), world)
    _check_parts(path, live, "b", range(4, 7), world)
    with ckptstore.open(path, "r") as reader:
        for it in range(0, 7):
            whole = reader.load(it)
            assert bits(whole["model"]["head.weight"]) == bits(whole["model"]["embed.weight"])
            assert whole[REPLAY]["aliases"] == {"head.weight": "embed.weight"}
            for r in range(world):
                part = reader.load(it, rank=r)
                if "embed.weight" in part["model"]:  # the writer of the parameter writes the tie
                    assert part[REPLAY]["aliases"] == {"head.weight": "embed.weight"}
                    assert bits(part["model"]["head.weight"]) == bits(part["model"]["embed.weight"])
                else:
                    assert "head.weight" not in part["model"] and part[REPLAY]["aliases"] == {}
                    assert omitted(part)["head.weight"] == omitted(part)["embed.weight"]
        if mesh_shape == (2, 1):  # whole tensors replicated: one part each
            owners = {reader.load(0, rank=r)[REPLAY]["shards"]["replicas"]["embed.weight"]
                      for r in range(world)}
            assert len(owners) == 1
        # the alias is written once: its tree is the parameter's (the same chunks)
        writers = 0
        for r in range(world):
            roots = {t.path: t for t in reader.stream(0, r).manifest(0).tensors}
            tied = [t for p, t in roots.items() if p.endswith(("head.weight", "embed.weight"))
                    and "model" in p]
            assert len(tied) in (0, 2), sorted(roots)
            if tied:
                assert tied[0].inline is None and tied[0].root == tied[1].root, tied
                writers += 1
        assert writers == (1 if mesh_shape == (2, 1) else world)


def test_owner_part_without_its_box_is_damaged(tmp_path):
    """Inconsistent owners on a (2, 1) mesh (each rank leaves every replica to the other), so
    no part holds the replicated boxes: a reader's assembly and a restore in fresh processes
    raise DamagedCheckpointError naming the tensor and its box."""
    world, path, live = 2, str(tmp_path / "job"), str(tmp_path / "live")
    os.makedirs(live)
    kw = dict(live_dir=live, kind="mlp", mesh_shape=[2, 1])
    ok(run_ranks(world, MOD, "train", path, str(tmp_path / "w1"), deadline=200, iterations=2,
                 tag="a", misown=True, **kw))
    with ckptstore.open(path, "r") as reader:
        for it in (0, 2):
            parts = [reader.load(it, rank=r) for r in range(world)]
            assert all("0.weight" not in p["model"] for p in parts)
            with pytest.raises(DamagedCheckpointError,
                               match=rf"iteration {it}: no part holds the box offsets \[0, 0\] "
                                     r"shape \[96, 16\] of '0.weight'"):
                reader.load(it)
    res = ok(run_ranks(world, MOD, "train", path, str(tmp_path / "w2"), deadline=200,
                       iterations=1, tag="b", **kw))
    assert all("no part holds the box" in r["damaged"] and "of '0.weight'" in r["damaged"]
               for r in res), res


# ---- pure tests ---------------------------------------------------------------------------------
def test_assign_owners_is_balanced_deterministic_and_order_free():
    hs = [Holding("a", (0,), (8,), 32, (0, 2)), Holding("a", (8,), (8,), 32, (1, 3)),
          Holding("b", (0,), (4,), 16, (0, 2)), Holding("b", (4,), (3,), 12, (1, 3)),
          Holding("c", (0,), (2,), 8, (0, 2)), Holding("c", (2,), (2,), 8, (1, 3)),
          Holding("s", (0,), (5,), 20, (2,))]  # a box rank 2 alone holds: it counts first
    owners = assign_owners(hs, 4)
    assert owners == assign_owners(list(reversed(hs)), 4)
    # largest first to the lighter holder: rank 2 already carries 20 bytes
    assert owners[("a", (0,), (8,))] == 0 and owners[("a", (8,), (8,))] == 1
    assert owners[("b", (0,), (4,))] == 2 and owners[("b", (4,), (3,))] == 3
    assert owners[("c", (0,), (2,))] == 0 and owners[("c", (2,), (2,))] == 3  # 0: 32 < 36
    assert ("s", (0,), (5,)) not in owners
    assert replica_owners(hs, 4, 0) == {"a": 0, "b": 2, "c": 0}
    assert replica_owners(hs, 4, 3) == {"a": 1, "b": 3, "c": 3}
    # equal loads: the lowest rank
    assert assign_owners([Holding("x", (0,), (1,), 4, (1, 0))], 2) == {("x", (0,), (1,)): 0}


def _part(rank: int) -> dict:
    """Rank ``rank``'s part (of 2) of a model: ``w`` Shard(0) rows 2r..2r+1, ``r`` replicated
    whole (owned by rank 1), ``t`` tied to ``r``; cut by the writer's own ``localize``."""
    w = torch.full((2, 2), float(rank))
    r = torch.arange(3, dtype=torch.float32)
    model = {"w": w, "r": r, "t": r}
    state = {"model": model,
             "optimizer": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": w + 0.5},
                                     1: {"step": torch.tensor(2.0), "exp_avg": r + 0.25}},
                           "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
             "iteration": 7,
             REPLAY: {"v": 1, "groups": [["w", "r"]], "aliases": {"t": "r"}}}
    part = localize(state, rank, 2, {"r": 1})
    boxes = {"w": {"shape": [4, 2], "offsets": [2 * rank, 0], "local": [2, 2],
                   "placements": ["S0"], "mesh": [2]},
             "r": {"shape": [3], "offsets": [0], "local": [3], "placements": ["R"], "mesh": [2]}}
    part[REPLAY]["shards"]["tensors"] = dict(boxes, t=boxes["r"])
    return part


def test_localize_cuts_a_non_owner_part_as_a_partition():
    p0, p1 = _part(0), _part(1)
    assert list(p0["model"]) == ["w"] and list(p1["model"]) == ["w", "r", "t"]
    assert p0[REPLAY]["groups"] == [["w"]] and p0[REPLAY]["aliases"] == {}
    assert p1[REPLAY]["groups"] == [["w", "r"]] and p1[REPLAY]["aliases"] == {"t": "r"}
    assert p0["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert list(p0["optimizer"]["state"]) == [0]
    sec = p0[REPLAY]["shards"]
    assert sec["replicas"] == {"r": 1, "t": 1} and omitted(p0) == {"r": 1, "t": 1}
    assert sec["groups"] == [["w", "r"]] and sec["keys"] == ["w", "r", "t"]
    assert sec["aliases"] == {"t": "r"} and sec["state_order"] == [0, 1]
    assert donors_needed(p0) == [1] and donors_needed(p1) == [] and omitted(p1) == {}


def test_complete_and_assemble_parts_with_replicas():
    p0, p1 = _part(0), _part(1)
    full0 = complete_part(p0, {1: p1})
    assert list(full0["model"]) == ["w", "r", "t"] and full0[REPLAY]["groups"] == [["w", "r"]]
    assert full0["model"]["w"].tolist() == [[0, 0], [0, 0]]
    assert full0["model"]["r"].tolist() == [0, 1, 2] and full0["model"]["t"] is p1["model"]["t"]
    assert full0["optimizer"]["state"][1]["exp_avg"].tolist() == [0.25, 1.25, 2.25]
    assert full0["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert omitted(full0) == {} and complete_part(p1, {}) is p1
    whole = assemble_parts([p0, p1])
    assert whole["model"]["w"].tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]
    assert whole["model"]["r"].tolist() == [0, 1, 2] == whole["model"]["t"].tolist()
    assert whole["optimizer"]["state"][0]["exp_avg"][:, 0].tolist() == [0.5, 0.5, 1.5, 1.5]
    assert whole[REPLAY]["groups"] == [["w", "r"]] and whole[REPLAY]["aliases"] == {"t": "r"}
    assert "shards" not in whole[REPLAY]
    # the owner's part without the box it was left: named tensor, box, owner, iteration
    bad = _part(1)
    del bad["model"]["r"]
    for call in (lambda: complete_part(p0, {1: bad}), lambda: assemble_parts([p0, bad])):
        with pytest.raises(DamagedCheckpointError,
                           match=r"iteration 7: no part holds the box offsets \[0\] shape \[3\] "
                                 r"of 'r' \(rank 0 left it to rank 1, whose part does not hold"):
            call()
    with pytest.raises(DamagedCheckpointError, match="rank 1, whose part is not at hand"):
        complete_part(p0, {})
    # both ranks leave it to the other: no part holds it
    other = _part(1)
    other[REPLAY]["shards"]["replicas"] = {"r": 0, "t": 0}
    del other["model"]["r"], other["model"]["t"]
    with pytest.raises(DamagedCheckpointError, match="no part holds the box .* of 'r'"):
        assemble_parts([p0, other])


def test_parts_without_replicas_still_assemble():
    """A part written before ``replicas`` existed (no such field, nothing cut)."""
    p0, p1 = _part(0), _part(1)
    for p, rank in ((p0, 0), (p1, 1)):
        w = torch.full((2, 2), float(rank))
        p["model"] = {"w": w, "r": torch.arange(3, dtype=torch.float32)}
        p["optimizer"] = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": w + 0.5},
                                    1: {"step": torch.tensor(2.0),
                                        "exp_avg": torch.arange(3, dtype=torch.float32)}},
                          "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
        p[REPLAY] = {"v": 1, "groups": [["w", "r"]], "aliases": {},
                     "shards": {"v": 1, "rank": rank, "world": 2,
                                "tensors": {k: v for k, v in p[REPLAY]["shards"]["tensors"].items()
                                            if k != "t"}}}
    assert omitted(p0) == {} and complete_part(p0, {}) is p0
    whole = assemble_parts([p0, p1])
    assert whole["model"]["w"][:, 0].tolist() == [0, 0, 1, 1]
    assert whole["model"]["r"].tolist() == [0, 1, 2]


def mesh_mismatch(rank, world, path):
    """4 ranks, an FSDP2 mesh over all of them, but one job store per pair of ranks (a store
    per replica group): the Checkpointer refuses before anything is written."""
    import torch.distributed as dist

    from ckptstore.errors import RankMismatchError
    from ckptstore.torch import Checkpointer

    model, opt, sched = _model("mlp", [world])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    store = ckptstore.open(os.path.join(path, f"pair{rank // 2}"), "a",
                           process_group=pairs[rank // 2], commit_timeout=60.0)
    try:
        Checkpointer(store, model, opt, sched)
        return None
    except RankMismatchError as e:
        return str(e)
    finally:
        store.close()


def test_a_mesh_that_is_not_the_job_stores_group_is_refused(tmp_path):
    res = ok(run_ranks(4, MOD, "mesh_mismatch", str(tmp_path), str(tmp_path / "w"), deadline=150))
    for r, msg in enumerate(res):
        assert msg is not None and "global ranks [0, 1, 2, 3]" in msg, (r, msg)
        assert f"holds ranks {[0, 1] if r < 2 else [2, 3]}" in msg and "'0.weight'" in msg, msg


def test_box_at_places_shards_as_dtensor_does():
    """The pure placement (replay/shards.py box_at) against torch's own, at every coordinate of
    1-D to 3-D meshes, Shard on any dimension (twice on one, nested), Replicate, uneven and empty
    shards."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from ckptstore.replay.shards import box_at

    cases = 0
    for shape in [(7,), (8, 3), (5, 9), (1, 4), (0, 6), (13, 2, 3)]:
        for mesh_shape in [(2,), (4,), (3,), (2, 2), (2, 3), (4, 2), (2, 2, 2)]:
            choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
            for placements in itertools.product(choices, repeat=len(mesh_shape)):
                codes = ["R" if isinstance(p, Replicate) else f"S{p.dim}" for p in placements]
                for coord in itertools.product(*(range(n) for n in mesh_shape)):
                    local, offsets = _compute_local_shape_and_global_offset(
                        list(shape), list(mesh_shape), list(coord), list(placements))
                    want = (tuple(int(o) for o in offsets), tuple(int(n) for n in local))
                    assert box_at(shape, mesh_shape, coord, codes) == want, \
                        (shape, mesh_shape, codes, coord)
                    cases += 1
    assert cases > 2500
