"""ckptstore: a crash-consistent, content-addressed, log-structured store for training checkpoints.

    import ckptstore
    with ckptstore.open("runs/gpt", mode="a") as store:
        store.save(100, {"model": model.state_dict(), "optim": opt.state_dict()}, meta={"loss": 2.3})
        state = store.load(100)
"""

from .errors import (BisectError, BisectPredicateError, CheckpointAbortedError, ChecksumMismatch, CkptStoreError, CorruptRecordError, DamagedCheckpointError,
                     DamagedIndexWarning, LoanWithdrawnError,
                     DeltaChainError, DiskFullError, FormatError, IndexUnusable,
                     IterationOrderError, JobStreamError, NotFoundError, ReadOnlyStoreError,
                     ReplayDivergenceError, StoreClosedError, StoreIOError, StoreLockedError,
                     StoreNotFoundError, UnsupportedTypeError, UnsupportedVersionError,
                     CheckpointPolicyError, CheckpointPlanError, UnreplayableOptimizerError,
                     CommitOutcomeUnknownError, GlobalCommitAbortedError,
                     RankFailureError, RankMismatchError, RetentionError, StaleWriterError,
                     StoreFeaturesError,
                     TargetMismatchError, DCPError, ExportError, ImportSkippedWarning,
                     ImportSourceError, LiveStateChangedError)
from .errors import (RemoteConflictError, RemoteError, RemoteIntegrityError,
                     RemoteStreamMissingError, RemoteUnsupportedError)
from .errors import FollowerError, FollowerMismatchError, FollowerWarning
from .errors import (ShardCoverageError, ShardDamagedError, ShardLayoutError, ShardMismatchError,
                     ShardedStateError)
import os as _os
from typing import Any as _Any

from .engine.write_path import SaveStats
from .multirank.job_store import JobStore
from .storage.job_log import is_job_store
from .ops.bisect import BisectResult
from .ops.retention import (AnyOf, KeepBest, KeepEvery, KeepLast, KeepNewerThan,
                             KeepSinceIteration, Policy)
from .store import CheckpointInfo, Store, TensorDiff

__version__ = "0.1.0"


def open(path: str | _os.PathLike, mode: str = "a", **options: _Any) -> _Any:  # noqa: A001
    """Open the store at ``path``: mode "a" creates it if needed and takes the single-writer lock;
    mode "r" reads (also while a writer runs) and never writes under the directory.

    With ``process_group=pg`` (torch.distributed), every rank of ``pg`` opens the store together
    and gets a :class:`JobStore`: a multi-rank store with one stream per rank and a global
    two-phase commit (format-spec/format.md §22; ``commit_timeout`` bounds how long a rank waits
    for the others, default 300 s). ``mode="r"`` on a multi-rank store opens a JobStore reader
    (no group needed).

    Options: ``chunk_size`` and ``segment_size`` (bytes; defaults 4 MiB and 1 GiB, recorded in the
    STORE file at creation, overridable per writer), ``file_ops`` (the I/O seam, for fault
    injection), ``load_threads`` (parallel chunk reads, default 2), ``evict_written`` (writers,
    default True: advise the kernel with posix_fadvise DONTNEED to write back and drop the page
    cache of what was written, every 32 MiB and after each fsync, so the writer reuses a few cache
    pages instead of filling fresh ones; advice only, it never discards data or fails a write;
    False leaves the page cache alone, e.g. when the checkpoints just written are read back soon),
    ``direct_io`` (writers, default "async": the records the asynchronous pipeline writes, deltas
    and ``save_async`` snapshots, are staged in a reused page-aligned 8 MiB buffer and written
    with O_DIRECT, bypassing the page cache, which halves the background CPU of a per-iteration
    delta and cuts an async snapshot's by about a third (31 against 49 ms for 54 MB, side by side,
    2026-11-29); synchronous ``save`` snapshots append buffered, which is faster for one large
    save on this kind of machine because the kernel's writeback overlaps the writer (on other
    cores); "deltas": delta records only; True: every record through O_DIRECT; False: none. The partial last block and every
    append on a file system that refuses O_DIRECT go through ordinary writes; the bytes and their
    durability points are the same either way), ``retention`` and ``retention_every`` (writers:
    a retention policy applied by an automatic gc after every ``retention_every``-th base
    snapshot this writer commits; see :meth:`Store.set_retention`, and for a job store
    :meth:`JobStore.set_retention`: the job's own collective gc), ``features`` (writers,
    default "current": a store created now gets every format feature this release writes,
    today FRAMING_CHECKS, format-spec/format.md §4; "compatible": a store created now gets none,
    so ckptstore releases from before those features can read it, e.g. followers or remote
    readers not yet upgraded, and opening a store that has features raises
    StoreFeaturesError; an existing store keeps the features it was created with either way;
    a multi-rank store's ranks create new streams at every open, with the features of its first
    streams, or ``features`` for a new store).

    Remote tier (format-spec/remote.md): ``remote="s3://bucket/run"`` and
    ``remote_options={...}`` (writers: endpoint and credentials, ``bandwidth``, ``head_interval``,
    ...; see :mod:`ckptstore.remote`) upload every commit in the background; a URL as ``path``
    with ``mode="r"`` (``storage_options={...}``) reads the newest remote HEAD lazily: STORE,
    the HEAD and its index object at open, then only the byte ranges a load needs (range GETs,
    a bounded block cache; ``store.remote_read_stats()``); ``cache_dir=DIR`` or ``lazy=False``
    pull the whole HEAD into a local directory first. A multi-rank job store is pushed with
    :func:`ckptstore.remote.push` (``ckptstore push``), uploaded while it trains with ``remote=``
    beside ``process_group=`` (each rank its own stream, rank 0 the job HEADs), and opened from
    its URL as a :class:`JobStore` reader: lazily (a rank's stream is read with range GETs only
    when a load needs it), or pulled whole with ``cache_dir=DIR`` or ``lazy=False``.
    """
    if isinstance(path, str) and "://" in path:
        # a remote copy (format-spec/remote.md): read lazily with range GETs (or pulled into
        # cache_dir / a temporary directory with lazy=False), see ckptstore/remote/reader.py
        from .remote.reader import open_remote

        try:
            engine, rest = open_remote(path, mode, options)
        except StoreNotFoundError:
            return _open_remote_job(path, mode, options)  # a job store's copy
        return _reader_on(engine, rest)
    if options.get("process_group") is not None or (mode == "r" and is_job_store(_os.fspath(path))):
        return JobStore(path, mode, **options)
    return Store(path, mode, **options)

def _reader_on(engine, options: dict | None = None) -> Store:
    """A Store reader on a remote copy's reader ``engine`` (closed if the Store cannot open)."""
    try:
        return Store(engine.path, "r", _engine=engine, **(options or {}))
    except BaseException:
        engine.close()
        raise


def _open_remote_job(url: str, mode: str, options: dict) -> JobStore:
    """The JobStore reader of a remote job store's copy (:func:`ckptstore.remote.job_pull.
    open_remote_job`: pulled whole, or lazily, each rank stream a Store on its own lazy reader
    engine); a temporary directory goes when the JobStore does."""
    import shutil
    import weakref

    from .remote.job_pull import open_remote_job

    copy = open_remote_job(url, mode, options)
    engines = copy.streams
    try:
        job = JobStore(copy.path, "r", **copy.options, _streams=None if engines is None else
                       (lambda epoch, rank: _reader_on(engines(epoch, rank))),
                       _read_stats=copy.read_stats)
    except BaseException:
        if copy.temporary:
            shutil.rmtree(copy.path, ignore_errors=True)
        raise
    if copy.temporary:
        weakref.finalize(job, shutil.rmtree, copy.path, ignore_errors=True)
    return job


__all__ = [
    "open", "Store", "JobStore", "SaveStats", "CheckpointInfo", "TensorDiff",
    "CkptStoreError", "FormatError", "CorruptRecordError", "ChecksumMismatch",
    "UnsupportedVersionError", "StoreNotFoundError", "StoreLockedError", "ReadOnlyStoreError",
    "StoreClosedError", "JobStreamError", "NotFoundError", "IterationOrderError", "UnsupportedTypeError",
    "StoreIOError", "DiskFullError", "DamagedCheckpointError", "IndexUnusable", "DeltaChainError",
    "ReplayDivergenceError", "CheckpointAbortedError", "DamagedIndexWarning",
    "StaleWriterError", "StoreFeaturesError", "RankMismatchError", "RankFailureError", "CommitOutcomeUnknownError",
    "GlobalCommitAbortedError", "CheckpointPolicyError", "TargetMismatchError",
    "BisectError", "BisectPredicateError", "BisectResult", "RetentionError", "DCPError",
    "ImportSourceError", "ExportError", "ImportSkippedWarning",
    "Policy", "KeepLast", "KeepEvery", "KeepBest", "KeepNewerThan", "KeepSinceIteration", "AnyOf",
]
__all__ += ["RemoteError", "RemoteIntegrityError", "RemoteConflictError", "RemoteUnsupportedError",
            "RemoteStreamMissingError"]
__all__ += ["FollowerError", "FollowerMismatchError", "FollowerWarning"]
__all__ += ["CheckpointPlanError", "UnreplayableOptimizerError", "LiveStateChangedError",
            "LoanWithdrawnError"]
__all__ += ["ShardCoverageError", "ShardMismatchError", "ShardDamagedError", "ShardLayoutError",
            "ShardedStateError"]
