"""PyTorch integration: :class:`Checkpointer` logs every training step as a gradient delta and
writes base snapshots periodically, so any iteration can be restored (format-spec/deltas.md)."""

from .checkpointer import Checkpointer, counters_like, ddp_comm_hook

__all__ = ["Checkpointer", "counters_like", "ddp_comm_hook"]
