"""Comparing a remote job store's copy with the local job store (format-spec/remote.md §8.4):
``ckptstore fsck JOB --remote URL``, :func:`ckptstore.remote.verify_remote` with ``local=JOB``.

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

from ..storage.fileops import io_errors
from ..storage.job_log import JobLayout, read_job_header, read_job_view
from ..storage.layout import Layout
from .client import ObjectStore
from .head import STORE_OBJECT, Extent, Head, digest
from .job_head import JobHead, log_extent_name, stream_prefix
from .job_push import cut_lengths
from .restore import local_digest


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
        _whole(out, rank, epoch, root.where.url(f"{prefix}/{STORE_OBJECT}"), where.store_file,
               h.store_digest)
        for seg in h.segments:
            _extents(out, rank, epoch, where.segment_path(seg.seq),
                     [(e, root.where.url(f"{prefix}/{e.name}")) for e in seg.extents])
    if out.collected:
        out.notes.append(f"{out.collected} files the remote copy names were collected by a job "
                         f"gc of {local} since (the remote copy is older)")
    return out


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
