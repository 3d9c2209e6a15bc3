"""The remote tier: a copy of a single-writer store in an S3-compatible object store that
outlives the machine (format-spec/remote.md).

* :func:`push` -- upload a store's committed state (a catch-up; resumes an interrupted upload);
* :class:`Uploader` -- the writer's background uploader (``ckptstore.open(path, "a",
  remote="s3://bucket/run", remote_options={...})``), the same code path after every commit,
  rate-limited to one HEAD per ``head_interval`` seconds and ``bandwidth`` bytes/s;
* :func:`pull` -- restore the newest remote HEAD into a local directory (``ckptstore pull``;
  ``ckptstore.open("s3://...", mode="r", cache_dir=DIR)``);
* :func:`~ckptstore.remote.reader.open_remote` -- ``ckptstore.open("s3://...", mode="r")``: a
  lazy reader that fetches STORE, the HEAD and its index object, then only the byte ranges a
  load reads (:class:`RemoteReadStats` says how many bytes);
* :func:`verify_remote` -- fsck of the remote copy (a job's: every object its newest job HEAD
  names, problems named with their rank).

Multi-rank job stores (format-spec/remote.md §8): :func:`push` and :func:`pull` of a job store go
through :func:`push_job` and :func:`pull_job` (each rank's stream is copied as a single store, the
global logs as extents, a job HEAD names a consistent cut); ``ckptstore.open("s3://...", "r")``
of a job pulls it whole and opens a JobStore reader; ``remote=`` with ``process_group=``
uploads while the job trains (:mod:`ckptstore.remote.job_uploader`).

Layers: above the engine (it reads a live engine's committed state under its lock), beside ops/.
"""

from .client import ObjectStore, RemoteURL, is_remote_url, parse_url
from .head import Head, IndexRef
from .replicate import PushResult, RemoteOptions, split_options
from .reader import RemoteReadStats, open_remote
from .restore import PullResult, RemoteFsckReport, newest_head, pull_for_open
from .uploader import RemoteStatus, Uploader
from .job_head import JobHead
from .job_push import JobPushResult, push_job
from .job_pull import JobPullResult, pull_job
from .job_fsck import JobFsckReport
from .transfer import pull, push, verify_remote

__all__ = ["ObjectStore", "RemoteURL", "is_remote_url", "parse_url", "Head", "IndexRef",
           "RemoteReadStats", "open_remote", "PushResult",
           "RemoteOptions", "push", "split_options", "PullResult", "RemoteFsckReport",
           "newest_head", "pull", "pull_for_open", "verify_remote", "RemoteStatus", "Uploader",
           "JobHead", "JobPushResult", "push_job", "JobPullResult", "pull_job", "JobFsckReport"]
