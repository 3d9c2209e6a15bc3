"""Bit-exact round trips of everything a training state holds, and refusal of what it must not."""

from __future__ import annotations

import collections
import json
import math
import os
import struct
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim import lr_scheduler as L

import ckptstore
from ckptstore import UnsupportedTypeError
from ckptstore.format import chunk as fchunk
from ckptstore.format.state import flatten, unflatten
from ckptstore.tensors import TORCH_DTYPES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning",
                                        "ignore::PendingDeprecationWarning")

CHUNK = 4096


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny tensors: intra-op threads only add contention on a 2-core runner."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def random_tensor(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` elements of ``dtype`` with random bit patterns (NaN payloads, denormals, bool 2..255)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


# ---------------------------------------------------------------------------------------------
# torch dtypes


def test_dtype_table_covers_common_and_exotic_dtypes():
    for name in ("float32", "float64", "float16", "bfloat16", "complex64", "complex128", "bool",
                 "int8", "uint8", "int64", "float8_e4m3fn", "float8_e5m2"):
        assert name in TORCH_DTYPES
    for name in ("qint8", "quint8", "qint32"):
        assert name not in TORCH_DTYPES


@pytest.mark.parametrize("name", sorted(TORCH_DTYPES))
def test_every_torch_dtype_roundtrips_bit_exact(name, roundtrip, assert_same):
    dtype = TORCH_DTYPES[name]
    try:
        small = random_tensor(dtype, 7, seed=1)          # inline in the manifest
        large = random_tensor(dtype, 3 * CHUNK // dtype.itemsize + 5, seed=2)  # several chunks
        zero_d = random_tensor(dtype, 1, seed=3).reshape(())
        shaped = random_tensor(dtype, 24, seed=4).reshape(2, 3, 4)
    except (RuntimeError, TypeError) as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch cannot create {name} tensors here: {e}")
    state = {"small": small, "large": large, "zero_d": zero_d, "shaped": shaped}
    out = roundtrip(state, chunk_size=CHUNK)
    assert_same(state, out)
    for k in state:
        assert out[k].dtype is dtype
        assert out[k].is_contiguous()


@pytest.mark.parametrize("name", ["bits16", "bits8", "bits1x8", "float32", "int64"])
def test_loads_under_torch_deterministic_mode(name, roundtrip, assert_same):
    """torch.use_deterministic_algorithms(True) makes torch fill every new tensor, which it
    cannot do for the bits dtypes: a load (which allocates) must still work."""
    import torch

    dtype = TORCH_DTYPES[name]
    state = {"t": random_tensor(dtype, 3 * CHUNK // dtype.itemsize + 5, seed=5),
             "zero_d": random_tensor(dtype, 1, seed=6).reshape(())}
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out = roundtrip(state, chunk_size=CHUNK)
    finally:
        torch.use_deterministic_algorithms(before)
    assert_same(state, out)


def test_float_special_values_and_nan_payloads(roundtrip, assert_same):
    bits32 = torch.tensor([0x7FC00000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x80000000, 0x00000001,
                           0x7F800000, 0xFF800000], dtype=torch.int64).to(torch.int32)
    f32 = bits32.view(torch.float32)
    f64 = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, -0.0, 5e-324], dtype=torch.float64)
    bf16 = torch.tensor([0x7FC1, 0xFF80, 0x8000, 0x0001], dtype=torch.int32).to(torch.int16).view(
        torch.bfloat16)
    f8 = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    state = {"f32": f32, "f64": f64, "bf16": bf16,
             **{n: f8.view(TORCH_DTYPES[n]) for n in TORCH_DTYPES if n.startswith("float8")}}
    out = roundtrip(state)
    assert_same(state, out)


def test_complex_and_bool(roundtrip, assert_same):
    c = torch.complex(torch.randn(100, dtype=torch.float64), torch.randn(100, dtype=torch.float64))
    state = {"c128": c, "c64": c.to(torch.complex64), "c32": c.to(torch.complex64).to(torch.complex32),
             "bool": torch.rand(1000) > 0.5, "bool_weird": torch.tensor([0, 1, 2, 255], dtype=torch.uint8)
             .view(torch.bool)}
    assert_same(state, roundtrip(state, chunk_size=CHUNK))


def test_tensors_larger_than_one_chunk(roundtrip, assert_same):
    g = torch.Generator().manual_seed(7)
    state = {
        "random_partial": torch.randn(5 * CHUNK // 4 + 3, generator=g),      # raw chunks + partial
        "random_exact": torch.randn(4 * CHUNK // 4, generator=g),            # exact multiple
        "compressible": torch.zeros(10 * CHUNK // 8 + 1, dtype=torch.float64),  # lz4 chunks
        "arange": torch.arange(20000, dtype=torch.int32),
        "at_inline_max": torch.arange(64, dtype=torch.float32),              # 256 bytes: inline
        "over_inline_max": torch.arange(65, dtype=torch.float32),            # 260 bytes: chunked
        "one_byte_chunks_worth": torch.arange(CHUNK + 1, dtype=torch.uint8),
    }
    out = roundtrip(state, chunk_size=CHUNK)
    assert_same(state, out)


def test_tiny_chunk_size(roundtrip, assert_same):
    state = {"w": torch.randn(300), "b": torch.arange(1000, dtype=torch.int16)}
    assert_same(state, roundtrip(state, chunk_size=7))


def test_non_contiguous_and_view_tensors(roundtrip, assert_same):
    base = torch.randn(40, 30)
    c = torch.complex(torch.randn(6, 5), torch.randn(6, 5))
    state = {
        "transposed": base.t(),
        "sliced": base[::3, 1::2],
        "narrow": base.narrow(0, 5, 7),                 # storage offset
        "expanded": torch.arange(5.0).expand(4, 5),     # stride 0
        "channels_last": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "permuted_big": torch.randn(32, 64, 3).permute(2, 0, 1),
        "conj_view": c.conj(),
        "neg_view": torch._neg_view(c),
        "diag": base[:30, :30].diagonal(),
    }
    out = roundtrip(state, chunk_size=CHUNK)
    assert_same(state, out)
    for k, v in state.items():
        assert torch.equal(out[k], v.resolve_conj().resolve_neg()), k
        assert not out[k].is_conj() and not out[k].is_neg()


def test_zero_size_tensors_and_arrays(roundtrip, assert_same):
    """Regression: zero-size arrays saved but load wrote into a read-only empty memoryview."""
    state = {"t0": torch.empty(0), "t03": torch.empty(0, 3, dtype=torch.int64),
             "t_param": nn.Parameter(torch.empty(2, 0)),
             "n0": np.empty((0,), dtype=">f8"), "n30": np.empty((3, 0), dtype="<c8")}
    assert_same(state, roundtrip(state))


def test_zero_d_tensors(roundtrip, assert_same):
    state = {"f": torch.tensor(3.5), "i": torch.tensor(-7, dtype=torch.int64),
             "b": torch.tensor(True), "bf": torch.tensor(1.5, dtype=torch.bfloat16),
             "c": torch.tensor(1 + 2j), "step": torch.tensor(12.0)}
    out = roundtrip(state)
    assert_same(state, out)
    assert out["f"].dim() == 0


def test_parameters_and_requires_grad(roundtrip, assert_same):
    big = nn.Parameter(torch.randn(3000))                      # chunked
    state = {
        "p": nn.Parameter(torch.randn(3, 4)),
        "p_big": big,
        "p_frozen": nn.Parameter(torch.randn(5), requires_grad=False),
        "p_int": nn.Parameter(torch.arange(4), requires_grad=False),
        "rg": torch.randn(4, requires_grad=True),
        "rg_nonleaf": torch.randn(4, requires_grad=True) * 2,
        "plain": torch.randn(4),
    }
    out = roundtrip(state, chunk_size=CHUNK)
    assert_same(state, out)
    assert type(out["p"]) is nn.Parameter and out["p"].requires_grad
    assert type(out["p_big"]) is nn.Parameter and out["p_big"].requires_grad
    assert type(out["p_frozen"]) is nn.Parameter and not out["p_frozen"].requires_grad
    assert type(out["rg"]) is torch.Tensor and out["rg"].requires_grad and out["rg"].is_leaf
    assert out["rg_nonleaf"].requires_grad and out["rg_nonleaf"].is_leaf
    assert type(out["plain"]) is torch.Tensor and not out["plain"].requires_grad
    out["p"].sum().backward()  # loaded parameters are usable leaves
    assert out["p"].grad is not None


# ---------------------------------------------------------------------------------------------
# numpy

NUMPY_DTYPES = ["|b1", "|i1", "|u1"] + [o + t for o in "<>" for t in
                                        ("i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8",
                                         "c8", "c16")]
for _ext in (np.longdouble, np.clongdouble):
    _s = np.dtype(_ext).str
    if _s[1:] not in ("f8", "c16"):
        NUMPY_DTYPES += [_s, np.dtype(_ext).newbyteorder().str]


@pytest.mark.parametrize("dt", NUMPY_DTYPES)
def test_numpy_dtypes_both_byte_orders(dt, roundtrip, assert_same):
    dtype = np.dtype(dt)
    rng = np.random.default_rng(5)
    big = rng.integers(0, 256, size=dtype.itemsize * (2 * CHUNK // dtype.itemsize + 3),
                       dtype=np.uint8).view(dtype)
    small = rng.integers(0, 256, size=dtype.itemsize * 6, dtype=np.uint8).view(dtype).reshape(2, 3)
    zero_d = np.frombuffer(rng.integers(0, 256, size=dtype.itemsize, dtype=np.uint8).tobytes(),
                           dtype=dtype).reshape(())
    state = {"big": big, "small": small, "zero_d": zero_d}
    out = roundtrip(state, chunk_size=CHUNK)
    assert_same(state, out)
    for k in state:
        assert out[k].dtype.str == dtype.str
        assert type(out[k]) is np.ndarray


def test_numpy_layouts(roundtrip, assert_same):
    a = np.arange(600, dtype=">f4").reshape(20, 30)
    ro = np.arange(10, dtype="<i8")
    ro.flags.writeable = False
    state = {"T": a.T, "fortran": np.asfortranarray(a), "reversed": a[::-1, ::-2], "readonly": ro,
             "zero_d": np.array(2.5), "zero_d_bool": np.array(True), "zero_d_be": np.array(7, ">i2")}
    out = roundtrip(state, chunk_size=256)
    assert_same(state, out)
    for k, v in state.items():
        np.testing.assert_array_equal(out[k], v)
        assert out[k].flags.c_contiguous


# ---------------------------------------------------------------------------------------------
# scalars and structure

FLOATS = [0.0, -0.0, 1.0, -1.5, 0.1, math.pi, 5e-324, -5e-324, 2.2250738585072014e-308,
          1.7976931348623157e308, math.inf, -math.inf, math.nan]


def test_json_like_scalars(roundtrip, assert_same):
    state = {
        "floats": FLOATS,
        "ints": [0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 + 1, -2**63 - 1, 2**1000, -(10**4000)],
        "bools": [True, False],
        "none": None,
        "strs": ["", "ascii", "ünïcödé", "日本語", "emoji 🚀", "nul\x00byte", "quote\"\\", "\ud800"],
        "bytes": [b"", b"\x00\xff" * 100, bytes(range(256))],
        "nested_empty": [[], (), {}, OrderedDict()],
    }
    out = roundtrip(state)
    assert_same(state, out)
    assert math.copysign(1.0, out["floats"][1]) == -1.0
    assert math.isnan(out["floats"][-1])
    assert out["ints"][-1] == -(10**4000)


def test_python_float_nan_bits_are_kept(roundtrip):
    """Regression: float.hex() renders every NaN as 'nan', which lost the sign and payload."""
    neg_nan = math.inf - math.inf           # on x86 this is the negative default NaN 0xfff8...
    payload = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000123))[0]
    out = roundtrip({"a": neg_nan, "b": payload})
    assert struct.pack("<d", out["a"]) == struct.pack("<d", neg_nan)
    assert struct.pack("<d", out["b"]) == struct.pack("<d", payload)


def test_ints_beyond_json_digit_limit(roundtrip, assert_same):
    """Regression: ints of more than 4300 digits (as values, then as dict keys) made json.dumps
    raise a bare ValueError."""
    huge = 10**5000
    state = {"x": huge, "neg": -huge - 1, "l": [2**20000, (-(2**70),)], huge: "key", -huge: {2**64: 1}}
    out = roundtrip(state)
    assert_same(state, out)
    assert list(out)[3] == huge and type(list(out)[3]) is int


def test_surrogate_key_above_tensor(tmp_path, assert_same):
    """Regression: snapshot_root raised a bare UnicodeEncodeError for a lone surrogate in a path."""
    state = {"\udcff": torch.arange(3)}
    with ckptstore.open(tmp_path / "s") as s:
        try:
            s.save(1, state)
        except UnsupportedTypeError:
            assert s.iterations() == []
        else:
            assert_same(state, s.load(1))


def test_tuple_list_dict_kinds_preserved(roundtrip, assert_same):
    od = OrderedDict([("z", 1), ("a", (2, [3, (4,)])), (5, {"k": ()})])
    state = {
        "tuple": (1, 2.0, "3", None),
        "list": [1, 2.0, "3", None],
        "nested": [(), [()], ((),), {"x": [(1,), [1]]}],
        "int_keys": {0: "a", -5: "b", 2**70: "c", 10: {1: {2: 3}}},
        "mixed_keys": {1: "int", "1": "str"},
        "order": {"b": 1, "a": 2, "c": 3},
        "od": od,
        "tensors_in_tuples": (torch.zeros(2), [np.ones(3), (torch.ones(1),)]),
    }
    out = roundtrip(state)
    assert_same(state, out)
    assert type(out["tuple"]) is tuple and type(out["list"]) is list
    assert type(out["od"]) is OrderedDict and type(out["order"]) is dict
    assert list(out["order"]) == ["b", "a", "c"]
    assert list(out["mixed_keys"].items()) == [(1, "int"), ("1", "str")]


def test_top_level_non_dict_states(roundtrip, assert_same):
    for state in ([torch.ones(2), 3], (1, 2), torch.arange(5), np.arange(3), 7, None, "x"):
        assert_same(state, roundtrip(state))


def test_ordered_dict_metadata_kept(roundtrip, assert_same):
    od = OrderedDict(w=torch.ones(2))
    od._metadata = OrderedDict([("", {"version": 2}), ("sub", {"version": 1})])
    out = roundtrip({"sd": od})
    assert_same({"sd": od}, out)
    assert out["sd"]._metadata == od._metadata


def test_meta_roundtrip(tmp_path, assert_same):
    meta = {"loss": 2.5, "nan": math.nan, "tags": ("a", "b"), "n": 2**80, 3: [None, True, b"x"]}
    with ckptstore.open(tmp_path / "s") as s:
        s.save(1, {"x": 1}, meta=meta)
        assert_same(meta, s.meta(1))
        s.save(2, {"x": 1})
        assert s.meta(2) is None


# ---------------------------------------------------------------------------------------------
# models, optimizers, schedulers


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 5 * 5, 8), nn.LayerNorm(8), nn.Dropout(0.1), nn.Linear(8, 3))


def batch(seed: int) -> torch.Tensor:
    return torch.randn(6, 2, 5, 5, generator=torch.Generator().manual_seed(seed))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    for s in range(steps):
        x = batch(seed + s)

        def closure():
            torch.manual_seed(seed + s)  # Dropout: same mask on every replay of this step
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)


def test_module_state_dict(roundtrip, assert_same):
    m = make_model()
    m.train()
    m(batch(0))  # update BatchNorm running stats
    sd = m.state_dict()
    assert hasattr(sd, "_metadata")
    out = roundtrip({"model": sd}, chunk_size=CHUNK)
    assert_same({"model": sd}, out)
    assert type(out["model"]) is OrderedDict
    assert out["model"]["1.num_batches_tracked"].dtype is torch.int64
    m2 = make_model(seed=1)
    m2.load_state_dict(out["model"])
    m.eval()
    m2.eval()
    x = batch(3)
    assert torch.equal(m(x), m2(x))


OPTIMIZERS = {
    "SGD": (torch.optim.SGD, dict(lr=0.1)),
    "SGD_momentum_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True,
                                                    weight_decay=1e-4)),
    "SGD_momentum_dampening": (torch.optim.SGD, dict(lr=0.1, momentum=0.5, dampening=0.1)),
    "Adam": (torch.optim.Adam, dict(lr=1e-3)),
    "Adam_amsgrad": (torch.optim.Adam, dict(lr=1e-3, amsgrad=True, betas=(0.8, 0.95))),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    "RMSprop": (torch.optim.RMSprop, dict(lr=1e-3)),
    "RMSprop_centered_momentum": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.9, centered=True)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
    "Adadelta": (torch.optim.Adadelta, dict()),
    "Adamax": (torch.optim.Adamax, dict()),
    "NAdam": (torch.optim.NAdam, dict()),
    "NAdam_decoupled": (torch.optim.NAdam, dict(decoupled_weight_decay=True, weight_decay=0.01)),
    "RAdam": (torch.optim.RAdam, dict()),
    "ASGD": (torch.optim.ASGD, dict(t0=1)),
    "Rprop": (torch.optim.Rprop, dict()),
    "LBFGS": (torch.optim.LBFGS, dict(lr=0.5, history_size=4, max_iter=4)),
}
if hasattr(torch.optim, "Adafactor"):
    OPTIMIZERS["Adafactor"] = (torch.optim.Adafactor, dict())
if hasattr(torch.optim, "Muon"):
    OPTIMIZERS["Muon"] = None  # needs 2-D params only; handled in its own branch below


def test_every_torch_optimizer_is_covered():
    classes = {obj for name in dir(torch.optim) if isinstance(obj := getattr(torch.optim, name), type)
               and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer}
    covered = {spec[0] for spec in OPTIMIZERS.values() if spec is not None}
    covered |= {getattr(torch.optim, "Muon", None), torch.optim.SparseAdam}
    missing = sorted(c.__name__ for c in classes - covered)
    assert not missing, f"add these optimizers to OPTIMIZERS: {missing}"


def _make_opt(name, model):
    if name == "Muon":
        params = [p for p in model.parameters() if p.dim() == 2]
        return torch.optim.Muon(params, lr=0.02), params
    cls, kw = OPTIMIZERS[name]
    return cls(model.parameters(), **kw), None


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_dict_roundtrip_and_resume(name, roundtrip, assert_same):
    model = make_model()
    opt, _ = _make_opt(name, model)
    train(model, opt, 2, seed=10)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 2}
    out = roundtrip(state, chunk_size=CHUNK)
    assert_same(state, out)  # before training on: the state dict aliases live tensors
    assert len(out["optim"]["state"]) > 0 or name == "SGD"
    assert all(type(k) is int for k in out["optim"]["state"])

    model2 = make_model(seed=99)
    model2.load_state_dict(out["model"])
    opt2, _ = _make_opt(name, model2)
    opt2.load_state_dict(out["optim"])
    train(model, opt, 2, seed=20)
    train(model2, opt2, 2, seed=20)
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), f"{name}: {k} diverged after resuming from the loaded state"


def test_sparse_adam_state_dict(roundtrip, assert_same):
    emb = nn.Embedding(20, 4, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    for s in range(2):
        opt.zero_grad()
        emb(torch.tensor([1, 3, 5 + s])).sum().backward()
        opt.step()
    state = {"emb": emb.state_dict(), "optim": opt.state_dict()}
    out = roundtrip(state)
    assert_same(state, out)
    opt2 = torch.optim.SparseAdam(nn.Embedding(20, 4, sparse=True).parameters(), lr=0.01)
    opt2.load_state_dict(out["optim"])
    assert_same(opt.state_dict(), opt2.state_dict())


def _const(epoch):
    return 0.95 ** epoch


class _Factor:
    """A callable object: LambdaLR stores its __dict__ (plain data) in the state dict."""

    def __init__(self, f):
        self.f = f

    def __call__(self, epoch):
        return self.f ** epoch


SCHEDULERS = {
    "StepLR": lambda o: L.StepLR(o, step_size=2, gamma=0.5),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.9),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=7, eta_min=1e-4),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2),
    "CyclicLR": lambda o: L.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2, mode="exp_range",
                                     gamma=0.9),
    "CyclicLR_triangular2": lambda o: L.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3,
                                                 mode="triangular2"),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=20),
    "OneCycleLR_linear": lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=20,
                                                anneal_strategy="linear", three_phase=True),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.25, total_iters=5),
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.5, total_iters=3),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=8, power=2.0),
    "SequentialLR": lambda o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.5, total_iters=2), L.ExponentialLR(o, gamma=0.9)],
        milestones=[2]),
    "ChainedScheduler": lambda o: L.ChainedScheduler(
        [L.ConstantLR(o, factor=0.5, total_iters=2), L.ExponentialLR(o, gamma=0.9)]),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "LambdaLR_function": lambda o: L.LambdaLR(o, _const),
    "LambdaLR_callable_object": lambda o: L.LambdaLR(o, _Factor(0.9)),
    "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lambda e: 0.97),
    "SWALR": lambda o: torch.optim.swa_utils.SWALR(o, swa_lr=0.05, anneal_epochs=3),
}


def _sched_opt():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return opt


def _sched_step(sched, opt, i):
    opt.step()
    if isinstance(sched, L.ReduceLROnPlateau):
        sched.step(1.0)  # constant metric: plateau, lr drops
    else:
        sched.step()


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_scheduler_state_dict_roundtrip_and_resume(name, roundtrip, assert_same):
    opt = _sched_opt()
    sched = SCHEDULERS[name](opt)
    for i in range(3):
        _sched_step(sched, opt, i)
    state = {"optim": opt.state_dict(), "sched": sched.state_dict()}
    out = roundtrip(state)
    assert_same(state, out)
    opt2 = _sched_opt()
    sched2 = SCHEDULERS[name](opt2)
    opt2.load_state_dict(out["optim"])
    sched2.load_state_dict(out["sched"])
    for i in range(3, 9):
        _sched_step(sched, opt, i)
        _sched_step(sched2, opt2, i)
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups], name
        assert [g.get("momentum") for g in opt.param_groups] == \
            [g.get("momentum") for g in opt2.param_groups], name


def test_multisteplr_state_dict_is_refused_clearly(tmp_path):
    """MultiStepLR keeps its milestones in a collections.Counter, which the format does not hold:
    the save is refused with UnsupportedTypeError naming the path, and nothing is written."""
    opt = _sched_opt()
    sched = L.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
    for i in range(3):
        _sched_step(sched, opt, i)
    sd = sched.state_dict()
    assert type(sd["milestones"]) is collections.Counter
    with ckptstore.open(tmp_path / "s") as s:
        with pytest.raises(UnsupportedTypeError) as ei:
            s.save(1, {"sched": sd})
        assert "state['sched']['milestones']" in str(ei.value)
        assert "Counter" in str(ei.value)
        assert s.iterations() == []
        # the documented workaround: store the Counter as a plain dict
        sd2 = dict(sd, milestones=dict(sd["milestones"]))
        s.save(1, {"sched": sd2})
        sched2 = L.MultiStepLR(_sched_opt(), milestones=[7], gamma=0.5)
        loaded = s.load(1)["sched"]
        loaded["milestones"] = collections.Counter(loaded["milestones"])
        sched2.load_state_dict(loaded)
        assert sched2.milestones == sched.milestones


# ---------------------------------------------------------------------------------------------
# refused objects

class _Custom:
    pass


class _MyTensor(torch.Tensor):
    pass


_Point = collections.namedtuple("_Point", "x y")


def _refused_cases():
    quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    return {
        "set": ({"a": {"b": {1, 2}}}, "state['a']['b']"),
        "frozenset": ({"a": frozenset()}, "state['a']"),
        "custom_object": ({"x": [1, _Custom()]}, "state['x'][1]"),
        "float_key": ({"a": {1.5: 1}}, "state['a']"),
        "bool_key": ({"a": {True: 1}}, "state['a']"),
        "tuple_key": ({(1, 2): 1}, "state"),
        "none_key": ({None: 1}, "state"),
        "numpy_object_array": ({"arr": np.array([1, "a"], dtype=object)}, "state['arr']"),
        "numpy_structured": ({"arr": np.zeros(2, dtype=[("a", "<i4")])}, "state['arr']"),
        "numpy_str_array": ({"arr": np.array(["a"])}, "state['arr']"),
        "numpy_datetime": ({"arr": np.array(["2020-01-01"], dtype="M8[D]")}, "state['arr']"),
        "numpy_scalar": ({"s": [np.float32(1.0)]}, "state['s'][0]"),
        "numpy_float64_scalar": ({"s": np.float64(1.0)}, "state['s']"),
        "numpy_int_scalar": ({"s": np.int64(1)}, "state['s']"),
        "sparse_coo": ({"t": {"w": torch.eye(3).to_sparse()}}, "state['t']['w']"),
        "sparse_csr": ({"t": torch.eye(3).to_sparse_csr()}, "state['t']"),
        "quantized": ({"q": quantized}, "state['q']"),
        "meta_tensor": ({"m": torch.empty(3, device="meta")}, "state['m']"),
        "tensor_subclass": ({"t": torch.zeros(2).as_subclass(_MyTensor)}, "state['t']"),
        "namedtuple": ({"p": _Point(1, 2)}, "state['p']"),
        "bytearray": ({"b": bytearray(b"x")}, "state['b']"),
        "complex_scalar": ({"c": 1j}, "state['c']"),
        "module": ({"m": nn.Linear(1, 1)}, "state['m']"),
        "function": ({"f": print}, "state['f']"),
        "int_subclass": ({"i": _IntSub(3)}, "state['i']"),
        "dict_subclass": ({"d": collections.defaultdict(int)}, "state['d']"),
        "int_key_path": ({3: {"x": object()}}, "state[3]['x']"),
    }


class _IntSub(int):
    pass


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    REFUSED = _refused_cases()
    NP_SUBCLASSES = [np.ma.masked_array([1.0, 2.0], mask=[False, True]), np.matrix([[1, 2]])]


def _segment_sizes(path):
    seg = os.path.join(path, "segments")
    return {n: os.path.getsize(os.path.join(seg, n)) for n in sorted(os.listdir(seg))}


@pytest.fixture
def used_store(tmp_path):
    s = ckptstore.open(tmp_path / "s", chunk_size=CHUNK)
    s.save(1, {"w": torch.randn(3000), "k": 1})
    yield s
    s.close()


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_objects_are_refused_and_nothing_is_written(case, used_store):
    state, where = REFUSED[case]
    state = {"ok_tensor": torch.randn(5000), **state} if type(state) is dict else state
    before = _segment_sizes(used_store.path)
    with pytest.raises(UnsupportedTypeError) as ei:
        used_store.save(2, state)
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, ckptstore.CkptStoreError)
    assert where in str(ei.value), str(ei.value)
    assert used_store.iterations() == [1]
    assert _segment_sizes(used_store.path) == before
    stats = used_store.save(2, {"k": 2})  # still usable
    assert stats.iteration == 2 and used_store.iterations() == [1, 2]
    assert used_store.load(1)["k"] == 1


def test_deep_and_cyclic_structures_refused(used_store):
    deep: list = []
    node = deep
    for _ in range(400):
        node.append([])
        node = node[0]
    with pytest.raises(UnsupportedTypeError, match="deeper"):
        used_store.save(2, {"deep": deep})
    cyc: list = []
    cyc.append(cyc)
    with pytest.raises(UnsupportedTypeError):
        used_store.save(2, {"cyc": cyc})
    assert used_store.iterations() == [1]


def test_bad_meta_refused(used_store):
    with pytest.raises(UnsupportedTypeError, match="meta"):
        used_store.save(2, {"a": 1}, meta={"t": torch.ones(1)})
    with pytest.raises(UnsupportedTypeError):
        used_store.save(2, {"a": 1}, meta=[1, 2])
    with pytest.raises(UnsupportedTypeError):
        used_store.save(2, {"a": 1}, meta={"s": {1}})
    assert used_store.iterations() == [1]


@pytest.mark.parametrize("value", NP_SUBCLASSES, ids=["masked", "matrix"])
def test_numpy_subclasses_refused_or_preserved(value, tmp_path):
    """Regression: ndarray subclasses came back as plain ndarrays (a MaskedArray lost its mask)."""
    with ckptstore.open(tmp_path / "s") as s:
        try:
            s.save(1, {"a": value})
        except UnsupportedTypeError:
            return
        out = s.load(1)["a"]
        assert type(out) is type(value)


# ---------------------------------------------------------------------------------------------
# property tests: state encoding and chunks


class _Leaf:
    def __init__(self, n):
        self.n = n


def _leaf_hook(x, path):
    return x if type(x) is _Leaf else None


scalars = (st.none() | st.booleans() | st.integers(min_value=-2**80, max_value=2**80)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
           | st.binary(max_size=16) | st.integers(0, 5).map(_Leaf))
keys = st.text(max_size=6) | st.integers(-2**70, 2**70)
tree = st.recursive(
    scalars,
    lambda kids: (st.lists(kids, max_size=4) | st.lists(kids, max_size=4).map(tuple)
                  | st.dictionaries(keys, kids, max_size=4)
                  | st.dictionaries(keys, kids, max_size=4).map(OrderedDict)),
    max_leaves=25)


def _same_tree(a, b):
    assert type(a) is type(b)
    if type(a) is _Leaf:
        assert a is b
    elif type(a) is float:
        assert struct.pack("<d", a) == struct.pack("<d", b)  # NaN sign and payload included
    elif type(a) in (dict, OrderedDict):
        assert list(a) == list(b) and [type(k) for k in a] == [type(k) for k in b]
        for k in a:
            _same_tree(a[k], b[k])
    elif type(a) in (list, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_tree(x, y)
    else:
        assert a == b


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree)
def test_property_flatten_unflatten_through_json(obj):
    skeleton, leaves = flatten(obj, _leaf_hook)
    text = json.dumps(skeleton, allow_nan=False, ensure_ascii=True)  # what the manifest stores
    back = unflatten(json.loads(text), lambda i, path: leaves[i])
    _same_tree(obj, back)


@settings(max_examples=60, deadline=None)
@given(tree, st.lists(st.text(max_size=3) | st.integers(), min_size=1, max_size=3))
def test_property_ordered_dict_metadata(obj, mkeys):
    od = OrderedDict(x=obj)
    od._metadata = OrderedDict((str(k), {"version": i}) for i, k in enumerate(mkeys))
    skeleton, leaves = flatten(od, _leaf_hook)
    back = unflatten(json.loads(json.dumps(skeleton)), lambda i, p: leaves[i])
    assert type(back) is OrderedDict and back._metadata == od._metadata
    _same_tree(od, back)


def _check_chunk(raw: bytes) -> fchunk.Codec:
    view = memoryview(raw)
    codec, data = fchunk.choose_encoding(view)
    addr = fchunk.address_of(view)
    payload = fchunk.encode_chunk_header(addr, codec, len(raw)) + bytes(data)
    header, out = fchunk.decode_chunk(payload)
    assert header.address == addr and header.codec is codec and header.raw_length == len(raw)
    assert bytes(out) == raw
    if codec is fchunk.Codec.LZ4:
        assert len(data) <= len(raw) * (1 - fchunk.MIN_SAVING)
    return codec


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000))
def test_property_chunk_random_bytes(raw):
    _check_chunk(raw)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(1, 3000), st.binary(max_size=40))
def test_property_chunk_compressible_bytes(unit, reps, tail):
    raw = unit * reps + tail
    codec = _check_chunk(raw)
    if len(unit) <= 8 and len(raw) >= 1024 and len(tail) < 10:
        assert codec is fchunk.Codec.LZ4


def test_chunk_encoding_policy_examples():
    assert _check_chunk(b"") is fchunk.Codec.RAW
    assert _check_chunk(bytes(255)) is fchunk.Codec.RAW  # below 256 bytes: never compressed
    assert _check_chunk(bytes(100_000)) is fchunk.Codec.LZ4
    assert _check_chunk(os.urandom(100_000)) is fchunk.Codec.RAW
    # the sample spans the chunk: an incompressible head does not hide a compressible rest ...
    assert _check_chunk(os.urandom(64 << 10) + bytes(200_000)) is fchunk.Codec.LZ4
    # ... and where every sampled piece is incompressible the chunk stays raw untried, even when
    # the bytes between the pieces would compress
    n = 400_000
    stride = (n - fchunk.SAMPLE_PIECE) // (fchunk.SAMPLES - 1)
    raw = bytearray(n)
    for i in range(fchunk.SAMPLES):
        raw[i * stride:i * stride + fchunk.SAMPLE_PIECE] = os.urandom(fchunk.SAMPLE_PIECE)
    assert _check_chunk(bytes(raw)) is fchunk.Codec.RAW
