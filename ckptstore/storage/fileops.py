"""The I/O seam: every write-side system call the store makes goes through a :class:`FileOps`.

Production code uses :class:`FileOps` itself. Fault-injection tests pass a subclass that fails chosen
calls (ENOSPC, EIO, short writes, ...) without monkeypatching the standard library. Every method
wraps ``OSError`` into :class:`~ckptstore.errors.StoreIOError` (``DiskFullError`` for ENOSPC and
EDQUOT) naming the operation and the file.

Invariant (tests/test_faults.py enforces it by sweeping a fault over every call): each file or
directory the writer creates, each write, fsync (of a file or of a directory), truncate, rename and
unlink, and each commit of an LMDB index transaction, passes through exactly one ``_*`` hook below:

    _open        create/open a file for writing (segments, temp files, the lock file)
    _mkdir       create a directory (the store, segments/, index/, quarantine/)
    _pwritev     write at an offset (may be short; the caller continues)
    _fsync       fsync a file
    _fsync_dir   fsync a directory (defaults to _fsync, so older subclasses still see it)
    _ftruncate, _rename, _unlink
    _index_open  open (and create) the LMDB environment of the index
    _index_commit  commit an LMDB write transaction (LMDB's own writes and fsyncs happen here)

One more hook is advice, not I/O the store relies on: ``_advise`` (posix_fadvise DONTNEED over
bytes already written, see :meth:`FileOps.advise_written`). Its failure is swallowed, so the
sweep does not count it as a failing call; tests/test_faults.py fails it at every call of every
write path instead and checks that nothing changes.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from ..errors import DiskFullError, StoreIOError

_FULL = {errno.ENOSPC, errno.EDQUOT}
#: The open flag of direct I/O (0 where the platform has none: macOS, Windows).
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def skip_bytes(views: Sequence[memoryview], n: int) -> list[memoryview]:
    """What is left of ``views`` (byte views, written in order) after their first ``n`` bytes."""
    rest: list[memoryview] = []
    for b in views:
        if n >= len(b):
            n -= len(b)
            continue
        rest.append(b[n:])
        n = 0
    return rest


def wrap_os_error(operation: str, path: str, err: OSError) -> StoreIOError:
    cls = DiskFullError if err.errno in _FULL else StoreIOError
    return cls(operation, path, err)


@contextmanager
def io_errors(operation: str, path: str) -> Iterator[None]:
    """Turn an OSError raised inside the block into a StoreIOError naming ``operation`` and ``path``."""
    try:
        yield
    except OSError as e:
        if isinstance(e, StoreIOError):
            raise
        raise wrap_os_error(operation, path, e) from e


def _unless_refused(operation: str, path: str, call: Callable[..., int], *args: Any) -> int | None:
    """``call(*args)``, or None when it fails with EINVAL (the file system refuses O_DIRECT);
    any other OSError becomes a StoreIOError naming ``operation`` and ``path``."""
    try:
        with io_errors(operation, path):
            return call(*args)
    except StoreIOError as e:
        if e.errno == errno.EINVAL:
            return None
        raise


class FileOps:
    """Write-side file system calls. Subclass and override the underscore hooks (``_open``,
    ``_pwritev``, ``_fsync``, ...) to inject faults."""

    def open_append(self, path: str, create: bool) -> int:
        flags = os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        with io_errors("create" if create else "open", path):
            return self._open(path, flags, 0o644)

    def open_direct(self, path: str) -> int | None:
        """A second, O_DIRECT write descriptor of the existing ``path`` (ckptstore/storage/direct.py),
        or None where the platform or the file system refuses O_DIRECT (EINVAL)."""
        if not O_DIRECT:
            return None
        return _unless_refused("open (O_DIRECT)", path, self._open,
                               path, os.O_WRONLY | os.O_CLOEXEC | O_DIRECT, 0o644)

    def open_truncate(self, path: str) -> int:
        """Create (or empty) ``path`` for writing: temp files and quarantine copies."""
        with io_errors("create", path):
            return self._open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

    def open_lock(self, path: str) -> int:
        """Open (creating it if needed) the writer lock file; the caller flocks the descriptor."""
        with io_errors("open lock file", path):
            return self._open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def makedirs(self, path: str) -> None:
        """Create ``path`` and missing parents; an existing directory is fine."""
        with io_errors("create directory", path):
            if not os.path.isdir(path):
                self._mkdir(path)

    def writev(self, fd: int, path: str, buffers: Sequence[bytes | memoryview], offset: int) -> None:
        """Write all of ``buffers`` at ``offset``; retries short writes until done."""
        views = [memoryview(b).cast("B") for b in buffers]  # lengths in bytes, whatever the format
        total = sum(len(b) for b in views)
        with io_errors("write", path):
            n = done = self._pwritev(fd, views, offset)
            while done < total:  # short write: continue with the remainder
                if n == 0:
                    raise OSError(errno.EIO, "write returned 0 bytes")
                # ``views`` starts where the previous call started: skip what that call wrote
                views = skip_bytes(views, n)
                n = self._pwritev(fd, views, offset + done)
                done += n

    def write_direct(self, fd: int, path: str, buffer: memoryview | Sequence[memoryview],
                     offset: int) -> int | None:
        """One O_DIRECT write of ``buffer`` (aligned address, length and offset), or of several
        such buffers in order as one vectored write, at ``offset``. Returns the bytes written
        (fewer than asked only when the device stopped short; the caller writes the rest through
        its buffered descriptor, which reports the cause), or None when the file system refuses
        O_DIRECT writes (EINVAL: nothing was written)."""
        views = [buffer] if isinstance(buffer, memoryview) else list(buffer)
        return _unless_refused("write (O_DIRECT)", path, self._pwritev, fd, views, offset)

    def fsync(self, fd: int, path: str) -> None:
        with io_errors("fsync", path):
            self._fsync(fd)

    def fsync_dir(self, path: str) -> None:
        with io_errors("directory fsync", path):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                self._fsync_dir(fd)
            finally:
                os.close(fd)

    def truncate(self, fd: int, path: str, length: int) -> None:
        with io_errors("truncate", path):
            self._ftruncate(fd, length)

    def rename(self, src: str, dst: str) -> None:
        with io_errors("rename", f"{src} -> {dst}"):
            self._rename(src, dst)

    def unlink(self, path: str) -> None:
        with io_errors("unlink", path):
            self._unlink(path)

    def advise_written(self, fd: int, path: str, offset: int, length: int) -> bool:
        """Advice, never an error: tell the kernel that ``length`` bytes at ``offset`` of ``fd``
        (already written) will not be read soon (POSIX_FADV_DONTNEED). Linux starts writeback of
        the dirty pages and drops the clean ones; dirty data is never discarded, so no outcome of
        this call can lose or change a byte. Returns False when the advice failed or is not
        available (the OSError is swallowed). ``path`` is for subclasses that log or observe."""
        if length <= 0:  # posix_fadvise reads length 0 as "to the end of the file"
            return False
        try:
            self._advise(fd, offset, length)
        except OSError:
            return False
        return True

    def write_file(self, path: str, data: bytes | memoryview) -> None:
        """Create (or empty) ``path``, write ``data``, fsync it (the name is durable only after
        the caller fsyncs the directory)."""
        fd = self.open_truncate(path)
        try:
            self.writev(fd, path, [data], 0)
            self.fsync(fd, path)
        finally:
            os.close(fd)

    def write_file_atomic(self, path: str, data: bytes) -> None:
        """temp file -> write -> fsync -> rename over ``path`` -> fsync the directory."""
        tmp = f"{path}.tmp"
        self.write_file(tmp, data)
        self.rename(tmp, path)
        self.fsync_dir(os.path.dirname(path) or ".")

    def index_open(self, path: str, **options: Any) -> Any:
        """Open the LMDB environment at ``path`` (lmdb errors propagate; the index classifies them)."""
        with io_errors("open index", path):
            return self._index_open(path, options)

    def index_commit(self, txn: Any, path: str) -> None:
        """Commit an LMDB write transaction of the index at ``path``. On failure the transaction
        is aborted (nothing of it is applied) and the error propagates."""
        try:
            with io_errors("index commit", path):
                self._index_commit(txn)
        except BaseException:
            try:
                txn.abort()  # a no-op when LMDB already freed the transaction
            except Exception:  # noqa: BLE001 - the original error matters, not the abort's
                pass
            raise

    # Hooks (override in fault-injection tests).
    def _open(self, path: str, flags: int, mode: int) -> int:
        return os.open(path, flags, mode)

    def _mkdir(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def _fsync_dir(self, fd: int) -> None:
        self._fsync(fd)

    def _index_open(self, path: str, options: dict) -> Any:
        import lmdb

        return lmdb.open(path, **options)

    def _index_commit(self, txn: Any) -> None:
        txn.commit()

    def _advise(self, fd: int, offset: int, length: int) -> None:
        if not hasattr(os, "posix_fadvise"):  # macOS: no such call; the advice is simply skipped
            raise OSError(errno.ENOSYS, "posix_fadvise is not available")
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def _pwritev(self, fd: int, buffers: Sequence[bytes | memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def _fsync(self, fd: int) -> None:
        os.fsync(fd)

    def _ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def _rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def _unlink(self, path: str) -> None:
        os.unlink(path)


OsFileOps = FileOps
