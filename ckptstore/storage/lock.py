"""The writer lock: one exclusive ``flock`` on the store's LOCK file.

:class:`WriterLock` is the only code that takes or releases it, and one ``WriterLock`` object
(owned by the writer's :class:`~ckptstore.engine.writer_engine.WriterEngine`) holds it for the
writer's lifetime. Closing the descriptor drops the lock, so a writer that dies releases it too.
:func:`no_writer` is the shared probe for tools that must read files only a live writer changes
(fsck reading the LMDB index without LMDB's own lock file).

``flock`` is local to one machine: it does not exclude a writer on another host that shares the
directory over NFS or Lustre (format-spec/format.md, assumption A1).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from typing import Iterator

from ..errors import StoreLockedError
from .fileops import FileOps
from .layout import Layout


class WriterLock:
    """The single-writer lock of one store directory."""

    def __init__(self, layout: Layout, ops: FileOps) -> None:
        self.layout = layout
        self._ops = ops
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise StoreLockedError at once (never waits)."""
        if self._fd is not None:
            return
        fd = self._ops.open_lock(self.layout.lock_file)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLockedError(
                f"{self.layout.root} is already open for writing by another process (lock "
                f"{self.layout.lock_file}); open it with mode=\"r\" to read while that writer "
                "runs") from None
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock


@contextmanager
def no_writer(layout: Layout) -> Iterator[str]:
    """Hold a shared lock on LOCK while no writer runs, for a read that must not race one.

    Yields "free" (no writer: the shared lock is held for the block), "locked" (a writer holds
    the store) or "absent" (no LOCK file: no writer ever opened the store). Writes nothing."""
    try:
        fd = os.open(layout.lock_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        yield "absent"
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            yield "locked"
            return
        yield "free"
    finally:
        os.close(fd)
