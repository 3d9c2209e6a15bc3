"""Restoring a multi-rank job store from the object store alone (format-spec/remote.md §8).

:func:`pull_job` makes a local directory a job store holding the newest valid job HEAD's cut:

1. the job's STORE object, checked against the job HEAD (digest, store_id, format version 2);
   a directory holding another store, or bytes the cut lacks (a newer epoch's global log or
   stream: the local copy was written to since), is refused before anything changes;
2. every global log prefix the job HEAD names, fetched and checked into memory;
3. every stream the job HEAD pins: its HEAD object fetched and checked against the pinned digest,
   then pulled with the single store's verified, incremental pull
   (:func:`~ckptstore.remote.restore.pull_head`) into ``streams/EEEEEEEEEE-RRRRR``;
4. the global logs written (each atomically), then, for a new copy, the STORE file last (what
   makes the directory a job store).

The result opens as any job store: ``ckptstore.open(DIR, "r")`` loads every iteration of the cut,
and a job of any world size continues it (``ckptstore.open(DIR, "a", process_group=pg)``: a new
epoch adopts the pulled global logs; the Checkpointer's elastic restore re-partitions the state).
An object the job HEAD names that is missing raises RemoteStreamMissingError (rank, epoch and the
object's URL) for a stream's, RemoteIntegrityError for the job's own.

:func:`open_remote_job` (``ckptstore.open("s3://...", "r")`` of a job) reads lazily instead: the
job's STORE and global logs into a private directory, and each rank's stream only when a load
needs it, as the single store's lazy remote reader of the pinned stream HEAD. What such a reader
fetched (``JobStore.remote_read_stats()``) is :func:`job_read_stats`: the job's own objects plus
the sum over the rank streams it opened.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import (DamagedCheckpointError, RemoteConflictError, RemoteError,
                      RemoteIntegrityError, RemoteStreamMissingError,
                      StoreNotFoundError)
from ..storage.fileops import FileOps, io_errors
from ..storage.job_log import STREAM_RE, JobLayout, refuse_job_part
from .client import ObjectStore
from .head import STORE_OBJECT, Head, digest
from .job_head import (JobHead, LogEntry, StreamRef, encode_job_head, is_remote_job,
                       log_extent_name, newest_job_head, stream_store, stream_url)
from .pieces import DEFAULT_BLOCK
from .reader import READER_KEYS, RemoteReaderEngine, RemoteReadStats, open_lazy, reader_options
from .replicate import fetch_head, split_options
from .restore import PullStats, check_store_object, pull_head

_MISSING = ("NoSuchKey", "404")


@dataclass(frozen=True)
class JobPullResult:
    """What a job pull did: the job HEAD restored, bytes and objects downloaded, bytes kept."""

    url: str
    path: str
    head: JobHead
    downloaded_bytes: int
    downloaded_objects: int
    kept_bytes: int
    seconds: float


def pull_job(url: str, path: str | os.PathLike, options: dict | None = None, *,
             progress: Callable[[int], None] | None = None) -> JobPullResult:
    """Restore the newest valid job HEAD of ``url`` into the directory ``path`` (created if
    needed; empty, or an earlier pull of the same job store that nothing wrote to since). An
    object that vanishes under the pull because a newer job HEAD collected it makes the pull
    start over from that one."""
    path = os.fspath(path)
    refuse_job_part(path, "a pull into it")
    client_opts, _ = split_options(options)
    root = ObjectStore(url, client_opts)
    t0 = time.perf_counter()
    head = newest_job_head(root)
    for _ in range(5):
        stats = PullStats()
        try:
            _pull_cut(root, client_opts, head, path, stats, progress)
        except RemoteError as e:
            if e.code not in _MISSING:
                raise
            newer = newest_job_head(root)
            if newer.generation != head.generation:
                head = newer
                continue
            if isinstance(e, RemoteStreamMissingError):
                raise
            raise RemoteIntegrityError("pull", e.url, f"named by job HEAD generation "
                                       f"{head.generation} but missing") from e
        return JobPullResult(str(root.where), path, head, stats.downloaded, stats.objects,
                             stats.kept, time.perf_counter() - t0)
    raise RemoteError("pull", url, "the remote copy kept changing under the pull", code="Busy")


def _pull_cut(root: ObjectStore, client_opts: dict, head: JobHead, path: str, stats: PullStats,
              progress: Callable[[int], None] | None) -> None:
    """One attempt of :func:`pull_job` (the module docstring's steps)."""
    ops = FileOps()
    layout = JobLayout(path)
    store_bytes = root.get(STORE_OBJECT, 0, 65)  # 1.
    check_store_object(root, head, store_bytes)
    fresh = not os.path.exists(layout.store_file)
    if not fresh:
        with io_errors("read", layout.store_file), open(layout.store_file, "rb") as f:
            if f.read(65) != store_bytes:
                raise RemoteConflictError("pull", path, f"it holds another store than "
                                          f"{root.where}; pull into an empty directory")
    elif os.path.isdir(path) and set(os.listdir(path)) - {"global", "streams", "STORE.tmp"}:
        raise RemoteConflictError("pull", path, "the directory is neither empty nor a copy of "
                                  "this job store")
    logs = {lg.epoch: _fetch_log(root, lg, stats, progress) for lg in head.logs}  # 2.
    _refuse_newer_local(layout, head, logs)
    ops.makedirs(path)
    ops.makedirs(layout.global_dir)
    ops.makedirs(layout.streams_dir)
    ops.fsync_dir(path)
    for ref in head.streams:  # 3.
        _pull_stream(root, client_opts, ref, layout, stats, progress)
    for epoch, data in logs.items():  # 4.
        where = layout.epoch_log_path(epoch)
        if not os.path.exists(where) or os.path.getsize(where) != len(data):
            ops.write_file_atomic(where, data)
    ops.fsync_dir(layout.global_dir)
    if fresh:
        ops.write_file_atomic(layout.store_file, store_bytes)
        ops.fsync_dir(os.path.dirname(os.path.abspath(path)))


def _fetch_log(root: ObjectStore, lg: LogEntry, stats: PullStats,
               progress: Callable[[int], None] | None) -> bytes:
    """The global log prefix ``lg`` names, every extent checked (length and digest)."""
    parts = []
    for e in lg.extents:
        name = log_extent_name(e)
        data = root.get(name)
        if len(data) != e.length or digest(data) != e.digest:
            raise RemoteIntegrityError("get", root.where.url(name), f"holds {len(data)} bytes "
                                       f"with digest {digest(data).hex()}, the job HEAD names "
                                       f"{e.length} bytes with {e.digest.hex()} (changed behind "
                                       "our back)")
        parts.append(data)
        stats.downloaded += len(data)
        stats.objects += 1
        if progress is not None:
            progress(len(data))
    return b"".join(parts)


def _refuse_newer_local(layout: JobLayout, head: JobHead, logs: dict[int, bytes]) -> None:
    """RemoteConflictError when the local directory holds what the cut lacks: a global log or a
    stream of a newer epoch, or a global log that is not a prefix of the cut's (a job wrote to
    the local copy since it was pulled: pulling would lose that)."""
    top = max([0, *logs, *(s.epoch for s in head.streams)])
    for epoch in layout.list_epochs():
        where = layout.epoch_log_path(epoch)
        if epoch not in logs:
            if epoch > top:
                raise RemoteConflictError("pull", where, f"epoch {epoch} is not in the remote "
                                          f"copy (job HEAD generation {head.generation}): the "
                                          "local job store was written to after it was pulled; "
                                          "pull into an empty directory")
            continue
        with io_errors("read", where), open(where, "rb") as f:
            mine = f.read()
        if not logs[epoch].startswith(mine):
            raise RemoteConflictError("pull", where, "this global log is not a prefix of the "
                                      "remote copy's: the local job store was written to after "
                                      "it was pulled; pull into an empty directory")
    names = os.listdir(layout.streams_dir) if os.path.isdir(layout.streams_dir) else []
    for name in names:
        m = STREAM_RE.match(name)
        if m and int(m.group(1)) > top:
            raise RemoteConflictError("pull", os.path.join(layout.streams_dir, name), "this "
                                      "stream's epoch is not in the remote copy: the local job "
                                      "store was written to after it was pulled")


def pinned_head(store: ObjectStore, ref: StreamRef, operation: str) -> Head:
    """The stream HEAD a job HEAD pins (``ref``), from the stream's ``store``, checked against
    the pin's digest: RemoteStreamMissingError (rank, epoch, URL) when the object is missing,
    RemoteIntegrityError naming the rank when it is another or damaged."""
    try:
        head, raw = fetch_head(store, ref.generation)
    except RemoteError as e:
        if e.code not in _MISSING:
            raise
        raise RemoteStreamMissingError(
            operation, e.url, f"rank {ref.rank}'s stream (epoch {ref.epoch}, {store.where}) is "
            "named by the job HEAD but its HEAD object is missing", rank=ref.rank,
            epoch=ref.epoch, code=e.code) from e
    if digest(raw) != ref.digest:
        raise RemoteIntegrityError(
            "check", store.where.url(head.name), f"rank {ref.rank}'s stream HEAD (epoch "
            f"{ref.epoch}) differs from the one the job HEAD pins (digest {digest(raw).hex()}, "
            f"expected {ref.digest.hex()}): changed behind our back")
    return head


def _pull_stream(root: ObjectStore, client_opts: dict, ref: StreamRef, layout: JobLayout,
                 stats: PullStats, progress: Callable[[int], None] | None) -> None:
    """Pull one rank's stream: its HEAD checked against the job HEAD's pin, then the single
    store's pull. A missing object is RemoteStreamMissingError naming the rank and the object."""
    store = stream_store(root, ref.epoch, ref.rank, client_opts)
    try:
        head = pinned_head(store, ref, "pull")
        pull_head(store, head, layout.stream_dir(ref.epoch, ref.rank), stats, progress,
                  job_part=True)
    except RemoteStreamMissingError:
        raise
    except RemoteError as e:
        if e.code not in _MISSING:
            raise
        raise RemoteStreamMissingError(
            "pull", e.url, f"rank {ref.rank}'s stream (epoch {ref.epoch}, {store.where}) is named "
            f"by the job HEAD but its object is missing", rank=ref.rank, epoch=ref.epoch,
            code=e.code) from e


# ---- open("s3://...") of a job ----------------------------------------------------------------
@dataclass
class RemoteJob:
    """What ``open("s3://job", "r")`` reads, for the API layer to open as a JobStore reader:
    the local job directory ``path`` (the cut pulled whole, or only the job's STORE and global
    logs when ``streams`` opens each rank stream's lazy reader engine on demand), whether that
    directory is ``temporary`` (it goes when the JobStore does), the other open() options, and
    ``read_stats``: what the reader fetched, given the stats of the lazy rank streams it opened
    (:func:`job_read_stats`)."""

    path: str
    options: dict[str, Any]
    read_stats: Callable[[list[RemoteReadStats]], RemoteReadStats]
    streams: Callable[[int, int], Any] | None = None
    temporary: bool = False


def open_remote_job(url: str, mode: str, options: dict[str, Any]) -> RemoteJob:
    """``ckptstore.open(url, "r", storage_options=..., cache_dir=..., lazy=...)`` of a remote job
    store. By default lazy: the newest valid job HEAD, the job's STORE and global logs go into a
    temporary directory, and a rank's stream is opened only when a load needs it, as a lazy
    remote reader of the stream HEAD the job HEAD pins (range GETs, ckptstore/remote/reader.py):
    loading one rank's part reads only that rank's objects. With ``cache_dir`` the cut is
    pulled there (kept: the next open pulls only what is new), with ``lazy=False`` into a
    temporary directory. StoreNotFoundError when ``url`` holds no job store either."""
    storage, cache, lazy, rest = reader_options(url, mode, options)
    client_opts, _ = split_options({k: v for k, v in storage.items() if k not in READER_KEYS})
    root = ObjectStore(url, client_opts)
    if not is_remote_job(root):
        raise StoreNotFoundError(f"no ckptstore store at {url} (no HEAD and no job HEAD)")
    if cache is not None:
        pulled = pull_job(url, os.fspath(cache), client_opts)
        return RemoteJob(os.fspath(cache), rest, _pulled_stats(pulled))
    tmp = tempfile.mkdtemp(prefix="ckptstore-pull-")
    try:
        if lazy:
            head = newest_job_head(root)
            own = _fetch_metadata(root, head, tmp)
            own.downloaded += len(encode_job_head(head))  # (as a lazy store reader counts its HEAD)
            own.objects += 1
            block = int(storage.get("block_size", DEFAULT_BLOCK))
            return RemoteJob(tmp, rest, lambda parts: job_read_stats(
                str(root.where), head.generation, own, block, parts),
                _lazy_streams(url, root, head, storage), temporary=True)
        pulled = pull_job(url, tmp, client_opts)
        return RemoteJob(tmp, rest, _pulled_stats(pulled), temporary=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _pulled_stats(pulled: JobPullResult) -> Callable[[list[RemoteReadStats]], RemoteReadStats]:
    """The read stats of a job pulled whole (its streams are local stores: no parts)."""
    return lambda parts: RemoteReadStats(pulled.url, pulled.head.generation, "whole", "skipped",
                                         pulled.downloaded_bytes, pulled.downloaded_objects, 0,
                                         0, 0)


def job_read_stats(url: str, generation: int, own: PullStats, block: int,
                   parts: list[RemoteReadStats]) -> RemoteReadStats:
    """What a lazy reader of the job at ``url`` (job HEAD ``generation``) fetched: its own
    objects (``own``: the job HEAD, STORE, the global logs) plus every rank stream it opened
    (``parts``, by epoch and rank). ``mode`` is "whole" when some stream fetched its segments
    whole, else "ranges"; ``index`` the streams' when they agree, else the first that is not
    "used", "skipped" while no stream was opened; ``cache_size`` the sum of the streams' caches
    (each has its own)."""
    states = [p.index for p in parts]
    index = ("skipped" if not parts else states[0] if len(set(states)) == 1 else
             next(s for s in states if s != "used"))
    return RemoteReadStats(url, generation,
                           "whole" if any(p.mode == "whole" for p in parts) else "ranges", index,
                           own.downloaded + sum(p.bytes_read for p in parts),
                           own.objects + sum(p.requests for p in parts),
                           sum(p.cache_hits for p in parts), block,
                           sum(p.cache_size for p in parts))


def _fetch_metadata(root: ObjectStore, head: JobHead, path: str) -> PullStats:
    """The job's STORE and global logs of ``head`` into the private directory ``path``; the
    bytes and GETs it took."""
    layout = JobLayout(path)
    store_bytes = root.get(STORE_OBJECT, 0, 65)
    check_store_object(root, head, store_bytes)
    stats = PullStats(len(store_bytes), 1)
    for d in (layout.global_dir, layout.streams_dir):
        os.makedirs(d, exist_ok=True)
    for lg in head.logs:
        with open(layout.epoch_log_path(lg.epoch), "wb") as f:
            f.write(_fetch_log(root, lg, stats, None))
    with open(layout.store_file, "wb") as f:
        f.write(store_bytes)
    return stats


def _lazy_streams(url: str, root: ObjectStore, head: JobHead,
                  storage: dict[str, Any]) -> Callable[[int, int], Any]:
    """Opens the lazy reader engine of a rank stream of ``head``, at the HEAD it pins."""
    client_opts = {k: v for k, v in storage.items() if k not in READER_KEYS}

    def open_stream(epoch: int, rank: int) -> RemoteReaderEngine:
        ref = head.stream(epoch, rank)
        if ref is None:
            raise DamagedCheckpointError(f"{url}: rank {rank}'s stream of epoch {epoch} is not in "
                                         f"the remote copy (job HEAD generation "
                                         f"{head.generation})")
        h = pinned_head(stream_store(root, epoch, rank, client_opts), ref, "open")
        return open_lazy(stream_url(url, epoch, rank), storage, head=h)
    return open_stream
