"""ckptstore: a crash-consistent, content-addressed, log-structured store for training checkpoints.

    import ckptstore
    with ckptstore.open("runs/gpt", mode="a") as store:
        store.save(100, {"model": model.state_dict(), "optim": opt.state_dict()}, meta={"loss": 2.3})
        state = store.load(100)
"""

from .errors import (CheckpointAbortedError, ChecksumMismatch, CkptStoreError, CorruptRecordError, DamagedCheckpointError,
                     DamagedIndexWarning,
                     DeltaChainError, DiskFullError, FormatError, IndexUnusable,
                     IterationOrderError, NotFoundError, ReadOnlyStoreError,
                     ReplayDivergenceError, StoreClosedError, StoreIOError, StoreLockedError,
                     StoreNotFoundError, UnsupportedTypeError, UnsupportedVersionError)
import os as _os
from typing import Any as _Any

from .engine.write_path import SaveStats
from .store import CheckpointInfo, Store, TensorDiff

__version__ = "0.1.0"


def open(path: str | _os.PathLike, mode: str = "a", **options: _Any) -> Store:  # noqa: A001
    """Open the store at ``path``: mode "a" creates it if needed and takes the single-writer lock;
    mode "r" reads (also while a writer runs) and never writes under the directory.

    Options: ``chunk_size`` and ``segment_size`` (bytes; defaults 4 MiB and 1 GiB, recorded in the
    STORE file at creation, overridable per writer), ``file_ops`` (the I/O seam, for fault
    injection), ``load_threads`` (parallel chunk reads, default 2), ``evict_written`` (writers,
    default True: advise the kernel with posix_fadvise DONTNEED to write back and drop the page
    cache of what was written, every 32 MiB and after each fsync, so the writer reuses a few cache
    pages instead of filling fresh ones; advice only, it never discards data or fails a write;
    False leaves the page cache alone, e.g. when the checkpoints just written are read back soon).
    """
    return Store(path, mode, **options)

__all__ = [
    "open", "Store", "SaveStats", "CheckpointInfo", "TensorDiff",
    "CkptStoreError", "FormatError", "CorruptRecordError", "ChecksumMismatch",
    "UnsupportedVersionError", "StoreNotFoundError", "StoreLockedError", "ReadOnlyStoreError",
    "StoreClosedError", "NotFoundError", "IterationOrderError", "UnsupportedTypeError",
    "StoreIOError", "DiskFullError", "DamagedCheckpointError", "IndexUnusable", "DeltaChainError",
    "ReplayDivergenceError", "CheckpointAbortedError", "DamagedIndexWarning",
]
