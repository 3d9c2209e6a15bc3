"""Tiled replay windows of torch.optim.Adam / AdamW steps through the native kernel
(``adam_steps.c``): all of a window's steps on one cache-sized block at a time, in one pass per
step instead of torch's eight elementwise ops, on several threads.

Why it computes torch's bits: the kernel performs, per element, the single-tensor (for-loop)
path's operations in its order with its float32 roundings (adam_steps.c lists them), the same
square root (MKL's ``vmsSqrt`` when this torch build exports it, which is what torch.sqrt calls),
and scalars rounded from the same Python doubles torch computes. Whether that holds on this
machine and torch build is not assumed: before a configuration is used, :func:`_verified` runs
torch's own optimizer and the kernel side by side on calibration tensors (odd sizes, magnitudes
from subnormal to large, zeros), from no state, and compares every bit of the parameters and both
moments, the step count and the state's keys. A configuration that differs anywhere is never
used; the window runs on torch's ops instead.

Only what was verified runs here: Adam or AdamW with float (not tensor) hyperparameters,
``amsgrad``, ``capturable``, ``differentiable`` and ``fused`` off, float32 contiguous CPU
parameters, gradients and moments, at most MAX_STEPS steps. For anything else
:meth:`AdamWindow.run` returns False and changes nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import build

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ckptstore.replay.native")

#: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE: the mode torch's vml wrapper passes to MKL
VML_MODE = 0x00140102
DECOUPLED, WEIGHT_DECAY, MAXIMIZE = 1, 2, 4
#: float32 scalars per step, in the kernel's order (adam_steps.c)
SCALARS = 8
#: most steps per kernel call (CKPT_MAX_STEPS in adam_steps.c, which does nothing past it)
MAX_STEPS = 64
#: kernel calls are split at multiples of this many entries (cache lines of float32)
SPLIT_ALIGN = 64

_lib_lock = threading.Lock()
_kernel: tuple[Any, int | None] | None = None
_verdicts: dict[tuple, int | None | bool] = {}  # configuration -> its sqrt, or False (_verified)
#: windows and steps run by the kernel in this process (for tests and benchmarks)
stats = {"windows": 0, "steps": 0}


def _load() -> tuple[Any, int | None] | None:
    """(kernel function, address of torch's vmsSqrt or None), or None without a kernel."""
    global _kernel
    with _lib_lock:
        if _kernel is None:
            lib = build.load("adam_steps")
            if lib is None or lib.ckpt_adam_abi() != 3:
                _kernel = (None, None)
            else:
                fn = lib.ckpt_adam_steps
                fn.restype = None
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong]
                _kernel = (fn, _torch_vsqrt())
        return None if _kernel[0] is None else _kernel


@functools.lru_cache(maxsize=None)
def _torch_library() -> ctypes.CDLL | None:
    """torch's CPU library (already loaded), where a statically linked MKL exports its C API."""
    import torch

    try:
        return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except OSError:
        return None


def _torch_vsqrt() -> int | None:
    """Address of MKL's ``vmsSqrt`` (what torch.sqrt calls on float32), if torch exports it."""
    fn = getattr(_torch_library(), "vmsSqrt", None)
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


@functools.lru_cache(maxsize=None)
def _mkl_set_threads_local() -> Any:
    """MKL's ``MKL_Set_Num_Threads_Local(int) -> int`` from torch's library, or None."""
    fn = getattr(_torch_library(), "MKL_Set_Num_Threads_Local", None)
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    return fn


def mkl_sequential() -> int | None:
    """Make MKL calls from this thread single-threaded; returns the previous thread-local setting
    (to restore with :func:`mkl_restore`), None without MKL. Why: vmsSqrt called from a thread
    that is not torch's starts an OpenMP team of its own, whose spinning workers then slowed
    every thread's vmsSqrt 15x (measured: 0.6 -> 9.6 ns per entry, 2-core EPYC)."""
    fn = _mkl_set_threads_local()
    return None if fn is None else int(fn(1))


def mkl_restore(previous: int | None) -> None:
    if previous is not None:
        _mkl_set_threads_local()(previous)


def _flags(group: dict, cls_name: str) -> int:
    decoupled = bool(group.get("decoupled_weight_decay", cls_name == "AdamW"))
    return ((DECOUPLED if decoupled else 0) | (WEIGHT_DECAY if group["weight_decay"] != 0 else 0)
            | (MAXIMIZE if group.get("maximize") else 0))


def _eligible_group(group: dict) -> bool:
    if any(group.get(k) for k in ("amsgrad", "capturable", "differentiable", "fused")):
        return False
    betas = group.get("betas")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        return False
    return all(type(x) in (float, int) for x in (group.get("lr"), group.get("eps"),
                                               group.get("weight_decay"), *betas))


def _signature(cls_name: str, group: dict) -> tuple:
    """What selects torch's code path (and so its rounding) for a group's step."""
    return (cls_name, bool(group.get("foreach")), _flags(group, cls_name),
            abs(1 - group["betas"][0]) < 0.5)


def _row(group: dict, step: float) -> list[float]:
    """The kernel's scalars for one step, computed in Python doubles exactly as torch's
    ``_single_tensor_adam`` computes them (the kernel receives them rounded to float32, as torch
    rounds a Python scalar operand of a float32 op)."""
    lr, (beta1, beta2) = group["lr"], group["betas"]
    wd, eps = group["weight_decay"], group["eps"]
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    return [1 - lr * wd, wd, 1 - beta1, beta2, 1 - beta2, bias_correction2 ** 0.5, eps,
            -(lr / bias_correction1)]


def _step_values(step0: "torch.Tensor", k: int) -> tuple[list[float], "torch.Tensor"]:
    """The step counts torch's ``step_t += 1`` produces over ``k`` steps, in the state tensor's
    own dtype, and the final state tensor."""
    t = step0.detach().clone()
    out = []
    for _ in range(k):
        t += 1
        out.append(float(t))
    return out, t


def _new_step() -> "torch.Tensor":
    """A fresh ``step`` state entry, as torch's Adam makes it (capturable and fused off)."""
    import torch
    from torch.optim import optimizer as torch_optimizer

    scalar_dtype = getattr(torch_optimizer, "_get_scalar_dtype", lambda: torch.float32)()
    return torch.tensor(0.0, dtype=scalar_dtype)


def _init_state(st: dict, p: "torch.Tensor") -> None:
    """Fill the empty state ``st`` of ``p`` as torch's Adam does at its first step: ``step``,
    ``exp_avg``, ``exp_avg_sq``, in that order."""
    import torch

    st["step"] = _new_step()
    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class _Grad(ctypes.Structure):
    """adam_steps.c's ckpt_grad: a dense gradient, or a sparse one (positions, values, count)."""

    _fields_ = [("dense", ctypes.c_void_p), ("idx", ctypes.c_void_p), ("vals", ctypes.c_void_p),
                ("count", ctypes.c_int64)]


class _Call:
    """One kernel call: ``len(grads)`` steps over ``n`` entries, sparse positions relative to
    ``origin``. Holds every buffer its pointers refer to, so they outlive the call."""

    __slots__ = ("p", "m", "v", "grads", "origin", "n", "scalars", "flags", "vsqrt", "keep")

    def __init__(self, p: int, m: int, v: int, grads: ctypes.Array, origin: int, n: int,
                 scalars: np.ndarray, flags: int, vsqrt: int | None, keep: tuple) -> None:
        self.p, self.m, self.v, self.grads, self.origin, self.n = p, m, v, grads, origin, n
        self.scalars, self.flags, self.vsqrt, self.keep = scalars, flags, vsqrt, keep

    def split(self, parts: int) -> list["_Call"]:
        """The same work as ``parts`` calls over consecutive ranges (the kernel is elementwise)."""
        if parts <= 1 or self.n < 2 * SPLIT_ALIGN:
            return [self]
        size = -(-self.n // parts // SPLIT_ALIGN) * SPLIT_ALIGN
        out = []
        for a in range(0, self.n, size):
            grads = (_Grad * len(self.grads))(*[
                _Grad(g.dense + 4 * a if g.dense else None, g.idx, g.vals, g.count) for g in self.grads])
            out.append(_Call(self.p + 4 * a, self.m + 4 * a, self.v + 4 * a, grads, self.origin + a,
                             min(size, self.n - a), self.scalars, self.flags, self.vsqrt, self.keep))
        return out

    def __call__(self, fn: Any) -> None:
        fn(self.p, self.m, self.v, ctypes.addressof(self.grads), self.origin, self.n, len(self.grads),
           self.scalars.ctypes.data, self.flags, self.vsqrt, VML_MODE)


class _ParamPlan:
    """One parameter's share of a window: the steps that have its gradient, their float32
    scalars (``SCALARS`` per step), its flags, its square root and its final step count."""

    __slots__ = ("applied", "scalars", "flags", "vsqrt", "final_step")

    def __init__(self, applied: tuple[int, ...], scalars: np.ndarray, flags: int,
                 vsqrt: int | None, final_step: "torch.Tensor") -> None:
        self.applied, self.scalars, self.flags = applied, scalars, flags
        self.vsqrt, self.final_step = vsqrt, final_step


class AdamWindow:
    """Runs tiled windows of one Adam/AdamW optimizer through the kernel. ``make(groups)`` builds
    an optimizer of the same class and defaults (calibration uses it); ``threads``: how many
    threads run kernel calls."""

    def __init__(self, optimizer: "torch.optim.Optimizer", make: Callable[[list], Any],
                 threads: int) -> None:
        self.optimizer = optimizer
        self.cls_name = type(optimizer).__name__
        self.make = make
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckptstore-adam",
                                        initializer=mkl_sequential) if self.threads > 1 else None

    @staticmethod
    def supports(optimizer: "torch.optim.Optimizer") -> bool:
        """Adam or AdamW itself (not a subclass), with native kernels switched on."""
        import torch

        return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and build.enabled()

    def run(self, tiles: list[list[tuple[int, int, int]]], params: list, gis: list[int],
            steps: list[tuple[list[dict], list[Any]]]) -> bool:
        """Apply ``steps`` (as :meth:`ckptstore.replay.parallel.TiledSteps.run` takes them) tile by
        tile. ``tiles``: per tile, its (parameter index, start, stop) slices; ``gis``: each
        parameter's group index. Returns False, having changed nothing, when the kernel may not
        run this window. Lossy slices of tile t+1 are decoded (on this thread, with torch ops)
        while the kernel threads run tile t."""
        plans = self._plan(params, gis, steps)
        if plans is None:
            return False
        loaded = _load()
        assert loaded is not None  # _plan returned plans, so the kernel loaded (_load caches it)
        fn = loaded[0]
        scratch: list[Any] = [None, None]  # two flat buffers for lossy slices, tile t uses t % 2
        pending: list = []
        try:
            self._run_tiles(fn, tiles, params, plans, steps, scratch, pending)
        finally:  # queued calls write through raw pointers: never leave before they are done
            self._wait(pending, raise_first=False)
        state = self.optimizer.state
        for p, plan in zip(params, plans):
            if plan is not None:
                state[p]["step"].copy_(plan.final_step)
        stats["windows"] += 1
        stats["steps"] += len(steps)
        return True

    def _run_tiles(self, fn: Any, tiles: list, params: list, plans: list, steps: list,
                   scratch: list, pending: list) -> None:
        import torch

        for t, tile in enumerate(tiles):
            need = sum((b - a) * len(plans[i].applied) for i, a, b in tile if plans[i] is not None
                       and any(not isinstance(steps[s][1][i], torch.Tensor) for s in plans[i].applied))
            # (an upper bound: sparse slices take no scratch)
            if need and (scratch[t % 2] is None or scratch[t % 2].numel() < need):
                scratch[t % 2] = torch.empty(need, dtype=torch.float32)
            free = [0]
            calls = [self._call(params[i], a, b, plans[i], steps, i, scratch[t % 2], free)
                     for i, a, b in tile if plans[i] is not None]
            self._wait(pending)
            pending.extend(self._submit(fn, calls))
        self._wait(pending)

    def _plan(self, params: list, gis: list[int], steps: list) -> list[_ParamPlan | None] | None:
        """Per parameter, its plan (None: no gradient in this window); None when anything in the
        window is outside what the kernel was verified for."""
        import torch

        loaded = _load()
        if loaded is None:
            return None
        fn, vsqrt = loaded
        if len(steps) > MAX_STEPS:
            return None
        for hyper, grads in steps:
            if not all(_eligible_group(h) for h in hyper):
                return None
            if not all(g is None or not isinstance(g, torch.Tensor) or (
                    g.dtype == torch.float32 and g.is_contiguous() and g.device.type == "cpu")
                    for g in grads):
                return None
        roots: dict[int, int | None] = {}
        for gi in sorted(set(gis)):
            sig = _signature(self.cls_name, steps[0][0][gi])
            if any(_signature(self.cls_name, hyper[gi]) != sig for hyper, _ in steps):
                return None
            root = _verified(fn, vsqrt, sig, self.make, steps[0][0][gi])
            if root is False:
                return None
            roots[gi] = root
        plans: list[_ParamPlan | None] = []
        memo: dict[tuple, _ParamPlan] = {}
        fresh: list[tuple[int, int]] = []  # (first step with a gradient, index): state to create
        state = self.optimizer.state
        step: "torch.Tensor | None"  # a tensor once checked below
        for i, p in enumerate(params):
            st = state.get(p) or {}
            applied = tuple(s for s, (_, grads) in enumerate(steps) if grads[i] is not None)
            if not st:  # torch creates the state at the parameter's first step with a gradient
                if not (p.dtype == torch.float32 and p.is_contiguous() and p.device.type == "cpu"):
                    return None
                step = _new_step()
                if applied:
                    fresh.append((applied[0], i))
            else:
                step = st.get("step")
                if not (p.dtype == torch.float32 and _flat_f32(st.get("exp_avg"), p)
                        and _flat_f32(st.get("exp_avg_sq"), p) and isinstance(step, torch.Tensor)
                        and step.dim() == 0 and step.device.type == "cpu"):
                    return None
            if any(isinstance(steps[s][1][i], torch.Tensor) and steps[s][1][i].numel() != p.numel()
                   for s in applied):
                return None
            if not applied:
                plans.append(None)
                continue
            gi = gis[i]
            key = (gi, float(step), step.dtype, applied)
            if key not in memo:
                values, final = _step_values(step, len(applied))
                rows = [_row(steps[s][0][gi], sv) for s, sv in zip(applied, values)]
                memo[key] = _ParamPlan(applied, np.asarray(rows, dtype=np.float32).reshape(-1),
                                       _flags(steps[applied[0]][0][gi], self.cls_name), roots[gi], final)
            plans.append(memo[key])
        for _, i in sorted(fresh):  # in the order torch's steps would create them
            _init_state(state[params[i]], params[i])
        return plans

    @staticmethod
    def can_start(optimizer: "torch.optim.Optimizer", params: list) -> bool:
        """Whether a window may start before any parameter has state (the first deltas after a
        base taken before the first step): :meth:`supports`, no state at all, float32 contiguous
        CPU parameters and groups of settings the kernel handles. The window creates the state
        as torch's first step would (verified with the rest, see :func:`_verified`)."""
        import torch

        return AdamWindow.supports(optimizer) and not any(optimizer.state.get(p) for p in params) \
            and all(p.dtype == torch.float32 and p.is_contiguous() and p.device.type == "cpu"
                    and p.numel() for p in params) \
            and all(_eligible_group(g) for g in optimizer.param_groups) and _load() is not None

    def _call(self, p: "torch.Tensor", a: int, b: int, plan: _ParamPlan, steps: list, i: int,
              scratch: Any, free: list[int]) -> _Call:
        """The kernel call for entries ``a..b`` of parameter ``i``. Lossy gradient slices are
        decoded into ``scratch`` from offset ``free[0]`` on (advanced past what they use)."""
        import torch

        st = self.optimizer.state[p]
        grads, keep = [], []
        for s in plan.applied:
            g = steps[s][1][i]
            if isinstance(g, torch.Tensor):
                grads.append(_Grad(g.data_ptr() + 4 * a, None, None, 0))
                continue
            sparse = g.sparse
            if sparse is not None and sparse[1].dtype == np.float32:
                idx, vals = sparse
                grads.append(_Grad(None, idx.ctypes.data, vals.ctypes.data, idx.size))
                keep.append(sparse)
                continue
            buf = scratch[free[0]:free[0] + b - a]
            free[0] += b - a
            g.into(a, b, buf)
            grads.append(_Grad(buf.data_ptr(), None, None, 0))
            keep.append(buf)
        return _Call(p.data_ptr() + 4 * a, st["exp_avg"].data_ptr() + 4 * a,
                     st["exp_avg_sq"].data_ptr() + 4 * a, (_Grad * len(grads))(*grads), a, b - a,
                     plan.scalars, plan.flags, plan.vsqrt, tuple(keep))

    def _submit(self, fn: Any, calls: list[_Call]) -> list:
        if self._pool is None:
            previous = mkl_sequential()
            try:
                for c in calls:
                    c(fn)
            finally:
                mkl_restore(previous)
            return []
        return [self._pool.submit(part, fn) for c in calls for part in c.split(self.threads)]

    @staticmethod
    def _wait(pending: list, raise_first: bool = True) -> None:
        """Wait for every queued call; the first failure is raised once all are done."""
        error = None
        for f in pending:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others
                error = error or e
        pending.clear()
        if error is not None and raise_first:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _flat_f32(t: Any, p: "torch.Tensor") -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == p.shape \
        and t.is_contiguous() and t.device.type == "cpu"


#: calibration tensor sizes: a lone entry, scalar tails, a vector body, one split across threads
CALIBRATION_SIZES = (1, 37, 4099, 70001)
#: calibration steps, from no state (the first ones create it, with extreme bias corrections)
CALIBRATION_STEPS = 5


def _verified(fn: Any, vsqrt: int | None, sig: tuple, make: Callable[[list], Any],
              group: dict) -> int | None | bool:
    """For configuration ``sig``: the square root with which the kernel reproduces torch's
    steps bit for bit on this machine (torch's vmsSqrt address, or None for sqrtf), or False
    when neither does. Decided once per process and configuration, on calibration tensors stepped
    by ``make``'s optimizer with ``group``'s settings: CALIBRATION_STEPS steps from no state, the
    learning rate changing every step, against the state :func:`_init_state` creates and the
    kernel's steps. Compared: every bit of parameters and moments, the step count (value and
    dtype) and the state's key order."""
    with _lib_lock:
        if sig in _verdicts:
            return _verdicts[sig]
    import torch

    gen = torch.Generator().manual_seed(20261121)

    silent = {n: torch.rand(n, generator=gen) < 0.1 for n in CALIBRATION_SIZES}

    def grad(n: int) -> torch.Tensor:
        # magnitudes from 1e-25 (squares that underflow to zero or subnormals) to 1e2; a tenth of
        # the entries never has a gradient (zero moments), a few more miss one now and then
        scale = torch.pow(10.0, torch.empty(n).uniform_(-25, 2, generator=gen))
        g = torch.randn(n, generator=gen) * scale
        return g.masked_fill_(silent[n] | (torch.rand(n, generator=gen) < 0.05), 0.0)

    settings = {k: v for k, v in group.items() if k != "params"}
    initial = [torch.randn(n, generator=gen) for n in CALIBRATION_SIZES]
    live = [p.clone() for p in initial]
    opt = make([dict(settings, params=live)])
    hypers = []
    grads = [[grad(n) for n in CALIBRATION_SIZES] for _ in range(CALIBRATION_STEPS)]
    for s in range(CALIBRATION_STEPS):  # from no state: the first steps create it
        opt.param_groups[0]["lr"] = settings["lr"] * (1 + 0.25 * s)
        hypers.append(dict(opt.param_groups[0]))
        for p, g in zip(live, grads[s]):
            p.grad = g
        opt.step()
    verdict: int | None | bool = False
    st: dict[str, Any]  # the kernel's state of one calibration tensor
    for root in ([vsqrt] if vsqrt is not None else []) + [None]:
        same = True
        for p0, p, gs in zip(initial, live, zip(*grads)):
            P, st = p0.clone(), {}
            _init_state(st, P)
            values, final = _step_values(st["step"], CALIBRATION_STEPS)
            scalars = np.asarray([_row(h, sv) for h, sv in zip(hypers, values)], dtype=np.float32)
            dense = (_Grad * CALIBRATION_STEPS)(*[_Grad(x.data_ptr(), None, None, 0) for x in gs])
            _Call(P.data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(), dense, 0,
                  P.numel(), scalars.reshape(-1), _flags(hypers[0], sig[0]), root, ())(fn)
            st["step"] = final
            ref = opt.state[p]
            same = same and list(st) == list(ref) and final.dtype == ref["step"].dtype \
                and float(final) == float(ref["step"]) \
                and all(torch.equal(x.view(torch.int32), y.view(torch.int32))
                        for x, y in ((P, p), (st["exp_avg"], ref["exp_avg"]),
                                     (st["exp_avg_sq"], ref["exp_avg_sq"])))
        if same:
            verdict = root
            break
    if verdict is False:
        log.info("native Adam kernel does not match torch for %s: replay keeps torch's ops", sig)
    with _lib_lock:
        _verdicts[sig] = verdict
    return verdict
