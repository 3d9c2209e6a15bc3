"""Data-parallel partitions of a Checkpointer state (ckptstore/replay/partition.py): every split
merges back to the same state, each part replays like the whole, and a merge refuses parts that do
not form one partition."""

from __future__ import annotations

import copy

import pytest
import torch

from ckptstore.errors import DamagedCheckpointError
from ckptstore.format.delta import REPLAY_KEY
from ckptstore.replay.partition import Partition, merge_parts, split_grads, split_state
from ckptstore.replay.replayer import _StateReplayer

from conftest import _same


def _trained(opt_name: str, tied: bool, named: bool):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12),
                                torch.nn.BatchNorm1d(12), torch.nn.Linear(12, 12),
                                torch.nn.Linear(12, 3))
    if tied:
        model[4].weight = model[2].weight
    # named: the optimizer gets names of another module (not the model's own), as when it is
    # built from a wrapper's named_parameters()
    params = list(torch.nn.ModuleDict({"module": model}).named_parameters()) if named \
        else list(model.parameters())
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 0.05}]
    opt = {"Adam": lambda: torch.optim.Adam(groups, lr=0.01),
           "SGD": lambda: torch.optim.SGD(groups, lr=0.02, momentum=0.9),
           "AdamW": lambda: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)}[opt_name]()
    model[0].requires_grad_(False)  # no gradient at first: its state comes last
    for i in range(3):
        if i == 2:
            model[0].requires_grad_(True)
        model(torch.randn(5, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
    sd = model.state_dict()
    aliases = {}
    if sd["4.weight"].data_ptr() == sd["2.weight"].data_ptr():
        aliases["4.weight"] = "2.weight"
    return {"model": sd, "optimizer": opt.state_dict(), "rng": {"seed": 1}, "iteration": 2,
            REPLAY_KEY: {"v": 1, "optimizer": type(opt).__name__, "defaults": {},
                         "groups": groups, "aliases": aliases, "codec": "exact",
                         "device": "cpu", "scheduler": False}}


@pytest.mark.parametrize("opt_name", ["Adam", "SGD", "AdamW"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("named", [False, True], ids=["params", "named-params"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 16])
def test_split_then_merge_gives_the_state_back(opt_name, tied, named, world):
    model, opt = _trained(opt_name, tied, named)
    state = _state(model, opt)
    info = state[REPLAY_KEY]
    names = [n for g in info["groups"] for n in g]
    part = Partition.balanced([(n, dict(model.named_parameters())[n].numel() * 4) for n in names],
                              world)
    parts = [split_state(copy.deepcopy(state), part, r) for r in range(world)]
    owned = [set(n for g in p[REPLAY_KEY]["groups"] for n in g) for p in parts]
    assert sorted(n for o in owned for n in o) == sorted(names)  # each parameter exactly once
    for local in range(world):
        merged = merge_parts(parts, local)
        _same(state["model"], merged["model"], "model")
        _same(state["optimizer"], merged["optimizer"], "optimizer")
        assert merged[REPLAY_KEY]["groups"] == info["groups"]
        assert merged[REPLAY_KEY]["aliases"] == info["aliases"]


def test_a_part_replays_like_the_whole():
    """Replaying rank r's part of a base with its gradients gives exactly the owned parameters of
    replaying the whole state (the optimizers update each parameter independently)."""
    model, opt = _trained("AdamW", tied=True, named=False)
    state = _state(model, opt)
    names = [n for g in state[REPLAY_KEY]["groups"] for n in g]
    params = dict(model.named_parameters())
    grads = [{"g": torch.randn_like(params[n])} for n in names]
    record = {"v": 1, "codec": "exact", "lossy": False, "applied": False, "grads": grads,
              "hyper": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
              "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
              "rng": {"seed": 2}, "buffers": {}}
    whole = _StateReplayer(copy.deepcopy(state), 2)
    whole.apply(3, copy.deepcopy(record))
    want = whole.current(clone=True)
    part = Partition.balanced([(n, params[n].numel() * 4) for n in names], 3)
    replayed = []
    for r in range(3):
        rec = dict(copy.deepcopy(record), grads=split_grads(grads, part, r, names))
        eng = _StateReplayer(split_state(copy.deepcopy(state), part, r), 2)
        eng.apply(3, rec)
        replayed.append(eng.current(clone=True))
    merged = merge_parts(replayed)
    _same(want["model"], merged["model"], "model")
    _same(want["optimizer"], merged["optimizer"], "optimizer")


def test_merge_refuses_parts_of_different_partitions():
    model, opt = _trained("Adam", tied=False, named=False)
    state = _state(model, opt)
    names = [n for g in state[REPLAY_KEY]["groups"] for n in g]
    a = Partition.balanced([(n, 1) for n in names], 2)
    b = Partition(2, {n: 1 - r for n, r in a.owner.items()})
    parts = [split_state(state, a, 0), split_state(state, b, 1)]
    with pytest.raises(DamagedCheckpointError, match="partition"):
        merge_parts(parts)
    with pytest.raises(DamagedCheckpointError):
        merge_parts([split_state(state, a, 0)])  # a part is missing
    with pytest.raises(DamagedCheckpointError):
        merge_parts([split_state(state, a, 1), split_state(state, a, 0)])  # out of order
