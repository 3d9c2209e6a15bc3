"""Loading a stored iteration into a Checkpointer's live objects (model, optimizer, scheduler,
RNG states), by the cheapest way the store and the layout allow:

1. FSDP2 / DTensor parameters: each rank its own part at the saved world size, else the whole
   state assembled (:mod:`ckptstore.torch.sharded`), copied into the live local shards;
2. a state the caller has read already: used as it is;
3. a data-parallel job store whose ranks each hold a part: each rank replays its own part
   (:mod:`ckptstore.torch.dp_restore`);
4. a single writer: straight into the live parameters and optimizer state (no allocation);
5. otherwise the whole state, loaded and then copied in.

The Checkpointer's chain position is not this module's business (:meth:`Checkpointer.restore`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import NotFoundError
from .dp_restore import can_load_in_parallel, load_in_parallel
from .live_state import counters_like, restore_rng
from .param_layout import ParamLayout
from .sharded import copy_into_live, load_sharded


def restore_live(store: Any, target: int, iterations: list[int], state: dict | None,
                 model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 layout: ParamLayout) -> None:
    """Load iteration ``target`` of ``store`` (``iterations``: the store's, not empty) into the
    live objects; ``state``: that iteration's state as ``store.load(target)`` returned it, or
    None (read here). NotFoundError for an iteration the store does not hold; whatever the
    store's load raises otherwise, before any live object changed (but the sharded copy, which
    checks every box first)."""
    if (state is not None or layout.sharded) and target not in iterations:
        raise NotFoundError(f"iteration {target} is not in {store.path}")
    if layout.sharded:
        # each rank its own part (replayed) at the saved world size, else the whole state
        if state is None:
            state = load_sharded(store, target, layout.rank, layout.world)
        copy_into_live(state, model, optimizer, layout.params, layout.names, layout.world)
    elif state is not None:
        pass
    elif can_load_in_parallel(store, target):
        state = load_in_parallel(store, target)  # each rank replays its own part
    elif layout.partition is None:
        # straight into the live parameters and optimizer state: no allocation, and
        # load_state_dict below then copies nothing (optimizer) or onto itself (model)
        live = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        state = store.load(target, into=live)
    else:
        state = store.load(target)
    assert state is not None
    if not layout.sharded:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(counters_like(state["scheduler"], scheduler.state_dict()))
    restore_rng(state["rng"])
