"""The topk codec's selection in C (``topk_select.c``): one pass per gradient, many on a few threads.

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
            fn = kth = run = None
            if lib is not None and lib.ckpt_topk_abi() == 4:
                fn = lib.ckpt_topk_select
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p]
                kth = lib.ckpt_topk_kth_magnitude
                kth.restype = ctypes.c_int
                kth.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
                run = lib.ckpt_topk_run
                run.restype = None
                run.argtypes = [ctypes.c_void_p, ctypes.c_int64]
                _pool.append(ThreadPoolExecutor(2, thread_name_prefix="ckptstore-topk"))
            _fn.extend((fn, kth, run))
        return _fn[0]


class _Job(ctypes.Structure):
    """``ckpt_topk_job`` of topk_select.c, field for field."""
    _fields_ = [("x", ctypes.c_void_p), ("n", ctypes.c_int64), ("pos", ctypes.c_void_p),
                ("m", ctypes.c_int64), ("keep", ctypes.c_int64), ("idx", ctypes.c_void_p),
                ("vals", ctypes.c_void_p), ("cap", ctypes.c_int64), ("keys", ctypes.c_void_p),
                ("idx_bytes", ctypes.c_int32), ("status", ctypes.c_int32),
                ("kept", ctypes.c_int64), ("stats", ctypes.c_double * 3),
                ("threshold", ctypes.c_float)]


class SelectionBatch:
    """The selections of many gradients, each whole on one thread: the sampled threshold and the
    pass of :func:`select`, or exactly k entries, in one C call per share of the batch
    (:meth:`run`, which runs no torch op and releases the GIL, so shares run concurrently on any
    threads), read back with :meth:`result`. Built on the caller's thread; every gradient must
    stay unchanged until the shares have run.

    ``flats``: contiguous float32 CPU tensors; ``positions``: each one's int64 sample positions,
    or None to keep exactly ``keeps`` of its entries (ckpt_topk_exact's rule: the largest
    magnitudes, ties at the k-th in increasing index order); ``keeps``: the rank of its
    threshold in the sample (or that k); ``caps``: the most entries it may keep;
    ``index_dtypes``: int32 or int64 per gradient. The kept entries of all gradients lie in two
    buffers (indices of one dtype share one), each gradient's at its own offset: results are
    views of them."""

    def __init__(self, flats: list[torch.Tensor], positions: list[torch.Tensor | None],
                 keeps: list[int], caps: list[int], index_dtypes: list[torch.dtype],
                 shares: int) -> None:
        if _kernel() is None:
            raise RuntimeError("the topk kernel is not available")
        count = len(flats)
        for j, (flat, pos, dt) in enumerate(zip(flats, positions, index_dtypes)):
            if flat.dtype != torch.float32 or flat.device.type != "cpu" or \
                    not flat.is_contiguous() or dt not in (torch.int32, torch.int64) or \
                    pos is not None and (pos.dtype != torch.int64 or pos.device.type != "cpu" or
                                         not pos.is_contiguous()):
                raise ValueError(f"gradient {j}: not a contiguous float32 CPU tensor with int64 "
                                 "CPU positions and an int32/int64 index dtype")
            if pos is None and caps[j] < keeps[j]:
                raise ValueError(f"gradient {j}: cap {caps[j]} below the {keeps[j]} it keeps")
            if dt == torch.int32 and flat.numel() > 2**31:
                raise ValueError(f"int32 indices cannot address {flat.numel()} entries")
        self._keep_alive = (flats, positions)
        index = {dt: torch.empty(max(1, sum(c for c, d in zip(caps, index_dtypes) if d == dt)),
                                 dtype=dt) for dt in set(index_dtypes)}
        values = torch.empty(max(1, sum(caps)), dtype=torch.float32)
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        next_index = dict.fromkeys(index, 0)
        next_value = 0
        for cap, dt in zip(caps, index_dtypes):
            self._views.append((index[dt][next_index[dt]:next_index[dt] + cap],
                                values[next_value:next_value + cap]))
            next_index[dt] += cap
            next_value += cap
        # largest first, each to the share with the least work so far (LPT scheduling)
        loads = [0] * max(1, shares)
        members: list[list[int]] = [[] for _ in loads]
        for j in sorted(range(count), key=lambda j: -flats[j].numel()):
            w = loads.index(min(loads))
            members[w].append(j)
            loads[w] += flats[j].numel()
        self._arrays: list[Any] = []
        self._keys: list[np.ndarray] = []
        self._where: list[tuple[int, int]] = [(0, 0)] * count
        for m in (m for m in members if m):
            array = (_Job * len(m))()
            keys = np.empty(max(flats[j].numel() if positions[j] is None else
                                positions[j].numel() for j in m), dtype=np.uint32)  # type: ignore[union-attr]
            for a, j in enumerate(m):
                idx, vals = self._views[j]
                job = array[a]
                job.x, job.n = flats[j].data_ptr(), flats[j].numel()
                pos = positions[j]
                job.pos, job.m, job.keep = (None, flats[j].numel(), keeps[j]) if pos is None else \
                    (pos.data_ptr(), pos.numel(), keeps[j])
                job.idx, job.vals, job.cap = idx.data_ptr(), vals.data_ptr(), caps[j]
                job.keys, job.idx_bytes = keys.ctypes.data, idx.element_size()
                self._where[j] = (len(self._arrays), a)
            self._arrays.append(array)
            self._keys.append(keys)

    @property
    def shares(self) -> int:
        return len(self._arrays)

    def run(self, share: int) -> None:
        """Run share ``share`` (0 <= share < :attr:`shares`) on the calling thread."""
        array = self._arrays[share]
        _fn[2](ctypes.addressof(array), len(array))

    def result(self, j: int) -> tuple[torch.Tensor, torch.Tensor, float, float, float] | None:
        """What :func:`select` gives gradient ``j`` for its sampled threshold (its pass on one
        thread: the sums of a tensor :func:`select` splits add up in another order), after its
        share ran: None when it kept more than its cap. IndexError for sample positions
        out of range, ValueError for a keep outside [1, its sample size]."""
        share, a = self._where[j]
        job = self._arrays[share][a]
        if job.status == -2:
            raise IndexError(f"sample positions outside a tensor of {job.n} entries")
        if job.status != 0:
            raise ValueError(f"gradient {j}: keep {job.keep} outside [1, {job.m}]")
        assert job.kept >= 0
        if job.kept > job.cap:
            return None
        idx, vals = self._views[j]
        return (idx[:job.kept], vals[:job.kept], float(job.stats[0]), float(job.stats[1]),
                float(job.stats[2]))


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


def select(flat: torch.Tensor, threshold: float, cap: int, index_dtype: torch.dtype = torch.int64
           ) -> tuple[torch.Tensor, torch.Tensor, float, float, float] | None:
    """(indices of ``index_dtype``, int32 or int64; values; sum of squares of all entries, of
    the dropped ones; largest dropped magnitude) for a contiguous float32 CPU ``flat``; None when
    the kernel is missing or more than ``cap`` entries are kept. The indices and values are
    views of the front of buffers sized for ``cap`` per part (no copy to trim them). A tensor
    of SPLIT_AT entries or more is scanned in two halves on two threads."""
    fn = _kernel()
    if fn is None or flat.dtype != torch.float32 or flat.device.type != "cpu" or \
            not flat.is_contiguous() or index_dtype not in (torch.int32, torch.int64):
        return None
    n = flat.numel()
    if index_dtype == torch.int32 and n > 2**31:
        raise ValueError(f"int32 indices cannot address {n} entries")
    parts = 2 if n >= SPLIT_AT else 1
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
