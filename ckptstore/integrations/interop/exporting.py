"""Exporting: a loaded state, or a committed iteration, written as a ``torch.save`` file, a
safetensors file or a DCP directory, under a temporary name renamed into place."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any, Callable

import numpy as np
import torch

from ...errors import ExportError
from .sources import refusal

#: Formats :func:`write_state` writes.
EXPORT_FORMATS = ("torch", "safetensors", "dcp")


def flat_tensors(state: Any, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested state into ``{path: tensor}`` and ``{path: JSON-able value}`` (paths
    ``a/b/0``), for safetensors."""
    tensors: dict[str, Any] = {}
    other: dict[str, Any] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) \
        if isinstance(state, (list, tuple)) else None
    if items is None:
        if isinstance(state, torch.Tensor):
            tensors[prefix] = state.detach().contiguous()
        elif isinstance(state, np.ndarray):
            tensors[prefix] = torch.from_numpy(np.ascontiguousarray(state))
        else:
            other[prefix] = state if not isinstance(state, bytes) else state.hex()
        return tensors, other
    for k, v in items:
        t, o = flat_tensors(v, f"{prefix}/{k}" if prefix else str(k))
        tensors.update(t)
        other.update(o)
    return tensors, other


def _numpy_to_torch(state: Any) -> Any:
    """The state with every numpy array as a torch tensor (DCP pickles anything else)."""
    if isinstance(state, np.ndarray):
        a = state if state.dtype.isnative else state.astype(state.dtype.newbyteorder("="))
        return torch.from_numpy(np.ascontiguousarray(a))
    if isinstance(state, dict):
        out = type(state)((k, _numpy_to_torch(v)) for k, v in state.items())
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(state, list):
        return [_numpy_to_torch(v) for v in state]
    if isinstance(state, tuple):
        return tuple(_numpy_to_torch(v) for v in state)
    return state


def _write_dcp(state: Any, target: str) -> None:
    import torch.distributed.checkpoint as dcp

    if not isinstance(state, dict):
        raise ExportError(f"DCP needs a dict at the top of the state, not {type(state).__name__}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notice that it runs in a single process
        dcp.save(_numpy_to_torch(state), checkpoint_id=target, no_dist=True)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def write_state(state: Any, out: str | os.PathLike, fmt: str, *,
                iteration: int | None = None) -> None:
    """Write a loaded state to ``out`` as ``fmt`` (one of :data:`EXPORT_FORMATS`), under a
    temporary name renamed into place (package docstring). ExportError for an unknown format, a
    DCP target that exists and is not an empty directory, or a state the format cannot hold."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r} (one of {', '.join(EXPORT_FORMATS)})")
    target = os.fspath(out)
    if fmt == "dcp" and os.path.lexists(target) and not (
            os.path.isdir(target) and not os.path.islink(target) and not os.listdir(target)):
        raise ExportError(f"{target}: exists; a DCP export needs a new or empty directory")
    tmp = os.path.join(os.path.dirname(os.path.abspath(target)),
                       f".{os.path.basename(os.path.abspath(target))}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        if fmt == "torch":
            torch.save(state, tmp)
        elif fmt == "safetensors":
            from safetensors.torch import save_file

            tensors, other = flat_tensors(state)
            metadata = {"ckptstore.values": json.dumps(other, default=repr)}
            if iteration is not None:
                metadata["ckptstore.iteration"] = str(iteration)
            try:
                save_file(tensors, tmp, metadata=metadata)
            except (ValueError, RuntimeError) as e:
                raise ExportError(f"{target}: safetensors cannot hold this state ({e})") from e
        else:
            from torch.distributed.checkpoint import CheckpointException

            try:
                _write_dcp(state, tmp)
            except (ExportError, OSError):
                raise
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps its
                # writers' failures in CheckpointException (a BaseException)
                raise ExportError(f"{target}: DCP cannot write this state ({refusal(e)})") from e
            if os.path.isdir(target):
                os.rmdir(target)  # empty (checked above): the rename puts the export there
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def export_checkpoint(store: Any, iteration: int, out: str | os.PathLike, fmt: str, *,
                      keys: list | None = None,
                      progress: Callable[[int], None] | None = None) -> None:
    """Write committed ``iteration`` of ``store`` (a delta iteration is reconstructed by
    :meth:`Store.load`) to ``out`` as ``fmt``; ``keys``: only these top-level keys."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r} (one of {', '.join(EXPORT_FORMATS)})")
    state = store.load(iteration, keys=keys, progress=progress)
    write_state(state, out, fmt, iteration=iteration)
