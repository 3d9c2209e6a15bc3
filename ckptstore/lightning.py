"""``ckptstore.lightning``, the documented import path of the Lightning ``CheckpointIO``:
re-exports :mod:`ckptstore.integrations.lightning` (importing it imports ``lightning``)."""

from .integrations.lightning import (META_KEY, NAMES_FILE, EveryRankCheckpoints, NamedCheckpoints,
                                    StoreCheckpointIO, StoreDDPStrategy)

__all__ = ["StoreCheckpointIO", "NamedCheckpoints", "EveryRankCheckpoints", "StoreDDPStrategy",
           "META_KEY", "NAMES_FILE"]
