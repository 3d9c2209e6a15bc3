"""Loading into tensors the caller already has: ``store.load(iteration, into=target)``.

A *target* is a nested structure shaped like the state being loaded (dicts, lists, tuples: a
``Module.state_dict()``, an ``Optimizer.state_dict()``, or a dict of them). Wherever the target
holds a torch tensor at the path of a stored torch tensor, the stored bytes land in that tensor's
memory and the loaded state holds that same tensor object; a path the target lacks (or holds no
tensor at) is allocated as usual, and target tensors the state does not name are left alone.

Invariants:

* Every destination is checked (a torch tensor of the stored dtype and shape) before a byte is
  written to any of them: a mismatch raises :class:`TargetMismatchError` naming the tensor, and
  every target is left untouched.
* Contiguous CPU targets receive the bytes straight from the reads (verified in place); others
  (a GPU tensor, a non-contiguous view) are filled with one ``copy_`` from a staged CPU tensor
  once every read has been verified.
* A target tensor is never resized, re-typed or replaced; ``requires_grad`` tensors (parameters)
  are filled without autograd, as ``with torch.no_grad(): p.copy_(x)`` would.
* A damaged chunk met during the reads raises ``DamagedCheckpointError`` after some targets may
  have been partly filled (as with DCP's in-place load): their contents are then unspecified.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ..errors import TargetMismatchError
from ..format.manifest import TensorEntry
from ..format.state import Path, format_path
from .leaves import TORCH_DTYPES

_MISSING = object()


def lookup(target: Any, path: Path) -> Any:
    """The value of ``target`` at ``path`` (dict keys, list/tuple positions), or None when the
    target has nothing there."""
    node = target
    for key in path:
        if isinstance(node, dict):
            node = node.get(key, _MISSING)
        elif isinstance(node, (list, tuple)) and type(key) is int and 0 <= key < len(node):
            node = node[key]
        else:
            return None
        if node is _MISSING:
            return None
    return node


def check_target(entry: TensorEntry, path: Path, given: torch.Tensor) -> None:
    """Raise TargetMismatchError unless ``given`` can hold exactly the stored tensor ``entry``."""
    want = TORCH_DTYPES.get(entry.dtype) if entry.lib == "torch" else None
    if want is None or given.dtype != want or tuple(given.shape) != tuple(entry.shape):
        stored = f"{entry.lib} {entry.dtype}{list(entry.shape)}"
        raise TargetMismatchError(
            f"{format_path(path)}: the stored tensor is {stored}; the tensor given to load into "
            f"is {str(given.dtype).removeprefix('torch.')}{list(given.shape)} on "
            f"{given.device}")


def destinations(paths: dict[int, Path], entries: list[TensorEntry],
                 target: Any) -> dict[int, torch.Tensor]:
    """Leaf index -> the target's tensor to fill, for every stored tensor ``paths`` names that the
    target holds a tensor for, each checked with :func:`check_target` (all before any read)."""
    out: dict[int, torch.Tensor] = {}
    for i, path in paths.items():
        given = lookup(target, path)
        if isinstance(given, torch.Tensor):
            check_target(entries[i], path, given)
            out[i] = given
    return out


def _tensor_pairs(loaded: Any, target: Any, path: Path) -> Iterator[tuple[Path, Any, torch.Tensor]]:
    if isinstance(loaded, torch.Tensor):
        if isinstance(target, torch.Tensor):
            yield path, loaded, target
    elif isinstance(loaded, dict) and isinstance(target, dict):
        for k, v in loaded.items():
            if k in target:
                yield from _tensor_pairs(v, target[k], path + (k,))
    elif isinstance(loaded, (list, tuple)) and isinstance(target, (list, tuple)):
        for i, (v, t) in enumerate(zip(loaded, target)):
            yield from _tensor_pairs(v, t, path + (i,))


def _substitute(loaded: Any, filled: dict[int, torch.Tensor]) -> Any:
    if isinstance(loaded, torch.Tensor):
        return filled.get(id(loaded), loaded)
    if isinstance(loaded, dict):
        for k, v in loaded.items():
            loaded[k] = _substitute(v, filled)
        return loaded
    if isinstance(loaded, list):
        loaded[:] = [_substitute(v, filled) for v in loaded]
        return loaded
    if isinstance(loaded, tuple):
        return tuple(_substitute(v, filled) for v in loaded)
    return loaded


def copy_into(loaded: Any, target: Any) -> Any:
    """``loaded`` (a state rebuilt in fresh tensors, e.g. by replay) with each tensor the target
    holds at the same path copied into the target's tensor and replaced by it. All pairs are
    checked before the first copy."""
    pairs = list(_tensor_pairs(loaded, target, ()))
    for path, src, dst in pairs:
        if src.dtype != dst.dtype or src.shape != dst.shape:
            raise TargetMismatchError(
                f"{format_path(path)}: the stored tensor is {str(src.dtype).removeprefix('torch.')}"
                f"{list(src.shape)}; the tensor given to load into is "
                f"{str(dst.dtype).removeprefix('torch.')}{list(dst.shape)} on {dst.device}")
    filled: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for _, src, dst in pairs:
            dst.copy_(src)
            filled[id(src)] = dst
    return _substitute(loaded, filled)
