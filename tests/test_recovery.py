"""ckptstore.replay.parallel.TiledSteps: a window of optimizer steps run tile by tile computes the same
bits as the same steps run one after another on whole tensors (format-spec/deltas.md, "Pipelined
and parallel replay"). The store-level proof is tests/test_checkpointer.py; these tests drive the
tiler directly on awkward shapes, changing hyperparameters and missing gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from ckptstore.replay.parallel import TILE_ALIGN, TiledSteps, window_size

CONFIGS = [
    ("SGD", {"lr": 0.05}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "foreach": True}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "fused": True}),
    ("Adam", {"lr": 1e-2, "amsgrad": True}),
    ("Adam", {"lr": 1e-2, "foreach": True}),
    ("Adam", {"lr": 1e-2, "fused": True}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.05}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.05, "fused": True}),
    ("RMSprop", {"lr": 1e-3, "momentum": 0.9, "centered": True}),
    ("Adagrad", {"lr": 0.05, "lr_decay": 1e-3}),
]
#: odd sizes (not multiples of any vector width), a 0-d parameter, ones spanning many tiles, one
#: large enough for torch to split each whole-tensor op across intra-op threads
SHAPES = [(1000,), (3, 129), (7,), (), (5, 3, 11), (4099,), (70001,)]


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(1000 + step)
    out: list[torch.Tensor | None] = [torch.randn(s, generator=g) * 0.1 for s in SHAPES]
    if step % 3 == 1:
        out[2] = None  # a parameter without a gradient in this step is skipped by both paths
    return out


def _make(name: str, kw: dict, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": kw["lr"] / 2}]
    return getattr(torch.optim, name)(groups, **kw)


def _fused_ok(name: str) -> bool:
    p = torch.zeros(2)
    p.grad = torch.ones(2)
    try:
        getattr(torch.optim, name)([p], lr=0.1, fused=True).step()
        return True
    except (RuntimeError, ValueError, TypeError):
        return False


def _step_plain(opt, params, hyper, grads):
    for group, h in zip(opt.param_groups, hyper):
        group.update(h)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    for p in params:
        p.grad = None


@pytest.mark.parametrize("tile,threads", [(1000, 1), (1 << 18, 2)])
@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}-{'-'.join(map(str, kw))}" for n, kw in CONFIGS])
def test_tiled_window_is_bit_exact(name, kw, tile, threads, assert_same):
    """Tiles of ``tile`` entries; ``threads`` intra-op threads for both paths (with 2, torch
    splits the whole-tensor ops of the large parameter between threads, the tiles' not)."""
    if kw.get("fused") and not _fused_ok(name):
        pytest.skip(f"no fused {name} on CPU in this torch")
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain_p, tiled_p = _params(0), _params(0)
        plain, tiled = _make(name, kw, plain_p), _make(name, kw, tiled_p)
        for opt, ps in ((plain, plain_p), (tiled, tiled_p)):  # reach a steady state
            for s in range(2):
                _step_plain(opt, ps, [{}, {}], [g if g is not None else torch.zeros_like(p)
                                                 for g, p in zip(_grads(s), ps)])
        assert TiledSteps.ready(tiled, tiled_p)
        # a window of 5 steps, the learning rate changing every step (a scheduler's effect)
        steps = []
        for s in range(2, 7):
            hyper = [{"lr": kw["lr"] * (0.9 ** s)}, {"lr": kw["lr"] * (0.8 ** s)}]
            steps.append((hyper, _grads(s)))
            _step_plain(plain, plain_p, hyper, _grads(s))
        tiler = TiledSteps(tiled, tiled_p, lambda groups: getattr(torch.optim, name)(groups, **kw),
                           tile_numel=tile)
        settings = []
        for hyper, grads in steps:  # the engine passes each group's full settings per step
            full = [dict({k: v for k, v in g.items() if k != "params"}, **h)
                    for g, h in zip(tiled.param_groups, hyper)]
            settings.append((full, grads))
        tiler.run(settings)
        for g, h in zip(tiled.param_groups, steps[-1][0]):
            g.update(h)
        assert_same(plain_p, tiled_p)
        assert_same(plain.state_dict(), tiled.state_dict())
        if tile == 1000:  # several tiles, parameters cut into TILE_ALIGN pieces and packed
            assert len(tiler.tiles) > 10
            assert all(a % TILE_ALIGN == 0 for _, views, _ in tiler.tiles for _, a, _, _ in views)
        tiler.close()
    finally:
        torch.set_num_threads(saved_threads)


def test_every_entry_in_exactly_one_tile():
    params = _params(1)
    opt = torch.optim.Adam(params)
    tiler = TiledSteps(opt, params, lambda groups: torch.optim.Adam(groups), tile_numel=200)
    covered = [torch.zeros(max(1, p.numel()), dtype=torch.int32) for p in params]
    for _, views, _ in tiler.tiles:
        assert sum(b - a for _, a, b, _ in views) <= max(200, TILE_ALIGN)
        for i, a, b, v in views:
            covered[i][a:b] += 1
            assert v.data_ptr() == params[i].data_ptr() + a * params[i].element_size()
    assert all(bool((c == 1).all()) for c in covered)


def test_ready_only_for_steady_separable_state():
    p = [torch.zeros(10), torch.zeros(3)]
    adam = torch.optim.Adam(p)
    assert not TiledSteps.ready(adam, p)  # no state yet: the first step creates it
    for q in p:
        q.grad = torch.ones_like(q)
    adam.step()
    assert TiledSteps.ready(adam, p)
    adam.state[p[1]]["exp_avg"] = torch.zeros(3, 2)[:, 0]  # a non-contiguous state tensor
    assert not TiledSteps.ready(adam, p)
    assert TiledSteps.ready(torch.optim.SGD(p, lr=0.1), p)  # no momentum: stateless
    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.9)
    assert not TiledSteps.ready(sgd, p)  # momentum buffers not made yet
    assert not TiledSteps.ready(torch.optim.SGD([torch.zeros(4, 4).t()], lr=0.1), [torch.zeros(4, 4).t()])

    class MyAdam(torch.optim.Adam):
        pass

    mine = MyAdam(p)
    mine.state.update(copy.deepcopy(dict(adam.state)))
    assert not TiledSteps.ready(mine, p)  # a subclass may step differently: never tiled
    nadam = torch.optim.NAdam(p)
    nadam.step()
    assert not TiledSteps.ready(nadam, p)  # not in the separable allowlist


def test_window_size_bounded_by_memory():
    assert window_size([torch.zeros(10)]) == 16
    assert window_size([torch.zeros(1 << 28)]) == 1  # 1 GiB of gradient: step by step
    assert 1 < window_size([torch.zeros(27_000_000)]) < 16


def test_parameter_norm_is_float64_accurate():
    from ckptstore.replay import parameter_norm

    g = torch.Generator().manual_seed(3)
    params = [torch.randn(300_001, generator=g) * 1e3, torch.randn(7, 5, generator=g).half(),
              torch.arange(5), torch.randn(3, dtype=torch.float64, generator=g)]
    exact = sum(float(p.double().square().sum()) for p in params if p.is_floating_point()) ** 0.5
    assert abs(parameter_norm(params) - exact) <= 1e-6 * exact  # float32 partial sums
