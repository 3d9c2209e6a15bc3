"""Reading a remote copy lazily: ``ckptstore.open("s3://bucket/run", "r")`` on a fresh machine
loads any committed iteration of the newest HEAD, fetching only the byte ranges it needs
(format-spec/remote.md §7).

At open only metadata is fetched: the newest valid HEAD, the STORE object (checked against the
HEAD's digest and store_id) and the **index object** the HEAD names (an lz4 frame of a compact
copy of the writer's LMDB index, checked against its length and digest while it streams in),
written into a private temporary directory. The engine is a
:class:`~ckptstore.engine.reader_engine.ReaderEngine` (:class:`RemoteReaderEngine`) whose log
reads segments through :class:`~ckptstore.remote.pieces.RemoteSegmentFile`
(:mod:`ckptstore.remote.pieces`): ``pread`` maps a segment's byte range onto the HEAD's extent
objects and fetches it with range GETs -- small reads through a bounded LRU
block cache (``block_size``, ``cache_size``), large ones (a chunk record) exactly. Nothing of a
segment is trusted more than a local file is: every byte a load returns passed the read path's
checks (record trailers, the manifest digest, chunk addresses), and a fetch that covers a whole
extent is checked against the extent's digest.

The index is a cache, used exactly as a local reader uses the writer's index (format-spec
format.md §16): opened read-only (its pages checked first), validated against the log (the
segments up to its position are the HEAD's, the COMMIT record at its last commit holds that
commit and ends at its position), the log after its position scanned (so an older index still
serves a newer HEAD), every commit entry checked against its COMMIT record on use. An index that
is absent (a HEAD of an older writer), damaged or fails validation -- or any failure a warm
index may have caused -- makes the reader **fetch the segments whole** (the verified download
of :func:`~ckptstore.remote.restore.pull`, into the same private directory) and scan them: slower,
still correct.

A read that fails its record checks is checked against the objects it read: the extents under
the failing record are fetched whole and hashed; one whose digest differs from the HEAD's raises
:class:`~ckptstore.errors.RemoteIntegrityError` naming the object (it was changed behind our
back). Service failures reach the caller as the RemoteError they are, never as damage.

A reader reads the HEAD that was newest when it opened; reopen to see a newer one. An extent
that vanishes under it (a writer's remote gc collected the segment after two newer HEADs) raises
RemoteIntegrityError naming it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import xxhash

from ..engine.reader_engine import ReaderEngine
from ..errors import (CkptStoreError, CorruptRecordError, FormatError, RemoteError,
                      RemoteIntegrityError, RemoteUnsupportedError)
from ..storage.index import Index, MemoryIndex, Position
from ..storage.layout import Layout, is_segment_seq
from ..storage.log import Log
from ..storage.reader_index import ReaderIndex
from ..storage.segments import SegmentFile
from .client import ObjectStore, parse_url
from .head import SEGMENTS_DIR, STORE_OBJECT, Head, IndexRef, encode_head
from .pieces import (DEFAULT_BLOCK, DEFAULT_CACHE, GONE_CODES, STREAM_STEP, PieceReader,
                     RemoteSegmentFile)
from .replicate import split_options
from .restore import PullResult, check_store_object, pull_head, PullStats, newest_head, pull_store

log = logging.getLogger("ckptstore")

#: Reader options (in ``storage_options``, beside the client's).
READER_KEYS = frozenset({"block_size", "cache_size"})


@dataclass(frozen=True)
class RemoteReadStats:
    """What a remote reader fetched since it opened (:meth:`ckptstore.Store.remote_read_stats`)."""

    url: str
    #: the HEAD this reader reads
    generation: int
    #: "ranges": segments are read with range GETs; "whole": they were fetched whole (no usable
    #: index, ``lazy=False`` or ``cache_dir``)
    mode: str
    #: the index object: "used" (validated, serving reads), "absent" (the HEAD names none),
    #: "missing" (named, not there), "damaged" (its bytes fail their digest or do not decode),
    #: "unusable" (it failed a check against the log), "skipped" (not fetched:
    #: ``use_index=False``, ``lazy=False``, ``cache_dir``)
    index: str
    #: bytes fetched from the object store: HEAD, STORE, index, ranges, whole objects
    bytes_read: int
    #: GET requests made (LISTs not counted)
    requests: int
    #: small reads served from the block cache
    cache_hits: int
    #: block size and cache capacity in bytes
    block_size: int
    cache_size: int


@dataclass(frozen=True)
class _HeadLayout(Layout):
    """A store directory whose segments are the HEAD's (named by their remote prefix)."""

    seqs: tuple[int, ...] = ()
    prefix: str = ""

    def list_segments(self) -> list[int]:
        return list(self.seqs)

    def segment_path(self, seq: int) -> str:
        return f"{self.prefix}{seq:010d}"


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        # the cause first; a context only where it was not suppressed (``raise ... from``)
        stack += [None if e.__suppress_context__ else e.__context__, e.__cause__]


class RemoteLog(Log):
    """The log of a remote copy: the HEAD's segments, read with range GETs until
    :meth:`materialize` fetches them whole into the reader's private directory."""

    def __init__(self, local: Layout, store_id: bytes, reader: PieceReader, *,
                 framing_checks: bool) -> None:
        head = reader.head
        super().__init__(_HeadLayout(local.root, tuple(s.seq for s in head.segments),
                                     reader.url(SEGMENTS_DIR)), store_id,
                         framing_checks=framing_checks)
        self.local = local
        self.reader = reader
        #: the segments are local files now (fetched whole and verified)
        self.whole = False
        self._paths: dict[str, int] = {}
        self._materialize_lock = threading.Lock()

    def file(self, seq: int) -> SegmentFile:
        f = self._files.get(seq)
        if f is None:
            if not is_segment_seq(seq):
                raise CorruptRecordError(f"a location names segment {seq}, which is out of range "
                                         f"in {self.layout.segment_path(seq)}")
            if self.whole:
                f = SegmentFile(self.local.segment_path(seq), seq)
            else:
                f = RemoteSegmentFile(self.layout.segment_path(seq), seq, self.reader)
                self._paths[f.path] = seq
            f = self._files.setdefault(seq, f)
        return f

    def materialize(self) -> None:
        """Fetch every segment of the HEAD whole into the private directory, each extent checked
        against its digest as it arrives (RemoteIntegrityError names one that differs); reads
        use the local files from then on."""
        with self._materialize_lock:
            if self.whole:
                return
            stats = PullStats()
            try:
                pull_head(self.reader.store, self.reader.head, self.local.root, stats, None)
            except RemoteError as e:
                if e.code in GONE_CODES and not isinstance(e, RemoteIntegrityError):
                    raise RemoteIntegrityError(
                        "get", str(e.filename), f"named by HEAD generation "
                        f"{self.reader.head.generation} but missing (a newer HEAD's gc collected "
                        "it, or it was deleted); reopen the store to read the newest HEAD"
                    ) from None
                raise
            finally:
                self.reader.count(stats.downloaded + 64, stats.objects + 1)
            self.whole = True
            self._files = {}  # open remote files stay usable for reads in flight

    def audit(self, err: BaseException) -> None:
        """After a failed read: check the extents under every record the failure is located at
        against their digests; RemoteIntegrityError naming the first that differs."""
        if self.whole:
            return
        for fe in _chain(err):
            if not isinstance(fe, FormatError) or fe.path is None or fe.offset is None:
                continue
            seq = self._paths.get(str(fe.path))
            f = self._files.get(seq) if seq is not None else None
            if seq is None or not isinstance(f, RemoteSegmentFile):
                continue
            end = f.span(fe.offset) or fe.offset + 1
            for e in self.reader.pieces(seq, fe.offset, end):
                got = self.reader.verify_piece(e)
                if got is not None:
                    raise RemoteIntegrityError(
                        "read", self.reader.url(e.name), f"digest mismatch: HEAD generation "
                        f"{self.reader.head.generation} says {e.digest.hex()}, the object holds "
                        f"{got.hex()} (changed behind our back; the read found: {fe.reason})"
                    ) from fe
                self.reader.forget(e)


class _TemporaryCopyEngine(ReaderEngine):
    """A reader over a private directory (the fetched metadata, or a whole pull): ``_cleanup``
    removes it once, after the engine is closed."""

    _cleanup: Callable[[], None] | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            cleanup, self._cleanup = self._cleanup, None
            if cleanup is not None:
                cleanup()


class RemoteReaderEngine(_TemporaryCopyEngine):
    """A reader of one remote HEAD (see the module docstring). ``path`` is its private directory
    (STORE, the index); ``cleanup`` runs once it is closed."""

    def __init__(self, path: str, reader: PieceReader, *, index: str, load_threads: int = 8,
                 use_index: bool = True, cleanup: Callable[[], None] | None = None) -> None:
        self.reader = reader
        self.index_state = index
        self._cleanup = cleanup
        self.remote_log: RemoteLog | None = None
        super().__init__(path, load_threads=load_threads, use_index=use_index)

    def _open_log(self) -> Log:
        self.remote_log = RemoteLog(self.layout, self.header.store_id, self.reader,
                                    framing_checks=self.header.framing_checks)
        return self.remote_log

    def _rlog(self) -> RemoteLog:
        assert self.remote_log is not None
        return self.remote_log

    def _warm_view(self, live: list[int]) -> tuple[Index, Position | None]:
        rlog = self._rlog()
        if not rlog.whole:
            index, start = super()._warm_view(live)
            if isinstance(index, ReaderIndex):
                self.index_state = "used"
                return index, start
            if self.index_state == "fetched":
                self.index_state = "unusable"
                log.warning("ckptstore: the index object of %s (HEAD generation %d) does not "
                            "validate against the log; fetching the segments whole",
                            self.reader.store.where, self.reader.head.generation)
            rlog.materialize()
        return MemoryIndex(), None

    def _go_cold(self) -> None:
        self._rlog().materialize()
        if self.index_state == "used":
            self.index_state = "unusable"
        super()._go_cold()

    def _audited(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except CkptStoreError as e:
            for c in _chain(e):
                if isinstance(c, RemoteError) and c is not e:
                    raise c  # the service failed, or an object changed: not the store's damage
            self._rlog().audit(e)
            raise

    def indexed(self, lookup: Callable[[], Any]) -> Any:
        return super().indexed(lambda: self._audited(lookup))

    def read(self, fn: Callable[[], Any]) -> Any:
        return super().read(lambda: self._audited(fn))

    def remote_stats(self) -> RemoteReadStats:
        r = self.reader
        nbytes, requests, hits = r.counters()
        return RemoteReadStats(str(r.store.where), r.head.generation,
                               "whole" if self._rlog().whole else "ranges", self.index_state,
                               nbytes, requests, hits, r.block, r.capacity)


class PulledReaderEngine(_TemporaryCopyEngine):
    """A reader of a remote copy pulled whole into a directory (``cache_dir``, ``lazy=False``)."""

    def __init__(self, path: str, pulled: PullResult, *, load_threads: int = 2,
                 use_index: bool = True, cleanup: Callable[[], None] | None = None) -> None:
        self.pulled = pulled
        self._cleanup = cleanup
        super().__init__(path, load_threads=load_threads, use_index=use_index)

    def remote_stats(self) -> RemoteReadStats:
        p = self.pulled
        return RemoteReadStats(p.url, p.head.generation, "whole", "skipped", p.downloaded_bytes,
                               p.downloaded_objects, 0, 0, 0)


# ---- open ------------------------------------------------------------------------------------
def _fetch_index(reader: PieceReader, ref: IndexRef, index_dir: str) -> str:
    """Stream the index object into ``index_dir/data.mdb`` (decompressed, bounded by its raw
    length), checking its length and digest; "fetched", "missing" (not there), or "damaged"
    (warned, nothing kept)."""
    import lz4.frame

    url = reader.url(ref.name)
    os.makedirs(index_dir, exist_ok=True)
    data = os.path.join(index_dir, "data.mdb")
    h = xxhash.xxh3_128()
    n = raw = 0
    why = ""
    try:
        d = lz4.frame.LZ4FrameDecompressor()
        with open(data, "wb") as f:
            try:
                for chunk in reader.store.stream(ref.name, STREAM_STEP):
                    n += len(chunk)
                    if n > ref.length:
                        why = f"longer than the {ref.length} bytes the HEAD names"
                        break
                    h.update(chunk)
                    out = d.decompress(chunk, max_length=ref.raw_length - raw + 1)
                    while True:
                        raw += len(out)
                        if raw > ref.raw_length:
                            why = f"decompresses to more than {ref.raw_length} bytes"
                            break
                        f.write(out)
                        if d.needs_input or d.eof:
                            break
                        out = d.decompress(b"", max_length=ref.raw_length - raw + 1)
                    if why:
                        break
            finally:
                reader.count(n)
        if not why:
            if n != ref.length:
                why = f"holds {n} bytes, the HEAD names {ref.length}"
            elif h.digest() != ref.digest:
                why = (f"digest mismatch: the HEAD says {ref.digest.hex()}, the object holds "
                       f"{h.hexdigest()} (changed behind our back)")
            elif not d.eof or raw != ref.raw_length:
                why = f"an incomplete lz4 frame ({raw} of {ref.raw_length} bytes)"
    except RemoteError as e:
        if e.code not in GONE_CODES:
            raise
        shutil.rmtree(index_dir, ignore_errors=True)
        return "missing"
    except (RuntimeError, ValueError, EOFError) as e:  # lz4's errors for bytes it cannot decode
        why = f"not an lz4 frame ({e})"
    if why:
        log.warning("ckptstore: the index object %s is damaged (%s); it is a cache: reading the "
                    "segments whole instead", url, why)
        shutil.rmtree(index_dir, ignore_errors=True)
        return "damaged"
    # LMDB's lock file, created empty here (LMDB initialises it): the reader never writes the
    # data file; this private directory is nobody else's
    open(os.path.join(index_dir, "lock.mdb"), "wb").close()
    return "fetched"


def open_lazy(url: str, storage: dict[str, Any], *, load_threads: int = 8,
              use_index: bool = True, head: Head | None = None) -> RemoteReaderEngine:
    """A :class:`RemoteReaderEngine` of the newest valid HEAD at ``url`` (see the module
    docstring), or of ``head`` (a job HEAD's pinned stream HEAD). ``storage``: the client's
    options and the reader's (``block_size``, ``cache_size``)."""
    opts = dict(storage)
    block = int(opts.pop("block_size", DEFAULT_BLOCK))
    cache = int(opts.pop("cache_size", DEFAULT_CACHE))
    client_opts, _ = split_options(opts)
    store = ObjectStore(url, client_opts)
    tmp = tempfile.mkdtemp(prefix="ckptstore-remote-")
    try:
        head = newest_head(store) if head is None else head
        for _ in range(5):
            reader = PieceReader(store, head, block, cache)
            reader.count(len(encode_head(head)), 2)  # the LIST of heads/ and the HEAD itself
            try:
                store_bytes = reader.fetch(STORE_OBJECT, 0, 64)
                check_store_object(store, head, store_bytes)
                with open(os.path.join(tmp, "STORE"), "wb") as f:
                    f.write(store_bytes)
                index_state = "absent" if head.index is None else "skipped"
                ref = head.index
                if ref is not None and use_index:
                    index_state = _fetch_index(reader, ref, os.path.join(tmp, "index"))
                    if index_state == "missing":
                        newer = newest_head(store)
                        if newer.generation != head.generation:
                            head = newer  # a newer HEAD's gc collected it: read that HEAD
                            continue
                        log.warning("ckptstore: the index object %s named by HEAD generation %d "
                                    "is missing; it is a cache: reading the segments whole "
                                    "instead", reader.url(ref.name), head.generation)
                reader.prefetch_headers()
            except RemoteIntegrityError as e:
                # an object vanished: a newer HEAD's gc collected it (a writer is uploading);
                # start over from the newest HEAD. Under the same HEAD, it is missing.
                newer = newest_head(store)
                if newer.generation == head.generation or "missing" not in str(e):
                    raise
                head = newer
                shutil.rmtree(os.path.join(tmp, "index"), ignore_errors=True)
                continue
            break
        else:
            raise RemoteError("open", url, "the remote copy kept changing under the open",
                              code="Busy")
        engine = RemoteReaderEngine(tmp, reader, index=index_state, load_threads=load_threads,
                                    use_index=use_index,
                                    cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    weakref.finalize(engine, shutil.rmtree, tmp, ignore_errors=True)
    return engine


def reader_options(url: str, mode: str, options: dict[str, Any]
                   ) -> tuple[dict[str, Any], Any, bool, dict[str, Any]]:
    """(storage options, cache_dir, lazy, the rest) of ``ckptstore.open(url, mode, ...)``'s
    options for a remote reader (a store's or a job's); RemoteUnsupportedError for a mode or an
    option a remote reader does not take, or a URL it cannot read."""
    if mode != "r":
        raise RemoteUnsupportedError(f"{url}: a remote store opens read-only (mode=\"r\"); to "
                                     "write, open a local path with remote=URL")
    rest = dict(options)
    storage = dict(rest.pop("storage_options", None) or {})
    cache = rest.pop("cache_dir", None)
    lazy = bool(rest.pop("lazy", True))
    for k in ("remote", "remote_options", "process_group"):
        if rest.get(k) is not None:
            raise RemoteUnsupportedError(f"{url}: option {k!r} does not apply to a remote reader")
        rest.pop(k, None)
    parse_url(url)
    return storage, cache, lazy, rest


def open_remote(url: str, mode: str, options: dict[str, Any]
                ) -> tuple[ReaderEngine, dict[str, Any]]:
    """What ``ckptstore.open(url, "r", storage_options=..., cache_dir=..., lazy=...)`` reads:
    the reader engine of the newest remote HEAD, and the options left for the Store. By default
    lazy (range GETs, see the module docstring); with ``cache_dir`` the HEAD is pulled into that
    directory (kept: the next open pulls only what is new), with ``lazy=False`` into a temporary
    one (removed when the store is closed or dropped)."""
    storage, cache, lazy, rest = reader_options(url, mode, options)
    use_index = bool(rest.get("use_index", True))
    engine: ReaderEngine
    if cache is None and lazy:
        engine = open_lazy(url, storage, load_threads=int(rest.get("load_threads", 8)),
                           use_index=use_index)
    else:
        for k in READER_KEYS:
            storage.pop(k, None)
        threads = int(rest.get("load_threads", 2))
        if cache is not None:
            path = os.fspath(cache)
            engine = PulledReaderEngine(path, pull_store(url, path, storage), load_threads=threads,
                                        use_index=use_index)
        else:
            tmp = tempfile.mkdtemp(prefix="ckptstore-pull-")
            try:
                pulled = pull_store(url, tmp, storage)
                engine = PulledReaderEngine(tmp, pulled, load_threads=threads,
                                            use_index=use_index,
                                            cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            weakref.finalize(engine, shutil.rmtree, tmp, ignore_errors=True)
    return engine, rest
