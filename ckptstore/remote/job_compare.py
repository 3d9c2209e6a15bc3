"""Comparing a remote copy with the local store, by bytes (format-spec/remote.md §6 and §8.4):
``ckptstore fsck DIR --remote URL``, :func:`ckptstore.remote.verify_remote` with ``local=DIR``,
for a job store (:func:`compare_job`) and a single store (:func:`compare_store`: what step 3
below does for each rank stream, one implementation).

:func:`compare_job` checks, for the job HEAD the remote fsck verified, that the local job store
holds the same bytes as every object the job HEAD names, by the digests the job HEAD and the
stream HEADs it pins record (so a remote object that passed the fsck holds the local bytes):

1. the job's STORE file (also its ``store_id``: another job store stops the comparison);
2. the prefix of every epoch's global log the job HEAD names, extent by extent: the global
   commits the remote copy makes visible are the local ones;
3. for every pinned stream HEAD: the stream's STORE file and every segment extent it names, the
   rank's own records. The index object is a cache of the log and is not compared.

Global logs, segments and streams only grow, except that a local job gc (a new epoch) removes
the streams and logs of the epochs it replaced: a file the job HEAD names that the local job
lacks is a note when the remote copy is older than the local job (it was collected locally
since), else a mismatch. Each mismatch names the rank and epoch of its stream (None for the
job's own objects), the remote object and the local file. Nothing is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..engine.reader_engine import ReaderEngine
from ..storage.fileops import io_errors
from ..storage.job_log import JobLayout, read_job_header, read_job_view
from ..storage.layout import Layout
from .client import ObjectStore
from .head import STORE_OBJECT, Extent, Head, digest
from .job_head import JobHead, log_extent_name, stream_prefix
from .job_push import cut_lengths
from .replicate import pos_key
from .restore import RemoteFsckReport, local_digest


@dataclass(frozen=True)
class Mismatch:
    """An object the job HEAD names whose bytes the local job store does not hold: its stream's
    ``rank`` and ``epoch`` (None: the job's own), its ``url``, the ``local`` file, and why."""

    rank: int | None
    epoch: int | None
    url: str
    local: str
    why: str

    def line(self) -> str:
        who = "" if self.rank is None else f"rank {self.rank} (epoch {self.epoch}): "
        return f"{who}{self.url}: {self.why} ({self.local})"


@dataclass
class JobComparison:
    """What :func:`compare_job` found: mismatches, notes, the local job's newest visible
    iteration and whether the remote copy lags the local job (older cut)."""

    mismatches: list[Mismatch] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    local_iteration: int | None = None
    behind: bool = False
    #: files the job HEAD names that a local job gc removed since (the remote copy is older)
    collected: int = 0


def compare_job(root: ObjectStore, head: JobHead, streams: dict[tuple[int, int], Head],
                local: str) -> JobComparison:
    """Compare the job HEAD ``head`` of the remote job at ``root`` (with ``streams``: the stream
    HEADs it pins that the fsck could read, by (epoch, rank)) with the local job store at
    ``local`` (module docstring). The caller checked that ``local`` is a job store."""
    layout = JobLayout(local)
    out = JobComparison()
    header = read_job_header(layout)
    store_url = root.where.url(STORE_OBJECT)
    if header.store_id != head.store_id:
        out.mismatches.append(Mismatch(None, None, store_url, layout.store_file, (
            f"{local} is another job store ({header.store_id.hex()}) than the remote copy "
            f"({head.store_id.hex()})")))
        return out
    view = read_job_view(layout, header.store_id)
    current = view.chain[-1] if view.chain else 0
    position = (current, cut_lengths(view, list(view.commits.values()), current).get(current, 0))
    out.local_iteration = max(view.commits) if view.commits else None
    out.behind = head.position < position
    if out.behind:
        out.notes.append(f"the remote copy is older than {local}: it holds iteration "
                         f"{head.latest} ({head.count} iterations), the local job store "
                         f"{out.local_iteration} ({len(view.commits)} iterations)")
    elif head.position > position:
        out.notes.append(f"the remote copy is newer than {local} (iteration {head.latest}; "
                         f"local {out.local_iteration})")
    else:
        out.notes.append(f"the remote copy holds what {local} holds (iteration "
                         f"{out.local_iteration})")
    _whole(out, None, None, store_url, layout.store_file, head.store_digest)  # 1.
    for lg in head.logs:  # 2.
        _extents(out, None, None, layout.epoch_log_path(lg.epoch),
                 [(e, root.where.url(log_extent_name(e))) for e in lg.extents])
    for (epoch, rank), h in sorted(streams.items()):  # 3.
        where = Layout(layout.stream_dir(epoch, rank))
        prefix = stream_prefix(epoch, rank)
        if not os.path.isdir(where.root):
            _absent(out, rank, epoch, root.where.url(f"{prefix}/"), where.root)
            continue
        _store_files(out, root, f"{prefix}/", h, where, rank, epoch)
    if out.collected:
        out.notes.append(f"{out.collected} files the remote copy names were collected by a job "
                         f"gc of {local} since (the remote copy is older)")
    return out


def compare_store(report: RemoteFsckReport, root: ObjectStore, local: str) -> None:
    """Compare the single store's remote copy at ``root`` whose newest valid HEAD
    ``report.head`` the remote fsck verified with the local store at ``local``, into ``report``:
    the same store (another one is damage, and the comparison stops), whether the copy is older
    (``behind``), newer or equal (positions), then the bytes: its STORE file and every segment
    extent the HEAD names, as step 3 compares a rank stream (the index object, a cache, is not
    compared). A segment the HEAD names that the local store lacks is a note when the copy is
    older (a local gc removed it since), else a mismatch; mismatches go to ``report.differs``."""
    head = report.head
    assert head is not None
    engine = ReaderEngine(local)
    try:
        if engine.header.store_id != head.store_id:
            report.damage.append(f"{local} is another store ({engine.header.store_id.hex()}) "
                                 f"than the remote copy ({head.store_id.hex()})")
            return
        recoverable = engine.recoverable()
        report.local_iteration = recoverable[-1] if recoverable else None
        p = engine.index.position()
        local_pos = None if p is None else (p.seq, p.offset)
        if pos_key(head.position) < pos_key(local_pos):
            report.behind = True
            report.notes.append(f"the remote copy is older than {local}: it holds iteration "
                                f"{head.recoverable} ({head.count} iterations), the local store "
                                f"{report.local_iteration} ({len(recoverable)} iterations)")
        elif pos_key(head.position) > pos_key(local_pos):
            report.notes.append(f"the remote copy is newer than {local} (iteration "
                                f"{head.recoverable}; local {report.local_iteration})")
        else:
            report.notes.append(f"the remote copy holds what {local} holds (iteration "
                                f"{report.local_iteration})")
    finally:
        engine.close()
    out = JobComparison(behind=report.behind)
    _store_files(out, root, "", head, Layout(local), None, None)
    report.differs += [m.line() for m in out.mismatches]
    if out.collected:
        report.notes.append(f"{out.collected} segments the remote copy names were collected by "
                            f"a gc of {local} since (the remote copy is older)")


def _store_files(out: JobComparison, root: ObjectStore, prefix: str, h: Head, where: Layout,
                 rank: int | None, epoch: int | None) -> None:
    """The STORE file and every segment extent ``h`` names (objects under ``prefix``) against
    the local store ``where``."""
    _whole(out, rank, epoch, root.where.url(f"{prefix}{STORE_OBJECT}"), where.store_file,
           h.store_digest)
    for seg in h.segments:
        _extents(out, rank, epoch, where.segment_path(seg.seq),
                 [(e, root.where.url(f"{prefix}{e.name}")) for e in seg.extents])


def _absent(out: JobComparison, rank: int | None, epoch: int | None, url: str,
            path: str) -> None:
    """``path``, named by the remote copy, is not in the local job."""
    if out.behind:
        out.collected += 1
    else:
        out.mismatches.append(Mismatch(rank, epoch, url, path, "the local job store lacks it"))


def _whole(out: JobComparison, rank: int | None, epoch: int | None, url: str, path: str,
           want: bytes) -> None:
    """A STORE file: its bytes' digest must be ``want``."""
    if not os.path.exists(path):
        _absent(out, rank, epoch, url, path)
        return
    with io_errors("read", path), open(path, "rb") as f:
        data = f.read(65)
    if digest(data) != want:
        out.mismatches.append(Mismatch(rank, epoch, url, path, f"the local STORE file differs "
                                       f"(digest {digest(data).hex()}, the HEAD names "
                                       f"{want.hex()})"))


def _extents(out: JobComparison, rank: int | None, epoch: int | None, path: str,
             extents: list[tuple[Extent, str]]) -> None:
    """Bytes of the local file ``path``: each extent's (with its object's URL) digest."""
    if not os.path.exists(path):
        if extents:
            _absent(out, rank, epoch, extents[0][1], path)
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with io_errors("stat", path):
            size = os.fstat(fd).st_size
        for e, url in extents:
            if size < e.end:
                why = f"the local file holds {size} bytes, the object is bytes {e.offset}..{e.end}"
            elif local_digest(fd, path, e) != e.digest:
                why = (f"the local bytes {e.offset}..{e.end} differ (the HEAD names digest "
                       f"{e.digest.hex()})")
            else:
                continue
            out.mismatches.append(Mismatch(rank, epoch, url, path, why))
    finally:
        os.close(fd)
