"""ckptstore.replay.native: the Adam/AdamW replay kernel computes torch's bits or is not used.

The kernel is optional (it needs a C compiler); tests that need it skip with the reason when this
machine cannot build it. The fallbacks (no compiler, switched off, a configuration whose bits
differ) are tested everywhere."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from ckptstore.replay.gradcodecs import parse_codec
from ckptstore.replay.native import adam, build
from ckptstore.replay.parallel import TiledSteps

#: odd sizes, a 0-d parameter, and one big enough for torch to split ops between threads
SHAPES = [(1000,), (3, 129), (7,), (), (4099,), (70001,)]
CONFIGS = [
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.05}),
    ("AdamW", {"lr": 3e-3, "weight_decay": 0.0, "betas": (0.3, 0.95)}),  # lerp weight >= 0.5
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1}),  # L2 decay: grad + wd * param
    ("Adam", {"lr": 1e-2, "maximize": True, "eps": 1e-6}),
    ("Adam", {"lr": 1e-2, "foreach": True}),
    ("Adam", {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.02}),
]


def _kernel():
    if adam._load() is None:
        pytest.skip("no native kernel on this machine (no C compiler, or CKPTSTORE_NATIVE=0)")


def _grads(step: int, codec: str | None) -> list:
    g = torch.Generator().manual_seed(1000 + step)
    out: list = []
    for i, s in enumerate(SHAPES):
        t = torch.randn(s, generator=g) * 10.0 ** float(torch.empty(()).uniform_(-6, 0, generator=g))
        t[t.abs() < 0.2 * t.abs().mean()] = 0.0  # zero entries: zero moments, sqrt's slow lanes
        if step % 3 == 1 and i == 2:
            out.append(None)  # no gradient for this parameter in this step
        elif codec is None:
            out.append(t)
        else:  # decoded slice by slice, as a tiled window decodes lossy payloads
            c = parse_codec(codec)
            out.append((c.slicer(c.encode(t), t), c.decode(c.encode(t), tuple(t.shape), t.dtype)))
    return out


def _run(name: str, kw: dict, codec: str | None, tile: int, threads: int):
    """(whole-tensor torch steps, tiled window) over the same 6 steps, after 2 steady steps;
    returns both optimizers and parameter lists."""
    def make(groups):
        return getattr(torch.optim, name)(groups, **kw)

    out = []
    for _ in range(2):
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=g) for s in SHAPES]
        opt = make([{"params": params[:3]}, {"params": params[3:], "lr": kw["lr"] / 2}])
        for s in range(2):
            for p, gr in zip(params, _grads(s, None)):
                p.grad = gr if gr is not None else torch.zeros_like(p)
            opt.step()
        out.append((opt, params))
    (plain, pp), (tiled, tp) = out
    steps = []
    for s in range(2, 8):
        hyper = [{"lr": kw["lr"] * 0.9 ** s}, {"lr": kw["lr"] * 0.7 ** s}]
        grads = _grads(s, codec)
        for group, h in zip(plain.param_groups, hyper):
            group.update(h)
        for p, gr in zip(pp, grads):
            p.grad = None if gr is None else gr if codec is None else gr[1]
        plain.step()
        full = [dict({k: v for k, v in g.items() if k != "params"}, **h)
                for g, h in zip(tiled.param_groups, hyper)]
        steps.append((full, [gr if gr is None or codec is None else gr[0] for gr in grads]))
    tiler = TiledSteps(tiled, tp, make, tile_numel=tile, threads=threads)
    tiler.run(steps)
    tiler.close()
    for g, h in zip(tiled.param_groups, steps[-1][0]):
        g.update(h)
    return plain, pp, tiled, tp


@pytest.mark.parametrize("codec", [None, "topk:0.05", "bf16"])
@pytest.mark.parametrize("tile,threads", [(1000, 1), (1 << 18, 2)])
@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}-{'-'.join(map(str, kw))}" for n, kw in CONFIGS])
def test_native_window_is_bit_exact(name, kw, tile, threads, codec, assert_same):
    _kernel()
    before = adam.stats["steps"]
    plain, pp, tiled, tp = _run(name, kw, codec, tile, threads)
    assert adam.stats["steps"] == before + 6  # the kernel ran this window
    assert_same(pp, tp)
    assert_same(plain.state_dict(), tiled.state_dict())


def test_configuration_that_differs_is_never_used(monkeypatch, assert_same):
    """The calibration gate: a kernel whose bits differ from torch's (simulated: one scalar off
    by a rounding) is rejected, and the window runs on torch's ops with the right result."""
    _kernel()
    row = adam._row
    monkeypatch.setattr(adam, "_row", lambda group, step: [*row(group, step)[:6], row(group, step)[6] * 1.5,
                                                           row(group, step)[7]])
    monkeypatch.setattr(adam, "_verdicts", {})
    before = adam.stats["steps"]
    plain, pp, tiled, tp = _run("AdamW", {"lr": 1e-2, "weight_decay": 0.05}, None, 1000, 1)
    assert adam.stats["steps"] == before
    assert False in adam._verdicts.values()
    assert_same(pp, tp)
    assert_same(plain.state_dict(), tiled.state_dict())


@pytest.mark.parametrize("kw", [{"amsgrad": True}, {"fused": True}])
def test_unsupported_settings_take_torch_ops(kw, assert_same):
    if kw.get("fused"):
        p = torch.zeros(2)
        p.grad = torch.ones(2)
        try:
            torch.optim.Adam([p], fused=True).step()
        except (RuntimeError, ValueError, TypeError):
            pytest.skip("no fused Adam on CPU in this torch")
    before = adam.stats["steps"]
    plain, pp, tiled, tp = _run("Adam", {"lr": 1e-2, **kw}, None, 1000, 1)
    assert adam.stats["steps"] == before
    assert_same(pp, tp)
    assert_same(plain.state_dict(), tiled.state_dict())


def test_tensor_gradient_of_wrong_size_is_refused_not_read():
    """A gradient tensor whose size differs from its parameter's (a damaged record) never reaches
    the kernel, which would read past its end; torch's ops then raise."""
    _kernel()
    p = torch.randn(1000)
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(1000)
    opt.step()
    win = adam.AdamWindow(opt, lambda groups: torch.optim.Adam(groups), 1)
    settings = [{k: v for k, v in opt.param_groups[0].items() if k != "params"}]
    assert win.run([[(0, 0, 1000)]], [p], [0], [(settings, [torch.ones(10)])]) is False
    assert win.run([[(0, 0, 1000)]], [p], [0], [(settings, [torch.ones(1000, dtype=torch.float64)])]) is False
    assert win.run([[(0, 0, 1000)]], [p], [0], [(settings, [torch.ones(1000)])]) is True
    win.close()


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("CKPTSTORE_NATIVE", "0")
    assert build.load("adam_steps") is None
    p = [torch.zeros(10)]
    opt = torch.optim.Adam(p)
    assert TiledSteps(opt, p, lambda groups: torch.optim.Adam(groups))._native is None


def test_no_compiler_means_no_kernel(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_compiler", lambda: None)
    monkeypatch.setenv("CKPTSTORE_KERNEL_CACHE", str(tmp_path))
    assert build.load("adam_steps") is None
    assert list(tmp_path.iterdir()) == []


def test_failed_compile_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "CFLAGS", ("-this-flag-does-not-exist",))
    monkeypatch.setenv("CKPTSTORE_KERNEL_CACHE", str(tmp_path / "k"))
    if build._compiler() is None:
        pytest.skip("no C compiler")
    assert build.load("adam_steps") is None
    assert [f.name for f in (tmp_path / "k").iterdir()] == []  # no half-written library


def test_build_cache_is_private_and_reused(monkeypatch, tmp_path):
    if build._compiler() is None:
        pytest.skip("no C compiler")
    cache = tmp_path / "cache"
    monkeypatch.setenv("CKPTSTORE_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(build, "_loaded", {})
    lib = build.load("adam_steps")
    assert lib is not None and lib.ckpt_adam_abi() == 3
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".so"
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    mtime = files[0].stat().st_mtime_ns
    monkeypatch.setattr(build, "_loaded", {})
    assert build.load("adam_steps") is not None
    assert files[0].stat().st_mtime_ns == mtime  # loaded from the cache, not rebuilt


def test_step_counts_follow_torch_float32_arithmetic():
    """Scalars come from the step count torch's ``step_t += 1`` gives, in the state's dtype."""
    values, final = adam._step_values(torch.tensor(float(2 ** 24 - 2)), 4)
    assert values == [2.0 ** 24 - 1, 2.0 ** 24, 2.0 ** 24, 2.0 ** 24]  # float32 stops counting
    assert final.dtype == torch.float32 and float(final) == 2.0 ** 24
    values, _ = adam._step_values(torch.tensor(float(2 ** 24), dtype=torch.float64), 2)
    assert values == [2.0 ** 24 + 1, 2.0 ** 24 + 2]
    row = np.asarray(adam._row({"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.1, "eps": 1e-8}, 3.0),
                     dtype=np.float32)
    assert row.shape == (adam.SCALARS,) and row[7] < 0  # the last scalar is -step_size


@pytest.mark.parametrize("codec", [None, "topk:0.05"])
def test_window_from_empty_state(monkeypatch, codec, assert_same):
    """A window may start before the optimizer has state (the first deltas after a run's first
    base): the kernel creates the state as torch's first step does; where it declines, the
    window runs as whole-tensor steps (slices cannot create state). Both match torch's steps."""
    def make(groups):
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05)

    def fresh():
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=g) for s in SHAPES]
        return make([{"params": params[:3]}, {"params": params[3:], "lr": 5e-3}]), params

    for declined in (False, True):
        if declined:
            monkeypatch.setattr(adam.AdamWindow, "_plan", lambda self, *a: None)
        elif adam._load() is None:
            continue
        (plain, pp), (tiled, tp) = fresh(), fresh()
        assert adam.AdamWindow.can_start(tiled, tp) == (adam._load() is not None)
        steps = []
        for s in range(4):
            grads = _grads(s, codec)
            for p, gr in zip(pp, grads):
                p.grad = None if gr is None else gr if codec is None else gr[1]
            plain.step()
            full = [{k: v for k, v in g.items() if k != "params"} for g in tiled.param_groups]
            steps.append((full, [gr if gr is None or codec is None else gr[0] for gr in grads]))
        before = adam.stats["steps"]
        tiler = TiledSteps(tiled, tp, make, tile_numel=1000, threads=2)
        tiler.run(steps)
        tiler.close()
        assert adam.stats["steps"] == before + (0 if declined else 4)
        assert_same(pp, tp)
        assert_same(plain.state_dict(), tiled.state_dict())


def test_cache_writable_by_others_is_not_used(monkeypatch, tmp_path):
    """Whatever library sits in the cache gets loaded: a directory others may write is refused."""
    if build._compiler() is None:
        pytest.skip("no C compiler")
    cache = tmp_path / "shared"
    cache.mkdir()
    os.chmod(cache, 0o777)
    monkeypatch.setenv("CKPTSTORE_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(build, "_loaded", {})
    assert build.load("adam_steps") is None
    assert list(cache.iterdir()) == []


def test_kernel_never_writes_outside_its_range_on_unsorted_positions():
    """Defence in depth below the payload checks: sparse positions out of order (which the
    codecs refuse) still only ever touch entries inside the call's range."""
    _kernel()
    fn, vsqrt = adam._load()
    n, guard = 8192, 4096
    p, m, v = (torch.zeros(n + 2 * guard) for _ in range(3))
    for t in (p, m, v):
        t[:guard] = 7.0
        t[guard + n:] = 7.0
    idx = np.array([8000, 5, 9000, -3, 4096], dtype=np.int64)  # unsorted, some out of range
    backwards = idx[::-1].copy()
    vals = np.ones(idx.size, dtype=np.float32)
    grads = (adam._Grad * 2)(adam._Grad(None, idx.ctypes.data, vals.ctypes.data, idx.size),
                            adam._Grad(None, backwards.ctypes.data, vals.ctypes.data, idx.size))
    row = adam._row({"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0, "eps": 1e-8}, 1.0)
    scalars = np.asarray([row, row], dtype=np.float32).reshape(-1)
    call = adam._Call(p.data_ptr() + 4 * guard, m.data_ptr() + 4 * guard, v.data_ptr() + 4 * guard,
                      grads, 0, n, scalars, 0, vsqrt, (idx, backwards, vals))
    for part in call.split(2):
        part(fn)
    for t in (p, m, v):
        assert bool((t[:guard] == 7.0).all()) and bool((t[guard + n:] == 7.0).all())
