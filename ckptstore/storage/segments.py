"""Segment files: append-only sequences of records (format/records.py).

A segment starts with a SEGMENT_HEADER record. :class:`SegmentWriter` appends; :class:`SegmentFile`
reads records at known offsets with ``pread`` (thread-safe, no shared file position);
:func:`scan_segment` walks a segment from an offset, yielding valid records and the corrupt regions
between them, resynchronising on the next valid header after damage.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import xxhash

from ..errors import CorruptRecordError, FormatError
from ..format import records as rec
from ..format.chunk import CHUNK_HEADER_SIZE, decode_chunk_header, verify_chunk_blocks
from ..format.image import pad_payload, pad_size
from ..format.header import SEGMENT_HEADER_SIZE, SegmentHeader, decode_segment_header, encode_segment_header
from .direct import DirectAppender, StagingBuffer
from .fileops import FileOps, io_errors

#: Bytes read per step while hashing a large payload or searching for the next record after damage.
_SCAN_BLOCK = 8 << 20
SEGMENT_HEADER_RECORD_SIZE = rec.OVERHEAD + SEGMENT_HEADER_SIZE


#: Offsets and lengths a read may name (the OS takes a signed 64-bit offset).
_MAX_FILE_OFFSET = 1 << 63


@dataclass(frozen=True)
class Loc:
    """Where a record lives: segment, offset of its header, payload length."""

    seq: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + rec.OVERHEAD + self.length

    @property
    def payload_offset(self) -> int:
        return self.offset + rec.HEADER_SIZE


class SegmentFile:
    """Read access to one segment file. Opened lazily; safe to share between threads."""

    def __init__(self, path: str, seq: int) -> None:
        self.path = path
        self.seq = seq
        self._fd: int | None = None
        self._lock = threading.Lock()

    def fileno(self) -> int:
        if self._fd is None:
            with self._lock:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        return self._fd

    def same_file(self) -> bool:
        """False when the path now names another file than the one this object holds open."""
        if self._fd is None:
            return True
        try:
            a, b = os.fstat(self._fd), os.stat(self.path)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def size(self) -> int:
        return os.fstat(self.fileno()).st_size

    def _check_span(self, offset: int, n: int) -> None:
        # offsets and lengths come from records and the index: a damaged or hostile one must be
        # a located error, not an OverflowError from the OS call
        if not (0 <= offset < _MAX_FILE_OFFSET and 0 <= n < _MAX_FILE_OFFSET):
            raise CorruptRecordError(f"read of {n} bytes at offset {offset} is out of range"
                                     ).located(self.path, offset if offset >= 0 else 0)

    def pread(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at end of file). Never allocates more than
        the file holds past ``offset``, whatever ``n`` a damaged length asks for."""
        self._check_span(offset, n)
        with io_errors("read", self.path):
            n = max(0, min(n, os.fstat(self.fileno()).st_size - offset))
            out = os.pread(self.fileno(), n, offset)
            while len(out) < n:
                more = os.pread(self.fileno(), n - len(out), offset + len(out))
                if not more:
                    break
                out += more
            return out

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> int:
        """Fill ``buffers`` from ``offset``; return bytes read (short only at end of file)."""
        want = sum(len(b) for b in buffers)
        self._check_span(offset, want)
        with io_errors("read", self.path):
            got = os.preadv(self.fileno(), buffers, offset)
            if got < want:  # rare: continue buffer by buffer
                got = 0
                for b in buffers:
                    pos = 0
                    while pos < len(b):
                        n = os.preadv(self.fileno(), [b[pos:]], offset + got)
                        if n == 0:
                            return got
                        pos += n
                        got += n
            return got

    def read_payload(self, loc: Loc, verify: bool = True) -> memoryview:
        """The payload of the record at ``loc``; with ``verify`` the header and trailer are checked.

        Raises CorruptRecordError (located at this file and offset) on a torn or corrupt record.
        """
        buf = self.pread(loc.offset, rec.OVERHEAD + loc.length)
        try:
            header, payload = rec.decode_record(buf) if verify else (
                rec.decode_header(buf), memoryview(buf)[rec.HEADER_SIZE:rec.HEADER_SIZE + loc.length])
            if header.length != loc.length:
                raise CorruptRecordError(
                    f"record length {header.length} differs from the indexed {loc.length}")
        except FormatError as e:
            raise e.located(self.path, loc.offset) from None
        return payload

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_segment_header(f: SegmentFile) -> SegmentHeader:
    """Decode the header record at offset 0; raises FormatError located at the file."""
    h = read_segment_header_record(f)
    if h.seq != f.seq:
        raise misnamed_segment_error(f, h)
    return h


def read_segment_header_record(f: SegmentFile) -> SegmentHeader:
    """Decode and verify the header record at offset 0 without comparing its ``seq`` with the
    file name (a renamed file still has a trustworthy header); raises FormatError located at the
    file."""
    buf = f.pread(0, SEGMENT_HEADER_RECORD_SIZE)
    try:
        header, payload = rec.decode_record(buf)
        if header.type != rec.RecordType.SEGMENT_HEADER:
            raise CorruptRecordError(f"segment starts with a record of type {header.type}")
        return decode_segment_header(payload)
    except FormatError as e:
        raise e.located(f.path, 0) from None


def misnamed_segment_error(f: SegmentFile, h: SegmentHeader) -> FormatError:
    return FormatError(f"segment header names sequence {h.seq}, file name says {f.seq}").located(
        f.path, 0)


@dataclass(frozen=True)
class ScannedRecord:
    """A record whose header is valid. ``payload`` is set when the scan read it (small records,
    or every record with ``verify``); ``error`` is set when its payload failed verification."""

    loc: Loc
    type: int
    payload: bytes | None = None
    error: FormatError | None = None


@dataclass(frozen=True)
class CorruptRegion:
    """Bytes between ``start`` and ``end`` that hold no valid record header."""

    seq: int
    path: str
    start: int
    end: int
    error: FormatError


#: Payloads of these types are always read during a scan (they are small and drive recovery).
_ALWAYS_READ = frozenset({rec.RecordType.SEGMENT_HEADER, rec.RecordType.MANIFEST,
                          rec.RecordType.COMMIT, rec.RecordType.TREE, rec.RecordType.TOMBSTONE})


def _verify_streaming(f: SegmentFile, loc: Loc) -> FormatError | None:
    """Check a large record's trailer by hashing its payload block by block."""
    h = xxhash.xxh3_64()
    got = 0
    for block in _blocks(f, loc.payload_offset, loc.length):
        h.update(block)
        got += len(block)
    if got < loc.length:
        return CorruptRecordError("record payload truncated at end of file").located(f.path, loc.offset)
    trailer = f.pread(loc.payload_offset + loc.length, rec.TRAILER_SIZE)
    if len(trailer) < rec.TRAILER_SIZE:
        return CorruptRecordError("record trailer truncated at end of file").located(f.path, loc.offset)
    if int.from_bytes(trailer, "little") != h.intdigest():
        return CorruptRecordError("record payload checksum mismatch").located(f.path, loc.offset)
    return None


def _verify_framed_chunk(f: SegmentFile, loc: Loc) -> FormatError | None:
    """Check a FRAMING_CHECK CHUNK record: its trailer over the chunk header, then its data
    against the chunk's address (what stands in for the payload check on these records)."""
    try:
        head = f.pread(loc.payload_offset, CHUNK_HEADER_SIZE)
        trailer = f.pread(loc.payload_offset + loc.length, rec.TRAILER_SIZE)
        rec.check_trailer(head, trailer)
        start, n = loc.payload_offset + CHUNK_HEADER_SIZE, loc.length - CHUNK_HEADER_SIZE
        verify_chunk_blocks(decode_chunk_header(head), n, _blocks(f, start, n))
    except FormatError as e:
        return e.located(f.path, loc.offset)
    return None


def _blocks(f: SegmentFile, start: int, n: int) -> Iterator[bytes]:
    """``n`` bytes of ``f`` from ``start`` in reads of at most _SCAN_BLOCK; stops early at the
    end of the file."""
    pos = 0
    while pos < n:
        block = f.pread(start + pos, min(_SCAN_BLOCK, n - pos))
        if not block:
            return
        yield block
        pos += len(block)


def _find_next_header(f: SegmentFile, start: int, size: int) -> int:
    """Offset of the next valid record header at or after ``start``, or ``size`` if none."""
    pos = start
    while pos < size:
        n = min(_SCAN_BLOCK, size - pos)
        # Read a little past the block so a header straddling its end is still seen whole.
        block = f.pread(pos, n + rec.HEADER_SIZE - 1)
        i = block.find(rec.MAGIC)
        while i != -1 and i < n:
            try:
                rec.decode_header(block[i:i + rec.HEADER_SIZE])
                return pos + i
            except FormatError:
                i = block.find(rec.MAGIC, i + 1)
        pos += n
    return size


def scan_segment(f: SegmentFile, start: int = 0, *, verify: bool = False,
                 end: int | None = None,
                 framing_allowed: bool = True) -> Iterator[ScannedRecord | CorruptRegion]:
    """Walk the records of ``f`` from ``start`` (a record boundary) to ``end`` (default: file size).

    Yields a ScannedRecord for every record with a valid header, in order, and a CorruptRegion for
    every stretch of bytes that is not one (a torn tail included). Small records (manifest, commit,
    tree, headers) are always read and verified; chunk payloads only with ``verify``, which also
    reports a FRAMING_CHECK record in a store without the feature (``framing_allowed`` False) as
    damaged: no writer of that store may write one (format-spec/format.md §4).
    """
    size = f.size() if end is None else end
    pos = start
    while pos < size:
        head = f.pread(pos, rec.HEADER_SIZE)
        try:
            header = rec.decode_header(head)
        except FormatError as e:
            nxt = _find_next_header(f, pos + 1, size)
            yield CorruptRegion(f.seq, f.path, pos, nxt, e.located(f.path, pos))
            pos = nxt
            continue
        loc = Loc(f.seq, pos, header.length)
        if loc.end > size:
            err = CorruptRecordError(
                f"record of {loc.end - pos} bytes runs past the end of the file at {size}")
            nxt = _find_next_header(f, pos + 1, size)
            yield CorruptRegion(f.seq, f.path, pos, nxt, err.located(f.path, pos))
            pos = nxt
            continue
        if header.type in _ALWAYS_READ:
            buf = f.pread(pos, loc.end - pos)
            try:
                _, payload = rec.decode_record(buf)
                yield ScannedRecord(loc, header.type, bytes(payload))
            except FormatError as e:
                yield ScannedRecord(loc, header.type, None, e.located(f.path, pos))
        elif verify:
            problem: FormatError | None
            if header.framing_checked and not framing_allowed:
                problem = CorruptRecordError(
                    "a FRAMING_CHECK record in a store without the FRAMING_CHECKS feature "
                    "(readers before it take the record for damage)").located(f.path, pos)
            else:
                check = _verify_framed_chunk if header.framing_checked else _verify_streaming
                problem = check(f, loc)
            yield ScannedRecord(loc, header.type, None, problem)
        else:
            yield ScannedRecord(loc, header.type)
        pos = loc.end


#: With eviction on, a SegmentWriter advises the kernel (FileOps.advise_written) each time this
#: many bytes have been appended since its last advice. Writing into fresh page-cache pages is slow
#: on VMs that hand freed guest memory back to the host (~0.4 GB/s measured, MEASUREMENTS.md);
#: written-back pages dropped from the cache are reused by the next writes instead.
#: 32 MiB: a few calls per 100 MB delta (each costs microseconds), while the pages the writer keeps
#: dirty or in writeback stay a working set of tens of MiB, not the whole delta.
EVICT_EVERY = 32 << 20
#: A record up to this payload size is staged for O_DIRECT as one joined piece (the join is
#: cheaper than a staging call per part); larger ones are staged part by part, never joined.
_SMALL_RECORD = 16 << 10

#: Advice ranges start on a page boundary (the kernel keeps a partially covered page).
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class SegmentWriter:
    """Appends records to one segment file through a FileOps seam.

    Invariant: ``offset`` is the end of the last record appended; bytes past it are garbage from an
    aborted write and will be overwritten or truncated.

    With ``evict`` the writer advises the kernel to write back and drop what it wrote, on a rolling
    basis (every EVICT_EVERY bytes), after each :meth:`sync` and when the file is closed. A rolling
    advice covers the bytes new since the last advice and, again, the bytes that advice covered
    first (its range starts at the end of the advice before, page-aligned down): the first advice
    over a byte starts its writeback (a page in writeback cannot be dropped yet), the second drops
    its page, clean by then. After an fsync every page is clean, so that advice drops them all and
    the next starts at the current end. Advice starts are non-decreasing and together cover every
    byte written. Advice never fails (FileOps.advise_written swallows errors).
    """

    def __init__(self, path: str, seq: int, fd: int, offset: int, ops: FileOps,
                 evict: bool = False, stage: StagingBuffer | None = None,
                 direct_on: bool = True, *, framing_checks: bool) -> None:
        self.path = path
        #: CHUNK records get FRAMING_CHECK trailers (over the chunk header; only in a store whose
        #: STORE header has the FRAMING_CHECKS flag)
        self.framing_checks = framing_checks
        self.seq = seq
        self.fd = fd
        self.offset = offset
        self.ops = ops
        self.dirty = False
        self.evict = evict
        #: with a staging buffer, appends go through O_DIRECT (storage/direct.py) when the file
        #: system takes it; None: buffered appends
        self.direct: DirectAppender | None = None
        #: appends go through ``direct`` now (see :meth:`use_direct`)
        self.direct_on = direct_on
        if stage is not None:
            direct_fd = ops.open_direct(path)
            if direct_fd is not None:
                self.direct = DirectAppender(path, fd, direct_fd, ops, stage, offset)
        #: end of the last advice (bytes before it were advised at least once) ...
        self._advised = offset
        #: ... and where the next advice starts: the end of the advice before the last one, or
        #: the end of the last one when it followed an fsync (see the class docstring)
        self._window = offset

    @classmethod
    def create(cls, path: str, seq: int, store_id: bytes, ops: FileOps, supersedes: int = 0,
               evict: bool = False, stage: StagingBuffer | None = None,
               direct_on: bool = True, *, framing_checks: bool) -> "SegmentWriter":
        """Create a new segment holding only its header record (fsynced; the caller fsyncs the dir).
        ``framing_checks``: the store's FEATURE_FRAMING_CHECKS (CHUNK records get FRAMING_CHECK
        trailers)."""
        from ..format.header import FORMAT_VERSION

        fd = ops.open_append(path, create=True)
        try:
            w = cls(path, seq, fd, 0, ops, evict, stage, direct_on, framing_checks=framing_checks)
        except BaseException:
            os.close(fd)
            raise
        try:
            payload = encode_segment_header(SegmentHeader(FORMAT_VERSION, seq, store_id, supersedes))
            w.append(rec.RecordType.SEGMENT_HEADER, [payload])
            w.sync()
        except BaseException:
            w.close_fds()
            raise
        return w

    @classmethod
    def reopen(cls, path: str, seq: int, offset: int, ops: FileOps, evict: bool = False,
               stage: StagingBuffer | None = None, direct_on: bool = True, *,
               framing_checks: bool) -> "SegmentWriter":
        fd = ops.open_append(path, create=False)
        try:
            return cls(path, seq, fd, offset, ops, evict, stage, direct_on,
                       framing_checks=framing_checks)
        except BaseException:
            os.close(fd)
            raise

    @property
    def _staging(self) -> DirectAppender | None:
        """The O_DIRECT appender in use; None while appends are buffered."""
        return self.direct if self.direct_on else None

    def use_direct(self, on: bool) -> None:
        """Switch between O_DIRECT and buffered appends (a no-op without O_DIRECT). Going
        buffered first writes what is staged; going direct reads the partial block back."""
        if self.direct is None or on == self.direct_on:
            return
        if on:
            self.direct.resume(self.offset)
        else:
            self.direct.flush()
        self.direct_on = on

    def _flags_for(self, record_type: int, length: int) -> int:
        """The record flags a record gets here: FRAMING_CHECK on a CHUNK in a store that uses them."""
        return rec.FRAMING_CHECK if self.framing_checks and rec.may_frame(record_type, length) \
            else 0

    def append(self, record_type: int, payload_parts: Sequence[bytes | memoryview]) -> Loc:
        staging = self._staging
        if staging is not None:
            return self._append_direct(staging, record_type, payload_parts)
        length = sum(len(p) for p in payload_parts)
        flags = self._flags_for(record_type, length)
        header = rec.encode_header(record_type, length, flags)
        trailer = rec.encode_trailer(*rec.checked_parts(flags, payload_parts))
        loc = Loc(self.seq, self.offset, length)
        self.ops.writev(self.fd, self.path, [header, *payload_parts, trailer], self.offset)
        self.offset = loc.end
        self.dirty = True
        if self.evict and self.offset - self._advised >= EVICT_EVERY:
            self._advise()
        return loc

    def _append_direct(self, direct: DirectAppender, record_type: int,
                       payload_parts: Sequence[bytes | memoryview]) -> Loc:
        """Stage the record; its trailer hashes the staged bytes while they are in cache (with
        FRAMING_CHECK, only the chunk header). A small record is joined and staged whole (one
        put instead of one per part: a snapshot appends a TREE record per tensor)."""
        length = sum(memoryview(p).nbytes for p in payload_parts)
        loc = Loc(self.seq, self.offset, length)
        flags = self._flags_for(record_type, length)
        try:
            if length <= _SMALL_RECORD:
                payload = b"".join(payload_parts)
                direct.put(rec.encode_record(record_type, payload, flags))
            elif flags:
                direct.put(rec.encode_header(record_type, length, flags))
                for part in payload_parts:
                    direct.put(part)
                direct.put(rec.encode_trailer(*rec.framed_parts(payload_parts)))
            else:
                direct.put(rec.encode_header(record_type, length, flags))
                check = xxhash.xxh3_64()
                for part in payload_parts:
                    direct.put(part, check.update)
                direct.put(rec.encode_check(check.intdigest()))
        except BaseException:
            direct.cut(self.offset)  # the record was never appended
            raise
        finally:
            if not direct.active:  # the file system refused O_DIRECT: buffered from now on
                direct.flush()
                self.direct = None
        self.offset = loc.end
        self.dirty = True
        return loc

    def append_image(self, buffers: Sequence[memoryview]) -> int:
        """Append ``buffers``, whole records laid out by the caller (format/image.py), from their
        own memory; returns the file offset of their first byte. With O_DIRECT the log's end is
        first moved to a block boundary by a pad record and the buffers, page-aligned and whole
        blocks long, are written without a copy; buffered appends write them where the log
        ends."""
        staging = self._staging
        if staging is not None:
            pad = pad_size(self.offset)
            if pad:
                self._append_direct(staging, rec.RecordType.CHUNK, [pad_payload(pad)])
        staging = self._staging  # (None when the pad's write found O_DIRECT refused)
        if staging is not None:
            start = self.offset
            try:
                staging.put_aligned(list(buffers))
            except BaseException:
                staging.cut(start)
                raise
            finally:
                if not staging.active:  # the file system refused O_DIRECT: buffered from now on
                    staging.flush()
                    self.direct = None
        else:
            start = self.offset
            self.ops.writev(self.fd, self.path, list(buffers), start)
        self.offset = start + sum(len(b) for b in buffers)
        self.dirty = True
        if self.evict and self._staging is None and self.offset - self._advised >= EVICT_EVERY:
            self._advise()
        return start

    def _advise(self, all_clean: bool = False) -> None:
        """Advise ``[_window page-aligned down, offset)``; ``all_clean`` after an fsync (the whole
        range is dropped now, so the next advice need not cover it again)."""
        start = self._window - self._window % _PAGE
        if self.offset > start:
            self.ops.advise_written(self.fd, self.path, start, self.offset - start)
        self._window = self.offset if all_clean else self._advised
        self._advised = self.offset

    def flush(self) -> None:
        """Write what is staged for O_DIRECT (no fsync); a no-op for buffered appends (while
        they are on, the stage holds nothing: :meth:`use_direct` flushed it, and resumes it)."""
        staging = self._staging
        if staging is not None:
            staging.flush()

    def sync(self) -> None:
        if self.dirty:
            self.flush()
            self.ops.fsync(self.fd, self.path)
            self.dirty = False
            if self.evict and self._staging is None:
                self._advise(all_clean=True)

    def truncate(self, offset: int) -> None:
        """Cut the file at ``offset`` (fsynced) and forget what was appended after it. Staged
        bytes before the cut stay staged (flushed by the next sync), and the file is cut where
        they start when that is earlier: it never holds bytes a later write would cover again
        (ckptstore/storage/direct.py). No staged write here: a rollback after a failed write
        must not retry it."""
        staging = self._staging
        if staging is not None:
            staging.check_cut(offset)  # (waits for a write in flight: ``in_file`` is final)
        length = offset if staging is None else min(offset, staging.in_file)
        self.ops.truncate(self.fd, self.path, length)
        self.ops.fsync(self.fd, self.path)
        self.rewind(offset)
        self.dirty = length < offset  # staged bytes before the cut still to be written

    def quiesce(self) -> None:
        """Wait for a background O_DIRECT write in flight (storage/direct.py), if any, so the
        file's size is final; a failure stays for the next append or cut to raise."""
        if self.direct is not None:
            self.direct.quiesce()

    def rewind(self, offset: int) -> None:
        """Forget what was appended after ``offset`` when none of it reached the file (the file
        ends at or before ``offset``; bytes staged for O_DIRECT only): no system call, so a cut
        after a failed write cannot fail in turn."""
        staging = self._staging
        if staging is not None:
            staging.cut(offset)
        self.offset = offset
        self._advised = min(self._advised, offset)
        self._window = min(self._window, offset)

    def close(self) -> None:
        if self.fd >= 0:
            try:
                self.flush()  # what was appended reaches the file, as buffered appends do
            finally:
                if self.evict and self._staging is None and self.offset > self._advised:
                    self._advise()  # starts writeback of what was not synced (close paths sync first)
                self.close_fds()

    def close_fds(self) -> None:
        """Close the descriptors without writing anything still staged."""
        if self.direct is not None:
            self.direct.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
