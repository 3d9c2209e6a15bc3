"""The live training objects' plain state as records hold it: RNG states captured and restored,
a scheduler's ``collections.Counter`` values turned into plain dicts and back, an optimizer's
hyperparameters and JSON-safe defaults, and the byte size of a state's tensors
(format-spec/deltas.md). Pure functions: nothing here writes to a store."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                           "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        # (a restore on fewer devices than saved: the ones it has; the rest have no generator)
        for i, state in enumerate(rng["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, i)


def plain_counters(state: Any) -> Any:
    """``state`` (a scheduler's ``state_dict()``) with every ``collections.Counter`` in it (dicts,
    lists, tuples; MultiStepLR's ``milestones``) turned into a plain dict of the same items, in the
    same order: the state encoding holds no Counter (format-spec/deltas.md, "Scheduler state").
    Containers on the way are copied; everything else is shared."""
    t = type(state)
    if t is Counter:
        return dict(state)
    if t is dict:
        return {k: plain_counters(v) for k, v in state.items()}
    if t is list:
        return [plain_counters(v) for v in state]
    if t is tuple:
        return tuple(plain_counters(v) for v in state)
    return state


def counters_like(loaded: Any, live: Any) -> Any:
    """Undo :func:`plain_counters` for a state read back: where the live scheduler's state holds a
    Counter at the same place and ``loaded`` holds a plain dict, make that dict a Counter again
    (missing keys then read as 0, ``elements()`` works), keeping its item order."""
    if type(live) is Counter and type(loaded) is dict:
        return Counter(loaded)
    if type(live) is dict and type(loaded) is dict:
        return {k: counters_like(v, live[k]) if k in live else v for k, v in loaded.items()}
    if type(live) in (list, tuple) and type(loaded) is type(live) and len(loaded) == len(live):
        return type(loaded)(counters_like(a, b) for a, b in zip(loaded, live))
    return loaded


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's settings (everything but its ``params``), in group order, as they
    are now: a tensor setting (a learning rate given as a tensor, ``betas`` of tensors) is copied,
    because a scheduler changes it in place (``fill_``) after the step it was in effect for."""
    return [{k: _settled(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _settled(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (tuple, list) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_settled(v) for v in value)
    return value


def json_defaults(defaults: dict) -> dict:
    """The optimizer defaults a record can hold as plain values (None, bool, int, float, str,
    tuple); the others are left out."""
    return {k: v for k, v in defaults.items()
            if v is None or type(v) in (bool, int, float, str, tuple)}


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state: the size of a base snapshot, about."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0
