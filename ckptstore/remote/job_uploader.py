"""The background remote tier of a job store's writer ranks (format-spec/remote.md §8.3).

``ckptstore.open(path, "a", process_group=pg, remote="s3://...", remote_options={...})``:

1. every rank opens its own stream with the single store's :class:`~.uploader.Uploader` on the
   stream's prefix (:func:`stream_url`): each rank uploads its own stream, after its own commits,
   at most once per ``head_interval``; its remote gc keeps the stream HEADs that kept job HEADs
   pin (:func:`stream_pins`, asked at each gc);
2. rank 0 runs a :class:`JobHeadUploader`: every ``head_interval`` it reads the job's global logs
   and the newest HEAD each rank's uploader wrote (older epochs' streams, closed, it uploads
   itself), and writes a job HEAD for the cut those stream HEADs cover
   (:class:`~.job_push.JobReplicator`, the code path of a push): the global log's commits are
   uploaded after the streams they name;
3. at close every rank flushes its stream's uploader, the ranks meet, and rank 0 writes the final
   job HEAD (:meth:`JobHeadUploader.finish`).

Failures never reach training: they are logged and kept (:attr:`JobHeadUploader.error`), and the
next round re-reads the remote.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..errors import RemoteError
from .client import ObjectStore, parse_url
from .job_head import JobHead, list_job_heads, read_job_head, stream_url
from .job_push import JobReplicator
from .head import head_name
from .replicate import split_options

log = logging.getLogger("ckptstore")


def stream_pins(root: ObjectStore, keep_heads: int, epoch: int, rank: int) -> frozenset[int]:
    """The generations of stream (epoch, rank)'s HEADs that the newest ``keep_heads`` valid job
    HEADs pin (J4: the stream's remote gc keeps them)."""
    out: set[int] = set()
    valid = 0
    for g in list_job_heads(root.list_objects("jobheads/")):
        try:
            h = read_job_head(root, g)
        except RemoteError:
            continue  # damaged, or collected since the listing
        ref = h.stream(epoch, rank)
        if ref is not None:
            out.add(ref.generation)
        valid += 1
        if valid >= keep_heads:
            break
    return frozenset(out)


class JobHeadUploader:
    """Rank 0's thread writing job HEADs while the job trains (module docstring, 2)."""

    def __init__(self, path: str, url: str, options: dict | None, epoch: int) -> None:
        client_opts, self.opts = split_options(options)
        self.path = path
        self.rep = JobReplicator(ObjectStore(url, client_opts), client_opts, self.opts)
        self.rep.live_epoch = epoch
        #: the newest job HEAD written or found, the last round's failure (None: it succeeded)
        self.head: JobHead | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one sync at a time
        self._thread = threading.Thread(target=self._run, name=f"ckptstore-remote-job {url}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.opts.head_interval):
            self.sync_once()

    def sync_once(self) -> JobHead | None:
        """One round: a job HEAD for the newest cut the remote stream HEADs cover; then check
        that the live streams' HEADs it pins are still there (a rank's gc could have collected
        one between this round's reading and its job HEAD: then a second round names newer
        ones). A failure is logged and kept, never raised."""
        with self._lock:
            try:
                for _ in range(2):
                    self.head = self.rep.sync(self.path)
                    if all(self.rep.streams[(s.epoch, s.rank)].store.size(head_name(s.generation))
                           is not None for s in self.head.streams
                           if (s.epoch, s.rank) in self.rep.streams):
                        break
                if self.error is not None:
                    log.info("ckptstore: the job's remote copy %s is written again",
                             self.rep.root.where)
                self.error = None
            except Exception as e:  # noqa: BLE001 - never raised into training
                if self.error is None:
                    log.warning("ckptstore: the job's remote copy %s: %s (retried)",
                                self.rep.root.where, e)
                self.error = e
                self.rep.loaded = False  # re-read the remote next time
            return self.head

    def finish(self, timeout: float | None = None) -> JobHead | None:
        """Stop the thread, then write the final job HEAD (the ranks flushed their streams)."""
        self._stop.set()
        self._thread.join(self.opts.close_timeout if timeout is None else timeout)
        t0 = time.monotonic()
        head = self.sync_once()
        log.debug("ckptstore: final job HEAD in %.3f s", time.monotonic() - t0)
        return head

    def stop(self) -> None:
        self._stop.set()


class JobRemote:
    """What a job store's writer rank holds of the remote tier (module docstring): the options
    its stream opens with, rank 0's :class:`JobHeadUploader`, the close protocol."""

    def __init__(self, url: str, options: dict | None) -> None:
        client_opts, self.opts = split_options(options)  # (a bad option fails the open)
        self.url = str(parse_url(url))
        self.options = dict(options or {})
        self.root = ObjectStore(url, client_opts)
        self.job: JobHeadUploader | None = None

    def stream_options(self, epoch: int, rank: int) -> dict:
        """The keywords of rank ``rank``'s stream Store for ``epoch``: its own uploader."""
        return {"remote": stream_url(self.url, epoch, rank), "remote_options": self.options}

    def started(self, path: str, epoch: int, rank: int, stream: Any) -> None:
        """After the epoch's streams opened: the stream's gc learns the pins; rank 0 starts (or,
        after a job gc's new epoch, retargets) the job HEAD thread."""
        uploader = stream.uploader
        if uploader is not None:
            keep = self.opts.keep_heads
            uploader.rep.pins = lambda: stream_pins(self.root, keep, epoch, rank)
        if rank != 0:
            return
        if self.job is None:
            self.job = JobHeadUploader(path, self.url, self.options, epoch)
        else:
            self.job.rep.live_epoch = epoch

    def finish(self, stream: Any, group: Any, rank: int) -> None:
        """At close (collective): flush this rank's stream copy, meet, then rank 0 writes the
        final job HEAD. Remote failures are logged, never raised (the local store is intact)."""
        if stream is not None and not stream.closed and stream.uploader is not None:
            try:
                stream.remote_flush(self.opts.close_timeout)
            except RemoteError as e:
                log.warning("ckptstore: rank %d's stream copy may lag at close: %s", rank, e)
        group.all_gather(b"", "the remote copy's close")
        if self.job is not None:
            self.job.finish()

    def stop(self) -> None:
        if self.job is not None:
            self.job.stop()
