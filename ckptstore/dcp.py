"""``ckptstore.dcp``, the documented import path of ckptstore as the storage layer of
``torch.distributed.checkpoint``: re-exports :mod:`ckptstore.integrations.dcp` (its docstring
says how a DCP save and load go through a store)."""

from .integrations.dcp import (FORMAT, FORMAT_VERSION, VOTE_KEY, Layout, ShardLayout, StorageReader,
                               StorageWriter, TensorLayout, ValueLayout, check_state_dict, is_dcp,
                               layout, layout_of, load_full_state_dict)

__all__ = ["StorageWriter", "StorageReader", "FORMAT", "FORMAT_VERSION", "Layout", "TensorLayout",
           "ShardLayout", "ValueLayout", "is_dcp", "layout", "layout_of", "load_full_state_dict",
           "check_state_dict", "VOTE_KEY"]
