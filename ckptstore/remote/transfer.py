"""``push``, ``pull`` and ``verify_remote`` (fsck) of any store: a single store's copy
(:mod:`.replicate`, :mod:`.restore`) or a multi-rank job store's (:mod:`.job_push`,
:mod:`.job_pull`, :mod:`.job_fsck`; format-spec/remote.md §8). The one place that tells the two
kinds apart, above the modules that copy and check each."""

from __future__ import annotations

import os
from typing import Callable

from ..storage.job_log import is_job_store, refuse_job_part
from .client import ObjectStore
from .job_compare import compare_store
from .job_fsck import JobFsckReport, verify_job
from .job_head import is_remote_job
from .job_pull import JobPullResult, pull_job
from .job_push import JobPushResult, push_job
from .replicate import PushResult, push_store, split_options
from .restore import PullResult, RemoteFsckReport, pull_store, verify_store


def push(path: str | os.PathLike, url: str, options: dict | None = None, *,
         progress: Callable[[int], None] | None = None) -> PushResult | JobPushResult:
    """Upload the committed state of the store at ``path`` to ``url`` (a catch-up: only what
    the remote lacks is sent; an interrupted push resumes where it stopped). A reader: it never
    writes under ``path`` and may run beside its writer. JobStreamError for one rank's stream
    of a job store, before any client is made."""
    path = os.fspath(path)
    if is_job_store(path):
        return push_job(path, url, options, progress=progress)
    return push_store(path, url, options, progress=progress)


def pull(url: str, path: str | os.PathLike, options: dict | None = None, *,
         progress: Callable[[int], None] | None = None) -> PullResult | JobPullResult:
    """Restore the newest valid remote HEAD of ``url`` into the directory ``path`` (created if
    needed; empty, or a copy of the same store that no writer holds): a remote job store's (job
    HEADs under ``jobheads/``) whole, else a single store's. JobStreamError for a directory
    inside a job store, before any client is made."""
    refuse_job_part(os.fspath(path), "a pull into it")
    client_opts, _ = split_options(options)
    if is_remote_job(ObjectStore(url, client_opts)):
        return pull_job(url, path, options, progress=progress)
    return pull_store(url, path, options, progress=progress)


def verify_remote(url: str, options: dict | None = None, *, local: str | os.PathLike | None = None,
                  progress: Callable[[int], None] | None = None
                  ) -> RemoteFsckReport | JobFsckReport:
    """fsck of the remote copy at ``url`` (``ckptstore fsck s3://...``): a remote job store's
    (job HEADs under ``jobheads/``: :func:`~.job_fsck.verify_job`, every object the newest valid
    job HEAD names, its streams' included, problems named with their rank) or else a single
    store's (:func:`~.restore.verify_store`). With ``local``, also compared with that local
    store: whether the copy is older, and the bytes of every object it names
    (:mod:`.job_compare`, for both kinds: ``report.differs``)."""
    client_opts, _ = split_options(options)
    if is_remote_job(ObjectStore(url, client_opts)):
        return verify_job(url, options, progress=progress,
                          local=None if local is None else os.fspath(local))
    report = verify_store(url, options, progress=progress)
    if local is not None and report.head is not None:
        compare_store(report, ObjectStore(url, client_opts), os.fspath(local))
    return report
