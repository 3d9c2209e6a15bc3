"""The topk codec's selection in C (``topk_select.c``): one pass per gradient, on two threads.

The pure-torch path of :func:`ckptstore.replay.gradcodecs._largest` and ``encode_measured`` makes
about seven passes over a gradient, each allocating (magnitudes, a mask, the nonzero indices,
two sums of squares in Python loops, a max): ~49 ms of the training thread per iteration on the
27M-parameter benchmark model. The kernel keeps exactly the entries the torch path keeps for the
same threshold (the rule is written out in the C file) and measures the error in the same pass,
its sums in float64 (the torch path sums float32 runs in float64; the recorded error is a
measurement, not something a replay reproduces).

:func:`select` returns None whenever it cannot serve a call (no kernel, not float32, too many
entries kept): the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from . import build

#: ranges below this many entries run on one thread
SPLIT_MIN = 1 << 20
#: tensors of this many entries and more are selected on two threads (:func:`select`)
SPLIT_AT = 2 * SPLIT_MIN
_lock = threading.Lock()
_fn: list[Any] = []
_pool: list[ThreadPoolExecutor] = []


def _kernel() -> Any:
    with _lock:
        if not _fn:
            lib = build.load("topk_select")
            fn = kth = None
            if lib is not None and lib.ckpt_topk_abi() == 2:
                fn = lib.ckpt_topk_select
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                kth = lib.ckpt_topk_kth_magnitude
                kth.restype = ctypes.c_float
                kth.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                ctypes.c_void_p]
                _pool.append(ThreadPoolExecutor(2, thread_name_prefix="ckptstore-topk"))
            _fn.extend((fn, kth))
        return _fn[0]


def available() -> bool:
    return _kernel() is not None


def kth_magnitude(flat: torch.Tensor, positions: torch.Tensor, keep: int) -> float | None:
    """The ``keep``-th largest of ``flat[positions].abs()`` (a NaN when that is one: NaN counts
    as the largest), as ``torch.topk(flat[positions].abs(), keep).values[-1]`` gives it, for a
    contiguous float32 CPU ``flat`` and int64 ``positions`` in range (IndexError otherwise);
    None when the kernel is missing. Runs no torch op (so it may run on any thread: see
    gradcodecs.TopKCodec.encode_many)."""
    if _kernel() is None or flat.dtype != torch.float32 or flat.device.type != "cpu" or \
            not flat.is_contiguous() or positions.dtype != torch.int64 or \
            not positions.is_contiguous() or not 1 <= keep <= positions.numel():
        return None
    m = positions.numel()
    at = positions.numpy()
    if int(at.min()) < 0 or int(at.max()) >= flat.numel():  # (numpy: no torch op here)
        raise IndexError(f"sample positions outside a tensor of {flat.numel()} entries")
    keys = np.empty(m, dtype=np.uint32)
    return float(_fn[1](flat.data_ptr(), positions.data_ptr(), m, keep, keys.ctypes.data))


def select(flat: torch.Tensor, threshold: float, cap: int
           ) -> tuple[torch.Tensor, torch.Tensor, float, float, float] | None:
    """(int64 indices, values, sum of squares of all entries, of the dropped ones, largest
    dropped magnitude) for a contiguous float32 CPU ``flat``; None when the kernel is missing or
    more than ``cap`` entries are kept."""
    fn = _kernel()
    if fn is None or flat.dtype != torch.float32 or flat.device.type != "cpu" or \
            not flat.is_contiguous():
        return None
    n = flat.numel()
    parts = 2 if n >= SPLIT_AT else 1
    bounds = [n * p // parts for p in range(parts + 1)]
    idx = torch.empty((parts, cap), dtype=torch.int64)
    vals = torch.empty((parts, cap), dtype=torch.float32)
    stats = torch.zeros((parts, 3), dtype=torch.float64)
    ptr, esz = flat.data_ptr(), flat.element_size()

    def run(p: int) -> int:
        lo, hi = bounds[p], bounds[p + 1]
        return int(fn(ptr + lo * esz, hi - lo, threshold, lo, idx[p].data_ptr(),
                      vals[p].data_ptr(), cap, stats[p].data_ptr()))

    counts = [run(0)] if parts == 1 else list(_pool[0].map(run, range(parts)))
    if sum(counts) > cap:
        return None
    i = torch.cat([idx[p, :c] for p, c in enumerate(counts)])
    v = torch.cat([vals[p, :c] for p, c in enumerate(counts)])
    s = stats.sum(0)
    return i, v, float(s[0]), float(s[1]), float(stats[:, 2].max())
