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
            if lib is not None and lib.ckpt_topk_abi() == 3:
                fn = lib.ckpt_topk_select
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p]
                kth = lib.ckpt_topk_kth_magnitude
                kth.restype = ctypes.c_int
                kth.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
                _pool.append(ThreadPoolExecutor(2, thread_name_prefix="ckptstore-topk"))
            _fn.extend((fn, kth))
        return _fn[0]


def available() -> bool:
    return _kernel() is not None


def kth_magnitude(flat: torch.Tensor, positions: torch.Tensor, keep: int) -> float | None:
    """The ``keep``-th largest of ``flat[positions].abs()`` (a NaN when that is one: NaN counts
    as the largest), as ``torch.topk(flat[positions].abs(), keep).values[-1]`` gives it, for a
    contiguous float32 CPU ``flat`` and int64 ``positions`` in range (IndexError otherwise,
    found by the kernel as it gathers); None when the kernel is missing. Runs no torch op (so
    it may run on any thread: see gradcodecs.TopKCodec.encode_many)."""
    if _kernel() is None or flat.dtype != torch.float32 or flat.device.type != "cpu" or \
            not flat.is_contiguous() or positions.dtype != torch.int64 or \
            positions.device.type != "cpu" or not positions.is_contiguous() or \
            not 1 <= keep <= positions.numel():
        return None
    m = positions.numel()
    keys = np.empty(m + 1, dtype=np.uint32)  # the last slot receives the answer's bits
    answer = keys[m:].view(np.float32)
    status = _fn[1](flat.data_ptr(), flat.numel(), positions.data_ptr(), m, keep,
                    keys.ctypes.data, answer.ctypes.data)
    if status == -2:
        raise IndexError(f"sample positions outside a tensor of {flat.numel()} entries")
    assert status == 0, status  # keep was checked above
    return float(answer[0])


def select(flat: torch.Tensor, threshold: float, cap: int, index_dtype: torch.dtype = torch.int64,
           split: bool = True) -> tuple[torch.Tensor, torch.Tensor, float, float, float] | None:
    """(indices of ``index_dtype``, int32 or int64; values; sum of squares of all entries, of
    the dropped ones; largest dropped magnitude) for a contiguous float32 CPU ``flat``; None when
    the kernel is missing or more than ``cap`` entries are kept. The indices and values are
    views of the front of buffers sized for ``cap`` per part (no copy to trim them).
    ``split``: a tensor of SPLIT_AT entries or more is scanned in two halves on two threads
    (else on the calling thread alone, e.g. a pool's worker)."""
    fn = _kernel()
    if fn is None or flat.dtype != torch.float32 or flat.device.type != "cpu" or \
            not flat.is_contiguous() or index_dtype not in (torch.int32, torch.int64):
        return None
    n = flat.numel()
    if index_dtype == torch.int32 and n > 2**31:
        raise ValueError(f"int32 indices cannot address {n} entries")
    parts = 2 if split and n >= SPLIT_AT else 1
    # halves split at a multiple of the kernel's float runs (FLUSH = 512 entries): the same
    # runs as one scan, so split and whole sums differ only in the order doubles add up
    bounds = [0, n // 2 // 512 * 512, n] if parts == 2 else [0, n]
    idx = torch.empty(parts * cap, dtype=index_dtype)
    vals = torch.empty(parts * cap, dtype=torch.float32)
    stats = np.zeros((parts, 3), dtype=np.float64)
    ptr, esz = flat.data_ptr(), flat.element_size()
    isz = idx.element_size()

    def run(p: int) -> int:
        lo, hi = bounds[p], bounds[p + 1]
        return int(fn(ptr + lo * esz, hi - lo, threshold, lo, idx.data_ptr() + p * cap * isz, isz,
                      vals.data_ptr() + p * cap * 4, cap, stats[p].ctypes.data))

    counts = [run(0)] if parts == 1 else list(_pool[0].map(run, range(parts)))
    total = sum(counts)
    if total > cap:
        return None
    if parts == 2 and counts[0] < cap and counts[1]:
        # the second part's entries move down to follow the first's (regions may overlap)
        ctypes.memmove(idx.data_ptr() + counts[0] * isz, idx.data_ptr() + cap * isz, counts[1] * isz)
        ctypes.memmove(vals.data_ptr() + counts[0] * 4, vals.data_ptr() + cap * 4, counts[1] * 4)
    return (idx[:total], vals[:total], float(stats[:, 0].sum()), float(stats[:, 1].sum()),
            float(stats[:, 2].max()))
