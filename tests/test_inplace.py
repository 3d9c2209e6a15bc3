"""Loading into tensors the caller already has: ``store.load(it, into=...)`` and the
Checkpointer's restore, which uses it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore.torch import Checkpointer


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(8, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _equal_states(a: dict, b: dict) -> bool:
    ta = {k: v for k, v in _leaves(a)}
    tb = {k: v for k, v in _leaves(b)}
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _leaves(x, path=()):
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, path + (i,))


@pytest.fixture
def saved(tmp_path):
    model, opt = _trained()
    path = str(tmp_path / "s")
    with ckptstore.open(path, "a", chunk_size=1024) as store:
        store.save(1, _state(model, opt))
    return path, _state(model, opt)


def test_snapshot_is_read_into_the_given_tensors(saved):
    path, expected = saved
    model, opt = _trained(seed=1)  # same shapes, other values, optimizer state present
    live = _state(model, opt)
    ptrs = {k: v.data_ptr() for k, v in _leaves(live)}
    with ckptstore.open(path, "r") as store:
        got = store.load(1, into=live)
    assert _equal_states(got, expected)
    for k, v in _leaves(got):  # the caller's own tensors, same memory
        assert v.data_ptr() == ptrs[k]
    assert torch.equal(model[0].weight, expected["model"]["0.weight"])
    exp_avg = opt.state[model[0].weight]["exp_avg"]
    assert torch.equal(exp_avg, expected["optim"]["state"][0]["exp_avg"])


def test_paths_the_target_lacks_are_allocated_and_extra_targets_untouched(saved):
    path, expected = saved
    w = torch.zeros(32, 16)
    spare = torch.full((3,), 7.0)
    with ckptstore.open(path, "r") as store:
        got = store.load(1, into={"model": {"0.weight": w, "not-stored": spare}})
    assert got["model"]["0.weight"] is w and torch.equal(w, expected["model"]["0.weight"])
    assert _equal_states(got, expected)
    assert torch.equal(spare, torch.full((3,), 7.0))


def test_parameters_requiring_grad_are_filled_without_autograd(saved):
    path, expected = saved
    model = _model(seed=5)
    params = dict(model.named_parameters())
    with ckptstore.open(path, "r") as store:
        got = store.load(1, keys=["model"], into={"model": params})
    assert got["model"]["2.bias"] is params["2.bias"]
    assert params["2.bias"].requires_grad and params["2.bias"].grad_fn is None
    assert torch.equal(model[2].bias, expected["model"]["2.bias"])
    assert list(got) == ["model"]


def test_non_contiguous_targets_are_staged(saved):
    path, expected = saved
    wt = torch.zeros(16, 32).t()  # a [32, 16] view, not contiguous
    with ckptstore.open(path, "r") as store:
        got = store.load(1, into={"model": {"0.weight": wt}})
    assert got["model"]["0.weight"] is wt
    assert torch.equal(wt, expected["model"]["0.weight"])


@pytest.mark.parametrize("bad", [torch.zeros(16, 32), torch.zeros(32, 16, dtype=torch.float64),
                                 torch.zeros(32 * 16)])
def test_a_mismatch_raises_before_any_target_is_written(saved, bad):
    path, _ = saved
    first = torch.full((32,), 3.0)  # 0.bias: loaded before 0.weight would be
    with ckptstore.open(path, "r") as store:
        with pytest.raises(ckptstore.TargetMismatchError, match=r"state\['model'\]\['0.weight'\]"):
            store.load(1, into={"model": {"0.bias": first, "0.weight": bad}})
    assert torch.equal(first, torch.full((32,), 3.0))
    assert not bad.any()


def test_a_numpy_leaf_cannot_be_loaded_into_a_tensor(tmp_path):
    path = str(tmp_path / "s")
    with ckptstore.open(path, "a") as store:
        store.save(1, {"a": np.arange(4, dtype=np.float32)})
        with pytest.raises(ckptstore.TargetMismatchError, match="numpy"):
            store.load(1, into={"a": torch.zeros(4)})
        # a numpy array in the target is not a destination: the leaf is allocated
        got = store.load(1, into={"a": np.zeros(4, dtype=np.float32)})
        assert isinstance(got["a"], np.ndarray) and got["a"][3] == 3


def test_a_damaged_chunk_is_reported(saved):
    path, _ = saved
    import glob
    seg = sorted(glob.glob(f"{path}/segments/*.seg"))[0]
    data = bytearray(open(seg, "rb").read())
    data[len(data) // 3] ^= 0xFF  # inside some chunk or tree: the read fails, naming it
    open(seg, "wb").write(bytes(data))
    model, opt = _trained(seed=1)
    with ckptstore.open(path, "r") as store:
        with pytest.raises(ckptstore.DamagedCheckpointError):
            store.load(1, into=_state(model, opt))


def _train_with_checkpointer(path: str, iters: int, base_every: int):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ckptstore.open(path, "a", chunk_size=4096) as store:
        ckpt = Checkpointer(store, model, opt, policy="every-iteration", base_every=base_every,
                            asynchronous=False)
        ckpt.restore()
        for it in range(1, iters + 1):
            torch.manual_seed(100 + it)
            model(torch.randn(8, 16)).square().sum().backward()
            ckpt.step(it)
            opt.zero_grad()
    return model, opt


def test_a_replayed_delta_is_copied_into_the_targets(tmp_path):
    path = str(tmp_path / "s")
    model, opt = _train_with_checkpointer(path, iters=7, base_every=5)
    m2 = _model(3)
    live = {"model": m2.state_dict()}
    with ckptstore.open(path, "r") as store:
        assert store.kind(7) == "delta"
        got = store.load(7, into=live)
    assert got["model"]["0.weight"] is live["model"]["0.weight"]
    for k, v in model.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v)


@pytest.mark.parametrize("iteration", [5, 7])
def test_checkpointer_restore_loads_into_the_live_model_and_optimizer(tmp_path, iteration):
    path = str(tmp_path / "s")
    _train_with_checkpointer(path, iters=iteration, base_every=5)
    with ckptstore.open(path, "r") as store:
        expected = store.load(iteration)
    model = _model(9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()  # the optimizer has state to load into
    opt.zero_grad()
    ptrs = [p.data_ptr() for p in model.parameters()]
    avg_ptrs = [opt.state[p]["exp_avg"].data_ptr() for p in model.parameters()]
    with ckptstore.open(path, "a") as store:
        assert Checkpointer(store, model, opt, policy="every-iteration", base_every=5,
                            asynchronous=False).restore() == iteration
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert [opt.state[p]["exp_avg"].data_ptr() for p in model.parameters()] == avg_ptrs
    for k, v in expected["model"].items():
        assert torch.equal(model.state_dict()[k], v)
    for i, p in enumerate(model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], expected["optimizer"]["state"][i][key])
