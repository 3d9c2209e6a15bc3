"""The engine: one open store directory -- its header, log and index -- behind one lock.

:class:`Engine` holds what writers and readers share: the STORE header, the :class:`Log`, the
current :class:`Index` (the cache of the log), the mutex every operation on them takes
(:meth:`Engine.locked`), and the look-ups a load needs (commit entries, chains, manifests, state
reads). Its two kinds differ in how the index is kept true to the log:

* :class:`~ckptstore.engine.writer_engine.WriterEngine` (mode "a") holds the writer lock, runs
  crash recovery on open, owns the one open :class:`~ckptstore.engine.transaction.Transaction`
  and rebuilds the index from the log when a value turns out wrong;
* :class:`~ckptstore.engine.reader_engine.ReaderEngine` (mode "r") never writes under the store:
  it reads the writer's index read-only when it validates, else scans the log into memory, and
  follows the writer (and gc) by catching up with the log.

Words used with one meaning each: a *scan* reads the log and feeds the index (at open, on
catch-up, in fsck); *recovery* is what a writer does after a crash or a failed write (scan, cut
the uncommitted tail, reopen the log for appending); *replay* is re-executing optimizer steps
(:mod:`ckptstore.replay`), never done here.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from ..errors import DamagedIndexWarning, DeltaChainError, NotFoundError, StoreClosedError
from ..format.commit import KIND_DELTA
from ..format.header import StoreHeader
from ..format.manifest import Manifest, TensorEntry
from ..format.tree import Tree
from ..storage.fileops import FileOps
from ..storage.index import CommitEntry, Index, MemoryIndex
from ..storage.layout import Layout
from ..storage.log import Log, ScanReport
from .read_path import StateReader, read_manifest, read_tree

DEFAULT_CHUNK_SIZE = 4 << 20
DEFAULT_SEGMENT_SIZE = 1 << 30


class Engine:
    """An open store directory (see the module docstring). Not used directly: open a
    :class:`WriterEngine` or a :class:`ReaderEngine`."""

    mode: str = ""
    header: StoreHeader
    chunk_size: int
    segment_size: int
    log: Log

    def __init__(self, path: str, *, file_ops: FileOps | None = None, load_threads: int = 2) -> None:
        self.path = path
        self.layout = Layout(path)
        self.file_ops = file_ops or FileOps()
        self.load_threads = load_threads
        self.index: Index = MemoryIndex()
        #: what the last scan of the log found (commits, damage, the tail)
        self.last_scan: ScanReport | None = None
        self._mutex = threading.RLock()
        self._closed = False
        self._warned_index = False

    # ---- the lock --------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the engine's mutex (reentrant): every change to the log, the index or the open
        transaction happens under it, and so does every read on a writer."""
        with self._mutex:
            yield

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def close(self) -> None:
        """Release the log, the index and (writers) the lock. Idempotent."""
        with self._mutex:
            self._closed = True
            self._release()

    def _release(self) -> None:
        log = getattr(self, "log", None)
        if log is not None:
            log.close()
        self.index.close()

    def warn_damaged_index(self, why: BaseException, action: str) -> None:
        """Tell the user, once per open store, that a read through the index failed and what was
        done (called only once the retry succeeded: the data was intact)."""
        if not self._warned_index:
            self._warned_index = True
            warnings.warn(f"ckptstore: a read through the index of {self.path} failed ({why}); "
                          f"{action}. Nothing is lost; `ckptstore fsck` shows what is damaged and "
                          "`ckptstore fsck --repair` rebuilds the index.",
                          DamagedIndexWarning, stacklevel=4)

    # ---- look-ups (each subclass keeps the index true to the log its own way) ----------------
    def indexed(self, lookup: Callable[[], Any]) -> Any:
        """Run an index look-up; an index that turns out unusable is repaired and the look-up
        retried (writers rebuild it, readers fall back to a scan into memory)."""
        raise NotImplementedError

    def read(self, fn: Callable[[], Any]) -> Any:
        """Run a read of checkpoint data, retried where the failure may be the index's (or, for
        readers, a concurrent gc's) rather than the log's: only damage in the log reaches the
        caller."""
        raise NotImplementedError

    def sync_view(self) -> None:
        """Before answering what is committed: readers catch up with the log, writers finish a
        recovery a failure left pending."""
        raise NotImplementedError

    def missing(self, iteration: Any) -> Exception:
        """The error for a look-up of an iteration the index does not hold."""
        return NotFoundError(f"iteration {iteration!r} is not committed in {self.path}")

    def entry(self, iteration: Any) -> CommitEntry:
        """The commit entry of a committed iteration; NotFoundError (or DamagedCheckpointError
        where the log holds it damaged) otherwise."""
        self.check_open()
        e = self.indexed(lambda: self.index.get_commit(iteration)) if type(iteration) is int else None
        if e is None and type(iteration) is int:
            e = self.indexed(lambda: self._lookup_checked(iteration))
        if e is None:
            raise self.missing(iteration)
        return e

    def _lookup_checked(self, iteration: int) -> CommitEntry | None:
        """A look-up that missed, asked again after checking that the index lost no entry (a
        damaged cache must not turn a committed iteration into a missing one)."""
        self.index.verify_complete()
        return self.index.get_commit(iteration)

    def kind_code(self, iteration: int) -> int | None:
        e = self.indexed(lambda: self.index.get_commit(iteration))
        return None if e is None else e.commit.kind

    def chain_base(self, iteration: int) -> int:
        """The base snapshot the chain ending at committed ``iteration`` starts from; raises
        DeltaChainError when the chain is broken (a predecessor is missing)."""
        base = self.indexed(lambda: self.index.chains().base(iteration))
        if base is not None:
            return base
        it = iteration  # not recoverable: find where the chain breaks, for the message
        while True:
            k = self.kind_code(it)
            if k is None:
                raise DeltaChainError(f"iteration {iteration} is not recoverable: the delta chain is "
                                      f"broken at iteration {it} (missing)")
            if k != KIND_DELTA:
                return it
            it -= 1

    def recoverable_latest(self) -> int | None:
        """The newest recoverable iteration (the chain rule of format-spec/deltas.md), O(1) from
        the index's recoverability summary."""
        return self.indexed(lambda: self.index.latest_recoverable())

    def recoverable(self) -> list[int]:
        return self.indexed(lambda: self.index.recoverable())

    def state_reader(self) -> StateReader:
        return StateReader(self.log, self.index, threads=self.load_threads)

    def load_entry(self, iteration: int, keys: Sequence[Any] | None = None,
                   progress: Callable[[int], None] | None = None,
                   into: Callable[[Any], Any] | None = None, target: Any = None) -> Any:
        """The state stored for ``iteration`` as written (a delta's record, not replayed), with
        no retry: for callers that retry a larger read themselves. ``target``: see
        :meth:`StateReader.load`."""
        return self.state_reader().load(self.entry(iteration), keys, progress, into, target)

    def manifest(self, iteration: int) -> Manifest:
        return self.read(lambda: read_manifest(self.log, self.entry(iteration)))

    def tree_of(self, tensor: TensorEntry) -> Tree:
        """The verified tree of a committed tensor (its chunk addresses)."""
        return read_tree(self.log, self.index, tensor)
