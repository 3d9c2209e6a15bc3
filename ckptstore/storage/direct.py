"""Direct appends: file bytes staged in an aligned buffer and written with O_DIRECT.

A buffered ``pwrite`` copies every byte into page-cache pages the kernel must first allocate,
and on VMs that hand freed guest memory back to the host that costs 3-5x the copy itself
(``../shared/MEASUREMENTS.md``; issue 18 measured 95 ms per 77 MB delta). An O_DIRECT write
moves the bytes from the caller's memory to the device without the page cache, but only in whole
blocks: the buffer's address, the length and the file offset must all be multiples of the
block size. A log's records have any length, so they cannot be written straight from the
tensors; they are copied (GIL released) into one reused, page-aligned :class:`StagingBuffer`
that mirrors the file's bytes from the last block boundary, and the full blocks go out with
O_DIRECT.

**Two-stage overlap.** The buffer has two regions. When the region being filled is full, a
background thread writes it with O_DIRECT while the appender fills the other one (the copy and
the hash run while the device writes), so a long append runs at the device's speed rather than
copy time plus write time. At most one write is in flight, and every other file operation of the
appender (a partial-block write, a flush, a cut, a close) first waits for it (:meth:`settle`), so
the file sees the same writes, in the same order, as with one region.

Invariants of :class:`DirectAppender` (``base`` is always a multiple of :data:`ALIGN`):

* the stage holds exactly the file's intended bytes ``[base, end)``: everything appended and
  not yet in a full block written out, plus the head of the partial block at ``base``;
* every byte before ``base`` has been written to the file (O_DIRECT, or buffered as a fallback);
* after :meth:`DirectAppender.flush` every byte before ``end`` is in the file too: the partial
  last block goes through the ordinary (buffered) descriptor at its exact offset, so the file
  never holds padding past the last record and its size is the log's end, exactly as with
  buffered appends;
* **no write covers a byte already in the file** (``in_file``): when the first staged block
  starts before ``in_file`` (the partial block a flush or a reopen left), only its new bytes are
  written, buffered, and O_DIRECT starts at the next block boundary. Rewriting the block whole,
  even with identical bytes, would put the committed records at its head at risk: a power loss
  during a write may leave garbage over the written range (format-spec A2/A3), while bytes no
  write touches stay put (A5). Found by the power-loss simulation (tests/test_powerloss.py);
* a background write that fails loses the bytes from its start (``lost``): its error is raised by
  the appender's next operation, and until a cut goes back to that start (a rollback of the
  transaction that staged them) every append, and any cut to a later offset, raises it again, so
  no record after a hole can ever be committed. (A synchronous write that fails keeps its bytes
  staged instead; the one case that differs is a pending delta group, format-spec/deltas.md,
  whose later delta's failure then aborts the group, as a failed cut does.)
* nothing about the format or the commit protocol changes: the bytes, their order and the
  points where they are made durable (the writer's fsync calls) are those of buffered appends.
  Bytes appended and not yet flushed live only in memory, which is what an unsynced buffered
  append promises as well: nothing before a sync is durable (format-spec/format.md, A2-A4).

Where the file system refuses O_DIRECT (tmpfs on older kernels, some FUSE or network mounts),
opening or writing reports EINVAL and the appender falls back to buffered writes of the same
bytes from then on.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import deque
from typing import Callable

import numpy as np

from .fileops import O_DIRECT, FileOps, skip_bytes

#: Buffers per vectored O_DIRECT write of :meth:`put_aligned` (well under IOV_MAX, 1024)
IOV_BATCH = 256
#: Alignment of O_DIRECT buffers, lengths and offsets: the page size, which is a multiple of every
#: logical block size Linux devices use (512 or 4096).
ALIGN = 4096
#: Bytes staged before a write: large enough that one write per 8 MiB costs little in system calls,
#: small enough to stay a fixed, reused allocation per writer.
STAGE_CAPACITY = 8 << 20
#: A staging buffer's writer thread exits after this many seconds without a write to do.
_WRITER_IDLE_S = 5.0
#: Below this, a copy holds the GIL (a memoryview assignment); above it numpy releases it.
_SMALL_COPY = 16 << 10



def supported() -> bool:
    """Whether this platform has O_DIRECT at all (Linux, FreeBSD; not macOS)."""
    return O_DIRECT != 0


class StagingBuffer:
    """Page-aligned anonymous memory, allocated once and reused by every writer of a log: one
    region of ``capacity`` bytes, or two (``overlap``: one is written while the other fills).

    The memory is mapped at the first append that stages bytes (:attr:`views`, :attr:`arrays`),
    not when the log opens, and its pages are not touched ahead: each is faulted in by the first
    append that fills it. A restarted trainer opens its store and restores before it writes
    anything, and touching 16 MiB of fresh pages at open cost 10-18 ms of every resume
    (2026-11-30: ckptstore.open 11.7 -> 1.9 ms on a quiet 2-core VM); and a writer whose large
    records go straight from their own memory (chunk images, lent tensors) stages only framing,
    trees, manifests and commits, which use the regions' first pages alone."""

    def __init__(self, capacity: int | None = None, overlap: bool = True) -> None:
        capacity = STAGE_CAPACITY if capacity is None else capacity  # (read now: tests shrink it)
        if capacity <= 0 or capacity % ALIGN:
            raise ValueError(f"staging capacity must be a positive multiple of {ALIGN}")
        self.capacity = capacity
        self._regions = 2 if overlap else 1
        self._views: list[memoryview] | None = None
        self._arrays: list[np.ndarray] = []
        self._worker_pid = -1  # (the writer thread's state is made by submit, per process)
        self._jobs: deque[_BackgroundWrite] = deque()
        self._cv = threading.Condition()
        self._worker: threading.Thread | None = None

    @property
    def overlap(self) -> bool:
        return self._regions == 2

    @property
    def allocated(self) -> bool:
        """Whether the regions' memory has been made (by the first append that staged bytes)."""
        return self._views is not None

    @property
    def views(self) -> list[memoryview]:
        """The regions' memory (made on first use; only the appending thread asks)."""
        return self._memory()[0]

    @property
    def arrays(self) -> list[np.ndarray]:
        """The regions as numpy arrays (the same memory as :attr:`views`)."""
        return self._memory()[1]

    def _memory(self) -> tuple[list[memoryview], list[np.ndarray]]:
        if self._views is None:
            maps = [mmap.mmap(-1, self.capacity) for _ in range(self._regions)]  # page-aligned
            self._arrays = [np.frombuffer(m, dtype=np.uint8) for m in maps]
            self._views = [memoryview(m) for m in maps]
        return self._views, self._arrays

    def submit(self, job: "_BackgroundWrite") -> None:
        """Run ``job`` on this buffer's writer thread. The thread is started on demand and exits
        after :data:`_WRITER_IDLE_S` without work (a buffer no longer used leaves no thread
        behind); a forked child, which inherits no threads, starts afresh."""
        if self._worker_pid != os.getpid():
            self._jobs, self._cv, self._worker = deque(), threading.Condition(), None
            self._worker_pid = os.getpid()
        with self._cv:
            self._jobs.append(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, daemon=True,
                                                name="ckptstore-direct-write")
                self._worker.start()
            else:
                self._cv.notify()

    def _serve(self) -> None:
        while True:
            with self._cv:
                if not self._jobs:
                    self._cv.wait(_WRITER_IDLE_S)
                    if not self._jobs:  # idle: exit (submit starts another, under the same lock)
                        self._worker = None
                        return
                job = self._jobs.popleft()
            job.run()


class _BackgroundWrite:
    """One O_DIRECT write of ``view`` at ``lo`` (its end ``hi``), the part O_DIRECT did not
    write going through the buffered descriptor, run by the buffer's writer thread. Its outcome
    is read by :meth:`DirectAppender.settle` after ``done``; it touches no appender state."""

    def __init__(self, appender: "DirectAppender", view: memoryview, lo: int) -> None:
        self.done = threading.Event()
        self.appender = appender
        self.view = view
        self.lo = lo
        self.hi = lo + len(view)
        self.direct_bytes = 0
        self.refused = False
        self.error: BaseException | None = None

    def run(self) -> None:
        a = self.appender
        try:
            got = a.ops.write_direct(a.direct_fd, a.path, self.view, self.lo)
            if got is None:  # refused: this file system does not do O_DIRECT
                self.refused = True
                got = 0
            self.direct_bytes = got
            if got < len(self.view):
                a.ops.writev(a.fd, a.path, [self.view[got:]], self.lo + got)
        except BaseException as e:  # noqa: BLE001 - raised on the appender's thread by settle()
            self.error = e
        finally:
            self.done.set()


class DirectAppender:
    """Appends to one file through a :class:`StagingBuffer`, see the module docstring.

    ``fd`` is the file's ordinary write descriptor (partial blocks, fallback), ``direct_fd`` its
    O_DIRECT one; ``end`` is the file's logical end when the appender takes over.
    """

    def __init__(self, path: str, fd: int, direct_fd: int, ops: FileOps, stage: StagingBuffer,
                 end: int) -> None:
        self.path = path
        self.fd = fd
        self.direct_fd = direct_fd
        self.ops = ops
        self.stage = stage
        self.base = end - end % ALIGN
        self.fill = end - self.base
        #: the stage's head ``[base, base + fill)`` holds the file's bytes (False after a reopen
        #: or a cut before ``base``, until they are read back from the file)
        self._loaded = self.fill == 0
        #: the file holds the intended bytes before this offset; no write covers them again
        self.in_file = end
        #: bytes written with O_DIRECT (the rest went through the buffered descriptor)
        self.direct_bytes = 0
        #: the region of ``stage`` being filled (the other may be in flight)
        self._region = 0
        self._inflight: _BackgroundWrite | None = None
        #: (offset, error) of a background write that failed: bytes from offset never reached
        #: the file, though the writer counts them appended (module docstring)
        self._lost: tuple[int, BaseException] | None = None

    @property
    def _view(self) -> memoryview:
        return self.stage.views[self._region]

    @property
    def end(self) -> int:
        return self.base + self.fill

    @property
    def active(self) -> bool:
        """False once the file system refused O_DIRECT (the caller appends buffered from then)."""
        return self.direct_fd >= 0

    def put(self, data: bytes | memoryview, update: Callable[[memoryview], None] | None = None
            ) -> None:
        """Append ``data``; ``update`` (a hash's update) sees each staged piece, so a checksum
        is computed over the bytes as they will be written, while they are in cache."""
        src = memoryview(data).cast("B")
        n = len(src)
        pos = 0
        self._refuse_after_loss()
        if not self._loaded:
            self._load()
        stage = self.stage
        while pos < n:
            if self.fill == stage.capacity:
                self._hand_off()
            k = min(stage.capacity - self.fill, n - pos)
            dst = slice(self.fill, self.fill + k)
            if k >= _SMALL_COPY:
                np.copyto(stage.arrays[self._region][dst],
                          np.frombuffer(src[pos:pos + k], dtype=np.uint8))
            else:
                self._view[dst] = src[pos:pos + k]
            if update is not None:
                update(self._view[dst])
            self.fill += k
            pos += k

    def flush(self) -> None:
        """Write every staged byte: full blocks with O_DIRECT, the partial last block buffered
        (kept staged: the next write sends its new bytes only). No fsync."""
        self._refuse_after_loss()
        if not self._loaded:
            return  # nothing was put since the take-over: the stage's head is the file's, unread
        if self.fill >= ALIGN:
            self._write_blocks()
        self._write_buffered(self.base, self.end)

    def put_aligned(self, buffers: list[memoryview]) -> None:
        """Append ``buffers`` straight from their own memory, no staging copy: each must start
        at a page-aligned address and have a length that is a multiple of :data:`ALIGN`, and
        :attr:`end` must be on a block boundary (the caller appended padding records first).
        What is staged before them is written first, so appends stay in order."""
        if self.end % ALIGN:
            raise ValueError(f"{self.path}: aligned append at unaligned end {self.end}")
        self.settle()
        self._refuse_after_loss()
        if not self._loaded:
            self._load()
        self._write_blocks()  # the stage holds whole blocks only (end is aligned): now empty
        assert self.fill == 0
        views = [b for b in buffers if len(b)]
        for k in range(0, len(views), IOV_BATCH):  # (a lent tensor's gaps and middles: many)
            batch = views[k:k + IOV_BATCH]
            n = sum(len(b) for b in batch)
            written = 0
            if self.active and self.in_file <= self.base:
                got = self.ops.write_direct(self.direct_fd, self.path, batch, self.base)
                if got is None:  # refused: this file system does not do O_DIRECT
                    self.close()
                else:
                    written = got
                    self.direct_bytes += got
            if written < n:  # the rest (a refused or short direct write) goes buffered
                self.ops.writev(self.fd, self.path, skip_bytes(batch, written), self.base + written)
            self.base += n
            self.in_file = max(self.in_file, self.base)

    def cut(self, end: int) -> None:
        """The file is being truncated to ``end`` (at or before :attr:`end`): forget staged bytes
        after it (the caller truncates the file). Raises the failure of a background write whose
        bytes, before ``end``, were lost (:meth:`check_cut`), changing nothing."""
        self.check_cut(end)
        self._lost = None
        if end >= self.base and self._loaded:
            self.fill = end - self.base
        else:
            self.base = end - end % ALIGN
            self.fill = end - self.base
            self._loaded = self.fill == 0
        self.in_file = min(self.in_file, end)

    def resume(self, end: int) -> None:
        """Take over again at ``end`` after the file was appended to by other means (buffered
        appends): the partial block there is read back at the next :meth:`put`."""
        self.settle()
        self.base = end - end % ALIGN
        self.fill = end - self.base
        self._loaded = self.fill == 0
        self.in_file = end

    def close(self) -> None:
        """Close the O_DIRECT descriptor, after the write in flight (if any) ended; writes
        nothing staged (:meth:`flush` does)."""
        self.quiesce()
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1

    def settle(self) -> None:
        """Wait for the background write in flight, if any; raise its failure (remembered as
        ``lost``: the bytes from its start are not in the file)."""
        w, self._inflight = self._inflight, None
        if w is None:
            return
        w.done.wait()
        self.direct_bytes += w.direct_bytes
        if w.refused and self.direct_fd >= 0:
            os.close(self.direct_fd)  # buffered from now on; ``in_file`` holds: the rest went so
            self.direct_fd = -1
        if w.error is not None:
            self._lost = (w.lo, w.error)
            raise w.error
        self.in_file = max(self.in_file, w.hi)

    def quiesce(self) -> None:
        """:meth:`settle` for rollback and close paths: waits, and leaves a failure to be raised
        by what depends on the lost bytes (:meth:`check_cut`, the next append)."""
        try:
            self.settle()
        except BaseException:  # noqa: BLE001 - remembered in ``_lost``
            pass

    def check_cut(self, end: int) -> None:
        """Raise the error of a failed background write when a cut to ``end`` would keep bytes it
        lost (its start is before ``end``): such a cut would leave a hole the writer believes
        written. Waits for the write in flight first."""
        self.quiesce()
        if self._lost is not None and end > self._lost[0]:
            raise self._lost[1]

    # ---- internals ---------------------------------------------------------------------------
    def _refuse_after_loss(self) -> None:
        """Appending after bytes a background write lost is refused until a cut goes back."""
        self.settle()
        if self._lost is not None:
            raise self._lost[1]

    def _hand_off(self) -> None:
        """The region being filled is full (``fill == capacity``, whole blocks): have a
        background thread write it while the other region fills, after the write before it
        ended (one write in flight). Without a second region, or O_DIRECT, it is written now."""
        self.settle()
        if not self.stage.overlap or not self.active:
            self._write_blocks()
            return
        whole = self.fill
        stop = self.base + whole
        direct_from = self.base if self.in_file == self.base else self.base + ALIGN
        self._write_buffered(self.base, direct_from)  # a partial head block already in the file
        if direct_from < stop:
            w = _BackgroundWrite(self, self._view[direct_from - self.base:whole], direct_from)
            self.stage.submit(w)
            self._inflight = w
        self._region ^= 1
        self.base = stop
        self.fill = 0

    def _load(self) -> None:
        """Read the head of the partial block at ``base`` back from the file."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            got = os.preadv(fd, [self._view[:self.fill]], self.base)
        finally:
            os.close(fd)
        if got != self.fill:
            raise OSError(errno.EIO, f"{self.path}: the file ends before offset {self.end}, "
                                     f"where the writer resumes")
        self._loaded = True

    def _write_blocks(self) -> None:
        """Write the stage's full blocks (never a byte before ``in_file``, module doc), then move
        the partial block's head to the front."""
        whole = self.fill - self.fill % ALIGN
        if whole == 0:
            return
        stop = self.base + whole
        # O_DIRECT starts at a block boundary: after the first block when its head is in the
        # file already (that block's new bytes go buffered, first, so appends stay in order)
        direct_from = self.base if self.in_file == self.base else self.base + ALIGN
        self._write_buffered(self.base, direct_from)
        if direct_from < stop and self.active:
            written = self.ops.write_direct(self.direct_fd, self.path,
                                            self._view[direct_from - self.base:whole],
                                            direct_from)
            if written is None:  # refused: this file system does not do O_DIRECT
                self.close()
                written = 0
            self.direct_bytes += written
            self.in_file = max(self.in_file, direct_from + written)
        self._write_buffered(self.base, stop)  # what O_DIRECT did not write
        rest = self.fill - whole
        if rest:
            self._view[:rest] = self._view[whole:self.fill]
        self.base = stop
        self.fill = rest

    def _write_buffered(self, lo: int, hi: int) -> None:
        """Write the staged bytes of file offsets ``[lo, hi)`` through the buffered descriptor,
        skipping those already in the file: the one place that keeps ``in_file``'s promise for
        buffered writes."""
        lo = max(lo, self.in_file)
        if hi > lo:
            self.ops.writev(self.fd, self.path, [self._view[lo - self.base:hi - self.base]], lo)
            self.in_file = hi
