"""The reader's engine (mode "r"): never writes anything under the store directory.

It reads the writer's index read-only when that validates against the log and scans only the log
after it, or else builds an in-memory index by scanning the whole log (format-spec/format.md §16,
§18). It follows the writer by catching up with the log (:meth:`ReaderEngine.refresh`), and a gc
by starting over when the segments it was built from change.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ..errors import (CkptStoreError, DamagedCheckpointError, IndexUnusable, NotFoundError,
                      StoreIOError, StoreNotFoundError)
from ..storage.index import CommitEntry, Index, MemoryIndex, Position
from ..storage.reader_index import IndexSnapshot, ReaderIndex
from ..storage.log import Log
from ..storage.store_file import read_store_header
from .engine import Engine

#: Scans a reader starts over when a concurrent gc deletes a segment under it.
READER_RETRIES = 3


class ReaderEngine(Engine):
    """A read-only view of a store directory that any number of processes may hold."""

    mode = "r"

    def __init__(self, path: str, *, load_threads: int = 2, use_index: bool = True) -> None:
        super().__init__(path, load_threads=load_threads)
        #: start from the writer's index when it validates (False: always scan the log)
        self.use_index = use_index
        #: iterations a warm view held that the scan after its fallback does not commit (their
        #: records in the log are damaged or cut): reported as damaged, not as missing
        self._index_only: set[int] = set()
        try:
            if not os.path.exists(self.layout.store_file):
                raise StoreNotFoundError(
                    f"no ckptstore store at {self.path} (missing {self.layout.store_file})")
            self.header = read_store_header(self.layout)
            self.chunk_size = self.header.chunk_size
            self.segment_size = self.header.segment_size
            self.log = self._open_log()
            self._catch_up(reset=True)
        except BaseException:
            self._release()
            raise

    def _open_log(self) -> Log:
        """The log this reader reads (a remote reader's reads its segments from an object
        store: ckptstore/remote/reader.py)."""
        return Log(self.layout, self.header.store_id, framing_checks=self.header.framing_checks)

    # ---- the view --------------------------------------------------------------------------
    def _warm_view(self, live: list[int]) -> tuple[Index, Position | None]:
        """A new view: the writer's index read-only when it validates against the segments
        ``live`` (the scan then starts at its position), else an empty MemoryIndex (full scan).
        Never creates or changes a file (format-spec §16 "Readers")."""
        snap = IndexSnapshot.open(self.layout.index_dir, self.header.store_id) \
            if self.use_index else None
        if snap is not None:
            index = ReaderIndex(snap, self.header.store_id,
                                lambda loc: self.log.read_payload(loc))
            if index.validate(live):
                return index, index.position()
            index.close()
        return MemoryIndex(), None

    def _catch_up(self, reset: bool = False) -> None:
        """Catch the view up with the log (``reset``: build a new view first).

        One directory listing decides both whether a gc happened (the live segments up to the
        index's position differ from those the index was built from: start over) and what is
        scanned, so a gc completing in between cannot mix two segment sets. A gc that deletes a
        segment after that listing makes the scan fail with ENOENT; the scan then starts over on
        a fresh listing (a few times: each retry needs another gc to race it). A warm view whose
        index turns out unusable is replaced by a full scan into memory."""
        for attempt in range(READER_RETRIES):
            try:
                live = self.log.refresh_segments()
                start = self.index.position()
                if isinstance(self.index, ReaderIndex) and self.index.revoked:
                    reset = True  # try a new warm view (the writer that revoked it may be gone)
                if not reset and start is not None:
                    segs = self.index.segments()
                    reset = segs is None or tuple(s for s in live if s <= start.seq) != segs
                if reset:
                    self._index_only = set()
                    self.index.close()
                    self.index = MemoryIndex()  # never left pointing at a closed view
                    self.index, start = self._warm_view(live)
                    reset = False
                try:
                    self.last_scan = self.log.scan(self.index, start, live=live)
                except IndexUnusable as e:
                    self.warn_damaged_index(e, "reading from the log instead")
                    self._go_cold()
                    self.last_scan = self.log.scan(self.index, None, live=live)
                if isinstance(self.index, ReaderIndex):
                    self.index.renew(live)
                return
            except (FileNotFoundError, StoreIOError) as e:
                if not caused_by_missing_file(e) or attempt == READER_RETRIES - 1:
                    raise
                reset = True

    def _go_cold(self) -> None:
        """Drop the warm view for an empty MemoryIndex (the caller scans the log)."""
        self.index.close()
        self.index = MemoryIndex()

    def _fall_back(self) -> bool:
        """The warm view failed a check: scan the whole log into memory. False when there was no
        warm view (the failure is not the index's)."""
        with self._mutex:
            if not isinstance(self.index, ReaderIndex):
                return False
            try:
                held = set(self.index.iterations())
            except (CkptStoreError, OSError):
                held = set()
            self._go_cold()
            self._catch_up()
            self._index_only = held - set(self.index.iterations())
            return True

    def refresh(self) -> None:
        """Pick up checkpoints committed since open (and follow a gc)."""
        with self._mutex:
            self.check_open()
            self._catch_up()

    # ---- look-ups ------------------------------------------------------------------------------
    def sync_view(self) -> None:
        self.refresh()

    def indexed(self, lookup: Callable[[], Any]) -> Any:
        try:
            return lookup()
        except IndexUnusable as err:
            if not self._fall_back():
                raise
            out = lookup()
            damage = getattr(err, "log_damage", None)
            if out is None and damage is not None:
                # the index names a commit whose record the log holds damaged: a scan does not
                # commit it, but the caller asked for a checkpoint that was written
                raise DamagedCheckpointError(damage) from err
            self.warn_damaged_index(err, "reading from the log instead")
            return out

    def entry(self, iteration: Any) -> CommitEntry:
        """As :meth:`Engine.entry`, catching up with the log once before answering "missing"."""
        self.check_open()
        if type(iteration) is int:
            e = self.indexed(lambda: self.index.get_commit(iteration))
            if e is None:
                self.refresh()
                e = self.indexed(lambda: self._lookup_checked(iteration))
            if e is not None:
                return e
        raise self.missing(iteration)

    def missing(self, iteration: Any) -> Exception:
        if iteration in self._index_only:
            return DamagedCheckpointError(
                f"iteration {iteration}: the index names it committed, but the log in {self.path} "
                "holds no valid commit of it (its records are damaged or cut)")
        return super().missing(iteration)

    def read(self, fn: Callable[[], Any]) -> Any:
        """A read that fails because gc deleted a segment refreshes and retries; one that fails on
        a warm index's value, or on what it located, drops the warm view for a full scan into
        memory and retries (once), so only damage in the log reaches the caller."""
        fell_back = refreshed = False
        damage: DamagedCheckpointError | None = None
        cause: BaseException | None = None  # what made the reader drop its warm view
        for attempt in range(READER_RETRIES):
            try:
                out = fn()
                if cause is not None:  # it was the index after all
                    self.warn_damaged_index(cause, "read from the log instead")
                return out
            except CkptStoreError as e:
                if isinstance(e, NotFoundError) and damage is not None:
                    # the index named a checkpoint whose records the log holds damaged (a full
                    # scan does not commit it): report the damage, not a missing iteration
                    raise damage from e
                if attempt == READER_RETRIES - 1:
                    raise
                if caused_by_missing_file(e) and not refreshed:
                    # a gc deleted a segment under us: catch up (a new view of the new segments)
                    refreshed = True
                    self.refresh()
                elif caused_by_missing_file(e) and not fell_back:
                    # missing again after catching up: not a gc but a location the log does not
                    # have (a damaged index value): drop the warm view for a scan into memory
                    fell_back, cause = True, e
                    if not self._fall_back():
                        raise
                elif isinstance(e, (IndexUnusable, DamagedCheckpointError)) and not fell_back:
                    fell_back, cause = True, e
                    if isinstance(e, DamagedCheckpointError):
                        damage = e
                    if not self._fall_back():
                        raise
                else:
                    raise
        raise AssertionError("unreachable")


def caused_by_missing_file(e: BaseException | None) -> bool:
    """Whether ``e`` (or an error it was raised from) is a missing file: ENOENT."""
    while e is not None:
        if isinstance(e, FileNotFoundError) or (isinstance(e, StoreIOError) and e.errno == 2):
            return True
        e = e.__cause__
    return False
