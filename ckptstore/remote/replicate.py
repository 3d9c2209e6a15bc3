"""Uploading a store's committed log to an object store (format-spec/remote.md, "Upload").

One code path, :meth:`Replicator.sync`, serves both ``ckptstore push`` (a closed store, or a
catch-up beside a live writer) and the writer's background uploader
(:mod:`ckptstore.remote.uploader`):

1. :func:`capture` takes, under the engine's lock, what the copy will hold: the position (end of
   the last indexed COMMIT), the live segments up to it (the position's segment cut at the
   position), the header record of every live segment after it (a gc marker must travel with the
   copy, or the segments it collected would read as missing), the newest iterations, and one
   open descriptor per segment. Committed bytes never change in place (format-spec §14: no
   write touches a byte already in the file), so the upload reads them later without the lock;
   a gc that deletes a segment meanwhile does not disturb the open descriptor.
2. Each segment becomes consecutive **extents**, one immutable object each, named by segment,
   offset, length and xxh3-128 (:class:`~ckptstore.remote.head.Extent`). Extents the remote
   HEAD already names are reused after their digest was checked against the local bytes (once
   per file identity); new ones end on multiples of ``max_object`` so an interrupted upload of a
   closed store re-plans the same names and skips what already arrived. An object listed remotely
   is never uploaded again (same name, same bytes); one larger than ``part_size`` goes as a
   multipart upload, one part in memory at a time, paced to ``bandwidth``.
3. Then a copy of the index at the captured position (:func:`index_view`: a read transaction of
   the writer's LMDB index taken under the lock, copied compacted and lz4-framed afterwards) as
   one immutable object under ``index/``, and, **last**, one HEAD object naming every extent and
   the index object, written with a conditional create (``If-None-Match: *``) under the next
   generation: the remote commit point. The index object is a cache for lazy remote readers
   (:mod:`ckptstore.remote.reader`), which validate it against the log.
4. Then remote gc: HEADs older than the newest ``keep_heads`` are deleted, then every object
   that none of the remaining HEADs names (an object is removed only once a newer HEAD no
   longer references it).

A remote whose newest HEAD names another store, or a position after the local one (a copy of
the store that went further), is never overwritten: RemoteConflictError.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import lmdb

from ..engine.engine import Engine
from ..engine.reader_engine import ReaderEngine
from ..engine.writer_engine import WriterEngine
from ..errors import FormatError, RemoteConflictError, RemoteError, RemoteIntegrityError
from ..storage.fileops import io_errors
from ..storage.index import unseal
from ..storage.job_log import refuse_job_part
from ..storage.segments import SEGMENT_HEADER_RECORD_SIZE
from .client import CLIENT_KEYS, MIN_PART_SIZE, ObjectStore, Pacer
from .generations import collect, put_next_generation, read_newest
from .head import (INDEX_DIR, MAX_HEAD_BYTES, SEGMENTS_DIR, STORE_OBJECT, Extent,
                   Head, IndexRef, SegmentEntry, decode_head, digest, encode_head,
                   head_generation, head_name)

log = logging.getLogger("ckptstore")

#: Bytes read at a time while hashing local segment bytes.
HASH_BLOCK = 8 << 20


@dataclass(frozen=True)
class RemoteOptions:
    """How the uploader behaves (every key optional; the client's keys are in
    :mod:`ckptstore.remote.client`)."""

    #: average upload rate bound, bytes/s (None: unbounded)
    bandwidth: float | None = None
    #: at most one HEAD per this many seconds while commits keep coming
    head_interval: float = 10.0
    #: multipart part size (>= 5 MiB); an upload holds a few parts in memory at most
    part_size: int = 8 << 20
    #: extents end on multiples of this many bytes of their segment (the largest object)
    max_object: int = 64 << 20
    #: HEADs kept remotely (the newest); objects only older ones name are deleted
    keep_heads: int = 2
    #: longest wait between retries after a failure, seconds
    max_backoff: float = 30.0
    #: how long close() waits for the final upload, seconds
    close_timeout: float = 60.0
    #: read the remote's state when the writer opens (wrong credentials, a missing bucket or a
    #: remote holding another store then fail the open)
    check_on_open: bool = True


_UPLOAD_KEYS = frozenset(RemoteOptions.__dataclass_fields__)


def split_options(options: dict | None) -> tuple[dict, RemoteOptions]:
    """(client options, uploader options) of one options dict; ValueError for an unknown key."""
    options = dict(options or {})
    unknown = set(options) - CLIENT_KEYS - _UPLOAD_KEYS
    if unknown:
        raise ValueError(f"unknown remote options {sorted(unknown)} (known: "
                         f"{sorted(CLIENT_KEYS | _UPLOAD_KEYS)})")
    opts = RemoteOptions(**{k: v for k, v in options.items() if k in _UPLOAD_KEYS})
    if opts.part_size < MIN_PART_SIZE:
        raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes (S3's smallest part)")
    if opts.max_object < 1 or opts.keep_heads < 1 or opts.head_interval < 0:
        raise ValueError("max_object and keep_heads must be >= 1, head_interval >= 0")
    if opts.bandwidth is not None and not opts.bandwidth > 0:
        raise ValueError(f"bandwidth must be a positive number of bytes/s, not {opts.bandwidth!r}")
    return {k: v for k, v in options.items() if k in CLIENT_KEYS}, opts


# ---- what to upload ------------------------------------------------------------------------------
@dataclass
class LocalSegment:
    """The first ``length`` bytes of segment ``seq``, read through a descriptor opened under the
    engine's lock (``ident``: the file's device and inode)."""

    seq: int
    length: int
    path: str
    fd: int
    ident: tuple[int, int]

    def read(self, offset: int, n: int) -> bytes:
        with io_errors("read", self.path):
            out = os.pread(self.fd, n, offset)
            while len(out) < n:
                more = os.pread(self.fd, n - len(out), offset + len(out))
                if not more:
                    raise OSError(errno.EIO, f"segment ends at {offset + len(out)}, before "
                                             f"{offset + n}")
                out += more
        return out


@dataclass
class LocalSnapshot:
    """What a remote copy of the store's committed state holds (see :func:`capture`)."""

    path: str
    store_id: bytes
    store_bytes: bytes
    position: tuple[int, int] | None
    latest: int | None
    recoverable: int | None
    count: int
    watermark: int
    segments: list[LocalSegment] = field(default_factory=list)
    #: (LMDB environment, read transaction) of the index at ``position``, taken under the lock
    #: (None: no persistent index at exactly that position; the HEAD then names no index)
    index: tuple[Any, Any] | None = None

    def close(self) -> None:
        for s in self.segments:
            if s.fd >= 0:
                os.close(s.fd)
                s.fd = -1
        self.release_index()

    def release_index(self) -> None:
        """End the index read transaction (it pins the writer's LMDB pages while open)."""
        if self.index is not None:
            _, txn = self.index
            self.index = None
            try:
                txn.abort()
            except lmdb.Error:
                pass  # the environment was closed meanwhile (an index rebuild): nothing to end


def pos_key(position: tuple[int, int] | None) -> tuple[int, int]:
    """Positions in log order (None, an empty log, first). Committed positions only grow: a
    commit appends after the last, a gc writes its copies into higher segments."""
    return (0, 0) if position is None else position


def capture(engine: Engine) -> LocalSnapshot | None:
    """The store's committed state now, with a descriptor per segment; None when it cannot be
    taken at this moment (the engine is closed, a writer awaits recovery, a gc deleted a segment
    between the listing and the open): try again later."""
    with engine.locked():
        if engine.closed or (isinstance(engine, WriterEngine) and engine.needs_recovery):
            return None
        if isinstance(engine, ReaderEngine):
            engine.refresh()
        pos = engine.indexed(lambda: engine.index.position())
        recoverable = engine.recoverable()
        latest = engine.indexed(lambda: engine.index.latest())
        indexed_segments = engine.indexed(lambda: engine.index.segments())
        live = engine.log.refresh_segments()
        headers = dict(engine.log.headers)
        if pos is not None and indexed_segments is not None and \
                tuple(s for s in live if s <= pos.seq) != tuple(indexed_segments):
            return None  # a reader's view from before a gc that completed since: take it again
        with io_errors("read", engine.layout.store_file):
            with open(engine.layout.store_file, "rb") as f:
                store_bytes = f.read(65)
        snap = LocalSnapshot(engine.path, engine.header.store_id, store_bytes,
                             None if pos is None else (pos.seq, pos.offset), latest,
                             recoverable[-1] if recoverable else None, len(recoverable),
                             max([0] + [h.supersedes for h in headers.values()]))
        snap.index = index_view(engine, snap.position)
        try:
            for seq in live:
                if pos is not None and seq <= pos.seq:
                    length = -1 if seq < pos.seq else pos.offset
                elif seq in headers:
                    length = SEGMENT_HEADER_RECORD_SIZE  # after the position: its header only
                else:
                    continue  # a damaged header after the position: a torn roll (tail)
                path = engine.layout.segment_path(seq)
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    snap.close()
                    return None
                st = os.fstat(fd)
                seg = LocalSegment(seq, st.st_size if length < 0 else min(length, st.st_size),
                                   path, fd, (st.st_dev, st.st_ino))
                snap.segments.append(seg)
            return snap
        except BaseException:
            snap.close()
            raise


_POS = struct.Struct("<QQ")


def index_view(engine: Engine, position: tuple[int, int] | None) -> tuple[Any, Any] | None:
    """A read transaction of the engine's LMDB index (the writer's, or the one a reader opened
    read-only) whose state is exactly ``position``: what the index object of a HEAD at that
    position copies. Called under the engine's lock; None when there is no such index (a
    reader that scanned into memory, a position the LMDB state does not hold yet)."""
    if position is None:
        return None
    source = engine.index.lmdb_source()
    if source is None:
        return None
    env, meta = source
    try:
        txn = env.begin(buffers=False)
    except lmdb.Error:
        return None
    try:
        raw = txn.get(b"position", db=meta)
        pos = unseal(b"meta", b"position", raw) if raw is not None else None
        if pos is not None and len(pos) == _POS.size and _POS.unpack(pos) == tuple(position):
            return env, txn
    except Exception:  # noqa: BLE001 - a damaged or closed index: the HEAD names none
        pass
    try:
        txn.abort()
    except lmdb.Error:
        pass
    return None


# ---- the remote's state --------------------------------------------------------------------------
def fetch_sealed(store: ObjectStore, name: str) -> bytes:
    """The bytes of a HEAD object (of a store or of a job), refused unread past
    ``MAX_HEAD_BYTES`` (RemoteIntegrityError naming it)."""
    chunks, n = [], 0
    for chunk in store.stream(name, 1 << 20):
        n += len(chunk)
        if n > MAX_HEAD_BYTES:
            raise RemoteIntegrityError("read HEAD", store.where.url(name),
                                       f"larger than {MAX_HEAD_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def read_head(store: ObjectStore, generation: int) -> Head:
    """The HEAD of ``generation``, checked; RemoteIntegrityError naming it when it fails."""
    return fetch_head(store, generation)[0]


def fetch_head(store: ObjectStore, generation: int) -> tuple[Head, bytes]:
    """The HEAD of ``generation``, checked, and the object's bytes (a job HEAD pins a stream's
    HEAD by their digest); RemoteIntegrityError naming it when it fails."""
    name = head_name(generation)
    data = fetch_sealed(store, name)
    try:
        return decode_head(data, generation), data
    except FormatError as e:
        raise RemoteIntegrityError("read HEAD", store.where.url(name), str(e)) from e


def list_heads(listed: dict[str, int]) -> list[int]:
    """HEAD generations among listed object names, newest first."""
    return sorted((g for n in listed if (g := head_generation(n)) is not None), reverse=True)


@dataclass
class _PackedIndex:
    """An index object ready to upload: its reference and a temporary file holding it."""

    ref: IndexRef
    file: Any


@dataclass
class SyncStats:
    """What this replicator sent (since it was created)."""

    uploaded_bytes: int = 0
    uploaded_objects: int = 0
    reused_objects: int = 0
    verified_bytes: int = 0
    heads_written: int = 0
    deleted_objects: int = 0


class Replicator:
    """Brings a remote copy up to a :class:`LocalSnapshot` (see the module docstring). Not
    thread-safe: one thread syncs."""

    def __init__(self, store: ObjectStore, opts: RemoteOptions,
                 cancel: threading.Event | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.opts = opts
        self.pacer = Pacer(opts.bandwidth, cancel)
        self.progress = progress
        self.stats = SyncStats()
        #: the remote's state is known (False: read it before the next sync)
        self.loaded = False
        #: HEAD generations present remotely -> the decoded HEAD (None: invalid, or not read)
        self.heads: dict[int, Head | None] = {}
        #: the newest valid HEAD (what a reader restores)
        self.head: Head | None = None
        #: objects under segments/ (and STORE) known to exist remotely -> size
        self.objects: dict[str, int] = {}
        #: the highest generation seen or written: a new HEAD always takes a higher one
        self.generation = 0
        #: extents whose digest matches local bytes, by (seq, file identity) -> offset -> extent
        self._extents: dict[tuple[int, tuple[int, int]], dict[int, Extent]] = {}
        #: extents of remote HEADs whose digest was found to match the local file, likewise
        self._checked: dict[tuple[int, tuple[int, int]], set[Extent]] = {}
        self._store_checked = False
        #: HEAD generations kept besides the newest ``keep_heads``: the ones a kept job HEAD
        #: pins (format-spec/remote.md §8, J4); asked at each load and remote gc
        self.pins: Callable[[], frozenset[int]] = frozenset

    def reset(self) -> None:
        """Forget what is known of the remote (after a failure: the service may have lost or
        changed objects); the next sync reads it again."""
        self.loaded = False
        self._store_checked = False

    def load(self) -> None:
        """Read the remote's state: existing objects, HEAD generations, the newest valid HEAD
        (and up to ``keep_heads`` valid ones); abort multipart uploads a dead process left."""
        listed = self.store.list_objects()
        self.objects = {n: s for n, s in listed.items()
                        if n == STORE_OBJECT or n.startswith((SEGMENTS_DIR, INDEX_DIR))}
        gens = list_heads(listed)
        self.generation = max([self.generation, *gens])
        self.heads, self.head = read_newest(gens, lambda g: read_head(self.store, g),
                                            self.opts.keep_heads, "HEAD")
        for g in sorted(self.pins() & set(gens)):
            if self.heads[g] is None:
                try:
                    self.heads[g] = read_head(self.store, g)
                except RemoteIntegrityError as e:
                    log.warning("ckptstore: %s (a job HEAD names it)", e)
        self.store.abort_uploads()
        self.loaded = True

    def check_compatible(self, snap: LocalSnapshot) -> None:
        """RemoteConflictError when the remote copy belongs to another store or went further
        than the local one (never overwritten)."""
        h = self.head
        if h is None:
            return
        url = str(self.store.where)
        if h.store_id != snap.store_id:
            raise RemoteConflictError(
                "sync", url, f"it holds another store (store_id {h.store_id.hex()}, HEAD "
                f"generation {h.generation}); {snap.path} is store {snap.store_id.hex()}")
        if pos_key(h.position) > pos_key(snap.position):
            raise RemoteConflictError(
                "sync", url, f"the remote copy (iteration {h.recoverable}, log position "
                f"{h.position}, HEAD generation {h.generation}) is newer than {snap.path} "
                f"(iteration {snap.recoverable}, position {snap.position}): another copy of "
                "this store went further; refusing to move the remote copy back")

    # ---- sync -----------------------------------------------------------------------------
    def sync(self, snap: LocalSnapshot) -> Head:
        """Upload what the remote lacks of ``snap``, then write its HEAD (unless the newest
        HEAD already says the same), then remove what no kept HEAD names. Returns the HEAD."""
        if not self.loaded:
            self.load()
        self.check_compatible(snap)
        h = self.head
        packed: _PackedIndex | None = None
        if not (h is not None and h.index is not None and h.position == snap.position):
            packed = self._pack_index(snap)  # first: the read transaction ends at once
        snap.release_index()
        try:
            return self._sync(snap, packed)
        finally:
            if packed is not None:
                packed.file.close()

    def _sync(self, snap: LocalSnapshot, packed: "_PackedIndex | None") -> Head:
        self._ensure_store(snap)
        entries = [self._sync_segment(seg) for seg in snap.segments]
        current = {(seg.seq, seg.ident) for seg in snap.segments}
        for gone in [k for k in self._extents if k not in current]:
            del self._extents[gone]  # segments a gc or a tail cut removed
        for gone in [k for k in self._checked if k not in current]:
            del self._checked[gone]
        new = Head(generation=0, store_id=snap.store_id, store_digest=digest(snap.store_bytes),
                   position=snap.position, latest=snap.latest, recoverable=snap.recoverable,
                   count=snap.count, watermark=snap.watermark, segments=tuple(entries),
                   created_ns=time.time_ns())
        h = self.head
        same = h is not None and (h.position, h.segments, h.latest, h.recoverable, h.count,
                                  h.store_digest) == (new.position, new.segments, new.latest,
                                                      new.recoverable, new.count,
                                                      new.store_digest)
        if same and (h is not None and h.index is not None or packed is None):
            self._collect()
            assert h is not None
            return h
        index = None if packed is None else self._upload_index(packed)
        if same and index is None:
            self._collect()
            assert h is not None
            return h
        new = replace(new, index=index)  # a HEAD the same but for an index gains one
        self._write_head(new, snap)
        self._collect()
        assert self.head is not None
        return self.head

    def _ensure_store(self, snap: LocalSnapshot) -> None:
        """The STORE object, written once (conditionally); another store's is a conflict."""
        if self._store_checked:
            return
        url = self.store.where.url(STORE_OBJECT)
        if STORE_OBJECT not in self.objects:
            if self.store.put(STORE_OBJECT, snap.store_bytes, if_absent=True):
                self.objects[STORE_OBJECT] = len(snap.store_bytes)
                self._store_checked = True
                self.stats.uploaded_objects += 1
                self.stats.uploaded_bytes += len(snap.store_bytes)
                return
        there = self.store.get(STORE_OBJECT, 0, 65)
        if there != snap.store_bytes:
            raise RemoteConflictError("sync", url, "the prefix holds another store's STORE "
                                      "object; refusing to write into it")
        self.objects[STORE_OBJECT] = len(there)
        self._store_checked = True

    def _sync_segment(self, seg: LocalSegment) -> SegmentEntry:
        """The extents of ``seg`` (uploading the ones the remote lacks). Every extent the newest
        HEAD names within the local bytes must match them: the new HEAD then extends that one.
        A mismatch means the remote copy holds another history (a copy of the store that went
        its own way, or damage of the local bytes): RemoteConflictError, nothing overwritten."""
        key = (seg.seq, seg.ident)
        known = self._extents.setdefault(key, {})  # offset -> extent, matching this file
        ok = self._checked.setdefault(key, set())  # remote extents found to match this file
        prior: dict[int, Extent] = {}
        entry = self.head.segment(seg.seq) if self.head is not None else None
        for p in entry.extents if entry is not None else ():
            if p.end > seg.length:
                break
            if p not in ok:
                if self._hash(seg, p.offset, p.length) != p.digest:
                    raise RemoteConflictError(
                        "sync", self.store.where.url(p.name),
                        f"its bytes {p.offset}..{p.end} of segment {seg.seq} (HEAD generation "
                        f"{self.head.generation if self.head else 0}) differ from {seg.path}: "
                        "the remote copy holds another history of this store (a copy that went "
                        "its own way) or the local bytes are damaged; refusing to overwrite it")
                ok.add(p)
            prior[p.offset] = p
        out: list[Extent] = []
        at = 0
        while at < seg.length:
            e = prior.get(at) or known.get(at)
            if e is None or e.end > seg.length:
                end = min(seg.length, (at // self.opts.max_object + 1) * self.opts.max_object)
                e = self._new_extent(seg, at, end - at)
                known[at] = e
            if self.objects.get(e.name) == e.length:  # listed, whole: the same bytes (O1)
                self.stats.reused_objects += 1
            else:
                self._upload(seg, e)
            out.append(e)
            at = e.end
        return SegmentEntry(seg.seq, seg.length, tuple(out))

    def _hash(self, seg: LocalSegment, offset: int, length: int) -> bytes:
        import xxhash

        h = xxhash.xxh3_128()
        pos, end = offset, offset + length
        while pos < end:
            block = seg.read(pos, min(HASH_BLOCK, end - pos))
            h.update(block)
            pos += len(block)
        self.stats.verified_bytes += length
        return h.digest()

    def _new_extent(self, seg: LocalSegment, offset: int, length: int) -> Extent:
        return Extent(seg.seq, offset, length, self._hash(seg, offset, length))

    def _upload(self, seg: LocalSegment, e: Extent) -> None:
        def read(off: int, n: int) -> bytes:
            return seg.read(e.offset + off, n)

        def sent(n: int) -> None:
            self.stats.uploaded_bytes += n
            if self.progress is not None:
                self.progress(n)

        self.store.put_range(e.name, read, e.length, self.opts.part_size, self.pacer,
                             metadata={"xxh3-128": e.digest.hex()}, sent=sent)
        self.objects[e.name] = e.length
        self.stats.uploaded_objects += 1

    def _pack_index(self, snap: LocalSnapshot) -> "_PackedIndex | None":
        """Copy the index state ``snap`` holds (compacted) and lz4-frame it, through temporary
        files. None when there is none, or the copy fails (the writer closed its index
        meanwhile, a rebuild): the HEAD then names no index, and readers fetch segments whole."""
        if snap.index is None:
            return None
        import lz4.frame
        import xxhash

        env, txn = snap.index
        packed = tempfile.TemporaryFile(prefix="ckptstore-index-")
        try:
            with tempfile.TemporaryFile(prefix="ckptstore-index-") as raw:
                try:
                    env.copyfd(raw.fileno(), compact=True, txn=txn)
                except lmdb.Error as e:
                    log.info("ckptstore: no index copy for this HEAD (%s)", e)
                    packed.close()
                    return None
                raw_length = os.fstat(raw.fileno()).st_size
                h = xxhash.xxh3_128()
                with io_errors("compress", "a temporary copy of the index"):
                    raw.seek(0)
                    comp = lz4.frame.LZ4FrameCompressor(content_checksum=True)

                    def out(piece: bytes) -> None:
                        h.update(piece)
                        packed.write(piece)

                    out(comp.begin())
                    while block := raw.read(HASH_BLOCK):
                        out(comp.compress(block))
                    out(comp.flush())
                    packed.flush()
            length = os.fstat(packed.fileno()).st_size
            if raw_length == 0 or length == 0:
                packed.close()
                return None
            return _PackedIndex(IndexRef(length, raw_length, h.digest()), packed)
        except BaseException:
            packed.close()
            raise

    def _upload_index(self, packed: "_PackedIndex") -> IndexRef:
        """Upload the index object unless it is there (one part in memory at a time)."""
        ref = packed.ref
        if self.objects.get(ref.name) == ref.length:
            self.stats.reused_objects += 1
            return ref
        fd = packed.file.fileno()

        def read(off: int, n: int) -> bytes:
            with io_errors("read", "a temporary copy of the index"):
                return os.pread(fd, n, off)

        def sent(n: int) -> None:
            self.stats.uploaded_bytes += n
            if self.progress is not None:
                self.progress(n)

        self.store.put_range(ref.name, read, ref.length, self.opts.part_size, self.pacer,
                             metadata={"xxh3-128": ref.digest.hex()}, sent=sent)
        self.objects[ref.name] = ref.length
        self.stats.uploaded_objects += 1
        return ref

    def _write_head(self, new: Head, snap: LocalSnapshot) -> None:
        """The remote commit point: a conditional create of the next generation. Losing the
        race to another writer re-reads the remote and retries above it, unless that writer's
        HEAD conflicts with ours."""
        def reread() -> int:
            self.load()
            self.check_compatible(snap)
            return self.generation

        gen = put_next_generation(self.store, head_name,
                                  lambda g: encode_head(replace(new, generation=g)),
                                  self.generation, reread)
        self.generation = gen
        self.head = self.heads[gen] = replace(new, generation=gen)
        self.stats.heads_written += 1

    def _collect(self) -> None:
        """Remote gc: delete HEADs older than the newest ``keep_heads`` valid ones (invalid
        ones too), then every object no remaining HEAD names."""
        self.stats.deleted_objects += collect(self.store, self.heads, self.opts.keep_heads,
                                              self.pins, head_name, self.objects)


# ---- push --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PushResult:
    """What a push did: the HEAD the remote now holds, what was sent."""

    url: str
    head: Head
    stats: SyncStats
    seconds: float


def push_store(path: str | os.PathLike, url: str, options: dict | None = None, *,
               progress: Callable[[int], None] | None = None) -> PushResult:
    """Upload the committed state of the single store at ``path`` to ``url`` (a catch-up: only
    what the remote lacks is sent, and an interrupted push resumes where it stopped). Opens the
    store as a reader: it never writes under ``path`` and may run beside its writer. (A job
    store: :func:`ckptstore.remote.transfer.push`.)"""
    path = os.fspath(path)
    refuse_job_part(path, "a push")  # one rank's partition would look like a whole store remotely
    client_opts, opts = split_options(options)
    t0 = time.perf_counter()
    rep = Replicator(ObjectStore(url, client_opts), opts, progress=progress)
    engine = ReaderEngine(path)
    try:
        for _ in range(5):
            snap = capture(engine)
            if snap is None:
                continue  # a gc deleted a segment under the listing: take it again
            try:
                head = rep.sync(snap)
            finally:
                snap.close()
            return PushResult(str(rep.store.where), head, rep.stats, time.perf_counter() - t0)
        raise RemoteError("push", url, f"the segments of {path} kept changing under the upload")
    finally:
        engine.close()
