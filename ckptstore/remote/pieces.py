"""Range reads of a remote copy's segments (format-spec/remote.md §7): the pieces a lazy reader
(:mod:`ckptstore.remote.reader`) reads through.

* :class:`PieceReader` maps a segment byte range onto the HEAD's extent objects and fetches it
  with range GETs: small reads through a bounded LRU block cache (``block_size``,
  ``cache_size``; one fetch per block at a time), large ones (a chunk record) exactly; it counts
  bytes and requests, prefetches every segment's header record, and verifies an extent against
  its digest (whole fetches for free, :meth:`PieceReader.verify_piece` on demand).
* :class:`RemoteSegmentFile` is a :class:`~ckptstore.storage.segments.SegmentFile` over a
  PieceReader (no descriptor), remembering recent read spans for the log's audit after a failed
  read.

Invariant: every byte returned is exactly the HEAD's extent bytes or the call raises
RemoteIntegrityError naming the object (missing, shorter than the HEAD says, or a digest
mismatch on a whole fetch); service failures propagate as the RemoteError they are.
"""

from __future__ import annotations

import bisect
import errno
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import xxhash

from ..errors import RemoteError, RemoteIntegrityError, StoreIOError
from ..storage.segments import SEGMENT_HEADER_RECORD_SIZE, SegmentFile
from .client import ObjectStore
from .head import Extent, Head, SegmentEntry, digest

#: Small reads fetch aligned blocks of this many bytes of an extent (and keep them cached).
DEFAULT_BLOCK = 256 << 10
#: Bytes of blocks the cache keeps (least recently used go first).
DEFAULT_CACHE = 32 << 20
#: Bytes per step while streaming an object (the index, an extent being verified).
STREAM_STEP = 8 << 20
#: Service codes that mean an object is not there (or shorter than the range asked).
GONE_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


class PieceReader:
    """The extents of one HEAD, read by segment range: range GETs, a bounded LRU block cache, the
    first bytes (header record) of every segment, byte and request counts. Thread-safe."""

    def __init__(self, store: ObjectStore, head: Head, block_size: int = DEFAULT_BLOCK,
                 cache_size: int = DEFAULT_CACHE) -> None:
        if block_size < 4096 or cache_size < 0:
            raise ValueError(f"block_size must be >= 4096 bytes and cache_size >= 0, not "
                             f"{block_size}, {cache_size}")
        self.store = store
        self.head = head
        self.block = int(block_size)
        self.capacity = int(cache_size)
        self._segs: dict[int, SegmentEntry] = {s.seq: s for s in head.segments}
        self._starts: dict[int, list[int]] = {s.seq: [e.offset for e in s.extents]
                                              for s in head.segments}
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._cached = 0
        self._inflight: dict[tuple[str, int], threading.Event] = {}
        self._heads: dict[int, bytes] = {}
        self._verified: set[str] = set()
        self.bytes_read = 0
        self.requests = 0
        self.cache_hits = 0

    # ---- bookkeeping ---------------------------------------------------------------------------
    def count(self, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.requests += requests

    def counters(self) -> tuple[int, int, int]:
        """``(bytes_read, requests, cache_hits)``, read together under the lock."""
        with self._lock:
            return self.bytes_read, self.requests, self.cache_hits

    def url(self, name: str) -> str:
        return self.store.where.url(name)

    def entry(self, seq: int) -> SegmentEntry | None:
        return self._segs.get(seq)

    def pieces(self, seq: int, start: int, end: int) -> list[Extent]:
        """The extents of segment ``seq`` overlapping bytes ``[start, end)``."""
        seg = self._segs.get(seq)
        if seg is None or end <= start:
            return []
        i = max(0, bisect.bisect_right(self._starts[seq], start) - 1)
        out = []
        for e in seg.extents[i:]:
            if e.offset >= end:
                break
            if e.end > start:
                out.append(e)
        return out

    def _missing(self, name: str) -> RemoteIntegrityError:
        return RemoteIntegrityError(
            "get", self.url(name), f"named by HEAD generation {self.head.generation} but missing "
            "or shorter than it says (a newer HEAD's gc collected it, or it was deleted); reopen "
            "the store to read the newest HEAD")

    # ---- fetches ---------------------------------------------------------------------------
    def fetch(self, name: str, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of object ``name``, all of them (or
        RemoteIntegrityError naming it)."""
        try:
            data = self.store.get(name, start, length)
        except RemoteError as err:
            if err.code in GONE_CODES or err.code == "InvalidRange":
                raise self._missing(name) from None
            raise
        self.count(len(data))
        if len(data) != length:
            raise RemoteIntegrityError("get", self.url(name), f"{length} bytes from offset {start} "
                                       f"asked, {len(data)} returned: shorter than HEAD "
                                       f"generation {self.head.generation} says")
        return data

    def _check_whole(self, e: Extent, data: bytes) -> None:
        """An extent fetched whole is checked against its digest (for free)."""
        if e.name in self._verified:
            return
        got = digest(data)
        if got != e.digest:
            raise RemoteIntegrityError(
                "get", self.url(e.name), f"digest mismatch: HEAD generation {self.head.generation} "
                f"says {e.digest.hex()}, the object holds {got.hex()} (changed behind our back)")
        self._verified.add(e.name)

    def verify_piece(self, e: Extent) -> bytes | None:
        """Hash extent ``e`` whole (streamed); None when it matches its digest, else the digest
        found."""
        if e.name in self._verified:
            return None
        h = xxhash.xxh3_128()
        n = 0
        try:
            for block in self.store.stream(e.name, STREAM_STEP):
                h.update(block)
                n += len(block)
        except RemoteError as err:
            if err.code in GONE_CODES:
                raise self._missing(e.name) from None
            raise
        finally:
            self.count(n)
        if n != e.length:
            raise RemoteIntegrityError("get", self.url(e.name), f"holds {n} bytes, HEAD generation "
                                       f"{self.head.generation} names {e.length}")
        if h.digest() != e.digest:
            return h.digest()
        self._verified.add(e.name)
        return None

    def forget(self, e: Extent) -> None:
        """Drop the cached blocks of ``e`` (a read of them failed: a retry fetches again)."""
        with self._lock:
            for key in [k for k in self._cache if k[0] == e.name]:
                self._cached -= len(self._cache.pop(key))

    def _block(self, e: Extent, b: int) -> bytes:
        """Block ``b`` of extent ``e``, from the cache or one range GET (one fetch per block at
        a time: a second reader of the same block waits for the first)."""
        key = (e.name, b)
        while True:
            with self._lock:
                data = self._cache.get(key)
                if data is not None:
                    self._cache.move_to_end(key)
                    self.cache_hits += 1
                    return data
                ev = self._inflight.get(key)
                mine = ev is None
                if mine:
                    ev = self._inflight[key] = threading.Event()
            assert ev is not None
            if not mine:
                ev.wait()
                continue  # cached now, or the fetch failed: then this thread tries
            try:
                start = b * self.block
                data = self.fetch(e.name, start, min(self.block, e.length - start))
                if start == 0 and len(data) == e.length:
                    self._check_whole(e, data)
                with self._lock:
                    if len(data) <= self.capacity:
                        self._cache[key] = data
                        self._cached += len(data)
                        while self._cached > self.capacity:
                            _, old = self._cache.popitem(last=False)
                            self._cached -= len(old)
                return data
            finally:
                with self._lock:
                    self._inflight.pop(key, None)
                ev.set()

    def _read_piece(self, e: Extent, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)`` of extent ``e`` (offsets within the object)."""
        B = self.block
        b0, b1 = lo // B, (hi - 1) // B
        with self._lock:
            blocks = [self._cache.get((e.name, b)) for b in range(b0, b1 + 1)]
        if any(x is None for x in blocks):
            if hi - lo >= B // 2:
                # a large read (a chunk record): blocks cached at either end are used, the rest
                # is fetched exactly, uncached
                i, j = 0, len(blocks)
                while i < j and blocks[i] is not None:
                    i += 1
                while j > i and blocks[j - 1] is not None:
                    j -= 1
                mid_lo, mid_hi = max(lo, (b0 + i) * B), min(hi, (b0 + j) * B)
                data = self.fetch(e.name, mid_lo, mid_hi - mid_lo)
                if mid_lo == 0 and mid_hi == e.length:
                    self._check_whole(e, data)
                if i == 0 and j == len(blocks):
                    return data
                with self._lock:
                    self.cache_hits += 1
                left = b"".join(x or b"" for x in blocks[:i])[lo - b0 * B:]
                right = b"".join(x or b"" for x in blocks[j:])[:hi - (b0 + j) * B]
                return left + data + right
            blocks = [self._block(e, b) for b in range(b0, b1 + 1)]
        else:
            with self._lock:
                self.cache_hits += 1
        joined = blocks[0] if len(blocks) == 1 else b"".join(x or b"" for x in blocks)
        assert joined is not None
        return joined[lo - b0 * B:hi - b0 * B]

    def read(self, seq: int, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes of segment ``seq`` at ``offset`` (fewer only at its end)."""
        seg = self._segs[seq]
        end = min(offset + n, seg.length)
        if end <= offset:
            return b""
        first = self._heads.get(seq)
        if first is not None and end <= len(first):
            return first[offset:end]
        parts = [self._read_piece(e, max(offset, e.offset) - e.offset, min(end, e.end) - e.offset)
                 for e in self.pieces(seq, offset, end)]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def prefetch_headers(self, threads: int = 8) -> None:
        """Fetch the header record of every segment (what a reader's open reads of each), in
        parallel, exactly: one small range GET per segment."""
        def one(seg: SegmentEntry) -> tuple[int, bytes]:
            n = min(SEGMENT_HEADER_RECORD_SIZE, seg.length)
            return seg.seq, b"".join(self.fetch(e.name, 0, min(n, e.end) - e.offset)
                                     for e in self.pieces(seg.seq, 0, n))

        segs = list(self.head.segments)
        if len(segs) <= 1:
            got = [one(s) for s in segs]
        else:
            with ThreadPoolExecutor(min(threads, len(segs)),
                                    thread_name_prefix="ckptstore-remote") as pool:
                got = list(pool.map(one, segs))
        self._heads.update(got)


class RemoteSegmentFile(SegmentFile):
    """A segment of a remote copy, read through a :class:`PieceReader` (no descriptor). A seq the
    HEAD does not hold reads like a missing local file (ENOENT)."""

    def __init__(self, path: str, seq: int, reader: PieceReader) -> None:
        super().__init__(path, seq)
        self.reader = reader
        self.seg = reader.entry(seq)
        #: recent reads, offset -> end (what :meth:`RemoteLog.audit` checks after a failure)
        self._spans: OrderedDict[int, int] = OrderedDict()

    def _missing(self) -> StoreIOError:
        return StoreIOError("read", self.path, FileNotFoundError(
            errno.ENOENT, f"segment {self.seq} is not in the remote copy (HEAD generation "
            f"{self.reader.head.generation})"))

    def fileno(self) -> int:
        raise StoreIOError("read", self.path, OSError(errno.EBADF, "a remote segment has no file "
                                                                   "descriptor"))

    def same_file(self) -> bool:
        return True

    def size(self) -> int:
        if self.seg is None:
            raise self._missing()
        return self.seg.length

    def span(self, offset: int) -> int | None:
        with self._lock:
            return self._spans.get(offset)

    def pread(self, offset: int, n: int) -> bytes:
        self._check_span(offset, n)
        if self.seg is None:
            raise self._missing()
        with self._lock:
            self._spans[offset] = max(self._spans.get(offset, 0), offset + n)
            self._spans.move_to_end(offset)
            while len(self._spans) > 4096:
                self._spans.popitem(last=False)
        return self.reader.read(self.seq, offset, n)

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> int:
        data = self.pread(offset, sum(memoryview(b).nbytes for b in buffers))
        pos = 0
        for b in buffers:
            mv = memoryview(b)
            if mv.format != "B" or mv.ndim != 1:
                mv = mv.cast("B")
            k = min(len(mv), len(data) - pos)
            mv[:k] = data[pos:pos + k]
            pos += k
            if pos >= len(data):
                break
        return len(data)

    def close(self) -> None:
        pass
