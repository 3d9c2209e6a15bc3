"""Parameter fingerprints: what a Checkpointer records in a delta (format-spec/deltas.md, "fp") and
replay checks against the replayed parameters. An exact replay compares the xxh3-64 digest of the
parameters' bytes; a replay that cannot compare bits (lossy gradients, another device) compares
their L2 norm. Pure functions of the parameters, in optimizer order."""

from __future__ import annotations

import math

import xxhash


def fingerprint(params) -> tuple[str, float]:
    """xxh3-64 of the parameters' bytes in optimizer order, and their L2 norm (float32 dot
    products over chunks of 2^16 entries, summed in float64: accurate to ~1e-7 relative without
    a float64 copy of the parameters)."""
    return fingerprint_digest(params), parameter_norm(params)


def parameter_norm(params) -> float:
    """The float64-accumulated L2 norm of the floating-point parameters (see :func:`fingerprint`)."""
    from .gradcodecs import sum_of_squares

    return math.sqrt(sum(sum_of_squares(p) for p in params if p.is_floating_point()))


def fingerprint_digest(params) -> str:
    """The xxh3-64 half of :func:`fingerprint` (all an exact replay compares). Parameters on
    another device are hashed from a copy in host memory (the same bytes)."""
    import torch

    h = xxhash.xxh3_64()
    for p in params:
        t = p.detach().contiguous().reshape(-1).cpu()  # (no copy for a CPU tensor)
        h.update(memoryview(t.view(torch.uint8).numpy()))
    return h.hexdigest()
