"""The rank streams a job store reads from, each checked against the global commit that names
it (format-spec/format.md §22: a global commit records, per rank, the stream COMMIT it made
visible; a read of that rank's records at that iteration must find exactly that COMMIT)."""

from __future__ import annotations

import os
from typing import Any, Callable

from ..errors import CkptStoreError, DamagedCheckpointError, NotFoundError
from ..format.job import GlobalCommit
from ..storage.job_log import JobLayout
from ..store import Store


class StreamReaders:
    """Read-only stores of a job's rank streams, by (epoch, rank), opened on first use and kept
    until :meth:`close`. ``source`` opens one instead of the stream directory (a remote job's
    lazy reader, ckptstore/remote/job_pull.py)."""

    def __init__(self, layout: JobLayout, load_threads: int,
                 source: Callable[[int, int], Store] | None = None) -> None:
        self.layout = layout
        self.load_threads = load_threads
        self.source = source
        self.readers: dict[tuple[int, int], Store] = {}
        #: what the streams opened from ``source`` and closed since fetched (remote_stats)
        self.retired: list[Any] = []

    def open(self, epoch: int, rank: int) -> Store:
        """``rank``'s stream of ``epoch`` (DamagedCheckpointError: missing or unreadable)."""
        store = self.readers.get((epoch, rank))
        if store is None and self.source is not None:
            store = self.readers[(epoch, rank)] = self.source(epoch, rank)
        if store is None:
            where = self.layout.stream_dir(epoch, rank)
            if not os.path.isdir(where):
                raise DamagedCheckpointError(f"{self.layout.root}: rank {rank}'s stream {where} "
                                             f"(epoch {epoch}) is missing")
            try:
                store = Store(where, "r", load_threads=self.load_threads)
            except CkptStoreError as e:
                raise DamagedCheckpointError(f"{self.layout.root}: rank {rank}'s stream {where} "
                                             f"cannot be opened: {e}") from e
            self.readers[(epoch, rank)] = store
        return store

    def remote_stats(self) -> list[Any]:
        """What each stream opened from ``source`` fetched from the object store
        (:meth:`ckptstore.Store.remote_read_stats`): those closed first, then the open ones by
        (epoch, rank); none without a source."""
        if self.source is None:
            return []
        return self.retired + [self.readers[k].remote_read_stats() for k in sorted(self.readers)]

    def refresh(self) -> None:
        for s in self.readers.values():
            s.refresh()

    def retain(self, epochs: set[int]) -> None:
        """Close the streams of every epoch not in ``epochs`` (no longer on the job's chain)."""
        self._close([k for k in self.readers if k[0] not in epochs])

    def close(self) -> None:
        """Close every stream read so far (errors closing a reader are of no consequence)."""
        self._close(list(self.readers))

    def _close(self, keys: list[tuple[int, int]]) -> None:
        """Close the streams of ``keys``; what they fetched from a source still counts
        (:meth:`remote_stats`)."""
        for k in keys:
            store = self.readers.pop(k)
            if self.source is not None:
                self.retired.append(store.remote_read_stats())
            try:
                store.close()
            except CkptStoreError:
                pass


def check_stream(store: Store, g: GlobalCommit, rank: int, path: str, where: str) -> Store:
    """``store`` (``rank``'s stream of ``g.epoch``, at ``where``) once its COMMIT of ``g.iteration`` is the one
    ``g`` records: DamagedCheckpointError, naming the rank and the stream, when it is missing
    or differs. A reader's stream is refreshed once first when it lacks the commit."""
    iteration, expected = g.iteration, g.ranks[rank]
    for attempt in range(2):
        try:
            # the own stream: its persister learns a global commit inside the stream's
            # transaction, before that transaction indexes it; the engine's lock waits for it
            with store.engine.locked():
                entry = store.engine.entry(iteration)
        except NotFoundError:
            if attempt == 0 and store.mode == "r":
                store.refresh()
                continue
            raise DamagedCheckpointError(
                f"{path}: iteration {iteration} is committed globally, but rank {rank}'s "
                f"stream {where} holds no commit of it") from None
        if entry.commit != expected.commit or (entry.loc.seq, entry.loc.offset) != \
                (expected.commit_seq, expected.commit_offset):
            raise DamagedCheckpointError(
                f"{path}: rank {rank}'s stream {where} commits iteration {iteration} "
                f"differently from the global commit (segment {entry.loc.seq} offset "
                f"{entry.loc.offset}, expected segment {expected.commit_seq} offset "
                f"{expected.commit_offset})")
        break
    return store
