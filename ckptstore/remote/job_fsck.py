"""fsck of a remote job store (format-spec/remote.md §8.4): ``ckptstore fsck s3://job``,
:func:`ckptstore.remote.verify_remote` of a job's prefix.

:func:`verify_job` checks every job HEAD (a damaged newer one is damage, as a store's HEAD is:
readers fall back to an older one), then everything the newest valid one names, with the single
store's checks (:func:`~ckptstore.remote.restore.verify_objects`: present, of the named length,
with the named xxh3-128 digest):

1. the job's STORE object (its digest, store_id and format version 2);
2. every extent of every global log prefix of the cut;
3. for every stream the job HEAD pins: that stream HEAD (present, its bytes' digest the pinned
   one: :func:`~ckptstore.remote.job_pull.pinned_head`), then every object it names under the
   stream's prefix.

Each missing or damaged object is reported with the rank and epoch of the stream it belongs to
(none for the job's own objects) and its URL, as lines and as :attr:`JobFsckReport.problems`.

With ``local`` (a local job store: the one pushed, or a pull of it), the cut is then compared
with it (:func:`~ckptstore.remote.job_compare.compare_job`): an object whose bytes the local job
does not hold is a problem of kind "differs" naming the rank, the object and the local file, and
the report says whether the remote copy is older than the local job (``behind``). Nothing is
written, remotely or locally.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from ..errors import RemoteIntegrityError, RemoteStreamMissingError, StoreNotFoundError
from ..storage.job_log import is_job_store
from .client import ObjectStore
from .head import STORE_OBJECT, Head
from .job_compare import compare_job
from .job_head import (GLOBAL_DIR, JOB_HEADS_DIR, STREAMS_DIR, JobHead, list_job_heads,
                       log_extent_name, read_job_head, stream_store)
from .job_pull import pinned_head
from .replicate import split_options
from .restore import FsckFindings, head_objects, verify_objects


@dataclass(frozen=True)
class RemoteProblem:
    """One missing or damaged object: whose (``rank`` and ``epoch`` of a stream; None: the job's
    own objects), its URL, and ``kind`` ("missing", "damaged", or "differs": its bytes are not
    those of the ``local`` file of the job store it was compared with)."""

    kind: str
    rank: int | None
    epoch: int | None
    url: str
    local: str | None = None


@dataclass
class JobFsckReport(FsckFindings):
    """What :func:`verify_job` found. ``clean``: a valid job HEAD, and every object it names
    (the streams' included) is present, whole and matches its digest."""

    head: JobHead | None = None
    streams: int = 0
    problems: list[RemoteProblem] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return (self.head is not None and not self.damage and not self.missing
                and not self.differs)

    @property
    def ranks(self) -> list[int]:
        """The ranks with a missing, damaged or (compared with a local job) differing stream
        object."""
        return sorted({p.rank for p in self.problems if p.rank is not None})

    def lines(self) -> list[str]:
        h = self.head
        out = [f"remote job {self.url}: " + (
            f"job HEAD generation {h.generation}, iteration {h.latest} ({h.count} iterations), "
            f"epoch {h.epoch}, {self.streams} rank streams, {self.objects} objects, "
            f"{self.bytes_verified} bytes verified" if h is not None else "no valid job HEAD")]
        out += [f"DIFFERS {d}" for d in self.differs] + self.found()
        out += self.behind_lines(None if h is None else h.latest, "the local job store")
        out.append("clean" if self.clean else f"NOT CLEAN: {len(self.missing)} missing objects, "
                   f"{len(self.damage)} damaged" + (
                       f", {len(self.differs)} differ from the local job store"
                       if self.differs else "") + (f" (ranks {self.ranks})" if self.ranks else "")
                   + ("" if h is not None else ", no valid job HEAD"))
        return out


def verify_job(url: str, options: dict | None = None, *, local: str | None = None,
               progress: Callable[[int], None] | None = None) -> JobFsckReport:
    """Verify the remote job store at ``url``, with ``local`` compared with the local job store
    at that path (module docstring; StoreNotFoundError, before reading the copy, when it holds no
    store; another kind of store is a "differs" problem)."""
    if local is not None and not is_job_store(local):
        if not os.path.exists(os.path.join(local, STORE_OBJECT)):
            raise StoreNotFoundError(f"no store at {local} to compare the remote job store "
                                     f"{url} with")
    client_opts, _ = split_options(options)
    root = ObjectStore(url, client_opts)
    report = JobFsckReport(str(root.where))
    gens = list_job_heads(root.list_objects(JOB_HEADS_DIR))
    valid = report.read_heads(gens, lambda g: read_job_head(root, g), "job HEAD")
    report.problems += [RemoteProblem("damaged", None, None, _url_in(d)) for d in report.damage]
    if not valid:
        return report
    head = report.head = valid[0]
    size = root.size(STORE_OBJECT)
    listed = {**root.list_objects(GLOBAL_DIR), **({} if size is None else {STORE_OBJECT: size})}
    wanted = [(STORE_OBJECT, 64, head.store_digest)]
    wanted += [(log_extent_name(e), e.length, e.digest) for lg in head.logs for e in lg.extents]
    _checked(report, None, None, lambda: verify_objects(root, head, wanted, listed, report,
                                                        progress))
    pinned: dict[tuple[int, int], Head] = {}
    for ref in head.streams:
        store = stream_store(root, ref.epoch, ref.rank, client_opts)
        who = f"rank {ref.rank} (epoch {ref.epoch}): "
        try:
            h = pinned_head(store, ref, "fsck")
        except RemoteStreamMissingError as e:
            report.missing.append(f"{who}{e.url} (the stream HEAD job HEAD generation "
                                  f"{head.generation} pins)")
            report.problems.append(RemoteProblem("missing", ref.rank, ref.epoch, e.url))
            continue
        except RemoteIntegrityError as e:
            report.damage.append(f"{who}{e}")
            report.problems.append(RemoteProblem("damaged", ref.rank, ref.epoch, e.url))
            continue
        report.streams += 1
        pinned[(ref.epoch, ref.rank)] = h
        _checked(report, ref.rank, ref.epoch, lambda: verify_objects(
            store, h, head_objects(h), store.list_objects(), report, progress, who))
    named = {s.prefix for jh in valid for s in jh.streams}
    other = {n.split("/", 2)[1] for n in root.list_objects(STREAMS_DIR) if n.count("/") >= 2}
    unnamed = sorted(p for p in other if f"{STREAMS_DIR}{p}" not in named)
    if unnamed:
        report.notes.append(f"{len(unnamed)} stream prefixes no kept job HEAD names (a job gc "
                            f"removed them, or a live job's newer streams): {unnamed[:4]}")
    if len(valid) > 1:
        report.notes.append(f"{len(valid) - 1} older job HEADs kept (generations "
                            f"{[h.generation for h in valid[1:]]})")
    if local is not None:
        _compare(report, root, head, pinned, local)
    return report


def _compare(report: JobFsckReport, root: ObjectStore, head: JobHead,
             pinned: dict[tuple[int, int], Head], local: str) -> None:
    """Fold the comparison with the local job store at ``local`` into ``report``."""
    if not is_job_store(local):
        why = f"{local} is not a job store; the remote copy is a job store's"
        report.differs.append(why)
        report.problems.append(RemoteProblem("differs", None, None, str(root.where), local))
        return
    found = compare_job(root, head, pinned, local)
    report.differs += [m.line() for m in found.mismatches]
    report.problems += [RemoteProblem("differs", m.rank, m.epoch, m.url, m.local)
                        for m in found.mismatches]
    report.notes += found.notes
    report.local_iteration, report.behind = found.local_iteration, found.behind


def _checked(report: JobFsckReport, rank: int | None, epoch: int | None,
             check: Callable[[], None]) -> None:
    """Run ``check`` (it appends lines to ``report.missing``/``damage``), recording each new line
    as a :class:`RemoteProblem` of stream (``rank``, ``epoch``) (None: the job's own)."""
    nm, nd = len(report.missing), len(report.damage)
    check()
    for kind, lines in (("missing", report.missing[nm:]), ("damaged", report.damage[nd:])):
        report.problems += [RemoteProblem(kind, rank, epoch, _url_in(line)) for line in lines]


def _url_in(line: str) -> str:
    """The first URL a report line names (the line itself when it names none)."""
    return next((w for w in line.split() if w.startswith("s3://")), line).rstrip(":")
