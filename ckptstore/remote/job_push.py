"""Uploading a multi-rank job store (format-spec/format.md §22) to an object store
(format-spec/remote.md §8).

Each rank's stream is a v1 store, so each is copied with the single store's code path
(:class:`~ckptstore.remote.replicate.Replicator` under ``PREFIX/streams/EEEEEEEEEE-RRRRR/``);
the global logs go as extents under ``global/``; a **job HEAD** under ``jobheads/`` names one
consistent cut. :meth:`JobReplicator.sync`:

1. Read the job's global logs (the view: which commits are visible), before any stream.
2. For every stream a visible global commit names, capture and sync it (its own HEAD; its
   remote gc keeps every stream HEAD that a kept job HEAD pins). A stream captured after the
   view holds every local COMMIT the view's global commits name (a rank's COMMIT is durable
   before the coordinator appends the GLOBAL_COMMIT, §22.3), unless the job is still writing
   and a stream was captured before it indexed its commit: the cut then ends before the first
   global commit some stream HEAD does not cover (only the current epoch can be cut; an older
   epoch's commit that its stream lacks is damage, DamagedCheckpointError).
3. The global logs' prefixes up to the cut: for each epoch of the chain its visible bytes,
   uploaded as immutable extents (those the newest job HEAD names are reused once their digest
   matches the local bytes; the rest goes as one new extent).
4. Last, the job HEAD naming every stream HEAD (generation and xxh3-128 of its object) and every
   log extent, written with a conditional create of the next generation: the job's remote
   commit point. Every object it names was written before it (H1). A job HEAD whose cut is
   older than the newest one's (its epoch and global log end), or of another job store, is never
   written (RemoteConflictError, W1).
5. Job HEADs other than the newest ``keep_heads`` are deleted, then every log extent no kept one
   names, then every stream no kept one pins whose epoch is below the newest job HEAD's (a job
   gc took it off the chain; streams are found by listing ``streams/`` at :meth:`load`, so an
   interrupted gc is finished by the next one), each stream's HEADs first.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields, replace
from typing import Callable

from ..engine.reader_engine import ReaderEngine
from ..errors import DamagedCheckpointError, RemoteConflictError, RemoteError, StoreNotFoundError
from ..format import records as rec
from ..format.job import EPOCH_SIZE, GlobalCommit
from ..storage.fileops import io_errors
from ..storage.job_log import JobLayout, JobView, read_job_header, read_job_view
from ..storage.layout import STORE_FILE
from .client import ObjectStore
from .head import STORE_OBJECT, Extent, Head, digest
from .job_head import (GLOBAL_DIR, JOB_HEADS_DIR, STREAMS_DIR, JobHead, LogEntry, StreamRef,
                       encode_job_head, job_head_name, list_job_heads, log_extent_name,
                       read_job_head, stream_of, stream_prefix, stream_store)
from .generations import collect, put_next_generation, read_newest
from .replicate import Replicator, RemoteOptions, SyncStats, capture, split_options
from .restore import newest_head

#: where the EPOCH record of a global log ends (its first GLOBAL_COMMIT starts)
EPOCH_END = rec.OVERHEAD + EPOCH_SIZE


@dataclass(frozen=True)
class JobPushResult:
    """What a job push did: the job HEAD the remote now holds, what was sent (streams and the
    job's own objects together)."""

    url: str
    head: JobHead
    stats: SyncStats
    seconds: float


@dataclass(frozen=True)
class _Cut:
    """A consistent cut of a job: the stream HEADs, each global log's length, the iterations."""

    streams: tuple[StreamRef, ...]
    lengths: dict[int, int]
    epoch: int
    latest: int | None
    count: int


class JobReplicator:
    """Brings a remote job store up to a local one (module docstring). One thread syncs."""

    def __init__(self, root: ObjectStore, client_options: dict, opts: RemoteOptions,
                 progress: Callable[[int], None] | None = None) -> None:
        self.root = root
        self.client_options = client_options
        self.opts = opts
        self.progress = progress
        #: the job's own objects (STORE, log extents, job HEADs) sent
        self.stats = SyncStats()
        self.streams: dict[tuple[int, int], Replicator] = {}
        self.loaded = False
        self.heads: dict[int, JobHead | None] = {}
        self.head: JobHead | None = None
        #: log extents listed remotely -> size
        self.objects: dict[str, int] = {}
        self.generation = 0
        #: the epoch whose streams their own ranks upload (a live job's, job_uploader.py):
        #: their newest remote HEADs are read instead of synced from the local files
        self.live_epoch: int | None = None

    def all_stats(self) -> SyncStats:
        """Everything sent since this replicator was created (streams included)."""
        out = replace(self.stats)
        for rep in list(self.streams.values()):  # (a status may ask while a round adds one)
            for f in fields(SyncStats):
                setattr(out, f.name, getattr(out, f.name) + getattr(rep.stats, f.name))
        return out

    def load(self) -> None:
        """Read the remote job's state: job HEADs (the newest ``keep_heads`` valid ones), log
        extents and the streams' prefixes (``streams/EEEEEEEEEE-RRRRR/``, gc candidates)."""
        gens = list_job_heads(self.root.list_objects(JOB_HEADS_DIR))
        self.objects = dict(self.root.list_objects(GLOBAL_DIR))
        for n in self.root.list_objects(STREAMS_DIR):  # every stream's prefix, as one entry
            key = stream_of(n)
            if key is not None:
                self.objects.setdefault(f"{stream_prefix(*key)}/", 0)
        self.generation = max([self.generation, *gens])
        self.heads, self.head = read_newest(gens, lambda g: read_job_head(self.root, g),
                                            self.opts.keep_heads, "job HEAD")
        self.loaded = True

    # ---- sync -----------------------------------------------------------------------------
    def sync(self, path: str) -> JobHead:
        """Upload what the remote lacks of the job store at ``path`` and write a job HEAD for
        its newest consistent cut (unless the newest one says the same). Returns the job HEAD."""
        layout = JobLayout(path)
        header = read_job_header(layout)
        with io_errors("read", layout.store_file), open(layout.store_file, "rb") as f:
            store_bytes = f.read(65)
        view = read_job_view(layout, header.store_id)  # 1. before any stream is captured
        if not self.loaded:
            self.load()
        current = view.chain[-1] if view.chain else 0
        self._check(header.store_id, (current, view.logs[current].valid_end if current else 0),
                    path)
        self._ensure_store(store_bytes)
        cut = self._sync_streams(path, layout, view)  # 2.
        logs = tuple(self._sync_log(layout, e, n) for e, n in sorted(cut.lengths.items()))  # 3.
        new = JobHead(generation=0, store_id=header.store_id, store_digest=digest(store_bytes),
                      epoch=cut.epoch, end=cut.lengths.get(cut.epoch, 0), latest=cut.latest,
                      count=cut.count, streams=cut.streams, logs=logs, created_ns=time.time_ns())
        h = self.head
        if h is not None and (h.position > new.position or (h.store_digest, h.position, h.latest,
                                                             h.count, h.streams, h.logs) ==
                              (new.store_digest, new.position, new.latest, new.count,
                               new.streams, new.logs)):
            self._collect()  # nothing new (or a live job's cut went back: keep the newer one)
            return h
        self._write_head(new, path)  # 4.
        self._collect()  # 5.
        assert self.head is not None
        return self.head

    def _check(self, store_id: bytes, position: tuple[int, int], path: str) -> None:
        h = self.head
        if h is None:
            return
        url = str(self.root.where)
        if h.store_id != store_id:
            raise RemoteConflictError(
                "sync", url, f"it holds another job store (store_id {h.store_id.hex()}, job HEAD "
                f"generation {h.generation}); {path} is {store_id.hex()}")
        if h.position > position:
            raise RemoteConflictError(
                "sync", url, f"the remote copy (iteration {h.latest}, epoch {h.epoch}, global "
                f"log end {h.end}, job HEAD generation {h.generation}) is newer than {path} "
                f"(epoch {position[0]}, global log end {position[1]}): another copy of this job "
                "store went further; refusing to move the remote copy back")

    def _ensure_store(self, store_bytes: bytes) -> None:
        """The job's STORE object, written once (conditionally); another one is a conflict."""
        if self.root.put(STORE_OBJECT, store_bytes, if_absent=True):
            self.stats.uploaded_objects += 1
            self.stats.uploaded_bytes += len(store_bytes)
            return
        if self.root.get(STORE_OBJECT, 0, 65) != store_bytes:
            raise RemoteConflictError("sync", self.root.where.url(STORE_OBJECT), "the prefix "
                                      "holds another store's STORE object; refusing to write "
                                      "into it")

    def _sync_streams(self, path: str, layout: JobLayout, view: JobView) -> _Cut:
        """Sync every stream a visible commit names; the cut they cover (module docstring, 2)."""
        need: dict[tuple[int, int], list[tuple[int, tuple[int, int]]]] = {}
        for it, g in view.commits.items():
            for r, part in enumerate(g.ranks):
                need.setdefault((g.epoch, r), []).append(
                    (it, (part.commit_seq, part.commit_offset)))
        pins: dict[tuple[int, int], set[int]] = {}
        for jh in self.heads.values():
            for s in jh.streams if jh is not None else ():
                pins.setdefault((s.epoch, s.rank), set()).add(s.generation)
        refs: list[StreamRef] = []
        positions: dict[tuple[int, int], tuple[int, int]] = {}
        for key in sorted(need):
            head, raw = self._sync_stream(path, layout, key, frozenset(pins.get(key, ())))
            if head is None:
                positions[key] = (0, 0)  # a live rank's uploader wrote none yet: cut before it
                continue
            refs.append(StreamRef(key[0], key[1], head.generation, digest(raw)))
            positions[key] = head.position or (0, 0)
        current = view.chain[-1] if view.chain else 0
        visible = []
        for it, g in view.commits.items():
            short = [r for r, part in enumerate(g.ranks)
                     if positions[(g.epoch, r)] <= (part.commit_seq, part.commit_offset)]
            if short and g.epoch != current:
                r = short[0]
                raise DamagedCheckpointError(
                    f"{path}: rank {r}'s stream {layout.stream_dir(g.epoch, r)} lacks the commit "
                    f"of iteration {it} that the global log of epoch {g.epoch} names: the job "
                    "store is damaged (ckptstore fsck); nothing of it was made visible remotely")
            if short:
                break  # a live job: that stream was captured before it indexed the commit
            visible.append(g)
        lengths = cut_lengths(view, visible, current)
        return _Cut(tuple(refs), lengths, current, visible[-1].iteration if visible else None,
                    len(visible))

    def _sync_stream(self, path: str, layout: JobLayout, key: tuple[int, int],
                     pinned: frozenset[int]) -> tuple[Head | None, bytes]:
        """Sync one rank's stream with the single store's replicator (or, for the live epoch,
        read the HEAD its rank's uploader wrote); its HEAD and the HEAD object's bytes."""
        epoch, rank = key
        where = layout.stream_dir(epoch, rank)
        if not os.path.exists(os.path.join(where, STORE_FILE)):
            raise DamagedCheckpointError(f"{path}: rank {rank}'s stream {where} (epoch {epoch}) "
                                         "is missing, and visible global commits name it: the "
                                         "job store is damaged (ckptstore fsck)")
        rep = self.streams.get(key)
        if rep is None:
            rep = self.streams[key] = Replicator(
                stream_store(self.root, epoch, rank, self.client_options), self.opts,
                progress=self.progress)
        rep.pins = lambda: pinned
        self.objects.setdefault(f"{stream_prefix(epoch, rank)}/", 0)  # a gc candidate later
        if epoch == self.live_epoch:
            return self._observe(rep)
        engine = ReaderEngine(where)
        try:
            for _ in range(5):
                snap = capture(engine)
                if snap is None:
                    continue  # (a reader's view from before a change: take it again)
                try:
                    head = rep.sync(snap)
                finally:
                    snap.close()
                return head, rep.store.get(head.name)
        finally:
            engine.close()
        raise RemoteError("push", str(rep.store.where), f"the segments of {where} kept changing "
                          "under the upload")

    @staticmethod
    def _observe(rep: Replicator) -> tuple[Head | None, bytes]:
        """The newest valid HEAD a live rank's own uploader wrote of its stream (None: none
        yet), and the object's bytes."""
        try:
            head = newest_head(rep.store)
        except StoreNotFoundError:
            return None, b""
        return head, rep.store.get(head.name)

    def _sync_log(self, layout: JobLayout, epoch: int, length: int) -> LogEntry:
        """The extents of the first ``length`` bytes of ``epoch``'s global log, uploading what
        the remote lacks. Extents of the newest job HEAD must match the local bytes (a global log
        is append-only): RemoteConflictError otherwise, nothing overwritten."""
        path = layout.epoch_log_path(epoch)
        with io_errors("read", path), open(path, "rb") as f:
            data = f.read(length)
        if len(data) != length:
            raise RemoteError("push", path, f"the global log holds {len(data)} bytes, fewer than "
                              f"the {length} read a moment ago", code="Busy")
        prior = self.head.log(epoch) if self.head is not None else None
        out: list[Extent] = []
        at = 0
        for e in prior.extents if prior is not None else ():
            if e.end > length:
                break
            if digest(data[e.offset:e.end]) != e.digest:
                raise RemoteConflictError(
                    "sync", self.root.where.url(log_extent_name(e)), f"its bytes {e.offset}.."
                    f"{e.end} differ from {path}: the remote copy holds another history of this "
                    "job store; refusing to overwrite it")
            out.append(e)
            at = e.end
        if at < length:
            out.append(Extent(epoch, at, length - at, digest(data[at:])))
        for e in out:
            name = log_extent_name(e)
            if self.objects.get(name) == e.length:
                self.stats.reused_objects += 1
                continue
            self.root.put(name, data[e.offset:e.end], metadata={"xxh3-128": e.digest.hex()})
            self.objects[name] = e.length
            self.stats.uploaded_objects += 1
            self.stats.uploaded_bytes += e.length
            if self.progress is not None:
                self.progress(e.length)
        return LogEntry(epoch, length, tuple(out))

    def _write_head(self, new: JobHead, path: str) -> None:
        """The remote commit point: a conditional create of the next generation (H2)."""
        def reread() -> int:
            self.load()
            self._check(new.store_id, new.position, path)
            return self.generation

        gen = put_next_generation(self.root, job_head_name,
                                  lambda g: encode_job_head(replace(new, generation=g)),
                                  self.generation, reread)
        self.generation = gen
        self.head = self.heads[gen] = replace(new, generation=gen)
        self.stats.heads_written += 1

    def _collect(self) -> None:
        """Delete job HEADs older than the newest ``keep_heads`` valid ones, then every log
        extent and every stream no remaining job HEAD names (J4). A stream of an epoch at or
        above the newest job HEAD's is spared: its rank may be uploading it for the next one."""
        bound = self.head.epoch if self.head is not None else None

        def spare(n: str) -> bool:
            key = stream_of(n)
            return key is not None and (bound is None or key[0] >= bound)

        self.stats.deleted_objects += collect(self.root, self.heads, self.opts.keep_heads,
                                              frozenset, job_head_name, self.objects, spare,
                                              self._remove)

    def _remove(self, names: list[str]) -> None:
        """Delete ``names``: objects, and streams (``streams/EEEEEEEEEE-RRRRR/``) whole, each
        HEADs first (a partly deleted stream then holds no HEAD naming a missing object)."""
        self.root.delete([n for n in names if stream_of(n) is None])
        for n in names:
            key = stream_of(n)
            if key is None:
                continue
            self.streams.pop(key, None)
            listed = sorted(self.root.list_objects(n), key=lambda o: not o.startswith(
                f"{n}heads/"))
            if listed:
                self.root.delete(listed)


def cut_lengths(view: JobView, visible: list[GlobalCommit], current: int) -> dict[int, int]:
    """Bytes of each chain epoch's global log a cut of ``view`` holds whose visible commits are
    ``visible`` (``current``: the chain's last epoch): an older epoch's visible prefix (up to its
    successor's ``adopted_end``), the current one's up to the cut's last commit."""
    out: dict[int, int] = {}
    shown = {g.iteration for g in visible}
    for i, e in enumerate(view.chain):
        scan = view.logs[e]
        if e != current:
            nxt = view.logs[view.chain[i + 1]].epoch
            assert nxt is not None
            out[e] = min(scan.valid_end, nxt.adopted_end)
            continue
        ends = [end for g, end in scan.commits if g.iteration in shown]
        out[e] = ends[-1] if ends else min(scan.valid_end, EPOCH_END)
    return out


def push_job(path: str | os.PathLike, url: str, options: dict | None = None, *,
             progress: Callable[[int], None] | None = None) -> JobPushResult:
    """Upload the committed state of the job store at ``path`` to ``url`` (a catch-up: only what
    the remote lacks is sent; an interrupted push resumes). Reads the job's files only: it never
    writes under ``path`` and may run beside the job's ranks."""
    path = os.fspath(path)
    client_opts, opts = split_options(options)
    t0 = time.perf_counter()
    rep = JobReplicator(ObjectStore(url, client_opts), client_opts, opts, progress)
    head = rep.sync(path)
    return JobPushResult(str(rep.root.where), head, rep.all_stats(), time.perf_counter() - t0)
