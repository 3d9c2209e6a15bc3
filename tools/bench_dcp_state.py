"""bench_dcp's state helpers: the tensors of a (nested) state, their bytes, zeroing a state in
place, and what differs between two states (bit for bit, or by a fingerprint of each tensor).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

def leaves(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    """(path, leaf) of a nested dict/list/tuple; containers also yield a (path, marker) entry
    with their type and length/keys, so a changed structure shows."""
    if isinstance(obj, dict):
        out: list[tuple[str, Any]] = [(path, ("dict", tuple(sorted(map(repr, obj)))))]
        for k in obj:
            out += leaves(obj[k], f"{path}/{k!r}")
        return out
    if isinstance(obj, (list, tuple)):
        out = [(path, (type(obj).__name__, len(obj)))]
        for i, v in enumerate(obj):
            out += leaves(v, f"{path}/{i}")
        return out
    return [(path, obj)]


def tensors_of(state: Any) -> list[Any]:
    return [v for _, v in leaves(state) if isinstance(v, torch.Tensor)]


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def zero_bytes(state: Any) -> int:
    """Bytes of the state's tensors held by elements equal to zero (+0.0 or -0.0): lz4 squeezes
    them, so the report shows how much of ckptstore's size is compression of zeros (here: the
    AdamW moments of embedding rows no batch has touched yet)."""
    return sum(int((t == 0).sum()) * t.element_size() for t in tensors_of(state))


def raw_bytes(t: Any) -> Any:
    """A tensor's bytes as a flat uint8 tensor (bit patterns: -0.0 != 0.0, NaNs by payload)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def zero_state(state: Any) -> None:
    """Overwrite every tensor of ``state`` with zeros (outside the clock, before a load), so a
    load that misses a tensor is caught by the comparison."""
    with torch.no_grad():
        for t in tensors_of(state):
            t.zero_()


def diff_states(got: Any, want: Any, limit: int = 5) -> list[str]:
    """Paths where ``got`` differs from ``want``: tensors compared byte for byte (and dtype and
    shape), other leaves by type and value, containers by type and keys/length."""
    a, b = dict(leaves(got)), dict(leaves(want))
    bad = [f"{p}: missing" for p in b if p not in a] + [f"{p}: unexpected" for p in a if p not in b]
    for p, w in b.items():
        if p not in a:
            continue
        g = a[p]
        if isinstance(w, torch.Tensor):
            ok = isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape \
                and torch.equal(raw_bytes(g), raw_bytes(w))
        else:
            ok = type(g) is type(w) and g == w
        if not ok:
            bad.append(f"{p}: differs")
    return bad[:limit] + ([f"... {len(bad) - limit} more"] if len(bad) > limit else [])


def fingerprint(state: Any) -> dict[str, Any]:
    """Per path: a tensor's dtype, shape and blake2b-128 of its bytes; another leaf's type and
    repr; a container's marker (see :func:`leaves`)."""
    out: dict[str, Any] = {}
    for p, v in leaves(state):
        if isinstance(v, torch.Tensor):
            h = hashlib.blake2b(memoryview(raw_bytes(v).numpy()), digest_size=16).hexdigest()
            out[p] = ("tensor", str(v.dtype), tuple(v.shape), h)
        else:
            out[p] = (type(v).__name__, repr(v))
    return out


def diff_fingerprints(got: dict[str, Any], want: dict[str, Any], limit: int = 5) -> list[str]:
    bad = [f"{p}: missing" for p in want if p not in got] + \
          [f"{p}: unexpected" for p in got if p not in want] + \
          [f"{p}: differs" for p in want if p in got and got[p] != want[p]]
    return bad[:limit] + ([f"... {len(bad) - limit} more"] if len(bad) > limit else [])
