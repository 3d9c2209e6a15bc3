"""Restoring from the object store alone, and verifying the remote copy (format-spec/remote.md).

:func:`pull` copies the objects of the newest valid remote HEAD into a local directory, which is
then an ordinary store: ``ckptstore.open(DIR, "r")`` loads any iteration the HEAD holds, bit for
bit, and a writer may continue it (with ``remote=`` the same URL, it continues the remote copy).
Every byte is checked against the HEAD's xxh3-128 digests while it streams in (memory: one
block); an object that fails is cut off again and raises RemoteIntegrityError naming it. Pulling
into a directory that already holds a copy is incremental: extents whose local bytes match are
kept, only the rest is downloaded; a local copy that holds bytes the remote does not (it was
written to since) is never overwritten (RemoteConflictError).

A pull takes the whole HEAD: every live segment, whatever iteration is wanted. Reading one
iteration's records straight from the objects with range GETs is :mod:`ckptstore.remote.reader`
(what ``ckptstore.open("s3://...", "r")`` does by default); it falls back to :func:`pull`'s
whole-segment download where the HEAD names no usable index.

:func:`verify_store` (``ckptstore fsck s3://...``) checks every HEAD, then every object the
newest valid HEAD names: present, of the right length, with the right digest; it reports what
is missing or damaged by name, and, given the local store, whether the remote copy is older.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import xxhash

from ..errors import (FormatError, RemoteConflictError, RemoteError, RemoteIntegrityError,
                      RemoteUnsupportedError, StoreLockedError, StoreNotFoundError)
from ..format.header import decode_store_header
from ..format.job import JOB_FORMAT_VERSION
from ..storage.fileops import FileOps, io_errors
from ..storage.job_log import refuse_job_part
from ..storage.layout import Layout
from ..storage.lock import no_writer
from .client import ObjectStore, parse_url
from .head import (INDEX_DIR, SEGMENTS_DIR, STORE_OBJECT, Extent, Head, SegmentEntry,
                   is_index_name, parse_extent_name)
from .generations import first_valid
from .replicate import list_heads, read_head, split_options

if TYPE_CHECKING:
    from .job_head import JobHead


H = TypeVar("H")

#: Bytes per block while streaming an object in.
BLOCK = 8 << 20


def newest_head(store: ObjectStore, listed: dict[str, int] | None = None) -> Head:
    """The newest HEAD that passes its checks (a damaged newer one is skipped, with a warning);
    StoreNotFoundError when there is none at all, RemoteIntegrityError when none is valid."""
    listed = store.list_objects("heads/") if listed is None else listed
    gens = list_heads(listed)
    if not gens:
        raise StoreNotFoundError(f"no ckptstore store at {store.where} (no HEAD object under "
                                 f"{store.where.url('heads/')})")
    return first_valid(gens, lambda g: read_head(store, g), "HEAD")


# ---- pull --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PullResult:
    """What a pull did: the HEAD restored, bytes and objects downloaded, bytes kept."""

    url: str
    path: str
    head: Head
    downloaded_bytes: int
    downloaded_objects: int
    kept_bytes: int
    seconds: float


def pull_store(url: str, path: str | os.PathLike, options: dict | None = None, *,
               progress: Callable[[int], None] | None = None) -> PullResult:
    """:func:`pull` of a single store's copy (StoreNotFoundError when ``url`` holds none)."""
    path = os.fspath(path)
    refuse_job_part(path, "a pull into it")  # (pull_head checks again: its other callers)
    client_opts, _ = split_options(options)
    store = ObjectStore(url, client_opts)
    t0 = time.perf_counter()
    head = newest_head(store)
    for _ in range(5):
        stats = PullStats()
        try:
            pull_head(store, head, path, stats, progress)
        except RemoteError as e:
            if e.code not in ("NoSuchKey", "404"):
                raise
            # an object vanished: a newer HEAD's gc collected it (a writer is uploading), or
            # someone deleted it. A newer HEAD: start over from it; the same: it is missing.
            newer = newest_head(store)
            if newer.generation == head.generation:
                raise RemoteIntegrityError("pull", e.url, f"named by HEAD generation "
                                           f"{head.generation} but missing") from e
            head = newer
            continue
        return PullResult(str(store.where), path, head, stats.downloaded, stats.objects,
                          stats.kept, time.perf_counter() - t0)
    raise RemoteError("pull", url, "the remote copy kept changing under the pull", code="Busy")


@dataclass
class PullStats:
    """Bytes and objects a :func:`pull_head` downloaded, bytes it kept."""

    downloaded: int = 0
    objects: int = 0
    kept: int = 0


def pull_head(store: ObjectStore, head: Head, path: str, stats: PullStats,
              progress: Callable[[int], None] | None, *, job_part: bool = False) -> None:
    """Make the directory ``path`` a verified copy of ``head`` (one attempt of :func:`pull`;
    also a lazy reader's whole-segment fallback, ckptstore/remote/reader.py). ``job_part``:
    ``path`` is a rank's stream of a job store being pulled whole (ckptstore/remote/job_pull.py),
    the one caller allowed to write into a job's part."""
    if not job_part:
        refuse_job_part(path, "a pull into it")
    ops = FileOps()
    layout = Layout(path)
    ops.makedirs(path)
    with no_writer(layout) as state:
        if state == "locked":
            raise StoreLockedError(f"{path} is open for writing by another process; a pull would "
                                   "change it under its writer")
        store_bytes = store.get(STORE_OBJECT, 0, 65)
        check_store_object(store, head, store_bytes)
        if os.path.exists(layout.store_file):
            with io_errors("read", layout.store_file), open(layout.store_file, "rb") as f:
                if f.read(65) != store_bytes:
                    raise RemoteConflictError("pull", path, f"it holds another store than "
                                              f"{store.where}; pull into an empty directory")
        else:
            others = [n for n in os.listdir(path) if n not in ("segments", "STORE.tmp")]
            if others or layout.list_segments():
                raise RemoteConflictError("pull", path, "the directory is neither empty nor a "
                                          "copy of this store")
            ops.makedirs(layout.segment_dir)
            ops.fsync_dir(path)
            ops.write_file_atomic(layout.store_file, store_bytes)
        ops.makedirs(layout.segment_dir)
        wanted = {s.seq for s in head.segments}
        first = min(wanted) if wanted else 0
        stale = []
        for seq in layout.list_segments():
            if seq in wanted:
                continue
            if seq < first:
                stale.append(seq)  # collected by a gc the remote copy already has
            else:
                raise RemoteConflictError(
                    "pull", layout.segment_path(seq), f"this local segment is not in the remote "
                    f"copy (HEAD generation {head.generation}): the local store was written to "
                    "after it was pulled; pull into an empty directory")
        for seg in head.segments:
            _pull_segment(store, ops, layout, seg, stats, progress)
        for seq in stale:
            ops.unlink(layout.segment_path(seq))
        ops.fsync_dir(layout.segment_dir)
        ops.fsync_dir(path)


def check_store_object(store: ObjectStore, head: "Head | JobHead", data: bytes) -> None:
    """RemoteIntegrityError unless ``data`` (the STORE object) is the one ``head`` (a store's
    HEAD, or a job HEAD: then a STORE of format version 2) names."""
    url = store.where.url(STORE_OBJECT)
    got = xxhash.xxh3_128_digest(data)
    if got != head.store_digest:
        raise RemoteIntegrityError("check", url, f"digest mismatch: HEAD generation "
                                   f"{head.generation} says {head.store_digest.hex()}, the object "
                                   f"holds {got.hex()}")
    try:
        h = (decode_store_header(data) if isinstance(head, Head) else
             decode_store_header(data, (JOB_FORMAT_VERSION,)))
    except FormatError as e:
        raise RemoteIntegrityError("check", url, str(e)) from e
    if h.store_id != head.store_id:
        raise RemoteIntegrityError("check", url, f"store_id {h.store_id.hex()} differs from the "
                                   f"HEAD's {head.store_id.hex()}")


def _pull_segment(store: ObjectStore, ops: FileOps, layout: Layout, seg: SegmentEntry,
                  stats: PullStats, progress: Callable[[int], None] | None) -> None:
    """Make the local segment file hold the remote segment's bytes: keep a verified prefix,
    stream in the rest (checking that bytes already there agree), verify every extent."""
    path = layout.segment_path(seg.seq)
    exists = os.path.exists(path)
    size = os.path.getsize(path) if exists else 0
    if size > seg.length:
        raise RemoteConflictError("pull", path, f"holds {size} bytes, the remote copy "
                                  f"{seg.length}: the local store was written to after it was "
                                  "pulled; pull into an empty directory")
    rfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if exists else -1
    wfd = ops.open_append(path, create=not exists)
    try:
        if rfd < 0:
            rfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        at = 0
        for e in seg.extents:
            if e.end <= size and local_digest(rfd, path, e) == e.digest:
                at = e.end
                stats.kept += e.length
                continue
            break
        for e in seg.extents:
            if e.offset < at:
                continue
            try:
                _download_extent(store, ops, wfd, rfd, path, e, size, stats, progress)
            except RemoteConflictError:
                raise  # found before writing a byte that differs: the local bytes stay
            except BaseException:
                # never leave bytes that failed a check: cut back to the verified prefix
                if e.offset == 0 and not exists:
                    os.close(wfd)
                    wfd = -1
                    ops.unlink(path)
                else:
                    ops.truncate(wfd, path, e.offset)
                raise
        if wfd >= 0:
            ops.fsync(wfd, path)
    finally:
        if wfd >= 0:
            os.close(wfd)
        if rfd >= 0:
            os.close(rfd)


def local_digest(fd: int, path: str, e: Extent) -> bytes:
    """The xxh3-128 of bytes [``e.offset``, ``e.end``) of the open file ``fd`` (at ``path``);
    of fewer bytes where the file ends before ``e.end``."""
    h = xxhash.xxh3_128()
    pos = e.offset
    with io_errors("read", path):
        while pos < e.end:
            block = os.pread(fd, min(BLOCK, e.end - pos), pos)
            if not block:
                break
            h.update(block)
            pos += len(block)
    return h.digest()


def _download_extent(store: ObjectStore, ops: FileOps, wfd: int, rfd: int, path: str,
                     e: Extent, size: int, stats: PullStats,
                     progress: Callable[[int], None] | None) -> None:
    url = store.where.url(e.name)
    h = xxhash.xxh3_128()
    pos = e.offset
    for block in store.stream(e.name, BLOCK):
        if pos + len(block) > e.end:
            raise RemoteIntegrityError("get", url, f"longer than the {e.length} bytes the HEAD "
                                       "names")
        if pos < size:  # bytes already here (an interrupted pull) must agree
            with io_errors("read", path):
                mine = os.pread(rfd, min(size, pos + len(block)) - pos, pos)
            if mine != block[:len(mine)]:
                raise RemoteConflictError("pull", path, f"local bytes at offset {pos} differ from "
                                          f"{url}: the local store was written to after it was "
                                          "pulled; pull into an empty directory")
        h.update(block)
        ops.writev(wfd, path, [block], pos)
        pos += len(block)
        stats.downloaded += len(block)
        if progress is not None:
            progress(len(block))
    if pos != e.end:
        raise RemoteIntegrityError("get", url, f"holds {pos - e.offset} bytes, the HEAD names "
                                   f"{e.length}")
    if h.digest() != e.digest:
        raise RemoteIntegrityError("get", url, f"digest mismatch: expected {e.digest.hex()}, "
                                   f"got {h.hexdigest()} (changed behind our back)")
    stats.objects += 1


# ---- open("s3://...") ----------------------------------------------------------------------------
def pull_for_open(url: str, mode: str, options: dict[str, Any]
                  ) -> tuple[str, Callable[[], None] | None, dict[str, Any]]:
    """What ``ckptstore.open(url, "r", storage_options=..., cache_dir=...)`` reads from: pull
    into ``cache_dir`` (kept: the next open pulls only what is new) or into a new temporary
    directory (removed by the returned cleanup). Returns (local directory, cleanup or None,
    the options left for the Store)."""
    if mode != "r":
        raise RemoteUnsupportedError(f"{url}: a remote store opens read-only (mode=\"r\"); to "
                                     "write, open a local path with remote=URL")
    rest = dict(options)
    storage = rest.pop("storage_options", None) or {}
    cache = rest.pop("cache_dir", None)
    for k in ("remote", "remote_options", "process_group"):
        if rest.get(k) is not None:
            raise RemoteUnsupportedError(f"{url}: option {k!r} does not apply to a remote reader")
        rest.pop(k, None)
    parse_url(url)
    if cache is not None:
        pull_store(url, os.fspath(cache), storage)
        return os.fspath(cache), None, rest
    tmp = tempfile.mkdtemp(prefix="ckptstore-pull-")
    try:
        pull_store(url, tmp, storage)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, lambda: shutil.rmtree(tmp, ignore_errors=True), rest


# ---- fsck of the remote copy ---------------------------------------------------------------------
@dataclass
class FsckFindings:
    """What a remote fsck counts and finds, for either kind (:class:`RemoteFsckReport`,
    :class:`~ckptstore.remote.job_fsck.JobFsckReport`): lines naming what is missing or damaged,
    and notes."""

    url: str
    heads: int = 0
    objects: int = 0
    bytes_verified: int = 0
    damage: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: compared with a local store: its newest recoverable iteration, and whether the remote
    #: copy lags it
    local_iteration: int | None = None
    behind: bool = False
    #: compared with a local store: the objects whose bytes it does not hold
    differs: list[str] = field(default_factory=list)

    def read_heads(self, gens: list[int], read: Callable[[int], H], what: str) -> list[H]:
        """The valid ones of HEAD-like generations ``gens`` (newest first) read with ``read``; a
        damaged one newer than every valid one is damage (readers fall back past it), an older
        one a note. ``what`` names the kind ("HEAD", "job HEAD")."""
        self.heads = len(gens)
        valid: list[H] = []
        for g in gens:
            try:
                valid.append(read(g))
            except RemoteIntegrityError as e:
                if valid:  # older than the newest valid one: the next upload deletes it
                    self.notes.append(f"an older {what} is damaged: {e}")
                else:
                    self.damage.append(f"{e}" + (f" (readers use the next older valid {what})"
                                                 if len(gens) > 1 else ""))
        return valid

    def found(self) -> list[str]:
        """The lines of what is missing, damaged, and the notes."""
        return ([f"MISSING {m}" for m in self.missing] + [f"DAMAGE {d}" for d in self.damage]
                + [f"note: {n}" for n in self.notes])

    def behind_lines(self, remote_iteration: int | None, local: str) -> list[str]:
        """The BEHIND line when the remote copy (at ``remote_iteration``) lags the ``local``
        store ("the local store", "the local job store") it was compared with."""
        return ([f"BEHIND: the remote copy holds iteration {remote_iteration}, {local} "
                 f"{self.local_iteration}"] if self.behind else [])


@dataclass
class RemoteFsckReport(FsckFindings):
    """What :func:`verify_store` found. ``clean``: a valid HEAD, and every object it names is
    present, whole and matches its digest."""

    head: Head | None = None

    @property
    def clean(self) -> bool:
        return self.head is not None and not self.damage and not self.missing and not self.differs

    def lines(self) -> list[str]:
        h = self.head
        out = [f"remote {self.url}: " + (
            f"HEAD generation {h.generation}, iteration {h.recoverable} ({h.count} iterations), "
            f"{len(h.segments)} segments, {self.objects} objects, {self.bytes_verified} bytes "
            "verified" if h is not None else "no valid HEAD")]
        out += [f"DIFFERS {d}" for d in self.differs] + self.found()
        out += self.behind_lines(None if h is None else h.recoverable, "the local store")
        out.append("clean" if self.clean else f"NOT CLEAN: {len(self.missing)} missing objects, "
                   f"{len(self.damage)} damaged" + (
                       f", {len(self.differs)} differ from the local store" if self.differs
                       else "") + ("" if h is not None else ", no valid HEAD"))
        return out


def verify_store(url: str, options: dict | None = None, *,
                 progress: Callable[[int], None] | None = None) -> RemoteFsckReport:
    """Verify a single store's remote copy at ``url`` (every HEAD; every object of the newest
    valid one, by length and digest). (Compared with a local store:
    :func:`~.job_compare.compare_store`.)"""
    client_opts, _ = split_options(options)
    store = ObjectStore(url, client_opts)
    report = RemoteFsckReport(str(store.where))
    listed = store.list_objects()
    gens = list_heads(listed)
    valid = report.read_heads(gens, lambda g: read_head(store, g), "HEAD")
    if not gens:
        report.damage.append(f"no HEAD object under {store.where.url('heads/')}: nothing was "
                             "uploaded, or no upload finished")
    if not valid:
        return report
    head = report.head = valid[0]
    verify_objects(store, head, head_objects(head), listed, report, progress)
    named = set().union(*(h.objects() for h in valid))
    stray = [n for n in listed if n.startswith((SEGMENTS_DIR, INDEX_DIR)) and n not in named]
    odd = [n for n in stray if parse_extent_name(n) is None and not is_index_name(n)]
    if stray:
        report.notes.append(f"{len(stray)} objects under {store.where.url(SEGMENTS_DIR)} or "
                            f"{store.where.url(INDEX_DIR)} that no HEAD names (an interrupted "
                            "upload: the next one reuses or deletes them)" + (
                                f", {len(odd)} not named like extents" if odd else ""))
    if len(valid) > 1:
        report.notes.append(f"{len(valid) - 1} older HEADs kept (generations "
                            f"{[h.generation for h in valid[1:]]})")
    return report


def head_objects(head: Head) -> list[tuple[str, int, bytes]]:
    """What a store's HEAD names, as (object name, length, xxh3-128): STORE, every extent, the
    index object."""
    wanted: list[tuple[str, int, bytes]] = [(STORE_OBJECT, 64, head.store_digest)]
    wanted += [(e.name, e.length, e.digest) for e in head.extents()]
    if head.index is not None:
        wanted.append((head.index.name, head.index.length, head.index.digest))
    return wanted


def verify_objects(store: ObjectStore, head: "Head | JobHead", wanted: list[tuple[str, int, bytes]],
                   listed: dict[str, int], report: Any,
                   progress: Callable[[int], None] | None = None, who: str = "") -> None:
    """Check that each ``(name, length, digest)`` of ``wanted`` (named by ``head``) is in
    ``listed`` (the store's listing) with that length, and streams in with that digest (the
    STORE object is also decoded against ``head``). What fails goes to ``report.missing`` or
    ``report.damage`` (each line starting with ``who``, naming the object's URL); every object
    read counts in ``report.objects`` and ``report.bytes_verified``."""
    for name, length, dig in wanted:
        u = store.where.url(name)
        if name not in listed:
            report.missing.append(f"{who}{u} (named by HEAD generation {head.generation})")
            continue
        if listed[name] != length:
            report.damage.append(f"{who}{u}: {listed[name]} bytes, the HEAD names {length}")
            continue
        h = xxhash.xxh3_128()
        try:
            for block in store.stream(name, BLOCK):
                h.update(block)
                report.bytes_verified += len(block)
                if progress is not None:
                    progress(len(block))
        except RemoteError as e:
            if e.code in ("NoSuchKey", "404"):
                report.missing.append(f"{who}{u} (named by HEAD generation {head.generation})")
                continue
            raise
        report.objects += 1
        if h.digest() != dig:
            report.damage.append(f"{who}{u}: digest mismatch: the HEAD says {dig.hex()}, the "
                                 f"object holds {h.hexdigest()} (changed behind our back)" + (
                                     "; it is the index, a cache: readers validate it and fetch "
                                     "the segments instead" if name.startswith(INDEX_DIR) else ""))
        elif name == STORE_OBJECT:
            try:
                check_store_object(store, head, store.get(STORE_OBJECT, 0, 65))
            except RemoteIntegrityError as e:
                report.damage.append(f"{who}{e}")
