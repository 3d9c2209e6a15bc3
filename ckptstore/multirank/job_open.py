"""Opening a job store for writing: the coordinator's claim of a writer epoch, its broadcast, and
the format features of each rank's new stream (format-spec/format.md §22, "Epochs and fencing").

Steps 2 and 3 of :class:`~ckptstore.multirank.job_store.JobStore`'s open (its module docstring),
also run by a writer after its own gc:

1. rank 0 :func:`claim_epoch`: creates the job store if needed, claims the next epoch (an
   exclusively created global log) and writes its EPOCH record;
2. :func:`agree_epoch` broadcasts the epoch and the latest iteration it continues from (or rank
   0's error, raised on every rank: no rank waits for a broadcast that never comes);
3. each rank creates its stream (:meth:`StreamOptions.open`, with :func:`stream_features`),
   and :func:`open_streams` tells every rank whether all did, in the same store.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CkptStoreError, FormatError, RankMismatchError, StoreFeaturesError
from ..engine.engine import DEFAULT_CHUNK_SIZE, DEFAULT_SEGMENT_SIZE
from ..format.header import StoreHeader, feature_names
from ..format.job import Epoch
from ..storage.fileops import FileOps
from ..storage.job_log import (EpochLog, JobLayout, claim_next_epoch, create_job_store,
                               quarantine_tail, read_job_header, read_job_view,
                               tail_is_suspicious)
from ..storage.layout import Layout
from ..storage.store_file import read_store_header
from ..store import Store
from .group import RankGroup

_OPENED = struct.Struct("<QQB")  # epoch, adopted latest + 1 (0: none), ok


def claim_epoch(layout: JobLayout, ops: FileOps, world_size: int, chunk_size: int | None,
                segment_size: int | None) -> tuple[EpochLog, int | None]:
    """The coordinator's part of opening: create the store at ``layout`` if needed, claim the
    next epoch and write its EPOCH record. Returns (the epoch's open log, the latest iteration it
    continues from)."""
    path = layout.root
    if not os.path.exists(layout.store_file):
        if os.path.exists(os.path.join(path, "segments")):
            raise FormatError(f"{path} holds segments but no STORE file: not a job store")
        ops.makedirs(path)
        create_job_store(layout, ops, chunk_size or DEFAULT_CHUNK_SIZE,
                         segment_size or DEFAULT_SEGMENT_SIZE)
    header = read_job_header(layout)
    view = read_job_view(layout, header.store_id)
    log = claim_next_epoch(layout, ops, view.highest_claimed)
    try:
        # what this epoch continues is read after the claim is durable: an older job's
        # coordinator that commits after this point sees the claim and reports its commit
        # as not known to be kept (format §22, "Epochs and fencing")
        view = read_job_view(layout, header.store_id)
        prev = view.chain[-1] if view.chain else 0
        end = view.logs[prev].valid_end if prev else 0
        if prev and tail_is_suspicious(view.logs[prev]):
            quarantine_tail(layout, ops, view.logs[prev])  # kept, never adopted
        log.write_epoch(Epoch(log.number, world_size, header.store_id, prev, end,
                              time.time_ns()))
    except BaseException:
        log.close()
        raise
    return log, view.latest


def agree_epoch(group: RankGroup, path: str,
                claim: Callable[[], tuple[EpochLog, int | None]]) -> tuple[EpochLog | None,
                                                                           int, int | None]:
    """Collective: rank 0 runs ``claim`` (:func:`claim_epoch`) and broadcasts its epoch and the
    latest iteration it adopted, or its error, which every rank raises (rank 0 its own, the
    others a CkptStoreError quoting it). Returns (rank 0: the epoch's log, others None; the
    epoch; the adopted latest iteration or None)."""
    log: EpochLog | None = None
    if group.rank == 0:
        try:
            log, adopted = claim()
            msg = _OPENED.pack(log.number, 0 if adopted is None else adopted + 1, 1)
        except Exception as e:  # every rank learns of it (none waits for a broadcast)
            group.broadcast(_OPENED.pack(0, 0, 0) + f"{type(e).__name__}: {e}".encode(),
                            "the store's open")
            raise
        group.broadcast(msg, "the store's open")
    else:
        msg = group.broadcast(None, "the store's open")
        if msg[_OPENED.size - 1] != 1:
            raise CkptStoreError(f"{path}: rank 0 could not open the store for "
                                 f"writing: {msg[_OPENED.size:].decode(errors='replace')}")
    epoch, adopted_plus, _ = _OPENED.unpack_from(msg)
    return log, epoch, adopted_plus - 1 if adopted_plus else None


def stream_features(layout: JobLayout, epoch: int, requested: str) -> str:
    """The ``features`` of the stream a rank creates for ``epoch``: those of the job's oldest
    earlier stream that has a readable STORE file (a store keeps the features it was created
    with: a job that began compatible stays readable by older releases), else ``requested``.
    StoreFeaturesError when ``requested`` is "compatible" and the earlier streams have
    features."""
    try:
        names = sorted(os.listdir(layout.streams_dir))
    except FileNotFoundError:
        names = []
    for name in names:
        head, _, _ = name.partition("-")
        if not head.isdigit() or not 0 < int(head) < epoch:
            continue
        try:
            flags = read_store_header(Layout(os.path.join(layout.streams_dir, name))).flags
        except (CkptStoreError, OSError):
            continue  # a stream whose open failed, or damaged: the next one says
        if flags and requested == "compatible":
            raise StoreFeaturesError(
                f"{layout.root}: its streams were created with format features "
                f"{', '.join(feature_names(flags))} (stream {name}; format-spec/format.md §4), "
                "which ckptstore releases without them cannot read; features are chosen when "
                "a store is created and never removed")
        return "current" if flags else "compatible"
    return requested


@dataclass(frozen=True)
class StreamOptions:
    """What a writer opens each of its streams with (at open, and after each of its gcs)."""

    chunk_size: int | None
    segment_size: int | None
    evict_written: bool
    direct_io: bool | str
    host_budget: int | None
    max_inflight: int | None
    features: str

    def open(self, layout: JobLayout, epoch: int, rank: int, header: StoreHeader, ops: FileOps,
             load_threads: int, commit_round: Callable[..., Any], remote: dict) -> Store:
        """Create and open ``rank``'s stream of ``epoch`` for writing; sizes not given are the
        job's (``header``, its STORE file's), features :func:`stream_features`; ``remote``:
        the remote tier's stream options (empty without one)."""
        return Store(layout.stream_dir(epoch, rank), "a",
                     chunk_size=self.chunk_size or header.chunk_size,
                     segment_size=self.segment_size or header.segment_size,
                     file_ops=ops, load_threads=load_threads,
                     evict_written=self.evict_written, direct_io=self.direct_io,
                     host_budget=self.host_budget,
                     features=stream_features(layout, epoch, self.features),
                     max_inflight=self.max_inflight, commit_round=commit_round, **remote)


def open_streams(group: RankGroup, path: str, open_own: Callable[[], Store],
                 store_id: Callable[[], bytes]) -> Store:
    """Collective, step 3: every rank opens its stream (``open_own``) and the ranks exchange the
    store id each sees (``store_id()``, read after ``open_own``) or their error. Returns this
    rank's stream once every rank opened one in the same store; else raises on every rank,
    naming each failed rank (StoreFeaturesError when this rank's failure was one), or
    RankMismatchError when the ranks see different stores."""
    own: Store | None = None
    error = b""
    own_error: BaseException | None = None
    try:
        own = open_own()
    except Exception as e:  # noqa: BLE001 - told to every rank below, then raised
        error = f"rank {group.rank}: {type(e).__name__}: {e}".encode()
        own_error = e
    try:
        ids = group.all_gather(error or store_id(), "the streams' open")
        failed = [m.decode(errors="replace") for m in ids if len(m) != 16]
        if failed:
            message = f"{path}: a rank could not open its stream: " + "; ".join(failed)
            if isinstance(own_error, StoreFeaturesError):
                raise StoreFeaturesError(message) from own_error
            raise CkptStoreError(message)
        if any(m != ids[0] for m in ids):
            raise RankMismatchError(f"{path}: the ranks see different stores (store ids "
                                    f"{[m.hex() for m in ids]}): is the directory shared?")
    except BaseException:
        if own is not None:  # (its LOCK released: the job can be opened again)
            try:
                own.close()
            except CkptStoreError:
                pass
        raise
    assert own is not None
    return own
