"""PyTorch integration: :class:`Checkpointer` logs every training step as a gradient delta and
writes base snapshots periodically, so any iteration can be restored (format-spec/deltas.md)."""

from .checkpointer import Checkpointer
from .ddp_hook import ddp_comm_hook
from .failure_policy import CheckpointerStats, CheckpointHealth
from .live_state import counters_like

__all__ = ["Checkpointer", "CheckpointHealth", "CheckpointerStats", "counters_like", "ddp_comm_hook"]
