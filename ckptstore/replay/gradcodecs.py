"""Gradient codecs for delta records (format-spec/deltas.md, "Gradient payloads").

A codec turns one gradient tensor into a *payload* (a small dict of tensors and numbers stored in
the delta record through the ordinary state encoding) and back. ``exact`` stores the gradient
bytes unchanged; the others are lossy and every payload they produce is marked so in the record,
together with the error measured at encode time.

    exact        {"g": grad}                                   bit-exact
    bf16 / fp16  {"g": grad cast to bfloat16 / float16}        lossy (round to nearest)
    topk:F       {"i": int32/int64 flat indices, "v": values}  lossy: keeps about k = max(1,
                                                               ceil(F*n)) entries of largest
                                                               magnitude (exactly k up to 2^16)
    int8         {"q": int8 codes, "s": float32 scale per      lossy: |error| <= scale/2 per entry
                  chunk of 1024 entries}
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .native import topk as native_topk

INT8_CHUNK = 1024


@dataclass(frozen=True)
class EncodeStats:
    max_abs_error: float
    l2_error: float
    l2_grad: float


class GradCodec:
    name = "exact"
    lossy = False

    def encode(self, g: torch.Tensor) -> dict:
        return {"g": g.detach()}

    def decode(self, payload: dict, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        g = payload["g"]
        if tuple(g.shape) != tuple(shape) or g.dtype != dtype:
            raise ValueError(f"exact gradient payload is {g.dtype}{list(g.shape)}, expected "
                             f"{dtype}{list(shape)}")
        return g

    def decode_into(self, payload: dict, out: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` into an existing contiguous tensor of the gradient's shape and dtype
        (the same values; no allocation where the codec allows). Returns the gradient, which is
        ``out`` unless the payload already holds it (exact)."""
        return self.decode(payload, tuple(out.shape), out.dtype)

    def slicer(self, payload: dict, out_like: torch.Tensor) -> "GradSlices | None":
        """A checked view of ``payload`` that decodes any 1-d range of the flat gradient on its own
        (what :meth:`decode_into` would put there), or None when this codec or payload cannot."""
        return None

    def encode_measured(self, g: torch.Tensor, decoded: bool = True
                        ) -> tuple[dict, torch.Tensor | None, EncodeStats | None]:
        """Encode, and for lossy codecs also decode and measure the error. Returns
        (payload, decoded or None, stats or None); ``decoded=False``: the caller does not need
        the decoded gradient (a codec may then skip making it)."""
        payload = self.encode(g)
        if not self.lossy:
            return payload, None, None
        dec = self.decode(payload, tuple(g.shape), g.dtype)
        err = (dec.double() - g.detach().double())
        stats = EncodeStats(float(err.abs().max()) if err.numel() else 0.0,
                            float(err.norm()), float(g.detach().double().norm()))
        return payload, dec, stats

    def encode_many(self, grads: "list[torch.Tensor | None]", decoded: bool = True
                    ) -> "list[tuple[dict, torch.Tensor | None, EncodeStats | None] | None]":
        """:meth:`encode_measured` of every gradient, in order (None for a None gradient). Each
        result depends on its own gradient only, so a codec may compute them concurrently; the
        results are the same either way. Here: one after another."""
        return [None if g is None else self.encode_measured(g, decoded) for g in grads]


class GradSlices:
    """Decodes ranges ``[a, b)`` of one flat gradient into caller-provided 1-d buffers.
    Invariant: ``into(a, b, out)`` writes exactly what a whole decode holds at ``a..b``."""

    def __init__(self, fill: "Callable[[int, int, torch.Tensor], object]",  # result ignored
                 sparse: "tuple[np.ndarray, np.ndarray] | None" = None) -> None:
        self._fill = fill
        #: for sparse payloads: (positions: int64, strictly increasing, in range; values: the
        #: output dtype), zero elsewhere, so a consumer may skip the dense decode
        self.sparse = sparse

    def into(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        self._fill(a, b, out)
        return out


class CastCodec(GradCodec):
    lossy = True

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype

    def encode(self, g: torch.Tensor) -> dict:
        return {"g": g.detach().to(self.dtype)}

    def decode(self, payload: dict, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        g = payload["g"]
        if tuple(g.shape) != tuple(shape):
            raise ValueError("cast gradient payload has the wrong shape")
        return g.to(dtype)

    def decode_into(self, payload: dict, out: torch.Tensor) -> torch.Tensor:
        g = payload["g"]
        if tuple(g.shape) != tuple(out.shape):
            raise ValueError("cast gradient payload has the wrong shape")
        return out.copy_(g)

    def slicer(self, payload: dict, out_like: torch.Tensor) -> GradSlices | None:
        g = payload["g"]
        if tuple(g.shape) != tuple(out_like.shape):
            raise ValueError("cast gradient payload has the wrong shape")
        flat = g.reshape(-1)
        return GradSlices(lambda a, b, out: out.copy_(flat[a:b]))


#: below this many entries ``topk`` selects exactly k (torch.topk); above, by a sampled threshold
EXACT_TOPK_MAX = 1 << 16
#: torch's grain size (at::internal::GRAIN_SIZE): an elementwise op on at most this many entries
#: runs on its calling thread
SERIAL_MAX = 1 << 15
#: the most entries sampled to estimate the threshold
TOPK_SAMPLE = 1 << 16
#: the fewest entries sampled
TOPK_SAMPLE_MIN = 1 << 14
#: sampled entries expected above the threshold: the count kept then lands within about
#: 1/sqrt(128) ~ 9% of k (one standard deviation), far inside the [k/2, 2k] it must
TOPK_SAMPLE_ABOVE = 128


def sample_size(n: int, k: int) -> int:
    """How many of a tensor's ``n`` entries are sampled to find the threshold of its ``k``
    largest: the smallest power of two in [TOPK_SAMPLE_MIN, TOPK_SAMPLE] expected to hold
    TOPK_SAMPLE_ABOVE entries above it (2^14 for topk:0.01). Every sample is a pass over the
    tensor's memory as far as the cache is concerned (2^16 samples touched every cache line of a
    1M-entry gradient), so no larger than the estimate needs."""
    want = -(-TOPK_SAMPLE_ABOVE * n // max(1, k))
    return min(TOPK_SAMPLE, max(TOPK_SAMPLE_MIN, 1 << (want - 1).bit_length()))


@functools.lru_cache(maxsize=32)
def _sample_positions(n: int, m: int = TOPK_SAMPLE) -> torch.Tensor:
    """The ``m`` fixed-seed sample positions for a tensor of ``n`` entries, in increasing order
    (the same on every call: cached, since a model's few distinct tensor sizes repeat every
    iteration)."""
    gen = torch.Generator().manual_seed(n)
    # sorted: the same sample, gathered front to back (prefetched, not a cache miss per entry)
    return torch.randint(0, n, (m,), generator=gen).sort().values


def _sample_rank(m: int, k: int, n: int) -> int:
    """The rank in a sample of ``m`` of ``n`` entries whose magnitude is the threshold of the
    ``k`` largest."""
    return max(1, round(m * k / n))


def _sampled_threshold(values: torch.Tensor, k: int,
                       positions: torch.Tensor | None = None) -> torch.Tensor:
    """The magnitude above which about ``k`` of the flat ``values`` lie, from a fixed-seed
    sample (``values`` may be the magnitudes or the signed values: the sample's magnitudes are
    the same; ``positions``: its :func:`_sample_positions` (:func:`sample_size` of them), when
    the caller has them):
    the sample's ``keep``-th largest magnitude, NaN counted as the largest (what
    ``torch.topk(sample, keep).values[-1]`` gives). For float32 where the C kernel is built, a
    radix select in C (no torch op: see :meth:`TopKCodec.encode_many`; numpy's partition took
    5 ms on a mostly-zero sample); else a partial top-``keep`` in torch."""
    n = values.numel()
    if positions is None:
        positions = _sample_positions(n, sample_size(n, k))
    keep = _sample_rank(positions.numel(), k, n)
    native = native_topk.kth_magnitude(values, positions, keep)
    if native is not None:
        return torch.tensor(native, dtype=values.dtype)
    sample = values[positions].abs()
    return torch.topk(sample, keep, sorted=True).values[-1]


def _largest(mags: torch.Tensor, k: int) -> torch.Tensor:
    """Strictly increasing flat indices of about ``k`` entries of largest magnitude ``mags``: all
    entries at or above a threshold, so every chosen magnitude is >= every dropped one.

    Exactly k (:func:`_exactly_k`) for small tensors, and whenever the sampled threshold
    misses (fewer than k/2 or more than 2k chosen: ties, e.g. mostly zeros). Else the threshold
    is the matching quantile of a fixed-seed random sample: one pass instead of a selection over
    every entry (27M entries: ~80 ms against ~550 ms on 2 cores). The sample uses its own
    generator, never the global RNG, so training's random stream is untouched."""
    n = mags.numel()
    if n > EXACT_TOPK_MAX and k < n // 2:
        threshold = _sampled_threshold(mags, k)
        # "not below" rather than ">=": NaN entries are kept, as torch.topk keeps them
        below = mags < threshold if bool(threshold > 0) else mags <= 0
        chosen = below.logical_not_().nonzero().squeeze(1)
        if k // 2 <= chosen.numel() <= 2 * k:
            return chosen
    return _exactly_k(mags, k)


#: the signed integer type of each float type's width: a magnitude's bits as an order key
_KEY_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _exactly_k(mags: torch.Tensor, k: int) -> torch.Tensor:
    """Strictly increasing flat indices of exactly ``k`` (1 <= k <= numel) entries of largest
    magnitude ``mags`` (non-negative, ``abs()`` of a float tensor): every entry above the k-th
    largest, then entries equal to it in increasing index order, NaN the largest (as torch.topk
    orders it). Compared by bits: a magnitude's bits, its sign clear, order as it does, NaN above
    +inf, so ties are bit-equal entries and the rule is the C kernel's (ckpt_topk_exact)."""
    keys = mags.view(_KEY_DTYPES[mags.element_size()])
    kth = torch.topk(keys, k, sorted=True).values[-1]
    above = (keys > kth).nonzero().squeeze(1)
    ties = (keys == kth).nonzero().squeeze(1)[:k - above.numel()]
    return torch.cat([above, ties]).sort().values


#: entries per float32 partial sum in :func:`sum_of_squares`
SQUARES_CHUNK = 1 << 16
#: a float32 run's sum of squares outside this range may have overflowed (inf) or lost precision
#: to subnormal squares (every square below 1e-30 only if the sum is): recomputed in float64
SQUARES_SAFE = (1e-30, 1e30)


def sum_of_squares(t: torch.Tensor) -> float:
    """Sum of squares of a floating-point tensor's entries: float32 dot products over runs of
    SQUARES_CHUNK entries, summed in float64 (within 1e-6 of a float64 sum, at a float32 pass's
    cost; a float32 sum of 27M squares was 0.16% off, a float64 copy 15x slower)."""
    flat = t.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()  # half types: a float32 copy (no half dot kernel on every CPU build)
    total = []
    for c in flat.split(SQUARES_CHUNK):
        sq = float(c.dot(c))
        if flat.dtype == torch.float32 and not SQUARES_SAFE[0] <= sq <= SQUARES_SAFE[1]:
            # squares that overflow or fall into subnormals in float32: this run in float64
            sq = float(c.double().square().sum())
        total.append(sq)
    return math.fsum(total)


_encode_pool_lock = threading.Lock()
_encode_pools: dict[int, ThreadPoolExecutor] = {}


def _encode_pool(workers: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads for concurrent encodes (one per size, made once)."""
    with _encode_pool_lock:
        pool = _encode_pools.get(workers)
        if pool is None:
            pool = _encode_pools[workers] = ThreadPoolExecutor(
                workers, thread_name_prefix="ckptstore-encode")
        return pool


class TopKCodec(GradCodec):
    lossy = True

    def __init__(self, fraction: float) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"topk fraction must be in (0, 1], not {fraction}")
        self.fraction = fraction
        self.name = f"topk:{fraction:g}"

    def encode(self, g: torch.Tensor) -> dict:
        flat = g.detach().reshape(-1)
        n = flat.numel()
        if n == 0:
            return {"i": torch.zeros(0, dtype=torch.int32), "v": flat.clone()}
        return self._payload(flat, flat.abs())

    def _payload(self, flat: torch.Tensor, mags: torch.Tensor) -> dict:
        """The payload of a non-empty flat gradient whose magnitudes are ``mags``."""
        n = flat.numel()
        idx = _largest(mags, max(1, math.ceil(self.fraction * n)))
        return {"i": idx.to(torch.int32 if n < 2**31 else torch.int64), "v": flat[idx]}

    def encode_measured(self, g: torch.Tensor, decoded: bool = True
                        ) -> tuple[dict, torch.Tensor | None, EncodeStats | None]:
        """What the generic path measures, without its float64 copies: the decode is exact at
        the kept entries and zero elsewhere, so the error is the dropped entries themselves."""
        flat = g.detach().reshape(-1)
        n = flat.numel()
        if n == 0 or not flat.is_floating_point():
            return super().encode_measured(g, decoded)
        fast = self._selected_natively(flat)
        if fast is not None:
            dec = self.decode(fast[0], tuple(g.shape), g.dtype) if decoded else None
            return fast[0], dec, fast[1]
        mags = flat.abs()
        payload = self._payload(flat, mags)
        grad_sq = sum_of_squares(flat)
        mags[payload["i"].to(torch.int64)] = 0  # now the dropped entries only
        stats = EncodeStats(float(mags.max()), math.sqrt(sum_of_squares(mags)), math.sqrt(grad_sq))
        dec = self.decode(payload, tuple(g.shape), g.dtype) if decoded else None
        return payload, dec, stats

    def encode_many(self, grads: "list[torch.Tensor | None]", decoded: bool = True
                    ) -> "list[tuple[dict, torch.Tensor | None, EncodeStats | None] | None]":
        """:meth:`encode_measured` of every gradient, in order. The C kernel's selections
        (contiguous float32 CPU gradients it serves, :meth:`_native_mode`) run whole, each on
        one thread, on a pool of ``torch.get_num_threads()`` threads, largest first. Of the
        rest, gradients whose torch ops may go parallel (more than SERIAL_MAX entries) run on
        the caller's thread before the pool starts (beside the pool they would make more
        threads than cores); smaller ones run there while the pool works (their ops stay on the
        calling thread); the decodes and any selection the kernel gave back (a threshold that
        missed) run there afterwards. Each pool thread makes one kernel call for its share
        (:class:`native_topk.SelectionBatch`), which releases the GIL; one selection at a time
        left every core but one idle (27.3M parameters on 2 cores: 39 ms of the training thread
        per step, 8 now). Pool threads run no torch op large enough to go parallel: a torch
        parallel region on another thread starts an OpenMP team of its own, whose threads slowed
        every later parallel region of training (optimizer steps 6-10 ms slower for good,
        measured). Each result is what :meth:`encode_measured` gives for that gradient alone (the
        error norms to within float64 rounding: alone, a gradient of ``native_topk.SPLIT_AT``
        entries or more is scanned in two halves whose sums add up in another order)."""
        workers = torch.get_num_threads()

        # (index, flat gradient, how the kernel serves it) of every gradient it serves whole
        jobs = [(i, g.detach().reshape(-1), mode) for i, g in enumerate(grads)
                if g is not None and g.is_cpu and g.is_contiguous()
                and (mode := self._native_mode(g)) is not None]
        if workers < 2 or len(jobs) < 2:
            return super().encode_many(grads, decoded)
        out: list = [None] * len(grads)
        in_pool = {i for i, _, _ in jobs}
        rest = [i for i, g in enumerate(grads) if g is not None and i not in in_pool]
        for i in rest:
            if grads[i].numel() > SERIAL_MAX:  # type: ignore[union-attr]
                out[i] = self.encode_measured(grads[i], decoded)  # type: ignore[arg-type]
        # the sample positions are made here (torch ops) and handed over
        ks = [max(1, math.ceil(self.fraction * flat.numel())) for _, flat, _ in jobs]
        positions = [self._positions(flat.numel()) if mode == "sampled" else None
                     for _, flat, mode in jobs]
        batch = native_topk.SelectionBatch(
            [flat for _, flat, _ in jobs], positions,
            [k if p is None else _sample_rank(p.numel(), k, flat.numel())
             for p, k, (_, flat, _) in zip(positions, ks, jobs)],
            [k if p is None else 2 * k for p, k in zip(positions, ks)],
            [torch.int32 if flat.numel() < 2**31 else torch.int64 for _, flat, _ in jobs], workers)
        pool = _encode_pool(workers)
        futures = [pool.submit(batch.run, share) for share in range(batch.shares)]
        try:
            for i in rest:
                if out[i] is None:
                    out[i] = self.encode_measured(grads[i], decoded)  # type: ignore[arg-type]
        finally:
            concurrent.futures.wait(futures)  # none left reading a gradient
        for f in futures:
            f.result()
        for j, ((i, _, _), k) in enumerate(zip(jobs, ks)):
            g = grads[i]
            assert g is not None
            got = batch.result(j)
            if got is None or not k // 2 <= got[0].numel():  # the threshold missed: torch path
                out[i] = self.encode_measured(g, decoded)
                continue
            idx, vals, all_sq, dropped_sq, dropped_max = got
            payload = {"i": idx, "v": vals}
            dec = self.decode(payload, tuple(g.shape), g.dtype) if decoded else None
            out[i] = (payload, dec,
                      EncodeStats(dropped_max, math.sqrt(dropped_sq), math.sqrt(all_sq)))
        return out

    def _positions(self, n: int) -> torch.Tensor:
        """The sample positions of a tensor of ``n`` entries (:func:`sample_size` of its k)."""
        return _sample_positions(n, sample_size(n, max(1, math.ceil(self.fraction * n))))

    def _native_mode(self, flat: torch.Tensor) -> str | None:
        """How :meth:`_selected_natively` serves this flat gradient, the kernel built: "exact"
        (exactly k, :func:`_exactly_k`'s rule) for a non-empty float32 CPU tensor of at most
        EXACT_TOPK_MAX entries, "sampled" (:func:`_largest`'s threshold) for a larger one keeping
        less than half its entries; None otherwise (the torch path)."""
        n = flat.numel()
        if flat.dtype != torch.float32 or flat.device.type != "cpu" or n == 0 or \
                not native_topk.available():
            return None
        if n <= EXACT_TOPK_MAX:
            return "exact"
        return "sampled" if max(1, math.ceil(self.fraction * n)) < n // 2 else None

    def _selected_natively(self, flat: torch.Tensor) -> tuple[dict, EncodeStats] | None:
        """The payload and error of a float32 gradient from the C kernel
        (:mod:`ckptstore.replay.native.topk`): the entries :func:`_largest` keeps (for the same
        sampled threshold), in one pass (a large gradient's on two threads,
        :func:`native_topk.select`). None where the torch path must run (no kernel, not float32,
        a threshold that misses)."""
        mode = self._native_mode(flat)
        if mode is None:
            return None
        n = flat.numel()
        k = max(1, math.ceil(self.fraction * n))
        index_dtype = torch.int32 if n < 2**31 else torch.int64
        if mode == "exact":
            batch = native_topk.SelectionBatch([flat.contiguous()], [None], [k], [k], [index_dtype], 1)
            batch.run(0)
            got = batch.result(0)
        else:
            got = native_topk.select(flat.contiguous(), float(_sampled_threshold(flat, k)),
                                     2 * k, index_dtype)
        if got is None or not k // 2 <= got[0].numel():
            return None
        idx, vals, all_sq, dropped_sq, dropped_max = got
        payload = {"i": idx, "v": vals}
        return payload, EncodeStats(dropped_max, math.sqrt(dropped_sq), math.sqrt(all_sq))

    @staticmethod
    def _checked(payload: dict, n: int) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        """(indices as int64, the same as a contiguous numpy array, values) of a payload for a
        gradient of ``n`` entries: both 1-d tensors of one length, every index in ``[0, n)``;
        else ValueError. (What the encoder writes; a 2-d index tensor would pass an increasing
        check that compares rows, not entries.)"""
        idx, vals = payload["i"], payload["v"]
        if not (isinstance(idx, torch.Tensor) and isinstance(vals, torch.Tensor)) \
                or idx.dim() != 1 or vals.dim() != 1 or idx.numel() != vals.numel() \
                or idx.dtype not in (torch.int32, torch.int64):
            raise ValueError("topk gradient payload has invalid indices")
        idx = idx.to(torch.int64)
        # numpy: payloads are small and many; torch's per-op dispatch costs more than the work
        # (a payload on a GPU, decoded by the encoder with apply_decoded, is checked from a copy)
        idx_np = np.ascontiguousarray(idx.cpu().numpy())
        if idx_np.size and (int(idx_np.min()) < 0 or int(idx_np.max()) >= n):
            raise ValueError("topk gradient payload has invalid indices")
        return idx, idx_np, vals

    def decode(self, payload: dict, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        idx, _, vals = self._checked(payload, n)
        out = torch.zeros(n, dtype=dtype, device=vals.device)
        out[idx] = vals.to(dtype)
        return out.reshape(shape)

    def decode_into(self, payload: dict, out: torch.Tensor) -> torch.Tensor:
        idx, _, vals = self._checked(payload, out.numel())
        flat = out.view(-1)
        flat.zero_()
        flat[idx] = vals.to(out.dtype)
        return out

    def slicer(self, payload: dict, out_like: torch.Tensor) -> GradSlices | None:
        """Ranges located by binary search in the indices; only for strictly increasing indices
        (what :meth:`encode` writes), else None (a whole decode)."""
        idx, idx_np, vals = self._checked(payload, out_like.numel())
        if idx_np.size > 1 and not bool((idx_np[1:] > idx_np[:-1]).all()):
            return None
        vals = vals.to(out_like.dtype)
        if out_like.dtype in (torch.float32, torch.float64, torch.float16):
            # (ranges are a tile: torch's dispatch and intra-op threads cost 3x the work here)
            vals_np = np.ascontiguousarray(vals.numpy())

            def fill(a: int, b: int, out: torch.Tensor) -> None:
                lo, hi = np.searchsorted(idx_np, (a, b)).tolist()
                dense = out.numpy()
                dense.fill(0)
                dense[idx_np[lo:hi] - a] = vals_np[lo:hi]

            return GradSlices(fill, (idx_np, vals_np))

        def fill_torch(a: int, b: int, out: torch.Tensor) -> None:
            lo, hi = torch.searchsorted(idx, torch.tensor([a, b], dtype=torch.int64)).tolist()
            out.zero_()
            out[idx[lo:hi] - a] = vals[lo:hi]

        return GradSlices(fill_torch)


class Int8Codec(GradCodec):
    name = "int8"
    lossy = True

    def encode(self, g: torch.Tensor) -> dict:
        flat = g.detach().reshape(-1).float()
        n = flat.numel()
        pad = (-n) % INT8_CHUNK
        x = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, INT8_CHUNK) if n else flat.reshape(0, INT8_CHUNK)
        scale = x.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x / safe[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
        return {"q": q, "s": scale.float()}

    def decode(self, payload: dict, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        q, s = payload["q"], payload["s"]
        if q.numel() != n or s.numel() != (n + INT8_CHUNK - 1) // INT8_CHUNK:
            raise ValueError("int8 gradient payload has the wrong size")
        pad = (-n) % INT8_CHUNK
        x = torch.nn.functional.pad(q.float(), (0, pad)).reshape(-1, INT8_CHUNK) * s[:, None]
        return x.reshape(-1)[:n].reshape(shape).to(dtype)


def parse_codec(spec: str) -> GradCodec:
    """"exact" | "bf16" | "fp16" | "topk:F" (0 < F <= 1) | "int8"."""
    if spec == "exact":
        return GradCodec()
    if spec == "bf16":
        return CastCodec("bf16", torch.bfloat16)
    if spec == "fp16":
        return CastCodec("fp16", torch.float16)
    if spec == "int8":
        return Int8Codec()
    if isinstance(spec, str) and spec.startswith("topk:"):
        try:
            f = float(spec[5:])
        except ValueError:
            raise ValueError(f"invalid topk fraction in codec {spec!r}") from None
        return TopKCodec(f)
    raise ValueError(f'unknown gradient codec {spec!r} (exact, bf16, fp16, topk:F, int8)')
